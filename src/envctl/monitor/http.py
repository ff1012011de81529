"""The monitor's /metrics endpoint: non-blocking sockets driven by the monitor's own loop (no
thread), each connection a small state machine with a deadline, so that a slow or malicious
client costs only its own connection and never a tick, a heal or SIGTERM.

Why not a thread: a heal forks a service supervisor that goes on running Python in the child;
a fork beside a thread that holds a lock (a buffered stream's, OpenSSL's) hands the child that
lock held forever. The loop stays the only thread, and this module never blocks it: every
socket is non-blocking, a TLS handshake is stepped through its WANT_READ/WANT_WRITE states, a
request is read up to MAX_REQUEST bytes, the answer is written as the socket accepts it.

What a connection may cost: DEADLINE seconds from accept to its last byte, whatever it sends
(a byte every few seconds included); at most MAX_CONNECTIONS at a time and MAX_PER_SOURCE from
one source (an IPv4 address, an IPv6 /64): a source over its share closes its own oldest, a
full table closes the oldest of the source holding most, so one peer's flood never evicts a
scraper on another address. bcrypt: at most AUTH_BUDGET of the loop's time each second, and
AUTH_BUDGET_PER_SOURCE of it for one source (a flood of wrong passwords gets 429 instead of
the loop's time, and other sources keep their share); a credential that passed once is
remembered; an unknown user costs the same bcrypt as a known one (a dummy hash of the same
cost), so user names cannot be told apart by the time a 401 takes.

The body is the exposition the loop built at its last tick (`publish`), served as one whole
snapshot: a scrape never sees half of one tick and half of the next.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import gzip
import hashlib
import selectors
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from envctl.errors import HostError, InputError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEADLINE = 10.0
MAX_CONNECTIONS = 64
MAX_PER_SOURCE = 8  # connections of one source (address, IPv6 /64)
MAX_REQUEST = 8192
AUTH_BUDGET = 0.2  # seconds of bcrypt per second of wall time
AUTH_BUDGET_PER_SOURCE = 0.05  # of it, for one source
PATHS = ("/metrics", "/")


@dataclass
class Auth:
    """Basic-auth users (name -> bcrypt hash) with a memory of credentials that passed, and a
    budget on the time spent checking those that did not, in all and per source."""

    users: dict[str, bytes]
    budget: float = AUTH_BUDGET
    clock: Callable[[], float] = time.monotonic
    per_source: float = AUTH_BUDGET_PER_SOURCE
    passed: set[tuple[str, bytes]] = field(default_factory=set)
    window: float = 0.0
    spent: float = 0.0
    by_source: dict[str, float] = field(default_factory=dict)  # this second's bcrypt time
    dummy: bytes = b""

    def __post_init__(self) -> None:
        """The dummy: a hash no password matches, of the highest cost among the users'
        (`$2b$12$…`: the cost is the number after the second `$`), so that checking it takes
        as long as checking theirs. Made here, once, not at the first unknown user (whose 401
        would then take twice as long)."""
        if self.dummy:
            return
        import bcrypt

        costs = [int(p[2]) for h in self.users.values()
                 if len(p := h.split(b"$")) > 2 and p[2].isdigit()]
        rounds = min(max(costs or [12]), 31)
        self.dummy = bcrypt.hashpw(b"envctl: no such user", bcrypt.gensalt(max(4, rounds)))

    def check(self, header: str | None, source: str = "") -> int:
        """200 when `header` (an Authorization value) names a user with its password, 401 when
        it does not, 429 when this second's bcrypt budget (all of it, or `source`'s share) is
        spent."""
        user, password = _basic(header)
        if user is None:
            return 401
        key = (user, hashlib.sha256(password).digest())
        if key in self.passed:
            return 200
        now = self.clock()
        if now - self.window >= 1.0:
            self.window, self.spent = now, 0.0
            self.by_source.clear()
        mine = self.by_source.get(source, 0.0)
        if mine >= self.per_source:
            return 429  # this source's share of the second is spent
        if self.spent >= (self.budget if mine else 2 * self.budget):
            # A source's first check of the second goes through while the whole stays under
            # twice the budget: one check at a real cost (~0.25 s at bcrypt's default 12) is
            # over the budget alone, and the flood's first check of each second would
            # otherwise refuse every other source for the rest of it.
            return 429
        import bcrypt

        known = user in self.users
        try:
            # An unknown user is checked against the dummy: its 401 takes a known one's time.
            ok = bcrypt.checkpw(password, self.users[user] if known else self.dummy)
        except ValueError:  # a hash the config check let through but bcrypt cannot read
            ok = False
        spent = self.clock() - now
        self.spent += spent
        self.by_source[source] = self.by_source.get(source, 0.0) + spent
        if ok and known:
            self.passed.add(key)
            return 200
        return 401


def source_of(addr: tuple) -> str:
    """Whose connection this is, for the per-source limits: the IPv4 address, an IPv6
    address's /64 (one host holds a whole /64), an IPv4-mapped IPv6 address as IPv4."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(str(addr[0]).split("%", 1)[0])
    except (ValueError, IndexError):
        return str(addr)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _basic(header: str | None) -> tuple[str | None, bytes]:
    scheme, _, value = (header or "").strip().partition(" ")
    if scheme.lower() != "basic":
        return None, b""
    try:
        raw = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None, b""
    user, sep, password = raw.partition(b":")
    if not sep:
        return None, b""
    return user.decode("utf-8", "replace"), password


