"""Benchmark: the daemon (envctl.server): submission throughput from 8 parallel clients,
`submit-job` as a whole client process, and a no-op `envctl up` of an operator through it,
each against the same thing in-process (root, no daemon).

Run as root from the repository root: `python bench/daemon.py [--submits 400] [--runs 9]`.
Everything runs in a throwaway net + mount namespace (the integration tests' sandbox) with one
small environment. Targets (issue 22): >= 200 submissions/s sustained from 8 clients,
`submit-job` <= 50 ms median, a no-op `up` through the daemon <= 150 ms. Asserts nothing;
`--smoke` is the suite's tiny run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import let_nobody_run_python, precompile  # noqa: E402
from bench.queue import cpu_seconds  # noqa: E402
from tests.integration.sandbox import Sandbox  # noqa: E402

NOBODY = 65534
SPEC = """name: box
kind: cpu
rootfs:
  binaries: [sh, "true"]
resources:
  memory: {max: 256M}
access:
  submit: {users: [nobody]}
  operate: {users: [nobody]}
"""


def timed(sb: Sandbox, *argv: str, env: dict[str, str]) -> float:
    t = time.perf_counter()
    res = sb.run(*argv, env=env, timeout=600)
    dt = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return dt


def throughput(sock: str, total: int, clients: int = 8) -> float:
    """Submissions per second from `clients` threads, each its own connection per submit,
    each answered as the plain `submit-job` is (`early`: once the job's supervisor holds it,
    not once it runs; docs/runtime.md "What submit-job's answer means")."""
    os.environ["ENVCTL_SOCKET"] = sock
    from envctl.server import client

    errors: list[BaseException] = []
    per = total // clients

    def one() -> None:
        try:
            for _ in range(per):
                c = client.route()
                assert c is not None
                client.submit(c, "box", "true", [], user="nobody", early=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(clients)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.perf_counter() - t
    if errors:
        raise SystemExit(f"a submit failed: {errors[0]!r}")
    return per * clients / dt


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (and theirs, as each reaped its own)."""
    import resource

    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def wait_for_socket(sb: Sandbox, proc, sock: str) -> None:
    import socket

    deadline = time.monotonic() + 30
    while True:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(sock)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the daemon did not start: {proc.communicate()[1]}") from None
            time.sleep(0.02)
        finally:
            s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--submits", type=int, default=400)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--smoke", action="store_true", help="16 submits, 1 run")
    args = ap.parse_args()
    if args.smoke:
        args.submits, args.runs = 16, 1
    precompile()
    with tempfile.TemporaryDirectory(prefix="envctl-bench-daemon-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        sb = Sandbox(root)
        daemon = None
        try:
            sb.write_spec("box", SPEC)
            let_nobody_run_python(sb, root)
            for d in (sb.state, sb.run_dir):
                d.mkdir(parents=True, exist_ok=True)
            timed(sb, sys.executable, "-m", "envctl", "up", "box", env={})
            sock = str(root / "envctl.sock")
            none = {"ENVCTL_SOCKET": str(root / "none.sock")}
            via = {"ENVCTL_SOCKET": sock}
            daemon = sb.popen(sys.executable, "-m", "envctl", "daemon", env=via)
            wait_for_socket(sb, daemon, sock)
            envctl = (sys.executable, "-m", "envctl")
            as_nobody = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                         "--", *envctl)
            med = {}
            med["submit in-process"] = statistics.median(
                timed(sb, *envctl, "submit-job", "--user", "nobody", "box", "true", env=none)
                for _ in range(args.runs))
            # CPU per submit too (the wall time on a shared VM measures the other load): the
            # client's (its whole process, nsenter and setpriv included: reaped children) and
            # the daemon's (itself, its workers and children; not the job's supervisor, which
            # is detached and is the job's own cost).
            client0, daemon0 = children_cpu(), cpu_seconds(daemon.pid)
            med["submit via daemon"] = statistics.median(
                timed(sb, *as_nobody, "submit-job", "box", "true", env={**via, "HOME": "/"})
                for _ in range(args.runs))
            cpu = ((children_cpu() - client0) / args.runs,
                   (cpu_seconds(daemon.pid) - daemon0) / args.runs)
            # The floor under it that is not envctl's: the same nsenter and setpriv starting
            # an interpreter that does nothing.
            med["floor"] = statistics.median(
                timed(sb, *as_nobody[:-2], "-c", "pass", env={**via, "HOME": "/"})
                for _ in range(args.runs))
            med["up in-process"] = statistics.median(
                timed(sb, *envctl, "up", "box", env=none) for _ in range(args.runs))
            med["up via daemon"] = statistics.median(
                timed(sb, *as_nobody, "up", "box", env={**via, "HOME": "/"})
                for _ in range(args.runs))
            rate = throughput(sock, args.submits)
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait(30)
            sb.envctl("down", "box", "--force", timeout=600)
            sb.close()
    print(f"submit-job in-process     {med['submit in-process'] * 1000:6.0f} ms  (median of "
          f"{args.runs} runs)")
    print(f"submit-job via daemon     {med['submit via daemon'] * 1000:6.0f} ms  ratio "
          f"{med['submit via daemon'] / med['submit in-process']:5.2f}  vs target 50 ms: "
          f"{'met' if med['submit via daemon'] <= 0.05 else 'MISSED'}; CPU per submit: "
          f"client {cpu[0] * 1000:.1f} ms, daemon {cpu[1] * 1000:.1f} ms")
    print(f"  of which not envctl's   {med['floor'] * 1000:6.0f} ms  (nsenter, setpriv and "
          "`python -c pass`, as the bench starts the client)")
    print(f"no-op up in-process       {med['up in-process'] * 1000:6.0f} ms")
    print(f"no-op up via daemon       {med['up via daemon'] * 1000:6.0f} ms  ratio "
          f"{med['up via daemon'] / med['up in-process']:5.2f}  vs target 150 ms: "
          f"{'met' if med['up via daemon'] <= 0.15 else 'MISSED'}")
    print(f"load average              {os.getloadavg()[0]:6.1f}")
    print(f"throughput, 8 clients     {rate:6.0f} submissions/s ({args.submits} submits) vs "
          f"target 200/s: {'met' if rate >= 200 else 'MISSED'}")


if __name__ == "__main__":
    main()
