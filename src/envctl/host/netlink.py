"""Links, addresses and routes through rtnetlink, in the host's or a named netns.

Reads (one link, a namespace's IPv4 addresses and main-table routes) are plain rtnetlink
requests on a socket of envctl's own, parsed for the few attributes a check needs: a `check`
runs several of them per resource, and through pyroute2 each cost ~1.4 ms of request machinery
against ~10 us for the kernel round trip and the parse. Deleting a link (all `down` does to
links) is one such plain request too. Other changes go through pyroute2, imported only when one
is to be made. Sockets inside a named namespace are made by entering it
with setns(2) for the socket() call and coming straight back, in this thread (pyroute2's own
`netns=` forks a helper per namespace).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envctl.errors import HostError
from envctl.host.libc import libc as _libc

IFF_UP = 0x1
AF_INET = 2
MAIN_TABLE = 254
CLONE_NEWNET = 0x40000000
# Errors that mean "already gone" to a delete: no such device / address / route.
GONE = (errno.ENODEV, errno.ENOENT, errno.EADDRNOTAVAIL, errno.ESRCH)

# rtnetlink, as in <linux/netlink.h>, <linux/rtnetlink.h>, <linux/if_link.h>, <linux/if_addr.h>.
_HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg: family, dst_len, src_len, tos, table, ...
_ATTR = struct.Struct("=HH")  # rtattr: len, type
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_DUMP_INTR, NLM_F_DUMP = 0x1, 0x2, 0x10, 0x300
RTM_DELLINK, RTM_GETLINK, RTM_GETADDR, RTM_GETROUTE = 17, 18, 22, 26
NLM_F_ACK = 0x4
IFLA_IFNAME, IFLA_MASTER, IFLA_LINKINFO, IFLA_LINK_NETNSID = 3, 10, 18, 37
IFLA_INFO_KIND, IFLA_INFO_SLAVE_KIND, IFLA_INFO_SLAVE_DATA = 1, 4, 5
IFLA_BRPORT_ISOLATED = 33
IFA_ADDRESS = 1
RTA_GATEWAY, RTA_TABLE = 5, 15
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
_RECV = 65536
_DUMP_TRIES = 5



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


# ---------------------------------------------------------------- sockets in a namespace


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def socket_in(path: Path, proto: int = socket.NETLINK_ROUTE) -> socket.socket:
    """A netlink socket that lives in the network namespace bound at `path`.

    A socket stays in the namespace it was made in, so this thread enters the namespace for the
    socket() call only. FileNotFoundError when there is no such file; OSError(EINVAL) when it
    is not a network namespace."""
    target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
            try:
                return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, proto)
            finally:
                try:
                    _setns(home)
                except OSError as exc:  # pragma: no cover - setns back into our own netns
                    # Going on in the wrong namespace would change the wrong host: stop here,
                    # before the engine's rollback acts on it.
                    sys.stderr.write(f"envctl: cannot return to the host netns: {exc}\n")
                    os._exit(70)
        finally:
            os.close(home)
    finally:
        os.close(target)


class Requests:
    """Request/response on one NETLINK_ROUTE socket, returning raw message bodies."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.bind((0, 0))
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def request(self, mtype: int, payload: bytes, *, dump: bool = False,
                ack: bool = False) -> list[bytes]:
        """The bodies of the kernel's replies; OSError(errno) when it answers with an error.
        `ack` asks for the kernel's answer to a change (an empty list when it succeeded)."""
        for _ in range(_DUMP_TRIES):
            bodies, interrupted = self._once(mtype, payload, dump, ack)
            if not interrupted:
                return bodies
        # The table kept changing under every dump: say so rather than return a torn one.
        raise OSError(errno.EAGAIN, "netlink dump interrupted")

    def _once(self, mtype: int, payload: bytes, dump: bool,
              ack: bool) -> tuple[list[bytes], bool]:
        self.seq += 1
        seq = self.seq
        flags = NLM_F_REQUEST | (NLM_F_DUMP if dump else 0) | (NLM_F_ACK if ack else 0)
        self.sock.send(_HDR.pack(_HDR.size + len(payload), mtype, flags, seq, 0) + payload)
        bodies: list[bytes] = []
        interrupted = False
        while True:
            data = self.sock.recv(_RECV)
            off = 0
            while off + _HDR.size <= len(data):
                length, typ, fl, sq, _ = _HDR.unpack_from(data, off)
                if length < _HDR.size:
                    raise OSError(errno.EPROTO, "malformed netlink message")
                body = data[off + _HDR.size:off + length]
                off += (length + 3) & ~3
                if sq != seq:
                    continue  # a late answer to an earlier request
                interrupted |= bool(fl & NLM_F_DUMP_INTR)
                if typ == NLMSG_ERROR:
                    code = struct.unpack_from("=i", body)[0]
                    if code:
                        raise OSError(-code, os.strerror(-code))
                    return bodies, interrupted
                if typ == NLMSG_DONE:
                    return bodies, interrupted
                bodies.append(body)
                if not fl & NLM_F_MULTI:
                    return bodies, interrupted


