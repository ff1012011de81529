"""Boots the VM with systemd as PID 1 on cgroup v2 (tests/vm/harness.py `run_systemd`) and
runs the systemd cgroup driver's tests of tests/vm/guest_systemd.py inside it, in one boot."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from tests.vm import harness

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vm_ready():
    missing = harness.missing_tools()
    if missing:
        pytest.skip(f"the VM harness needs {', '.join(missing)} (scripts/install-deps)")
    harness.systemd_initramfs()  # download and build once, outside any test's own time


def test_systemd_driver_under_a_real_systemd(vm_ready):
    script = (f"cd {shlex.quote(str(REPO))} && PYTHONDONTWRITEBYTECODE=1 "
              f"{shlex.quote(sys.executable)} -m pytest -p no:cacheprovider -o addopts= -rA "
              "-q --timeout 600 tests/vm/guest_systemd.py\n")
    result = harness.run_systemd(script, timeout=900)
    tail = f"--- guest log\n{result.log[-6000:]}\n--- console\n{result.console[-3000:]}"
    assert result.rc == 0, tail
    assert " passed" in result.log and "skipped" not in result.log, tail
