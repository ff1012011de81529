"""Benchmark: `envctl up --all` + `down --all` against the seed-style shell script (ip + nft).

Run as root from the repository root: `python bench/network_updown.py [--runs 5] [--n 32]`;
`--smoke` is the suite's tiny run (one paired run of each case, 2 generated partitions).
Everything runs in a throwaway net + mount namespace (the integration tests' sandbox), one
fresh sandbox per run. Runs are paired (envctl, then the script, on the same sandbox kind) and
the medians are compared. Prints times and ratios; asserts nothing.

Cases:
- the two shipped partitions (network, directories, cgroups, sysctls; the gpu-compute spec's
  nvidia modules and GPUs, and both rootfs, mounts and services, are dropped: this machine has
  no GPU, bench/rootfs_gpu_up.py measures the rootfs, and a service needs a rootfs),
  against a script that makes the same network objects;
- N generated network-only partitions (default 32) on one bridge, against the same script.
"""

from __future__ import annotations

import argparse
import ipaddress
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import precompile  # noqa: E402
from envctl.plan.network import peer_mac  # noqa: E402
from envctl.spec.naming import host_veth  # noqa: E402
from tests.integration.sandbox import Sandbox  # noqa: E402

BRIDGE, BRIDGE_CIDR = "compute-bridge", "10.200.0.1/24"


def shipped_specs() -> dict[str, tuple[str, str, list[int]]]:
    return {"cpu-compute": ("10.200.0.21", "eth0", [9090]),
            "gpu-compute": ("10.200.0.11", "eth0", [8888])}


def generated(n: int) -> dict[str, tuple[str, str, list[int]]]:
    net = ipaddress.IPv4Network("10.200.0.0/24")
    return {f"part-{i:02d}": (str(net[10 + i]), "eth0", [20000 + i]) for i in range(n)}


def write_generated(sb: Sandbox, envs: dict[str, tuple[str, str, list[int]]]) -> None:
    for name, (addr, _, ports) in envs.items():
        sb.write_spec(name, f"name: {name}\nkind: cpu\nnetwork:\n  bridge: {BRIDGE}\n"
                            f"  bridge_address: {BRIDGE_CIDR}\n  address: {addr}\n"
                            f"  ports: {ports}\n")


def write_shipped(sb: Sandbox) -> None:
    import yaml

    for f in (REPO / "configs").glob("*.yaml"):
        spec = yaml.safe_load(f.read_text())
        # No nvidia modules or GPUs on this machine: drop them (plan errors here). The rootfs
        # and its mounts are measured by bench/rootfs_gpu_up.py: a network benchmark keeps to
        # what the script makes. A service runs inside the rootfs (plan refuses one without
        # it), so it goes with it.
        spec["host"].pop("modules", None)
        for key in ("gpus", "rootfs", "mounts", "service"):
            spec.pop(key, None)
        sb.write_spec(f.stem, yaml.safe_dump(spec, sort_keys=False))


