"""rtnetlink without root: replies that are short, long, truncated, failed or never come; the
veth peer's address; signals held across a namespace switch."""

from __future__ import annotations

import errno
import os
import signal
import socket
import struct
from pathlib import Path

import pytest

from envctl.errors import HostError
from envctl.host import libc, netlink
from envctl.host.netlink import (
    NLM_F_MULTI,
    NLMSG_DONE,
    NLMSG_ERROR,
    RTM_GETLINK,
    RTM_NEWLINK,
    Netlink,
    Requests,
    attrs,
    message,
    parse_address,
    parse_default_gateway,
    parse_link,
)


class FakeSocket:
    """A netlink socket whose kernel answers with the datagrams queued here, one per receive;
    with none left it does what SO_RCVTIMEO makes recvmsg(2) do when nothing came in time."""

    def __init__(self, *datagrams: bytes):
        self.queue = list(datagrams)
        self.sent: list[bytes] = []
        self.options: dict[tuple[int, int], bytes] = {}
        self.closed = False

    def bind(self, addr) -> None:
        pass

    def setsockopt(self, level: int, name: int, value: bytes) -> None:
        self.options[(level, name)] = value

    def send(self, data: bytes) -> int:
        self.sent.append(bytes(data))
        return len(data)

    def recvmsg(self, bufsize: int, ancbufsize: int = 0, flags: int = 0):
        if not self.queue:
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        data = self.queue.pop(0)
        return data[:bufsize], [], socket.MSG_TRUNC if len(data) > bufsize else 0, (0, 0)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        return self.recvmsg(bufsize)[0]  # as recv(2): the rest of a long datagram is lost

    def close(self) -> None:
        self.closed = True


LINK = netlink._ifinfo(7, netlink.IFF_UP) + netlink._attr(netlink.IFLA_IFNAME, b"v0\0")


def _error(code: int, seq: int = 1) -> bytes:
    """An NLMSG_ERROR as the kernel sends it: the errno, then the request's header."""
    return message(NLMSG_ERROR, 0, struct.pack("=i", code) + bytes(16), seq)


def _dump(*datagrams: bytes) -> list[bytes]:
    return Requests(FakeSocket(*datagrams)).request(RTM_GETLINK, b"", dump=True)


def _protocol_error(excinfo, *words: str) -> None:
    assert excinfo.value.errno == errno.EPROTO
    for word in words:
        assert word in str(excinfo.value)


# ---------------------------------------------------------------- whole replies


def test_a_dump_ends_with_done():
    one = message(RTM_NEWLINK, NLM_F_MULTI, LINK, 1)
    assert _dump(one, one + message(NLMSG_DONE, NLM_F_MULTI, struct.pack("=i", 0), 1)) == \
        [LINK, LINK]


def test_done_carrying_an_errno_is_the_dump_failing():
    # The kernel ends a dump that failed part way with the errno in NLMSG_DONE's payload.
    failed = message(RTM_NEWLINK, NLM_F_MULTI, LINK, 1) + message(
        NLMSG_DONE, NLM_F_MULTI, struct.pack("=i", -errno.EMSGSIZE), 1)
    with pytest.raises(OSError) as excinfo:
        _dump(failed)
    assert excinfo.value.errno == errno.EMSGSIZE


def test_done_without_its_errno_is_malformed():
    with pytest.raises(OSError) as excinfo:
        _dump(message(NLMSG_DONE, NLM_F_MULTI, b"", 1))
    _protocol_error(excinfo, "done")


def test_kernel_errors_and_acks():
    rt = Requests(FakeSocket(_error(-errno.ENODEV), _error(0, seq=2)))
    with pytest.raises(OSError) as excinfo:
        rt.request(RTM_GETLINK, LINK)
    assert excinfo.value.errno == errno.ENODEV and not rt.broken
    assert rt.request(RTM_NEWLINK, LINK, ack=True) == []


@pytest.mark.parametrize("body", [b"", b"\xff\xff", struct.pack("=i", -errno.ENODEV)])
def test_truncated_error_message(body):
    # struct nlmsgerr is the errno and the request's nlmsghdr: 20 bytes, always.
    rt = Requests(FakeSocket(message(NLMSG_ERROR, 0, body, 1)))
    with pytest.raises(OSError) as excinfo:
        rt.request(RTM_GETLINK, LINK)
    _protocol_error(excinfo, "error message")
    assert rt.broken


