"""`envctl daemon`: the root process behind the socket. It owns the listening socket (bound
here, or handed over by systemd's socket activation), the connections, and the per-request
children; everything a request does is in envctl.server.handlers.

One nonblocking selector loop, so that no client can hold up another: each connection has a
capped read buffer and DEADLINE seconds from its accept to send its whole request (a client
sending a byte a second is dropped, the others are served meanwhile); connections are capped,
in all and per uid. Cheap reads (ping, jobs) answer inline through a nonblocking write
buffer; work that can block (submit, cancel, wait, logs) runs in another process, which
answers on the connection (a crash stays in it): a submit in one of WORKERS long-lived
workers, forked warm and reused (the connection passed to it with SCM_RIGHTS; a fork and exit
per submit cost more CPU than the submit), the others, and a submit that finds every worker
busy for POOL_WAIT, in a child forked per request. Children and busy workers are capped in
all and per uid (the rest wait their turn) and reaped through pidfds; a `wait` blocks until
its jobs end, so waits have caps of their own: a user's pending waits never hold that user's
submits.

A submit whose job queues is answered once its record and index line are written; the pass
of the queue that may start it (backfill) is the daemon's, after the answer: the child exits
PASS_EXIT and the daemon runs one pass for all the submits that asked since the last
(`want_pass`), so submits arriving together do not each wait on a pass for the jobs lock.

Jobs outlive the daemon: a job's supervisor is double-forked by the request's child and
detached (runtime.supervisor._spawn); nothing of it waits on the daemon, so kill -9 of the
daemon, or a restart, ends no job. A request's child is not killed with the daemon either:
a submit in flight finishes (its record written) and answers, or no id was ever returned.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import resource
import selectors
import signal
import socket
import stat
import sys
import time
import traceback

from envctl.errors import EnvctlError, HostError
from envctl.runtime.access import Caller
from envctl.server import handlers
from envctl.server import protocol as proto

DEADLINE = 5.0  # seconds from accept to a whole request
WRITE_DEADLINE = 60.0  # seconds to take an inline reply
MAX_CONNS = 256
MAX_CONNS_PER_UID = 32
MAX_CHILDREN = 32
MAX_CHILDREN_PER_UID = 8
# Waits (`wait`, `logs --follow`) sleep until their jobs end, and an `exec` until its command
# does: counted apart from the workers.
MAX_WAITS = 128
MAX_WAITS_PER_UID = 16
WAITS = ("wait", "exec")


def is_wait(request: dict) -> bool:
    """A wait-class request: a WAITS op, or a `logs` with "follow" (it waits for a queued
    job to start)."""
    return request.get("op") in WAITS or (request.get("op") == "logs"
                                          and request.get("follow") is True)
SD_LISTEN_FDS_START = 3
KICK_EVERY = 2.0  # seconds between the daemon's passes of the job queue
# A submit's child answers, then exits PASS_EXIT when its job wants a pass (it may be
# backfilled at once): the daemon runs one, at most every PASS_GAP seconds, so that submits
# arriving together share a pass instead of queueing behind one each for the jobs lock.
PASS_EXIT = 3
PASS_GAP = 0.2
# Submits run in long-lived workers (forked warm like a request's child, then reused): the
# fork and exit of a child per submit cost more CPU than the submit itself (docs/benchmarks.md
# "The job queue"). When every worker is busy a submit gets a child of its own, as before.
POOLED = ("submit",)
WORKERS = 4
WORKER_REQUESTS = 1000  # requests a worker serves before it exits (and a fresh one is forked)
# With every worker busy, a submit waits up to POOL_WAIT seconds for one (a submit takes a few
# ms; a fork more) before it gets a child of its own: a stuck worker delays others no longer.
POOL_WAIT = 0.05
# The largest message a worker reads (the caller and the request, compact: at most the
# client's frame, MAX_REQUEST, plus the caller's ids).
WORKER_MESSAGE = proto.MAX_REQUEST + 4096


class Worker:
    """A submit worker (worker_main), from the daemon's side: its end of their socket pair
    and whose request it serves now (None: idle)."""

    def __init__(self, pid: int, sock: socket.socket):
        self.pid = pid
        self.sock = sock
        self.uid: int | None = None
        self.since = 0.0  # when it took its request
        self.retiring = False  # it said its last request was its last


class Conn:
    """One client connection, from accept to close."""

    def __init__(self, sock: socket.socket, caller: Caller):
        self.sock = sock
        self.caller = caller
        self.reader = proto.FrameReader()
        self.deadline = time.monotonic() + DEADLINE
        self.out = b""
        self.request: dict | None = None  # complete, waiting for a child slot
        self.state = "read"  # then "queued" (for a child) or "write" (an inline answer)


def log(text: str) -> None:
    # A log that cannot be written (its reader gone, a closed stderr) stops no request: the
    # line is lost, the worker serves on.
    with contextlib.suppress(OSError, ValueError):
        print(f"envctl daemon: {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the listening socket


def listen(path: str) -> tuple[socket.socket, bool]:
    """The listening socket: systemd's (LISTEN_FDS/LISTEN_PID for this process), else one
    bound at `path`; and whether this process bound it (and so removes it at exit).
    HostError (exit 1) when another daemon answers at `path` or something that is not a
    socket is there."""
    if (os.environ.get("LISTEN_PID") == str(os.getpid())
            and os.environ.get("LISTEN_FDS", "").isdigit()
            and int(os.environ["LISTEN_FDS"]) >= 1):
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(key, None)  # not for the children's children
        sock = socket.socket(fileno=SD_LISTEN_FDS_START)
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise HostError("envctl daemon: the socket systemd passed is not AF_UNIX "
                            "SOCK_STREAM (see systemd/envctl-daemon.socket)")
        sock.set_inheritable(False)
        name = sock.getsockname()
        if isinstance(name, str) and name.startswith("/"):
            check_directory(os.path.dirname(name))
        return sock, False
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o755, exist_ok=True)
    check_directory(parent)
    _lock(path)
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise HostError(f"envctl daemon: {path} is there and is not a socket: left as it "
                            "is (remove it, or set ENVCTL_SOCKET)")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # an earlier daemon's, which is gone (we hold its lock)
        else:
            raise HostError(f"envctl daemon: another daemon answers on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.bind(path)
    # 0666: anyone may connect; the kernel's peer credentials decide what they may do.
    os.chmod(path, 0o666)
    sock.listen(128)
    return sock, True


def check_directory(directory: str) -> None:
    """HostError unless only root can change what is at `directory`: it and every directory
    above it root's (or this process's user's: the daemon is root, unit tests need not be),
    it not writable by group or others, those above it neither or sticky (/tmp: nobody else
    can rename a root-owned directory there). Whoever could write it could put their own
    socket where the clients connect, or unlink the daemon's."""
    real = os.path.realpath(directory)
    for path in dict.fromkeys([*_prefixes(os.path.abspath(directory)), *_prefixes(real)]):
        st = os.lstat(path)
        why = None
        if st.st_uid not in (0, os.geteuid()):
            why = f"is owned by uid {st.st_uid}, not root"
        elif stat.S_ISLNK(st.st_mode):
            continue  # root's link: its target is checked through the resolved path
        elif not stat.S_ISDIR(st.st_mode):
            why = "is not a directory"
        elif st.st_mode & 0o022 and (path == real or not st.st_mode & stat.S_ISVTX):
            why = f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
        if why:
            raise HostError(f"envctl daemon: the socket's directory {path} {why}: refusing to "
                            "serve (make it root's, mode 0755, or set ENVCTL_SOCKET)")


