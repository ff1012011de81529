"""envctl-monitor.service under this machine's systemd (nspawn): Type=notify, so `systemctl
start` returns once the first tick said READY=1; WATCHDOG=1 keeps it running past WatchdogSec
between ticks; a monitor that hangs (SIGSTOP stands in for a hung heal) is killed by the
watchdog and started again; `systemctl stop` ends it cleanly. The unit is the shipped one,
with a short watchdog and this checkout's envctl."""

from __future__ import annotations

import shlex
import sys

import pytest

from tests.systemd.nspawn import REPO, boot

pytestmark = [pytest.mark.root, pytest.mark.systemd, pytest.mark.timeout(300)]

SCRIPT = """\
exec > /out/log 2>&1
PY={py}
U=envctl-monitor.service
# wait_for CMD: until CMD succeeds, 30 s at most (a condition, not a fixed sleep)
wait_for() {{ i=0; until "$@"; do i=$((i+1)); [ $i -gt 600 ] && return 1; sleep 0.05; done; }}
# ticked N: the monitor's /metrics says it ticked N times or more
ticked() {{ $PY -c 'import re, sys, urllib.request as u
t = u.urlopen("http://127.0.0.1:9464/metrics", timeout=5).read().decode()
n = float(re.search(r"^envctl_monitor_ticks_total (\\S+)", t, re.M).group(1))
sys.exit(0 if n >= int(sys.argv[1]) else 1)' "$1" 2>/dev/null; }}
echo "start=$(systemctl start $U; echo $?)"
echo "state=$(systemctl show -p ActiveState --value $U)"
echo "type=$(systemctl show -p Type --value $U)"
echo "watchdog=$(systemctl show -p WatchdogUSec --value $U)"
PID=$(systemctl show -p MainPID --value $U)
# Ticks every 1 s, watchdog 3 s: past two watchdog periods, pinged, never restarted.
echo "ticked=$(wait_for ticked 7 && echo yes)"
echo "restarts_alive=$(systemctl show -p NRestarts --value $U)"
kill -STOP $PID  # hung: no more pings
wait_for sh -c "[ \\$(systemctl show -p NRestarts --value $U) -ge 1 ]"
wait_for sh -c "systemctl show -p ActiveState --value $U | grep -qx active"
NEW=$(systemctl show -p MainPID --value $U)
echo "new_pid=$([ "$NEW" != "$PID" ] && [ "$NEW" != 0 ] && echo yes)"
echo "said=$(journalctl -q -u $U | grep -c 'Watchdog timeout')"
echo "stop=$(systemctl stop $U; echo $?)"
echo "result=$(systemctl show -p Result --value $U)"
"""


def _unit(py: str) -> str:
    text = (REPO / "systemd" / "envctl-monitor.service").read_text()
    assert "WatchdogSec=5min" in text and "Type=notify" in text
    env = (f"Environment=PYTHONPATH={REPO}/src ENVCTL_STATE_DIR=/tmp/st ENVCTL_RUN_DIR=/tmp/rn "
           "ENVCTL_CONFIG_DIR=/tmp/cfg ENVCTL_NVML=off PYTHONDONTWRITEBYTECODE=1")
    exec_start = (f"ExecStart={py} -m envctl monitor --no-heal --interval 1 --csv-dir none "
                  "--listen 127.0.0.1:9464")
    lines = []
    for line in text.splitlines():
        if line.startswith("ExecStart="):
            lines += [env, exec_start]
        elif line.startswith("WatchdogSec="):
            # Short, for the test; and a SIGABRT to a stopped process waits for its SIGKILL.
            lines += ["WatchdogSec=3s", "TimeoutStopSec=3s"]
        elif line.startswith("RestartSec="):
            lines.append("RestartSec=1s")
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def test_the_monitor_unit_notifies_and_its_watchdog_restarts_a_hung_monitor(tmp_path):
    py = shlex.quote(sys.executable)
    log, res = boot(tmp_path, SCRIPT.format(py=py),
                    {"envctl-monitor.service": _unit(sys.executable)})
    got = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    tail = f"--- log\n{log}\n--- nspawn\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
    want = {"start": "0", "state": "active", "type": "notify", "watchdog": "3s",
            "ticked": "yes", "restarts_alive": "0", "new_pid": "yes", "said": "1", "stop": "0",
            "result": "success"}
    assert {k: got.get(k) for k in want} == want, tail