def test_message_shorter_than_its_header():
    bad = struct.pack("=IHHII", 8, RTM_NEWLINK, 0, 1, 0)
    with pytest.raises(OSError) as excinfo:
        _dump(bad)
    _protocol_error(excinfo, "8 bytes", "header")


def test_message_longer_than_the_datagram():
    whole = message(RTM_NEWLINK, 0, LINK, 1)
    with pytest.raises(OSError) as excinfo:
        _dump(whole[:24])  # the header says more than came
    _protocol_error(excinfo, f"{len(whole)} bytes", "24")


def test_stray_bytes_after_the_last_message():
    with pytest.raises(OSError) as excinfo:
        _dump(message(RTM_NEWLINK, 0, LINK, 1) + bytes(8))
    _protocol_error(excinfo, "8 stray bytes")


def test_answers_to_earlier_requests_are_skipped():
    late = message(RTM_NEWLINK, 0, b"late" + LINK, 0)
    assert _dump(late + message(RTM_NEWLINK, 0, LINK, 1)) == [LINK]


def test_truncated_datagram_is_refused_not_half_parsed():
    # Two messages in one datagram longer than the receive buffer: recv(2) would hand over the
    # first and silently drop the second.
    first = message(RTM_NEWLINK, NLM_F_MULTI, LINK, 1)
    pad = netlink._attr(netlink.IFLA_GROUP, bytes(netlink._RECV - len(first) - 4))
    first = message(RTM_NEWLINK, NLM_F_MULTI, LINK + pad, 1)
    assert len(first) == netlink._RECV
    rt = Requests(FakeSocket(first + message(NLMSG_DONE, NLM_F_MULTI, bytes(4), 1)))
    with pytest.raises(OSError) as excinfo:
        rt.request(RTM_GETLINK, b"", dump=True)
    assert excinfo.value.errno == errno.EMSGSIZE and "truncated" in str(excinfo.value)
    assert rt.broken


def test_receive_timeout_is_set_and_silence_is_an_error():
    sock = FakeSocket()
    rt = Requests(sock)
    sec, usec = struct.unpack("@ll", sock.options[(socket.SOL_SOCKET, socket.SO_RCVTIMEO)])
    assert (sec, usec) == (30, 0)
    with pytest.raises(OSError) as excinfo:
        rt.request(RTM_GETLINK, LINK)
    assert excinfo.value.errno == errno.ETIMEDOUT
    assert "no answer from the kernel within 30 s" in str(excinfo.value)
    assert rt.broken


class _Mute:
    """A real datagram socket nobody answers on (netlink has no such kernel)."""

    def __init__(self):
        self.sock, self.peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)

    def bind(self, addr) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def close(self) -> None:
        self.sock.close()
        self.peer.close()


@pytest.mark.timeout(30)
def test_a_real_socket_times_out_rather_than_hangs():
    mute = _Mute()
    try:
        rt = Requests(mute, timeout=0.2)
        with pytest.raises(OSError) as excinfo:
            rt.request(RTM_GETLINK, LINK)
        assert excinfo.value.errno == errno.ETIMEDOUT
    finally:
        mute.close()


def _netlink_on(monkeypatch, *socks: FakeSocket) -> Netlink:
    made = iter(socks)
    monkeypatch.setattr(Netlink, "_socket", lambda self, netns: next(made))
    return Netlink(Path("/nonexistent"))


def test_silence_is_a_host_error_naming_the_request_and_the_socket_is_replaced(monkeypatch):
    first, second = FakeSocket(), FakeSocket(message(RTM_NEWLINK, 0, LINK, 1))
    nl = _netlink_on(monkeypatch, first, second)
    with pytest.raises(HostError, match=r"^read link 'v0': get link: no answer from the kernel"):
        nl.link("v0")
    # The first socket may still get the late answer: the next request has a fresh one.
    assert nl.link("v0").index == 7
    assert first.closed and not second.closed


def test_malformed_answer_is_a_host_error(monkeypatch):
    short = message(RTM_NEWLINK, 0, LINK[:6], 1)
    nl = _netlink_on(monkeypatch, FakeSocket(short))
    with pytest.raises(HostError, match=r"^read link 'v0': get link: .*ifinfomsg"):
        nl.link("v0")


def test_the_real_kernel_answers_through_the_checks():
    # Read-only, no root: the loopback device of the namespace the tests run in.
    nl = Netlink(Path("/nonexistent"))
    try:
        lo = nl.link("lo")
        assert lo is not None and lo.index == 1 and lo.address == "00:00:00:00:00:00"
        assert nl.link("envctl-no-such") is None
    finally:
        nl.close()


# ---------------------------------------------------------------- attributes and bodies


