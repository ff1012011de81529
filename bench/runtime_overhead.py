"""Benchmark: running inside an environment (`envctl exec`) against running natively, and the
launch latency of `envctl exec` against the seed setup's `ip netns exec … unshare … chroot` line.

Run as root from the repository root: `python bench/runtime_overhead.py [--runs 7]`.
A fresh sandbox (the integration tests' throwaway net + mount namespace) holds one environment
with a rootfs (sh, true, dd and examples/matmul.c built with OpenMP) and a network namespace.
Pairs alternate (native, then inside; then the other way round) on the same CPUs, and medians
are compared:
- compute: examples/matmul.c (~3 s natively on 2 vCPUs), the seconds the program reports for the
  multiply itself (so the launch is not counted here);
- syscall-heavy: `dd bs=512 count=300000 if=/dev/zero of=/dev/null`, the seconds dd reports;
- launch: `/bin/true` as a whole process, `envctl exec ENV -- /bin/true` against the seed's
  `ip netns exec ENV unshare --mount --pid --fork chroot ROOT /bin/true`.
Prints times and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.sandbox import Sandbox  # noqa: E402

SPEC = """name: bench
kind: cpu
network: {{bridge: bench-br, bridge_address: 10.231.0.1/24, address: 10.231.0.2}}
rootfs:
  binaries: [sh, "true", dd, {matmul}]
"""


def timed(sb: Sandbox, argv: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    res = sb.run(*argv, timeout=600)
    took = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"{argv} failed ({res.returncode}):\n{res.stderr}")
    return took, res


def matmul_seconds(res: subprocess.CompletedProcess) -> float:
    return float(re.search(r"seconds=([0-9.]+)", res.stdout).group(1))


def dd_seconds(res: subprocess.CompletedProcess) -> float:
    return float(re.search(r"copied, ([0-9.e-]+) s", res.stderr).group(1))


def pairs(runs: int, native: list[str], inside: list[str], sb: Sandbox, read) -> tuple:
    nat, ins = [], []
    for i in range(runs):
        order = [(native, nat), (inside, ins)] if i % 2 == 0 else [(inside, ins), (native, nat)]
        for argv, out in order:
            _, res = timed(sb, argv)
            out.append(read(res))
    return statistics.median(nat), statistics.median(ins)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--n", type=int, default=1700, help="matrix size (about 3 s at 1700 here)")
    ap.add_argument("--launches", type=int, default=20)
    args = ap.parse_args()
    if shutil.which("gcc") is None:
        raise SystemExit("needs gcc (scripts/install-deps installs it)")
    with tempfile.TemporaryDirectory(prefix="envctl-bench-", dir="/var/tmp") as tmp:
        matmul = Path(tmp) / "matmul"
        subprocess.run(["gcc", "-O2", "-fopenmp", "-o", str(matmul),
                        str(REPO / "examples" / "matmul.c")], check=True)
        sb = Sandbox(Path(tmp) / "sb")
        try:
            sb.write_spec("bench", SPEC.format(matmul=matmul))
            up = sb.envctl("up", "bench")
            if up.returncode != 0:
                raise SystemExit(up.stderr)
            root = sb.state / "rootfs" / "bench"
            inside = [sys.executable, "-m", "envctl", "exec", "bench", "--user", "root", "--"]
            cpus = sb.run("sh", "-c", "nproc").stdout.strip()
            print(f"{cpus} CPUs; medians of {args.runs} alternating pairs "
                  f"({args.launches} for launches)")
            nat, ins = pairs(args.runs, [str(matmul), str(args.n)],
                             [*inside, str(matmul), str(args.n)], sb, matmul_seconds)
            print(f"compute  (matmul n={args.n}): native {nat:.3f} s   inside {ins:.3f} s   "
                  f"ratio {ins / nat:.3f}  (target <= 1.01)")
            dd = ["dd", "bs=512", "count=300000", "if=/dev/zero", "of=/dev/null"]
            nat, ins = pairs(args.runs, dd, [*inside, *dd], sb, dd_seconds)
            print(f"syscalls (dd bs=512 x300000): native {nat:.3f} s   inside {ins:.3f} s   "
                  f"ratio {ins / nat:.3f}  (target <= 1.02)")
            seed = ["ip", "netns", "exec", "bench", "unshare", "--mount", "--pid", "--fork",
                    "chroot", str(root), "/bin/true"]
            pairs(3, seed, [*inside, "/bin/true"], sb, lambda res: 0.0)  # warm the caches
            seed_t = statistics.median(timed(sb, seed)[0] for _ in range(args.launches))
            ours_t = statistics.median(timed(sb, [*inside, "/bin/true"])[0]
                                       for _ in range(args.launches))
            native_t = statistics.median(timed(sb, ["/bin/true"])[0]
                                         for _ in range(args.launches))
            print(f"launch /bin/true: native {native_t * 1000:.1f} ms   seed line "
                  f"{seed_t * 1000:.1f} ms   envctl exec {ours_t * 1000:.1f} ms   "
                  f"(target <= 80 ms; each through nsenter into the sandbox)")
            sb.envctl("down", "bench")
        finally:
            sb.close()


if __name__ == "__main__":
    main()
