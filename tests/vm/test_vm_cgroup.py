"""Boots a real cgroup v2 kernel under qemu (tests/vm/harness.py) and runs the cgroup tests of
tests/vm/guest_cgroup_v2.py inside it: limits, throttling, OOM kills, the BPF device program,
dedicated CPUs, teardown with live processes, faults, and the monitor's reading of cpu.max,
cpu.stat, PSI and io.stat."""

from __future__ import annotations

import pytest

from tests.vm import harness

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def vm_ready():
    missing = harness.missing_tools()
    if missing:
        pytest.skip(f"the VM harness needs {', '.join(missing)} (scripts/install-deps)")
    harness.initramfs()  # download and build once, outside any test's own time


def test_cgroup_v2_in_a_real_v2_kernel(vm_ready):
    script = harness.guest_pytest("tests/vm/guest_cgroup_v2.py", timeout=400)
    # A small blank disk: the monitor's io.stat test needs IO on a block device.
    harness.assert_guest_passed(harness.run(script, timeout=1500, disk_mb=32))
