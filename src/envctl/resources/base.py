"""The resource contract: a small frozen value with check / snapshot / apply / remove."""

from __future__ import annotations

import dataclasses
import enum
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from envctl.errors import EnvctlError

if TYPE_CHECKING:
    from envctl.host.context import Host

REGISTRY: dict[str, type[Resource]] = {}


class Status(enum.Enum):
    ABSENT = "missing"
    PRESENT = "ok"
    DRIFTED = "drifted"
    WRONG_KIND = "wrong-kind"


@dataclass(frozen=True)
class Diff:
    """One attribute that differs: what the spec wants and what the host has."""

    field: str
    want: object
    have: object

    def __str__(self) -> str:
        return f"{self.field}: {show(self.have)} -> {show(self.want)}"


def show(value: object) -> str:
    """A value as an operator reads it, never a Python repr: lists joined, None as none."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=str) if isinstance(value, set | frozenset) else value
        return ", ".join(show(v) for v in items) or "none"
    return str(value)


@dataclass(frozen=True)
class Check:
    """What `check()` found. Never a bare bool: absent, wrong kind, or present with diffs."""

    status: Status
    diffs: tuple[Diff, ...] = ()
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is Status.PRESENT

    @classmethod
    def absent(cls, detail: str = "") -> Check:
        return cls(Status.ABSENT, detail=detail)

    @classmethod
    def present(cls, detail: str = "") -> Check:
        return cls(Status.PRESENT, detail=detail)

    @classmethod
    def wrong_kind(cls, detail: str) -> Check:
        return cls(Status.WRONG_KIND, detail=detail)

    @classmethod
    def compare(cls, want: dict[str, object], have: dict[str, object], detail: str = "") -> Check:
        """PRESENT when every wanted attribute matches, else DRIFTED with one Diff per mismatch."""
        diffs = tuple(Diff(k, v, have.get(k)) for k, v in want.items() if have.get(k) != v)
        return cls(Status.DRIFTED if diffs else Status.PRESENT, diffs, detail)

    def describe(self) -> str:
        parts = [str(d) for d in self.diffs]
        if self.detail:
            parts.append(self.detail)
        return "; ".join(parts)


@dataclass(frozen=True)
class Resource:
    """One kernel object envctl owns. Subclasses are frozen dataclasses of JSON-simple fields.

    - `check(host)` is read-only and says whether the host matches.
    - `snapshot(host)` is read-only and returns what `remove` needs to restore the host
      (a sysctl's old value, whether an object existed before); the engine journals it
      *before* `apply` runs, so a crash between the change and its record loses nothing.
    - `apply(host, memo)` makes it so and is a no-op when already so.
    - `remove(host, memo)` undoes it; success when it is already gone. It undoes only what
      envctl did: an object that existed before (memo) is never deleted, only given back the
      attributes envctl changed.
    """

    kind: ClassVar[str] = ""
    # Several environments may hold a shared resource (a bridge, a sysctl); the engine removes
    # it when the last holder lets go, with the memo taken by the first.
    shared: ClassVar[bool] = False
    # `down` of several environments gathers the steps of a kind that sets this and removes
    # them together through `remove_many` (see Engine.down_many).
    batch_remove: ClassVar[bool] = False
    # The object lives in the kernel (or on tmpfs) and is gone after a reboot: journal entries
    # and ledger memos of such kinds from another boot are dropped without `remove`, and `up`
    # snapshots afresh (see engine.journal). False for what survives a reboot (a directory on
    # disk), which `down` still removes from an old boot's journal.
    volatile: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            if cls.kind in REGISTRY and REGISTRY[cls.kind] is not cls:
                raise TypeError(f"resource kind '{cls.kind}' registered twice")
            REGISTRY[cls.kind] = cls

    # -- identity
    def ident(self) -> str:
        raise NotImplementedError

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.ident()}"

    def describe(self) -> str:
        return f"{self.kind} {self.ident()}"

    # -- the contract
    def check(self, host: Host) -> Check:
        raise NotImplementedError

    def snapshot(self, host: Host) -> dict[str, Any]:
        return {}

    def refuses(self, memo: dict[str, Any]) -> str:
        """Why envctl will not take over the object its snapshot `memo` describes ("" when it
        will): an object envctl did not make sits where this one goes, and this kind does not
        adopt (a cgroup, a veth). The engine refuses the step before journalling it, so
        nothing of it is ever removed; `plan` shows it as `!`. Kinds that adopt (a namespace,
        a bridge) record `existed` instead and undo only their own changes."""
        return ""

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        """Read-only: what `remove` with `memo` will do to the host now, for `down`, `plan
        --down` and `status` ("1 -> 0", "kept: it existed before envctl"); "" when it simply
        goes."""
        return ""

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        raise NotImplementedError

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        raise NotImplementedError

    @classmethod
    def remove_many(cls, host: Host,
                    items: list[tuple[Resource, dict[str, Any]]]) -> list[Exception | None]:
        """Remove several of this kind; one result per item, None when it went. A kind whose
        kernel objects are cheaper to delete together overrides this; here, one by one."""
        out: list[Exception | None] = []
        for res, memo in items:
            try:
                res.remove(host, memo)
                out.append(None)
            except (EnvctlError, OSError) as exc:
                out.append(exc)
        return out

    # -- serialisation for the journal
    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Resource:
        data = dict(data)
        cls = resource_class(data.pop("kind", None))
        fields = {f.name: f for f in dataclasses.fields(cls)}
        args = {k: _tuplify(v) for k, v in data.items() if k in fields}
        return cls(**args)


def _tuplify(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_tuplify(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _tuplify(x)) for k, x in v.items()))
    return v


def resource_class(kind: Any) -> type[Resource]:
    """The class of `kind`, importing its module on first use."""
    cls = REGISTRY.get(kind)
    if cls is None:
        from envctl.resources import MODULES

        if kind not in MODULES:
            raise ValueError(f"unknown resource kind {kind!r} in journal")
        importlib.import_module(f"envctl.resources.{MODULES[kind]}")
        cls = REGISTRY[kind]
    return cls

