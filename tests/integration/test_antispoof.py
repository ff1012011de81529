"""Anti-spoofing on the real kernel: root in one environment claims another's address on the
shared bridge (gratuitous ARP, its MAC, its IP) and still never gets that one's traffic.

Two environments on one bridge, each serving one forwarded port with a small server that
answers with its environment's name. Traffic goes only from the sandbox's "host" to the
environments' addresses and forwarded ports.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from envctl.plan.network import peer_mac
from tests.integration.test_network import in_ns

pytestmark = pytest.mark.root

BACKENDS = ["nftables", "iptables"]
ALPHA, BETA, GATEWAY = "10.231.0.2", "10.231.0.3", "10.231.0.1"


def spec(name: str, address: str, host_port: int, backend: str) -> str:
    # Not isolated: the environments can reach each other directly, the case spoofing is
    # easiest in.
    return f"""\
name: {name}
kind: cpu
network:
  bridge: t-br0
  bridge_address: {GATEWAY}/24
  address: {address}
  isolate: false
  ports: ['{host_port}:8080']
  firewall: {backend}
"""


NAME_SERVER = """\
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(sys.argv[1].encode())
    c.close()
"""

CLIENT = """\
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as c:
    print(c.recv(100).decode())
"""

# Root in an environment announcing `ip` as its own: a gratuitous ARP request and reply from
# the interface's MAC (or `mac`), sender and target both `ip`, to everyone.
GARP = """\
import socket, struct, sys
ifname, ip = sys.argv[1], socket.inet_aton(sys.argv[2])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((ifname, 0))
mac = bytes.fromhex(sys.argv[3].replace(":", "")) if len(sys.argv) > 3 else s.getsockname()[4]
for op, target in ((1, b"\\0" * 6), (2, b"\\xff" * 6)):
    arp = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, op, mac, ip, target, ip)
    s.send(b"\\xff" * 6 + mac + struct.pack("!H", 0x0806) + arp)
"""


def serve(sb, ns):
    proc = sb.popen("ip", "netns", "exec", ns, sys.executable, "-c", NAME_SERVER, ns)
    line = proc.stdout.readline()
    if line.strip() != "listening":
        proc.kill()
        raise AssertionError(f"server in {ns} did not start: {proc.stderr.read()}")
    return proc


def answer(sb, host, port):
    res = sb.run(sys.executable, "-c", CLIENT, host, str(port))
    return res.stdout.strip() if res.returncode == 0 else f"failed: {res.stderr[-200:]}"


def neighbour(sb, address):
    out = sb.run("ip", "-j", "neigh", "show", address, "dev", "t-br0", check=True).stdout
    entries = json.loads(out)
    return entries[0].get("lladdr") if entries else None


def dropped(sb):
    """Frames envctl's anti-spoofing rules dropped so far (0 when there are none)."""
    res = sb.run("nft", "-j", "list", "table", "bridge", "envctl")
    if res.returncode != 0:
        return 0
    total = 0
    for item in json.loads(res.stdout)["nftables"]:
        for expr in item.get("rule", {}).get("expr", []):
            if "counter" in expr:
                total += expr["counter"]["packets"]
    return total


def mac(sb, env):
    shown = json.loads(in_ns(sb, env, "ip", "-j", "link", "show", "eth0", check=True).stdout)
    return shown[0]["address"]