def attrs(buf: bytes, off: int = 0) -> dict[int, bytes]:
    """The attributes from `off` on, by type (nested ones stay raw bytes)."""
    out = {}
    while off + _ATTR.size <= len(buf):
        length, typ = _ATTR.unpack_from(buf, off)
        if length < _ATTR.size:
            break
        out[typ & NLA_TYPE_MASK] = buf[off + _ATTR.size:off + length]
        off += (length + 3) & ~3
    return out


def _attr(typ: int, value: bytes) -> bytes:
    raw = _ATTR.pack(_ATTR.size + len(value), typ) + value
    return raw + b"\0" * (-len(raw) % 4)


def _str(raw: bytes | None) -> str | None:
    return None if raw is None else raw.split(b"\0", 1)[0].decode()


def _u32(raw: bytes | None) -> int | None:
    return None if raw is None else struct.unpack_from("=I", raw)[0]


def parse_link(body: bytes) -> Link:
    """A Link from the body of an RTM_NEWLINK message."""
    _, _, index, flags, _ = _IFINFO.unpack_from(body)
    a = attrs(body, _IFINFO.size)
    info = attrs(a[IFLA_LINKINFO]) if IFLA_LINKINFO in a else {}
    isolated = None
    if _str(info.get(IFLA_INFO_SLAVE_KIND)) == "bridge" and IFLA_INFO_SLAVE_DATA in info:
        flag = attrs(info[IFLA_INFO_SLAVE_DATA]).get(IFLA_BRPORT_ISOLATED)
        isolated = None if flag is None else bool(flag[0])
    netnsid = a.get(IFLA_LINK_NETNSID)
    return Link(
        index=index,
        name=_str(a.get(IFLA_IFNAME)) or "",
        kind=_str(info.get(IFLA_INFO_KIND)) or "",
        up=bool(flags & IFF_UP),
        master=_u32(a.get(IFLA_MASTER)),
        isolated=isolated,
        peer_netnsid=None if netnsid is None else struct.unpack_from("=i", netnsid)[0],
    )


def parse_address(body: bytes) -> tuple[int, str]:
    """(interface index, `ADDR/PLEN`) from the body of an AF_INET RTM_NEWADDR message."""
    _, plen, _, _, index = _IFADDR.unpack_from(body)
    addr = attrs(body, _IFADDR.size).get(IFA_ADDRESS, b"")
    return index, f"{socket.inet_ntoa(addr[:4])}/{plen}" if len(addr) >= 4 else ""


def parse_default_gateway(body: bytes) -> str | None:
    """The gateway of an AF_INET RTM_NEWROUTE message when it is a main-table default route."""
    _, dst_len, _, _, table, _, _, _, _ = _RTMSG.unpack_from(body)
    a = attrs(body, _RTMSG.size)
    if RTA_TABLE in a:
        table = _u32(a[RTA_TABLE]) or table
    gw = a.get(RTA_GATEWAY)
    if dst_len != 0 or table != MAIN_TABLE or gw is None or len(gw) != 4:
        return None
    return socket.inet_ntoa(gw)


