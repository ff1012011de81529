"""The benchmarks under bench/ run once, tiny, so that none of them can rot unnoticed: each
must finish and print every line its report is read from (docs/benchmarks.md)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.root
REPO = Path(__file__).resolve().parents[2]


def test_runtime_overhead_smoke():
    res = subprocess.run([sys.executable, str(REPO / "bench" / "runtime_overhead.py"),
                          "--smoke"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for label in ("compute", "syscalls", "files   "):
        for what in ("wall", "cpu "):
            line = next((x for x in out.splitlines() if x.startswith(label)
                         and f" {what}: " in x), None)
            assert line is not None and "ratio " in line and "min-max" in line, out
    assert "launch /bin/true:" in out and "submit-job to RUNNING:" in out, out
    assert "seccomp default" in out


def test_seccomp_cost_smoke():
    res = subprocess.run([sys.executable, str(REPO / "bench" / "seccomp_cost.py"), "--smoke"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr
    for variant in ("native", "allow-all", "docker", "docker x2"):
        line = next((x for x in res.stdout.splitlines() if x.startswith(f"{variant} ")), None)
        assert line is not None and "ns per call" in line and "min-max" in line, res.stdout


def test_list_speed_smoke():
    res = subprocess.run([sys.executable, str(REPO / "bench" / "list_speed.py"), "--smoke"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    for label in ("--version", "list ", "list --json", "status"):
        assert any(f"envctl {label}" in x and " ms " in x for x in out.splitlines()), out
    assert "ratio status/list" in out and "vs target 300 ms" in out, out


def test_daemon_bench_smoke():
    res = subprocess.run([sys.executable, str(REPO / "bench" / "daemon.py"), "--smoke"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    for label in ("submit-job in-process", "submit-job via daemon", "no-op up in-process",
                  "no-op up via daemon", "throughput, 8 clients"):
        assert any(x.startswith(label) for x in out.splitlines()), out
    assert out.count("vs target") == 3 and "submissions/s" in out, out


def test_queue_smoke():
    res = subprocess.run([sys.executable, str(REPO / "bench" / "queue.py"), "--smoke"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    for what in ("submissions/s from 2 clients", "submit latency median", "envctl jobs",
                 "50 PENDING shown", "daemon RSS", "one pass of the queue"):
        assert what in out, out


def smoke(name: str, timeout: float = 600) -> str:
    """bench/NAME.py --smoke, which must succeed; its standard output."""
    res = subprocess.run([sys.executable, str(REPO / "bench" / f"{name}.py"), "--smoke"],
                         capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_network_updown_smoke():
    out = smoke("network_updown")
    for label in ("2 shipped partitions: ", "2 partitions: "):
        line = next((x for x in out.splitlines() if label in x), None)
        assert line is not None and "envctl up+down" in line and "script" in line \
            and "ratio envctl/script" in line, out


def test_monitor_tick_smoke():
    out = smoke("monitor_tick")
    assert "monitor tick: 1 environments, 1 GPUs" in out, out
    for what in ("CPU per tick", "of which sampling alone", "NVML initialised 1 time(s)",
                 "KiB after 1,000 ticks", "CSV written"):
        assert what in out, out
    assert "None" not in out, out


def test_rootfs_gpu_up_smoke():
    out = smoke("rootfs_gpu_up")
    assert any(re.fullmatch(r"\s*0\.001G\s+\d+\.\d+s\s+\d+\.\d+s", x)
               for x in out.splitlines()), out
    for what in ("largest/smallest up", "seed-style cp -a", "envctl up", "vs copy"):
        assert what in out, out


@pytest.mark.skipif(shutil.which("runsc") is None, reason="gVisor's runsc is not installed")
def test_sandbox_overhead_smoke():
    out = smoke("sandbox_overhead")
    assert "platform ptrace" in out, out
    for label in ("compute: matmul", "syscalls: dd", "small files:", "data mount: write",
                  "data mount: read", "network: 10 TCP", "launch: exec"):
        line = next((x for x in out.splitlines() if x.startswith(label)), None)
        assert line is not None and "envctl-native" in line and "envctl-gvisor" in line, out


def processes_naming(text: str) -> dict[int, bytes]:
    """The processes whose environment names `text` (a benchmark's state, run and socket paths
    all lie below its temporary directory): its daemon, job supervisors, clients, sandbox."""
    found = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "environ").read_bytes():
                    found[int(d.name)] = (d / "cmdline").read_bytes()
            except OSError:  # gone meanwhile, or a kernel thread
                pass
    return found


def cgroups_of(pid: int) -> list[Path]:
    """The cgroup parents of the sandboxes process `pid` made (tests/integration/sandbox.py)."""
    root, name = Path("/sys/fs/cgroup"), f"envctl-test-{pid}-*"
    return sorted([*root.glob(name), *root.glob(f"*/{name}")])


def remove_leftovers(work: Path, pid: int) -> None:
    """After a failed test: kill what names `work` and remove the cgroups of `pid`."""
    for left in processes_naming(str(work)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(left, signal.SIGKILL)
    for top in cgroups_of(pid):
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            for victim in (d / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(victim), signal.SIGKILL)
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGINT])
def test_queue_bench_killed_mid_run_tears_everything_down(signo):
    """A time-out's SIGTERM (or Ctrl-C) while the jobs are being submitted, with the daemon
    up and a job running: the benchmark stops its daemon, takes its environment down with its
    jobs, kills its sandbox and removes its temporary directory; it exits 128 + the signal."""
    # A short directory of the test's own (the daemon's socket path must fit sun_path).
    tmp = Path(tempfile.mkdtemp(prefix="qb-", dir="/tmp"))
    out = tmp / "out"
    proc = None
    try:
        with open(out, "w") as f:
            proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "queue.py"),
                                     "--jobs", "2000", "--clients", "2"], cwd=REPO,
                                    env={**os.environ, "TMPDIR": str(tmp)}, stdout=f,
                                    stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while "submitting 2000 jobs" not in out.read_text():
                assert proc.poll() is None, f"exited {proc.returncode}:\n{out.read_text()}"
                assert time.monotonic() < deadline, out.read_text()
                time.sleep(0.05)
            (work,) = [p for p in tmp.iterdir() if p.name.startswith("envctl-bench-queue-")]
            assert processes_naming(str(work)), "no daemon or job to tear down"
            proc.send_signal(signo)
            proc.wait(180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert "one pass of the queue" not in out.read_text(), "not killed mid-run"
        assert sorted(p.name for p in tmp.iterdir()) == ["out"], out.read_text()
        assert processes_naming(str(work)) == {}
        assert cgroups_of(proc.pid) == []
        assert proc.returncode == 128 + signo, out.read_text()
    finally:
        if proc is not None:
            remove_leftovers(tmp, proc.pid)
        shutil.rmtree(tmp)


def test_gpus_bench_smoke():
    res = subprocess.run([sys.executable, str(REPO / "bench" / "gpus.py"), "--smoke"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "host: 8 GPUs, 56 MIG instances (56 held by 8 environments), source nvml" in out, out
    for label in ("envctl --version", "envctl gpus", "envctl gpus --json",
                  "in-process discover_gpus", "in-process gpu_report"):
        assert any(x.startswith(label) and ": median " in x for x in out.splitlines()), out
    assert out.count("(target <= 150 ms)") == 2 and "above --version" in out, out


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("ldconfig") is None,
                    reason="the fake GPU host's driver libraries need gcc and ldconfig")
def test_mig_up_smoke():
    out = smoke("mig_up")
    assert "seven 1g.18gb MIG instances" in out and "the first up made 15 NVML writes" in out, out
    for label in ("envctl up:", "envctl up again (no-op):", "envctl down:"):
        line = next((x for x in out.splitlines() if x.startswith(label)), None)
        assert line is not None and re.search(r"wall \d+ ms, CPU \d+ ms$", line), out


def test_monitor_tick_with_mig_smoke():
    res = subprocess.run([sys.executable, str(REPO / "bench" / "monitor_tick.py"), "--mig",
                          "--ticks", "20"], capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "8 GPUs (16 GPU processes), 20 ticks, MIG: 56 instances held" in out, out
    assert "CPU per tick" in out and "(target <= 20 ms)" in out, out
