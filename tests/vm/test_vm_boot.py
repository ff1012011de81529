"""Boots the VM with systemd as PID 1 on cgroup v2 to multi-user.target with envctl's units
installed (tests/vm/harness.py `run_systemd_boot`) and runs tests/vm/guest_boot.py inside it:
twice, the second boot with the state the first left at a power loss."""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path

import pytest

from tests.vm import guest_boot, harness

pytestmark = [pytest.mark.vm, pytest.mark.timeout(2400)]
ENVCTL = str(Path(sys.executable).parent / "envctl")


@pytest.fixture(scope="module")
def vm_ready():
    missing = harness.missing_tools()
    if missing:
        pytest.skip(f"the VM harness needs {', '.join(missing)} (scripts/install-deps)")
    harness.boot_initramfs()  # download and build once, outside any test's own time


def boot(out: Path, test: str, preboot: str) -> harness.Result:
    script = (f"export ENVCTL_VM_ENVCTL={shlex.quote(ENVCTL)}\n"
              + harness.guest_pytest(f"tests/vm/guest_boot.py::{test}", timeout=900))
    res = harness.run_systemd_boot(script, preboot=preboot, out=out, timeout=1100)
    pre = (out / "preboot.log").read_text() if (out / "preboot.log").exists() else ""
    pre_rc = (out / "preboot.rc").read_text().strip() if (out / "preboot.rc").exists() else ""
    assert pre_rc == "0", f"--- preboot\n{pre}\n--- console\n{res.console[-3000:]}"
    assert "wrote envctl.service" in pre and "enabled envctl.service" in pre, pre
    harness.assert_guest_passed(res)
    return res


def test_boot_units_under_a_real_systemd(vm_ready, tmp_path):
    first, second = tmp_path / "boot1", tmp_path / "boot2"
    boot(first, "TestFirstBoot", guest_boot.preboot_script(ENVCTL))
    assert (first / "state" / "journal").is_dir(), "the first boot left no state"
    second.mkdir()
    shutil.copytree(first / "state", second / "state", symlinks=True)
    boot(second, "TestSecondBoot", guest_boot.preboot_script(ENVCTL, state_from="/out/state"))