def test_attributes_must_fit_their_buffer():
    ok = netlink._attr(netlink.IFLA_IFNAME, b"v0\0")
    assert attrs(ok) == {netlink.IFLA_IFNAME: b"v0\0"}
    assert attrs(struct.pack("=HH", 7, 3) + b"v0\0") == {3: b"v0\0"}  # last one unpadded
    with pytest.raises(OSError) as excinfo:
        attrs(ok + struct.pack("=HH", 2, 3))
    _protocol_error(excinfo, "attribute", "2 bytes")
    with pytest.raises(OSError) as excinfo:
        attrs(ok + struct.pack("=HH", 40, 3) + b"v0\0")
    _protocol_error(excinfo, "attribute", "runs past")


@pytest.mark.parametrize(("parse", "size", "struct_name"), [
    (parse_link, 15, "ifinfomsg"), (parse_address, 7, "ifaddrmsg"),
    (parse_default_gateway, 11, "rtmsg")])
def test_bodies_shorter_than_their_fixed_part(parse, size, struct_name):
    with pytest.raises(OSError) as excinfo:
        parse(bytes(size))
    _protocol_error(excinfo, struct_name)


def _link_with(*attributes: bytes) -> bytes:
    return netlink._ifinfo(7) + b"".join(attributes)


@pytest.mark.parametrize("body", [
    _link_with(netlink._attr(netlink.IFLA_MASTER, b"\1\0")),
    _link_with(netlink._attr(netlink.IFLA_LINK_NETNSID, b"\1")),
    _link_with(netlink._nest(netlink.IFLA_LINKINFO, netlink._attr(
        netlink.IFLA_INFO_SLAVE_KIND, b"bridge\0"), netlink._nest(
        netlink.IFLA_INFO_SLAVE_DATA, netlink._attr(netlink.IFLA_BRPORT_ISOLATED, b"")))),
    _link_with(netlink._nest(netlink.IFLA_LINKINFO, struct.pack("=HH", 40, 1))),
], ids=["master", "netnsid", "isolated", "linkinfo"])
def test_short_link_attributes(body):
    with pytest.raises(OSError) as excinfo:
        parse_link(body)
    assert excinfo.value.errno == errno.EPROTO


def test_short_address_and_gateway_attributes():
    addr = netlink._IFADDR.pack(2, 24, 0, 0, 5) + netlink._attr(netlink.IFA_ADDRESS, b"\n\0")
    with pytest.raises(OSError) as excinfo:
        parse_address(addr)
    _protocol_error(excinfo, "address")
    route = netlink._RTMSG.pack(2, 0, 0, 0, 254, 4, 0, 1, 0) + netlink._attr(
        netlink.RTA_GATEWAY, b"\n\0\0")
    with pytest.raises(OSError) as excinfo:
        parse_default_gateway(route)
    _protocol_error(excinfo, "gateway")


def test_a_name_that_is_not_utf8_does_not_stop_a_dump():
    link = parse_link(_link_with(netlink._attr(netlink.IFLA_IFNAME, b"v\xff\0")))
    assert link.name.startswith("v") and link.index == 7


# ---------------------------------------------------------------- the veth peer's address


VETH_WITHOUT_ADDRESS = (
    "000000000000000000000000000000001400030076652d6370752d636f2d6632663165003c001280090001007665"
    "7468000000002c000280280001800000000000000000000000000000000009000300657468300000000008001c00"
    "0b000000")


def test_veth_without_peer_address_is_unchanged():
    change = netlink.newlink_veth("ve-cpu-co-f2f1e", "eth0", 11)
    assert change.body.hex() == VETH_WITHOUT_ADDRESS
    assert change.flags == netlink.NLM_F_CREATE | netlink.NLM_F_EXCL


def _peer_attrs(change) -> list[tuple[str, object]]:
    """The peer's attributes in a veth RTM_NEWLINK, as pyroute2 decodes them."""
    from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

    data = message(change.mtype, change.flags | netlink.NLM_F_REQUEST | netlink.NLM_F_ACK,
                   change.body, 9)
    msg = ifinfmsg(data)
    msg.decode()
    assert msg["header"]["length"] == len(data) and len(data) % 4 == 0
    assert msg.get_attr("IFLA_ADDRESS") is None  # the host end keeps a random one
    peer = msg.get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA", "VETH_INFO_PEER")
    return [(a.name, a.value) for a in peer["attrs"]]


