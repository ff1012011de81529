"""Benchmark: `envctl jobs` through the daemon with N jobs queued (default 10,000), as root and as
a plain user (`nobody`), the whole client process: wall time, and the CPU time of the client
and of the daemon (which answers the listing in its own process) taken apart.

Run as root from the repository root: `python bench/jobs_listing.py [--jobs 10000] [--runs 7]`.
Everything runs in the integration tests' sandbox. bench/queue.py measures the same listing
after submitting every job through the daemon, which takes half an hour at 10,000 on a
loaded 2-core VM; here `--seed` jobs (default 100) are submitted through the daemon (queued
behind a job holding the environment's one CPU), then, with the daemon stopped, the last
queued job's record, request, directory and index line are copied to the ids up to N (what
the listing reads: the index and the jobs directory), and the daemon is started again.
Target (issue #22): `envctl jobs` <= 300 ms with 10,000 queued. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import let_nobody_run_python, precompile  # noqa: E402
from bench.queue import CLIENTS, SPEC, check  # noqa: E402
from tests.integration.sandbox import Sandbox  # noqa: E402

NOBODY = 65534


def grow(jobs: Path, n: int) -> None:
    """Copy the last queued job of the index to the ids after it, up to `n` queued (under
    the jobs lock, as every writer of the index is)."""
    import fcntl

    lock = os.open(jobs / ".lock", os.O_RDWR | os.O_CLOEXEC)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        _grow(jobs, n)
    finally:
        os.close(lock)


def _grow(jobs: Path, n: int) -> None:
    index = jobs / ".queue" / "qbench"
    lines = index.read_bytes().splitlines()
    last = json.loads(lines[-1])
    record = json.loads((jobs / f"{last['id']}.json").read_text())
    request = (jobs / f"{last['id']}.req").read_bytes()
    st = (jobs / str(last["id"])).stat()
    out = list(lines)
    for i in range(last["id"] + 1, last["id"] + 1 + n - len(lines)):
        paths = {k: str(jobs / str(i) / k) for k in ("stdout", "stderr")}
        out.append(json.dumps(last | paths | {"id": i}, separators=(",", ":")).encode())
        rec = record | paths | {"id": i, "cgroup": record["cgroup"] | {
            "name": f"qbench/job-{i}"}}
        for path, data in ((jobs / f"{i}.json", json.dumps(rec).encode()),
                           (jobs / f"{i}.req", request)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, data)
            os.close(fd)
        (jobs / str(i)).mkdir(mode=0o700)
        os.chown(jobs / str(i), st.st_uid, st.st_gid)
    index.write_bytes(b"\n".join(out) + b"\n")
    (jobs / ".next").write_text(f"{json.loads(out[-1])['id'] + 1}\n")


def start_daemon(sb: Sandbox, root: Path, env: dict[str, str]) -> subprocess.Popen:
    log = open(root / "daemon.log", "a")  # noqa: SIM115 - the daemon's, closed with the run
    daemon = subprocess.Popen(["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable,
                               "-m", "envctl", "daemon"], env=sb.env(env), stdout=log,
                              stderr=log)
    answers = "from envctl.server import client; raise SystemExit(client.route() is None)"
    deadline = time.monotonic() + 120
    while sb.run(sys.executable, "-c", answers, env=env).returncode != 0:
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the daemon did not start: {(root / 'daemon.log').read_text()}")
        time.sleep(0.05)
    return daemon


def cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_jobs(sb: Sandbox, daemon: subprocess.Popen, prefix: tuple[str, ...],
               env: dict[str, str], out: Path) -> tuple[float, float, float, str]:
    """One `envctl jobs`: wall seconds, the client's CPU, the daemon's CPU, its output."""
    with open(out, "w+") as f:
        before = cpu_of(daemon.pid)
        t = time.perf_counter()
        proc = subprocess.Popen(["nsenter", "-t", str(sb.pid), "-n", "-m", "--", *prefix,
                                 sys.executable, "-m", "envctl", "jobs"], env=sb.env(env),
                                stdout=f, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        if status != 0:
            raise SystemExit(f"envctl jobs failed: {proc.stderr.read().decode()[-2000:]}")
        proc.stderr.close()
        f.seek(0)
        return wall, usage.ru_utime + usage.ru_stime, cpu_of(daemon.pid) - before, f.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    precompile()
    results = {}
    with tempfile.TemporaryDirectory(prefix="envctl-bench-jobs-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # nobody's client walks through it to the socket
        sb, daemon = Sandbox(root), None
        try:
            let_nobody_run_python(sb, root)
            sb.write_spec("qbench", SPEC % (args.jobs + 10))
            check(sb.envctl("up", "qbench"), "up")
            sock = {"ENVCTL_SOCKET": str(root / "envctl.sock"), "HOME": "/"}
            daemon = start_daemon(sb, root, sock)
            check(sb.envctl("submit-job", "--user", "root", "--cpus", "1", "-t", "60",
                            "qbench", "sleep", "3600", env=sock), "the holding job")
            check(sb.run(sys.executable, "-c", CLIENTS, str(args.seed), "2", env=sock,
                         timeout=3600), "submitting")
            daemon.terminate()
            daemon.wait(30)
            grow(sb.state / "jobs", args.jobs)
            daemon = start_daemon(sb, root, sock)
            nobody = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                      "--")
            for who, prefix in (("root", ()), ("nobody", nobody)):
                runs = [timed_jobs(sb, daemon, prefix, sock, root / "out.txt")
                        for _ in range(args.runs)]
                shown = sum(1 for line in runs[-1][3].splitlines() if "PENDING" in line)
                results[who] = [statistics.median(r[k] for r in runs) for k in range(3)]
                results[who].append(shown)
            check(sb.envctl("down", "qbench", "--force", env=sock, timeout=3600),
                  "down --force")
        finally:
            if daemon is not None and daemon.poll() is None:
                daemon.terminate()
                daemon.wait(30)
            sb.close()
    for who, (wall, client, served, shown) in results.items():
        print(f"{args.jobs} queued: envctl jobs as {who:6} {wall * 1000:6.0f} ms (median of "
              f"{args.runs}; CPU: client {client * 1000:.0f} ms, daemon {served * 1000:.0f} "
              f"ms; {shown} PENDING shown; target 300 ms: "
              f"{'met' if wall <= 0.3 else 'MISSED'})")


if __name__ == "__main__":
    main()
