"""The job system's processes: `submit` (stage the executable, start a supervisor), the detached
supervisor of one job (podman's conmon shape), and `cancel`.

The supervisor is forked from the `envctl submit-job` process itself, twice (the intermediate
child calls setsid and exits), not started as `python -m …`: the CLI has already loaded the
environment's context, checked every option and staged the file, so the supervisor starts the
launch within a millisecond of the fork instead of paying a second interpreter start and a
second read of the journal (~40 ms here). It needs no systemd, outlives the CLI (its parent
becomes PID 1 or the nearest subreaper, which reaps it), has /dev/null as stdio and `/` as its
directory, and closes every inherited descriptor but its own. Because `cli.entry` turns the
cyclic GC off for the short-lived CLI, the supervisor, which may live for days, turns it on
again, and it never returns into the CLI's stack: it ends with `os._exit`.

What one supervisor does, in order (each step's failure ends the job FAILED with `error`):

1. writes the record PENDING with its identity (pid and /proc start time) and reports its pid
   to the CLI on a pipe;
2. creates the job's cgroup `<env's cgroup>/job-<id>` in every hierarchy of the environment
   (`launch.create_cgroup`; v1 cpuset: the job's CPUs and the environment's memory nodes);
3. starts the launch (`runtime.launch.start`) with a status pipe, records RUNNING and its
   start time, and tells the CLI ("R");
4. waits on the launch's pidfd, the status pipe and a self-pipe its signal handlers write to:
   SIGUSR1 (`envctl cancel`, after it wrote `<id>.cancel` with the grace) and SIGTERM/SIGINT
   cancel; the time limit sends SIGTERM; SIGKILL to the whole cgroup follows after the grace;
5. when the launcher ends: the job's wait status from the status pipe (from the launcher's
   exit status when the init died without writing it, e.g. the OOM killer chose the init),
   CPU time, peak memory and the OOM-kill counter from the job's cgroup; then it kills what
   is left in the cgroup, removes it, writes the final record (fsynced) and exits.

Killing the supervisor (kill -9) kills the job: the launch's init has PR_SET_PDEATHSIG
(SIGKILL), and the kernel kills a PID namespace whose init dies. The record stays active and
is shown as LOST; `cancel` of it removes what is left of its cgroup and writes LOST for good.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import select
import signal
import stat
import time
from pathlib import Path

from envctl.errors import Busy, EnvctlError, HostError, InputError, NeedsRootError, UsageError
from envctl.record import Factory, Record
from envctl.runtime import jobs
from envctl.runtime.daemon import poll_ms, protect_from_oom, read_report, wait_fd
from envctl.runtime.jobs import Job, State

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~5 ms): see record.py
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from envctl.host.asuser import Creds
    from envctl.host.cgroups import Cgroups
    from envctl.host.context import Host
    from envctl.runtime.context import EnvContext
    from envctl.runtime.launch import Started, User

# How long `submit-job` waits for the supervisor to report that the job started.
# How long `cancel` waits, beyond the grace, for the supervisor to record the end.
CANCEL_SLACK = 15.0
# The final record's write is retried on failure (ENOSPC, EIO: a full or failing state
# disk), after these many seconds each, ~2.5 minutes in all, before the supervisor gives up.
FINAL_RETRIES = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0, 30.0)


class Request(Record):
    """A job as `submit-job` asks for it, before anything is staged or started."""

    exe: Path  # on the host: copied into the job's directory, read as `submitter`
    # The program's path inside the environment when `exe` was a bare name found in its PATH
    # (see make_request): run from the rootfs as it is, nothing staged. "": `exe` is staged.
    program: str = ""
    args: list[str] = Factory(list)
    name: str = ""
    user: User | None = None  # None: refused (never silently root); see launch.resolve_user
    user_name: str = ""
    cpus: tuple[int, ...] | None = None  # None: the environment's
    gpus: tuple[str, ...] | None = None  # UUIDs; None: the environment's
    # Counts (--cpus N, --gpus N: exclusive, chosen by envctl.runtime.slices) and --mem bytes.
    cpu_count: int = 0
    gpu_count: int = 0
    mem: int = 0
    # The job cgroup's own device allow-list (its GPUs' nodes only); None: the environment's.
    devices: tuple[str, ...] | None = None
    env: dict[str, str] = Factory(dict)
    workdir: str = "/"
    output: Path | None = None
    error: Path | None = None
    time_limit: int | None = None
    # Who submits it: the user behind sudo (asuser.submitter); None: this process (root run
    # directly, or a test). The program is read with this user's rights, never root's.
    submitter: Creds | None = None
    # Descriptors the submitter opened itself (the daemon's client, over SCM_RIGHTS): used
    # instead of opening `exe`, `output`, `error` by path (those then only name them).
    program_fd: int | None = None
    output_fd: int | None = None
    error_fd: int | None = None


# ---------------------------------------------------------------- checking a request


def check_request(ctx: EnvContext, req: Request) -> tuple[list[str], str]:
    """Refuse a bad request before anything changes (InputError, exit 2); the argv the job
    runs (its argv[0] as seen inside) and the name of the staged file.

    The program is opened and looked at with the submitting user's rights (a symlink to a file
    that user cannot read is refused as the file would be); the output paths are looked at
    with the job's user's rights: root's are never lent to a path a user names."""
    if req.program:
        # The environment's own program (found in its PATH by make_request): nothing staged.
        argv, staged = [req.program, *req.args], ""
        _check_job_dir(ctx)
        _check_interpreter(ctx, Path(req.program), _rootfs_head(ctx, req.program))
    else:
        argv, staged = _staged_argv(ctx, req)
    _check_options(ctx, req)
    return argv, staged


def _check_job_dir(ctx: EnvContext) -> None:
    if not (Path(ctx.root) / "job").is_dir():
        raise HostError(f"submit-job: environment '{ctx.env}''s rootfs has no /job directory "
                        f"to bind the job's files on: run `envctl up {ctx.env}` with this "
                        "envctl, which makes it")


def _staged_argv(ctx: EnvContext, req: Request) -> tuple[list[str], str]:
    """The argv of a program of this host, staged as /job/NAME, and NAME."""
    exe = req.exe
    fd = _open_program(req)
    try:
        st = os.fstat(fd)
        head = os.pread(fd, 256, 0)  # its #! line, if any
    finally:
        os.close(fd)
    _check_job_dir(ctx)
    staged = exe.name
    if exe.suffix == ".py":
        python = find_in_rootfs(ctx, "python3")
        if python is None:
            raise InputError(f"submit-job: {exe} is a Python script, but environment "
                             f"'{ctx.env}' has no python3 in its rootfs (add `rootfs.python: "
                             "true` to its spec)")
        argv = [python, f"/job/{staged}", *req.args]
    else:
        if not st.st_mode & 0o111:
            raise InputError(f"submit-job: {exe}: not executable (chmod +x it, or give a .py "
                             "script)")
        _check_interpreter(ctx, exe, head)
        argv = [f"/job/{staged}", *req.args]
    return argv, staged


def _check_options(ctx: EnvContext, req: Request) -> None:
    if req.cpus is not None:
        extra = sorted(set(req.cpus) - set(ctx.cpus))
        if not req.cpus or extra:
            raise InputError(f"submit-job --cpus: CPU(s) {_cpulist(extra) or 'none'} not among "
                             f"environment '{ctx.env}''s CPUs ({_cpulist(ctx.cpus)})")
    if req.gpus is not None:
        extra = [g for g in req.gpus if g not in ctx.gpus]
        if extra:
            held = ", ".join(ctx.gpus) or "none"
            raise InputError(f"submit-job --gpus: {', '.join(extra)} not among environment "
                             f"'{ctx.env}''s GPUs ({held})")
    if not req.workdir.startswith("/"):
        raise InputError(f"submit-job --workdir '{req.workdir}': an absolute path inside the "
                         "environment")
    for opt, path, fd in (("--output", req.output, req.output_fd),
                          ("--error", req.error, req.error_fd)):
        if fd is not None:
            _check_given_output(opt, path, fd)
        elif path is not None:
            _check_output(opt, path, _output_creds(req))


def _check_given_output(opt: str, path: Path | None, fd: int) -> None:
    """An output the submitter opened itself: a regular file open for writing."""
    try:
        st = os.fstat(fd)
        mode = fcntl_flags(fd) & os.O_ACCMODE
    except OSError as exc:
        raise InputError(f"submit-job {opt} {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"submit-job {opt} {path}: not a regular file (a device, FIFO or "
                         "socket is refused)")
    if mode not in (os.O_WRONLY, os.O_RDWR):
        raise InputError(f"submit-job {opt} {path}: the descriptor passed is not open for "
                         "writing")


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _output_creds(req: Request) -> tuple | None:
    """Whose rights --output/--error are opened with (see jobs.output_creds)."""
    if req.user is None:
        return None
    return jobs.output_creds(req.user.uid, req.user.gid, req.user.groups,
                             _submitter_ids(req))


def _submitter_ids(req: Request) -> list[int] | None:
    s = req.submitter
    return None if s is None or s.uid == 0 else [s.uid, s.gid, *s.groups]


def _who(creds: Creds | tuple | None) -> str:
    return "root" if creds is None or int(creds[0]) == 0 else f"uid {creds[0]}"


def _open_program(req: Request) -> int:
    """A read-only descriptor of the program, opened with the submitting user's rights
    (O_NONBLOCK: a FIFO must not hang the open); InputError when that user cannot read it or
    it is not a regular file."""
    from envctl.host.asuser import open_as

    exe = req.exe
    try:
        if req.program_fd is not None:  # opened by the submitter itself (the daemon's client)
            fd = os.dup(req.program_fd)
            if fcntl_flags(fd) & (os.O_PATH | os.O_ACCMODE) not in (os.O_RDONLY, os.O_RDWR):
                os.close(fd)
                raise InputError(f"submit-job: {exe}: the descriptor passed is not open for "
                                 "reading")
        else:
            fd = open_as(req.submitter, exe, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        why = exc.strerror
        if req.submitter is not None and isinstance(exc, PermissionError):
            why += f" (read as {_who(req.submitter)}, who submits it)"
        raise InputError(f"submit-job: {exe}: {why}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(f"submit-job: {exe}: not a regular file (give an executable or a "
                             ".py script)")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check_output(opt: str, path: Path, user: Creds | tuple | None) -> None:
    """Refuse an output path the job's user could not write, or that is not (or would not
    be) a regular file, looked at with that user's rights. An existing file is opened for
    writing to tell (without O_TRUNC: nothing changes); anything else is only lstat'ed, since
    opening a device may act on it. `_open_output` checks the descriptor it writes to again."""
    from envctl.host.asuser import as_user

    with as_user(user):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            try:
                parent = os.stat(path.parent)
            except (FileNotFoundError, NotADirectoryError):
                parent = None
            except OSError as exc:
                raise InputError(f"submit-job {opt} {path}: {path.parent}: {exc.strerror} (as "
                                 f"{_who(user)}, whose file it would be)") from None
            if parent is None or not stat.S_ISDIR(parent.st_mode):
                raise InputError(f"submit-job {opt} {path}: directory {path.parent} does not "
                                 "exist") from None
            return  # made by _open_output, with the user's rights (which decide there)
        except OSError as exc:
            raise InputError(f"submit-job {opt} {path}: {exc.strerror} (as "
                             f"{_who(user)}, whose file it would be)") from None
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"submit-job {opt} {path}: is a directory")
        if stat.S_ISLNK(st.st_mode):
            raise InputError(f"submit-job {opt} {path}: is a symlink, which envctl does not "
                             "follow for an output; name the file itself")
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"submit-job {opt} {path}: not a regular file (a device, FIFO or "
                             "socket is refused)")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_NOCTTY | os.O_CLOEXEC))
        except OSError as exc:
            raise InputError(f"submit-job {opt} {path}: {exc.strerror} (as {_who(user)}, "
                             "whose file it would be)") from None