def script(envs: dict[str, tuple[str, str, list[int]]]) -> str:
    """The seed's way: one ip/nft command per object, the same objects envctl makes (with
    anti-spoofing: each port pinned to its environment's MAC, IPv4 address and ARP sender)."""
    up = ["set -e", f"ip link add {BRIDGE} type bridge", f"ip addr add {BRIDGE_CIDR} dev {BRIDGE}",
          f"ip link set {BRIDGE} up", "sysctl -qw net.ipv4.ip_forward=1",
          "nft add table inet seed",
          "nft add chain inet seed spre '{ type nat hook prerouting priority dstnat; }'",
          "nft add chain inet seed sout '{ type nat hook output priority -100; }'",
          "nft add chain inet seed spost '{ type nat hook postrouting priority srcnat; }'",
          "nft add chain inet seed sfwd '{ type filter hook forward priority filter; }'",
          "nft add table bridge seedb",
          "nft add chain bridge seedb pre '{ type filter hook prerouting priority -200; }'"]
    down = ["set -e", "nft delete table inet seed", "nft delete table bridge seedb"]
    for name, (addr, ifname, ports) in envs.items():
        veth, mac = host_veth(name), peer_mac(name)
        up += [f"ip netns add {name}",
               f"nft add rule bridge seedb pre iifname {veth} ether saddr != {mac} drop",
               f"nft add rule bridge seedb pre iifname {veth} ether type != {{ ip, arp, ip6 }} "
               "drop",
               f"nft add rule bridge seedb pre iifname {veth} arp saddr ether != {mac} drop",
               f"nft add rule bridge seedb pre iifname {veth} ip saddr != {addr} drop",
               f"nft add rule bridge seedb pre iifname {veth} arp saddr ip != {addr} drop",
               f"ip link add {veth} type veth peer name {ifname} address {mac} netns {name}",
               f"ip link set {veth} master {BRIDGE} up",
               f"ip link set {veth} type bridge_slave isolated on",
               f"ip -n {name} addr add {addr}/24 dev {ifname}",
               f"ip -n {name} link set {ifname} up",
               f"ip -n {name} link set lo up",
               f"ip -n {name} route add default via 10.200.0.1",
               f"nft add rule inet seed spost ip saddr {addr} oifname != {BRIDGE} masquerade",
               f"nft add rule inet seed sfwd iifname {BRIDGE} oifname {BRIDGE} "
               f"ip saddr {addr} ct status != dnat drop",
               f"nft add rule inet seed sfwd iifname {BRIDGE} oifname {BRIDGE} "
               f"ip daddr {addr} ct status != dnat drop"]
        for p in ports:
            up += [f"nft add rule inet seed spre fib daddr type local tcp dport {p} "
                   f"dnat ip to {addr}:{p}",
                   f"nft add rule inet seed sout fib daddr type local tcp dport {p} "
                   f"dnat ip to {addr}:{p}"]
        down += [f"ip link del {veth}", f"ip netns del {name}"]
    down += [f"ip link del {BRIDGE}", "sysctl -qw net.ipv4.ip_forward=0"]
    return "\n".join(up) + "\n" + "\n".join(down) + "\n"


def timed(sb: Sandbox, *argv: str) -> float:
    t = time.perf_counter()
    res = sb.run(*argv, timeout=600)
    dt = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"{argv[:2]} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return dt


def one_pair(case: str, n: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        sb = Sandbox(Path(tmp))
        try:
            if case == "shipped":
                write_shipped(sb)
                envs = shipped_specs()
            else:
                envs = generated(n)
                write_generated(sb, envs)
            py = sys.executable
            e = timed(sb, py, "-m", "envctl", "up", "--all", "--json")
            # Every partition made, none skipped: a benchmark of fewer is not this one.
            if sb.netns() != sorted(envs):
                raise SystemExit(f"up --all made {sb.netns()}, not {sorted(envs)}")
            e += timed(sb, py, "-m", "envctl", "down", "--all", "--json")
            assert sb.residue() == {}, sb.residue()
            s = timed(sb, "sh", "-c", script(envs))
            return e, s
        finally:
            sb.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="one paired run, 2 generated partitions")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.n = 1, 2
    precompile()
    for case, n in (("shipped", 2), ("generated", args.n)):
        pairs = [one_pair(case, n) for _ in range(args.runs)]
        e = statistics.median(p[0] for p in pairs)
        s = statistics.median(p[1] for p in pairs)
        label = "2 shipped partitions" if case == "shipped" else f"{n} partitions"
        print(f"{label:>22}: envctl up+down {e * 1000:7.0f} ms   script {s * 1000:7.0f} ms   "
              f"ratio envctl/script {e / s:5.2f}  (median of {args.runs} paired runs)", flush=True)


if __name__ == "__main__":
    main()
