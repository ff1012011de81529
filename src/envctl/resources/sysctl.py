"""Kernel parameters under /proc/sys: set to the spec's value, restored to the value found."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.errors import HostError
from envctl.host.procfs import normalize
from envctl.resources.base import Check, Resource
from envctl.spec.sysctls import canonical

if TYPE_CHECKING:
    from envctl.host.context import Host


@dataclass(frozen=True)
class Sysctl(Resource):
    """`name` = `value`. Shared: environments wanting the same value hold it together and the
    value found before the first of them is restored when the last one goes.

    The name is canonical (envctl.spec.sysctls): two spellings of one kernel value, such as
    net.ipv4.conf.all.forwarding and net.ipv4.ip_forward, are one resource and one ledger key,
    so the value found is remembered once and restored once.
    """

    kind = "sysctl"
    shared = True
    name: str
    value: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", canonical(self.name))

    def ident(self) -> str:
        return self.name

    def describe(self) -> str:
        return f"sysctl {self.name} = {self.value}"

    def check(self, host: Host) -> Check:
        have = host.sysctl.read(self.name)
        if have is None:
            link = interface(self.name)
            if link is not None and not host.sysctl.path(self.name).parent.exists():
                # A per-interface value of a link not there yet (a bridge an earlier step of
                # the plan makes): it will start with the `default` entry's value, which is
                # what `up` will find and change (or keep), not a kernel without the parameter.
                parts = self.name.split(".")
                start = host.sysctl.read(".".join([*parts[:3], "default", parts[4]]))
                return Check.compare({"value": normalize(self.value)}, {"value": start},
                                     f"interface {link} does not exist yet")
            return Check.wrong_kind(f"this kernel has no sysctl {self.name}")
        return Check.compare({"value": normalize(self.value)}, {"value": have})

    def snapshot(self, host: Host) -> dict[str, Any]:
        return {"old": host.sysctl.read(self.name)}

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        if host.sysctl.read(self.name) is None:
            raise HostError(f"set sysctl '{self.name}': this kernel has no such parameter")
        if host.sysctl.read(self.name) == normalize(self.value):
            return  # already so
        host.sysctl.write(self.name, self.value)

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        old, have = memo.get("old"), host.sysctl.read(self.name)
        if old is None or have is None:
            return ""
        return f"restored {have} -> {old}" if have != old else f"left at {old}, as found"

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        old = memo.get("old")
        if old is None:
            return  # the parameter did not exist when we looked: nothing to restore
        if host.sysctl.read(self.name) in (None, old):
            return  # already the value we found (or the netns holding it is gone)
        host.sysctl.write(self.name, old)


def interface(name: str) -> str | None:
    """The interface a per-interface sysctl (`net.ipv4.conf.IFACE.x`, `net.ipv6.conf.IFACE.x`)
    belongs to; None for any other, and for the `all` and `default` entries."""
    parts = name.split(".")
    if len(parts) == 5 and parts[0] == "net" and parts[2] in ("conf", "neigh") \
            and parts[3] not in ("all", "default"):
        return parts[3].replace("/", ".")
    return None
