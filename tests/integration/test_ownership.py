"""Ownership on the real kernel: what envctl finds is kept, what it changes is given back, and
read-only commands and the iptables backend leave others' state (tables, the xtables lock) be.

Each test runs in its own sandbox; traffic, if any, stays inside namespaces the test made.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import stat
import sys
import threading
import time

import pytest

from envctl.spec.naming import host_veth
from tests.integration.sandbox import Sandbox
from tests.integration.test_network import in_ns, iptables_residue, spec

pytestmark = pytest.mark.root

BACKENDS = ["nftables", "iptables"]


def steps(sb, *args):
    """The steps of one environment's plan or status, by kind (and by key)."""
    out = {}
    for s in sb.envctl_json(*args)[0]["steps"]:
        out.setdefault(s["kind"], s)
        out[s["key"]] = s
    return out


def nft_table(sb, family="inet", name="envctl"):
    """{"chains": {name: hook or None}, "rules": {chain: [comment]}, "other": [kind name]}, or
    None when there is no such table."""
    res = sb.run("nft", "-j", "list", "table", family, name)
    if res.returncode != 0:
        return None
    out = {"chains": {}, "rules": {}, "other": []}
    for item in json.loads(res.stdout)["nftables"]:
        (what, body), = item.items()
        if what == "chain":
            out["chains"][body["name"]] = body.get("hook")
        elif what == "rule":
            out["rules"].setdefault(body["chain"], []).append(body.get("comment", ""))
        elif what not in ("metainfo", "table"):
            out["other"].append(f"{what} {body['name']}")
    return out


# ---------------------------------------------------------------- links


def test_a_veth_under_the_derived_name_is_refused_and_never_deleted(clean):
    sb = clean
    veth = host_veth("alpha")
    sb.run("ip", "link", "add", veth, "type", "veth", "peer", "name", "t-theirs", check=True)
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    step = steps(sb, "plan", "alpha")["veth"]
    assert step["op"] == "!" and "did not make" in step["note"], step
    res = sb.envctl("up", "alpha")
    assert res.returncode == 1, res.stderr
    assert veth in res.stderr and "did not make" in res.stderr
    # Rolled back: the namespace and the bridge went, the foreign pair stayed as it was.
    assert sb.links() == sorted([veth, "t-theirs"]) and sb.netns() == []
    sb.envctl("down", "alpha", check=True)
    assert sb.links() == sorted([veth, "t-theirs"])
    sb.run("ip", "link", "del", veth, check=True)


def test_a_bridge_that_was_down_is_set_down_again(clean):
    sb = clean
    sb.run("ip", "link", "add", "t-br0", "type", "bridge", check=True)
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    sb.envctl("up", "alpha", check=True)
    assert ",UP" in sb.run("ip", "link", "show", "t-br0", check=True).stdout
    note = steps(sb, "plan", "--down", "alpha")["bridge"]["note"]
    assert "kept: it existed before envctl" in note and "set down again" in note
    sb.envctl("down", "alpha", check=True)
    shown = sb.run("ip", "link", "show", "t-br0", check=True).stdout
    assert ",UP" not in shown and "state DOWN" in shown
    assert "10.231.0.1" not in sb.run("ip", "addr", "show", "t-br0", check=True).stdout
    sb.run("ip", "link", "del", "t-br0", check=True)


def test_an_adopted_namespace_gets_its_lo_and_default_route_back(clean):
    sb = clean
    sb.run("ip", "netns", "add", "alpha", check=True)
    in_ns(sb, "alpha", "ip", "link", "add", "t-dummy", "type", "veth", "peer", "name", "t-dummy2",
          check=True)
    in_ns(sb, "alpha", "ip", "addr", "add", "192.0.2.2/24", "dev", "t-dummy", check=True)
    in_ns(sb, "alpha", "ip", "link", "set", "t-dummy", "up", check=True)
    in_ns(sb, "alpha", "ip", "route", "add", "default", "via", "192.0.2.1", check=True)

    def routes():
        out = in_ns(sb, "alpha", "ip", "-j", "route", "show", "default", check=True).stdout
        return [(r.get("gateway"), r.get("dev")) for r in json.loads(out)]

    def lo_up():
        return ",UP" in in_ns(sb, "alpha", "ip", "link", "show", "lo", check=True).stdout

    assert not lo_up() and routes() == [("192.0.2.1", "t-dummy")]
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    sb.envctl("up", "alpha", check=True)
    assert lo_up() and routes() == [("10.231.0.1", "eth0")]
    note = steps(sb, "plan", "--down", "alpha")["netns"]["note"]
    assert "kept: it existed before envctl" in note
    assert "lo set down again" in note and "default route via 192.0.2.1 restored" in note
    sb.envctl("down", "alpha", check=True)
    assert sb.netns() == ["alpha"]
    assert not lo_up() and routes() == [("192.0.2.1", "t-dummy")]
    # The operator's network changes while the environment is up: the old gateway's device
    # goes. `down` cannot give the route back, and must not fail forever trying.
    sb.envctl("up", "alpha", check=True)
    in_ns(sb, "alpha", "ip", "link", "del", "t-dummy", check=True)
    sb.envctl("down", "alpha", check=True)
    assert sb.netns() == ["alpha"] and routes() == [] and not lo_up()
    sb.run("ip", "netns", "del", "alpha", check=True)


