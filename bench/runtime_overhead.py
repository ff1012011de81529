"""Benchmark: running inside an environment (`envctl exec`) against running natively, and the
launch latency of `envctl exec` against the seed setup's `ip netns exec … unshare … chroot` line.

Run as root from the repository root: `python bench/runtime_overhead.py [--runs 7]`.
A fresh sandbox (the integration tests' throwaway net + mount namespace) holds one environment
with a rootfs (sh, true, dd and examples/matmul.c built with OpenMP) and a network namespace.
Pairs alternate (native, then inside; then the other way round) on the same CPUs. Each case
prints the median ratio of the pairs (inside / native, each pair measured back to back, so a
slow minute of the VM slows both) with its spread beside it (min-max and the interquartile
range of the pair ratios): a ratio target is only judged where the spread is narrower than
the margin. Wall time and CPU time (user + system of the program and its children, read with
wait4 by a small runner, `cputime`, the same binary natively and inside) are both shown: on a
VM whose neighbours steal time, the noise is in the wall clock. Inside, the program runs as
every job does: its own namespaces, cgroup, pivot_root, capabilities and the environment's
seccomp filter (Docker's default profile unless `--seccomp unconfined`).
- compute: examples/matmul.c (~3 s natively on 2 vCPUs), the seconds the program reports for the
  multiply itself (so the launch is not counted here);
- syscall-heavy: `dd bs=512 count=300000 if=/dev/zero of=/dev/null`, the seconds dd reports;
- small files: a C program that walks a tree (the host's /usr/share/doc, a read-only data mount
  at /data inside: the same inodes) and stats, opens, reads and closes every file in it, 5
  times; the seconds it reports;
- NumPy: a 2000x2000 float64 matmul, where NumPy is installed for the python3 an environment
  gets (`python: true`: the first python3 in the default PATH); the environment runs that
  interpreter, with the directory NumPy is installed in as a read-only data mount;
- launch: `/bin/true` as a whole process, `envctl exec ENV -- /bin/true` against the seed's
  `ip netns exec ENV unshare --mount --pid --fork chroot ROOT /bin/true`;
- submit: `envctl submit-job ENV /bin/true` as a whole process (it returns once the job is
  RUNNING), and the record's start time minus its submit time; the same for the bare name
  `true` (the environment's own, found in its PATH, nothing staged).
Prints times and ratios; asserts nothing. `--smoke` runs every case once, tiny (the suite's
tests/integration/test_bench_smoke.py), so that the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
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

from bench.common import precompile  # noqa: E402
from tests.integration.sandbox import Sandbox  # noqa: E402

SPEC = """name: bench
kind: cpu
network: {{bridge: bench-br, bridge_address: 10.231.0.1/24, address: 10.231.0.2}}
rootfs:
  binaries: [sh, "true", dd, {matmul}, {walk}, {cputime}]
