"""Benchmark: `envctl up` of a GPU environment whose CUDA toolkit is multi-gigabyte, against the
seed-style copy of the toolkit into the rootfs.

Run as root from the repository root: `python bench/rootfs_gpu_up.py [--runs 5]`
(`--smoke`: the suite's tiny run).
Each run uses a fresh sandbox (the integration tests' throwaway net + mount namespace) and the
fake GPU host of tests/integration/test_gpu_env.py (mknod'ed nodes, fake /proc, fake NVML,
fake driver libraries in a fake ld.so.cache). The toolkit is a tree of sparse files of the
given total size. envctl bind-mounts the toolkit read-only into the environment's mount
namespace, so `up` should take the same time whatever its size; the seed script copied it
(`cp -a`), which for a real (not sparse) toolkit writes every byte: the copy is timed with
`--sparse=never` so that it writes what a real toolkit would. Prints medians and ratios;
asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import precompile  # noqa: E402
from tests.integration.sandbox import Sandbox  # noqa: E402
from tests.integration.test_gpu_env import fake_gpu_host  # noqa: E402

GIB = 1 << 30
FILES = 64  # the toolkit's size is spread over this many files (plus a few directories)

SPEC = """name: gpu-bench
kind: gpu
rootfs:
  binaries: [bash, ls, cat]
gpus: {{count: 1, toolkit: {toolkit}}}
"""


def make_toolkit(root: Path, size: int) -> Path:
    toolkit = root / "cuda"
    for sub in ("bin", "lib64", "include", "nvvm/lib64"):
        (toolkit / sub).mkdir(parents=True)
    for i in range(FILES):
        sub = ("lib64", "bin", "include", "nvvm/lib64")[i % 4]
        with open(toolkit / sub / f"part{i:03d}", "wb") as f:
            f.truncate(size // FILES)  # sparse: no blocks written
    return toolkit


def timed(sb: Sandbox, *argv: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    res = sb.envctl(*argv, env=env)
    took = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"envctl {' '.join(argv)} failed:\n{res.stderr}")
    return took


def envctl_up(size: int) -> tuple[float, float]:
    """(up seconds, down seconds) on a fresh sandbox."""
    with tempfile.TemporaryDirectory(prefix="envctl-bench-", dir="/var/tmp") as tmp:
        sb = Sandbox(Path(tmp) / "sb")
        try:
            env = fake_gpu_host(Path(tmp) / "gpuroot")
            toolkit = make_toolkit(Path(tmp), size)
            sb.write_spec("gpu-bench", SPEC.format(toolkit=toolkit))
            up = timed(sb, "up", "gpu-bench", "--json", env=env)
            down = timed(sb, "down", "gpu-bench", "--json", env=env)
            if sb.residue():
                raise SystemExit(f"residue after down: {sb.residue()}")
            return up, down
        finally:
            sb.close()


def seed_copy(size: int) -> float:
    """The seed's way: copy the toolkit into the environment's rootfs."""
    with tempfile.TemporaryDirectory(prefix="envctl-bench-", dir="/var/tmp") as tmp:
        toolkit = make_toolkit(Path(tmp), size)
        dest = Path(tmp) / "rootfs" / "usr" / "local"
        dest.mkdir(parents=True)
        start = time.perf_counter()
        subprocess.run(["cp", "-a", "--sparse=never", str(toolkit), str(dest / "cuda")],
                       check=True)
        subprocess.run(["sync", "-f", str(dest)], check=True)
        took = time.perf_counter() - start
        shutil.rmtree(dest)
        return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", default="1,4,16", help="toolkit sizes in GiB (comma-separated)")
    ap.add_argument("--copy-size", type=float, default=1.0,
                    help="GiB the seed-style copy is timed with (it writes them to disk)")
    ap.add_argument("--smoke", action="store_true", help="one run, a 1 MiB toolkit")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.sizes, args.copy_size = 1, "0.001", 0.001
    precompile()
    sizes = [float(s) for s in args.sizes.split(",")]
    print(f"toolkit of {FILES} sparse files; {args.runs} runs each, medians")
    print(f"{'toolkit':>9}  {'envctl up':>10}  {'envctl down':>11}")
    ups = {}
    for gib in sizes:
        runs = [envctl_up(int(gib * GIB)) for _ in range(args.runs)]
        ups[gib] = statistics.median(u for u, _ in runs)
        down = statistics.median(d for _, d in runs)
        print(f"{gib:>7g}G  {ups[gib]:>9.3f}s  {down:>10.3f}s")
    flat = max(ups.values()) / min(ups.values())
    print(f"largest/smallest up: {flat:.2f}x (flat in toolkit size: ~1.0)")
    copies = [seed_copy(int(args.copy_size * GIB)) for _ in range(max(1, args.runs // 2))]
    copy = statistics.median(copies)
    print(f"seed-style cp -a of a {args.copy_size:g}G toolkit: {copy:.3f}s "
          f"(~{copy / args.copy_size:.2f}s per GiB, grows with the toolkit)")
    for gib in sizes:
        est = copy / args.copy_size * gib
        print(f"  at {gib:g}G: envctl up {ups[gib]:.3f}s vs copy ~{est:.2f}s "
              f"-> {ups[gib] / est:.3f}x")


if __name__ == "__main__":
    main()
