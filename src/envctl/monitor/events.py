"""The monitor's events log, `<state>/events.jsonl`: one JSON object a line (what the health
loop found and did to each environment), appended by the monitor and read by `status`.

A line: {"time": 1767000000.5, "env": "box", "event": "healed", "detail": "…"}. Events:
`drift` (found drifted or a service dead; detail: which steps), `healed` (re-converged; detail:
which steps changed), `heal-failed` (the `up` failed and was rolled back; detail: why, and when
the next attempt is due), `heal-deferred` (another envctl held the global lock: tried again next
tick), `heal-skipped` (cannot be healed here: its `down` did not finish, or its journal cannot
be read), `heal-paused` (drifted while in maintenance: `envctl maintenance ENV on`).

The file is history, like job records: `down` leaves it (the state directory then keeps it and
the lock file). It is kept small: past MAX_BYTES it is renamed to `events.jsonl.1` (the one
before is dropped), so it never grows without bound under a failure that keeps recurring.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

FILE = "events.jsonl"
MAX_BYTES = 1 << 20
# `status` reads only the file's tail: the recent events of every environment are in it.
TAIL_BYTES = 256 << 10


def path(state_dir: Path) -> Path:
    return state_dir / FILE


def append(state_dir: Path, env: str, event: str, detail: str = "", *,
           now: float | None = None, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """Append one event (one whole write(2) with O_APPEND: lines from two writers never mix)
    and return it. Rotates the file first when it is larger than `max_bytes`."""
    rec = {"time": round(time.time() if now is None else now, 3), "env": env, "event": event,
           "detail": detail}
    p = path(state_dir)
    with contextlib.suppress(FileNotFoundError):
        if p.stat().st_size > max_bytes:
            p.replace(p.with_name(FILE + ".1"))
    state_dir.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)  # a short write (a full disk) leaves a torn line: readers skip it
    finally:
        os.close(fd)
    return rec


def recent(state_dir: Path, *, per_env: int = 5, envs: list[str] | None = None
           ) -> dict[str, list[dict[str, Any]]]:
    """The last `per_env` events of each environment (of `envs` when given), oldest first,
    from the tail of the log. Read-only; damaged lines are skipped."""
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        with open(path(state_dir), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - TAIL_BYTES))
            data = f.read()
    except FileNotFoundError:
        return out
    lines = data.split(b"\n")
    if len(data) >= TAIL_BYTES:
        lines = lines[1:]  # the first is probably cut
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("env"), str):
            continue
        if envs is not None and rec["env"] not in envs:
            continue
        got = out.setdefault(rec["env"], [])
        got.append(rec)
        if len(got) > per_env:
            del got[0]
    return out


def format_event(rec: dict[str, Any]) -> str:
    """One line for `status`: "2026-11-30T10:34:15 healed: service box (…)"."""
    when = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(float(rec.get("time") or 0)))
    detail = rec.get("detail") or ""
    return f"{when} {rec.get('event')}" + (f": {detail}" if detail else "")
