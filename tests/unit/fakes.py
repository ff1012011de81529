"""A fake resource kind whose "kernel" is a dict, for engine tests without root."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from envctl.errors import HostError
from envctl.host.context import Host
from envctl.resources.base import Check, Resource

WORLD: dict[str, str] = {}   # key -> value: the fake kernel's objects
LOG: list[str] = []          # every change, in order
FAIL_ON: set[str] = set()    # names whose apply raises


def reset() -> None:
    WORLD.clear()
    LOG.clear()
    FAIL_ON.clear()


@dataclass(frozen=True)
class Thing(Resource):
    kind = "fake-thing"
    name: str
    value: str = "on"

    def ident(self) -> str:
        return self.name

    def check(self, host: Host) -> Check:
        if self.name not in WORLD:
            return Check.absent()
        return Check.compare({"value": self.value}, {"value": WORLD[self.name]})

    def snapshot(self, host: Host) -> dict[str, Any]:
        return {"old": WORLD.get(self.name)}

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        if self.name in FAIL_ON:
            raise HostError(f"create thing '{self.name}': injected")
        WORLD[self.name] = self.value
        LOG.append(f"apply {self.name}")

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        LOG.append(f"remove {self.name}")
        if memo.get("old") is None:
            WORLD.pop(self.name, None)
        else:
            WORLD[self.name] = memo["old"]


@dataclass(frozen=True)
class SharedThing(Thing):
    kind = "fake-shared"
    shared = True


@dataclass(frozen=True)
class TupleThing(Thing):
    """A resource with a tuple field, which the journal stores as a JSON list."""

    kind = "fake-tuple"
    parts: tuple[str, ...] = ("x", "y")


@dataclass(frozen=True)
class BatchThing(Thing):
    """Removed together with the others of its kind that several `down`s reach at once."""

    kind = "fake-batch"
    batch_remove = True

    @classmethod
    def remove_many(cls, host: Host, items: list[tuple[Resource, dict[str, Any]]]) -> list:
        LOG.append("remove together " + " ".join(res.name for res, _ in items))
        out: list[Exception | None] = []
        for res, _ in items:
            if res.name in FAIL_ON:
                out.append(HostError(f"remove thing '{res.name}': refused"))
            else:
                WORLD.pop(res.name, None)
                out.append(None)
        return out


@dataclass(frozen=True)
class OwnThing(Thing):
    """Does not adopt: refuses when something of the same name is already there."""

    kind = "fake-own"

    def refuses(self, memo: dict[str, Any]) -> str:
        return "exists and was not made by envctl" if memo.get("old") is not None else ""

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        return f"restored {WORLD.get(self.name)} -> {memo['old']}" if memo.get("old") else ""


@dataclass(frozen=True)
class DiskThing(Thing):
    """Survives a reboot (as a directory on disk does)."""

    kind = "fake-disk"
    volatile = False
