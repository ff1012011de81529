"""Per-environment journal and the host-wide ledger of shared resources, written atomically."""

from __future__ import annotations

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

    @classmethod
    def open(cls, state_dir: Path, env: str) -> Journal:
        if not _ENV_NAME.fullmatch(env):
            # Names reach here from the command line (down/status of a spec-less env).
            raise UsageError(f"'{env}' is not an environment name")
        path = state_dir / "journal" / f"{env}.json"
        data = read_json(path)
        journal = cls(path, env)
        if data:
            journal.entries = [Entry(**e) for e in data.get("entries", [])]
        return journal

    def exists(self) -> bool:
        return self.path.exists()

    def get(self, key: str) -> Entry | None:
        return next((e for e in self.entries if e.key == key), None)

    def put(self, entry: Entry) -> None:
        for i, e in enumerate(self.entries):
            if e.key == entry.key:
                self.entries[i] = entry
                break
        else:
            self.entries.append(entry)
        self.save()

    def drop(self, key: str, *, save: bool = True) -> None:
        self.entries = [e for e in self.entries if e.key != key]
        if save:
            self.save()

    def save(self, *, durable: bool = False) -> None:
        """Write atomically; `durable` (once per run, see host.files) also fsyncs."""
        if not self.entries:
            self.path.unlink(missing_ok=True)
            if durable and self.path.parent.is_dir():
                sync_dir(self.path.parent)
            return
        write_json(self.path, {
            "version": VERSION, "env": self.env, "updated": time.time(),
            "entries": [vars(e) for e in self.entries],
        }, durable=durable)

    @staticmethod
    def environments(state_dir: Path) -> list[str]:
        d = state_dir / "journal"
        return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []


@dataclass
class Ledger:
    """Shared resources: who holds each, and the memo taken before the first holder applied it."""

    path: Path
    items: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def open(cls, state_dir: Path) -> Ledger:
        path = state_dir / "shared.json"
        return cls(path, (read_json(path) or {}).get("items", {}))

    def get(self, key: str) -> dict[str, Any] | None:
        return self.items.get(key)

    def hold(self, key: str, env: str, resource: Resource, memo: dict[str, Any]) -> dict[str, Any]:
        """Add `env` as a holder; the first holder's memo is kept. Returns the memo in force."""
        item = self.items.setdefault(key, {"resource": resource.to_dict(), "memo": memo,
                                           "holders": []})
        if env not in item["holders"]:
            item["holders"].append(env)
        self.save()
        return item["memo"]

    def held_by(self, env: str) -> list[str]:
        return [k for k, v in self.items.items() if env in v["holders"]]

    def holders(self, key: str) -> list[str]:
        return list(self.items.get(key, {}).get("holders", []))

    def forget(self, key: str, env: str, *, save: bool = True) -> None:
        item = self.items.get(key)
        if item is None:
            return
        if env in item["holders"]:
            item["holders"].remove(env)
        if not item["holders"]:
            del self.items[key]
        if save:
            self.save()

    def save(self, *, durable: bool = False) -> None:
        if not self.items:
            self.path.unlink(missing_ok=True)
            if durable and self.path.parent.is_dir():
                sync_dir(self.path.parent)
            return
        write_json(self.path, {"version": VERSION, "items": self.items}, durable=durable)