def test_an_adopted_namespace_with_the_peers_name_taken_is_refused(clean):
    sb = clean
    sb.run("ip", "netns", "add", "alpha", check=True)
    in_ns(sb, "alpha", "ip", "link", "add", "eth0", "type", "veth", "peer", "name", "t-x",
          check=True)
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    plan = steps(sb, "plan", "alpha")
    veth = next(s for k, s in plan.items() if k.startswith("veth"))
    assert veth["op"] == "!" and "already has an interface 'eth0'" in veth["note"]
    res = sb.envctl("up", "alpha")
    assert res.returncode == 1 and "already has an interface 'eth0'" in res.stderr
    assert in_ns(sb, "alpha", "ip", "link", "show", "eth0").returncode == 0  # untouched
    sb.run("ip", "netns", "del", "alpha", check=True)


# ---------------------------------------------------------------- directories


def test_a_directory_that_existed_gets_its_mode_back(clean):
    sb = clean
    mine = sb.state / "envs" / "alpha"
    mine.mkdir(parents=True)
    os.chmod(mine, 0o700)
    (mine / "data").write_text("the user's\n")
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    sb.envctl("up", "alpha", check=True)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755
    note = steps(sb, "plan", "--down", "alpha")["dir:state:envs/alpha"]["note"]
    assert "kept: it existed before envctl" in note and "mode 0755 -> 0700" in note
    sb.envctl("down", "alpha", check=True)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    assert (mine / "data").read_text() == "the user's\n"
    shutil.rmtree(sb.state)  # the kept directory, and the state directory it kept


@pytest.mark.parametrize("order", [("alpha", "beta"), ("beta", "alpha")])
def test_the_run_base_goes_with_the_last_environment_in_any_order(clean, order):
    sb = clean
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    sb.write_spec("beta", spec("beta", "10.231.0.3", backend="nftables", ports="[9091]"))
    sb.envctl("up", "alpha", check=True)
    sb.envctl("up", "beta", check=True)
    assert sorted(os.listdir(sb.run_dir)) == ["alpha", "beta"]
    sb.envctl("down", order[0], check=True)
    assert os.listdir(sb.run_dir) == [order[1]]
    sb.envctl("down", order[1], check=True)
    assert not sb.run_dir.exists()


def test_a_run_base_that_existed_is_kept(clean):
    sb = clean
    sb.run_dir.mkdir()
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    sb.envctl("up", "alpha", check=True)
    sb.envctl("down", "alpha", check=True)
    assert sb.run_dir.is_dir() and os.listdir(sb.run_dir) == []
    sb.run_dir.rmdir()


# ---------------------------------------------------------------- /run/netns


