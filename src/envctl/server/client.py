"""The CLI's side of the daemon: whether to go through it (`route`), one request per
connection (`Client.call`), and the commands' requests (submit, jobs, cancel, wait, logs).

Kept light (no typer, no pydantic, no launch code): `submit-job` as a client is a latency
target. The program and the output files a user names are opened here, by the user's own
process, and passed as descriptors: the daemon never opens a user's path."""

from __future__ import annotations

import _socket
import errno
import os

from envctl.errors import EnvctlError, InputError
from envctl.server import protocol as proto

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from envctl.runtime.jobs import Job


class DaemonDown(EnvctlError):
    """No daemon answers on the socket, and this user cannot run the command in-process."""


class Refused(EnvctlError):
    """The daemon answered with an error: its line and exit code."""

    def __init__(self, text: str, code: int):
        super().__init__(text)
        # 127/126: exec's command not found / not runnable, as a shell (and in-process) says;
        # 3: a `down` refused while jobs run (errors.Busy)
        self.exit_code = code if code in (1, 2, 3, 126, 127) else 1


def _connect(path: str) -> _socket.socket | None:
    # _socket, not socket: see protocol (a client's import of `socket` costs ~5 ms)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
            return None  # no socket, or a stale one: nobody answers
        if exc.errno == errno.EACCES:
            raise DaemonDown(f"envctl: cannot reach the envctl daemon at {path}: "
                             f"{exc.strerror}") from None
        raise
    _, uid, _, _ = proto.peer_credentials(sock)
    if uid != 0:  # not root's: whoever made it could take the descriptors we pass
        sock.close()
        raise DaemonDown(f"envctl: the process on {path} is not root's (uid {uid}): not an "
                         "envctl daemon; refusing to talk to it")
    return sock


class Client:
    """Requests to the daemon at `path`; `first` is a connection already made."""

    def __init__(self, path: str, first: _socket.socket | None = None):
        self.path = path
        self.first = first

    def open(self) -> _socket.socket:
        sock, self.first = self.first, None
        if sock is None:
            sock = _connect(self.path)
            if sock is None:
                raise DaemonDown(not_running(self.path))
        return sock

    def call(self, op: str, fds: list[int] | tuple[int, ...] = (), **fields: object
             ) -> tuple[dict, list[int]]:
        """Send one request, return the reply's fields and descriptors; Refused for an
        error reply."""
        sock = self.open()
        try:
            proto.send_frame(sock, {"v": proto.VERSION, "op": op, **fields}, fds)
            try:
                reply, got = proto.recv_frame(sock)
            except ConnectionError:
                raise DaemonDown(f"envctl: the envctl daemon closed the connection during "
                                 f"'{op}' (it stopped, or was restarted): see its log") from None
        finally:
            sock.close()
        if not reply.get("ok"):
            for fd in got:
                os.close(fd)
            raise Refused(str(reply.get("error") or "refused"), int(reply.get("exit") or 1))
        return reply, got


def not_running(path: str) -> str:
    return (f"the envctl daemon is not running (no socket at {path}): start it with "
            "'systemctl start envctl-daemon.socket' (or run 'envctl daemon' as root)")


def route(environ: dict[str, str] | os._Environ[str] = os.environ) -> Client | None:
    """A Client when the daemon answers; None when it does not and this process is root (it
    runs the command in-process: boot, recovery, tests); DaemonDown for anyone else."""
    path = proto.socket_path(environ)
    sock = _connect(path)
    if sock is not None:
        return Client(path, sock)
    if os.geteuid() == 0:
        return None
    raise DaemonDown(not_running(path))


# ---------------------------------------------------------------- the commands


def job_of(raw: dict) -> Job:
    """The Job of a record the daemon sent."""
    from pathlib import Path

    from envctl.runtime.jobs import Job

    return Job.from_json(raw, Path("<daemon>"))


def submit(client: Client, env: str, exe: str, args: list[str], **options: Any) -> Job:
    """Submit through the daemon (submit_record's arguments); the record it answers with."""
    return job_of(submit_record(client, env, exe, args, **options))


