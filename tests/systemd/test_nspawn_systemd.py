"""The systemd driver under this machine's own systemd 252, booted by systemd-nspawn
(`--volatile=yes`, private network) on this host's hybrid cgroup v1 layout: plan, up, the unit
file, the properties as systemd reports them, status, drift repair, attach, down, down again.

The v1 hierarchies are read-only inside nspawn, so systemd cannot apply the limits there (the
VM test checks those). The host is kept out of it: nspawn runs in a private mount namespace
with a tmpfs on /run/systemd, and from a cgroup of its own that the test removes."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.systemd, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
PREFIX = Path(sys.prefix).resolve()

SCRIPT = """\
exec > /out/log 2>&1
cd {repo}
export PYTHONDONTWRITEBYTECODE=1 ENVCTL_STATE_DIR=/tmp/st ENVCTL_CONFIG_DIR=/tmp/cfg \\
  ENVCTL_RUN_DIR=/tmp/rn COLUMNS=200
mkdir -p /tmp/cfg
printf 'name: lim\\nkind: cpu\\nresources:\\n  driver: systemd\\n  cpu: {{quota: 50%%}}\\n\
  memory: {{max: 64M}}\\n  pids: {{max: 32}}\\n' > /tmp/cfg/lim.yaml
PY={py}
echo "up=$($PY -m envctl up lim >/dev/null 2>&1; echo $?)"
echo "file=$(test -f /run/systemd/system/envctl-lim.slice && echo yes)"
systemctl show -p ActiveState,CPUQuotaPerSecUSec,MemoryMax,TasksMax,DevicePolicy envctl-lim.slice
$PY -m envctl status lim | grep -o 'driver systemd'
systemctl set-property --runtime envctl-lim.slice TasksMax=5
$PY -m envctl status lim | grep -o 'TasksMax: 5 -> 32'
echo "up2=$($PY -m envctl up lim >/dev/null 2>&1; echo $?)"
systemctl show -p TasksMax envctl-lim.slice | sed 's/^/after-/'
$PY -c 'import os; from envctl.host.systemd import Systemd
Systemd.from_env().attach("lim", os.getpid())
print("in", open("/proc/self/cgroup").read().split("::")[-1].strip())'
echo "down=$($PY -m envctl down lim >/dev/null 2>&1; echo $?)"
echo "down2=$($PY -m envctl down lim >/dev/null 2>&1; echo $?)"
echo "units=$(systemctl list-units --all --plain --no-legend 'envctl*' | wc -l)"
echo "files=$(ls /run/systemd/system | grep -c envctl)"
"""
UNIT = """[Service]
Type=oneshot
ExecStart=/bin/sh /out/run.sh
ExecStartPost=/bin/systemctl poweroff --no-block
"""


def test_systemd_driver_under_nspawn(tmp_path):
    if shutil.which("systemd-nspawn") is None:
        pytest.skip("needs systemd-nspawn (systemd-container, scripts/install-deps)")
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.sh").write_text(SCRIPT.format(repo=shlex.quote(str(REPO)),
                                              py=shlex.quote(sys.executable)))
    (tmp_path / "probe.service").write_text(UNIT)
    binds = [f"--bind-ro={REPO}", f"--bind-ro={PREFIX}"]
    if str(Path(sys.executable).resolve()).startswith("/root/"):
        binds.append("--bind-ro=/root")  # pyenv: the interpreter lives under /root
    nspawn = ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "-D", "/",
              "--volatile=yes", "--private-network", *binds, f"--bind={out}:/out",
              f"--bind-ro={tmp_path / 'probe.service'}:/etc/systemd/system/probe.service",
              "-b", "systemd.firstboot=off", "systemd.unit=multi-user.target",
              "systemd.wants=probe.service"]
    # nspawn makes payload/ and supervisor/ cgroups below its own: give it one to remove.
    cg = f"envctl-test-nspawn-{os.getpid()}"
    dirs = [Path("/sys/fs/cgroup", h, cg) for h in ("systemd", "unified")
            if Path("/sys/fs/cgroup", h, "cgroup.procs").exists()]
    for d in dirs:
        d.mkdir()
    enter = "".join(f"echo $$ > {d}/cgroup.procs; " for d in dirs)
    inner = "mount -t tmpfs envctl-test /run/systemd && exec " + shlex.join(nspawn)
    try:
        res = subprocess.run(["sh", "-c", enter + "exec unshare --mount --propagation private "
                              "-- sh -c " + shlex.quote(inner)], capture_output=True,
                             text=True, timeout=240)
    finally:
        for d in dirs:
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(
                    str(p))):
                sub.rmdir()
            d.rmdir()
    log = (out / "log").read_text() if (out / "log").exists() else ""
    got = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    tail = f"--- log\n{log}\n--- nspawn\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
    assert {k: got.get(k) for k in ("up", "file", "ActiveState", "CPUQuotaPerSecUSec",
                                    "MemoryMax", "TasksMax", "DevicePolicy", "up2",
                                    "after-TasksMax", "down", "down2", "units", "files")} == {
        "up": "0", "file": "yes", "ActiveState": "active", "CPUQuotaPerSecUSec": "500ms",
        "MemoryMax": str(64 * 2**20), "TasksMax": "32", "DevicePolicy": "closed", "up2": "0",
        "after-TasksMax": "32", "down": "0", "down2": "0", "units": "0", "files": "0"}, tail
    assert "driver systemd" in log and "TasksMax: 5 -> 32" in log, tail
    assert "in /envctl.slice/envctl-lim.slice/envctl-lim-" in log, tail
