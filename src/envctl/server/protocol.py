"""The daemon's wire format: frames (a 4-byte big-endian length, then one UTF-8 JSON object),
descriptors carried with SCM_RIGHTS on a frame's bytes, the peer's kernel credentials, and the
socket's path. Shared by the daemon and the client; kept light (no typing, no pydantic): the
client is on `submit-job`'s path.

Requests are `{"v": 1, "op": ..., ...}` of at most MAX_REQUEST bytes with at most MAX_FDS
descriptors; replies are `{"v": 1, "ok": true, ...}` or `{"v": 1, "ok": false, "exit": 1|2,
"error": "one line"}` and may be large. Every descriptor received is close-on-exec
(MSG_CMSG_CLOEXEC).

Sockets through `_socket`, the C module under `socket`: `import socket` builds its enums
and imports `selectors` (~5 ms of a client's ~50); `_socket.socket` is the base class of
`socket.socket`, so the daemon's sockets go through the same functions."""

from __future__ import annotations

import _socket
import os
import struct

from envctl.errors import InputError

VERSION = 1
MAX_REQUEST = 64 * 1024
MAX_FDS = 8
MAX_REPLY = 256 * 1024 * 1024  # a client's guard against a reply it cannot hold
DEFAULT_SOCKET = "/run/envctl/envctl.sock"
SO_PEERGROUPS = getattr(_socket, "SO_PEERGROUPS", 59)
MSG_CMSG_CLOEXEC = getattr(_socket, "MSG_CMSG_CLOEXEC", 0x40000000)
_HEADER = struct.Struct(">I")


class ProtocolError(InputError):
    """A frame that is not what the protocol allows (too big, not JSON, not an object)."""


