"""The host bridge environments attach to: created if absent, addressed, up; shared by holders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.errors import HostError
from envctl.resources.base import Check, Resource

if TYPE_CHECKING:
    from envctl.host.context import Host


@dataclass(frozen=True)
class Bridge(Resource):
    """Bridge `name` with `address` (CIDR, the environments' gateway). Shared: every environment
    on it holds it, and it is removed with the last one, and only if envctl created it; a bridge
    that existed is adopted and gets back its address list and its down state."""

    kind = "bridge"
    shared = True
    name: str
    address: str

    def ident(self) -> str:
        return self.name

    def describe(self) -> str:
        return f"bridge {self.name} {self.address}"

    def check(self, host: Host) -> Check:
        link = host.netlink.link(self.name)
        if link is None:
            return Check.absent()
        if link.kind != "bridge":
            return Check.wrong_kind(f"'{self.name}' exists but is a {link.kind or 'device'}, "
                                    "not a bridge")
        addrs = host.netlink.ipv4_addresses(self.name)
        return Check.compare(
            {"address": self.address, "state": "up"},
            {"address": self.address if self.address in addrs else ", ".join(addrs) or "missing",
             "state": "up" if link.up else "down"})

    def snapshot(self, host: Host) -> dict[str, Any]:
        # An operator's bridge is adopted: only what envctl adds to it is taken back (its
        # address, and its state when it was down).
        link = host.netlink.link(self.name)
        return {"existed": link is not None,
                "had_address": link is not None
                and self.address in host.netlink.ipv4_addresses(self.name),
                "was_up": link is not None and link.up}

    def _restore(self, host: Host, memo: dict[str, Any], *, act: bool) -> list[str]:
        """What envctl gives back to an adopted bridge, done when `act`."""
        nl, done = host.netlink, []
        link = nl.link(self.name)
        if link is None:
            return []
        if not memo.get("had_address") and self.address in nl.ipv4_addresses(self.name):
            if act:
                nl.del_address(self.name, self.address)
            done.append(f"address {self.address} removed")
        # Only a memo that recorded the state says it was down (older ones said nothing).
        if memo.get("was_up") is False and link.up:
            if act:
                nl.set_link(self.name, up=False)
            done.append("set down again as found")
        return done

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        if not memo.get("existed"):
            return ""
        return "; ".join(["kept: it existed before envctl", *self._restore(host, memo, act=False)])

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        nl = host.netlink
        link = nl.link(self.name)
        if link is None:
            nl.add_bridge(self.name)
            link = nl.link(self.name)  # fetched again, never assumed
        if link is None or link.kind != "bridge":
            raise HostError(f"create bridge '{self.name}': it exists but is not a bridge")
        if self.address not in nl.ipv4_addresses(self.name):
            nl.add_address(self.name, self.address)
        if not link.up:
            nl.set_link(self.name, up=True)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        if not memo.get("existed"):
            host.netlink.delete_link(self.name)  # success when already gone
        else:
            self._restore(host, memo, act=True)
