"""Per-environment journal and the host-wide ledger of shared resources.

Each is a JSON file plus a write-ahead log beside it. A change (a step begun, one removed, a
holder added) is one line appended to the log with a single write(2) on a file kept open:
the record is in the page cache, so it survives a crash of this process, before the engine
touches the host. At the end of a run the state is folded into the JSON file (written to a
temporary file and renamed, fsynced once) and the log starts afresh. At 32 partitions `up`
made 544 such changes; as whole-file atomic rewrites they cost more than the kernel work.

The JSON file names its log generation (`NAME.<gen>.log`): a crash between writing the file
and deleting the old log leaves a log no file names, which the next fold deletes, so a
record is never replayed onto a state that already holds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envctl.errors import UsageError
from envctl.host.files import read_json, sync_dir, write_json
from envctl.resources.base import Resource

VERSION = 1
_ENV_NAME = re.compile(r"[a-z](?:[a-z0-9-]{0,30}[a-z0-9])?")  # as spec.models.EnvName


class _Store:
    """A JSON state file `DIR/NAME.json` and its write-ahead log `DIR/NAME.<gen>.log`."""

    def __init__(self, path: Path):
        self.path = path
        self.gen = 0
        self._fd: int | None = None

    def load(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The file's content (None when absent) and the log's records, oldest first."""
        data = read_json(self.path)
        self.gen = int(data.get("log", 0)) if data else 0
        try:
            raw = self._log(self.gen).read_bytes()
        except FileNotFoundError:
            return data, []
        records = []
        for line in raw.split(b"\n"):
            try:
                records.append(json.loads(line))
            except ValueError:
                break  # a line cut short by a machine crash: nothing after it was written
        return data, records

    def _log(self, gen: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.{gen}.log")

    def append(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self._log(self.gen),
                               os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.write(self._fd, json.dumps(record, separators=(",", ":")).encode() + b"\n")

    def fold(self, data: dict[str, Any] | None, *, durable: bool) -> None:
        """Make the file hold `data` (delete it for None) and start a new, empty log."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if data is None:
            self.path.unlink(missing_ok=True)
            self.gen = 0
        else:
            self.gen += 1
            write_json(self.path, {**data, "log": self.gen}, durable=durable)
        for log in self.path.parent.glob(f"{self.path.stem}.*.log"):
            if log != self._log(self.gen) or data is None:
                with contextlib.suppress(FileNotFoundError):
                    log.unlink()
        if durable and self.path.parent.is_dir():
            sync_dir(self.path.parent)

    def exists(self) -> bool:
        return self.path.exists() or any(self.path.parent.glob(f"{self.path.stem}.*.log"))


@dataclass
class Entry:
    """One step envctl has begun ('applying') or finished ('applied') for an environment."""

    key: str
    resource: dict[str, Any]
    memo: dict[str, Any]
    status: str
    shared: bool = False

    def load(self) -> Resource:
        return Resource.from_dict(self.resource)


@dataclass
class Journal:
    """What envctl may have made for one environment, in the order it made it."""

    path: Path
    env: str
    entries: list[Entry] = field(default_factory=list)
    store: _Store = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.store = _Store(self.path)

    @classmethod
    def open(cls, state_dir: Path, env: str) -> Journal:
        if not _ENV_NAME.fullmatch(env):
            # Names reach here from the command line (down/status of a spec-less env).
            raise UsageError(f"'{env}' is not an environment name")
        journal = cls(state_dir / "journal" / f"{env}.json", env)
        data, records = journal.store.load()
        if data:
            journal.entries = [Entry(**e) for e in data.get("entries", [])]
        for rec in records:
            if "put" in rec:
                journal._put(Entry(**rec["put"]))
            else:
                journal._drop(rec["drop"])
        return journal

    def exists(self) -> bool:
        return self.store.exists()

    def get(self, key: str) -> Entry | None:
        return next((e for e in self.entries if e.key == key), None)

    def put(self, entry: Entry) -> None:
        """Record `entry` (new, or replacing the one with its key) before the host changes."""
        self._put(entry)
        self.store.append({"put": vars(entry)})

    def drop(self, key: str) -> None:
        self._drop(key)
        self.store.append({"drop": key})

    def _put(self, entry: Entry) -> None:
        for i, e in enumerate(self.entries):
            if e.key == entry.key:
                self.entries[i] = entry
                break
        else:
            self.entries.append(entry)

    def _drop(self, key: str) -> None:
        self.entries = [e for e in self.entries if e.key != key]

    def save(self, *, durable: bool = False) -> None:
        """Fold everything into the journal file (atomically); `durable` also fsyncs."""
        self.store.fold({
            "version": VERSION, "env": self.env, "updated": time.time(),
            "entries": [vars(e) for e in self.entries],
        } if self.entries else None, durable=durable)

    @staticmethod
    def environments(state_dir: Path) -> list[str]:
        """Every environment with a journal file or a log (a first run that never folded)."""
        d = state_dir / "journal"
        if not d.is_dir():
            return []
        return sorted({p.name.split(".", 1)[0] for p in d.iterdir()
                       if p.name.endswith((".json", ".log")) and not p.name.startswith(".")})


@dataclass
class Ledger:
    """Shared resources: who holds each, and the memo taken before the first holder applied it."""

    path: Path
    items: dict[str, dict[str, Any]] = field(default_factory=dict)
    store: _Store = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.store = _Store(self.path)

    @classmethod
    def open(cls, state_dir: Path) -> Ledger:
        ledger = cls(state_dir / "shared.json")
        data, records = ledger.store.load()
        ledger.items = (data or {}).get("items", {})
        for rec in records:
            if "hold" in rec:
                ledger._hold(rec["hold"], rec["env"], rec["item"])
            else:
                ledger._forget(rec["forget"], rec["env"])
        return ledger

    def get(self, key: str) -> dict[str, Any] | None:
        return self.items.get(key)

    def hold(self, key: str, env: str, resource: Resource, memo: dict[str, Any]) -> dict[str, Any]:
        """Add `env` as a holder; the first holder's memo is kept. Returns the memo in force."""
        new = {"resource": resource.to_dict(), "memo": memo}
        item = self._hold(key, env, new)
        self.store.append({"hold": key, "env": env, "item": new})
        return item["memo"]

    def _hold(self, key: str, env: str, new: dict[str, Any]) -> dict[str, Any]:
        item = self.items.setdefault(key, {**new, "holders": []})
        if env not in item["holders"]:
            item["holders"].append(env)
        return item

    def held_by(self, env: str) -> list[str]:
        return [k for k, v in self.items.items() if env in v["holders"]]

    def holders(self, key: str) -> list[str]:
        return list(self.items.get(key, {}).get("holders", []))

    def forget(self, key: str, env: str) -> None:
        if key in self.items:
            self._forget(key, env)
            self.store.append({"forget": key, "env": env})

    def _forget(self, key: str, env: str) -> None:
        item = self.items.get(key)
        if item is None:
            return
        if env in item["holders"]:
            item["holders"].remove(env)
        if not item["holders"]:
            del self.items[key]

    def save(self, *, durable: bool = False) -> None:
        """Fold everything into shared.json (atomically); `durable` also fsyncs."""
        self.store.fold({"version": VERSION, "items": self.items} if self.items else None,
                        durable=durable)