def submit_record(client: Client, env: str, exe: str, args: list[str], *,
                  name: str | None = None, time_limit: str | None = None,
                  cpus: str | None = None, gpus: str | None = None,
                  env_vars: list[str] | None = None, workdir: str = "/",
                  output: str | None = None, error: str | None = None,
                  user: str | None = None, mem: str | None = None,
                  early: bool = False) -> dict:
    """Submit through the daemon; the record it answers with, as the JSON it sent (building
    a Job imports envctl.runtime.jobs: the plain `submit-job` prints the id without it). A
    user's program and output files are opened here as that user and passed; root passes
    paths (and who is behind its sudo), which the daemon opens as in-process envctl does.
    `early`: a job that starts at once is answered once its supervisor holds it (its
    record PENDING, not yet RUNNING), not once it runs (handlers.submit)."""
    here = "/" in exe or os.path.lexists(exe)
    fields: dict[str, object] = {
        "env": env, "exe": os.path.abspath(exe) if here else exe, "args": list(args),
        "name": name, "time_limit": time_limit, "cpus": cpus, "gpus": gpus, "mem": mem,
        "env_vars": list(env_vars or []), "workdir": workdir, "user": user, "here": here,
        "output": os.path.abspath(output) if output else None,
        "error": os.path.abspath(error) if error else None}
    if early:
        fields["early"] = True
    fds: list[int] = []
    try:
        if os.geteuid() == 0:
            fields["sudo"] = {k: os.environ[k] for k in ("SUDO_UID", "SUDO_GID", "SUDO_USER")
                              if k in os.environ}
        else:
            if here:
                fields["program_fd"] = _pass(fds, _open_program(exe))
            if output:
                fields["output_fd"] = _pass(fds, _open_output("--output", output))
            if error:
                same = output and os.path.abspath(output) == os.path.abspath(error)
                fields["error_fd"] = (fields["output_fd"] if same else
                                      _pass(fds, _open_output("--error", error)))
        reply, _ = client.call("submit", fds, **fields)
    finally:
        for fd in fds:
            os.close(fd)
    job = reply.get("job")
    if not isinstance(job, dict) or not isinstance(job.get("id"), int):
        raise proto.ProtocolError("the daemon's 'submit' reply: no job record")
    return job


def _pass(fds: list[int], fd: int) -> int:
    fds.append(fd)
    return len(fds) - 1


