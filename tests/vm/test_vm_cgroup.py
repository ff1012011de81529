"""Boots a real cgroup v2 kernel under qemu (tests/vm/harness.py) and runs the cgroup tests of
tests/vm/guest_cgroup_v2.py inside it: limits, throttling, OOM kills, the BPF device program,
dedicated CPUs, teardown with live processes, faults."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from tests.vm import harness

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vm_ready():
    missing = harness.missing_tools()
    if missing:
        pytest.skip(f"the VM harness needs {', '.join(missing)} (scripts/install-deps)")
    harness.initramfs()  # download and build once, outside any test's own time


def test_cgroup_v2_in_a_real_v2_kernel(vm_ready):
    script = (f"cd {shlex.quote(str(REPO))} && PYTHONDONTWRITEBYTECODE=1 "
              f"{shlex.quote(sys.executable)} -m pytest -p no:cacheprovider -o addopts= -rA "
              "-q --timeout 900 tests/vm/guest_cgroup_v2.py\n")
    result = harness.run(script, timeout=1500)
    tail = f"--- guest log\n{result.log[-6000:]}\n--- console\n{result.console[-3000:]}"
    assert result.rc == 0, tail
    assert " passed" in result.log and "skipped" not in result.log, tail
