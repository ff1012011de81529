"""The GPU quarantine ledger, `<state>/gpu-quarantine.json`: which GPUs envctl keeps out of
every assignment, with the evidence that put them there, until an operator clears them.

    {"gpus": {"GPU-…": {"index": 3, "since": 1767000000.5, "boot": "…",
                        "evidence": [{"what": "xid", "detail": "XID 79 (…)", "seq": 812}]}},
     "cleared": {"GPU-…": {"boot": "…", "seq": 812, "time": 1767000100.0}}}

A quarantine outlives a reboot (a reset clears the hardware's state, not the operator's duty to
look at it). `clear` records the kernel log position it was given, so that XIDs logged before
the operator's reset do not quarantine the GPU again in the same boot. Writes are a read,
change and atomic replace under an flock of `gpu-quarantine.lock`, so two writers (an `up` and
the monitor) never lose each other's findings.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envctl.errors import HostError, StateCorrupt

if TYPE_CHECKING:
    from envctl.host.gpuhealth import Finding

FILE = "gpu-quarantine.json"
LOCK = "gpu-quarantine.lock"


@dataclass
class Quarantine:
    """The ledger as read: quarantined GPUs and the clear marks."""

    gpus: dict[str, dict[str, Any]] = field(default_factory=dict)
    cleared: dict[str, dict[str, Any]] = field(default_factory=dict)

    def reason(self, uuid: str) -> str:
        """One line: why `uuid` is quarantined ("" when it is not)."""
        item = self.gpus.get(uuid)
        if item is None:
            return ""
        return "; ".join(e.get("detail", "?") for e in item.get("evidence", []))

    def reasons(self) -> dict[str, str]:
        return {u: self.reason(u) for u in self.gpus}

    def fresh(self, findings: list[Finding], boot: str) -> list[Finding]:
        """`findings` less the XIDs logged before the GPU's last clear in this boot."""
        out = []
        for f in findings:
            mark = self.cleared.get(f.uuid)
            if (f.what == "xid" and mark and mark.get("boot") == boot
                    and f.seq <= int(mark.get("seq", 0))):
                continue
            out.append(f)
        return out


    def covering(self, uuid: str) -> str:
        """The quarantined GPU `uuid` is or is part of (a MIG device), "" when none."""
        for u, item in self.gpus.items():
            if uuid == u or uuid in item.get("covers", []):
                return u
        return ""


def refuse_quarantined(state_dir: Path, uuids: list[str]) -> None:
    """HostError naming the first of `uuids` that is quarantined (a job must not start on
    it); a ledger that cannot be read refuses too (it cannot say the GPU is fit)."""
    if not uuids or not path(state_dir).exists():
        return
    q = load(state_dir)
    for u in uuids:
        if sick := q.covering(u):
            item = q.gpus[sick]
            raise HostError(f"GPU {item.get('index', '?')} ({sick}) is quarantined: "
                            f"{q.reason(sick)}; the operator resets it and runs "
                            "`envctl gpus --clear`")


def path(state_dir: Path) -> Path:
    return state_dir / FILE


def load(state_dir: Path) -> Quarantine:
    """The ledger (empty when there is none); StateCorrupt when it cannot be read."""
    p = path(state_dir)
    try:
        data = json.loads(p.read_bytes())
    except FileNotFoundError:
        return Quarantine()
    except (OSError, ValueError) as exc:
        raise StateCorrupt(p, f"cannot be read: {exc}") from exc
    gpus, cleared = (data.get("gpus"), data.get("cleared")) if isinstance(data, dict) else (
        None, None)
    if not isinstance(gpus, dict) or not isinstance(cleared, dict) or not all(
            isinstance(v, dict) for v in (*gpus.values(), *cleared.values())):
        raise StateCorrupt(p, "not a mapping of GPUs to evidence")
    return Quarantine(gpus, cleared)


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[Quarantine]:
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        q = load(state_dir)
        yield q
        from envctl.host.files import atomic_write

        atomic_write(path(state_dir), (json.dumps({"gpus": q.gpus, "cleared": q.cleared},
                                                  indent=1, sort_keys=True) + "\n").encode(),
                     mode=0o644)
    finally:
        os.close(fd)


def record(state_dir: Path, findings: list[Finding], *, boot: str,
           now: float | None = None) -> dict[str, str]:
    """Add `findings` (those `fresh` keeps) to the ledger; GPU UUID -> reason of each GPU
    newly quarantined or with new evidence (for events). Nothing is written when nothing is
    new."""
    if not findings:
        return {}
    q = load(state_dir)
    if not _new(q, q.fresh(findings, boot)):
        return {}
    changed: dict[str, str] = {}
    with _locked(state_dir) as q:
        for f in _new(q, q.fresh(findings, boot)):
            item = q.gpus.setdefault(f.uuid, {"index": f.index,
                                              "since": round(now or time.time(), 3),
                                              "boot": boot, "evidence": [],
                                              "covers": list(f.covers)})
            item["evidence"].append({"what": f.what, "detail": f.detail, "seq": f.seq})
            changed[f.uuid] = q.reason(f.uuid)
    return changed


def _new(q: Quarantine, findings: list[Finding]) -> list[Finding]:
    out, seen = [], set()
    for f in findings:
        key = (f.uuid, f.what, f.detail)
        if not f.uuid or key in seen:
            continue
        seen.add(key)
        have = q.gpus.get(f.uuid, {}).get("evidence", [])
        if not any((e.get("what"), e.get("detail")) == (f.what, f.detail) for e in have):
            out.append(f)
    return out


def clear(state_dir: Path, uuid: str, *, boot: str, seq: int,
          now: float | None = None) -> dict[str, Any] | None:
    """Release `uuid` (the operator reset it): its entry removed, and the kernel log position
    `seq` remembered for this boot. The entry that was removed; None when it was not
    quarantined (nothing written)."""
    if uuid not in load(state_dir).gpus:
        return None
    with _locked(state_dir) as q:
        item = q.gpus.pop(uuid, None)
        q.cleared[uuid] = {"boot": boot, "seq": seq, "time": round(now or time.time(), 3)}
    return item
