"""The engine's promises on the real kernel: crashes inside a journal fold, reboots, signals,
a full disk, damaged state, and commands that serve each environment on its own."""

from __future__ import annotations

import json
import signal
import sys
import time
import uuid

import pytest

from tests.integration.sandbox import Sandbox

pytestmark = pytest.mark.root

SPEC = """\
name: alpha
kind: cpu
network:
  bridge: t-br0
  bridge_address: 10.231.0.1/24
  address: 10.231.0.2
  ports: ["18080:80"]
host:
  sysctls:
    net.ipv4.ip_local_port_range: "20000 30000"
    vm.zone_reclaim_mode: {value: 1, policy: best-effort}
"""
ORIGINAL = ("0", "32768\t60999", "0")
CHANGED = ("1", "20000\t30000", "1")


def settings(sb):
    return (sb.sysctl("net.ipv4.ip_forward"), sb.sysctl("net.ipv4.ip_local_port_range"),
            sb.sysctl("vm.zone_reclaim_mode"))


def prepare(sb, spec=SPEC):
    sb.write_spec("alpha", spec)
    sb.set_sysctl("net.ipv4.ip_forward", "0")
    sb.set_sysctl("net.ipv4.ip_local_port_range", "'32768 60999'")
    sb.set_sysctl("vm.zone_reclaim_mode", "0")


@pytest.fixture
def alpha(sandbox):
    prepare(sandbox)
    return sandbox


def wait_for(what, predicate, proc=None, timeout=60.0):
    """Wait until `predicate()` holds; fail with the child's stderr if it died first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"envctl exited {proc.returncode} before {what}:\n"
                        f"{proc.stderr.read()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ---------------------------------------------------------------- kill -9 inside a fold


@pytest.mark.parametrize("store", ["alpha.json", "shared.json"])
def test_kill_9_at_every_point_of_the_last_fold_then_up_and_down_restore_everything(
        alpha, store):
    """`down` empties the journal and the ledger; killed after any file operation of that
    fold, the next `up` and `down` still restore every setting and leave nothing."""
    op = 0
    while True:
        alpha.envctl("up", "alpha", check=True)
        assert settings(alpha) == CHANGED
        res = alpha.envctl("down", "alpha", env={"ENVCTL_FAULT": f"kill@fold:{store}#{op}"})
        if res.returncode == 0:
            break  # the fold has fewer operations than `op`: every point was tried
        assert res.returncode == -9, res.stderr
        alpha.envctl("up", "alpha", check=True)
        alpha.envctl("down", "alpha", check=True)
        assert settings(alpha) == ORIGINAL, f"killed after operation {op} of {store}"
        assert alpha.residue() == {}, f"killed after operation {op} of {store}"
        op += 1
    assert op >= 3  # file, logs, fsync, unlink: the points of interest were reached
    assert alpha.residue() == {}


def test_kill_9_inside_the_fold_of_up_then_down(alpha):
    for op in range(3):
        res = alpha.envctl("up", "alpha", env={"ENVCTL_FAULT": f"kill@fold:alpha.json#{op}"})
        assert res.returncode == -9, res.stderr
        alpha.envctl("up", "alpha", check=True)
        alpha.envctl("down", "alpha", check=True)
        assert settings(alpha) == ORIGINAL
        assert alpha.residue() == {}


# ---------------------------------------------------------------- reboots


def fake_boot(sb, boot_id: str) -> None:
    """Make this sandbox's kernel report `boot_id` (a file bound over the proc file)."""
    f = sb.root / f"boot_id-{boot_id}"
    f.write_text(boot_id + "\n")
    sb.run("mount", "--bind", str(f), "/proc/sys/kernel/random/boot_id", check=True)


def reboot(sb: Sandbox) -> Sandbox:
    """The machine reboots: every kernel object of the sandbox goes (its namespaces, links,
    nft tables, cgroups), the state directory stays, and the kernel has a new boot id."""
    sb.close()
    after = Sandbox(sb.root)
    fake_boot(after, str(uuid.uuid4()))
    return after


