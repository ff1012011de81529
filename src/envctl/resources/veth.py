"""The environment's veth pair: host side on the bridge, peer inside the environment's netns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.errors import HostError, NamespaceGone
from envctl.resources.base import Check, Resource, Status

if TYPE_CHECKING:
    from envctl.host.context import Host
    from envctl.host.netlink import Link


@dataclass(frozen=True)
class Veth(Resource):
    """Host side `name` (no address) attached to `bridge`, up, with bridge-port isolation set to
    `isolated`; peer `interface` in netns `netns`, up, with hardware address `mac` (derived from
    the environment's name, so that anti-spoofing can pin it before the pair exists; "" in
    journals from before: any). Deleting either end deletes both, which also takes the peer's
    address and routes with it.

    The host name carries a hash of the environment's name, so anything already there under it
    was not made by envctl (what envctl makes is journalled before it exists): refused, never
    adopted, never deleted."""

    kind = "veth"
    batch_remove = True
    name: str
    bridge: str
    netns: str
    interface: str
    isolated: bool
    mac: str = ""

    def ident(self) -> str:
        return self.name

    def describe(self) -> str:
        iso = ", isolated" if self.isolated else ""
        return f"veth {self.name} on {self.bridge} <-> {self.netns}:{self.interface}{iso}"

    def _state(self, host: Host) -> tuple[Link | None, Link | None]:
        nl = host.netlink
        link = nl.link(self.name)
        try:
            peer = nl.link(self.interface, netns=self.netns)
        except NamespaceGone:
            peer = None
        return link, peer

    def check(self, host: Host) -> Check:
        link, peer = self._state(host)
        if link is None:
            return Check.absent()
        if link.kind != "veth":
            return Check.wrong_kind(f"'{self.name}' exists but is a {link.kind or 'device'}, "
                                    "not a veth")
        master = host.netlink.link_by_index(link.master) if link.master else None
        want = {"master": self.bridge, "state": "up", "isolated": self.isolated,
                "peer": f"{self.netns}:{self.interface} up"}
        have = {"master": master.name if master else "none",
                "state": "up" if link.up else "down",
                "isolated": bool(link.isolated),
                "peer": "missing" if peer is None else
                f"{self.netns}:{self.interface} {'up' if peer.up else 'down'}"}
        if self.mac and peer is not None:
            want["peer mac"], have["peer mac"] = self.mac, peer.address or "unknown"
        return Check.compare(want, have)

    def _wrong_mac(self, peer: Link | None) -> bool:
        return bool(self.mac) and peer is not None and peer.address != self.mac

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        nl = host.netlink
        link, peer = self._state(host)
        if link is not None and link.kind != "veth":
            raise HostError(f"create veth '{self.name}': it exists but is a "
                            f"{link.kind or 'device'}")
        if link is not None and (peer is None or self._wrong_mac(peer)):
            # Host side without its peer in the namespace (peer moved or renamed by hand, or the
            # namespace was replaced), or a peer whose MAC was changed (anti-spoofing drops all
            # it sends): the pair is useless, make it again. Its address and route go with it;
            # the ipconfig step after this one puts them back.
            nl.delete_link(self.name)
            link = None
        if link is None:
            nl.add_veth(self.name, peer=self.interface, peer_netns=self.netns,
                        peer_address=self.mac or None)
            link, peer = self._state(host)
            if link is None or peer is None:
                raise HostError(f"create veth '{self.name}': made, but "
                                f"{'the peer' if link else 'it'} cannot be found")
        bridge = nl.link(self.bridge)
        if bridge is None:
            raise HostError(f"attach veth '{self.name}': bridge '{self.bridge}' does not exist")
        if link.master != bridge.index or not link.up:
            # One request for both, as `ip link set NAME master BRIDGE up`.
            nl.set_link(self.name, master=bridge.index if link.master != bridge.index else None,
                        up=True if not link.up else None)
        # Read again: the bridge-port flags exist only once the link is a port.
        if bool(nl.link(self.name).isolated) != self.isolated:
            nl.set_isolated(self.name, self.isolated)
        if not peer.up:
            nl.set_link(self.interface, netns=self.netns, up=True)

    def snapshot(self, host: Host) -> dict[str, Any]:
        link = host.netlink.link(self.name)
        try:  # an adopted namespace may already have an interface of the peer's name
            peer = host.netlink.link(self.interface, netns=self.netns)
        except NamespaceGone:
            peer = None
        return {"existed": link is not None, "kind": link.kind if link else None,
                "peer_existed": peer is not None}

    def refuses(self, memo: dict[str, Any]) -> str:
        if memo.get("existed"):
            return (f"'{self.name}' already exists (a {memo.get('kind') or 'device'}) and "
                    "envctl did not make it; envctl neither takes it over nor deletes it: "
                    "remove or rename it, or give the environment another name")
        if memo.get("peer_existed"):
            return (f"namespace {self.netns} already has an interface '{self.interface}', "
                    "which envctl did not make; rename it, or choose another "
                    "network.interface for the environment")
        return ""

    @staticmethod
    def _not_ours(host: Host, memo: dict[str, Any]) -> bool:
        """Somebody else's device under this name (a journal from before refusals recorded
        one as found): never deleted."""
        return bool(memo.get("existed"))

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        if not self._not_ours(host, memo):
            host.netlink.delete_link(self.name)  # the peer goes with it; success when gone

    @classmethod
    def remove_many(cls, host: Host,
                    items: list[tuple[Resource, dict[str, Any]]]) -> list[Exception | None]:
        """All in one kernel batch: deleting a veth pair alone waits for RCU (20-30 ms here),
        a batch waits once (Netlink.delete_links)."""
        out: list[Exception | None] = [None] * len(items)
        mine: dict[str, int] = {}
        for i, (res, memo) in enumerate(items):
            assert isinstance(res, Veth)
            try:
                if not res._not_ours(host, memo):
                    mine[res.name] = i
            except HostError as exc:
                out[i] = exc
        for name, exc in host.netlink.delete_links(list(mine)).items():
            out[mine[name]] = exc
        return out


@dataclass(frozen=True)
class IpConfig(Resource):
    """Inside netns `netns`: loopback up, `address` (CIDR) on `interface`, default route via
    `gateway`. These live on the veth peer and the namespace, so `remove` leaves them to the
    Veth and NetNamespace steps that come after it in teardown (and always do): the address
    and the route go with the peer, and a namespace that existed before envctl gets its `lo`
    state and default route back from NetNamespace, which recorded them before this changed
    them."""

    kind = "ipconfig"
    netns: str
    interface: str
    address: str
    gateway: str

    def ident(self) -> str:
        return f"{self.netns}/{self.interface}"

    def describe(self) -> str:
        return f"address {self.address} on {self.netns}:{self.interface}, " \
               f"default route via {self.gateway}"

    def check(self, host: Host) -> Check:
        nl = host.netlink
        try:
            link = nl.link(self.interface, netns=self.netns)
            lo = nl.link("lo", netns=self.netns)
        except NamespaceGone:
            return Check.absent(f"namespace {self.netns} is missing")
        if link is None:
            return Check.absent(f"interface {self.interface} is missing")
        addrs = nl.ipv4_addresses(self.interface, netns=self.netns)
        gw = nl.default_gateway(netns=self.netns)
        route = f"default via {self.gateway}"
        have_addr = self.address if self.address in addrs else ", ".join(addrs) or "missing"
        check = Check.compare(
            {"address": self.address, "route": route, "lo": "up"},
            {"address": have_addr, "route": f"default via {gw}" if gw else "missing",
             "lo": "up" if lo and lo.up else "down"})
        if check.status is Status.DRIFTED and len(check.diffs) == 3 and not addrs:
            return Check(Status.ABSENT, check.diffs)
        return check

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        nl = host.netlink
        lo = nl.link("lo", netns=self.netns)
        if lo is not None and not lo.up:
            nl.set_link("lo", netns=self.netns, up=True)
        addrs = nl.ipv4_addresses(self.interface, netns=self.netns)
        # Addresses changed by hand go first: deleting a primary address after ours was added
        # as its secondary would take ours with it.
        for other in addrs:
            if other != self.address:
                nl.del_address(self.interface, other, netns=self.netns)
        if self.address not in addrs:
            nl.add_address(self.interface, self.address, netns=self.netns)
        if nl.default_gateway(netns=self.netns) != self.gateway:
            nl.set_default_route(self.gateway, netns=self.netns)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        return  # goes with the veth peer and the namespace (see the class docstring)