def spoofed_or_dropped(sb, alpha_mac, before):
    """Wait until the host either took the spoof (its neighbour entry for alpha changed) or
    envctl's rules dropped it, so the checks after it never depend on timing."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if neighbour(sb, ALPHA) != alpha_mac or dropped(sb) > before:
            return
        time.sleep(0.05)
    raise AssertionError("the spoofed frames were neither taken nor dropped")


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_environment_cannot_take_anothers_address(clean, backend):
    sb = clean
    sb.write_spec("alpha", spec("alpha", ALPHA, 9090, backend))
    sb.write_spec("beta", spec("beta", BETA, 9091, backend))
    sb.envctl("up", "alpha", "beta", check=True)
    # Each peer carries the MAC derived from its environment's name, locally administered.
    alpha_mac = mac(sb, "alpha")
    assert [alpha_mac, mac(sb, "beta")] == [peer_mac("alpha"), peer_mac("beta")]
    assert alpha_mac != mac(sb, "beta") and alpha_mac.startswith("02:")
    servers = [serve(sb, "alpha"), serve(sb, "beta")]
    try:
        assert answer(sb, ALPHA, 8080) == "alpha" and answer(sb, BETA, 8080) == "beta"
        assert answer(sb, GATEWAY, 9090) == "alpha" and answer(sb, GATEWAY, 9091) == "beta"
        assert neighbour(sb, ALPHA) == alpha_mac

        # Root in beta claims alpha's address: adds it, announces it with beta's own MAC...
        in_ns(sb, "beta", "ip", "addr", "add", f"{ALPHA}/24", "dev", "eth0", check=True)
        before = dropped(sb)
        in_ns(sb, "beta", sys.executable, "-c", GARP, "eth0", ALPHA, check=True)
        spoofed_or_dropped(sb, alpha_mac, before)
        assert neighbour(sb, ALPHA) == alpha_mac
        assert answer(sb, ALPHA, 8080) == "alpha"
        assert answer(sb, GATEWAY, 9090) == "alpha"

        # ... then takes alpha's MAC as well and announces again.
        in_ns(sb, "beta", "ip", "link", "set", "eth0", "address", alpha_mac,
              check=True)
        before = dropped(sb)
        in_ns(sb, "beta", sys.executable, "-c", GARP, "eth0", ALPHA, check=True)
        spoofed_or_dropped(sb, alpha_mac, before)
        assert neighbour(sb, ALPHA) == alpha_mac
        assert answer(sb, ALPHA, 8080) == "alpha"
        assert answer(sb, GATEWAY, 9090) == "alpha"
        fdb = sb.run("bridge", "-j", "fdb", "show", "br", "t-br0", check=True).stdout
        ports = {e["ifname"] for e in json.loads(fdb) if e.get("mac") == alpha_mac}
        assert ports <= {next(n for n in sb.links() if n.startswith("ve-alpha"))}
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()

    # beta's MAC was changed by hand: reported as drift of beta's veth, and repaired.
    veth = {s["kind"]: s for s in sb.envctl_json("status", "beta")[0]["steps"]}["veth"]
    assert veth["status"] == "drifted"
    assert any(d["field"] == "peer mac" for d in veth["diffs"]), veth
    sb.envctl("up", "beta", check=True)
    assert mac(sb, "beta") == peer_mac("beta")
    assert {s["status"] for s in sb.envctl_json("status", "beta")[0]["steps"]} == {"ok"}

    sb.envctl("down", "--all", check=True)
    assert sb.nft_tables() == []


def test_anti_spoofing_rules_are_reported_and_repaired(clean):
    sb = clean
    sb.write_spec("alpha", spec("alpha", ALPHA, 9090, "nftables"))
    sb.envctl("up", "alpha", check=True)
    out = json.loads(sb.run("nft", "-j", "list", "chain", "bridge", "envctl", "prerouting",
                            check=True).stdout)
    rules = [i["rule"] for i in out["nftables"] if "rule" in i]
    assert len(rules) == 5 and all(r["comment"].startswith("envctl:alpha antispoof ")
                                   for r in rules)
    arp = next(r for r in rules if "arp saddr ip" in r["comment"])
    sb.run("nft", "delete", "rule", "bridge", "envctl", "prerouting", "handle",
           str(arp["handle"]), check=True)

    def antispoof():
        return {s["kind"]: s for s in sb.envctl_json("status", "alpha")[0]["steps"]}["antispoof"]

    step = antispoof()
    assert step["status"] == "drifted"
    assert [(d["want"], d["have"]) for d in step["diffs"]] == [(arp["comment"], "missing")]
    sb.envctl("up", "alpha", check=True)
    assert {s["status"] for s in sb.envctl_json("status", "alpha")[0]["steps"]} == {"ok"}
    # All of them gone (the chain flushed): missing, and made again.
    sb.run("nft", "flush", "chain", "bridge", "envctl", "prerouting", check=True)
    assert antispoof()["status"] == "missing"
    sb.envctl("up", "alpha", check=True)
    assert antispoof()["status"] == "ok"
    sb.envctl("down", "alpha", check=True)