runtime: {{seccomp: {seccomp}}}
mounts:
"""
# Runs argv, then prints the CPU seconds (user + system) it and its children used: the same
# measure natively and inside, whatever envctl itself costs around it.
CPUTIME = r"""
#include <stdio.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
int main(int argc, char **argv) {
    pid_t pid = fork();
    if (pid == 0) { execvp(argv[1], argv + 1); perror(argv[1]); _exit(127); }
    int status;
    struct rusage ru;
    if (wait4(pid, &status, 0, &ru) < 0) { perror("wait4"); return 1; }
    fprintf(stderr, "cpu=%.6f\n", ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6
            + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
"""
# Walks a tree N times: lstat, open, read (4 KiB at a time), close every regular file.
WALK = r"""
#define _XOPEN_SOURCE 700
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
static long files;
static int visit(const char *path, const struct stat *st, int type, struct FTW *f) {
    if (type != FTW_F) return 0;
    char buf[4096];
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    while (read(fd, buf, sizeof buf) > 0) {}
    close(fd);
    files++;
    return 0;
}
int main(int argc, char **argv) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < atoi(argv[2]); i++) nftw(argv[1], visit, 32, FTW_PHYS);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("files=%ld seconds=%.4f\n", files,
           (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9);
    return 0;
}
"""
MOUNT = "  - {{source: {source}, target: {target}, read_only: true}}\n"
NUMPY = ("import time, numpy as np; a = np.random.rand(2000, 2000); b = np.random.rand(2000, 2000)"
         "; t = time.perf_counter(); a @ b; print(f'seconds={time.perf_counter() - t:.4f}')")


def timed(sb: Sandbox, argv: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    res = sb.run(*argv, timeout=600)
    took = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"{argv} failed ({res.returncode}):\n{res.stderr}")
    return took, res


def matmul_seconds(res: subprocess.CompletedProcess) -> float:
    """What examples/matmul.c, the walker and the NumPy case print: seconds=S."""
    return float(re.search(r"seconds=([0-9.]+)", res.stdout).group(1))


def numpy_site() -> tuple[str, str] | None:
    """(python3, the directory NumPy is installed in) for the python3 `python: true` places."""
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if python is None:
        return None
    res = subprocess.run([python, "-c", "import numpy, os; print(os.path.dirname("
                          "os.path.dirname(numpy.__file__)))"], capture_output=True, text=True)
    return (python, res.stdout.strip()) if res.returncode == 0 else None


def dd_seconds(res: subprocess.CompletedProcess) -> float:
    return float(re.search(r"copied, ([0-9.e-]+) s", res.stderr).group(1))


def cpu_seconds(res: subprocess.CompletedProcess) -> float:
    return float(re.search(r"cpu=([0-9.]+)", res.stderr).group(1))


def pairs(runs: int, native: list[str], inside: list[str], sb: Sandbox, read
          ) -> tuple[list, list]:
    """What `read` takes from each run of `runs` alternating pairs: (native, inside)."""
    nat, ins = [], []
    for i in range(runs):
        order = [(native, nat), (inside, ins)] if i % 2 == 0 else [(inside, ins), (native, nat)]
        for argv, out in order:
            _, res = timed(sb, argv)
            out.append(read(res))
    return nat, ins


def spread(nat: list[float], ins: list[float]) -> str:
    """The medians, and the median of the pair ratios (inside / native, each pair back to
    back) with min-max and the interquartile range beside it."""
    ratios = [b / a for a, b in zip(nat, ins, strict=True) if a > 0]
    head = f"native {statistics.median(nat):.3f} s   inside {statistics.median(ins):.3f} s   "
    if not ratios:
        return head + "ratio n/a"
    med = statistics.median(ratios)
    if len(ratios) < 4:
        return head + f"ratio {med:.3f} [min-max {min(ratios):.3f}-{max(ratios):.3f}]"
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return head + (f"ratio {med:.3f} [IQR {q1:.3f}-{q3:.3f}, min-max {min(ratios):.3f}-"
                   f"{max(ratios):.3f}]")


def case(label: str, target: str, runs: int, native: list[str], inside: list[str],
         sb: Sandbox, read) -> None:
    """One case run under `cputime`: wall (what the program reports) and CPU time."""
    nat, ins = pairs(runs, native, inside, sb, lambda res: (read(res), cpu_seconds(res)))
    for k, what in ((0, "wall"), (1, "cpu ")):
        print(f"{label} {what}: {spread([x[k] for x in nat], [x[k] for x in ins])}  "
              f"(target {target})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--n", type=int, default=1700, help="matrix size (about 3 s at 1700 here)")
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--dd-count", type=int, default=300000)
    ap.add_argument("--reps", type=int, default=5, help="walks of the tree per run")
    ap.add_argument("--seccomp", default="default", help="the environment's runtime.seccomp")
    ap.add_argument("--smoke", action="store_true", help="every case once, tiny")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.n, args.launches, args.dd_count, args.reps = 1, 64, 1, 1000, 1
    precompile()
    if shutil.which("gcc") is None:
        raise SystemExit("needs gcc (scripts/install-deps installs it)")
    with tempfile.TemporaryDirectory(prefix="envctl-bench-", dir="/var/tmp") as tmp:
        matmul = Path(tmp) / "matmul"
        subprocess.run(["gcc", "-O2", "-fopenmp", "-o", str(matmul),
                        str(REPO / "examples" / "matmul.c")], check=True)
        walk = Path(tmp) / "walk"
        (Path(tmp) / "walk.c").write_text(WALK)
        subprocess.run(["gcc", "-O2", "-o", str(walk), str(Path(tmp) / "walk.c")], check=True)
        cputime = Path(tmp) / "cputime"
        (Path(tmp) / "cputime.c").write_text(CPUTIME)
        subprocess.run(["gcc", "-O2", "-o", str(cputime), str(Path(tmp) / "cputime.c")],
                       check=True)
        numpy = None if args.smoke else numpy_site()
        sb = Sandbox(Path(tmp) / "sb")
        try:
            spec = SPEC.format(matmul=matmul, walk=walk, cputime=cputime,
                               seccomp=args.seccomp) + MOUNT.format(source="/usr/share/doc",
                                                                    target="/data")
            if numpy:
                # NumPy's extension modules need the BLAS and LAPACK the host's ld.so finds.
                spec = spec.replace("rootfs:\n", "rootfs:\n  python: true\n  libraries: "
                                    "[libblas.so.3, liblapack.so.3]\n")
                spec += MOUNT.format(source=numpy[1], target=numpy[1])
            sb.write_spec("bench", spec)
            up = sb.envctl("up", "bench")
            if up.returncode != 0:
                raise SystemExit(up.stderr)
            root = sb.state / "rootfs" / "bench"
            inside = [sys.executable, "-m", "envctl", "exec", "bench", "--user", "root", "--"]
            cpus = sb.run("sh", "-c", "nproc").stdout.strip()
            print(f"{cpus} CPUs; seccomp {args.seccomp}; medians of {args.runs} alternating "
                  f"pairs ({args.launches} for launches)")
            cpu = [str(cputime)]
            case(f"compute  (matmul n={args.n})", "<= 1.01", args.runs,
                 [*cpu, str(matmul), str(args.n)], [*inside, *cpu, str(matmul), str(args.n)],
                 sb, matmul_seconds)
            dd = ["dd", "bs=512", f"count={args.dd_count}", "if=/dev/zero", "of=/dev/null"]
            case(f"syscalls (dd bs=512 x{args.dd_count})", "<= 1.02", args.runs, [*cpu, *dd],
                 [*inside, *cpu, *dd], sb, dd_seconds)
            tree, reps = "/usr/share/doc", str(args.reps)  # /data inside: the same inodes
            files = re.search(r"files=(\d+)", timed(sb, [str(walk), tree, "1"])[1].stdout)[1]
            case(f"files    (stat+open+read+close of {files} files x{reps})", "<= 1.02",
                 args.runs, [*cpu, str(walk), tree, reps],
                 [*inside, *cpu, str(walk), "/data", reps], sb, matmul_seconds)
            if numpy:
                py = [numpy[0], "-c", NUMPY]
                nat, ins = pairs(args.runs, py, [*inside, *py], sb, matmul_seconds)
                print(f"numpy    (2000x2000 matmul): {spread(nat, ins)}  (target <= 1.01)")
            else:
                print("numpy    not installed for the environment's python3: case skipped")
            seed = ["ip", "netns", "exec", "bench", "unshare", "--mount", "--pid", "--fork",
                    "chroot", str(root), "/bin/true"]
            pairs(1 if args.smoke else 3, seed, [*inside, "/bin/true"], sb,
                  lambda res: 0.0)  # warm the caches
            seed_t = statistics.median(timed(sb, seed)[0] for _ in range(args.launches))
            ours_t = statistics.median(timed(sb, [*inside, "/bin/true"])[0]
                                       for _ in range(args.launches))
            native_t = statistics.median(timed(sb, ["/bin/true"])[0]
                                         for _ in range(args.launches))
            print(f"launch /bin/true: native {native_t * 1000:.1f} ms   seed line "
                  f"{seed_t * 1000:.1f} ms   envctl exec {ours_t * 1000:.1f} ms   "
                  f"(target <= 80 ms; each through nsenter into the sandbox)")
            submit = [sys.executable, "-m", "envctl", "submit-job", "bench", "--user", "root",
                      "--json", "/bin/true"]
            whole, inner = [], []
            for _ in range(args.launches):
                took, res = timed(sb, submit)
                job = json.loads(res.stdout)
                whole.append(took)
                inner.append(job["start_time"] - job["submit_time"])
            print(f"submit-job to RUNNING: whole process {statistics.median(whole) * 1000:.1f} ms"
                  f"   inside the command {statistics.median(inner) * 1000:.1f} ms   "
                  f"(target <= 100 ms)")
            # A bare name: the environment's own /usr/bin/true, found in its PATH in the
            # rootfs, nothing staged.
            by_name, named_inner = [], []
            for _ in range(args.launches):
                took, res = timed(sb, [*submit[:-1], "true"])
                job = json.loads(res.stdout)
                assert job["program"] == {"rootfs": "/usr/bin/true"}, job
                by_name.append(took)
                named_inner.append(job["start_time"] - job["submit_time"])
            print(f"submit-job by bare name (rootfs, unstaged) to RUNNING: whole process "
                  f"{statistics.median(by_name) * 1000:.1f} ms   inside the command "
                  f"{statistics.median(named_inner) * 1000:.1f} ms   "
                  f"(ratio to staged {statistics.median(by_name) / statistics.median(whole):.2f})")
            sb.envctl("down", "bench")
        finally:
            sb.close()


if __name__ == "__main__":
    main()