def _check_interpreter(ctx: EnvContext, exe: Path, head: bytes) -> None:
    """A script's `#!` interpreter (and the program `#!/usr/bin/env NAME` runs) must be in the
    environment: refused here, naming it, before a job id is taken, rather than failing at
    the exec as "no such file" about the script itself."""
    if not head.startswith(b"#!"):
        return  # a binary (ELF), or a script the kernel hands to no interpreter
    line = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if not line:
        return
    interp, args = line[0], line[1:]
    fix = "add it to the spec's rootfs.binaries"
    if not interp.startswith("/") or not _in_rootfs(ctx, interp):
        raise InputError(f"submit-job: {exe}: its interpreter {interp} (from its #! line) is "
                         f"not in environment '{ctx.env}'; {fix}")
    if os.path.basename(interp) == "env":
        prog = next((a for a in args if not a.startswith("-")), None)
        if prog is not None and "=" not in prog and find_in_rootfs(ctx, prog) is None:
            raise InputError(f"submit-job: {exe}: its interpreter {prog} (#!{interp} {prog}) "
                             f"is not in environment '{ctx.env}''s PATH; {fix}")


RESOLVE_IN_ROOT = 0x10  # openat2(2): resolve as if the directory were the root


def _in_rootfs(ctx: EnvContext, path: str) -> bool:
    """Whether `path` exists inside the rootfs, resolved as the environment resolves it
    (RESOLVE_IN_ROOT: its symlinks, absolute ones too, and `..` stay inside it)."""
    from envctl.host.safepath import RESOLVE_NO_MAGICLINKS, openat2

    root = os.open(ctx.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.close(openat2(root, path.lstrip("/") or ".", os.O_PATH,
                         resolve=RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS))
        return True
    except OSError:
        return False
    finally:
        os.close(root)


def find_in_rootfs(ctx: EnvContext, name: str, search: str | None = None, *,
                   executable: bool = False) -> str | None:
    """The path inside the environment of program `name`, searched in `search` (default: its
    PATH, from its /etc/environment) as the launch's execvp will: the first entry of that name
    (with `executable`, the first regular file with an execute bit, as execvp skips the
    others). Resolved beneath the rootfs as the environment resolves it
    (RESOLVE_IN_ROOT): a symlink inside it (`/usr/bin/python3 -> python3.11`, absolute ones
    too) is followed within the tree, never out of it; the host's own files are never looked
    at. The rootfs as the host sees it: a program on a data mount is not found here."""
    from envctl.host.safepath import RESOLVE_NO_MAGICLINKS, openat2
    from envctl.runtime.context import DEFAULT_PATH

    if not name or "/" in name or name in (".", ".."):
        return None
    if search is None:
        search = ctx.environ.get("PATH") or DEFAULT_PATH
    root = os.open(ctx.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for d in search.split(":"):
            if not d.startswith("/"):
                continue  # a relative entry names no directory of the environment's
            inside = f"{d.rstrip('/')}/{name}"
            try:
                fd = openat2(root, inside.lstrip("/"), os.O_PATH,
                             resolve=RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
            except OSError:
                continue  # not there (or a loop, a magic link): execvp goes on too
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            if not executable or (stat.S_ISREG(st.st_mode) and st.st_mode & 0o111):
                return inside
    finally:
        os.close(root)
    return None


def _rootfs_head(ctx: EnvContext, inside: str) -> bytes:
    """The first bytes of program `inside` of the rootfs (its #! line, if any), resolved as
    find_in_rootfs resolves it; b"" when it cannot be read. Opened O_PATH first, and read only
    when that descriptor is a regular file: a device node or FIFO planted there is never
    opened for reading."""
    from envctl.host.safepath import RESOLVE_NO_MAGICLINKS, fd_path, openat2

    try:
        root = os.open(ctx.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        fd = openat2(root, inside.lstrip("/"), os.O_PATH,
                     resolve=RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    except OSError:
        return b""
    finally:
        os.close(root)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        rfd = os.open(fd_path(fd), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        try:
            return os.pread(rfd, 256, 0)
        finally:
            os.close(rfd)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _cpulist(cpus: Any) -> str:
    return ",".join(str(c) for c in sorted(cpus))


# ---------------------------------------------------------------- submitting


def submit(host: Host, ctx: EnvContext, req: Request, *, now: float | None = None,
           run_pass: bool = True, taken: Callable[[Job], None] | None = None) -> Job:
    """Check `req`, allocate an id, stage the executable into `<state>/jobs/<id>/`, open the
    output files and start the job's supervisor; the record once the job runs (or once it
    failed to start: FAILED with `error`). Prunes finished records beyond the retention
    first. Bad input (InputError) changes nothing. A job that queues gets a pass of the
    queue here unless `run_pass` is False: then whoever called runs it (`wants_pass`), as
    the daemon does after it answered (a pass holds the jobs lock for ~40 ms with 2,000
    queued, and every submit's answer waited for one).

    `taken(record)`, for a job that starts at once: called as soon as its supervisor has
    written its own first record (PENDING, its pid in it), before the job's start, which
    this call still waits for and settles (a supervisor that dies before it: FAILED). The
    daemon answers a plain `submit-job` there (docs/runtime.md, "What submit-job's answer
    means"): the start itself (cgroup, namespaces, pivot_root, exec) was ~40 ms of ~55."""
    submit_time = time.time() if now is None else now
    argv, staged = check_request(ctx, req)
    assert req.user is not None
    uid, gid = req.user.uid, req.user.gid
    from envctl.runtime import slices

    ask = slices.Ask(cpus=req.cpu_count, cpu_list=req.cpus, gpus=req.gpu_count,
                     gpu_list=req.gpus, mem=req.mem)
    pool = slices.env_pool(ctx)
    slices.check_ask(pool, ask, ctx.env)
    from envctl.runtime import queue

    try:
        with jobs.jobs_lock(host.state_dir):
            # The slice is chosen and recorded under the lock: two submits never take the same.
            got, held, listed, reason = _take_slice(host, ctx, pool, ask, req)
            running = _running_of(ctx, req, held)
            room = _user_room(host, ctx, req, running, queued=reason is not None)
            jid = jobs._allocate_locked(host.state_dir)
            if jid % jobs.PRUNE_EVERY == 0:
                # Not at every submit: prune lists the jobs directory (30,000 entries with
                # 10,000 queued) and queue.count reads every index, under the lock.
                jobs.prune(host.state_dir, queued=queue.count(host.state_dir))
            jdir = jobs.job_dir(host.state_dir, jid)
            stdout = req.output or jdir / "stdout"
            stderr = req.error or jdir / "stderr"
            cgroup = None
            if ctx.cgroup is not None and ctx.cgroup.driver == "cgroupfs":
                # The adapter's parent, without importing the adapter (the host facts: ~12 ms).
                cgroup = {"parent": ctx.cgroup.parent_name,
                          "name": jobs.cgroup_name(ctx.env, jid)}
            job = Job(id=jid, env=ctx.env, argv=argv, name=req.name or req.exe.name,
                      user=req.user_name, uid=uid, gid=gid, groups=list(req.user.groups),
                      submitter=_submitter_ids(req),
                      submit_time=submit_time, boot_id=host.boot_id, stdout=str(stdout),
                      stderr=str(stderr), workdir=req.workdir, time_limit=req.time_limit,
                      cpus=list(got.cpus), gpus=list(got.gpus),
                      cpus_exclusive=got.cpus_exclusive, gpus_exclusive=got.gpus_exclusive,
                      mem_bytes=got.mem or None,
                      requested=_requested(req), cgroup=cgroup,
                      program={"rootfs": req.program} if req.program else
                      {"staged": os.path.abspath(req.exe)})
            if reason is None:
                # Started from now on: the record, with this process as its supervisor until
                # the supervisor's own first write (a submit that dies meanwhile shows it
                # LOST, which frees it), and its id in the started jobs' index (which the
                # queue counts for max_running, and whose slices it holds).
                job.supervisor = jobs.identity()
                jobs.write(host.state_dir, job)
                keep = [j.id for j in held] + [jid]
                if sorted(keep) != sorted(listed):
                    slices.write_index(host.state_dir, keep)
    except OSError as exc:  # a full or failing state disk: no id shown, nothing started
        raise HostError(f"submit-job: {exc.filename or jobs.jobs_dir(host.state_dir)}: "
                        f"{exc.strerror}") from exc
    if reason is not None:
        return _enqueue(host, ctx, req, job, staged, reason, room, running,
                        run_pass=run_pass)
    fds: list[int] = []
    jfd = -1
    try:
        if tuple(got.gpus) != tuple(ctx.gpus):
            req = req.replace(devices=_job_devices(host, ctx, tuple(got.gpus)))
        jfd = _make_job_dir(host.state_dir, jid)
        owner = _host_ids(ctx, uid, gid)
        if not req.program:
            _stage(req, jfd, staged, *owner)
        out_fd, err_fd = _open_outputs(req, job, jfd, owner, fds)
        # The user's only once everything in it is made: nothing of theirs can be in the way.
        os.fchown(jfd, *owner)
    except (OSError, EnvctlError) as exc:
        for fd in fds:
            os.close(fd)
        import shutil  # here, not at the top: it imports bz2 and lzma (~3 ms of a submit)

        shutil.rmtree(jdir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):  # no job: what it held is free again
            jobs.record_path(host.state_dir, jid).unlink()
        if isinstance(exc, EnvctlError):
            raise
        raise HostError(f"submit job {jid}: {exc.filename or jdir}: {exc.strerror}") from exc
    finally:
        if jfd >= 0:
            os.close(jfd)
    on_pid = None
    if taken is not None:
        def on_pid() -> None:
            # The record as the supervisor wrote it ("P" follows its write), else ours.
            try:
                record = jobs.read(host.state_dir, jid) or job
            except EnvctlError:
                record = job
            taken(record)
    try:
        kind, text = _spawn(host, ctx, req, job, out_fd, err_fd, on_pid=on_pid)
    finally:
        for fd in fds:
            os.close(fd)
    final = jobs.read(host.state_dir, jid)
    # The record as this process wrote it, before the supervisor's own first write.
    unclaimed = final is not None and final.active and final.supervisor == job.supervisor
    if (final is None or unclaimed) and kind in ("E", "dead"):
        # The supervisor wrote no record (its first write failed: a full or failing state
        # disk; or it died before it) and started nothing: leave nothing, and print no id
        # that has no record.
        import shutil

        shutil.rmtree(jdir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            jobs.record_path(host.state_dir, jid).unlink()
        raise HostError(f"submit-job: job {jid} was not started: {text}")
    if kind == "dead" and final is not None and final.active:
        # The supervisor died before it started the job (it is gone: its pidfd said so), and
        # nobody else will ever write this record.
        final = final.replace(state=State.FAILED, end_time=time.time(),
                              error=f"the supervisor died before it started the job ({text})")
        try:
            jobs.write(host.state_dir, final, durable=True)
        except OSError as exc:
            raise HostError(f"submit-job: job {jid}: its supervisor died before it started "
                            f"the job ({text}), and its record cannot be written: "
                            f"{exc.strerror}") from exc
    return final or job


def _take_slice(host: Host, ctx: EnvContext, pool: Any, ask: Any, req: Request
                ) -> tuple[Any, list, list, str | None]:
    """(the slice `ask` gets now, the index's active started jobs, the ids it listed, None),
    or with no slice (an empty one) and the reason the job waits in the queue instead
    (runtime.queue): a queue already there (FCFS: it goes behind; a pass may backfill it),
    max_running or max_running_per_user reached, or what it asks for held by others. Call
    under the jobs lock."""
    from envctl.runtime import queue, slices

    held, listed = slices.holders(host.state_dir, host.boot_id)
    mine = [j for j in held if j.env == ctx.env]
    me = _owner(req)
    reason = None
    # The limits first, as a pass (queue.schedule) gives them: such a job cannot start before
    # a running one ends, so its submit needs no pass (`_needs_pass`).
    if ctx.max_running and len(mine) >= ctx.max_running:
        reason = queue.MAX_RUNNING
    elif ctx.max_running_per_user and sum(
            1 for j in mine if queue.owner(j) == me) >= ctx.max_running_per_user:
        reason = queue.MAX_RUNNING_PER_USER
    elif queue.has_pending(host.state_dir, ctx.env):
        reason = queue.PRIORITY
    else:
        got = slices.allocate(pool, [(j.id, slices.slice_of(j)) for j in mine], ask)
        if isinstance(got, slices.Slice):
            return got, held, listed, None
        reason = queue.RESOURCES
    return slices.Slice(), held, listed, reason


def _owner(req: Request) -> int:
    """Whose job it is for the per-user limits (queue.owner): who submitted it, else its
    user."""
    if req.submitter is not None and req.submitter.uid:
        return req.submitter.uid
    return req.user.uid if req.user is not None else 0


def _running_of(ctx: EnvContext, req: Request, held: list[Job]) -> int:
    """How many of the started jobs `held` are in `ctx`'s environment and `req`'s owner's."""
    from envctl.runtime import queue

    me = _owner(req)
    return sum(1 for j in held if j.env == ctx.env and queue.owner(j) == me)


def _user_room(host: Host, ctx: EnvContext, req: Request, running: int, *, queued: bool,
               mine: int = 0) -> int | None:
    """Refuse (HostError, exit 1) a submit past jobs.max_queued_per_user (the user's jobs in
    the environment, pending and running, Slurm's MaxSubmitJobs) or, for a job that is queued,
    past jobs.max_staged_per_user; the bytes its staged program may still take (None:
    unbounded, or it is not queued). `running`: the user's started jobs there (_running_of);
    `mine`: bytes of the job's own program already staged (its recheck under the lock, before
    its record is written). Call under the jobs lock."""
    from envctl.runtime import queue

    me = _owner(req)
    pending, staged = queue.user_load(host.state_dir, ctx.env, me)
    who = "root" if me == 0 else f"uid {me}"
    if ctx.max_queued_per_user and running + pending >= ctx.max_queued_per_user:
        raise HostError(f"submit-job: {who} has {running} job(s) running and {pending} pending "
                        f"in environment '{ctx.env}', its jobs.max_queued_per_user "
                        f"({ctx.max_queued_per_user}): wait for some to end or cancel them")
    if not queued or not ctx.max_staged_per_user:
        return None
    left = ctx.max_staged_per_user - staged
    if left < mine:
        raise _over_staged(ctx, who, staged, mine)
    return left


def _over_staged(ctx: EnvContext, who: str, staged: int, more: int | None) -> HostError:
    from envctl.spec.units import format_size

    extra = "" if more is None else f" and this job's program needs {format_size(more)} more"
    return HostError(f"submit-job: {who}'s queued jobs in environment '{ctx.env}' stage "
                     f"{format_size(staged)}{extra}, past its jobs.max_staged_per_user "
                     f"({format_size(ctx.max_staged_per_user)}): wait for some to start or "
                     "cancel them, or stage less (a small launcher)")


# ---------------------------------------------------------------- the queue


def request_path(state_dir: Path, job_id: int) -> Path:
    """A queued job's request (what its start needs beyond its record): beside the record,
    root's and 0600 as it is, never in the job's directory, which is its user's."""
    return jobs.jobs_dir(state_dir) / f"{job_id}.req"


def _request_json(req: Request) -> dict[str, Any]:
    """What of a Request a queued job's start reads back (`_request_from`). The descriptors
    the client passed are not kept: the program is staged already, and an output the job
    names is opened at its start with the submitter's rights (never root's by name)."""
    u, sub = req.user, req.submitter
    assert u is not None
    return {"exe": str(req.exe), "program": req.program, "args": list(req.args),
            "name": req.name, "user": [u.uid, u.gid, list(u.groups)],
            "user_name": req.user_name, "gpus": None if req.gpus is None else list(req.gpus),
            "env": dict(req.env), "workdir": req.workdir,
            "output": None if req.output is None else str(req.output),
            "error": None if req.error is None else str(req.error),
            "time_limit": req.time_limit,
            "submitter": None if sub is None else [sub.uid, sub.gid, list(sub.groups)]}


def _request_from(raw: Any) -> Request:
    from envctl.host.asuser import Creds
    from envctl.runtime.launch import User

    if not isinstance(raw, dict):
        raise ValueError("not a job request")
    uid, gid, groups = raw["user"]
    sub = raw.get("submitter")
    return Request(exe=Path(raw["exe"]), program=str(raw.get("program") or ""),
                   args=[str(a) for a in raw.get("args") or []], name=str(raw.get("name") or ""),
                   user=User(int(uid), int(gid), tuple(int(g) for g in groups)),
                   user_name=str(raw.get("user_name") or ""),
                   gpus=None if raw.get("gpus") is None else tuple(raw["gpus"]),
                   env={str(k): str(v) for k, v in (raw.get("env") or {}).items()},
                   workdir=str(raw.get("workdir") or "/"),
                   output=Path(raw["output"]) if raw.get("output") else None,
                   error=Path(raw["error"]) if raw.get("error") else None,
                   time_limit=raw.get("time_limit"),
                   submitter=None if not sub else Creds(int(sub[0]), int(sub[1]),
                                                        tuple(int(g) for g in sub[2])))


def _enqueue(host: Host, ctx: EnvContext, req: Request, job: Job, staged: str,
             reason: str, room: int | None = None, running: int = 0, *,
             run_pass: bool = True) -> Job:
    """Queue `job` (id allocated, nothing held): its directory with its program staged, its
    request, then (under the jobs lock) its record PENDING with `reason` and its index line;
    then a pass of the queue (`kick`), which may start it at once, unless no pass could
    (queue.could_start: with 10,000 queued a pass costs ~100 ms, and every submit ran one).
    Its record, as it is then. `room`: the bytes its staged program may take
    (jobs.max_staged_per_user; None: unbounded); checked again under the lock with what the
    user's other queued jobs stage by then (and its jobs.max_queued_per_user with its queued
    jobs then, `running` as submit counted them), so that concurrent submits cannot pass them."""
    from envctl.host.files import write_json
    from envctl.runtime import queue

    jdir = jobs.job_dir(host.state_dir, job.id)
    jfd = -1
    try:
        jfd = _make_job_dir(host.state_dir, job.id)
        owner = _host_ids(ctx, job.uid, job.gid)
        if not req.program:
            job.staged_bytes = _stage(req, jfd, staged, *owner, room=room,
                                      ctx=ctx, who=_owner(req))
        os.fchown(jfd, *owner)
        write_json(request_path(host.state_dir, job.id), _request_json(req), durable=False,
                   mode=jobs.RECORD_MODE)
        job.queued, job.reason = True, reason
        with jobs.jobs_lock(host.state_dir):
            _user_room(host, ctx, req, running, queued=room is not None,
                       mine=job.staged_bytes)
            jobs.write(host.state_dir, job)
            needs_pass = queue.could_start(host.state_dir, job)
            queue.append(host.state_dir, job)
    except (OSError, EnvctlError) as exc:
        import shutil

        shutil.rmtree(jdir, ignore_errors=True)
        for path in (request_path(host.state_dir, job.id),
                     jobs.record_path(host.state_dir, job.id)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if isinstance(exc, EnvctlError):
            raise
        raise HostError(f"submit job {job.id}: {exc.filename or jdir}: {exc.strerror}") from exc
    finally:
        if jfd >= 0:
            os.close(jfd)
    if not needs_pass or not run_pass:
        return job  # as written: nothing started it, nothing else has seen it yet
    kick(host)
    return jobs.read(host.state_dir, job.id) or job


def wants_pass(host: Host, job: Job) -> bool:
    """Whether a job `submit(…, run_pass=False)` returned needs a pass of the queue run for
    it (queue.could_start): queued, and no limit holds it."""
    from envctl.runtime import queue

    return job.queued and job.state is State.PENDING and queue.could_start(host.state_dir, job)


KICK_LOCK, KICK_AGAIN = ".kick", ".kick-again"


def kick(host: Host) -> list[Job]:
    """Run the queue: pass after pass (queue.claim), start what each says, until a pass starts
    nothing; the records of the jobs started. One kicker at a time (`<state>/jobs/.kick`,
    flock'd): a kick that finds another running leaves `.kick-again` for it (it passes once
    more) and returns at once, so that submits never wait for starts. Called after a queued
    submit, by a supervisor once its job's final record is written, after a cancel, and by
    the daemon at start and every few seconds; nothing needs the daemon."""

    d = jobs.jobs_dir(host.state_dir)
    if not (d / ".queue").is_dir():
        return []
    started: list[Job] = []
    again = d / KICK_AGAIN
    # A cancel of a job this process has claimed but whose supervisor has not yet written its
    # record signals this process: ignored here, the supervisor reads the request's file.
    old = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        return _kick(host, d, again, started)
    finally:
        signal.signal(signal.SIGUSR1, old)


def _kick(host: Host, d: Path, again: Path, started: list[Job]) -> list[Job]:
    import fcntl

    while True:
        # Asked for first, then the lock tried: a kicker that lets go of the lock looks for
        # the request after it did, so a request made while it held the lock is never lost
        # (asked after its look, the lock is free and taken here).
        os.close(os.open(again, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        fd = os.open(d / KICK_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return started
            while True:
                with contextlib.suppress(FileNotFoundError):
                    again.unlink()
                claims = _claim(host)
                for ctx, job in claims:
                    started.append(_start_queued(host, ctx, job))
                if not claims and not again.exists():
                    break
        finally:
            os.close(fd)
        if not again.exists():  # left after our last look, before we unlocked
            return started


def _claim(host: Host) -> list:
    from envctl.runtime import queue
    from envctl.runtime.context import EnvContext

    contexts: dict[str, Any] = {}

    def load(env: str) -> Any:
        if env not in contexts:
            try:
                contexts[env] = EnvContext.load(host, env)
            except EnvctlError:
                contexts[env] = None  # not up (or not enterable): its queue waits
        return contexts[env]

    return queue.claim(host, load)


def _start_queued(host: Host, ctx: EnvContext, job: Job) -> Job:
    """Start a claimed queued job as `submit` starts one: its outputs opened now (a path it
    names with the submitter's rights), its supervisor spawned. A start that fails ends it
    FAILED, never started, with why."""
    fds: list[int] = []
    jfd = -1
    try:
        try:
            req = _request_from(json.loads(request_path(host.state_dir, job.id).read_bytes()))
        except (ValueError, KeyError, TypeError) as exc:
            raise HostError(f"its request {request_path(host.state_dir, job.id)} is damaged: "
                            f"{exc}") from None
        if tuple(job.gpus) != tuple(ctx.gpus):
            req = req.replace(devices=_job_devices(host, ctx, tuple(job.gpus)))
        top = os.open(jobs.jobs_dir(host.state_dir), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            jfd = os.open(str(job.id), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                          | os.O_CLOEXEC, dir_fd=top)
        finally:
            os.close(top)
        out_fd, err_fd = _open_outputs(req, job, jfd, _host_ids(ctx, job.uid, job.gid), fds)
    except (OSError, EnvctlError) as exc:
        for fd in fds:
            os.close(fd)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        if isinstance(exc, OSError) and exc.filename:
            why = f"{exc.filename}: {why}"
        failed = job.replace(state=State.FAILED, end_time=time.time(),
                             error=f"could not be started: {why}")
        with contextlib.suppress(OSError):
            jobs.write(host.state_dir, failed, durable=True)
        with contextlib.suppress(FileNotFoundError):
            request_path(host.state_dir, job.id).unlink()
        return failed
    finally:
        if jfd >= 0:
            os.close(jfd)
    try:
        from envctl.runtime.queue import _fault

        _fault("start", job.id)
        kind, text = _spawn(host, ctx, req, job, out_fd, err_fd)
    finally:
        for fd in fds:
            os.close(fd)
    final = jobs.read(host.state_dir, job.id)
    if final is not None and final.queued:
        return final  # put back in the queue meanwhile: its request is needed at its start
    with contextlib.suppress(FileNotFoundError):
        request_path(host.state_dir, job.id).unlink()
    unclaimed = final is not None and final.active and final.supervisor == job.supervisor
    if final is not None and final.active and (kind == "dead" or (kind == "E" and unclaimed)):
        why = (f"the supervisor died before it started the job ({text})" if kind == "dead"
               else f"could not be started: {text}")
        final = final.replace(state=State.FAILED, end_time=time.time(), error=why)
        with contextlib.suppress(OSError):
            jobs.write(host.state_dir, final, durable=True)
    return final or job


def _open_outputs(req: Request, job: Job, jfd: int, owner: tuple[int, int],
                  fds: list[int]) -> tuple[int, int]:
    """The job's stdout and stderr descriptors (each appended to `fds`, to close): the
    default ones made in its directory `jfd` as `owner`'s, the ones it names opened with
    the submitter's rights (see _open_output)."""
    stdout, stderr = Path(job.stdout), Path(job.stderr)
    out_fd = _open_output(stdout, owner if req.output is None else _output_creds(req),
                          jfd if req.output is None else None, given=req.output_fd)
    fds.append(out_fd)
    err_fd = (out_fd if _same_file(stdout, stderr) else
              _open_output(stderr, owner if req.error is None else _output_creds(req),
                           jfd if req.error is None else None, given=req.error_fd))
    if err_fd != out_fd:
        fds.append(err_fd)
    return out_fd, err_fd


def _requested(req: Request) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if req.cpu_count or req.cpus is not None:
        out["cpus"] = req.cpu_count or _cpulist(req.cpus)
    if req.gpu_count or req.gpus is not None:
        out["gpus"] = req.gpu_count or list(req.gpus or ())
    if req.mem:
        out["mem"] = req.mem
    return out


def exec_devices(host: Host, ctx: EnvContext) -> tuple[str, ...] | None:
    """The device allow-list of an `exec` in `ctx`: the environment's, less the nodes of the
    GPUs its active jobs hold exclusively (`--gpus N`), so that an exec cannot open a GPU a
    job was given as its own; None (the environment's list) when no job holds one. (An exec
    is not in the holders' index: a job submitted while it runs may still be given a GPU the
    exec has open.)"""
    from envctl.runtime import slices

    if not ctx.gpus or not ctx.device_rules:
        return None
    held, _ = slices.holders(host.state_dir, host.boot_id)
    taken = {g for j in held if j.env == ctx.env and j.gpus_exclusive for g in j.gpus}
    if not taken:
        return None
    return _job_devices(host, ctx, tuple(g for g in ctx.gpus if g not in taken))


def _job_devices(host: Host, ctx: EnvContext, gpus: tuple[str, ...]) -> tuple[str, ...] | None:
    """The device allow-list of a job holding `gpus` of the environment's GPUs (see
    slices.job_device_rules); None when the environment has no list of its own."""
    from envctl.host.devices import resolve_rules
    from envctl.host.gpus import read_proc_gpus
    from envctl.runtime import slices

    if not ctx.device_rules:
        return None
    found, _ = read_proc_gpus(host.gpu_root)
    minors = {g.uuid: g.minor for g in found if g.uuid in ctx.gpus}
    if missing := [u for u in ctx.gpus if u not in minors]:
        raise HostError(f"submit-job: GPU {', '.join(missing)} of environment '{ctx.env}' is "
                        f"not in {host.gpu_root / 'proc/driver/nvidia/gpus'}: its node is "
                        "unknown, so the job's GPUs cannot be kept apart")
    try:
        rules = slices.job_device_rules(resolve_rules(ctx.device_rules, host.gpu_root / "proc"),
                                        minors, gpus)
    except ValueError as exc:
        raise HostError(f"submit-job: {exc}: a job's GPUs cannot be kept apart from the "
                        "others'") from None
    return rules


def _host_ids(ctx: EnvContext, uid: int, gid: int) -> tuple[int, int]:
    """The host ids the job's uid and gid are: the same, but for 0 in an environment with a
    user namespace (root inside is the environment's own host id, launch._write_id_maps), so
    that the job's root can read its 0700 directory."""
    base = ctx.userns
    return (base if base and uid == 0 else uid), (base if base and gid == 0 else gid)


def _make_job_dir(state_dir: Path, jid: int) -> int:
    """Make `<state>/jobs/<id>/` (root's and 0700 until submit hands it to the job's user) and
    return a descriptor of it: everything in it is made through that descriptor."""
    jobs_fd = os.open(jobs.jobs_dir(state_dir), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.mkdir(str(jid), 0o700, dir_fd=jobs_fd)
        fd = os.open(str(jid), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=jobs_fd)
    finally:
        os.close(jobs_fd)
    os.fchmod(fd, 0o700)  # mkdir's mode passed the umask
    return fd


# The most a staged program may hold. Root copies it into the state disk (root's reserved
# blocks too) from a file the user names, whose holes cost the user nothing: `truncate -s 1T`.
MAX_PROGRAM = 1 << 30


def _too_big(req: Request) -> InputError:
    return InputError(f"submit-job: {req.exe}: more than 1 GiB, the most a staged program may "
                      "be (put big files on a data mount and give a small launcher)")


def _stage(req: Request, jfd: int, staged: str, uid: int, gid: int, *,
           room: int | None = None, ctx: EnvContext | None = None, who: int = 0) -> int:
    """Copy the program into the job's directory (descriptor `jfd`) as the submitting user can
    read it — opened with that user's rights, never root's, so the copy holds nothing that
    user could not read — with its permission bits (never set-id ones: it runs with
    no_new_privs anyway), owned by the job's user so that a mode like 0700 still lets the job
    run it. /job is bound read-only: the job cannot change it. (sendfile, as
    shutil.copyfile does on Linux, without importing shutil.) `room`: the most bytes it may
    take beside the user's other queued jobs (jobs.max_staged_per_user of `ctx`; None:
    unbounded), refused past it (HostError) as MAX_PROGRAM is. The bytes copied."""
    fd_in = _open_program(req)
    most = MAX_PROGRAM if room is None else min(MAX_PROGRAM, room)

    def over(size: int | None) -> EnvctlError:
        # `size`: the program's, when known (None: it grew past `most` while being copied).
        if (size or 0) > MAX_PROGRAM or ctx is None or room is None or most == MAX_PROGRAM:
            return _too_big(req)
        return _over_staged(ctx, "root" if who == 0 else f"uid {who}",
                            ctx.max_staged_per_user - room, size)

    try:
        fd_out = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=jfd)
        try:
            at = 0  # by offset: a descriptor the client passed shares its file position
            size = os.fstat(fd_in).st_size
            if size > most:
                raise over(size)
            # Bounded as it goes too: the user may extend the file (holes cost them nothing)
            # while root copies it.
            while sent := os.sendfile(fd_out, fd_in, at, most + 1 - at):
                at += sent
                if at > most:
                    raise over(None)
            os.fchown(fd_out, uid, gid)
            os.fchmod(fd_out, os.fstat(fd_in).st_mode & 0o777)
        except OSError as exc:  # sendfile's errors name no file: the copy's source is it
            raise OSError(exc.errno, exc.strerror, str(req.exe)) from None
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)
    return at


def _open_output(path: Path, user: Creds | tuple | None, jfd: int | None, *,
                 given: int | None = None) -> int:
    """Open (truncate, as Slurm's default) an output file for the job. A default one, in the
    job's new directory, is made there through its descriptor, 0600 and `user`'s. Any
    other is opened with `user`'s rights (see _output_creds), so that a file that user cannot
    write stays as it is, never through a symlink (O_NOFOLLOW), and refused unless the
    descriptor is a regular file (O_NONBLOCK: a FIFO must not hang the open; cleared once it
    is known to be a file) before anything is truncated."""
    from envctl.host.asuser import open_as

    if given is not None:  # opened by the submitter itself: checked in _check_given_output
        fd = os.dup(given)
        try:
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl_flags(fd) | os.O_APPEND)
            os.ftruncate(fd, 0)
        except BaseException:
            os.close(fd)
            raise
        return fd
    if jfd is not None:  # a default output, `path` in the job's directory `jfd`
        fd = os.open(path.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_APPEND | os.O_CLOEXEC, 0o600, dir_fd=jfd)
        try:
            if user is not None:
                os.fchown(fd, user[0], user[1])
        except BaseException:
            os.close(fd)
            raise
        return fd
    try:
        fd = open_as(user, path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                     | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(f"submit-job {path}: is a symlink, which envctl does not follow "
                             "for an output; name the file itself") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(f"submit-job {path}: not a regular file (a device, FIFO or "
                             "socket is refused)")
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _same_file(a: Path, b: Path) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _spawn(host: Host, ctx: EnvContext, req: Request, job: Job, out_fd: int,
           err_fd: int, *, on_pid: Callable[[], None] | None = None) -> tuple[str, str]:
    """Start the supervisor (double fork) and wait for its report (see daemon.read_report;
    `on_pid` at its "P")."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the intermediate child
        code = 1
        try:
            os.close(r)
            os.setsid()  # its own session, no terminal: Ctrl-C in the shell does not reach it
            if os.fork() == 0:  # the grandchild, no session leader: it never gets a terminal
                _supervisor_main(host, ctx, req, job, out_fd, err_fd, w)  # never returns
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        return read_report(r, on_pid=on_pid)
    finally:
        os.close(r)
        # The intermediate exits at once; reaped after the report, not before it: its exit
        # (unmapping its copy-on-write copy of this process) runs beside the supervisor's
        # start instead of ahead of the report.
        os.waitpid(pid, 0)


# ---------------------------------------------------------------- bounded output


class _Output:
    """One of a job's outputs behind a pipe (jobs.max_output): the supervisor copies the pipe
    into the file (splice: no copy through this process) up to `limit` bytes; past it one line
    says so in the file, the copying stops and the pipe's read end is closed, so that the job's
    next write gets EPIPE (SIGPIPE unless it ignores it) and it knows its output is gone.
    Not RLIMIT_FSIZE: that would bound every file the job writes (a checkpoint on a data
    mount), and tell it with EFBIG on those too."""

    def __init__(self, name: str, dst: int, limit: int):
        import fcntl

        self.name, self.dst, self.limit = name, dst, limit
        self.r, self.w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self.r, False)
        # splice(2) refuses a destination opened O_APPEND (EINVAL); this process is the file's
        # only writer now (an output named twice shares one _Output), so the position is it.
        flags = fcntl.fcntl(dst, fcntl.F_GETFL)
        if flags & os.O_APPEND:
            fcntl.fcntl(dst, fcntl.F_SETFL, flags & ~os.O_APPEND)
            os.lseek(dst, 0, os.SEEK_END)
        self.copied = 0
        self.cut = False
        self.splice = hasattr(os, "splice")

    @property
    def open(self) -> bool:
        return self.r >= 0

    def close_write(self) -> None:
        if self.w >= 0:
            os.close(self.w)
            self.w = -1

    def close(self) -> None:
        self.close_write()
        if self.r >= 0:
            os.close(self.r)
            self.r = -1

    def pump(self) -> bool:
        """Copy what the pipe holds now; True when this output was cut just now. The read end
        is closed at EOF and at the cut."""
        while self.r >= 0:
            room = self.limit - self.copied
            try:
                if room <= 0:
                    more = os.read(self.r, 1)  # past the bound: is there anything beyond it?
                    if more:
                        self._cut()
                        return True
                    self.close()  # EOF exactly at the bound
                    return False
                n = self._copy(min(room, 1 << 20))
            except BlockingIOError:
                return False  # empty for now
            except OSError:
                # The file refuses (ENOSPC, EIO): keep draining so the job is not blocked, as
                # service.log drops what it cannot write; the record says nothing was cut.
                with contextlib.suppress(OSError):
                    n = len(os.read(self.r, 65536))
                    if n == 0:
                        self.close()
                return False
            if n == 0:
                self.close()
                return False
            self.copied += n
        return False

    def _copy(self, most: int) -> int:
        if self.splice:
            try:
                return os.splice(self.r, self.dst, most, flags=os.SPLICE_F_NONBLOCK)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS):
                    raise
                self.splice = False  # a file system without splice: read and write
        data = os.read(self.r, min(most, 65536))
        if data:
            os.write(self.dst, data)
        return len(data)

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.dst, f"\nenvctl: output truncated at {self.limit} bytes "
                     "(jobs.max_output)\n".encode())
        self.cut = True
        self.close()


# ---------------------------------------------------------------- the supervisor


class _Supervisor:
    """The state of one supervisor process (runs only in the forked grandchild)."""

    def __init__(self, host: Host, ctx: EnvContext, req: Request, job: Job, report: int):
        self.host = host
        self.ctx = ctx
        self.req = req
        self.job = job
        self.report_fd: int | None = report
        self.cancel_requested = False
        # Whether the record is this process's (its first write done, or the claim taken
        # over): a failure before that writes nothing (the job may be queued again, or
        # another supervisor's by now).
        self.owned = False
        self.cancel_signal: int | None = None  # what asked: SIGUSR1 (cancel) or SIGTERM/SIGINT
        self.cg_name = f"job-{job.id}"  # below the environment's cgroup
        self.cg_dirs: list[Path] | None = None  # made (cgroupfs driver)
        self.attempts: dict[str, int] = {}  # writes tried per state (ENVCTL_FAULT's `record`)
        self.outputs: list[_Output] = []  # behind pipes when jobs.max_output bounds them
        self.gpu_meter: Any = None  # a monitor.nvml.JobGpuMeter while a GPU job runs
        self.gpu_note: str | None = None  # why there is none for a GPU job

    # -- talking to the CLI
    def tell(self, line: str) -> None:
        if self.report_fd is None:
            return
        with contextlib.suppress(OSError):  # EPIPE: the CLI is gone (Ctrl-C); go on
            os.write(self.report_fd, (line.replace("\n", " ") + "\n").encode())

    def done_telling(self) -> None:
        if self.report_fd is not None:
            os.close(self.report_fd)
            self.report_fd = None

    def save(self, *, durable: bool = False) -> None:
        """Write the record; OSError when it cannot be (ENOSPC, EIO). `ENVCTL_FAULT`'s point
        `record` (engine.faults) fails it on purpose, keyed by the state written and the
        attempt at writing it."""
        if "ENVCTL_FAULT" in os.environ:
            from envctl.engine.faults import maybe_fault

            key = str(self.job.state)
            self.attempts[key] = self.attempts.get(key, 0) + 1
            maybe_fault("record", key, self.attempts[key])
        jobs.write(self.host.state_dir, self.job, durable=durable)

    def _take_claim(self, claimer: dict | None) -> bool:
        """The first write of a job claimed from the queue: a compare-and-swap under the jobs
        lock. It takes the job over only while its record is still that claim (claimed,
        PENDING, with `claimer` as its supervisor); False when a pass put it back in the
        queue meanwhile (queue.requeue_orphans: its claimer had died), and then it writes
        nothing. OSError as `save`."""
        from envctl.runtime.queue import _fault

        _fault("own", self.job.id)
        with jobs.jobs_lock(self.host.state_dir):
            now = jobs.read(self.host.state_dir, self.job.id)
            if (now is None or not now.claimed or now.queued or now.state is not State.PENDING
                    or now.supervisor != claimer):
                return False
            self.job.claimed = False
            self.save()
        return True

    def save_or_log(self) -> bool:
        """Write a record that is not the last one, never letting its failure touch the running
        job: it is logged (see `log`) and the next write carries everything. True if written."""
        try:
            self.save()
            return True
        except OSError as exc:
            self.log(f"could not write the record of job {self.job.id} ({self.job.state}): "
                     f"{exc.strerror or exc}; the job goes on")
            return False

    def save_final(self) -> None:
        """Write the final record (fsynced), retried with a growing delay (FINAL_RETRIES)
        while the disk refuses it, each failure logged: one failed write must not leave the
        record active, shown LOST once this process is gone."""
        for attempt, delay in enumerate((*FINAL_RETRIES, None), 1):
            try:
                self.save(durable=True)
                if attempt > 1:
                    self.log(f"wrote the final record of job {self.job.id} at attempt "
                             f"{attempt}")
                return
            except OSError as exc:
                why = exc.strerror or str(exc)
                if delay is None:
                    self.log(f"could not write the final record of job {self.job.id} "
                             f"({self.job.state}): {why}; gave up after {attempt} attempts")
                    return  # active on disk: shown LOST, and `cancel` finalizes it
                self.log(f"could not write the final record of job {self.job.id} "
                         f"({self.job.state}): {why}; retrying in {delay:g} s")
                time.sleep(delay)

    def log(self, line: str) -> None:
        """A line of the supervisor's own on the job's stderr, as slurmstepd writes its errors
        to the job's (the supervisor has no other output: its stdio is /dev/null). Nothing
        when that cannot be written either."""
        fd = getattr(self, "err_fd", None)
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(fd, f"envctl: {line}\n".encode(errors="replace"))

    # -- the job's cgroup (cgroupfs driver; with systemd's, a scope systemd makes and removes)
    def _cgroups(self) -> Cgroups | None:
        if self.cg_dirs is None:
            return None
        from envctl.runtime.launch import cgroup_adapter

        return cgroup_adapter(self.ctx)

    def _cg_path(self) -> str:
        return jobs.cgroup_name(self.ctx.env, self.job.id)

    def _controllers(self) -> tuple[str, ...] | None:
        return (self.ctx.cgroup.controllers if self.ctx.cgroup else ()) or None

    # -- running
    def run(self) -> None:
        from envctl.runtime.launch import (
            Bind,
            Launch,
            create_cgroup,
            start,
            supervisor_scope,
            systemd_attach,
        )

        claimer = self.job.supervisor
        self.job.supervisor = jobs.identity()
        try:
            if self.job.claimed:
                if not self._take_claim(claimer):
                    # Put back in the queue meanwhile (its claimer died first: the pass that
                    # did so starts it anew): nothing of it is this process's to touch.
                    self.tell(f"P {os.getpid()}")
                    self.tell("E its claim was taken back: the job is queued again")
                    return
            else:
                self.save()
            self.owned = True
        except OSError as exc:
            # No record, nothing started: `submit` says so and removes the job's directory,
            # and no id is printed that has no record. ("E" without "P": "P" says the record
            # is this process's, and the daemon answers a plain submit-job there.)
            self.tell(f"E could not write the job's record: {exc.strerror or exc}")
            return
        self.tell(f"P {os.getpid()}")
        started = None
        try:
            # Out of the submitter's cgroup, beside the launch (systemd driver; see there).
            scoped = supervisor_scope(self.ctx, f"job{self.job.id}-supervisor")
            dirs = create_cgroup(self.ctx, self.cg_name, cpus=tuple(self.job.cpus),
                                 mem=self.job.mem_bytes or 0, devices=self.req.devices)
            if self.ctx.cgroup is not None and self.ctx.cgroup.driver == "cgroupfs":
                self.cg_dirs = dirs
            if self.cancel_requested or jobs.cancel_path(self.host.state_dir,
                                                         self.job.id).exists():
                # Cancelled while PENDING (the request may have gone to whoever started
                # it, before this process was its supervisor): never started.
                self.finish(None, cancelled=True)
                self.tell("E cancelled before it started")
                return
            from envctl.engine.quarantine import refuse_quarantined

            refuse_quarantined(self.host.state_dir, list(self.job.gpus))  # fail, not crash
            stdio = self._output_pipes()
            status_r, status_w = os.pipe()
            launch = Launch(
                ctx=self.ctx, argv=self.job.argv, environ=self.environ, user=self.req.user,
                cwd=self.job.workdir, cpus=tuple(self.job.cpus), cgroup_dirs=dirs,
                binds=[Bind(str(jobs.job_dir(self.host.state_dir, self.job.id)), "/job", True)],
                stdio=(self.devnull, *stdio), status_fd=status_w,
                keep_out=tuple(o.r for o in self.outputs),
                attach=systemd_attach(self.ctx, mem=self.job.mem_bytes or 0,
                                      devices=self.req.devices, cpus=tuple(self.job.cpus)),
                oom_score_adj=0)
            try:
                started = start(launch)
            finally:
                os.close(status_w)
                for o in self.outputs:  # the job's ends are the job's alone
                    o.close_write()
            if scoped is not None:
                scoped()
        except (EnvctlError, OSError) as exc:  # OSError: a cgroup or pipe the kernel refused
            status = None
            if started is not None:  # it runs, but its supervisor would die with the submitter
                started.kill()
                status, _, _ = self.watch(started, status_r)
            self.finish(status, error=str(exc), exit_code=getattr(exc, "exit_code", None))
            self.tell(f"E {exc}")  # after the final record: the CLI reads it next
            return
        self.job.state = State.RUNNING
        self.job.start_time = time.time()
        self.save_or_log()  # a failed write never kills the job: the final one says it all
        self.tell("R")
        self.done_telling()
        # The cyclic GC, off in the CLI, goes on for a process that may live for days: after
        # the start, which it would only slow down, and with what the CLI left frozen (never
        # scanned, never copied on write by a collection).
        gc.freeze()
        gc.enable()
        self._open_gpu_meter()
        status, timed_out, cancelled = self.watch(started, status_r)
        self.finish(status, cancelled=cancelled, timed_out=timed_out)

    def watch(self, started: Started, status_r: int) -> tuple[int | None, bool, bool]:
        """Wait until the launch ends, enforcing the time limit and cancel requests; (the
        job's raw wait status or None, timed out, cancelled)."""
        poller = select.poll()
        poller.register(self.wake_r, select.POLLIN)
        poller.register(status_r, select.POLLIN)
        poller.register(started.pidfd, select.POLLIN)
        by_fd = {o.r: o for o in self.outputs if o.open}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        t0 = time.monotonic()
        limit_at = t0 + self.job.time_limit if self.job.time_limit else None
        reason: str | None = None
        kill_at: float | None = None
        sample_every = _gpu_sample_seconds() if self.gpu_meter is not None else None
        sample_at = t0 + min(1.0, sample_every) if sample_every else None
        buf = b""
        ended = False
        while not ended:
            now = time.monotonic()
            if sample_at is not None and sample_every and now >= sample_at:
                self._sample_gpus()
                sample_at = now + sample_every
            # The first cause stands, with its grace: a cancel once the time limit fired (or a
            # second cancel) changes neither the state the job ends in nor its SIGKILL's time.
            if reason is None and self.cancel_requested:
                reason = "cancel"
                kill_at = now + self._cancel_grace()
                started.signal(signal.SIGTERM)  # the launcher and init forward it to the job
                self._record_stopping(reason, kill_at - now)
            if reason is None and limit_at is not None and now >= limit_at:
                reason = "timeout"
                kill_at = now + jobs.KILL_GRACE
                started.signal(signal.SIGTERM)
                self._record_stopping(reason, kill_at - now)
            if kill_at is not None and now >= kill_at:
                kill_at = None
                self._kill_all(started)
            due = [t for t in (limit_at if reason is None else None, kill_at, sample_at)
                   if t is not None]
            for fd, _ in poller.poll(poll_ms(min(due) - now) if due else None):
                if fd == self.wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 256)
                elif fd == status_r:
                    data = os.read(status_r, 64)
                    if data:
                        buf += data
                    else:
                        poller.unregister(status_r)
                elif fd in by_fd:
                    self._pump(by_fd[fd])
                    if not by_fd[fd].open:
                        poller.unregister(fd)
                        del by_fd[fd]
                elif fd == started.pidfd:
                    ended = True
        # What is still in the pipes: the namespace's processes died with the init, so nothing
        # writes any more (EAGAIN ends it where a dying one still holds its end).
        for o in by_fd.values():
            self._pump(o)
            o.close()
        from envctl.runtime.launch import final_status

        status: int | None = final_status(started, status_r, buf)
        if reason is None and self.cancel_requested and status is not None and not (
                os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            # Asked to stop in the same wake-up as the job ended, not by itself: systemd at
            # shutdown signals the job's scope and this one's at once, and the job may be
            # gone before this loop looked at the request. The stop ended it.
            reason = "cancel"
        return status, reason == "timeout", reason == "cancel"

    def _record_stopping(self, cause: str, grace: float) -> None:
        """Say in the record why and until when the job is being stopped: a `cancel` that
        comes later waits for this SIGKILL, not for its own grace."""
        wall = time.time()
        self.job.stopping = {"cause": cause, "since": wall, "kill_at": wall + grace}
        self.save_or_log()

    def _open_gpu_meter(self) -> None:
        """For a job holding GPUs: NVML's energy counters now, and its GPU memory sampled
        from now on (monitor.nvml.JobGpuMeter). Nothing NVML does (missing, failing) touches
        the job: the GPU fields stay None and `gpu_note` says why."""
        if not self.job.gpus:
            return
        try:
            from envctl.monitor.nvml import job_meter

            self.gpu_meter, why = job_meter(self.host.gpu_root, list(self.job.gpus))
            self.gpu_note = why or None
        except Exception as exc:  # noqa: BLE001 - a broken NVML must never fail the job
            self.gpu_meter, self.gpu_note = None, f"NVML: {exc!r}"

    def _job_pids(self) -> Any:
        """Whether a host pid is one of the job's: in its cgroup (cgroup.procs), or, where
        envctl has no cgroup of the job's to read, any process on GPUs that are its alone."""
        for d in self.cg_dirs or ():
            try:
                pids = {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except OSError:
                continue
            return pids.__contains__
        exclusive = self.job.gpus_exclusive or tuple(self.job.gpus) == tuple(self.ctx.gpus)
        return (lambda pid: True) if exclusive else (lambda pid: False)

    def _sample_gpus(self) -> None:
        """One sample of the job's GPU memory; a new peak goes into the record at once (as
        sstat shows a running job's), other samples write nothing."""
        try:
            self.gpu_meter.sample(self._job_pids())
        except Exception as exc:  # noqa: BLE001 - see _open_gpu_meter
            self.gpu_note = f"NVML sampling failed: {exc!r}"
            self.gpu_meter = None
            return
        peak = self.gpu_meter.peak_total
        if peak is not None and peak != self.job.gpu_peak_memory_bytes:
            self.job.gpu_peak_memory_bytes = peak
            self.save_or_log()

    def _finish_gpus(self) -> None:
        """The record's GPU fields: GPU-seconds (elapsed x GPUs held, whatever NVML says), and
        what the meter counted."""
        j = self.job
        if not j.gpus:
            return
        elapsed = j.elapsed()
        j.gpu_seconds = None if elapsed is None else round(elapsed * len(j.gpus), 3)
        got: dict[str, Any] = {}
        if self.gpu_meter is not None:
            try:
                got = self.gpu_meter.finish()
            except Exception as exc:  # noqa: BLE001 - see _open_gpu_meter
                self.gpu_note = f"NVML: {exc!r}"
            self.gpu_meter = None
        j.gpu_energy_joules = got.get("gpu_energy_joules")
        j.gpu_peak_memory_bytes = got.get("gpu_peak_memory_bytes")
        j.gpu_usage = got.get("gpu_usage")
        j.gpu_note = "; ".join(n for n in (self.gpu_note, got.get("gpu_note")) if n) or None

    def _output_pipes(self) -> tuple[int, int]:
        """The job's stdout and stderr: the output files themselves when jobs.max_output is
        unbounded (0), else pipes the supervisor copies into them (_Output): one pipe when both
        are one file (the same path, or descriptors of one inode), its bound shared."""
        limit = self.ctx.max_output
        if limit <= 0:
            return self.out_fd, self.err_fd
        out = _Output("stdout", self.out_fd, limit)
        self.outputs.append(out)
        a, b = os.fstat(self.out_fd), os.fstat(self.err_fd)
        if self.err_fd == self.out_fd or (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
            return out.w, out.w
        err = _Output("stderr", self.err_fd, limit)
        self.outputs.append(err)
        return out.w, err.w

    def _pump(self, o: _Output) -> None:
        if o.pump():
            self.job.output_truncated = [*self.job.output_truncated, o.name]
            self.save_or_log()

    def _cancel_grace(self) -> float:
        try:
            data = json.loads(jobs.cancel_path(self.host.state_dir, self.job.id).read_text())
            return jobs.check_grace(float(data.get("grace", jobs.KILL_GRACE)))
        except (OSError, ValueError, TypeError, AttributeError, UsageError):
            return jobs.KILL_GRACE  # SIGTERM to the supervisor itself: the default

    def _cancel_reason(self) -> str | None:
        """Why a cancelled job was cancelled, for its record: the reason its cancel request
        gives (`down` while the host shuts down), else SHUTDOWN_REASON when systemd sent the
        SIGTERM while shutting the host down (it stops the jobs' scopes itself, maybe before
        envctl.service's `down`), else None (a user's cancel)."""
        with contextlib.suppress(OSError, ValueError, AttributeError):
            data = json.loads(jobs.cancel_path(self.host.state_dir, self.job.id).read_text())
            if isinstance(data.get("reason"), str):
                return data["reason"]
        if self.cancel_signal == signal.SIGTERM and self.host.systemd.stopping():
            return SHUTDOWN_REASON
        return None

    def _kill_all(self, started: Started) -> None:
        """SIGKILL the launcher: the init dies with it (PDEATHSIG), and the kernel kills the
        rest of the PID namespace; the job's cgroup too, for good measure."""
        started.kill()
        cg = self._cgroups()
        if cg is not None:
            with contextlib.suppress(HostError):
                cg.kill(self._cg_path(), self._controllers(), grace=0)

    def finish(self, status: int | None, *, cancelled: bool = False, timed_out: bool = False,
               error: str | None = None, exit_code: int | None = None) -> None:
        """Read the job's usage, remove its cgroup, write the final record."""
        for o in self.outputs:  # a job that never started: nothing more can come
            o.close()
        problems = []
        stats = None
        cg = self._cgroups()
        if cg is not None:
            try:
                # Whatever is left (nothing, normally: the namespace died with its init) goes
                # first, so that the CPU time read is final.
                cg.kill(self._cg_path(), self._controllers(), grace=0)
                stats = cg.stats(self._cg_path(), driver="cgroupfs")
            except HostError as exc:
                problems.append(str(exc))
        oom = stats.oom_kills if stats else None
        state, code, sig = jobs.final_state(wait_status=status, cancelled=cancelled,
                                            timed_out=timed_out, oom_kills=oom, error=error)
        if status is None and error is not None and exit_code in (126, 127):
            code = exit_code  # the program could not be run: not found (127), denied (126)
        if cg is not None:
            from envctl.runtime.launch import remove_cgroup

            try:
                remove_cgroup(self.ctx, self.cg_name)
            except HostError as exc:
                problems.append(str(exc))
        j = self.job
        j.state, j.exit_code, j.signal = state, code, sig
        if cancelled:
            j.reason = self._cancel_reason()
        j.end_time = time.time()
        if stats is not None:
            j.cpu_seconds = None if stats.cpu_usage_us is None else stats.cpu_usage_us / 1e6
            j.cpu_user_seconds = None if stats.cpu_user_us is None else stats.cpu_user_us / 1e6
            j.cpu_system_seconds = (None if stats.cpu_system_us is None
                                    else stats.cpu_system_us / 1e6)
            j.peak_memory_bytes = stats.memory_peak
            j.oom_kills = oom
        j.error = "; ".join([p for p in [error, *problems] if p]) or None
        self._finish_gpus()
        self.save_final()
        with contextlib.suppress(FileNotFoundError):
            jobs.cancel_path(self.host.state_dir, j.id).unlink()

    # -- process set-up
    def detach(self, out_fd: int, err_fd: int) -> None:
        """Become a daemon: stdio on /dev/null, `/` as cwd, every other inherited descriptor
        closed; then the self-pipe its signal handlers write to. (The cyclic GC goes on once
        the job runs: `run`.)"""
        os.chdir("/")
        os.umask(0o022)
        protect_from_oom()
        self.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        for fd in (0, 1, 2):
            os.dup2(self.devnull, fd)
        _close_fds_except({0, 1, 2, self.devnull, out_fd, err_fd, self.report_fd})
        self.out_fd, self.err_fd = out_fd, err_fd
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_cancel)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        # Whoever reads its start report may be gone before its last line (the daemon answers
        # a plain submit at "P" and its worker may be killed after; a daemon's worker runs
        # with SIGPIPE's default): a write to that pipe is EPIPE, which `tell` shrugs off,
        # never a death that leaves the job LOST. (The job gets SIGPIPE's default: launch.)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    def _on_cancel(self, signum: int, frame: Any) -> None:
        self.cancel_requested = True
        if self.cancel_signal is None:
            self.cancel_signal = signum

    @property
    def environ(self) -> dict[str, str]:
        from envctl.runtime.launch import job_environ

        extra = {}
        if self.req.gpus is not None or tuple(self.job.gpus) != tuple(self.ctx.gpus):
            # The job's GPUs, as CUDA and the NVIDIA runtime read them; its cgroup's device
            # list (req.devices) has only their nodes.
            extra["CUDA_VISIBLE_DEVICES"] = extra["NVIDIA_VISIBLE_DEVICES"] = (
                ",".join(self.job.gpus) or "void")
        extra.update(self.req.env)
        extra.update({"ENVCTL_JOB_ID": str(self.job.id), "ENVCTL_JOB_NAME": self.job.name})
        return job_environ(self.ctx, self.req.user, extra)


def _gpu_sample_seconds() -> float:
    """Seconds between samples of a GPU job's GPU memory (ENVCTL_JOB_GPU_SAMPLE, default 5)."""
    try:
        value = float(os.environ.get("ENVCTL_JOB_GPU_SAMPLE", 5.0))
    except ValueError:
        return 5.0
    return value if 0.05 <= value <= 3600 else 5.0


def _close_fds_except(keep: set[int | None]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _supervisor_main(host: Host, ctx: EnvContext, req: Request, job: Job, out_fd: int,
                     err_fd: int, report: int) -> None:
    """The grandchild: supervise the job, then leave without returning into the CLI."""
    code = 0
    sup = None
    try:
        sup = _Supervisor(host, ctx, req, job, report)
        sup.detach(out_fd, err_fd)
        sup.run()
        _kick_behind(host)  # what it held is free: the queue's next jobs may start
    except BaseException as exc:  # a bug: still end the record, never leave it RUNNING
        code = 1
        if sup is not None:
            if sup.owned:  # else not its record to end (queued again, or another's)
                with contextlib.suppress(BaseException):
                    sup.finish(None, error=f"supervisor failed: {exc!r}")
            with contextlib.suppress(BaseException):
                sup.tell(f"E supervisor failed: {exc!r}")
    finally:
        os._exit(code)  # no flush: what the CLI had buffered is the CLI's to print


def _kick_behind(host: Host) -> None:
    """Run the queue (`kick`) in a child of its own, so that this supervisor ends now (`wait`
    and `cancel` wait for it to) while the queue's next jobs start."""
    if not (jobs.jobs_dir(host.state_dir) / ".queue").is_dir():
        return
    if os.fork() == 0:
        code = 1
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            kick(host)
            code = 0
        finally:
            os._exit(code)


# ---------------------------------------------------------------- cancelling


def cancel(host: Host, job_id: int | str, *, grace: float = jobs.KILL_GRACE,
           wait: bool = True, reason: str | None = None) -> Job:
    """Cancel one job: SIGTERM, then SIGKILL after `grace` seconds; the record as it ends.

    Race-free against the job ending by itself: the request is written to `<id>.cancel`
    first, then SIGUSR1 goes to the supervisor through a pidfd pinned and checked against the
    recorded start time (a reused pid gets nothing). A supervisor that already ended gets
    nothing either (ESRCH), and the record then says how the job ended. A LOST job (its
    supervisor is gone) is finalized here: what is left of its cgroup is killed and removed,
    and the record is written LOST. A finished job is left as it is. A `grace` beyond
    jobs.MAX_DURATION is UsageError (exit 2), before anything is asked."""
    jobs.check_grace(grace)
    job = jobs.get(host.state_dir, job_id)
    if not job.active:
        return job
    if job.orphaned(host.boot_id):
        # Claimed by a process that died before a supervisor took it: back in the queue
        # first, then cancelled there (CANCELLED, never started), not finalized LOST.
        from envctl.runtime import queue

        with jobs.jobs_lock(host.state_dir):
            queue.requeue_orphans(host.state_dir, host.boot_id, [job.id])
        job = jobs.get(host.state_dir, job.id)
    if job.queued:
        done = _cancel_queued(host, job.id, reason=reason)
        if done is not None:
            kick(host)  # it may have been the head: others may start, or backfill, now
            return done
        job = jobs.get(host.state_dir, job.id)  # started meanwhile: cancelled as running
        if not job.active:
            return job
    sup = job.supervisor or {}
    pidfd = _pin_supervisor(job, host.boot_id)
    if pidfd is None:
        return _finalize_lost(host, job)
    try:
        jobs.write_cancel(host.state_dir, job.id,
                          {"grace": grace, "time": time.time(), "by": os.getuid(),
                           **({"reason": reason} if reason else {})})
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile: its record says how
            signal.pidfd_send_signal(pidfd, signal.SIGUSR1)
        if wait:
            _wait_stopped(host, job.id, pidfd, grace)
    finally:
        os.close(pidfd)
    final = jobs.get(host.state_dir, job.id)
    if not final.active:
        # It ended on its own between our look and our request: the request is nobody's.
        with contextlib.suppress(FileNotFoundError):
            jobs.cancel_path(host.state_dir, job.id).unlink()
        return final
    if wait and not jobs.supervisor_alive(final, host.boot_id):
        return _finalize_lost(host, final)
    if wait:
        raise HostError(f"cancel job {job.id}: supervisor {sup.get('pid')} has not ended it "
                        f"{grace + CANCEL_SLACK:g} s after SIGUSR1")
    return final


def _cancel_queued(host: Host, job_id: int, *, reason: str | None = None) -> Job | None:
    """Cancel a job still in the queue: CANCELLED, never started, its index line, request and
    directory (the staged program) gone. None when it is no longer queued (a pass claimed it
    meanwhile: it is cancelled as a running job)."""
    from envctl.runtime import queue

    with jobs.jobs_lock(host.state_dir):
        job = jobs.read(host.state_dir, job_id)
        if job is None or not job.queued or job.state is not State.PENDING:
            return None
        done = job.replace(state=State.CANCELLED, end_time=time.time(), queued=False,
                           reason=reason)
        jobs.write(host.state_dir, done, durable=True)
        lines = queue.read_env(host.state_dir, job.env)
        queue.write_env(host.state_dir, job.env, [e for e in lines if e["id"] != job_id])
    with contextlib.suppress(FileNotFoundError):
        request_path(host.state_dir, job_id).unlink()
    import shutil

    shutil.rmtree(jobs.job_dir(host.state_dir, job_id), ignore_errors=True)
    return done


def _cancel_env_queue(host: Host, env: str, *, reason: str | None = None) -> list[Job]:
    """Cancel every job in `env`'s queue in one pass (`down --force`: 10,000 of them must
    not rewrite the index 10,000 times); their records."""
    from envctl.runtime import queue

    if not queue.queue_dir(host.state_dir).is_dir():
        return []
    out = []
    with jobs.jobs_lock(host.state_dir):
        for e in queue.read_env(host.state_dir, env):
            job = jobs.read(host.state_dir, e["id"])
            if job is None or not job.queued or job.state is not State.PENDING:
                continue
            done = job.replace(state=State.CANCELLED, end_time=time.time(), queued=False,
                               reason=reason)
            jobs.write(host.state_dir, done)
            out.append(done)
        queue.write_env(host.state_dir, env, [])
    import shutil

    for job in out:
        with contextlib.suppress(FileNotFoundError):
            request_path(host.state_dir, job.id).unlink()
        shutil.rmtree(jobs.job_dir(host.state_dir, job.id), ignore_errors=True)
    return out


def queued_jobs(host: Host, env: str) -> list[Job]:
    """The jobs of `env` waiting in its queue."""
    from envctl.runtime import queue

    if not queue.queue_dir(host.state_dir).is_dir():
        return []
    return queue.queued_jobs(host.state_dir, env)


def cancel_jobs(host: Host, before: list[Job], *, grace: float = jobs.KILL_GRACE) -> list[Job]:
    """`envctl cancel` of these records: every active one asked at once, then each waited
    for; the records after, in the same order (a finished one as it was)."""
    for j in before:
        if j.active:
            cancel(host, j.id, grace=grace, wait=False)
    return [cancel(host, j.id, grace=grace) if j.active else j for j in before]


def _wait_stopped(host: Host, job_id: int, pidfd: int, grace: float) -> None:
    """Wait for the supervisor to end: our grace and CANCEL_SLACK, or longer when the record
    says the job was already being stopped (a time limit, an earlier cancel) with a SIGKILL
    due later: that first cause's grace is the one that runs."""
    deadline = time.time() + grace + CANCEL_SLACK
    while not wait_fd(pidfd, max(0.0, deadline - time.time())):
        with contextlib.suppress(EnvctlError):
            now = jobs.read(host.state_dir, job_id)
            kill_at = (now.stopping or {}).get("kill_at") if now is not None else None
            if isinstance(kill_at, int | float) and kill_at + CANCEL_SLACK > deadline:
                deadline = kill_at + CANCEL_SLACK
                continue
        return


def _pin_supervisor(job: Job, boot_id: str) -> int | None:
    """A pidfd of the job's supervisor when it is the recorded process, else None."""
    if not jobs.supervisor_alive(job, boot_id):
        return None
    pid = int((job.supervisor or {})["pid"])
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    # Pinned now: check again that this pid is still the recorded supervisor.
    if not jobs.supervisor_alive(job, boot_id):
        os.close(fd)
        return None
    return fd



def _finalize_lost(host: Host, job: Job) -> Job:
    """Kill and remove what is left of a LOST job's cgroup and record it LOST for good."""
    error = "its supervisor is gone (killed, or the host rebooted)"
    if job.cgroup and job.boot_id == host.boot_id:
        try:
            cg = host.cgroups.for_parent(job.cgroup.get("parent", ""))
            cg.remove(job.cgroup["name"])
        except (HostError, KeyError) as exc:
            error += f"; its cgroup: {exc}"
    with jobs.jobs_lock(host.state_dir):
        now = jobs.read(host.state_dir, job.id)
        if now is None or not now.active or jobs.supervisor_alive(now, host.boot_id):
            return now or job  # somebody else finished it meanwhile
        lost = now.replace(state=State.LOST, end_time=time.time(), error=error)
        jobs.write(host.state_dir, lost, durable=True)
    with contextlib.suppress(FileNotFoundError):
        jobs.cancel_path(host.state_dir, job.id).unlink()
    return lost


def wait(host: Host, job_ids: list[int], *, timeout: float | None = None) -> list[Job]:
    """Block until every job has ended (or `timeout` seconds passed); the records as shown
    (LOST for a supervisor that died without a final record). Waits on each supervisor's
    pidfd: no polling of the records."""
    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for jid in job_ids:
        job = jobs.get(host.state_dir, jid)
        while job.active:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0:
                break
            if job.queued or job.orphaned(host.boot_id):
                # No supervisor to wait on yet: the record changes only when a pass of the
                # queue starts it (or a cancel ends it), looked at twice a second. (An
                # orphaned claim: the next pass puts it back in the queue.)
                time.sleep(QUEUE_POLL if left is None else min(QUEUE_POLL, left))
                job = jobs.get(host.state_dir, jid)
                continue
            pidfd = _pin_supervisor(job, host.boot_id)
            if pidfd is None or int((job.supervisor or {}).get("pid", 0)) == os.getpid():
                if pidfd is not None:
                    os.close(pidfd)
                break
            try:
                # Its supervisor, or whoever claimed it from the queue (then its supervisor
                # is in the record once that one is done: looked at again).
                wait_fd(pidfd, left)
            finally:
                os.close(pidfd)
            job = jobs.get(host.state_dir, jid)
        out.append(job.shown(host.boot_id))
    return out


QUEUE_POLL = 0.5


def stop_env_jobs(host: Host, env: str, *, grace: float = jobs.KILL_GRACE,
                  reason: str | None = None) -> list[Job]:
    """For `down --force` (and `down` while the host shuts down): cancel every running job of
    `env` (all at once, then wait for each); their final records, CANCELLED with `reason`
    (e.g. SHUTDOWN_REASON) in each when given."""
    # The queued ones first: none of them may start as the running ones end.
    queued = _cancel_env_queue(host, env, reason=reason)
    running = jobs.active_jobs(host.state_dir, host.boot_id, env)
    for job in running:
        cancel(host, job.id, grace=grace, wait=False, reason=reason)
    return queued + [cancel(host, job.id, grace=grace, reason=reason) for job in running]


# What a job cancelled because the host is shutting down records as its `reason`.
SHUTDOWN_REASON = "host shutdown"


def busy_envs(host: Host, envs: list[str]) -> dict[str, tuple[list[Job], list[Job]]]:
    """The environments of `envs` with jobs running or pending: env -> (running, queued)."""
    out = {}
    for env in envs:
        running = jobs.active_jobs(host.state_dir, host.boot_id, env)
        queued = queued_jobs(host, env)
        if running or queued:
            out[env] = (running, queued)
    return out


def refuse_down(busy: dict[str, tuple[list[Job], list[Job]]]) -> Busy:
    """The refusal of a `down` of environments whose jobs still run (busy_envs), naming every
    one of them and its jobs: Busy (exit 3: the command is right, the host's state refuses it
    for now; apart from exit 1 so that a refused ExecStop= fails envctl.service)."""
    parts, every = [], []
    for env, (running, queued) in busy.items():
        ids = [str(j.id) for j in running + queued]
        every += ids
        what = " and ".join(x for x in (f"{len(running)} job(s) still running" if running
                                        else "", f"{len(queued)} job(s) pending in its queue"
                                        if queued else "") if x)
        parts.append(f"{env}: {what} ({' '.join(ids)})")
    ids = " ".join(every)
    return Busy(f"down {'; '.join(parts)}: wait for them (envctl wait {ids}), cancel "
                     "them, or use --force, which cancels them first")




# ---------------------------------------------------------------- the command line's request


def make_request(host: Host, ctx: EnvContext, exe: str, args: list[str], *,
                 name: str | None = None, user: str | None = None, cpus: str | None = None,
                 gpus: str | None = None, env: list[str] | None = None, workdir: str = "/",
                 output: str | None = None, error: str | None = None,
                 time_limit: str | None = None, mem: str | None = None,
                 environ: dict[str, str] | os._Environ[str] = os.environ,
                 here: bool | None = None) -> Request:
    """A Request from `submit-job`'s options as typed; InputError/UsageError (exit 2) for a
    bad one. The user rule is exec's (`launch.resolve_user`): the user behind sudo by
    default, root only when asked for. `here`: whether `exe` is a file of the submitter's
    (the daemon's client looked, and passes it opened); None: look here."""
    from envctl.host.asuser import submitter
    from envctl.runtime.launch import resolve_user

    who = resolve_user(user, ctx, environ)
    variables = {}
    for item in env or []:
        key, eq, value = item.partition("=")
        if not eq or not key or "\0" in item:
            raise UsageError(f"--env {item!r}: give KEY=VALUE")
        variables[key] = value
    program = ""
    if here is None:
        here = "/" in exe or os.path.lexists(exe)
    if not here:
        # A bare name that is no file here: the environment's own program, found in the PATH
        # the job will have, as srun and `docker run` find one. A path, or a file of that
        # name here, is this host's and is staged.
        from envctl.runtime.context import DEFAULT_PATH

        search = variables.get("PATH") or ctx.environ.get("PATH") or DEFAULT_PATH
        try:
            program = find_in_rootfs(ctx, exe, search, executable=True) or ""
        except PermissionError:
            raise NeedsRootError(f"envctl submit-job looks {exe!r} up in environment "
                                 f"'{ctx.env}''s rootfs and needs root: run it with "
                                 "sudo") from None
        if not program:
            raise InputError(f"submit-job: {exe or repr(exe)}: no such file here, and no "
                             f"program of that name in environment '{ctx.env}''s PATH "
                             f"({search}); give a path (./{exe}) for a file of this host")
    return Request(
        exe=Path(exe), program=program, args=list(args), name=name or "", user=who,
        user_name=_user_name(user, who.uid, ctx, environ),
        cpus=jobs.parse_cpus(cpus, "--cpus") if cpus is not None and not _digits(cpus)
        else None,
        gpus=resolve_gpus(host, ctx, gpus) if gpus is not None and not _digits(gpus) else None,
        cpu_count=_count(cpus, "--cpus", "a CPU list such as 0-0 for CPU 0"),
        gpu_count=_count(gpus, "--gpus", "an index with a comma (0,) for GPU 0"),
        mem=_mem(mem),
        env=variables, workdir=workdir,
        output=Path(os.path.abspath(output)) if output else None,
        error=Path(os.path.abspath(error)) if error else None,
        time_limit=jobs.parse_duration(time_limit) if time_limit is not None else None,
        submitter=submitter(environ))


def _digits(text: str) -> bool:
    from envctl.text import ascii_digits

    return ascii_digits(text)


def _count(text: str | None, opt: str, single: str) -> int:
    """A plain integer of --cpus/--gpus: a count (0 when it is a list or not given)."""
    if text is None or not _digits(text):
        return 0
    if int(text) < 1:
        raise UsageError(f"{opt} {text}: a count is 1 or more (a plain number is a count; "
                         f"for one of them give {single})")
    return int(text)


def _mem(text: str | None) -> int:
    """--mem as bytes (512M, 16G, 1.5G: the spec's sizes); 0 when not given."""
    if text is None:
        return 0
    from envctl.spec.units import parse_size

    try:
        size = parse_size(text)
    except ValueError as exc:
        raise UsageError(f"--mem '{text}': {exc}") from None
    if size < 1 << 20:
        raise UsageError(f"--mem '{text}': at least 1M (a job needs some memory to start)")
    return size


def _user_name(spec: str | None, uid: int, ctx: EnvContext,
               environ: dict[str, str] | os._Environ[str]) -> str:
    if spec is not None and not spec.split(":")[0].isdigit():
        return spec.split(":")[0]
    if spec is None and environ.get("SUDO_USER"):
        return environ["SUDO_USER"]
    for root in (Path(ctx.root), Path("/")):
        with contextlib.suppress(OSError):
            for line in (root / "etc" / "passwd").read_text().splitlines():
                parts = line.split(":")
                if len(parts) > 2 and parts[2] == str(uid):
                    return parts[0]
    return str(uid)


def resolve_gpus(host: Host, ctx: EnvContext, text: str) -> tuple[str, ...]:
    """`--gpus` as UUIDs: each item a UUID of the environment's, or a host GPU index as
    `envctl gpus` and the spec's `gpus:` list number them (read from the journal's claims)."""
    from envctl.engine.journal import Journal

    claims = Journal.open(host.state_dir, ctx.env, boot=host.boot_id).claims.get("gpus") or {}
    uuids = list(claims.get("uuids") or ())
    indices = list(claims.get("indices") or ())
    by_index = dict(zip(indices, uuids, strict=False)) if len(indices) == len(uuids) else {}
    held = ", ".join(f"{i}={u}" for i, u in by_index.items()) or ", ".join(ctx.gpus) or "none"
    out: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        uuid = by_index.get(int(item)) if _digits(item) else item
        if uuid is None or uuid not in ctx.gpus:
            raise InputError(f"submit-job --gpus: {item} is not one of environment "
                             f"'{ctx.env}''s GPUs ({held})")
        if uuid not in out:
            out.append(uuid)
    return tuple(out)