def socket_path(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """$ENVCTL_SOCKET, else /run/envctl/envctl.sock."""
    return environ.get("ENVCTL_SOCKET") or DEFAULT_SOCKET


# The JSON of frames through `_json`, the C codec under the `json` package, as json.dumps and
# json.loads drive it: importing `json` imports `re` (and `enum`, `functools` …) for the
# pure-Python fallbacks, ~9 ms of CPU here, which was all of a submit-job client's own cost
# above the interpreter's start. `json` itself where `_json` is missing (not CPython).
try:
    import _json
except ImportError:  # pragma: no cover - CPython always has it
    _json = None


class _Scanning:
    """What the C scanner reads of its context (json.JSONDecoder's defaults)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"),
                      "NaN": float("nan")}.__getitem__


_JSON_BLANKS = " \t\n\r"  # the whitespace JSON allows around a value


def dumps(obj: object) -> str:
    """json.dumps(obj, separators=(",", ":"), default=str)."""
    if _json is None:  # pragma: no cover
        import json

        return json.dumps(obj, separators=(",", ":"), default=str)
    # (markers, default, encoder, indent, key_separator, item_separator, sort_keys, skipkeys,
    # allow_nan): what json.JSONEncoder.iterencode passes for these settings
    encoder = _json.make_encoder({}, str, _json.encode_basestring_ascii, None, ":", ",",
                                 False, False, True)
    return "".join(encoder(obj, 0))


def loads(text: str) -> object:
    """json.loads(text): ValueError (json.JSONDecodeError) for what is not one JSON value."""
    if _json is None:  # pragma: no cover
        import json

        return json.loads(text)
    start = len(text) - len(text.lstrip(_JSON_BLANKS))
    try:
        obj, end = _json.make_scanner(_Scanning)(text, start)
    except StopIteration as exc:
        raise ValueError(f"Expecting value: char {exc.value}") from None
    if text[end:].strip(_JSON_BLANKS):
        raise ValueError(f"Extra data: char {end}")
    return obj


def encode(obj: dict) -> bytes:
    """One frame: the length, then the compact JSON."""
    body = dumps(obj).encode()
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict:
    """The JSON object of one frame's body; ProtocolError for anything else."""
    try:
        obj = loads(body.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nesting
        raise ProtocolError(f"not a JSON frame: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a frame must hold a JSON object")
    return obj


def error_reply(code: int, text: str) -> dict:
    return {"v": VERSION, "ok": False, "exit": code, "error": " ".join(str(text).split())}


def send_frame(sock: _socket.socket, obj: dict, fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one frame (blocking); `fds` ride on its first bytes."""
    data = encode(obj)
    if fds:  # what socket.send_fds does
        # (C ints packed with struct, not array.array: array imports collections, ~1.5 ms
        # of every client's start, docs/benchmarks.md)
        sent = sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS,
                                      struct.pack(f"{len(fds)}i", *fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


# The most descriptors one sendmsg may carry (the kernel's SCM_MAX_FD), and so one recvmsg
# (a stream socket's never joins two messages' descriptors).
SCM_MAX_FD = 253
_NO_LINGER = struct.pack("ii", 0, 0)


def recv_fds(sock: _socket.socket, bufsize: int, maxfds: int = MAX_FDS
             ) -> tuple[bytes, list[int], int]:
    """recvmsg: (data, descriptors, msg flags), every descriptor close-on-exec. (Python's own
    socket.recv_fds drops its `flags` argument, MSG_CMSG_CLOEXEC included.)

    Room is made for every descriptor a message can carry, more than `maxfds` (the caller
    refuses those past it): one the kernel drops for want of room is closed by it in this
    process. And a socket received has SO_LINGER cleared: whoever makes the last close of a
    TCP socket with it set waits, in close(2), until what it sent is acknowledged (for ever
    when its peer never reads), and a client that closed its own copy makes that the
    receiver's — the daemon's loop, serving nobody meanwhile (attacker review, s33)."""
    data, ancdata, flags, _ = sock.recvmsg(bufsize, _socket.CMSG_SPACE(
        max(maxfds, SCM_MAX_FD) * 4), MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            n = len(payload) // 4  # C ints (a cut one at the end is dropped, as before)
            fds += struct.unpack(f"{n}i", payload[: n * 4])
    for fd in fds:
        _unlinger(fd)
    return data, fds, flags


def dispose(fd: int) -> None:
    """Close a descriptor a client passed, which nobody else is to get (its request refused,
    or its client gone before it was served), without ever waiting in close(2). SO_LINGER,
    cleared as it came (recv_fds), belongs to the socket, and its sender may still hold a copy
    through which he sets it again and then closes his: the last close would be this one, a
    TCP socket whose peer never reads lingering "for ever" (the daemon's loop blocked in it).
    So a connected socket other than a Unix one is closed abortively: SO_LINGER 0 (a reset,
    at once) and the connection dropped first (connect AF_UNSPEC): what its sender still
    holds of it is a closed connection then, which he handed to a request he abandoned."""
    try:
        s = _socket.socket(fileno=fd)
    except OSError:  # not a socket
        os.close(fd)
        return
    try:
        if s.family != _socket.AF_UNIX and not s.getsockopt(_socket.SOL_SOCKET,
                                                             _socket.SO_ACCEPTCONN):
            s.setsockopt(_socket.SOL_SOCKET, _socket.SO_LINGER, struct.pack("ii", 1, 0))
            _disconnect(fd)
    except OSError:
        pass
    finally:
        s.detach()
    os.close(fd)


def _disconnect(fd: int) -> None:
    """connect(fd, {AF_UNSPEC}): a TCP connection reset and dropped at once (tcp_disconnect),
    whatever SO_LINGER its other holders set meanwhile (Python's connect() takes no
    AF_UNSPEC address)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    addr = struct.pack("H14x", _socket.AF_UNSPEC)
    libc.connect(fd, ctypes.c_char_p(addr), len(addr))


def _unlinger(fd: int) -> None:
    """Clear SO_LINGER of `fd` when it is a socket (anything else: nothing to do)."""
    try:
        s = _socket.socket(fileno=fd)
    except OSError:  # ENOTSOCK: not a socket
        return
    try:
        s.setsockopt(_socket.SOL_SOCKET, _socket.SO_LINGER, _NO_LINGER)
    except OSError:
        pass  # a socket without the option (a unix one accepts it too): nothing lingers
    finally:
        s.detach()


def recv_exact(sock: _socket.socket, n: int, fds: list[int]) -> bytes:
    """`n` bytes (blocking), the descriptors that came with them appended to `fds`;
    ConnectionError at EOF before that."""
    buf = bytearray()
    while len(buf) < n:
        data, got, _ = recv_fds(sock, min(n - len(buf), 1 << 20))
        fds.extend(got)
        if not data:
            raise ConnectionError("the other end closed the connection")
        buf += data
    return bytes(buf)


def recv_frame(sock: _socket.socket, *, limit: int = MAX_REPLY) -> tuple[dict, list[int]]:
    """One frame (blocking) and the descriptors that came with it."""
    fds: list[int] = []
    try:
        (size,) = _HEADER.unpack(recv_exact(sock, 4, fds))
        if size > limit:
            raise ProtocolError(f"a frame of {size} bytes (at most {limit})")
        return decode(recv_exact(sock, size, fds)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class FrameReader:
    """A request gathered from nonblocking reads: `feed` what came, then `frame()`."""

    def __init__(self, limit: int = MAX_REQUEST, max_fds: int = MAX_FDS):
        self.limit = limit
        self.max_fds = max_fds
        self.buf = bytearray()
        self.fds: list[int] = []
        self.size: int | None = None

    def feed(self, data: bytes, fds: list[int]) -> None:
        """Take bytes and descriptors; ProtocolError when they pass a limit (the descriptors
        are kept, to be closed with `close`)."""
        self.fds.extend(fds)
        self.buf += data
        if len(self.fds) > self.max_fds:
            raise ProtocolError(f"more than {self.max_fds} descriptors in a request")
        if self.size is None and len(self.buf) >= 4:
            (self.size,) = _HEADER.unpack(self.buf[:4])
            if self.size > self.limit:
                raise ProtocolError(f"a request of {self.size} bytes (at most {self.limit})")
        if self.size is not None and len(self.buf) > 4 + self.size:
            raise ProtocolError("bytes after the request (one request per connection)")

    def frame(self) -> dict | None:
        """The request once all of it came, else None."""
        if self.size is None or len(self.buf) < 4 + self.size:
            return None
        return decode(bytes(self.buf[4:4 + self.size]))

    def take_fds(self) -> list[int]:
        fds, self.fds = self.fds, []
        return fds

    def close(self) -> None:
        for fd in self.take_fds():
            dispose(fd)


def close_passed(fds: list[int]) -> None:
    """Close the daemon's copies of descriptors a client passed and a worker or a request's
    child now holds (not `dispose`: theirs to use), each socket's SO_LINGER cleared again
    first: should the holder have closed its copy already, this close is the last, and the
    client may have set SO_LINGER again through a copy of his own."""
    for fd in fds:
        _unlinger(fd)
        os.close(fd)


def peer_credentials(sock: _socket.socket) -> tuple[int, int, int, tuple[int, ...]]:
    """(pid, uid, gid, supplementary gids) of the process at the other end, as the kernel
    recorded them at connect (SO_PEERCRED, SO_PEERGROUPS): never what the client says."""
    raw = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    groups: tuple[int, ...] = ()
    size = 64 * 4
    while True:
        try:
            raw = sock.getsockopt(_socket.SOL_SOCKET, SO_PEERGROUPS, size)
        except OSError as exc:
            import errno

            if exc.errno == errno.ERANGE and size < 65536 * 4:
                size *= 4
                continue
            raise
        groups = struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
        break
    return pid, uid & 0xFFFFFFFF, gid & 0xFFFFFFFF, tuple(sorted(set(groups)))