def test_after_a_reboot_down_never_restores_a_memo_of_the_old_boot(sandbox, tmp_path):
    prepare(sandbox)
    fake_boot(sandbox, str(uuid.uuid4()))
    sandbox.envctl("up", "alpha", check=True)
    after = reboot(sandbox)
    try:
        # In the new boot the operator set ip_forward on purpose; the old memo says 0.
        after.set_sysctl("net.ipv4.ip_forward", "1")
        after.set_sysctl("vm.zone_reclaim_mode", "1")
        status = after.envctl_json("status", "alpha")[0]
        assert status["up"] is False  # nothing of it exists any more
        out = after.envctl("down", "alpha", check=True)
        assert "ip_forward" not in out.stdout  # nothing "restored"
        assert after.sysctl("net.ipv4.ip_forward") == "1"
        assert after.sysctl("vm.zone_reclaim_mode") == "1"
        assert after.residue() == {}
    finally:
        after.close()


def test_after_a_reboot_up_snapshots_afresh_and_down_restores_the_new_values(sandbox):
    prepare(sandbox)
    fake_boot(sandbox, str(uuid.uuid4()))
    sandbox.envctl("up", "alpha", check=True)
    after = reboot(sandbox)
    try:
        after.set_sysctl("vm.zone_reclaim_mode", "0")  # the new boot's value
        after.set_sysctl("net.ipv4.ip_local_port_range", "'40000 50000'")
        after.envctl("up", "alpha", check=True)
        status = after.envctl_json("status", "alpha")[0]
        assert {s["status"] for s in status["steps"]} == {"ok"}
        after.envctl("down", "alpha", check=True)
        assert after.sysctl("net.ipv4.ip_local_port_range") == "40000\t50000"
        assert after.sysctl("net.ipv4.ip_forward") == "0"
        assert after.residue() == {}
    finally:
        after.close()