def test_veth_peer_address_is_set_inside_the_peer():
    change = netlink.newlink_veth("ve-cpu-co-f2f1e", "eth0", 11, peer_address="02:AB:cd:ef:01:23")
    assert _peer_attrs(change) == [
        ("IFLA_IFNAME", "eth0"), ("IFLA_ADDRESS", "02:ab:cd:ef:01:23"), ("IFLA_NET_NS_FD", 11)]


@pytest.mark.parametrize("mac", ["02:ab:cd:ef:01", "02:ab:cd:ef:01:2g", "02-ab-cd-ef-01-23",
                                 "002:ab:cd:ef:01:23", ""])
def test_bad_peer_address(mac):
    with pytest.raises(ValueError, match="MAC"):
        netlink.newlink_veth("v0", "eth0", 11, peer_address=mac)


def test_add_veth_passes_the_peer_address(tmp_path, monkeypatch):
    (tmp_path / "ns1").touch()  # stands in for the bound namespace: only opened here
    nl = Netlink(tmp_path)
    sent = []
    monkeypatch.setattr(nl, "_change", lambda what, op, netns, change, **kw: sent.append(change))
    nl.add_veth("v0", peer="eth0", peer_netns="ns1", peer_address="02:ab:cd:ef:01:23")
    nl.add_veth("v1", peer="eth0", peer_netns="ns1")
    assert [name for name, _ in _peer_attrs(sent[0])] == \
        ["IFLA_IFNAME", "IFLA_ADDRESS", "IFLA_NET_NS_FD"]
    assert dict(_peer_attrs(sent[0]))["IFLA_ADDRESS"] == "02:ab:cd:ef:01:23"
    assert [name for name, _ in _peer_attrs(sent[1])] == ["IFLA_IFNAME", "IFLA_NET_NS_FD"]


def test_link_address_is_parsed():
    from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

    msg = ifinfmsg()
    msg["index"] = 3
    msg["attrs"] = [("IFLA_IFNAME", "eth0"), ("IFLA_ADDRESS", "02:ab:cd:ef:01:23")]
    msg.encode()
    assert parse_link(bytes(msg.data)[16:]).address == "02:ab:cd:ef:01:23"
    assert parse_link(_link_with(netlink._attr(netlink.IFLA_IFNAME, b"v0\0"))).address is None


# ---------------------------------------------------------------- signals held


@pytest.fixture
def ctrl_c():
    """SIGINT raises KeyboardInterrupt here, whatever the test runner inherited."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_signals_held_until_the_block_ends(ctrl_c):
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    reached = False
    with pytest.raises(KeyboardInterrupt), libc.signals_held():
        os.kill(os.getpid(), signal.SIGINT)  # pending, not delivered: no handler runs
        reached = True
    assert reached
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


def test_signals_held_keeps_a_mask_it_found():
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    try:
        with libc.signals_held():
            assert signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == {signal.SIGUSR1} | old
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def test_a_signal_raised_as_the_block_begins_leaves_the_mask_as_it_was(monkeypatch):
    # CPython's pthread_sigmask runs pending handlers after changing the mask: a Ctrl-C that
    # came just before the block raises from the call that blocked everything.
    real = signal.pthread_sigmask

    def sigmask(how, mask):
        old = real(how, mask)
        if how == signal.SIG_BLOCK and signal.SIGINT in set(mask):
            raise KeyboardInterrupt
        return old

    before = real(signal.SIG_BLOCK, [])
    monkeypatch.setattr(libc.signal, "pthread_sigmask", sigmask)
    try:
        with pytest.raises(KeyboardInterrupt), libc.signals_held():
            raise AssertionError("the block ran")
        assert real(signal.SIG_BLOCK, []) == before
    finally:
        real(signal.SIG_SETMASK, before)  # whatever happened, not for the tests after this


def test_a_malformed_nftables_generation_reply_means_unknown_never_a_crash():
    """A reply the generation read cannot parse makes the kept listing untrusted (None),
    and a socket left out of step is replaced before the next read."""
    from envctl.host import nft

    class Fake:
        broken = False
        closed = False

        def request(self, mtype, payload):
            # nfgenmsg, then an attribute that claims more bytes than there are
            return [b"\0\0\0\0" + struct.pack("=HH", 40, 1) + b"\0\0\0\1"]

        def close(self):
            self.closed = True

    gen = nft._Generation.__new__(nft._Generation)
    gen._nl = Fake()
    assert gen.read() is None
    old, fresh = gen._nl, Fake()
    old.broken = True
    gen._socket = lambda: fresh
    assert gen.read() is None
    assert old.closed and gen._nl is fresh
