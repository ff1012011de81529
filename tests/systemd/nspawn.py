"""Boot this machine's own systemd in systemd-nspawn (`--volatile=yes`, a private network, a
private mount namespace with a tmpfs on /run/systemd, a cgroup of its own removed afterwards)
with unit files bound in and a script run by a oneshot unit that powers the container off."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PREFIX = Path(sys.prefix).resolve()

# ExecStopPost, not ExecStartPost: the container powers off even when the script fails.
PROBE_UNIT = """[Service]
Type=oneshot
ExecStart=/bin/sh /out/run.sh
ExecStopPost=/bin/systemctl poweroff --no-block
"""


def _remove_cgroups(dirs: list[Path]) -> None:
    """Remove the container's cgroups, deepest first; on a timeout the container outlives
    nspawn (killed), so whatever is still in them is killed first (cgroup.kill on cgroup2)."""
    for d in dirs:
        if (d / "cgroup.kill").exists():
            (d / "cgroup.kill").write_text("1")
            deadline = time.monotonic() + 60
            while "populated 1" in (d / "cgroup.events").read_text():
                assert time.monotonic() < deadline, f"{d}: still populated"
                time.sleep(0.05)
    for d in dirs:
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(str(p))):
            sub.rmdir()
        d.rmdir()


def boot(tmp_path: Path, script: str, units: dict[str, str] | None = None,
         timeout: float = 240) -> tuple[str, subprocess.CompletedProcess]:
    """Run `script` (sh, its output in /out/log) as probe.service in a booted container, with
    `units` (name -> text) in its /etc/systemd/system; the log and nspawn's result."""
    if shutil.which("systemd-nspawn") is None:
        pytest.skip("needs systemd-nspawn (systemd-container, scripts/install-deps)")
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.sh").write_text(script)
    unit_binds = []
    for name, text in {"probe.service": PROBE_UNIT, **(units or {})}.items():
        (tmp_path / name).write_text(text)
        unit_binds.append(f"--bind-ro={tmp_path / name}:/etc/systemd/system/{name}")
    binds = [f"--bind-ro={REPO}", f"--bind-ro={PREFIX}"]
    if str(Path(sys.executable).resolve()).startswith("/root/"):
        binds.append("--bind-ro=/root")  # pyenv: the interpreter lives under /root
    nspawn = ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "-D", "/",
              "--volatile=yes", "--private-network", *binds, f"--bind={out}:/out",
              *unit_binds, "-b", "systemd.firstboot=off", "systemd.unit=multi-user.target",
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
                             text=True, timeout=timeout)
    finally:
        _remove_cgroups(dirs)
    log = (out / "log").read_text() if (out / "log").exists() else ""
    return log, res
