"""The systemd driver under this machine's own systemd 252, booted by systemd-nspawn
(`--volatile=yes`, private network) on this host's hybrid cgroup v1 layout: plan, up, the unit
file, the properties as systemd reports them, status, drift repair, attach, down with a process
that ignores SIGTERM, down again; an operator's drop-in kept; a slice somebody else started
refused and left running; a /dev/char link two environments need made once and removed with the
last of them, one that was there first kept.

The v1 hierarchies are read-only inside nspawn, so systemd cannot apply the limits there (the
VM test checks those). The host is kept out of it: nspawn runs in a private mount namespace
with a tmpfs on /run/systemd, and from a cgroup of its own that the test removes."""

from __future__ import annotations

import shlex
import sys

import pytest

from tests.systemd.nspawn import REPO, boot

pytestmark = [pytest.mark.root, pytest.mark.systemd, pytest.mark.timeout(300)]

SCRIPT = """\
exec > /out/log 2>&1
cd {repo}
# PYTHONPATH: this checkout's envctl, whatever the venv has installed
export PYTHONDONTWRITEBYTECODE=1 ENVCTL_STATE_DIR=/tmp/st ENVCTL_CONFIG_DIR=/tmp/cfg \\
  ENVCTL_RUN_DIR=/tmp/rn COLUMNS=200 PYTHONPATH={repo}/src
mkdir -p /tmp/cfg
printf 'name: lim\\nkind: cpu\\nresources:\\n  driver: systemd\\n  cpu: {{quota: 50%%}}\\n\
  memory: {{max: 64M}}\\n  pids: {{max: 32}}\\n' > /tmp/cfg/lim.yaml
PY={py}
# wait_for CMD: until CMD succeeds, 20 s at most (a condition, not a fixed sleep)
wait_for() {{ i=0; until "$@"; do i=$((i+1)); [ $i -gt 400 ] && return 1; sleep 0.05; done; }}
# gone PID: exited (a zombie counts); no awk here: /etc/alternatives is empty in the container
gone() {{ s=$(cut -d' ' -f3 /proc/$1/stat 2>/dev/null); [ -z "$s" ] || [ "$s" = Z ]; }}
printf 'name: two\nkind: cpu\nresources:\n  driver: systemd\n' > /tmp/cfg/two.yaml
# /dev/char links (the container's own /dev): 1:9 missing, so envctl makes it, for both
# environments; 1:3 there first, as udev makes it, so envctl keeps it.
mkdir -p /dev/char && rm -f /dev/char/1:9 && ln -sfn ../null /dev/char/1:3
# An operator's drop-in for the slice envctl makes: down must keep it.
mkdir -p /etc/systemd/system/envctl-lim.slice.d
printf '[Slice]\\nIOAccounting=yes\\n' > /etc/systemd/system/envctl-lim.slice.d/10-ops.conf
echo "up=$($PY -m envctl up lim >/dev/null 2>&1; echo $?)"
echo "file=$(test -f /run/systemd/system/envctl-lim.slice && echo yes)"
echo "link_up=$(readlink /dev/char/1:9)"
echo "up_two=$($PY -m envctl up two >/dev/null 2>&1; echo $?)"
systemctl show -p ActiveState,CPUQuotaPerSecUSec,MemoryMax,TasksMax,DevicePolicy envctl-lim.slice
$PY -m envctl status lim | grep -o 'driver systemd'
systemctl set-property --runtime envctl-lim.slice TasksMax=5
$PY -m envctl status lim | grep -o 'TasksMax: 5 -> 32'
echo "up2=$($PY -m envctl up lim >/dev/null 2>&1; echo $?)"
systemctl show -p TasksMax envctl-lim.slice | sed 's/^/after-/'
$PY -c 'import os; from envctl.host.systemd import Systemd
Systemd.from_env().attach("lim", os.getpid())
print("in", open("/proc/self/cgroup").read().split("::")[-1].strip())'
# A process in a scope of the slice that ignores SIGTERM (SIG_IGN survives exec).
systemd-run --quiet --scope --slice=envctl-lim.slice sh -c 'trap "" TERM; exec sleep 1000' &
STUBBORN=$!
wait_for sh -c "systemd-cgls --no-pager -u envctl-lim.slice | grep -q 'sleep 1000'"
echo "down=$(ENVCTL_KILL_GRACE=1 $PY -m envctl down lim >/dev/null 2>&1; echo $?)"
echo "stubborn_gone=$(gone $STUBBORN && echo yes)"
echo "down2=$($PY -m envctl down lim >/dev/null 2>&1; echo $?)"
# The link both environments use stays until the last of them goes.
echo "link_after_lim=$(readlink /dev/char/1:9)"
$PY -m envctl plan --down two | grep -o 'removes /dev/char/1:9'
echo "down_two=$($PY -m envctl down two >/dev/null 2>&1; echo $?)"
echo "link_after_two=$(readlink /dev/char/1:9 || echo gone)"
echo "kept_1_3=$(readlink /dev/char/1:3)"
echo "units=$(systemctl list-units --all --plain --no-legend 'envctl*' | wc -l)"
echo "files=$(ls /run/systemd/system | grep -c envctl)"
echo "etc_dropin=$(test -f /etc/systemd/system/envctl-lim.slice.d/10-ops.conf && echo kept)"
echo "control=$(ls /run/systemd/system.control/envctl-lim.slice.d 2>/dev/null | wc -l)"
# A slice somebody else started: refused, never stopped (nor the parent it lives in).
systemd-run --quiet --scope --slice=envctl-other.slice sleep 1000 &
OTHER=$!
wait_for sh -c 'systemctl show -p ActiveState --value envctl-other.slice | grep -qx active'
sed 's/lim/other/' /tmp/cfg/lim.yaml > /tmp/cfg/other.yaml
echo "refused=$($PY -m envctl up other 2>/tmp/refused; echo $?)"
grep -o 'is active and envctl did not start it' /tmp/refused
echo "down_other=$($PY -m envctl down other >/dev/null 2>&1; echo $?)"
echo "other_alive=$(gone $OTHER || echo yes)"
echo "other_state=$(systemctl show -p ActiveState --value envctl-other.slice)"
kill $OTHER || true
"""


def test_systemd_driver_under_nspawn(tmp_path):
    log, res = boot(tmp_path, SCRIPT.format(repo=shlex.quote(str(REPO)),
                                            py=shlex.quote(sys.executable)))
    got = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    tail = f"--- log\n{log}\n--- nspawn\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
    want = {"up": "0", "file": "yes", "ActiveState": "active", "CPUQuotaPerSecUSec": "500ms",
            "MemoryMax": str(64 * 2**20), "TasksMax": "32", "DevicePolicy": "closed",
            "up2": "0", "after-TasksMax": "32", "down": "0", "stubborn_gone": "yes",
            "down2": "0", "units": "0", "files": "0", "etc_dropin": "kept", "control": "0",
            "link_up": "../urandom", "up_two": "0", "link_after_lim": "../urandom",
            "down_two": "0", "link_after_two": "gone", "kept_1_3": "../null",
            "refused": "1", "down_other": "0", "other_alive": "yes", "other_state": "active"}
    assert {k: got.get(k) for k in want} == want, tail
    assert "driver systemd" in log and "TasksMax: 5 -> 32" in log, tail
    assert "in /envctl.slice/envctl-lim.slice/envctl-lim-" in log, tail
    assert "is active and envctl did not start it" in log, tail
    assert "removes /dev/char/1:9" in log, tail