# ---------------------------------------------------------------- signals


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_up_rolls_back_like_a_failure(alpha, sig):
    proc = alpha.popen(sys.executable, "-m", "envctl", "up", "alpha",
                       env={"ENVCTL_FAULT": "sleep60@apply:firewall:*"})
    wait_for("the firewall step", lambda: any(
        "firewall:" in p.read_text() for p in (alpha.state / "journal").glob("alpha.*.log"))
        if (alpha.state / "journal").is_dir() else False, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert f"interrupted ({sig.name})" in err and "rolled back" in err
    assert "Traceback" not in err
    assert settings(alpha) == ORIGINAL
    assert alpha.residue() == {}


# ---------------------------------------------------------------- a full disk


def test_a_full_disk_fails_cleanly_and_loses_nothing(alpha):
    # The state directory on a small tmpfs of the sandbox's own.
    alpha.state.mkdir(parents=True, exist_ok=True)
    alpha.run("mount", "-t", "tmpfs", "-o", "size=256k", "envctl-test-state", str(alpha.state),
              check=True)
    alpha.envctl("up", "alpha", check=True)
    before = alpha.run("cat", str(alpha.state / "journal" / "alpha.json"), check=True).stdout
    # Fill the disk, then change the spec: up must record a new step and cannot.
    alpha.run("sh", "-c", f"dd if=/dev/zero of={alpha.state}/filler bs=4k 2>/dev/null; true")
    alpha.write_spec("alpha", SPEC.replace('"18080:80"', '"18080:80", "18081:81"'))
    res = alpha.envctl("up", "alpha")
    assert res.returncode == 1, res.stderr
    assert "No space left on device" in res.stderr and "Traceback" not in res.stderr
    after = alpha.run("cat", str(alpha.state / "journal" / "alpha.json"), check=True).stdout
    json.loads(after)  # never replaced by a truncated file
    assert json.loads(after)["entries"] == json.loads(before)["entries"]
    alpha.run("rm", f"{alpha.state}/filler", check=True)
    alpha.envctl("down", "alpha", check=True)
    assert settings(alpha) == ORIGINAL
    alpha.run("umount", str(alpha.state), check=True)
    assert alpha.residue() == {}


# ---------------------------------------------------------------- damaged state


def test_a_damaged_journal_is_named_and_down_force_recovers(alpha):
    alpha.envctl("up", "alpha", check=True)
    journal = alpha.state / "journal" / "alpha.json"
    journal.write_text(journal.read_text()[:57])  # a disk error, a bad edit
    for cmd in (("status", "alpha"), ("up", "alpha"), ("down", "alpha")):
        res = alpha.envctl(*cmd)
        assert res.returncode == 1, (cmd, res.stderr)
        assert str(journal) in res.stderr and "down --force alpha" in res.stderr
        assert "Traceback" not in res.stderr
    res = alpha.envctl("down", "--force", "alpha")
    assert res.returncode == 0, res.stderr
    assert "kept damaged state file" in res.stderr and "found by name" in res.stderr
    assert settings(alpha) == ORIGINAL  # the ledger was intact: its memos restored
    left = alpha.residue()
    assert list(left) == ["journal", "state_dir"]  # only the damaged copy, kept
    assert [n.split(".damaged-")[0] for n in left["journal"]] == ["alpha.json"]


def test_a_damaged_ledger_is_named_and_down_force_reports_what_it_cannot_restore(alpha):
    alpha.envctl("up", "alpha", check=True)
    (alpha.state / "shared.json").write_text("{")
    res = alpha.envctl("down", "alpha")
    assert res.returncode == 1 and "shared.json" in res.stderr and "--force" in res.stderr
    res = alpha.envctl("down", "--force", "alpha")
    assert res.returncode == 0, res.stderr
    assert "left as found" in res.stderr and "sysctl" in res.stderr
    assert settings(alpha) == CHANGED  # the memos were lost: never guessed
    assert "= sysctl net.ipv4.ip_forward = 1  (left as found: its memo was lost)" in res.stdout
    left = alpha.residue()
    # What only the ledger knew envctl had made (the bridge, the firewall tables, the cgroup
    # parent) is left too, and the damaged ledger is kept for the operator.
    assert left.pop("links") == ["t-br0"]
    assert left.pop("nft") == ["bridge envctl", "inet envctl"]
    assert left.pop("cgroups")
    assert {n.split(".damaged-")[0] for n in left.pop("state_dir")} == {"lock", "shared.json"}
    assert {n.split(".damaged-")[0] for n in left.pop("journal")} == {"shared.json"}
    assert left == {}


# ---------------------------------------------------------------- each environment on its own


def test_plan_and_up_count_every_change_the_same_way(alpha):
    plan = alpha.envctl_json("plan", "alpha")[0]
    want = {op: sum(1 for s in plan["steps"] if s["op"] == op) for op in "+~=-"}
    out = alpha.envctl_json("up", "alpha")[0]
    got = {op: sum(1 for s in out["steps"] if s["op"] == op) for op in "+~=-"}
    assert got == want
    text = alpha.envctl("plan", "alpha", check=True).stdout
    assert f"{len(plan['steps'])} unchanged" in text
    alpha.envctl("down", "alpha", check=True)
    assert alpha.residue() == {}


def test_up_all_brings_up_what_the_host_can_serve_and_skips_the_rest(alpha, tmp_path):
    from tests.integration.sandbox import FakeKmod

    kmod = FakeKmod(tmp_path / "kmod", {"bridge": []})
    alpha.write_spec("gpu", "name: gpu\nkind: gpu\nhost:\n  modules: [nvidia]\n")
    res = alpha.envctl("up", "--all", env=kmod.env())
    assert res.returncode == 1, res.stderr
    assert "skipped gpu" in res.stderr and "nvidia" in res.stderr
    assert alpha.netns() == ["alpha"]
    assert settings(alpha) == CHANGED
    # A spec error still stops everything before the first change.
    alpha.envctl("down", "--all", env=kmod.env(), check=True)
    alpha.write_spec("bad", "name: bad\nkind: cpu\nresources: {memory: {max: lots}}\n")
    res = alpha.envctl("up", "--all", env=kmod.env())
    assert res.returncode == 2 and "bad.yaml" in res.stderr
    assert alpha.residue() == {}


def test_an_environment_that_is_up_keeps_its_claims_when_its_spec_is_gone(alpha):
    alpha.envctl("up", "alpha", check=True)
    # The spec is renamed: a "new" environment now asks for alpha's address and port.
    (alpha.config_dir / "alpha.yaml").unlink()
    alpha.write_spec("beta", SPEC.replace("name: alpha", "name: beta"))
    res = alpha.envctl("up", "beta")
    assert res.returncode == 2
    assert "address 10.231.0.2 is held by environment 'alpha', which is up" in res.stderr
    assert "host port tcp/18080" in res.stderr
    assert "beta" not in alpha.netns()
    alpha.envctl("down", "alpha", check=True)
    alpha.envctl("up", "beta", check=True)  # free now
    alpha.envctl("down", "beta", check=True)
    assert alpha.residue() == {}
