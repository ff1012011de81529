"""The environment's named network namespace (/run/netns/NAME, usable by `ip netns exec`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.resources.base import Check, Resource

if TYPE_CHECKING:
    from envctl.host.context import Host


@dataclass(frozen=True)
class NetNamespace(Resource):
    kind = "netns"
    name: str

    def ident(self) -> str:
        return self.name

    def describe(self) -> str:
        return f"network namespace {self.name}"

    def check(self, host: Host) -> Check:
        state = host.netns.state(self.name)
        if state == "absent":
            return Check.absent()
        if state == "stale":
            return Check.wrong_kind(f"{host.netns.path(self.name)} is not a bound namespace")
        return Check.present()

    def snapshot(self, host: Host) -> dict[str, Any]:
        # A namespace the operator made by hand before envctl is adopted, never deleted.
        return {"existed": host.netns.state(self.name) == "present"}

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        if host.netns.state(self.name) == "present":
            return  # already so
        host.netns.create(self.name)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        if memo.get("existed"):
            return
        host.netns.remove(self.name)
