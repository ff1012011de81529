"""Benchmark: what a seccomp filter alone costs a system call, apart from everything else a
launch does (namespaces, cgroup, mounts), and whether the profile's size matters.

Run from the repository root (no root needed: PR_SET_NO_NEW_PRIVS allows a filter):
`python bench/seccomp_cost.py [--runs 9] [--count 300000]`.
`dd bs=512 if=/dev/zero of=/dev/null` (two system calls per block) runs as a child of this
process: fork, then in the child PR_SET_NO_NEW_PRIVS, the variant's filters and execve, the
way envctl's job installs its filter. Variants, one of each per round in a rotating order:
- native: no filter;
- allow-all: a one-instruction program (`return ALLOW`);
- docker: envctl's compiled Docker default profile (runtime.seccomp: default) for root's
  default capability set, the program every job gets;
- docker x2: that program installed twice (the kernel runs every filter of the stack).
Prints per variant the median of the seconds dd reports, the median of the per-round ratios
to native with min-max, and the cost per system call in nanoseconds. If allow-all costs what
docker costs, the price is the kernel's seccomp entry on each system call (its slow path),
not the profile. `--smoke` runs one tiny round (tests/integration/test_bench_smoke.py).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from envctl import caps  # noqa: E402
from envctl.runtime import seccomp  # noqa: E402

_PR_SET_NO_NEW_PRIVS = 38
ALLOW_ALL = struct.pack("=HBBI", 0x06, 0, 0, 0x7FFF0000)  # BPF_RET|BPF_K, SECCOMP_RET_ALLOW


def run_dd(installs: list, count: int) -> float:
    """dd's own seconds for `count` blocks, in a child that installed `installs` first."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.dup2(w, 2)
            import ctypes

            ctypes.CDLL(None).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            for install in installs:
                install()
            os.execv("/bin/dd", ["dd", "bs=512", f"count={count}", "if=/dev/zero",
                                 "of=/dev/null"])
        finally:
            os._exit(127)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    m = re.search(r"copied, ([0-9.e-]+) s", err)
    if status != 0 or m is None:
        raise SystemExit(f"dd failed (status {status}): {err}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--count", type=int, default=300000)
    ap.add_argument("--smoke", action="store_true", help="one tiny round")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.count = 1, 2000
    with tempfile.TemporaryDirectory(prefix="envctl-bench-seccomp-") as cache:
        docker = seccomp.compile("default", sum(1 << caps.NUMBERS[c] for c in caps.DEFAULT),
                                 cache_dir=Path(cache))
    assert docker is not None
    variants = {
        "native": [],
        "allow-all": [seccomp.prepare(ALLOW_ALL)],
        "docker": [seccomp.prepare(docker)],
        "docker x2": [seccomp.prepare(docker), seccomp.prepare(docker)],
    }
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.runs):
        for n in names[i % len(names):] + names[:i % len(names)]:  # rotate the order
            times[n].append(run_dd(variants[n], args.count))
    calls = 2 * args.count
    print(f"dd bs=512 x{args.count} ({calls} system calls), medians of {args.runs} rounds; "
          f"docker profile: {len(docker) // 8} BPF instructions")
    base = statistics.median(times["native"])
    for n in names:
        med = statistics.median(times[n])
        ratios = [t / b for t, b in zip(times[n], times["native"], strict=True) if b > 0]
        per_call = (med - base) / calls * 1e9
        print(f"{n:10} {med:.4f} s  ratio {statistics.median(ratios):.3f} "
              f"[min-max {min(ratios):.3f}-{max(ratios):.3f}]  {per_call:+.1f} ns per call")


if __name__ == "__main__":
    main()
