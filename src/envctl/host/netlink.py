"""Links, addresses and routes through rtnetlink (pyroute2), in the host's or a named netns."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envctl.errors import HostError

IFF_UP = 0x1
AF_INET = 2
MAIN_TABLE = 254
# Errors that mean "already gone" to a delete: no such device / address / route.
GONE = (errno.ENODEV, errno.ENOENT, errno.EADDRNOTAVAIL, errno.ESRCH)


class NamespaceGone(HostError):
    """The named network namespace does not exist (any more)."""


@dataclass(frozen=True)
class Link:
    """What a check needs to know about one interface."""

    index: int
    name: str
    kind: str  # "bridge", "veth", "" for a device without link info (lo, physical)
    up: bool
    master: int | None
    isolated: bool | None  # the bridge-port isolation flag, None when not a bridge port
    peer_netnsid: int | None  # veth: the netns id its peer lives in, as seen from here


def _cause(exc: BaseException) -> str:
    code = getattr(exc, "code", None) or getattr(exc, "errno", None)
    if isinstance(code, int) and code > 0:
        return os.strerror(code)
    return str(exc) or type(exc).__name__


def _errno(exc: BaseException) -> int | None:
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    return getattr(exc, "errno", None)


class Netlink:
    """rtnetlink in the host namespace (`netns=None`) or in a named one under `netns_dir`.

    One socket per namespace is opened on first use and kept for the life of the process
    (opening one in another namespace forks a helper, which a run of 32 environments should
    pay once per namespace, not once per call). Sockets are keyed by the namespace's inode, so
    a namespace deleted and made again under the same name gets a fresh socket.
    """

    def __init__(self, netns_dir: Path):
        self.netns_dir = netns_dir
        self._sockets: dict[Any, Any] = {}

    # ------------------------------------------------------------------ sockets

    def _ipr(self, netns: str | None):  # noqa: ANN202 - pyroute2 is imported lazily
        from pyroute2 import IPRoute

        if netns is None:
            key: Any = None
        else:
            path = self.netns_dir / netns
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise NamespaceGone(f"open netns '{netns}': {path}: no such namespace") from None
            key = (st.st_dev, st.st_ino)
        ipr = self._sockets.get(key)
        if ipr is None:
            try:
                # flags=0: open the namespace, never create it (pyroute2's default creates it).
                ipr = IPRoute() if netns is None else IPRoute(netns=str(path), flags=0)
            except FileNotFoundError:
                raise NamespaceGone(f"open netns '{netns}': {path}: no such namespace") from None
            except OSError as exc:
                raise HostError(f"open netns '{netns}': netlink socket: {_cause(exc)}") from exc
            self._sockets[key] = ipr
        return ipr

    def close(self) -> None:
        for ipr in self._sockets.values():
            ipr.close()
        self._sockets.clear()

    def _do(self, what: str, op: str, netns: str | None, fn: str, *args: Any,
            ok: tuple[int, ...] = (), **kwargs: Any) -> Any:
        """Call `IPRoute.fn`; errnos in `ok` return None, others become HostError."""
        from pyroute2.netlink.exceptions import NetlinkError

        ipr = self._ipr(netns)
        try:
            return getattr(ipr, fn)(*args, **kwargs)
        except (NetlinkError, OSError) as exc:
            if _errno(exc) in ok:
                return None
            where = f" in netns '{netns}'" if netns else ""
            raise HostError(f"{what}{where}: {op}: {_cause(exc)}") from exc

    # ------------------------------------------------------------------ links

    def link(self, name: str, *, netns: str | None = None) -> Link | None:
        """The interface called `name`, or None."""
        # RTM_GETLINK for one name: get_links(ifname=…) would dump every link and filter here.
        msgs = self._do(f"read link '{name}'", "get link", netns, "link", "get", ifname=name,
                        ok=(errno.ENODEV,))
        msgs = list(msgs or ())
        return _link(msgs[0]) if msgs else None

    def link_by_index(self, index: int, *, netns: str | None = None) -> Link | None:
        msgs = self._do(f"read link #{index}", "get link", netns, "link", "get", index=index,
                        ok=(errno.ENODEV,))
        msgs = list(msgs or ())
        return _link(msgs[0]) if msgs else None

    def add_bridge(self, name: str) -> None:
        self._do(f"create bridge '{name}'", "add link", None, "link", "add", ifname=name,
                 kind="bridge")

    def add_veth(self, name: str, *, peer: str, peer_netns: str) -> None:
        """A veth pair whose peer is born inside `peer_netns` already named `peer` (so it never
        clashes with a host interface of the same name, e.g. eth0)."""
        self._ipr(peer_netns)  # NamespaceGone before anything is made
        self._do(f"create veth '{name}'", "add link", None, "link", "add", ifname=name,
                 kind="veth", peer={"ifname": peer, "net_ns_fd": str(self.netns_dir / peer_netns)})

    def set_link(self, name: str, *, netns: str | None = None, up: bool | None = None,
                 master: int | None = None) -> None:
        link = self._require(name, netns)
        kwargs: dict[str, Any] = {}
        if master is not None:
            kwargs["master"] = master
        if up is not None:
            kwargs["state"] = "up" if up else "down"
        if kwargs:
            self._do(f"configure link '{name}'", "set link", netns, "link", "set",
                     index=link.index, **kwargs)

    def set_isolated(self, name: str, isolated: bool) -> None:
        link = self._require(name, None)
        self._do(f"configure bridge port '{name}'", "set isolated", None, "brport", "set",
                 index=link.index, isolated=int(isolated))

    def delete_link(self, name: str, *, netns: str | None = None) -> None:
        """Delete; success when it is already gone (ENODEV) or its namespace is gone."""
        try:
            link = self.link(name, netns=netns)
        except NamespaceGone:
            return
        if link is None:
            return
        self._do(f"remove link '{name}'", "del link", netns, "link", "del", index=link.index,
                 ok=GONE)

    def _require(self, name: str, netns: str | None) -> Link:
        link = self.link(name, netns=netns)
        if link is None:
            where = f" in netns '{netns}'" if netns else ""
            raise HostError(f"configure link '{name}'{where}: get link: no such device")
        return link

    # ------------------------------------------------------------------ addresses

    def ipv4_addresses(self, name: str, *, netns: str | None = None) -> list[str]:
        """The IPv4 addresses of `name` as CIDR strings (`10.0.0.2/24`), in kernel order."""
        link = self.link(name, netns=netns)
        if link is None:
            return []
        msgs = self._do(f"read addresses of '{name}'", "get addr", netns, "get_addr",
                        family=AF_INET, index=link.index)
        return [f"{m.get('IFA_ADDRESS')}/{m['prefixlen']}" for m in msgs or ()]

    def add_address(self, name: str, cidr: str, *, netns: str | None = None) -> None:
        link = self._require(name, netns)
        ip, _, plen = cidr.partition("/")
        self._do(f"configure link '{name}'", f"add address {cidr}", netns, "addr", "add",
                 index=link.index, address=ip, prefixlen=int(plen), ok=(errno.EEXIST,))

    def del_address(self, name: str, cidr: str, *, netns: str | None = None) -> None:
        """Success when the address, the link or the namespace is already gone."""
        try:
            link = self.link(name, netns=netns)
        except NamespaceGone:
            return
        if link is None:
            return
        ip, _, plen = cidr.partition("/")
        self._do(f"configure link '{name}'", f"del address {cidr}", netns, "addr", "del",
                 index=link.index, address=ip, prefixlen=int(plen), ok=GONE)

    # ------------------------------------------------------------------ routes

    def default_gateway(self, *, netns: str | None = None) -> str | None:
        """The gateway of the IPv4 default route in the main table, or None."""
        msgs = self._do("read routes", "get route", netns, "get_routes", family=AF_INET,
                        table=MAIN_TABLE)
        for m in msgs or ():
            if m["dst_len"] == 0 and m.get("RTA_GATEWAY"):
                return m.get("RTA_GATEWAY")
        return None

    def set_default_route(self, gateway: str, *, netns: str | None = None) -> None:
        self._do(f"set default route via {gateway}", "replace route", netns, "route", "replace",
                 dst="0.0.0.0/0", gateway=gateway)

    def del_default_route(self, *, netns: str | None = None) -> None:
        try:
            self._ipr(netns)
        except NamespaceGone:
            return
        self._do("remove default route", "del route", netns, "route", "del", dst="0.0.0.0/0",
                 ok=GONE)


def _link(msg: Any) -> Link:
    info = msg.get("IFLA_LINKINFO")
    kind = (info.get("IFLA_INFO_KIND") if info else None) or ""
    isolated = None
    if info is not None and info.get("IFLA_INFO_SLAVE_KIND") == "bridge":
        data = info.get("IFLA_INFO_SLAVE_DATA")
        flag = data.get("IFLA_BRPORT_ISOLATED") if data is not None else None
        isolated = None if flag is None else bool(flag)
    return Link(
        index=msg["index"],
        name=msg.get("IFLA_IFNAME"),
        kind=kind,
        up=bool(msg["flags"] & IFF_UP),
        master=msg.get("IFLA_MASTER"),
        isolated=isolated,
        peer_netnsid=msg.get("IFLA_LINK_NETNSID"),
    )