class _Conn:
    """One client: handshake (TLS) -> read the request -> write the answer -> closed."""

    def __init__(self, sock: socket.socket, deadline: float, tls: bool, source: str = ""):
        self.sock = sock
        self.deadline = deadline
        self.source = source
        self.state = "handshake" if tls else "read"
        self.inbuf = b""
        self.out = memoryview(b"")


def parse_listen(text: str) -> tuple[str, int] | None:
    """`ADDR:PORT` (`[::1]:9464` for IPv6) -> (addr, port); "none" -> None."""
    if text.strip().lower() == "none":
        return None
    addr, sep, port = text.strip().rpartition(":")
    from envctl.text import ascii_digits

    if not sep or not ascii_digits(port) or not 0 <= int(port) <= 65535 or not addr:
        raise InputError(f"--listen '{text}': give ADDR:PORT (127.0.0.1:9464, [::1]:9464) or "
                         "none")
    return addr.strip("[]"), int(port)


class MetricsServer:
    """/metrics on `addr`, answered from the last `publish`ed body, stepped by the caller's
    selector: `attach(selector)` registers the listening socket, each ready key's `data` is a
    callable to call with the events, and `expire()` (before each wait, with `next_deadline()`
    bounding the wait) closes connections past their deadline."""

    def __init__(self, addr: tuple[str, int], *, tls: ssl.SSLContext | None = None,
                 auth: Auth | None = None, deadline: float = DEADLINE,
                 max_connections: int = MAX_CONNECTIONS,
                 max_per_source: int = MAX_PER_SOURCE,
                 clock: Callable[[], float] = time.monotonic):
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.tls = tls
        self.auth = auth
        self.deadline = deadline
        self.max_connections = max_connections
        self.max_per_source = max_per_source
        self.clock = clock
        self.body = b""
        self._gzipped: bytes | None = None
        self.conns: dict[int, _Conn] = {}  # insertion order: the oldest first
        self.selector: selectors.BaseSelector | None = None
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(addr)
            self.sock.listen(128)
        except OSError as exc:
            self.sock.close()
            raise HostError(f"listen on {addr[0]}:{addr[1]} for /metrics: {exc.strerror}") \
                from exc
        self.sock.setblocking(False)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def publish(self, body: bytes) -> None:
        """The exposition every request from now on gets, whole (a reference swap)."""
        self.body, self._gzipped = body, None

    def attach(self, selector: selectors.BaseSelector) -> None:
        self.selector = selector
        selector.register(self.sock, selectors.EVENT_READ, self._accept)

    def next_deadline(self) -> float | None:
        return next((c.deadline for c in self.conns.values()), None)  # the oldest's

    def expire(self) -> None:
        now = self.clock()
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            self._close(conn)

    def close(self) -> None:
        for conn in list(self.conns.values()):
            self._close(conn)
        if self.selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.sock)
        self.sock.close()

    # ------------------------------------------------------------ the state machine

    def _accept(self, events: int) -> None:
        for _ in range(self.max_connections):  # then back to the loop: a flood waits its turn
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE, ECONNABORTED: this client, not the monitor
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self.conns:
                    self._close(self._victim(None))
                return
            source = source_of(addr)
            if len(self.conns) >= self.max_connections or sum(
                    c.source == source for c in self.conns.values()) >= self.max_per_source:
                self._close(self._victim(source))
            sock.setblocking(False)
            if self.tls is not None:
                try:
                    sock = self.tls.wrap_socket(sock, server_side=True,
                                                do_handshake_on_connect=False)
                except (OSError, ssl.SSLError):
                    sock.close()
                    continue
            conn = _Conn(sock, self.clock() + self.deadline, self.tls is not None, source)
            self.conns[sock.fileno()] = conn
            assert self.selector is not None
            self.selector.register(sock, selectors.EVENT_READ,
                                   lambda ev, c=conn: self._step(c))
            self._step(conn)

    def _victim(self, source: str | None) -> _Conn:
        """The connection to close for a new one from `source`: `source`'s own oldest when it
        holds its share already, else the oldest of the source holding the most (a flood
        evicts itself, never a scraper on another address)."""
        held: dict[str, int] = {}
        for c in self.conns.values():
            held[c.source] = held.get(c.source, 0) + 1
        if source is None or held.get(source, 0) < self.max_per_source:
            source = max(held, key=lambda s: held[s])  # dicts keep order: ties go to the first
        return next(c for c in self.conns.values() if c.source == source)  # its oldest

    def _step(self, conn: _Conn) -> None:
        try:
            if conn.state == "handshake":
                conn.sock.do_handshake()  # type: ignore[attr-defined]
                conn.state = "read"
            if conn.state == "read":
                self._read(conn)
            if conn.state == "write":
                self._write(conn)
        except ssl.SSLWantReadError:
            self._want(conn, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            self._want(conn, selectors.EVENT_WRITE)
        except (BlockingIOError, InterruptedError):
            self._want(conn, selectors.EVENT_READ if conn.state == "read"
                       else selectors.EVENT_WRITE)
        except (OSError, ssl.SSLError, ValueError):  # reset, bad TLS: this client's end
            self._close(conn)
            return
        if conn.state == "done":
            self._close(conn)

    def _want(self, conn: _Conn, events: int) -> None:
        assert self.selector is not None
        with contextlib.suppress(KeyError, ValueError):
            self.selector.modify(conn.sock, events, self.selector.get_key(conn.sock).data)

    def _read(self, conn: _Conn) -> None:
        while b"\r\n\r\n" not in conn.inbuf:
            chunk = conn.sock.recv(4096)
            if not chunk:  # the client went away before a whole request
                conn.state = "done"
                return
            conn.inbuf += chunk
            if len(conn.inbuf) > MAX_REQUEST:
                self._answer(conn, 431, b"request header too large\n")
                return
        self._answer(conn, *self._respond(conn.inbuf.split(b"\r\n\r\n", 1)[0], conn.source))

    def _respond(self, head: bytes, source: str = "") -> tuple[int, bytes, dict[str, str], bool]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return 400, b"bad request\n", {}, False
        method, target = parts[0], parts[1]
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if method not in ("GET", "HEAD"):
            return 405, b"only GET and HEAD\n", {"Allow": "GET, HEAD"}, False
        if self.auth is not None:
            code = self.auth.check(headers.get("authorization"), source)
            if code == 401:
                return 401, b"unauthorized\n", {"WWW-Authenticate": 'Basic realm="envctl"'}, \
                    method == "HEAD"
            if code == 429:
                return 429, b"too many authentication attempts\n", {"Retry-After": "1"}, \
                    method == "HEAD"
        if target.split("?", 1)[0] not in PATHS:
            return 404, b"not found: /metrics\n", {}, method == "HEAD"
        body, extra = self.body, {"Content-Type": CONTENT_TYPE}
        if "gzip" in headers.get("accept-encoding", ""):
            if self._gzipped is None:
                self._gzipped = gzip.compress(self.body, compresslevel=6)
            body, extra["Content-Encoding"] = self._gzipped, "gzip"
        return 200, body, extra, method == "HEAD"

    def _answer(self, conn: _Conn, code: int, body: bytes, headers: dict[str, str] | None = None,
                head_only: bool = False) -> None:
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
                  405: "Method Not Allowed", 429: "Too Many Requests",
                  431: "Request Header Fields Too Large"}[code]
        lines = [f"HTTP/1.1 {code} {reason}", f"Content-Length: {len(body)}",
                 "Connection: close"]
        headers = headers or {}
        headers.setdefault("Content-Type", "text/plain; charset=utf-8")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)
        conn.out = memoryview(data)
        conn.state = "write"
        self._want(conn, selectors.EVENT_WRITE)

    def _write(self, conn: _Conn) -> None:
        while conn.out:
            sent = conn.sock.send(conn.out[:65536])
            conn.out = conn.out[sent:]
        conn.state = "done"

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if self.selector is not None and fd >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn.sock)
        self.conns.pop(fd, None)
        conn.sock.close()


def serve_until(server: MetricsServer, until: Callable[[], bool], timeout: float = 10.0) -> None:
    """Step `server` on a selector of its own until `until()` or `timeout` (for tests and
    tools that have no loop of their own)."""
    sel = selectors.DefaultSelector()
    server.attach(sel)
    end = time.monotonic() + timeout
    try:
        while not until() and time.monotonic() < end:
            for key, ev in sel.select(0.05):
                key.data(ev)
            server.expire()
    finally:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(server.sock)
        server.selector = None
        sel.close()
