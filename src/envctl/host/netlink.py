"""Links, addresses and routes through rtnetlink, in the host's or a named netns.

Every request, read or change, is a plain rtnetlink message on a socket of envctl's own, and a
read is parsed for the few attributes a check needs. pyroute2 did this before: its import cost
~125 ms of process start, and each request through it ~0.8 ms (a read ~1.4 ms) of request
machinery against ~10 us for the kernel round trip and the parse. The changes envctl makes are
few and fixed (a bridge, a veth pair with its peer born in a namespace, master/up, the
bridge-port isolation flag, an IPv4 address, the default route, deleting links), so their
messages are built here by the pure functions below (unit-tested by decoding them with pyroute2).
Sockets inside a named namespace are made by entering it with setns(2) for the socket() call and
coming straight back, in this thread, with signals held meanwhile. Every reply is bounds-checked
before it is parsed (a malformed one is OSError(EPROTO), never a misparse), and a kernel that
does not answer within `TIMEOUT` seconds is an error rather than a hang.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from envctl.errors import HostError, NamespaceGone
from envctl.host.libc import libc as _libc
from envctl.host.libc import signals_held

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
_ERR = struct.Struct("=i16x")  # nlmsgerr: error, then the request's nlmsghdr (always there)
_DONE = struct.Struct("=i")  # NLMSG_DONE: 0, or the errno that ended the dump
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK, NLM_F_DUMP_INTR, NLM_F_DUMP = 0x1, 0x2, 0x4, 0x10, 0x300
NLM_F_REPLACE, NLM_F_EXCL, NLM_F_CREATE = 0x100, 0x200, 0x400
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
RTM_NEWROUTE, RTM_GETROUTE = 24, 26
IFLA_ADDRESS, IFLA_IFNAME, IFLA_MASTER, IFLA_LINKINFO, IFLA_GROUP = 1, 3, 10, 18, 27
IFLA_NET_NS_FD = 28
IFLA_LINK_NETNSID = 37
IFLA_INFO_KIND, IFLA_INFO_DATA, IFLA_INFO_SLAVE_KIND, IFLA_INFO_SLAVE_DATA = 1, 2, 4, 5
VETH_INFO_PEER = 1
IFLA_BRPORT_ISOLATED = 33
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_GATEWAY, RTA_TABLE = 5, 15
RTPROT_STATIC, RT_SCOPE_UNIVERSE, RTN_UNICAST = 4, 0, 1
NLA_F_NESTED = 0x8000
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
_RECV = 65536  # above the 32 KiB the kernel puts in one dump datagram
_DUMP_TRIES = 5
TIMEOUT = 30.0  # seconds: far beyond any answer of a live kernel, even under load
# Link groups delete_links may tag its links with: far above any a person numbers by hand
# (/etc/iproute2/group names 0 "default"), below the sign bit of a u32 read as int.
GROUP_MIN, GROUP_MAX = 1 << 20, 1 << 31


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
    address: str | None = None  # the hardware address, "02:ab:cd:ef:01:23"


T = TypeVar("T")


def _cause(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror  # os.strerror's text, or what envctl said (a malformed reply)
    code = getattr(exc, "code", None) or getattr(exc, "errno", None)
    if isinstance(code, int) and code > 0:
        return os.strerror(code)
    return str(exc) or type(exc).__name__


# ---------------------------------------------------------------- sockets in a namespace


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def socket_in(path: Path, proto: int = socket.NETLINK_ROUTE) -> socket.socket:
    """A netlink socket that lives in the network namespace bound at `path`.

    A socket stays in the namespace it was made in, so this thread enters the namespace for the
    socket() call only, with signals held until it is back (see signals_held).
    FileNotFoundError when there is no such file; OSError(EINVAL) when it is not a network
    namespace."""
    target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            with signals_held():
                _setns(target)
                try:
                    return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, proto)
                finally:
                    try:
                        _setns(home)
                    except OSError as exc:  # pragma: no cover - setns back into our own netns
                        # Going on in the wrong namespace would change the wrong host: stop
                        # here, before the engine's rollback acts on it.
                        sys.stderr.write(f"envctl: cannot return to the host netns: {exc}\n")
                        os._exit(70)
        finally:
            os.close(home)
    finally:
        os.close(target)


def _malformed(what: str) -> OSError:
    return OSError(errno.EPROTO, f"malformed netlink reply: {what}")


def split(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """The messages of one datagram as (type, flags, seq, body), every length checked against
    what was received; OSError(EPROTO) when one does not fit."""
    out = []
    off = 0
    while off < len(data):
        if len(data) - off < _HDR.size:
            raise _malformed(f"{len(data) - off} stray bytes after the last message")
        length, typ, flags, seq, _ = _HDR.unpack_from(data, off)
        if length < _HDR.size:
            raise _malformed(f"a message of {length} bytes, shorter than its header")
        if length > len(data) - off:
            raise _malformed(f"a message of {length} bytes at offset {off} of a "
                             f"{len(data)}-byte datagram")
        out.append((typ, flags, seq, data[off + _HDR.size:off + length]))
        off += (length + 3) & ~3  # the next starts aligned; the last may go unpadded
    return out


class Requests:
    """Request/response on one netlink socket, returning raw message bodies.

    `broken` is set when a reply could not be read whole (no answer in time, a truncated or
    malformed datagram): the rest of it may still come, or a dump still be running on the
    socket (the kernel refuses a second one with EBUSY), so the socket should not be used
    again. An error the kernel answers with leaves it in step."""

    def __init__(self, sock: socket.socket, *, timeout: float = TIMEOUT):
        self.sock = sock
        self.timeout = timeout
        self.broken = False
        sock.bind((0, 0))
        # SO_RCVTIMEO rather than settimeout(): the socket stays blocking, and a receive that
        # waits longer fails with EAGAIN (struct timeval: seconds, microseconds).
        sec = int(timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("@ll", sec, int((timeout - sec) * 1_000_000)))
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def request(self, mtype: int, payload: bytes, *, dump: bool = False,
                ack: bool = False, flags: int = 0) -> list[bytes]:
        """The bodies of the kernel's replies; OSError(errno) when it answers with an error.
        `ack` asks for the kernel's answer to a change (an empty list when it succeeded);
        `flags` are further nlmsg flags (NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE)."""
        flags |= NLM_F_REQUEST | (NLM_F_DUMP if dump else 0) | (NLM_F_ACK if ack else 0)
        for _ in range(_DUMP_TRIES):
            bodies, interrupted = self._once(mtype, payload, flags)
            if not interrupted:
                return bodies
        # The table kept changing under every dump: say so rather than return a torn one.
        raise OSError(errno.EAGAIN, "netlink dump interrupted")

    def _once(self, mtype: int, payload: bytes, flags: int) -> tuple[list[bytes], bool]:
        self.seq += 1
        seq = self.seq
        self.sock.send(message(mtype, flags, payload, seq))
        bodies: list[bytes] = []
        interrupted = False
        while True:
            for typ, fl, sq, body in self._receive():
                if sq != seq:
                    continue  # a late answer to an earlier request
                interrupted |= bool(fl & NLM_F_DUMP_INTR)
                if typ in (NLMSG_ERROR, NLMSG_DONE):
                    code = self._code(typ, body)
                    if code:
                        raise OSError(-code, os.strerror(-code))
                    return bodies, interrupted
                bodies.append(body)
                if not fl & NLM_F_MULTI:
                    return bodies, interrupted

    def _receive(self) -> list[tuple[int, int, int, bytes]]:
        """The messages of the next datagram, read whole and checked."""
        self.broken = True  # until the datagram is in hand and well formed
        try:
            data, _, msg_flags, _ = self.sock.recvmsg(_RECV)
        except BlockingIOError:  # EAGAIN: SO_RCVTIMEO ran out
            raise OSError(errno.ETIMEDOUT, f"no answer from the kernel within "
                                           f"{self.timeout:g} s") from None
        if msg_flags & socket.MSG_TRUNC:
            raise OSError(errno.EMSGSIZE, f"netlink reply truncated: a datagram over {_RECV} "
                                          "bytes")
        messages = split(data)
        self.broken = False
        return messages

    def _code(self, typ: int, body: bytes) -> int:
        """The errno field of NLMSG_ERROR (0: an ack) or NLMSG_DONE (negative: the dump
        failed part way), checked."""
        name, form = ("error message", _ERR) if typ == NLMSG_ERROR else ("done message", _DONE)
        if len(body) < form.size:
            self.broken = True
            raise _malformed(f"{name} of {len(body)} bytes, expected {form.size}")
        code = form.unpack_from(body)[0]
        if code > 0:
            self.broken = True
            raise _malformed(f"{name} with errno {code}, expected 0 or a negative errno")
        return code


def message(mtype: int, flags: int, payload: bytes, seq: int = 0) -> bytes:
    """A whole netlink message: the nlmsghdr (port id 0: the kernel's) and `payload`."""
    return _HDR.pack(_HDR.size + len(payload), mtype, flags, seq, 0) + payload


def attrs(buf: bytes, off: int = 0) -> dict[int, bytes]:
    """The attributes from `off` on, by type (nested ones stay raw bytes); OSError(EPROTO)
    when one does not fit the buffer."""
    out = {}
    while off + _ATTR.size <= len(buf):
        length, typ = _ATTR.unpack_from(buf, off)
        if length < _ATTR.size:
            raise _malformed(f"attribute type {typ & NLA_TYPE_MASK} of {length} bytes, shorter "
                             "than its header")
        if length > len(buf) - off:
            raise _malformed(f"attribute type {typ & NLA_TYPE_MASK} of {length} bytes runs "
                             f"past its {len(buf) - off}-byte buffer")
        out[typ & NLA_TYPE_MASK] = buf[off + _ATTR.size:off + length]
        off += (length + 3) & ~3
    return out


def _attr(typ: int, value: bytes) -> bytes:
    raw = _ATTR.pack(_ATTR.size + len(value), typ) + value
    return raw + b"\0" * (-len(raw) % 4)


def _nest(typ: int, *inner: bytes) -> bytes:
    """A nested attribute holding the encoded attributes `inner`, flagged NLA_F_NESTED as
    iproute2 does (the kernel accepts it with or without)."""
    return _attr(typ | NLA_F_NESTED, b"".join(inner))


def _cstr(text: str) -> bytes:
    return text.encode() + b"\0"


def _u32_attr(typ: int, value: int) -> bytes:
    return _attr(typ, struct.pack("=I", value))


def _str(raw: bytes | None) -> str | None:
    # Linux takes any bytes but "/", ":" and white space in a link name: a foreign one that is
    # not UTF-8 must not stop a dump (envctl's own names are ASCII).
    return None if raw is None else raw.split(b"\0", 1)[0].decode(errors="replace")


def _int(raw: bytes | None, fmt: str, what: str) -> int | None:
    """The integer in attribute `raw` (None when absent), its size checked."""
    if raw is None:
        return None
    if len(raw) < struct.calcsize(fmt):
        raise _malformed(f"{what} of {len(raw)} bytes, expected {struct.calcsize(fmt)}")
    return struct.unpack_from(fmt, raw)[0]


def _u32(raw: bytes | None, what: str) -> int | None:
    return _int(raw, "=I", what)


def _fixed(form: struct.Struct, body: bytes, name: str) -> tuple[Any, ...]:
    """The fixed header `name` at the start of a message body, its size checked."""
    if len(body) < form.size:
        raise _malformed(f"{name} of {len(body)} bytes, expected {form.size}")
    return form.unpack_from(body)


def _mac(raw: bytes) -> str:
    return ":".join(f"{b:02x}" for b in raw)


def parse_link(body: bytes) -> Link:
    """A Link from the body of an RTM_NEWLINK message."""
    _, _, index, flags, _ = _fixed(_IFINFO, body, "ifinfomsg")
    a = attrs(body, _IFINFO.size)
    info = attrs(a[IFLA_LINKINFO]) if IFLA_LINKINFO in a else {}
    isolated = None
    if _str(info.get(IFLA_INFO_SLAVE_KIND)) == "bridge" and IFLA_INFO_SLAVE_DATA in info:
        flag = _int(attrs(info[IFLA_INFO_SLAVE_DATA]).get(IFLA_BRPORT_ISOLATED), "=B",
                    "bridge port isolation flag")
        isolated = None if flag is None else bool(flag)
    address = a.get(IFLA_ADDRESS)
    return Link(
        index=index,
        name=_str(a.get(IFLA_IFNAME)) or "",
        kind=_str(info.get(IFLA_INFO_KIND)) or "",
        up=bool(flags & IFF_UP),
        master=_u32(a.get(IFLA_MASTER), "link master"),
        isolated=isolated,
        peer_netnsid=_int(a.get(IFLA_LINK_NETNSID), "=i", "link netns id"),
        address=None if address is None else _mac(address),
    )


def parse_address(body: bytes) -> tuple[int, str]:
    """(interface index, `ADDR/PLEN`) from the body of an AF_INET RTM_NEWADDR message."""
    _, plen, _, _, index = _fixed(_IFADDR, body, "ifaddrmsg")
    addr = attrs(body, _IFADDR.size).get(IFA_ADDRESS)
    if addr is None:
        return index, ""
    if len(addr) != 4:
        raise _malformed(f"IPv4 address of {len(addr)} bytes")
    return index, f"{socket.inet_ntoa(addr)}/{plen}"


def parse_default_gateway(body: bytes) -> str | None:
    """The gateway of an AF_INET RTM_NEWROUTE message when it is a main-table default route."""
    _, dst_len, _, _, table, _, _, _, _ = _fixed(_RTMSG, body, "rtmsg")
    a = attrs(body, _RTMSG.size)
    if RTA_TABLE in a:
        table = _u32(a[RTA_TABLE], "route table") or table
    gw = a.get(RTA_GATEWAY)
    if gw is not None and len(gw) != 4:
        raise _malformed(f"IPv4 gateway of {len(gw)} bytes")
    if dst_len != 0 or table != MAIN_TABLE or gw is None:
        return None
    return socket.inet_ntoa(gw)


def parse_group(body: bytes) -> int | None:
    """The link group (IFLA_GROUP) from the body of an RTM_NEWLINK message."""
    return _u32(attrs(body, _IFINFO.size).get(IFLA_GROUP), "link group")


# ---------------------------------------------------------------- the changes, as messages
# Each returns the message type, the nlmsg flags it needs beyond REQUEST and ACK, and the body.
# The bodies match what pyroute2 sent for the same calls (captured with strace) but for
# NLA_F_NESTED on nested attributes (as iproute2 sends them), RTA_TABLE in the route (the
# table is in rtmsg too) and the bridge-port flag: see `setlink_isolated`.


class Change(NamedTuple):
    mtype: int
    flags: int
    body: bytes


def _ifinfo(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return _IFINFO.pack(0, 0, index, flags, change)  # AF_UNSPEC, type 0


def newlink_bridge(name: str) -> Change:
    """`ip link add NAME type bridge`."""
    return Change(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, _ifinfo() + _attr(
        IFLA_IFNAME, _cstr(name)) + _nest(IFLA_LINKINFO, _attr(IFLA_INFO_KIND, _cstr("bridge"))))


def _mac_bytes(mac: str) -> bytes:
    parts = mac.split(":")
    if len(parts) != 6 or not all(len(p) == 2 and p.isascii() and all(
            c in "0123456789abcdefABCDEF" for c in p) for p in parts):
        raise ValueError(f"bad MAC address '{mac}': expected six hex pairs, 02:ab:cd:ef:01:23")
    return bytes(int(p, 16) for p in parts)


def newlink_veth(name: str, peer: str, netns_fd: int, *,
                 peer_address: str | None = None) -> Change:
    """`ip link add NAME type veth peer name PEER [address MAC] netns NS`: the peer is born in
    the namespace open as `netns_fd`, with the hardware address `peer_address` when given.
    VETH_INFO_PEER holds an ifinfomsg of its own, then the peer's attrs."""
    mac = b"" if peer_address is None else _attr(IFLA_ADDRESS, _mac_bytes(peer_address))
    peer_msg = (_ifinfo() + _attr(IFLA_IFNAME, _cstr(peer)) + mac
                + _u32_attr(IFLA_NET_NS_FD, netns_fd))
    return Change(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, _ifinfo() + _attr(
        IFLA_IFNAME, _cstr(name)) + _nest(
            IFLA_LINKINFO, _attr(IFLA_INFO_KIND, _cstr("veth")),
            _nest(IFLA_INFO_DATA, _nest(VETH_INFO_PEER, peer_msg))))


def setlink(index: int, *, up: bool | None = None, master: int | None = None) -> Change:
    """`ip link set DEV [master M] [up|down]` in one request: only what is given changes."""
    flags = IFF_UP if up else 0
    change = IFF_UP if up is not None else 0
    extra = b"" if master is None else _u32_attr(IFLA_MASTER, master)
    return Change(RTM_NEWLINK, 0, _ifinfo(index, flags, change) + extra)


def setlink_isolated(index: int, isolated: bool) -> Change:
    """`ip link set DEV type bridge_slave isolated on|off`: the port's flag through its
    master's slave data. iproute2 names the slave kind in IFLA_INFO_SLAVE_KIND; pyroute2 sent
    IFLA_INFO_KIND "bridge_slave" (which made the kernel ask modprobe for rtnl-link-bridge_slave
    on every call). The kernel takes the slave ops from the device's master either way."""
    return Change(RTM_NEWLINK, 0, _ifinfo(index) + _nest(
        IFLA_LINKINFO, _attr(IFLA_INFO_SLAVE_KIND, _cstr("bridge")),
        _nest(IFLA_INFO_SLAVE_DATA, _attr(IFLA_BRPORT_ISOLATED, bytes([int(isolated)])))))


def setlink_group(index: int, group: int) -> Change:
    """`ip link set DEV group G`."""
    return Change(RTM_NEWLINK, 0, _ifinfo(index) + _u32_attr(IFLA_GROUP, group))


def dellink(index: int = 0, *, group: int | None = None) -> Change:
    """`ip link del DEV` by index, or with `group`, `ip link del group G`: every device of the
    group in the socket's namespace, in one unregister batch."""
    extra = b"" if group is None else _u32_attr(IFLA_GROUP, group)
    return Change(RTM_DELLINK, 0, _ifinfo(0 if group is not None else index) + extra)


def _ifaddr(index: int, cidr: str) -> bytes:
    ip, _, plen = cidr.partition("/")
    raw = socket.inet_aton(ip)
    # Local and peer address both, no broadcast: what pyroute2's `addr add` sent (and `ip addr
    # add ADDR/PLEN` without `brd`).
    return (_IFADDR.pack(AF_INET, int(plen), 0, RT_SCOPE_UNIVERSE, index)
            + _attr(IFA_ADDRESS, raw) + _attr(IFA_LOCAL, raw))


def newaddr(index: int, cidr: str) -> Change:
    """`ip addr add ADDR/PLEN dev DEV` (EEXIST when it is there)."""
    return Change(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, _ifaddr(index, cidr))


def deladdr(index: int, cidr: str) -> Change:
    """`ip addr del ADDR/PLEN dev DEV`."""
    return Change(RTM_DELADDR, 0, _ifaddr(index, cidr))


def replace_default_route(gateway: str) -> Change:
    """`ip route replace default via GW proto static` in the main table. Protocol static is
    what pyroute2 sent (iproute2 would say boot); it only labels the route."""
    return Change(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE, _RTMSG.pack(
        AF_INET, 0, 0, 0, MAIN_TABLE, RTPROT_STATIC, RT_SCOPE_UNIVERSE, RTN_UNICAST, 0)
        + _u32_attr(RTA_TABLE, MAIN_TABLE) + _attr(RTA_GATEWAY, socket.inet_aton(gateway)))


class Netlink:
    """rtnetlink in the host namespace (`netns=None`) or in a named one under `netns_dir`.

    One socket per namespace, for reads and changes alike, made on first need and kept for the
    life of the process, keyed by the namespace's inode, so a namespace deleted and made again
    under the same name gets a fresh one. Nothing read is cached: every read asks the kernel,
    so a check always sees what is there now.
    """

    def __init__(self, netns_dir: Path):
        self.netns_dir = netns_dir
        self._readers: dict[Any, Requests] = {}

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
        if rt is not None and rt.broken:
            rt.close()  # out of step with the kernel: a fresh socket instead
            rt = None
        if rt is None:
            rt = self._readers[key] = Requests(self._socket(netns))
        return rt

    def close(self) -> None:
        for rt in self._readers.values():
            rt.close()
        self._readers.clear()

    def _request(self, what: str, op: str, netns: str | None, mtype: int, payload: bytes, *,
                 dump: bool = False, ack: bool = False, flags: int = 0,
                 ok: tuple[int, ...] = ()) -> list[bytes] | None:
        """One request on envctl's own socket; errnos in `ok` return None, others become
        HostError."""
        return self._parsed(what, op, netns, mtype, payload, bytes, dump=dump, ack=ack,
                            flags=flags, ok=ok)

    def _parsed(self, what: str, op: str, netns: str | None, mtype: int, payload: bytes,
                parse: Callable[[bytes], T], *, dump: bool = False, ack: bool = False,
                flags: int = 0, ok: tuple[int, ...] = ()) -> list[T] | None:
        """`_request`, each body through `parse`: a reply that does not parse is a HostError
        naming the request too."""
        rt = self._reader(netns)
        try:
            return [parse(body) for body in rt.request(mtype, payload, dump=dump, ack=ack,
                                                       flags=flags)]
        except OSError as exc:
            if exc.errno in ok:
                return None
            where = f" in netns '{netns}'" if netns else ""
            raise HostError(f"{what}{where}: {op}: {_cause(exc)}") from exc

    def _change(self, what: str, op: str, netns: str | None, change: Change, *,
                ok: tuple[int, ...] = ()) -> bool:
        """Make `change` and wait for the kernel's answer: True when made, False when the
        kernel answered with an errno in `ok`."""
        return self._request(what, op, netns, change.mtype, change.body, ack=True,
                             flags=change.flags, ok=ok) is not None

    # ------------------------------------------------------------------ links

    def link(self, name: str, *, netns: str | None = None) -> Link | None:
        """The interface called `name`, or None."""
        req = _IFINFO.pack(0, 0, 0, 0, 0) + _attr(IFLA_IFNAME, name.encode() + b"\0")
        links = self._parsed(f"read link '{name}'", "get link", netns, RTM_GETLINK, req,
                             parse_link, ok=(errno.ENODEV,))
        return links[0] if links else None

    def link_by_index(self, index: int, *, netns: str | None = None) -> Link | None:
        links = self._parsed(f"read link #{index}", "get link", netns, RTM_GETLINK,
                             _IFINFO.pack(0, 0, index, 0, 0), parse_link, ok=(errno.ENODEV,))
        return links[0] if links else None

    def add_bridge(self, name: str) -> None:
        self._change(f"create bridge '{name}'", "add link", None, newlink_bridge(name))

    def add_veth(self, name: str, *, peer: str, peer_netns: str,
                 peer_address: str | None = None) -> None:
        """A veth pair whose peer is born inside `peer_netns` already named `peer` (so it never
        clashes with a host interface of the same name, e.g. eth0), with the hardware address
        `peer_address` ("02:ab:cd:ef:01:23") when given, else a random one."""
        self._key(peer_netns)  # NamespaceGone before anything is made
        path = self.netns_dir / peer_netns
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NamespaceGone(f"open netns '{peer_netns}': {path}: no such namespace") from None
        except OSError as exc:
            raise HostError(f"create veth '{name}': open netns '{peer_netns}': "
                            f"{_cause(exc)}") from exc
        try:
            self._change(f"create veth '{name}'", "add link", None,
                         newlink_veth(name, peer, fd, peer_address=peer_address))
        finally:
            os.close(fd)

    def set_link(self, name: str, *, netns: str | None = None, up: bool | None = None,
                 master: int | None = None) -> None:
        link = self._require(name, netns)
        if up is not None or master is not None:
            self._change(f"configure link '{name}'", "set link", netns,
                         setlink(link.index, up=up, master=master))

    def set_isolated(self, name: str, isolated: bool) -> None:
        link = self._require(name, None)
        self._change(f"configure bridge port '{name}'", "set isolated", None,
                     setlink_isolated(link.index, isolated))

    def delete_link(self, name: str, *, netns: str | None = None) -> None:
        """Delete; success when it is already gone (ENODEV) or its namespace is gone."""
        link = self._link_unless_gone(name, netns)
        if link is None:
            return
        self._change(f"remove link '{name}'", "del link", netns, dellink(link.index), ok=GONE)

    def delete_links(self, names: list[str], *,
                     netns: str | None = None) -> dict[str, Exception | None]:
        """Delete the links `names` of one namespace in one kernel batch: {name: None when it
        is gone (or was, or its namespace is), else the HostError}.

        Unregistering a device waits for RCU grace periods, once per unregister call: one
        RTM_DELLINK per link costs 20-30 ms each (16 `ip link del` of veths: 314 ms on the
        development VM), while every device of one group goes in a single unregister batch
        (`ip link del group G` of the same 16: ~10 ms). So the links are tagged with a random
        group G in [2^20, 2^31) that no link of the namespace carries (checked in one dump),
        then deleted with one RTM_DELLINK by group. A device of someone else's could only go
        with them if it were given G between that dump and the delete.

        A link that cannot be tagged gets that error. When the group delete fails (EOPNOTSUPP:
        a device without rtnl dellink, such as lo), the links are deleted one by one, and one
        that still cannot be deleted gets its old group back and its error."""
        names = list(dict.fromkeys(names))
        if len(names) == 1:
            return {names[0]: self._one(names[0], netns)}
        result: dict[str, Exception | None] = {}
        links: dict[str, Link] = {}
        for name in names:
            try:
                link = self.link(name, netns=netns)
            except NamespaceGone:
                return {name: None for name in names}  # every link went with it
            except HostError as exc:
                result[name] = exc
                continue
            if link is None:
                result[name] = None
            else:
                links[name] = link
        if len(links) <= 1:
            result |= {name: self._one(name, netns) for name in links}
            return {name: result[name] for name in names}
        where = f" in netns '{netns}'" if netns else ""
        groups: dict[int, int] = {}
        tagged: list[str] = []
        try:
            groups = dict(self._parsed(
                "read links", "dump links", netns, RTM_GETLINK, _ifinfo(),
                lambda b: (parse_link(b).index, parse_group(b) or 0), dump=True) or [])
            group = _free_group(set(groups.values()))
            for name, link in links.items():
                try:
                    if self._change(f"remove link '{name}'", "set group", netns,
                                    setlink_group(link.index, group), ok=GONE):
                        tagged.append(name)
                    else:
                        result[name] = None  # deleted meanwhile
                except HostError as exc:
                    result[name] = exc
            if tagged:
                self._change(f"remove {len(tagged)} links", "del link group", netns,
                             dellink(group=group), ok=GONE)
        except NamespaceGone:
            return {name: None for name in names}
        except HostError:
            # Not as a batch (the dump, or the group delete): one by one, the old way.
            for name, link in links.items():
                if name in result:
                    continue
                result[name] = self._one(name, netns)
                if result[name] is not None:
                    self._restore_group(link.index, groups.get(link.index), netns)
            return {name: result[name] for name in names}
        for name in tagged:
            try:
                left = self.link(name, netns=netns)
            except NamespaceGone:
                left = None
            except HostError as exc:
                result[name] = exc
                continue
            result[name] = None if left is None else HostError(
                f"remove link '{name}'{where}: del link group: still there")
        return {name: result[name] for name in names}

    def _one(self, name: str, netns: str | None) -> HostError | None:
        try:
            self.delete_link(name, netns=netns)
        except HostError as exc:
            return exc
        return None

    def _restore_group(self, index: int, group: int | None, netns: str | None) -> None:
        """Best effort: give a link that stays its group from before delete_links."""
        if group is None:
            return
        with contextlib.suppress(HostError):
            self._change(f"restore group of link #{index}", "set group", netns,
                         setlink_group(index, group))

    def _link_unless_gone(self, name: str, netns: str | None) -> Link | None:
        """The link, or None when it or its namespace is gone (a removal's success)."""
        try:
            return self.link(name, netns=netns)
        except NamespaceGone:
            return None

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
        found = self._parsed(f"read addresses of '{name}'", "get addr", netns, RTM_GETADDR,
                             _IFADDR.pack(AF_INET, 0, 0, 0, 0), parse_address, dump=True) or []
        return [cidr for index, cidr in found if index == link.index and cidr]

    def add_address(self, name: str, cidr: str, *, netns: str | None = None) -> None:
        link = self._require(name, netns)
        self._change(f"configure link '{name}'", f"add address {cidr}", netns,
                     newaddr(link.index, cidr), ok=(errno.EEXIST,))

    def del_address(self, name: str, cidr: str, *, netns: str | None = None) -> None:
        """Success when the address, the link or the namespace is already gone."""
        link = self._link_unless_gone(name, netns)
        if link is None:
            return
        self._change(f"configure link '{name}'", f"del address {cidr}", netns,
                     deladdr(link.index, cidr), ok=GONE)

    # ------------------------------------------------------------------ routes

    def default_gateway(self, *, netns: str | None = None) -> str | None:
        """The gateway of the IPv4 default route in the main table, or None."""
        gateways = self._parsed("read routes", "get route", netns, RTM_GETROUTE,
                                _RTMSG.pack(AF_INET, 0, 0, 0, 0, 0, 0, 0, 0),
                                parse_default_gateway, dump=True) or []
        return next((gw for gw in gateways if gw), None)

    def set_default_route(self, gateway: str, *, netns: str | None = None) -> None:
        self._change(f"set default route via {gateway}", "replace route", netns,
                     replace_default_route(gateway))


def _free_group(used: set[int]) -> int:
    """A random link group in [GROUP_MIN, GROUP_MAX) not in `used`."""
    while True:
        group = GROUP_MIN + int.from_bytes(os.urandom(4), "little") % (GROUP_MAX - GROUP_MIN)
        if group not in used:
            return group
