"""Boots the VM with systemd as PID 1 on cgroup v2 (tests/vm/harness.py `run_systemd`) and
runs the systemd cgroup driver's tests of tests/vm/guest_systemd.py inside it, in one boot."""

from __future__ import annotations

import pytest

from tests.vm import harness

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def vm_ready():
    missing = harness.missing_tools()
    if missing:
        pytest.skip(f"the VM harness needs {', '.join(missing)} (scripts/install-deps)")
    harness.systemd_initramfs()  # download and build once, outside any test's own time


def test_systemd_driver_under_a_real_systemd(vm_ready):
    script = harness.guest_pytest("tests/vm/guest_systemd.py", timeout=450)
    harness.assert_guest_passed(harness.run_systemd(script, timeout=1500))
