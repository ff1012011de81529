"""The benchmarks under bench/ run once, tiny, so that none of them can rot unnoticed: each
must finish and print every line its report is read from (docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
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


def test_monitor_tick_with_mig_smoke():
    res = subprocess.run([sys.executable, str(REPO / "bench" / "monitor_tick.py"), "--mig",
                          "--ticks", "20"], capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "8 GPUs (16 GPU processes), 20 ticks, MIG: 56 instances held" in out, out
    assert "CPU per tick" in out and "(target <= 20 ms)" in out, out