def _prefixes(path: str) -> list[str]:
    parts = path.strip("/").split("/")
    return ["/"] + ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1) if parts[0]]


_LOCK_FD: list[int] = []


def _lock(path: str) -> None:
    """Hold `<socket>.lock` for the daemon's life: two daemons starting at once cannot both
    replace the socket."""
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise HostError(f"envctl daemon: another daemon holds {path}.lock") from None
    _LOCK_FD.append(fd)


# ---------------------------------------------------------------- the loop


class Daemon:
    def __init__(self, listener: socket.socket):
        self.listener = listener
        listener.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ, "listen")
        self.conns: dict[int, Conn] = {}
        self.children: dict[int, tuple[int, int, bool]] = {}  # pidfd -> (pid, uid, a wait)
        self.workers: list[Worker] = []
        self.exiting: dict[int, int] = {}  # pidfd -> pid of a worker that left its pool
        self.queue: list[Conn] = []
        self.stopping = False
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_w = wake_w
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        # The job queue's timer: a pass (in a child: starts block) at start, where the
        # queue's index is rebuilt from the records, and every KICK_EVERY seconds.
        self.kick_at = 0.0
        self.kicked_at = 0.0  # when the last pass started
        self.kicker: int | None = None  # its pidfd while one runs
        self.kicks = 0

    # -- running
    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        while not self.stopping:
            self.tick()

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def tick(self) -> None:
        now = time.monotonic()
        due = [c.deadline for c in self.conns.values() if c.state != "queued"]
        if self.kicker is None:
            due.append(self.kick_at)
        busy = [w.since + POOL_WAIT for w in self.workers if w.uid is not None]
        if self.queue and busy and max(busy) > now:
            # A submit waiting for a worker: a child of its own once the last to take a
            # request has been busy for POOL_WAIT (worker_soon). (Not one past already: a
            # submit its uid's cap holds waits for a child's or a worker's end, never a
            # timer, and a past deadline would spin the loop.)
            due.append(max(busy))
        timeout = max(0.0, min(due) - now) if due else None
        for key, events in self.sel.select(timeout):
            what = key.data
            if what == "listen":
                self.accept()
            elif what == "wake":
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 256)
            elif what == "child":
                self.reap(key.fd)
            elif what == "kicker":
                self.reap_kicker()
            elif what == "worker-exit":
                self.reap_worker(key.fd)
            elif isinstance(what, Worker):
                self.worker_done(what)
            else:
                self.serve_conn(what, events)
        now = time.monotonic()
        for conn in [c for c in self.conns.values()
                     if c.state != "queued" and c.deadline <= now]:
            log(f"uid {conn.caller.uid}: dropped, " + ("no whole request in time"
                if conn.state == "read" else "its answer was not taken in time"))
            self.close(conn)
        self.start_queued()
        if self.kicker is None and now >= self.kick_at:
            self.kick()

    def kick(self) -> None:
        """A pass of the job queue (runtime.supervisor.kick) in a child of its own."""
        rebuild = self.kicks == 0
        self.kicks += 1
        self.kicked_at = time.monotonic()
        self.kick_at = self.kicked_at + KICK_EVERY
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = kick_child(rebuild)
            finally:
                os._exit(code)
        try:
            self.kicker = os.pidfd_open(pid)
        except ProcessLookupError:
            os.waitpid(pid, 0)
            return
        self.sel.register(self.kicker, selectors.EVENT_READ, "kicker")

    def want_pass(self) -> None:
        """A pass soon: PASS_GAP after the last one started (or once the one running ends,
        if that is later). The ones asked for meanwhile are this one."""
        self.kick_at = min(self.kick_at, self.kicked_at + PASS_GAP)

    def reap_kicker(self) -> None:
        assert self.kicker is not None
        self.sel.unregister(self.kicker)
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PIDFD, self.kicker, os.WEXITED)
        os.close(self.kicker)
        self.kicker = None

    def serve_conn(self, conn: Conn, events: int) -> None:
        """Read from or write to one connection. A bug met on one client's request drops
        that client, in the log, and never the daemon: whatever a client sends, the others
        are served on."""
        try:
            if events & selectors.EVENT_WRITE:
                self.write(conn)
            else:
                self.read(conn)
        except Exception:
            log(f"uid {conn.caller.uid}: dropped, the daemon failed on its request:")
            traceback.print_exc()
            self.close(conn)

    def accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and kin: the rest wait in the backlog
                log(f"accept: {exc.strerror}")
                return
            sock.setblocking(False)
            try:
                pid, uid, gid, groups = proto.peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            per_uid = sum(1 for c in self.conns.values() if c.caller.uid == uid)
            if len(self.conns) >= MAX_CONNS or per_uid >= MAX_CONNS_PER_UID:
                with contextlib.suppress(OSError):
                    sock.send(proto.encode(proto.error_reply(1, "the envctl daemon is busy "
                                                             "(too many connections): retry")))
                sock.close()
                continue
            conn = Conn(sock, Caller(uid, gid, groups, pid))
            self.conns[sock.fileno()] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def read(self, conn: Conn) -> None:
        try:
            data, fds, flags = proto.recv_fds(conn.sock, 65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close(conn)
            return
        if not data and not fds:
            self.close(conn)  # the client left
            return
        try:
            conn.reader.feed(data, fds)
            if flags & socket.MSG_CTRUNC:
                raise proto.ProtocolError(f"more than {proto.MAX_FDS} descriptors in a "
                                          "request")
            request = conn.reader.frame()
        except proto.ProtocolError as exc:
            self.answer(conn, proto.error_reply(2, str(exc)))
            return
        if request is not None:
            self.dispatch(conn, request)

    def dispatch(self, conn: Conn, request: dict) -> None:
        op = request.get("op")
        if not isinstance(op, str):  # a list or an object is no dict key: a TypeError below
            self.answer(conn, proto.error_reply(2, "request field 'op': a string"))
            return
        if request.get("v") != proto.VERSION:
            self.answer(conn, proto.error_reply(2, f"protocol version {request.get('v')!r} "
                                                f"(this daemon speaks {proto.VERSION})"))
            return
        if op in handlers.INLINE:
            fds = conn.reader.take_fds()
            try:
                reply = run_handler(handlers.INLINE[op], conn.caller, request, fds)
            finally:
                for fd in fds:
                    proto.dispose(fd)  # (never a wait in close(2) here: see there)
            for fd in reply.pop("_fds", []):  # the inline ones pass none
                os.close(fd)
            self.answer(conn, reply)
        elif op in handlers.FORKED:
            handlers.warm(request)
            conn.request = request
            conn.state = "queued"
            self.sel.unregister(conn.sock)  # nothing more is read from it here
            self.queue.append(conn)
            self.start_queued()
        else:
            self.answer(conn, proto.error_reply(2, f"unknown request {op!r}"))

    def answer(self, conn: Conn, reply: dict) -> None:
        """Send `reply` through the write buffer, then close."""
        conn.reader.close()
        conn.state = "write"
        conn.deadline = time.monotonic() + WRITE_DEADLINE
        conn.out = proto.encode(reply)
        with contextlib.suppress(KeyError):
            self.sel.unregister(conn.sock)
        self.sel.register(conn.sock, selectors.EVENT_WRITE, conn)
        self.write(conn)

    def write(self, conn: Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self.close(conn)

    def close(self, conn: Conn) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        self.conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(ValueError):
            self.queue.remove(conn)
        conn.reader.close()
        conn.sock.close()

    # -- children
    def start_queued(self) -> None:
        """Fork the queued requests that fit their caps, first come first served within each
        kind: workers (submit, cancel, logs) and waits are capped apart; root's never wait."""
        busy = [(w.pid, w.uid, False) for w in self.workers if w.uid is not None]
        for conn in list(self.queue):
            waits = is_wait(conn.request or {})
            mine = [u for _, u, w in [*self.children.values(), *busy] if w == waits]
            if conn.caller.uid == 0:
                # Root is never queued behind users' requests: however many users fill the
                # caps (colluding, or one with a subuid range: each subuid is a peer uid),
                # root's cancel or down through the daemon is served at once.
                pass
            elif len(mine) >= (MAX_WAITS if waits else MAX_CHILDREN):
                continue
            if mine.count(conn.caller.uid) >= (MAX_WAITS_PER_UID if waits
                                               else MAX_CHILDREN_PER_UID):
                continue
            if (conn.request or {}).get("op") in POOLED and self.worker_soon():
                continue  # (worker_done starts it)
            self.queue.remove(conn)
            self.fork(conn)
            busy = [(w.pid, w.uid, False) for w in self.workers if w.uid is not None]

    def fork(self, conn: Conn) -> None:
        """Start `conn`'s request: in an idle worker (a POOLED one), else in a child of its
        own."""
        request = conn.request or {}
        fds = conn.reader.take_fds()
        if request.get("op") in POOLED and self.to_worker(conn, request, fds):
            return
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = child(conn.sock, conn.caller, request, fds)
            finally:
                os._exit(code)
        proto.close_passed(fds)  # the child's now (it may have closed them already)
        self.conns.pop(conn.sock.fileno(), None)
        conn.sock.close()
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already: reap it now
            os.waitpid(pid, 0)
            return
        self.children[pidfd] = (pid, conn.caller.uid, is_wait(request))
        self.sel.register(pidfd, selectors.EVENT_READ, "child")

    # -- workers
    def worker_soon(self) -> bool:
        """No worker can take a request now, none can be forked, and one took its request
        less than POOL_WAIT ago."""
        now = time.monotonic()
        live = [w for w in self.workers if not w.retiring]
        return (len(self.workers) >= WORKERS and all(w.uid is not None for w in live)
                and any(now - w.since < POOL_WAIT for w in live))

    def to_worker(self, conn: Conn, request: dict, fds: list[int]) -> bool:
        """Hand `conn` and its request to an idle worker (forked when fewer than WORKERS
        run); False, nothing done, when none can take it."""
        idle = [w for w in self.workers if w.uid is None and not w.retiring]
        if not idle and len(self.workers) < WORKERS:
            idle = [self.spawn_worker()]
        if not idle or idle[0] is None:
            return False
        worker = idle[0]
        c = conn.caller
        # Compact and UTF-8 as sent: never larger than the client's frame (<= MAX_REQUEST)
        # plus the caller; an ASCII-escaped one could double and be cut at the worker's read.
        msg = json.dumps({"caller": [c.uid, c.gid, list(c.groups), c.pid],
                          "request": request}, ensure_ascii=False,
                         separators=(",", ":")).encode()
        if len(msg) > WORKER_MESSAGE:
            return False  # (cannot happen: see above) a child of its own instead
        try:
            socket.send_fds(worker.sock, [msg], [conn.sock.fileno(), *fds], socket.MSG_NOSIGNAL)
        except OSError:  # gone (its exit is reaped through its pidfd): a child instead
            self.drop_worker(worker)
            return False
        worker.uid, worker.since = c.uid, time.monotonic()
        proto.close_passed(fds)  # the worker's now (it may have closed them already)
        self.conns.pop(conn.sock.fileno(), None)
        conn.sock.close()
        return True

    def spawn_worker(self) -> Worker | None:
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET
                                             | socket.SOCK_CLOEXEC)
        except OSError as exc:  # EMFILE, ENFILE: a child of its own instead (fork's rules)
            log(f"submit worker: {exc}")
            return None
        try:
            pid = os.fork()
        except OSError as exc:
            log(f"submit worker: fork: {exc}")
            ours.close()
            theirs.close()
            return None
        if pid == 0:
            code = 1
            try:
                ours.close()
                code = worker_main(theirs)
            finally:
                os._exit(code)
        theirs.close()
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # (gone already, or EMFILE: its socket closed, it exits at EOF)
            ours.close()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return None
        self.exiting[pidfd] = pid  # reaped whenever it exits
        self.sel.register(pidfd, selectors.EVENT_READ, "worker-exit")
        ours.setblocking(False)
        worker = Worker(pid, ours)
        self.workers.append(worker)
        self.sel.register(ours, selectors.EVENT_READ, worker)
        return worker

    def worker_done(self, worker: Worker) -> None:
        """A worker's word: [the request's exit code (PASS_EXIT: a pass wanted), 1 if it was
        its last]; EOF when it is gone (its request's client saw its connection close)."""
        try:
            word = worker.sock.recv(16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            word = b""
        if len(word) != 2:
            self.drop_worker(worker)
            return
        worker.uid = None
        worker.retiring = worker.retiring or word[1] == 1
        if word[0] == PASS_EXIT:
            self.want_pass()
        if worker.retiring:
            self.drop_worker(worker)
        self.start_queued()  # a submit waiting for a worker

    def drop_worker(self, worker: Worker) -> None:
        if worker in self.workers:
            self.workers.remove(worker)
            self.sel.unregister(worker.sock)
            worker.sock.close()

    def reap_worker(self, pidfd: int) -> None:
        pid = self.exiting.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        for worker in [w for w in self.workers if w.pid == pid]:
            self.drop_worker(worker)  # died before its socket said so

    def reap(self, pidfd: int) -> None:
        pid, _, _ = self.children.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == PASS_EXIT:
            self.want_pass()


def run_handler(handler, caller: Caller, request: dict, fds: list[int],
                **kw: object) -> dict:
    """The reply to `request` (its descriptors under "_fds"); every error becomes an error
    reply with its exit code and one line."""
    try:
        out = handler(caller, request, fds, **kw)
    except EnvctlError as exc:
        return proto.error_reply(exc.exit_code, str(exc))
    except Exception as exc:  # a bug: say so in one line, the traceback in the daemon's log
        traceback.print_exc()
        return proto.error_reply(1, f"the envctl daemon failed: {exc!r}")
    if out is None:
        return {}
    fields, reply_fds = out
    return {"v": proto.VERSION, "ok": True, **fields, "_fds": reply_fds}


def _leave_the_daemon(keep: set[int]) -> None:
    """In a process forked from the daemon: default signals, and none of the daemon's
    descriptors (the listener, the connections, the workers' sockets) but `keep`."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    _close_all_but({0, 1, 2, *keep})
    if _NOFILE_SOFT is not None:  # the daemon's raised limit is not the jobs'
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (_NOFILE_SOFT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


# The soft RLIMIT_NOFILE the daemon started with, before _raise_nofile (None: not raised).
_NOFILE_SOFT: int | None = None


def _raise_nofile() -> None:
    """The daemon's soft limit of open descriptors up to its hard limit: at EMFILE the kernel
    drops the descriptors a client passes inside the daemon, whose last close can then block
    its loop (a socket left to linger), and 256 connections of 9 descriptors each pass the
    usual 1,024. Processes forked from it go back to the limit it was started with."""
    global _NOFILE_SOFT
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            _NOFILE_SOFT = soft


def _close_all_but(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in keep:
            with contextlib.suppress(OSError):
                os.close(int(name))


def worker_main(sock: socket.socket) -> int:
    """A submit worker: take a request (the client's connection first among its
    descriptors), serve it as a request's child does (`child`), tell the daemon [its exit
    code, 1 if it was the last]; WORKER_REQUESTS of them, or until the daemon is gone (EOF:
    a request in hand is finished and answered first)."""
    _leave_the_daemon({sock.fileno()})
    start = _process_ids()
    for n in range(1, WORKER_REQUESTS + 1):
        try:
            data, fds, flags = proto.recv_fds(sock, WORKER_MESSAGE, proto.MAX_FDS + 1)
        except OSError:
            return 0
        if not data:
            return 0  # the daemon is gone
        code = 1
        conn = None
        passed = _identities(fds)
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ValueError("the daemon's message was cut")  # its fds closed below
            msg = json.loads(data)
            uid, gid, groups, pid = msg["caller"]
            conn = socket.socket(fileno=fds[0])
            code = serve(conn, Caller(uid, gid, tuple(groups), pid), msg["request"], fds[1:])
        except Exception:  # a bug: in the log, and the next request is served
            with contextlib.suppress(OSError, ValueError):
                traceback.print_exc()
        finally:
            if conn is not None:
                conn.close()  # (the object's own close: never a later request's reused fd)
                passed.pop(fds[0], None)
            # The request's descriptors the handler left open; not a number it closed and
            # the C library (NSS) reused since: only one that still is what came.
            for fd, ident in passed.items():
                if _identities([fd]).get(fd) == ident:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        # The next request is another user's: a worker that is not exactly as it started
        # (file-system ids or groups left switched by a failed asuser switch, umask, cwd)
        # serves no more; it says this was its last and goes.
        last = n == WORKER_REQUESTS or _process_ids() != start
        with contextlib.suppress(OSError):
            sock.send(bytes([code, last]), socket.MSG_NOSIGNAL)
        if last:
            break
    return 0


def _process_ids() -> tuple:
    """What a request must leave as it found it in a worker that serves the next one."""
    from envctl.host import asuser

    umask = os.umask(0o022)
    os.umask(umask)
    return (asuser.fs_ids(), os.getresuid(), os.getresgid(), sorted(os.getgroups()), umask,
            os.getcwd())


def _identities(fds: list[int]) -> dict[int, tuple[int, int, int]]:
    out = {}
    for fd in fds:
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            out[fd] = (st.st_dev, st.st_ino, os.get_blocking(fd))
    return out


def child(sock: socket.socket, caller: Caller, request: dict, fds: list[int]) -> int:
    """A request's child: run the handler, answer on `sock`, return the exit code."""
    _leave_the_daemon({sock.fileno(), *fds})
    return serve(sock, caller, request, fds)


def serve(sock: socket.socket, caller: Caller, request: dict, fds: list[int]) -> int:
    """Run the request's handler and answer on `sock`; the exit code (PASS_EXIT: a pass of
    the queue wanted)."""
    sock.setblocking(True)
    op = request.get("op")
    handler = handlers.FORKED[op]
    kw: dict = {"conn": sock} if op in ("wait", "exec", "operate", "logs") else {}
    answered = False
    if op == "submit" and request.get("early") is True:
        def answer(fields: dict) -> None:
            """The answer sent before the handler returns (a plain submit-job's, once its
            job's supervisor holds it): the handler goes on, and returns nothing more."""
            nonlocal answered
            answered = True
            _send(sock, caller, op, {"v": proto.VERSION, "ok": True, **fields}, [])

        kw = {"answer": answer}
    reply = run_handler(handler, caller, request, fds, **kw)
    if answered:
        if reply and not reply.get("ok"):  # after the answer: the job's record says it
            log(f"uid {caller.uid} pid {caller.pid}: {op}: after its answer: "
                f"{reply.get('error')}")
        return 0
    if not reply:
        return 0  # the client left
    reply_fds = reply.pop("_fds", [])
    wants_pass = reply.pop(handlers.PASS_WANTED, False) is True
    _send(sock, caller, op, reply, reply_fds)
    # (whether or not the client took the answer: the job is queued either way)
    return PASS_EXIT if wants_pass else 0


def _send(sock: socket.socket, caller: Caller, op: object, reply: dict,
          reply_fds: list[int]) -> None:
    """Send a request's reply (a client gone is no error) and log it."""
    sock.settimeout(WRITE_DEADLINE)
    try:
        proto.send_frame(sock, reply, reply_fds)
    except OSError as exc:
        if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
            log(f"uid {caller.uid}: {op}: reply: {exc}")
    log(f"uid {caller.uid} pid {caller.pid}: {op}: "
        + ("ok" if reply.get("ok") else f"refused: {reply.get('error')}"))


def kick_child(rebuild: bool) -> int:
    """The daemon's pass of the job queue: the index made again from the records first at
    the daemon's start (whatever a crash left), then `kick`."""
    _leave_the_daemon(set())  # the listener and the connections are not its
    from envctl.host.context import Host
    from envctl.runtime import jobs, queue
    from envctl.runtime import supervisor as sv

    try:
        host = Host.from_env()
        if rebuild and jobs.jobs_dir(host.state_dir).is_dir():
            with jobs.jobs_lock(host.state_dir):
                queue.rebuild(host.state_dir)
        sv.kick(host)
    except Exception:  # a bug or a refusing disk: said in the log, the next pass tries again
        traceback.print_exc()
        return 1
    return 0


def main(path: str | None = None) -> int:
    """Run the daemon in the foreground until SIGTERM/SIGINT; its exit code."""
    if os.geteuid() != 0:
        from envctl.errors import NeedsRootError

        raise NeedsRootError("envctl daemon runs jobs as their users and needs root: run "
                             "it as root (systemctl start envctl-daemon.socket)")
    path = path or proto.socket_path()
    # The work of a request, loaded once here, so that each child starts warm.
    import envctl.commands

    envctl.commands.preload()  # operate: up/down/status/plan/list, run in the child
    import envctl.host.asuser  # noqa: F401
    import envctl.host.context  # noqa: F401
    import envctl.host.safepath  # noqa: F401
    import envctl.runtime.context  # noqa: F401
    import envctl.runtime.launch  # noqa: F401
    import envctl.runtime.queue  # noqa: F401 - and slices: what every submit's child imported
    import envctl.runtime.supervisor  # noqa: F401
    import envctl.spec.loader  # noqa: F401 - access lists: pydantic and the models, once

    _raise_nofile()
    listener, bound = listen(path)
    where = path if bound else "the socket systemd passed"
    log(f"listening on {where} (pid {os.getpid()})")
    ino = os.stat(path).st_ino if bound else None
    try:
        Daemon(listener).serve()
    finally:
        listener.close()
        if bound:
            with contextlib.suppress(OSError):
                if os.lstat(path).st_ino == ino:  # still ours, not a newer daemon's
                    os.unlink(path)
    log("stopped")
    return 0
