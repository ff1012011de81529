"""Boots the VM with systemd as PID 1 on cgroup v2 to multi-user.target with envctl's units
installed (tests/vm/harness.py `run_systemd_boot`) and runs tests/vm/guest_boot.py inside it:
twice, the second boot with the state the first left at a power loss, and ending with a clean
`systemctl poweroff` with everything up and a job running, whose leftovers (and the job's
record: cancelled, "host shutdown") a probe unit records."""

from __future__ import annotations

import json
import re
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


def boot(out: Path, test: str, preboot: str, *, clean_poweroff: bool = False
         ) -> harness.Result:
    script = (f"export ENVCTL_VM_ENVCTL={shlex.quote(ENVCTL)}\n"
              + harness.guest_pytest(f"tests/vm/guest_boot.py::{test}", timeout=600))
    res = harness.run_systemd_boot(script, preboot=preboot, out=out, timeout=1100,
                                   clean_poweroff=clean_poweroff)
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
    res = boot(second, "TestSecondBoot", guest_boot.preboot_script(
        ENVCTL, state_from="/out/state", shutdown_probe=True), clean_poweroff=True)
    # The clean poweroff: envctl.service's ExecStop= (`down --all`) took everything
    # down, with web's service run by the monitor's supervisor, before the probe ran.
    probe = second / "shutdown.json"
    assert probe.exists(), f"the shutdown probe did not run\n{res.console[-3000:]}"
    found = json.loads(probe.read_text())
    context = json.dumps(found, indent=1)
    assert found["envctl_service"]["ActiveState"] == "inactive", context
    assert found["envctl_service"]["Result"] == "success", context
    assert found["monitor"] == "inactive", context
    assert found["residue"] == {}, context
    # The job left running in web: cancelled by the shutdown, with that reason (the
    # supervisor's SIGTERM from systemd's stop of its scope, or `down --all` seeing
    # `systemctl is-system-running` say "stopping", whichever came first: the same record).
    job = (second / "shutdown_job").read_text().strip()
    assert found["jobs"][job]["state"] == "CANCELLED", context
    assert found["jobs"][job]["reason"] == "host shutdown", context
    assert found["processes"] == [], context
    assert {row["env"]: row["state"] for row in found["status"]} == {
        "web": "down", "broken": "down"}, context
    # The monitor neither logged systemd's teardown of the slices as drift nor tried to heal
    # it: it stopped reporting once the host was shutting down.
    left_up_at = float((second / "left_up_at").read_text())
    late = [e for row in found["status"] for e in row["events"] if e["time"] > left_up_at]
    assert late == [], context
    # ExecStop= ran `down` for both (not systemd's own teardown of the slices), and it
    # removed things and failed nothing.
    downs = re.findall(r"down: (\d+) removed, \d+ kept for other environments, (\d+) failed",
                       found["journal"])
    assert len(downs) == 2 and all(int(n) > 0 and failed == "0" for n, failed in downs), context
