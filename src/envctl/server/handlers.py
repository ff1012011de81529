"""What each request of the daemon does: the access check (envctl.runtime.access), then the same
functions the CLI calls in-process (supervisor.make_request/submit/cancel_jobs/wait,
jobs.listing/open_output). Each handler takes the caller (as the kernel names it), the request
and the descriptors that came with it, and returns the reply's fields and descriptors."""

from __future__ import annotations

import contextlib
import os
import select
import socket
from pathlib import Path

from envctl.engine import faults
from envctl.errors import UsageError
from envctl.runtime import access
from envctl.runtime import jobs as jb
from envctl.runtime.access import Caller
from envctl.server.protocol import ProtocolError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# squeue's view of somebody else's job: who, where, what state, how long; not its argv,
# program, outputs or environment.
PUBLIC_FIELDS = ("id", "env", "name", "user", "uid", "state", "submit_time", "start_time",
                 "end_time", "time_limit", "cpus", "gpus", "exit_code", "signal", "queued",
                 "reason")


# ---------------------------------------------------------------- reading a request


def _get(req: dict, key: str, kind: type | tuple, default: Any = None, *,
         required: bool = False) -> Any:
    if key not in req or req[key] is None:
        if required:
            raise ProtocolError(f"request field '{key}' is missing")
        return default
    value = req[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
        raise ProtocolError(f"request field '{key}': wrong type")
    return value


def _strs(req: dict, key: str) -> list[str]:
    value = _get(req, key, list, [])
    if not all(isinstance(v, str) for v in value):
        raise ProtocolError(f"request field '{key}': a list of strings")
    return value


def _fd(req: dict, key: str, fds: list[int]) -> int | None:
    index = _get(req, key, int)
    if index is None:
        return None
    if not 0 <= index < len(fds):
        raise ProtocolError(f"request field '{key}': no descriptor {index} came with it")
    return fds[index]


def _ids(req: dict) -> list[int]:
    ids = _get(req, "ids", list, required=True)
    if not ids or not all(isinstance(i, (int, str)) and not isinstance(i, bool) for i in ids):
        raise ProtocolError("request field 'ids': a list of job ids")
    return [jb.parse_id(i) for i in ids]


def _host():
    from envctl.host.context import Host

    return Host.from_env()


_ACCESS: dict[str, tuple[tuple, Any]] = {}


def load_access(env: str) -> Any:
    """access.load_access(env), kept in the daemon while the spec file and its directory are
    unchanged (inode, size, mtime, owner and mode of both: what load_access's own checks read)
    — parsing a spec costs ~150 ms, a request's budget. The daemon fills it before it forks
    (warm), so that every request's child starts with it."""
    from envctl.runtime.context import config_dir

    directory = config_dir()
    path = access._spec_file(directory, env)
    try:
        key = tuple((st.st_ino, st.st_size, st.st_mtime_ns, st.st_uid, st.st_mode)
                    for st in (os.stat(directory), *( [os.stat(path)] if path else [])))
    except OSError:
        return access.load_access(env)
    key = (str(path), *key)
    hit = _ACCESS.get(env)
    if hit is not None and hit[0] == key:
        return hit[1]
    got = access.load_access(env)
    _ACCESS[env] = (key, got)
    return got


def warm(request: dict) -> None:
    """In the daemon, before a request's child is forked: its environment's access list."""
    env = request.get("env")
    if isinstance(env, str) and len(env) < 64:
        # (an error: the child meets it again and answers it)
        with contextlib.suppress(Exception):
            load_access(env)


class _Lists:
    """Each environment's access list, read once per request."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def __call__(self, env: str) -> Any:
        if env not in self.seen:
            self.seen[env] = load_access(env)
        return self.seen[env]


# ---------------------------------------------------------------- cheap ones (inline)


def ping(caller: Caller, req: dict, fds: list[int]) -> tuple[dict, list[int]]:
    from envctl import __version__

    return {"version": __version__, "pid": os.getpid(), "uid": caller.uid,
            "admin": access.is_admin(caller)}, []


def list_jobs(caller: Caller, req: dict, fds: list[int]) -> tuple[dict, list[int]]:
    """`envctl jobs`: everyone's jobs, as squeue shows them; the whole record of those the
    caller may see (its own, its environments' as an operator, all for an admin)."""
    env = _get(req, "env", str)
    from envctl.runtime import queue

    if env is not None:
        from envctl.runtime.context import check_env_name

        # Before any path is made of it: the queue's index is read by it, as root, in the
        # daemon's own loop (a path named there was opened: bob's FIFO blocked the loop).
        check_env_name(env)
    host = _host()
    finished = bool(_get(req, "all", bool, False))
    groups = (queue.queued_groups(host.state_dir, env)
              if queue.queue_dir(host.state_dir).is_dir() else [])
    views = [_view(e, got) for e, got in groups]
    if env is None:  # every queue listed: an emptied one's view (MBs of rows) goes
        for gone in set(_VIEWS) - {e for e, _ in groups}:
            del _VIEWS[gone]
    skip = views[0].ids if len(views) == 1 else frozenset().union(*(v.ids for v in views))
    others = jb.listing(host.state_dir, host.boot_id, env=env, finished=finished, skip=skip)
    if env is not None and not views and not others and not jb.listing(
            host.state_dir, host.boot_id, env=env, finished=True):
        from envctl.known import require_known

        # No job of it, ever: a typo is exit 2, as in-process (the daemon's own specs).
        require_known([env], host)
    # The table's columns (`envctl jobs`, --format): the daemon answers its rows of cells;
    # without them, whole records (--json).
    fields = _strs(req, "fields") if req.get("fields") is not None else None
    if fields is not None and (not fields or len(fields) > jb.MAX_FIELDS
                               or any(f not in jb.FIELDS for f in fields)):
        raise ProtocolError(f"request field 'fields': 1 to {jb.MAX_FIELDS} of "
                            f"{', '.join(jb.FIELDS)}")
    lists = _Lists()
    admin = access.is_admin(caller)
    # access.may_see_job's answer, asked once per environment, not per job: is_admin reads
    # the host's group database (~0.3 ms), 3 s of a listing of 10,000 for a plain user.
    sees_all: dict[str, bool] = {}

    def sees(env: str) -> bool:
        if env not in sees_all:
            sees_all[env] = admin or access.operates(lists(env), caller)
        return sees_all[env]

    def whole(job: jb.Job) -> bool:
        return sees(job.env) or access.job_owner(job) == caller.uid

    if fields is None:
        listed = sorted([j for v in views for j in v.jobs] + others, key=lambda j: j.id)
        return {"jobs": [j.to_json() if whole(j) else _public(j) for j in listed]}, []
    # The table's rows (header first), every cell printable: `envctl jobs` prints them as they
    # are, without shipping and rebuilding 10,000 whole records (docs/benchmarks.md).
    shape = tuple(fields)
    rows: list[tuple[int, list[str]]] = []
    for v in views:
        if sees(v.env):  # an admin, an operator of it: every row whole
            rows += zip(v.ids_sorted, v.rows(shape, public=False), strict=True)
            continue
        full = public = None
        for i, (jid, owner) in enumerate(zip(v.ids_sorted, v.owners, strict=True)):
            if owner == caller.uid:
                full = full if full is not None else v.rows(shape, public=False)
                rows.append((jid, full[i]))
            else:
                public = public if public is not None else v.rows(shape, public=True)
                rows.append((jid, public[i]))
    if others:
        shown = [j if whole(j) else jb.Job.from_json(_public(j), PUBLIC_WHERE) for j in others]
        rows += zip([j.id for j in others], jb.table(shown, fields=shape)[1:], strict=True)
    if others or len(views) > 1:  # each queue's rows are in id order already
        rows.sort(key=lambda r: r[0])
    header = [jb.FIELDS[f][0] for f in shape]
    return {"rows": [header, *(r for _, r in rows)]}, []


PUBLIC_WHERE = Path("<public>")


def _public(job: jb.Job) -> dict:
    """The public view of somebody else's job (PUBLIC_FIELDS), as JSON values: as a Job
    (Job.from_json) its private cells (program, memory, accounting) are '-'."""
    return {k: getattr(job, k) for k in PUBLIC_FIELDS} | {"state": str(job.state), "argv": []}


class _QueueView:
    """What the daemon derives from one environment's parsed queue (queue.queued_groups: the
    same list while its index is unchanged), kept with it: the ids, each job's owner, and the
    table's rows per columns asked, whole and public. A plain user's `envctl jobs` with 10,000
    queued then costs a row picked per job (by its owner, asked per call), not a public Job
    and a row made for each (~130 ms of the daemon's CPU per listing). Queued jobs have not
    started, so no cell of theirs depends on the time (ELAPSED is '-')."""

    # --format variants kept per queue, whole or public (what a user asks is theirs to vary):
    # with 10,000 queued the default columns' rows take ~3 MB, 30 columns' ~7 MB.
    ROW_SHAPES = 4

    def __init__(self, env: str, jobs: list[jb.Job]) -> None:
        self.env, self.jobs = env, jobs
        self.ids_sorted = [j.id for j in jobs]
        self.ids = frozenset(self.ids_sorted)
        self.owners = [access.job_owner(j) for j in jobs]
        self._rows: dict[tuple[tuple[str, ...], bool], list[list[str]]] = {}

    def rows(self, fields: tuple[str, ...], *, public: bool) -> list[list[str]]:
        key = (fields, public)
        got = self._rows.get(key)
        if got is None:
            shown = ([jb.Job.from_json(_public(j), PUBLIC_WHERE) for j in self.jobs] if public
                     else self.jobs)
            got = jb.table(shown, fields=fields)[1:]
            if len(self._rows) >= self.ROW_SHAPES:
                self._rows.clear()
            self._rows[key] = got
        return got


_VIEWS: dict[str, _QueueView] = {}


def _view(env: str, jobs: list[jb.Job]) -> _QueueView:
    """The view of `env`'s queue as parsed now: the one kept while the list is the same."""
    got = _VIEWS.get(env)
    if got is None or got.jobs is not jobs:
        got = _VIEWS[env] = _QueueView(env, jobs)
    return got


# ---------------------------------------------------------------- in a child each


def submit(caller: Caller, req: dict, fds: list[int],
           answer: Callable[[dict], None] | None = None) -> tuple[dict, list[int]] | None:
    """`submit-job`: the caller's job, run as the caller unless an admin says otherwise.

    With the request's `early` (the plain `submit-job`, which prints the id alone) and
    `answer` (the daemon's, to send the reply before this returns), a job that starts at
    once is answered as soon as its supervisor has written its record (PENDING, about to
    start it), as sbatch answers once the job is queued: the start itself (~40 ms: cgroup,
    namespaces, pivot_root, exec) is not waited for, and a start that fails ends the job
    FAILED with why in its record. This call still waits for that start and settles it
    (a supervisor that died first: FAILED), then returns None: answered already. Without
    `early` (--json, --wait, and any other client) the answer waits for the start, and a
    job that did not start is answered FAILED (docs/runtime.md)."""
    from envctl.host.asuser import Creds
    from envctl.runtime import supervisor as sv
    from envctl.runtime.context import EnvContext

    env = _get(req, "env", str, required=True)
    exe = _get(req, "exe", str, required=True)
    user = _get(req, "user", str)
    program_fd = _fd(req, "program_fd", fds)
    output_fd, error_fd = _fd(req, "output_fd", fds), _fd(req, "error_fd", fds)
    output, error = _get(req, "output", str), _get(req, "error", str)
    for name, path in (("exe", exe if program_fd is None and "/" in exe else None),
                       ("output", output if output_fd is None else None),
                       ("error", error if error_fd is None else None)):
        if path is not None and caller.uid != 0:
            # The daemon never opens a path a user names: the client opens it and passes it.
            raise ProtocolError(f"request field '{name}': a path without its descriptor")
        if path is not None and not path.startswith("/"):
            raise ProtocolError(f"request field '{name}': an absolute path")
    access.check_user_option(caller, user)
    access.check_submit(env, load_access(env), caller)
    host = _host()
    ctx = EnvContext.load(host, env)
    environ = _run_as(caller, req)
    here = True if program_fd is not None else (
        _get(req, "here", bool, False) if caller.uid == 0 else False)
    request = sv.make_request(
        host, ctx, exe, _strs(req, "args"), name=_get(req, "name", str), user=user,
        cpus=_get(req, "cpus", str), gpus=_get(req, "gpus", str),
        env=_strs(req, "env_vars"), workdir=_get(req, "workdir", str, "/"), output=output,
        error=error, time_limit=_get(req, "time_limit", str), mem=_get(req, "mem", str),
        environ=environ, here=here)
    assert request.user is not None
    access.check_run_as(caller, request.user.uid, request.user.gid)
    changes: dict[str, Any] = {"program_fd": program_fd, "output_fd": output_fd,
                               "error_fd": error_fd}
    if caller.uid != 0:
        changes["submitter"] = Creds(caller.uid, caller.gid, caller.groups)
    # Test hooks (ENVCTL_FAULT=ACTION@submit:before|after): checked, nothing written yet;
    # the record written, not yet answered.
    faults.maybe_fault("submit", "before", 0)
    taken = None
    answered = False
    if answer is not None and _get(req, "early", bool, False):
        def taken(record: jb.Job) -> None:
            nonlocal answered
            faults.maybe_fault("submit", "after", 0)
            answered = True
            answer({"job": record.to_json()})
    # The pass of the queue a queued job may want: the daemon's, after the answer (a pass
    # holds the jobs lock, and one per submit was most of a submit's wait).
    job = sv.submit(host, ctx, request.replace(**changes), run_pass=False, taken=taken)
    if answered:
        return None
    faults.maybe_fault("submit", "after", 0)
    return {"job": job.to_json(), PASS_WANTED: sv.wants_pass(host, job)}, []


# A reply field the daemon's child takes out before it answers: True when the request
# wants a pass of the job queue (server.Daemon.want_pass runs it once the answer is sent).
PASS_WANTED = "_pass"


def _run_as(caller: Caller, req: dict) -> dict[str, str]:
    """The environment make_request reads the default user from: the caller, as if it ran
    envctl through sudo; for root, the user behind root's own sudo (root is trusted)."""
    if caller.uid == 0:
        sudo = _get(req, "sudo", dict, {})
        return {k: v for k, v in sudo.items()
                if k in ("SUDO_UID", "SUDO_GID", "SUDO_USER") and isinstance(v, str)}
    return {"SUDO_UID": str(caller.uid), "SUDO_GID": str(caller.gid),
            "SUDO_USER": caller.name}


def _allowed(caller: Caller, ids: list[int], what: str) -> tuple[Any, list[jb.Job]]:
    host = _host()
    records = [jb.get(host.state_dir, i) for i in ids]  # every id known, or nothing done
    lists = _Lists()
    for job in records:
        if access.job_owner(job) != caller.uid:
            access.check_job(job, lists(job.env), caller, what)
    return host, records


def cancel(caller: Caller, req: dict, fds: list[int]) -> tuple[dict, list[int]]:
    from envctl.runtime import supervisor as sv

    grace = _get(req, "grace", (int, float), jb.KILL_GRACE)
    if not 0 <= grace <= 365 * 86400:
        raise UsageError(f"--grace {grace}: between 0 and 365 days, in seconds")
    host, before = _allowed(caller, _ids(req), "cancel")
    after = sv.cancel_jobs(host, before, grace=float(grace))
    return {"before": [j.to_json() for j in before],
            "after": [j.to_json() for j in after]}, []


def wait(caller: Caller, req: dict, fds: list[int], conn: socket.socket | None = None
         ) -> tuple[dict, list[int]] | None:
    """Reply once every job has ended; None (nothing to reply to) when the client left."""
    from envctl.runtime import supervisor as sv

    host, records = _allowed(caller, _ids(req), "wait for")
    ids = [j.id for j in records]
    while True:
        done = sv.wait(host, ids, timeout=2.0)
        if not any(j.active for j in done):
            return {"jobs": [j.to_json() for j in done]}, []
        if conn is not None and _client_left(conn):
            return None


def _client_left(conn: socket.socket) -> bool:
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN | select.POLLHUP | select.POLLRDHUP)
    return bool(poller.poll(0))


def logs(caller: Caller, req: dict, fds: list[int], conn: socket.socket | None = None
         ) -> tuple[dict, list[int]] | None:
    """A read-only descriptor of the job's stdout (or stderr), opened as jobs.open_output
    opens it (never by name as root: with the job user's rights, O_NOFOLLOW, or beneath
    the jobs directory with no symlink), passed back. With "follow" (a wait-class request,
    server.is_wait) a queued job is waited for until it starts (queue.open_when_started);
    None (nothing to reply to) when the client left meanwhile."""
    from pathlib import Path

    from envctl.errors import HostError

    ids = _ids(req)
    if len(ids) != 1:
        raise ProtocolError("request field 'ids': one job id")
    host, (record,) = _allowed(caller, ids, "read the logs of")
    from envctl.runtime import queue

    follow = _get(req, "follow", bool, False)
    pending = queue.no_output_yet(host.state_dir, record)
    if pending is not None and not follow:
        raise HostError(pending)
    path = Path(record.stderr if _get(req, "stderr", bool, False) else record.stdout)
    try:
        if pending is None:
            fd = jb.open_output(host.state_dir, record, path)
        else:
            opened = queue.open_when_started(
                host.state_dir, record, path, boot_id=host.boot_id,
                gone=None if conn is None else lambda: _client_left(conn))
            if opened is None:
                return None
            fd, record = opened
    except OSError as exc:
        raise HostError(f"logs of job {record.id}: {path}: {exc.strerror}") from exc
    return {"job": record.to_json()}, [fd]


def exec_(caller: Caller, req: dict, fds: list[int], conn: socket.socket | None = None
          ) -> tuple[dict, list[int]] | None:
    """`envctl exec ENV -- CMD` for a user in access.submit: the same launch as in-process
    (runtime.exec), as the caller (never root for a non-admin), with the client's stdin,
    stdout and stderr; the reply is the command's exit code once it ended. While it runs the
    connection carries {"op": "signal", "sig": N} frames (forwarded as envctl exec forwards
    them); the client leaving kills the command."""
    from envctl.runtime import exec as ex
    from envctl.runtime.context import EnvContext
    from envctl.runtime.launch import (
        Launch,
        create_cgroup,
        job_environ,
        remove_cgroup,
        resolve_user,
        start,
        systemd_attach,
    )

    env = _get(req, "env", str, required=True)
    argv = _strs(req, "argv")
    if not argv:
        raise ProtocolError("request field 'argv': the command, at least its program")
    stdio = tuple(_fd(req, k, fds) for k in ("stdin_fd", "stdout_fd", "stderr_fd"))
    if any(fd is None for fd in stdio):
        raise ProtocolError("exec: stdin_fd, stdout_fd and stderr_fd are required")
    for name, fd in zip(("stdin", "stdout", "stderr"), stdio, strict=True):
        _check_stdio(name, fd)
    workdir = _get(req, "workdir", str, "/")
    if not workdir.startswith("/"):
        raise UsageError(f"-w/--workdir '{workdir}': an absolute path inside the environment")
    user = _get(req, "user", str)
    access.check_user_option(caller, user)
    access.check_submit(env, load_access(env), caller)
    variables = ex.parse_env_vars(_strs(req, "env_vars"))
    host = _host()
    ctx = EnvContext.load(host, env)
    who = resolve_user(user, ctx, _run_as(caller, req))
    access.check_run_as(caller, who.uid, who.gid)
    from envctl.runtime.supervisor import exec_devices

    devices = exec_devices(host, ctx)
    launch = Launch(ctx, argv, job_environ(ctx, who, variables), who, cwd=workdir,
                    attach=systemd_attach(ctx, devices=devices))
    launch.stdio = stdio  # type: ignore[assignment]
    name = f"exec-{os.getpid()}"
    launch.cgroup_dirs = create_cgroup(ctx, name, devices=devices)
    try:
        started = start(launch)
        for fd in fds:  # the command holds them now: the client sees EOF when it ends
            os.close(fd)
        fds.clear()
        code = _attend(started, conn)
    finally:
        remove_cgroup(ctx, name)
    return {"exit": code}, []


def _check_stdio(name: str, fd: int) -> None:
    """A descriptor the client passes as the command's stdin, stdout or stderr: a regular
    file, a pipe, a socket or a character device that is no terminal. Never a terminal
    (whoever holds one may change its line discipline: the client relays it), nor a
    directory or an O_PATH descriptor, with which the command inside would hold a piece of
    the host's tree (`cd /proc/self/fd/0`: the shape of CVE-2024-21626), nor a block device.
    ProtocolError otherwise."""
    import fcntl
    import stat

    st = os.fstat(fd)
    if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_PATH", 0o10000000):
        raise ProtocolError(f"exec: {name} is an O_PATH descriptor, not an open file")
    if stat.S_ISCHR(st.st_mode) and os.isatty(fd):
        raise ProtocolError("exec: a terminal is never passed (the client relays it)")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)
            or stat.S_ISSOCK(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        raise ProtocolError(f"exec: {name} must be a file, a pipe, a socket or a character "
                            "device (a directory or block device is never passed in)")


def _attend(started: Any, conn: socket.socket | None) -> int:
    """Wait for the command; forward the signals the client asks for; kill it when the
    client leaves (or sends what is not a signal request)."""
    from envctl.runtime.launch import FORWARDED_SIGNALS
    from envctl.server import protocol as proto

    poller = select.poll()
    poller.register(started.pidfd, select.POLLIN)
    if conn is not None:
        poller.register(conn.fileno(), select.POLLIN | select.POLLRDHUP)
        conn.settimeout(5.0)  # a signal request comes whole, or the client is gone
    while True:
        try:
            events = dict(poller.poll())
        except InterruptedError:
            continue
        if started.pidfd in events:
            return started.wait()
        if conn is not None and conn.fileno() in events:
            try:
                frame, got = proto.recv_frame(conn, limit=4096)
                for fd in got:
                    os.close(fd)
                sig = frame.get("sig")
                if frame.get("op") != "signal" or sig not in [int(s) for s in
                                                              FORWARDED_SIGNALS]:
                    raise ProtocolError("exec: only signal requests while it runs")
                started.signal(sig)
            except (OSError, ConnectionError, ProtocolError):
                started.kill()  # the client left: nobody reads its output any more
                poller.unregister(conn.fileno())
                conn = None


# Commands an operator runs through the daemon, and the only options they may carry: nothing
# that changes which specs, state or host settings are used (--config-dir, --cgroup-driver,
# ENVCTL_* of the client): the daemon's own are.
OPERATE = ("up", "down", "status", "plan", "list")
OPERATE_FLAGS = ("--json", "--force", "--check", "--dry-run", "--down", "--wide", "--debug")


def operate(caller: Caller, req: dict, fds: list[int], conn: socket.socket | None = None
            ) -> tuple[dict, list[int]] | None:
    """`envctl up|down|status|plan|list NAME…` for a member of each NAME's access.operate
    (or an admin; without names, meaning all, an admin only): the same command as root runs
    it, in a process of the daemon's with the daemon's settings, its output on the client's
    stdout and stderr; the reply is its exit code. The client leaving interrupts it (SIGINT:
    up and down roll back or finish as at Ctrl-C)."""
    from pathlib import Path

    from envctl.engine.journal import journal_path
    from envctl.errors import AccessDenied

    argv = _strs(req, "argv")
    if not argv or argv[0] not in OPERATE:
        raise ProtocolError(f"request field 'argv': one of {', '.join(OPERATE)}, then names")
    out_fd, err_fd = _fd(req, "stdout_fd", fds), _fd(req, "stderr_fd", fds)
    if out_fd is None or err_fd is None:
        raise ProtocolError("operate: stdout_fd and stderr_fd are required")
    names = []
    for word in argv[1:]:
        if word.startswith("-"):
            if word not in OPERATE_FLAGS:
                raise UsageError(f"envctl {argv[0]} {word}: not through the daemon, which "
                                 "uses its own specs and settings (allowed: "
                                 f"{', '.join(OPERATE_FLAGS)}); ask an admin to run it as root")
        else:
            journal_path(Path("/"), word)  # UsageError for what no environment is called
            names.append(word)
    if not names and not access.is_admin(caller):
        raise AccessDenied(f"{caller.name} may not {argv[0]} every environment: name the "
                           f"environments (envctl {argv[0]} NAME) whose access.operate lists "
                           "you")
    for name in names:
        access.check_operate(name, load_access(name), caller)
    return {"exit": _run_operate(argv, out_fd, err_fd, fds, conn)}, []


def _run_operate(argv: list[str], out_fd: int, err_fd: int, fds: list[int],
                 conn: socket.socket | None) -> int:
    """The command (envctl.commands.run_argv) here, in the request's child, as `envctl ARGV`
    run by root would: stdin /dev/null, the client's stdout and stderr on fds 1 and 2 (the
    child's own put back after), no SUDO_* of the daemon's, SIGINT a KeyboardInterrupt and
    SIGPIPE ignored (as in a new Python). The client leaving sends SIGINT here, as at Ctrl-C:
    `up` and `down` roll back or finish."""
    import signal
    import sys
    import threading

    from envctl import commands

    for key in [k for k in os.environ if k.startswith("SUDO_")]:
        del os.environ[key]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(0), os.dup(1), os.dup(2)]
    null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    for src, dst in ((null, 0), (out_fd, 1), (err_fd, 2)):
        os.dup2(src, dst)
    os.close(null)
    for fd in fds:
        os.close(fd)
    fds.clear()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    stop_r, stop_w = os.pipe2(os.O_CLOEXEC)
    watcher = None
    if conn is not None:
        def watch(fileno: int = conn.fileno()) -> None:
            poller = select.poll()
            poller.register(fileno, select.POLLIN | select.POLLRDHUP)
            poller.register(stop_r, select.POLLIN)
            while True:
                try:
                    events = dict(poller.poll())
                except InterruptedError:
                    continue
                if stop_r not in events:
                    os.kill(os.getpid(), signal.SIGINT)  # the client left (Ctrl-C)
                return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
    try:
        code = commands.run_argv(argv)
    except SystemExit as exc:  # pragma: no cover - the commands return their status
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.write(stop_w, b"x")
        if watcher is not None:
            watcher.join()
        os.close(stop_r)
        os.close(stop_w)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        with contextlib.suppress(OSError):
            sys.stdout.flush()
        with contextlib.suppress(OSError):
            sys.stderr.flush()
        for fd, dst in zip(saved, (0, 1, 2), strict=True):
            os.dup2(fd, dst)
            os.close(fd)
    return code


INLINE = {"ping": ping, "jobs": list_jobs}
FORKED = {"submit": submit, "cancel": cancel, "wait": wait, "logs": logs, "exec": exec_,
          "operate": operate}