def _open_program(exe: str) -> int:
    try:
        return os.open(exe, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise InputError(f"submit-job: {exe}: {exc.strerror}") from None


def _open_output(opt: str, path: str) -> int:
    """The output as this user opens it: created if need be, never through a symlink, not
    truncated here (the daemon truncates it once it knows it is a regular file)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                       | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(f"submit-job {opt} {path}: is a symlink, which envctl does not "
                             "follow for an output; name the file itself") from None
        raise InputError(f"submit-job {opt} {path}: {exc.strerror}") from None


def jobs(client: Client, env: str | None, all_: bool) -> list[Job]:
    """Whole records (`jobs --json`): the public fields only of a job the caller may not see."""
    reply, _ = client.call("jobs", env=env, all=all_)
    return [job_of(j) for j in reply["jobs"]]


def job_table(client: Client, env: str | None, all_: bool,
              fields: tuple[str, ...]) -> list[list[str]]:
    """The `envctl jobs` table with the columns `fields` names, header first, as the daemon
    made it (jobs.table: every cell printable): rows of cells, not 10,000 whole records."""
    reply, _ = client.call("jobs", env=env, all=all_, fields=list(fields))
    rows = reply.get("rows")
    if rows is None and isinstance(reply.get("jobs"), list):  # a daemon from before "fields"
        from envctl.runtime.jobs import table

        return table([job_of(j) for j in reply["jobs"]], fields=fields)
    if not isinstance(rows, list) or not rows or not all(
            isinstance(r, list) and len(r) == len(fields) and all(isinstance(c, str) for c in r)
            for r in rows):
        raise proto.ProtocolError("the daemon's 'jobs' reply: no table of the fields asked")
    return rows


def cancel(client: Client, ids: list[str], grace: float) -> tuple[list[Job], list[Job]]:
    reply, _ = client.call("cancel", ids=list(ids), grace=grace)
    return [job_of(j) for j in reply["before"]], [job_of(j) for j in reply["after"]]


def wait(client: Client, ids: list[str] | list[int]) -> list[Job]:
    reply, _ = client.call("wait", ids=list(ids))
    return [job_of(j) for j in reply["jobs"]]


def logs(client: Client, job_id: str, stderr: bool, *, follow: bool = False
         ) -> tuple[int, Job]:
    """A read-only descriptor of the job's output, opened by the daemon as the job's user
    may, and the job's record. With `follow` the daemon waits for a queued job to start."""
    reply, fds = client.call("logs", ids=[job_id], stderr=stderr, follow=follow)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise Refused("the envctl daemon sent no output descriptor", 1)
    return fds[0], job_of(reply["job"])


def exec_(client: Client, env: str, argv: list[str], *, user: str | None = None,
          env_vars: list[str] | None = None, workdir: str = "/",
          keep_stdin: bool = False) -> int:
    """`envctl exec` through the daemon: this process's stdin, stdout and stderr are passed
    (a terminal among them relayed through a pipe, as in-process exec relays it: stdin only
    with `keep_stdin`, else /dev/null); SIGINT, SIGTERM, SIGHUP and SIGQUIT go to the command
    as requests on the connection. The command's exit code."""
    import contextlib
    import select
    import signal

    stdio: list[int] = []
    outputs: dict[int, int] = {}  # pipe read end -> our terminal
    stdin_w = -1
    for target in (0, 1, 2):
        try:
            tty = os.isatty(target)
        except OSError:
            tty = False
        if not tty:
            try:
                os.fstat(target)
                stdio.append(os.dup(target))
            except OSError:  # closed: the command gets /dev/null
                stdio.append(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
            continue
        if target == 0 and not keep_stdin:
            stdio.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            continue
        r, w = os.pipe2(os.O_CLOEXEC)
        if target == 0:
            stdio.append(r)
            stdin_w = w
        else:
            stdio.append(w)
            outputs[r] = target
    sock = client.open()
    old: dict[int, object] = {}
    try:
        proto.send_frame(sock, {"v": proto.VERSION, "op": "exec", "env": env,
                                "argv": list(argv), "user": user,
                                "env_vars": list(env_vars or []), "workdir": workdir,
                                "stdin_fd": 0, "stdout_fd": 1, "stderr_fd": 2}, stdio)
        for fd in stdio:
            os.close(fd)
        stdio = []

        def forward(sig: int, frame: object) -> None:
            with contextlib.suppress(OSError):
                proto.send_frame(sock, {"v": proto.VERSION, "op": "signal", "sig": sig})

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            old[sig] = signal.signal(sig, forward)
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        for r in outputs:
            poller.register(r, select.POLLIN)
        if stdin_w >= 0:
            poller.register(0, select.POLLIN)
        while True:
            try:
                events = dict(poller.poll())
            except InterruptedError:
                continue
            for r in [r for r in outputs if r in events]:
                if not _copy(r, outputs[r]):
                    poller.unregister(r)
                    os.close(r)
                    del outputs[r]
            if stdin_w >= 0 and 0 in events:
                data = b""
                with contextlib.suppress(OSError):
                    data = os.read(0, 65536)
                try:
                    if not data:
                        raise BrokenPipeError
                    os.write(stdin_w, data)
                except OSError:  # the terminal's end, or the command closed its stdin
                    poller.unregister(0)
                    os.close(stdin_w)
                    stdin_w = -1
            if sock.fileno() in events:
                break
        try:
            reply, got = proto.recv_frame(sock)
        except ConnectionError:
            raise DaemonDown("envctl: the envctl daemon closed the connection during 'exec' "
                             "(it stopped, or was restarted): see its log") from None
        for fd in got:
            os.close(fd)
        for r, dst in outputs.items():  # what it wrote last, without waiting for an EOF
            os.set_blocking(r, False)
            while _copy(r, dst):
                pass
        if not reply.get("ok"):
            raise Refused(str(reply.get("error") or "refused"), int(reply.get("exit") or 1))
        return int(reply.get("exit", 1))
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        sock.close()
        for fd in [*stdio, *outputs, stdin_w]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def operate(client: Client, argv: list[str]) -> int:
    """`envctl up|down|status|plan|list …` through the daemon (for access.operate members):
    it runs the command with its own settings, writing to this process's stdout and stderr;
    its exit code. Ctrl-C closes the connection, which interrupts it there."""
    reply, _ = client.call("operate", [1, 2], argv=list(argv), stdout_fd=0, stderr_fd=1)
    return int(reply.get("exit", 1))


def _copy(src: int, dst: int) -> bool:
    try:
        data = os.read(src, 65536)
    except OSError:
        return False
    if not data:
        return False
    import contextlib  # here: not on submit-job's path (exec's only)

    with contextlib.suppress(OSError):
        os.write(dst, data)
    return True


def follow(client: Client, fd: int, job: Job, write: Callable[[bytes], None], *,
           recheck: float = 1.0) -> None:
    """Copy the output `fd` from its start, then as it grows, until the job ended: woken by
    inotify when the file changes and by the daemon's answer to a `wait` for the job."""
    import contextlib
    import select
    import threading

    from envctl.host.libc import libc
    from envctl.runtime.jobs import IN_CLOSE_WRITE, IN_MODIFY

    ended = threading.Event()
    r, w = os.pipe2(os.O_CLOEXEC)

    def waiter() -> None:
        try:
            wait(client, [job.id])
        except EnvctlError:
            pass
        finally:
            os.write(w, b"x")  # before `ended`: the loop closes `w` once it sees that
            ended.set()

    ino = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        poller = select.poll()
        poller.register(r, select.POLLIN)
        if ino >= 0 and libc.inotify_add_watch(
                ino, os.fsencode(f"/proc/self/fd/{fd}"), IN_MODIFY | IN_CLOSE_WRITE) >= 0:
            poller.register(ino, select.POLLIN)
        if job.active:
            threading.Thread(target=waiter, daemon=True).start()
        else:
            ended.set()
        while True:
            done = ended.is_set()
            while chunk := os.read(fd, 65536):
                write(chunk)
            if done:
                return
            for got, _ in poller.poll(recheck * 1000):
                if got == ino:
                    with contextlib.suppress(BlockingIOError):
                        os.read(ino, 4096)
    finally:
        os.close(fd)
        os.close(r)
        os.close(w)
        if ino >= 0:
            os.close(ino)