@pytest.fixture
def bare(tmp_path):
    """A sandbox whose /run/netns is a plain directory, not a mount point (a host where no
    namespace was ever added), with the residue check (mounts there included) at the end."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    sb = Sandbox(tmp_path, netns_mounted=False)
    try:
        yield sb
        assert sb.residue() == {}, "residue left behind"
    finally:
        sb.close()


def test_the_netns_directory_mount_goes_with_the_last_environment(bare):
    sb = bare
    assert not sb.is_mount_point("/run/netns")
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    sb.write_spec("beta", spec("beta", "10.231.0.3", backend="nftables", ports="[9091]"))
    sb.envctl("up", "alpha", check=True)
    # As iproute2: the directory is bind-mounted onto itself and made shared.
    assert sb.is_mount_point("/run/netns")
    sb.envctl("up", "beta", check=True)
    sb.envctl("down", "alpha", check=True)
    assert sb.is_mount_point("/run/netns")  # beta's namespace lives there
    # beta's own namespace goes before the mount does: nothing keeps it.
    assert steps(sb, "plan", "--down", "beta")["netns-dir"]["note"] == ""
    sb.envctl("down", "beta", check=True)
    assert not sb.is_mount_point("/run/netns")
    assert sb.netns() == []


def test_the_netns_directory_mount_stays_while_someone_elses_namespace_is_in_it(bare):
    sb = bare
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    sb.envctl("up", "alpha", check=True)
    sb.run("ip", "netns", "add", "theirs", check=True)
    note = steps(sb, "plan", "--down", "alpha")["netns-dir"]["note"]
    assert "kept" in note and "theirs" in note
    sb.envctl("down", "alpha", check=True)
    assert sb.is_mount_point("/run/netns") and sb.netns() == ["theirs"]
    sb.run("ip", "netns", "del", "theirs", check=True)
    sb.run("umount", "/run/netns", check=True)


def test_a_netns_directory_that_was_mounted_is_left_mounted(bare):
    sb = bare
    sb.run("ip", "netns", "add", "theirs", check=True)  # iproute2 mounts it first
    sb.run("ip", "netns", "del", "theirs", check=True)
    assert sb.is_mount_point("/run/netns")
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    sb.envctl("up", "alpha", check=True)
    sb.envctl("down", "alpha", check=True)
    assert sb.is_mount_point("/run/netns")
    sb.run("umount", "/run/netns", check=True)


# ---------------------------------------------------------------- firewall tables and chains


def test_an_nft_table_that_existed_keeps_its_content(clean):
    sb = clean
    sb.run("nft", "add", "table", "inet", "envctl", check=True)
    sb.run("nft", "add", "set", "inet", "envctl", "blocked", "{ type ipv4_addr; }", check=True)
    sb.run("nft", "add", "chain", "inet", "envctl", "mine", check=True)
    sb.run("nft", "add", "rule", "inet", "envctl", "mine", "counter", check=True)
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    sb.write_spec("beta", spec("beta", "10.231.0.3", backend="nftables", ports="[9091]"))
    sb.envctl("up", "alpha", "beta", check=True)
    assert set(nft_table(sb)["chains"]) == {"mine", "prerouting", "output", "postrouting",
                                            "forward", "raw-prerouting"}
    sb.envctl("down", "alpha", check=True)
    note = steps(sb, "plan", "--down", "beta")["firewall-base:nftables"]["note"]
    assert "kept: table inet envctl existed before envctl" in note
    sb.envctl("down", "beta", check=True)
    # Only the base chains envctl added went; the table, its set, chain and rule stayed.
    assert nft_table(sb) == {"chains": {"mine": None}, "rules": {"mine": [""]},
                             "other": ["set blocked"]}
    sb.run("nft", "delete", "table", "inet", "envctl", check=True)


def test_content_added_to_envctls_nft_table_is_never_deleted(clean):
    sb = clean
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    sb.envctl("up", "alpha", check=True)
    # The operator adds a rule of their own to envctl's forward chain, and a set.
    sb.run("nft", "add", "rule", "inet", "envctl", "forward", "ip", "daddr", "192.0.2.9",
           "drop", check=True)
    sb.run("nft", "add", "set", "inet", "envctl", "theirs", "{ type ipv4_addr; }", check=True)
    note = steps(sb, "plan", "--down", "alpha")["firewall-base:nftables"]["note"]
    assert "kept" in note and "set theirs" in note and "forward" in note
    sb.envctl("down", "alpha", check=True)
    assert nft_table(sb) == {"chains": {"forward": "forward"}, "rules": {"forward": [""]},
                             "other": ["set theirs"]}
    sb.run("nft", "delete", "table", "inet", "envctl", check=True)


def test_an_nft_base_chain_of_another_shape_is_refused(clean):
    sb = clean
    sb.run("nft", "add", "table", "inet", "envctl", check=True)
    sb.run("nft", "add", "chain", "inet", "envctl", "forward",
           "{ type filter hook forward priority 10; policy drop; }", check=True)
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="nftables"))
    step = steps(sb, "plan", "alpha")["firewall-base:nftables"]
    assert step["op"] == "!" and "forward" in step["note"]
    res = sb.envctl("up", "alpha")
    assert res.returncode == 1 and "priority 10 policy drop" in res.stderr, res.stderr
    assert nft_table(sb) == {"chains": {"forward": "forward"}, "rules": {}, "other": []}
    assert sb.residue() == {"nft": ["inet envctl"]}
    sb.run("nft", "delete", "table", "inet", "envctl", check=True)


def test_iptables_chains_and_jumps_envctl_did_not_make_are_kept(clean):
    sb = clean
    legacy = ("iptables-legacy",)
    # The operator's own ENVCTL-FORWARD, with a rule of theirs and a conditional jump to it.
    sb.run(*legacy, "-N", "ENVCTL-FORWARD", check=True)
    sb.run(*legacy, "-A", "ENVCTL-FORWARD", "-s", "192.0.2.7", "-j", "DROP", check=True)
    sb.run(*legacy, "-A", "FORWARD", "-i", "t-uplink", "-j", "ENVCTL-FORWARD", check=True)
    # And an unconditional jump of theirs to a chain envctl will make.
    sb.run(*legacy, "-t", "nat", "-N", "ENVCTL-OUTPUT", check=True)
    sb.run(*legacy, "-t", "nat", "-A", "OUTPUT", "-j", "ENVCTL-OUTPUT", check=True)
    before = {t: _legacy_rules(sb, t) for t in ("filter", "nat")}
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="iptables"))
    sb.write_spec("beta", spec("beta", "10.231.0.3", backend="iptables", ports="[9091]"))
    sb.envctl("up", "alpha", "beta", check=True)
    assert "-A FORWARD -m comment --comment \"envctl: jump\" -j ENVCTL-FORWARD" in \
        _legacy_rules(sb, "filter")
    sb.envctl("down", "alpha", check=True)
    sb.envctl("down", "beta", check=True)
    after = {t: _legacy_rules(sb, t) for t in ("filter", "nat")}
    assert after == before
    chains = sb.run(*legacy + ("-S",), check=True).stdout + \
        sb.run(*legacy, "-t", "nat", "-S", check=True).stdout
    assert "-N ENVCTL-FORWARD" in chains and "-N ENVCTL-OUTPUT" in chains
    assert "ENVCTL-PREROUTING" not in chains and "ENVCTL-POSTROUTING" not in chains
    sb.run(*legacy, "-F", "FORWARD", check=True)
    sb.run(*legacy, "-F", "ENVCTL-FORWARD", check=True)
    sb.run(*legacy, "-X", "ENVCTL-FORWARD", check=True)
    sb.run(*legacy, "-t", "nat", "-F", "OUTPUT", check=True)
    sb.run(*legacy, "-t", "nat", "-X", "ENVCTL-OUTPUT", check=True)
    assert iptables_residue(sb) == []


def _legacy_rules(sb, table):
    out = sb.run("iptables-legacy-save", "-t", table, check=True).stdout
    return [line for line in out.splitlines() if line.startswith("-A")]


# ---------------------------------------------------------------- the xtables lock


def test_an_iptables_change_waits_for_the_xtables_lock(clean):
    sb = clean
    lockfile = sb.root / "xtables.lock"
    env = {"XTABLES_LOCKFILE": str(lockfile)}
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend="iptables"))
    fd = os.open(lockfile, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as `iptables -w` holding it
        proc = sb.popen(sys.executable, "-m", "envctl", "up", "alpha", env=env)
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            for line in proc.stderr:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        seen, deadline = [], time.monotonic() + 60
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"envctl ended without waiting: {''.join(seen)}"
            seen.append(line)
            if "waiting for the xtables lock" in line:
                break
        # Still waiting: nothing of envctl's is in the tables yet.
        assert proc.poll() is None and iptables_residue(sb) == []
    finally:
        os.close(fd)  # released
    proc.wait(timeout=120)
    rest = []
    while (line := lines.get(timeout=60)) is not None:
        rest.append(line)
    assert proc.returncode == 0, "".join(seen + rest)
    assert any("ENVCTL-POSTROUTING" in line for line in iptables_residue(sb))
    sb.envctl("down", "alpha", env=env, check=True)
    assert iptables_residue(sb) == []


# ---------------------------------------------------------------- read-only commands


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_only_commands_make_no_firewall_tables(clean, backend):
    sb = clean
    sb.write_spec("alpha", spec("alpha", "10.231.0.2", backend=backend))
    assert sb.ip_tables_names() == [] and sb.nft_tables() == []
    sb.envctl("validate", check=True)
    sb.envctl("plan", "alpha", check=True)
    sb.envctl("plan", "alpha", "--json", check=True)
    sb.envctl("status", "alpha")
    sb.envctl("status", "alpha", "--json")
    assert sb.ip_tables_names() == []
    assert sb.nft_tables() == []
