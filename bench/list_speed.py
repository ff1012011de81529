"""Benchmark: `envctl list` (and `status`, for comparison) with N environments up.

Run as root from the repository root: `python bench/list_speed.py [--envs 32] [--runs 9]`.
Everything runs in a throwaway net + mount namespace (the integration tests' sandbox): N
generated partitions (a network namespace, a veth on one bridge, an address, a published port,
a cgroup with CPU, memory and pids limits, a description) are brought up with `up --all`, then
each command is timed as a whole process (interpreter start included, as an operator waits
for it), `--runs` times; the medians are printed, with `envctl --version` as the floor of any
command. Target: `list` <= 300 ms with 32 environments up. Asserts nothing; `--smoke` is the
suite's tiny run (2 environments, 1 run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import precompile  # noqa: E402
from tests.integration.sandbox import Sandbox  # noqa: E402


def write_specs(sb: Sandbox, n: int) -> None:
    for i in range(n):
        name = f"part-{i:02d}"
        sb.write_spec(name, f"name: {name}\nkind: cpu\ndescription: generated partition {i}\n"
                            "network:\n  bridge: lbench0\n  bridge_address: 10.203.0.1/24\n"
                            f"  address: 10.203.0.{10 + i}\n  ports: [\"{21000 + i}:80\"]\n"
                            "resources:\n  cpu: {quota: 50%}\n  memory: {max: 64M}\n"
                            "  pids: {max: 200}\n")


def timed(sb: Sandbox, *args: str) -> float:
    t = time.perf_counter()
    res = sb.envctl(*args, timeout=600)
    dt = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"envctl {' '.join(args)} failed:\n{res.stdout[-2000:]}\n"
                         f"{res.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--envs", type=int, default=32)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--smoke", action="store_true", help="2 environments, 1 run")
    args = ap.parse_args()
    if args.smoke:
        args.envs, args.runs = 2, 1
    precompile()
    with tempfile.TemporaryDirectory(prefix="envctl-bench-list-") as tmp:
        sb = Sandbox(Path(tmp))
        try:
            write_specs(sb, args.envs)
            timed(sb, "up", "--all", "--json")
            listed = sb.envctl_json("list")
            states = sorted({r["state"] for r in listed})
            if len(listed) != args.envs or states != ["up"]:
                raise SystemExit(f"expected {args.envs} environments up, list says "
                                 f"{[(r['name'], r['state'], r['reasons']) for r in listed]}")
            med = {}
            for label, argv in (("--version", ("--version",)), ("list", ("list",)),
                                ("list --json", ("list", "--json")), ("status", ("status",))):
                med[label] = statistics.median(timed(sb, *argv) for _ in range(args.runs))
            timed(sb, "down", "--all", "--json")
            assert sb.residue() == {}, sb.residue()
        finally:
            sb.close()
    n = args.envs
    for label, t in med.items():
        print(f"{n} environments up: envctl {label:<11} {t * 1000:6.0f} ms  (median of "
              f"{args.runs} runs)")
    print(f"{n} environments up: ratio status/list {med['status'] / med['list']:5.2f}   "
          f"list {med['list'] * 1000:.0f} ms vs target 300 ms: "
          f"{'met' if med['list'] <= 0.3 else 'MISSED'}")


if __name__ == "__main__":
    main()
