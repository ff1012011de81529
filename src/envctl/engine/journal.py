"""Per-environment journal and the host-wide ledger of shared resources.

Each is a JSON file plus a write-ahead log beside it. A change (a step begun, one removed, a
holder added) is one line appended to the log with whole write(2)s on a file kept open: the
record is in the page cache, so it survives a crash of this process, before the engine
touches the host. At the end of a run the state is folded into the JSON file (written to a
temporary file and renamed, fsynced once) and the log starts afresh. At 32 partitions `up`
made 544 such changes; as whole-file atomic rewrites they cost more than the kernel work.

Generations. The JSON file names its log (`NAME.<gen>.log`), and every fold moves to a
generation no log on disk has: a log left behind by a crash during a fold is never named by the
file, so it is never replayed onto a state that already holds its records. An emptied journal
is folded in three durable steps: first a file that names a new, empty generation, then every
log goes, then the file; a crash between any two leaves either a file naming no log or nothing.
With no file, only a first run's own log (generation 0) can exist.

Boots. Every entry and ledger item records the boot it was made in
(/proc/sys/kernel/random/boot_id). Kernel objects do not survive a reboot, their records do:
opened with the current boot id, entries of volatile kinds from another boot are dropped
without `remove` (what they describe is gone, and a memo taken before the reboot must never be
"restored" after it), and `up` snapshots afresh.

Damage. A file or log that cannot be parsed (a disk error, a hand edit, a newer envctl) is
reported as StateCorrupt naming the file, never a traceback; nothing is rewritten over it.
`Journal.salvage` reads what can still be read for `envctl down --force`. A log line cut short
at its end (a machine crash during an append, or a full disk) ends the log; a short append is
truncated away before the error is raised, so later records never follow a torn one.
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

from envctl.engine.faults import maybe_fault
from envctl.errors import HostError, StateCorrupt, UsageError
from envctl.host.files import read_json, sync_dir, write_all, write_json
from envctl.resources.base import Resource, resource_class

VERSION = 1
_ENV_NAME = re.compile(r"[a-z](?:[a-z0-9-]{0,30}[a-z0-9])?")  # as spec.models.EnvName


def _corrupt(path: Path, why: str) -> StateCorrupt:
    return StateCorrupt(path, why)


class _Store:
    """A JSON state file `DIR/NAME.json` and its write-ahead log `DIR/NAME.<gen>.log`."""

    def __init__(self, path: Path):
        self.path = path
        self.gen = 0
        self._fd: int | None = None
        self._faults = 0

    # ------------------------------------------------------------------ reading

    def load(self, *, salvage: bool = False) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The file's content (None when absent) and the log's records, oldest first.

        StateCorrupt when either cannot be read; with `salvage`, whatever can be: the file
        when it parses, and the log's records up to the first damaged line."""
        try:
            data = read_json(self.path)
        except (ValueError, OSError) as exc:
            if not salvage:
                raise _corrupt(self.path, _why(exc)) from None
            data = None
        if data is not None and not (isinstance(data, dict) and isinstance(data.get("log", 0),
                                                                            int)):
            if not salvage:
                raise _corrupt(self.path, "not an envctl state file")
            data = None
        if data is not None and data.get("version", VERSION) > VERSION:
            raise _corrupt(self.path, f"written by a newer envctl (format {data['version']}, "
                                      f"this one reads {VERSION})")
        self.gen = int(data.get("log", 0)) if data else 0
        log = self._log(self.gen)
        try:
            raw = log.read_bytes()
        except FileNotFoundError:
            return data, []
        except OSError as exc:
            if salvage:
                return data, []
            raise _corrupt(log, exc.strerror or str(exc)) from None
        return data, _records(log, raw, salvage=salvage)

    def _log(self, gen: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.{gen}.log")

    def logs(self) -> list[Path]:
        return sorted(self.path.parent.glob(f"{self.path.stem}.*.log"))

    def exists(self) -> bool:
        return self.path.exists() or bool(self.logs())

    # ------------------------------------------------------------------ writing

    def append(self, record: dict[str, Any]) -> None:
        """One record, whole, at the end of the log; on failure the log is as it was."""
        line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
        try:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self._log(self.gen),
                                   os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            end = os.fstat(self._fd).st_size
            try:
                write_all(self._fd, line)
            except OSError:
                # A short write (ENOSPC) left part of the line: cut it off, so that the next
                # record, or the next run's, never follows a torn one.
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, end)
                raise
        except OSError as exc:
            raise HostError(f"record step in '{self._log(self.gen)}': append: "
                            f"{exc.strerror or exc}") from exc

    def fold(self, data: dict[str, Any], *, keep: bool, durable: bool) -> None:
        """Make the file hold `data` and start a new, empty log; with `keep` False (nothing
        left to record) remove the file and every log instead. See the module docstring for
        why each step comes in this order."""
        self._close()
        if not keep and not self.exists():
            return  # nothing on disk, nothing to record
        self._faults = 0
        try:
            self.gen += 1
            write_json(self.path, {**data, "log": self.gen}, durable=durable)
            self._fault()
            for log in self.logs():
                if not keep or log != self._log(self.gen):
                    with contextlib.suppress(FileNotFoundError):
                        log.unlink()
                    self._fault()
            if durable:
                sync_dir(self.path.parent)  # the logs are gone before the file can go
                self._fault()
            if not keep:
                self.path.unlink()
                self._fault()
                if durable:
                    sync_dir(self.path.parent)
                self.gen = 0
        except OSError as exc:
            raise HostError(f"save '{self.path}': {exc.strerror or exc}; the file on disk is "
                            "the last one written whole") from exc

    def _fault(self) -> None:
        # ENVCTL_FAULT=kill@fold:NAME.json#N stops the fold after its N-th file operation.
        maybe_fault("fold", self.path.name, self._faults)
        self._faults += 1

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return f"not valid JSON ({exc})"