class Netlink:
    """rtnetlink in the host namespace (`netns=None`) or in a named one under `netns_dir`.

    Sockets (one for reads, one pyroute2 handle for changes, made on first need) are kept for
    the life of the process, keyed by the namespace's inode, so a namespace deleted and made
    again under the same name gets fresh ones. Nothing read is cached: every read asks the
    kernel, so a check always sees what is there now.
    """

    def __init__(self, netns_dir: Path):
        self.netns_dir = netns_dir
        self._readers: dict[Any, Requests] = {}
        self._sockets: dict[Any, Any] = {}

    # ------------------------------------------------------------------ sockets

    def _key(self, netns: str | None) -> Any:
        if netns is None:
            return None
        path = self.netns_dir / netns
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise NamespaceGone(f"open netns '{netns}': {path}: no such namespace") from None
        return (st.st_dev, st.st_ino)

    def _socket(self, netns: str | None) -> socket.socket:
        if netns is None:
            return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, socket.NETLINK_ROUTE)
        path = self.netns_dir / netns
        try:
            return socket_in(path)
        except FileNotFoundError:
            raise NamespaceGone(f"open netns '{netns}': {path}: no such namespace") from None
        except OSError as exc:
            # EINVAL: the file is not a network namespace (a stale mount point).
            raise HostError(f"open netns '{netns}': netlink socket: {_cause(exc)}") from exc

    def _reader(self, netns: str | None) -> Requests:
        key = self._key(netns)
        rt = self._readers.get(key)
        if rt is None:
            rt = self._readers[key] = Requests(self._socket(netns))
        return rt

    def _ipr(self, netns: str | None):  # noqa: ANN202 - pyroute2 is imported lazily
        from pyroute2 import IPRoute

        key = self._key(netns)
        ipr = self._sockets.get(key)
        if ipr is None:
            sock = self._socket(netns)
            try:
                ipr = IPRoute(fileno=sock.detach())
            except OSError as exc:
                where = f"netns '{netns}'" if netns else "host netns"
                raise HostError(f"open {where}: netlink socket: {_cause(exc)}") from exc
            self._sockets[key] = ipr
        return ipr

    def close(self) -> None:
        for rt in self._readers.values():
            rt.close()
        self._readers.clear()
        for ipr in self._sockets.values():
            ipr.close()
        self._sockets.clear()

    def _request(self, what: str, op: str, netns: str | None, mtype: int, payload: bytes, *,
              dump: bool = False, ack: bool = False,
              ok: tuple[int, ...] = ()) -> list[bytes] | None:
        """One request on envctl's own socket; errnos in `ok` return None, others become
        HostError."""
        rt = self._reader(netns)
        try:
            return rt.request(mtype, payload, dump=dump, ack=ack)
        except OSError as exc:
            if exc.errno in ok:
                return None
            where = f" in netns '{netns}'" if netns else ""
            raise HostError(f"{what}{where}: {op}: {_cause(exc)}") from exc

    def _do(self, what: str, op: str, netns: str | None, fn: str, *args: Any,
            ok: tuple[int, ...] = (), **kwargs: Any) -> Any:
        """Call `IPRoute.fn` (a change); errnos in `ok` return None, others become HostError."""
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
        req = _IFINFO.pack(0, 0, 0, 0, 0) + _attr(IFLA_IFNAME, name.encode() + b"\0")
        bodies = self._request(f"read link '{name}'", "get link", netns, RTM_GETLINK, req,
                            ok=(errno.ENODEV,))
        return parse_link(bodies[0]) if bodies else None

    def link_by_index(self, index: int, *, netns: str | None = None) -> Link | None:
        bodies = self._request(f"read link #{index}", "get link", netns, RTM_GETLINK,
                            _IFINFO.pack(0, 0, index, 0, 0), ok=(errno.ENODEV,))
        return parse_link(bodies[0]) if bodies else None

    def add_bridge(self, name: str) -> None:
        self._do(f"create bridge '{name}'", "add link", None, "link", "add", ifname=name,
                 kind="bridge")

    def add_veth(self, name: str, *, peer: str, peer_netns: str) -> None:
        """A veth pair whose peer is born inside `peer_netns` already named `peer` (so it never
        clashes with a host interface of the same name, e.g. eth0)."""
        self._key(peer_netns)  # NamespaceGone before anything is made
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
        # A plain RTM_DELLINK by index on the reading socket: `down` then never needs pyroute2
        # (~150 ms of import) for the one change it makes to links.
        self._request(f"remove link '{name}'", "del link", netns, RTM_DELLINK,
                   _IFINFO.pack(0, 0, link.index, 0, 0), ack=True, ok=GONE)

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
        bodies = self._request(f"read addresses of '{name}'", "get addr", netns, RTM_GETADDR,
                            _IFADDR.pack(AF_INET, 0, 0, 0, 0), dump=True) or []
        return [cidr for index, cidr in map(parse_address, bodies)
                if index == link.index and cidr]

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
        bodies = self._request("read routes", "get route", netns, RTM_GETROUTE,
                            _RTMSG.pack(AF_INET, 0, 0, 0, 0, 0, 0, 0, 0), dump=True) or []
        for body in bodies:
            gw = parse_default_gateway(body)
            if gw:
                return gw
        return None

    def set_default_route(self, gateway: str, *, netns: str | None = None) -> None:
        self._do(f"set default route via {gateway}", "replace route", netns, "route", "replace",
                 dst="0.0.0.0/0", gateway=gateway)

