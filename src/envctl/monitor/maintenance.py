"""Maintenance mode: `<run>/maintenance.d/<env>`, a small JSON file root writes to pause the
monitor's healing of one environment (`envctl maintenance ENV on|off`, shown in `status`).

The monitor still checks and reports an environment in maintenance (its drift is logged, its
metrics exported); it only does not heal it. The mark is independent of `up` and `down` (an
operator takes the environment down, fixes it, brings it up, then turns maintenance off) and,
in the run directory, lasts until the next boot: after a reboot, healing is back on.

`<run>/maintenance.d/@gpus` (`envctl maintenance --gpus on|off`, the same JSON) pauses the
monitor's GPU sampling instead: it shuts NVML down and holds no GPU node until the mark goes
(monitor/nvmlkeep.py), for `nvidia-smi -r`, a MIG mode change or a driver reload.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from envctl.errors import HostError

DIR = "maintenance.d"  # a dot: never the name of an environment (whose run dirs are beside it)
GPUS = "@gpus"  # the GPU sampling pause: `@` is in no environment's name


def path(run_dir: Path, env: str) -> Path:
    return run_dir / DIR / env


def read(run_dir: Path, env: str) -> dict[str, Any] | None:
    """The mark of `env` ({"since": unix time, "by": uid}) or None when healing is on. A mark
    that is not envctl's (unreadable, not JSON) still counts: whoever wrote it as root wanted
    healing off."""
    try:
        text = path(run_dir, env).read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return {"since": None, "error": exc.strerror}
    try:
        mark = json.loads(text)
    except ValueError:
        return {"since": None, "error": "not envctl's format"}
    return mark if isinstance(mark, dict) else {"since": None}


def paused(run_dir: Path, envs: list[str]) -> dict[str, dict[str, Any]]:
    """env -> mark of those of `envs` in maintenance (one listdir: the monitor asks each
    tick)."""
    try:
        names = set(os.listdir(run_dir / DIR))
    except OSError:
        return {}
    return {env: mark for env in envs if env in names
            and (mark := read(run_dir, env)) is not None}


def set_mode(run_dir: Path, env: str, on: bool, *, now: float | None = None) -> bool:
    """Turn maintenance of `env` on or off; whether anything changed."""
    from envctl.host.files import atomic_write

    p = path(run_dir, env)
    want = "on" if on else "off"
    try:
        if on:
            if p.exists():
                return False  # already on: the first `since` stays
            p.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            mark = {"since": time.time() if now is None else now, "by": os.getuid()}
            atomic_write(p, (json.dumps(mark) + "\n").encode(), durable=False)
            return True
        try:
            p.unlink()
        except FileNotFoundError:
            return False
        with contextlib.suppress(OSError):  # others may still be in maintenance
            p.parent.rmdir()
        return True
    except OSError as exc:
        raise HostError(f"turn maintenance {want} for '{env}': {p}: {exc.strerror}") from exc


def describe(mark: dict[str, Any]) -> str:
    since = mark.get("since")
    if not isinstance(since, int | float):
        return "maintenance: on (healing paused)"
    return ("maintenance: on since " + time.strftime("%Y-%m-%dT%H:%M:%S%z",
                                                     time.localtime(since)) + " (healing paused)")