def _records(log: Path, raw: bytes, *, salvage: bool) -> list[dict[str, Any]]:
    """The log's records. A damaged line followed by nothing but damage is a torn end (a crash
    while appending): it ends the log. A damaged line followed by a good record is corruption;
    `salvage` skips damaged lines and reads on."""
    lines = raw.split(b"\n")
    records: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip(b"\0 \t\r"):
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a record")
        except ValueError:
            if salvage:
                continue  # read on: a record after the damage may still name an object
            if not any(_parses(rest) for rest in lines[i + 1:]):
                return records
            raise _corrupt(log, f"line {i + 1} is damaged and records follow it") from None
        records.append(rec)
    return records


def _parses(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _drop_other_boots(kind: str, boot: str, made_in: str) -> bool:
    """Whether a record of `kind` made in boot `made_in` describes nothing any more."""
    if not boot or not made_in or made_in == boot:
        return False
    return resource_class(kind).volatile


@dataclass
class Entry:
    """One step envctl has begun ('applying') or finished ('applied') for an environment."""

    key: str
    resource: dict[str, Any]
    memo: dict[str, Any]
    status: str
    shared: bool = False
    boot: str = ""  # the boot it was made in ("" in journals from before boots were recorded)

    def load(self) -> Resource:
        return Resource.from_dict(self.resource)

    @classmethod
    def parse(cls, raw: Any, where: Path) -> Entry:
        try:
            entry = cls(**raw)
            # The resource must rebuild: a kind this envctl does not know, or fields it does
            # not take (a journal of another version), is damage found now, not a traceback
            # half-way through `down`.
            entry.load()
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise _corrupt(where, f"bad entry {str(raw)[:80]!r}: {exc}") from None
        return entry


@dataclass
class Journal:
    """What envctl may have made for one environment, in the order it made it."""

    path: Path
    env: str
    entries: list[Entry] = field(default_factory=list)
    # What `up` records about the environment besides its steps: `claims` (what it holds that no
    # other may have: address, ports, CPUs, …; so that a spec elsewhere cannot take it while it
    # is up) and `warnings` (what the plan skipped or warned about, for `status`).
    meta: dict[str, Any] = field(default_factory=dict)
    # Entries dropped at open because they describe kernel objects of another boot.
    dropped: list[Entry] = field(default_factory=list)
    store: _Store = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.store = _Store(self.path)

    @classmethod
    def open(cls, state_dir: Path, env: str, *, boot: str = "") -> Journal:
        """The journal of `env`; entries of volatile kinds from a boot other than `boot` are
        dropped ("" keeps everything). StateCorrupt when it cannot be read."""
        journal = cls(journal_path(state_dir, env), env)
        data, records = journal.store.load()
        journal._replay(data, records)
        journal._drop_stale(boot)
        return journal

    @classmethod
    def salvage(cls, state_dir: Path, env: str) -> Journal:
        """What can still be read of a damaged journal: the file if it parses, the log up to
        its first damaged line, entries that parse. For `down --force`."""
        journal = cls(journal_path(state_dir, env), env)
        data, records = journal.store.load(salvage=True)
        for raw in (data or {}).get("entries", []) if isinstance(data, dict) else []:
            with contextlib.suppress(StateCorrupt):
                journal._put(Entry.parse(raw, journal.path))
        for rec in records:
            with contextlib.suppress(StateCorrupt, TypeError, KeyError):
                journal._apply(rec)
        return journal

    def _replay(self, data: dict[str, Any] | None, records: list[dict[str, Any]]) -> None:
        if data:
            raw = data.get("entries", [])
            if not isinstance(raw, list):
                raise _corrupt(self.path, "entries is not a list")
            self.entries = [Entry.parse(e, self.path) for e in raw]
            self.meta = dict(data.get("meta") or {})
        log = self.store._log(self.store.gen)
        for rec in records:
            try:
                self._apply(rec)
            except (TypeError, KeyError) as exc:
                raise _corrupt(log, f"bad record {str(rec)[:80]!r}: {exc}") from None

    def _apply(self, rec: dict[str, Any]) -> None:
        if "put" in rec:
            self._put(Entry.parse(rec["put"], self.store._log(self.store.gen)))
        elif "drop" in rec:
            self._drop(rec["drop"])
        elif "meta" in rec:
            self.meta = dict(rec["meta"])
        else:
            raise KeyError("put, drop or meta")

    def _drop_stale(self, boot: str) -> None:
        keep = []
        for e in self.entries:
            (self.dropped if _drop_other_boots(e.resource["kind"], boot, e.boot)
             else keep).append(e)
        self.entries = keep

    def exists(self) -> bool:
        return self.store.exists()

    def get(self, key: str) -> Entry | None:
        return next((e for e in self.entries if e.key == key), None)

    def put(self, entry: Entry) -> None:
        """Record `entry` (new, or replacing the one with its key) before the host changes."""
        self.store.append({"put": vars(entry)})
        self._put(entry)

    def drop(self, key: str) -> None:
        self.store.append({"drop": key})
        self._drop(key)

    @property
    def claims(self) -> dict[str, Any]:
        return dict(self.meta.get("claims") or {})

    def set_meta(self, meta: dict[str, Any]) -> None:
        """Record `meta` (see the field) when it differs from what is recorded."""
        if meta != self.meta:
            self.store.append({"meta": meta})
            self.meta = dict(meta)

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
        """Fold everything into the journal file (atomically); `durable` also fsyncs. With no
        entries left, the file and its logs go."""
        self.store.fold({"version": VERSION, "env": self.env, "updated": time.time(),
                         "entries": [vars(e) for e in self.entries],
                         "meta": self.meta if self.entries else {}},
                        keep=bool(self.entries), durable=durable)

    @staticmethod
    def environments(state_dir: Path) -> list[str]:
        """Every environment with a journal file or a log (a first run that never folded)."""
        d = state_dir / "journal"
        if not d.is_dir():
            return []
        return sorted({p.name.split(".", 1)[0] for p in d.iterdir()
                       if p.name.endswith((".json", ".log")) and not p.name.startswith(".")})


def journal_path(state_dir: Path, env: str) -> Path:
    """Where `env`'s journal lives; UsageError when `env` is not an environment name."""
    if not _ENV_NAME.fullmatch(env):
        # Names reach here from the command line (down/status of a spec-less env).
        raise UsageError(f"'{env}' is not an environment name")
    return state_dir / "journal" / f"{env}.json"


@dataclass
class Ledger:
    """Shared resources: who holds each, and the memo taken before the first holder applied it."""

    path: Path
    items: dict[str, dict[str, Any]] = field(default_factory=dict)
    dropped: dict[str, dict[str, Any]] = field(default_factory=dict)
    store: _Store = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.store = _Store(self.path)

    @classmethod
    def open(cls, state_dir: Path, *, boot: str = "", salvage: bool = False) -> Ledger:
        """The ledger; items of volatile kinds held since another boot are dropped (their memo
        describes a host that is gone). StateCorrupt when it cannot be read, unless
        `salvage` (for `down --force`): then whatever can be."""
        ledger = cls(state_dir / "shared.json")
        data, records = ledger.store.load(salvage=salvage)
        items = (data or {}).get("items", {})
        if not isinstance(items, dict) or not all(_item_ok(v) for v in items.values()):
            if not salvage:
                raise _corrupt(ledger.path, "items are not a mapping of holders and memos")
            items = {k: v for k, v in items.items() if _item_ok(v)} \
                if isinstance(items, dict) else {}
        ledger.items = items
        for rec in records:
            try:
                if "hold" in rec:
                    ledger._hold(rec["hold"], rec["env"], rec["item"])
                else:
                    ledger._forget(rec["forget"], rec["env"])
            except (TypeError, KeyError, AttributeError) as exc:
                if not salvage:
                    raise _corrupt(ledger.store._log(ledger.store.gen),
                                   f"bad record {str(rec)[:80]!r}: {exc}") from None
        for key, item in list(ledger.items.items()):
            try:
                Resource.from_dict(item["resource"])  # rebuilds, as `down` will need it to
                stale = _drop_other_boots(item["resource"]["kind"], boot, item.get("boot", ""))
            except (ValueError, TypeError, KeyError) as exc:  # a kind or fields not known here
                if not salvage:
                    raise _corrupt(ledger.path, f"bad item {key!r}: {exc}") from None
                del ledger.items[key]
                continue
            if stale:
                ledger.dropped[key] = ledger.items.pop(key)
        return ledger

    def get(self, key: str) -> dict[str, Any] | None:
        return self.items.get(key)

    def hold(self, key: str, env: str, resource: Resource, memo: dict[str, Any], *,
             boot: str = "") -> dict[str, Any]:
        """Add `env` as a holder; the first holder's memo is kept. Returns the memo in force."""
        new = {"resource": resource.to_dict(), "memo": memo, "boot": boot}
        self.store.append({"hold": key, "env": env, "item": new})
        item = self._hold(key, env, new)
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
            self.store.append({"forget": key, "env": env})
            self._forget(key, env)

    def _forget(self, key: str, env: str) -> None:
        item = self.items.get(key)
        if item is None:
            return
        if env in item["holders"]:
            item["holders"].remove(env)
        if not item["holders"]:
            del self.items[key]

    def save(self, *, durable: bool = False) -> None:
        """Fold everything into shared.json (atomically); `durable` also fsyncs. With nothing
        held, the file and its logs go."""
        self.store.fold({"version": VERSION, "items": self.items}, keep=bool(self.items),
                        durable=durable)


def _item_ok(item: Any) -> bool:
    return (isinstance(item, dict) and isinstance(item.get("holders"), list)
            and isinstance(item.get("memo"), dict) and isinstance(item.get("resource"), dict))
