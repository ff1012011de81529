"""The test helpers that guard against a hung test: the VM harness's watchdog beside a guest's
command (tests/vm/harness.py `_watched`), its /init templates, and the sandbox's `stderr_of`
for failure messages."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.integration.sandbox import stderr_of
from tests.vm import harness


def _sh(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)


def test_a_command_that_ends_in_time_keeps_its_status_and_leaves_no_dump(tmp_path):
    # A sleep length of this run's own: two suites at once each look for theirs alone.
    secs = 10_000_000 + int.from_bytes(os.urandom(3), "big")
    res = _sh(harness._watched("echo out; exit 7", str(tmp_path), secs))
    assert (res.returncode, res.stdout, res.stderr) == (7, "out\n", "")  # no "Terminated"
    assert not (tmp_path / "stall.txt").exists()
    # The watchdog's sleep went with the command: nothing of it is left running.
    left = subprocess.run(["pgrep", "-f", f"^sleep {secs}$"], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


def test_a_command_still_running_gets_its_processes_dumped(tmp_path):
    # The command runs until the whole dump is there (a condition, not a sleep of the right
    # length: on a loaded host the dump of every process takes seconds).
    stall = tmp_path / "stall.txt"
    script = f"until grep -qa '^--- end of dump$' {stall} 2>/dev/null; do sleep 0.05; done; exit 3"
    res = _sh(harness._watched(script, str(tmp_path), 0))
    assert res.returncode == 3, res.stderr
    # Read as the harness reads it: some process's cmdline may hold bytes that are not UTF-8.
    dump = stall.read_bytes().decode(errors="replace")
    assert "WCHAN" in dump, dump  # ps ran
    # This test's own Python process has its section, headed by its pid and state.
    assert any(line.startswith("--- ") and "pytest" in line for line in dump.splitlines()), dump


def test_every_init_template_formats_with_the_read_only_share_options():
    for template in (harness.INIT, harness.SYSTEMD_INIT, harness.BOOT_INIT):
        init = template.format(modules="9p", ro_9p=harness.RO_9P)
        mounts = [line for line in init.splitlines() if line.startswith("mount -t 9p")]
        ro = [m for m in mounts if " hostroot " in m or " repo " in m]
        assert len(ro) == 2 and all(harness.RO_9P in m for m in ro), mounts
        # The results share stays uncached: the host reads what the guest wrote there.
        assert all("cache=" not in m for m in mounts if m not in ro), mounts



def test_stderr_of_a_live_process_kills_it_rather_than_waiting_for_it():
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                             "print('why', file=sys.stderr, flush=True)\n"
                             "print('ready', flush=True)\ntime.sleep(600)"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        assert stderr_of(proc) == "why\n"  # at once, not after 600 s (the test's limit is 300)
        assert proc.returncode == -9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
