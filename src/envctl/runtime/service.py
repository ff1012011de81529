"""The environment's service: one detached supervisor process per environment that runs the
spec's `service` command through the one entry path (runtime.launch), restarts it by its
policy with exponential backoff, and records its state in `<run>/<env>/service.json`.

API (the `service` resource kind calls it; nothing here imports the engine):

    Service(env, command, restart, restart_sec)     # what the spec asks for
    start(host, service) -> dict                    # the state once the command has exec'd;
                                                    # LaunchError when the first launch fails
    stop(host, env) -> None                         # SIGTERM, bounded wait, SIGKILL; cgroup gone
    read_state(host, env) -> dict | None; alive(state, boot_id) -> bool
    summary(state, now) -> str                      # "running (pid 4242, since …)", …
    next_delay(delay, restart_sec) -> float; restarts(policy, wait_status) -> bool

The supervisor is forked from the `envctl up` process itself, twice (the intermediate child
calls setsid and exits), as a job's is (runtime.supervisor): no systemd, no second
interpreter. It closes every descriptor it inherited (the global lock's among them), turns the
cyclic GC back on, has /dev/null as stdio and `/` as its directory, and never returns into the
CLI's stack (`os._exit`).

What it does, in a loop: makes the service's cgroup `<env's cgroup>/service` (cgroupfs driver;
with systemd's, a transient scope of the environment's slice), starts the launch (root inside
the environment, Docker's default capabilities, no_new_privs, stdin /dev/null, stdout and
stderr a pipe whose output it appends to `<run>/<env>/service.log`, rotated at LOG_MAX),
waits on its pidfd, the status pipe, that pipe and a self-pipe its signal handlers write
to, removes the cgroup when the launch ends, and decides:

- `restart: no` never restarts; `on-failure` restarts after a non-zero exit or a death by a
  signal (and after a launch that failed); `always` restarts after any end;
- the first restart waits `restart_sec`, each further one twice the last (at least 0.1 s,
  at most 60 s, or `restart_sec` when that is longer); a run that lasted 30 s resets it;
- a service that will not be restarted ends its supervisor (state `stopped` after exit 0,
  `failed` otherwise): the `service` step is then missing, and `envctl up` starts it again.

SIGTERM (or SIGINT) to the supervisor stops the service: SIGTERM to it (forwarded by the
launch's launcher and init), SIGKILL of the whole launch after the grace (ENVCTL_KILL_GRACE as
`up` had it, else 10 s); then the cgroup goes, the state says `stopped`, and it exits. kill -9
of the supervisor takes the service with it: the launcher has PR_SET_PDEATHSIG(SIGKILL) towards
the supervisor, the init towards the launcher, and the kernel kills a PID namespace whose init
dies.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envctl.errors import EnvctlError, HostError
from envctl.host.files import read_json, write_json
from envctl.runtime.daemon import poll_ms, protect_from_oom, read_report, wait_fd
from envctl.runtime.jobs import MAX_DURATION, identity, proc_start_time

if TYPE_CHECKING:
    from envctl.host.context import Host
    from envctl.runtime.context import EnvContext
    from envctl.runtime.launch import Started

STATE_FILE = "service.json"
LOG_FILE = "service.log"
# The service's cgroup, below the environment's.
CGROUP_NAME = "service"
# Backoff between restarts: doubling from restart_sec, never below MIN_BACKOFF after the
# first (restart_sec 0 must not spin), never above MAX_BACKOFF (unless restart_sec is longer);
# back to restart_sec after a run of RESET_AFTER seconds.
MIN_BACKOFF = 0.1
MAX_BACKOFF = 60.0
RESET_AFTER = 30.0
# SIGTERM -> SIGKILL when the supervisor stops the service (ENVCTL_KILL_GRACE overrides it).
DEFAULT_GRACE = 10.0
# How long `start` waits for the supervisor to say the command runs (or could not start).
# How long `stop` waits beyond the recorded grace before it SIGKILLs the supervisor.
STOP_SLACK = 5.0
# The service's output goes through a pipe to its supervisor, which appends it to
# service.log and rotates that (service.log -> .1 -> … -> .LOG_KEEP, the oldest dropped) as
# soon as a write would take it past LOG_MAX bytes, while the service runs. On /run, a tmpfs:
# RAM, hence 8 MiB and 2 old files (24 MiB at most). ENVCTL_SERVICE_LOG_MAX (bytes) and
# ENVCTL_SERVICE_LOG_KEEP override them, as `up` had them.
LOG_MAX = 8 << 20
LOG_KEEP = 2
POLICIES = ("no", "on-failure", "always")


@dataclass(frozen=True)
class Service:
    """The spec's `service` of environment `env`: an argv, a restart policy, a delay."""

    env: str
    command: tuple[str, ...]
    restart: str = "on-failure"
    restart_sec: float = 1.0


# ---------------------------------------------------------------- pure decisions


def next_delay(delay: float | None, restart_sec: float) -> float:
    """The wait before the next restart, given the last one (None: the first since a reset)."""
    if delay is None:
        return restart_sec
    return min(max(MAX_BACKOFF, restart_sec), max(2 * delay, MIN_BACKOFF))


def restarts(policy: str, wait_status: int | None) -> bool:
    """Whether a run that ended with `wait_status` (None: it could not be started) is
    restarted under `policy`."""
    if policy == "always":
        return True
    if policy == "on-failure":
        return wait_status is None or os.waitstatus_to_exitcode(wait_status) != 0
    return False


def describe_exit(last: dict[str, Any] | None) -> str:
    """A recorded `last_exit` as an operator reads it: "exit 1", "signal 9 (SIGKILL)"."""
    if not last:
        return "none"
    if last.get("error"):
        return f"could not start: {last['error']}"
    if last.get("signal") is not None:
        sig = int(last["signal"])
        try:
            return f"signal {sig} ({signal.Signals(sig).name})"
        except ValueError:
            return f"signal {sig}"
    return f"exit {last.get('code')}"


def summary(state: dict[str, Any], now: float | None = None) -> str:
    """One line for `status`: what the service is doing."""
    now = time.time() if now is None else now
    n = int(state.get("restarts") or 0)
    counted = f"{n} restart{'s' if n != 1 else ''}"
    last = describe_exit(state.get("last_exit"))
    what = state.get("state")
    if what == "backoff":
        left = max(0.0, float(state.get("next_start") or now) - now)
        return f"restarting ({counted}, last exit {last}, next start in {left:.1f} s)"
    if what == "running":
        since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(state.get("since") or now))
        extra = f", {counted}, last exit {last}" if n else ""
        return f"running (pid {state.get('pid')}, since {since}{extra})"
    if what in ("stopped", "failed"):
        return f"{what}: last exit {last} ({counted}, restart: {state.get('restart')})"
    return str(what or "unknown")


# ---------------------------------------------------------------- the state file


def state_path(host: Host, env: str) -> Path:
    return host.run_dir / env / STATE_FILE


def read_state(host: Host, env: str) -> dict[str, Any] | None:
    """The supervisor's last record, or None (none, or unreadable: it is rewritten whole)."""
    try:
        data = read_json(state_path(host, env))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def alive(state: dict[str, Any] | None, boot_id: str) -> bool:
    """Whether the supervisor the record names still runs: same boot, the pid exists, is not a
    zombie, and started when the recorded one did (a reused pid is somebody else)."""
    if not state:
        return False
    if boot_id and state.get("boot_id") and state["boot_id"] != boot_id:
        return False
    sup = state.get("supervisor") or {}
    pid = sup.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    seen = proc_start_time(pid)
    return seen is not None and seen[0] not in ("Z", "X") and seen[1] == sup.get("start")


def ended_by_policy(state: dict[str, Any] | None, boot_id: str) -> bool:
    """Whether the record is of a service that ended in this boot and that its restart policy
    does not restart (`restart: no` after any end, `on-failure` after exit 0): what the spec
    asks for, not a failure to heal."""
    if not state or state.get("ended") != "policy" or state.get("state") not in ("stopped",
                                                                                 "failed"):
        return False
    return not (boot_id and state.get("boot_id") and state["boot_id"] != boot_id)


def _pin(state: dict[str, Any], boot_id: str) -> int | None:
    """A pidfd of the recorded supervisor when it is that process, else None."""
    if not alive(state, boot_id):
        return None
    try:
        fd = os.pidfd_open(int(state["supervisor"]["pid"]))
    except ProcessLookupError:
        return None
    if not alive(state, boot_id):  # pinned now: check that this pid is still the one
        os.close(fd)
        return None
    return fd


# ---------------------------------------------------------------- start and stop


def start(host: Host, service: Service) -> dict[str, Any]:
    """Start the environment's service supervisor and return its state once the command has
    exec'd. The environment must be up (runtime.context.EnvContext.load's errors otherwise);
    a first launch that fails (the program is not in the rootfs: CommandNotFound) is raised as
    the launch's error and no supervisor stays."""
    from envctl.runtime.context import EnvContext

    if service.restart not in POLICIES:
        raise HostError(f"service of '{service.env}': restart {service.restart!r}; allowed: "
                        f"{', '.join(POLICIES)}")
    ctx = EnvContext.load(host, service.env)
    if ctx.cgroup is None:
        raise HostError(f"start the service of '{service.env}': the environment has no cgroup "
                        "recorded; `envctl up` makes it")
    grace = _grace()
    r, w = os.pipe()
    with _held():
        pid = os.fork()
        if pid == 0:  # the intermediate child
            code = 1
            try:
                os.close(r)
                os.setsid()  # its own session: Ctrl-C in the operator's shell never reaches it
                if os.fork() == 0:  # the grandchild, not a session leader: never a terminal
                    _main(host, ctx, service, w, grace)  # never returns
                code = 0
            finally:
                os._exit(code)
    os.close(w)
    try:
        os.waitpid(pid, 0)  # the intermediate exits at once
        kind, text = read_report(r)
    finally:
        os.close(r)
    if kind == "R":
        return read_state(host, service.env) or {}
    if kind in ("timeout", "dead"):
        with contextlib.suppress(EnvctlError, OSError):
            stop(host, service.env)
    if kind == "E":
        step, _, message = text.partition(" ")
        from envctl.runtime.launch import CommandNotFound, LaunchError

        cls = CommandNotFound if step == "127" else LaunchError
        raise cls(f"service of '{service.env}': {message}", step="service",
                  exit_code=int(step) if step.isdigit() else 1)
    raise HostError(f"start the service of '{service.env}': its supervisor {text}")


def stop(host: Host, env: str) -> None:
    """Stop the service of `env`: SIGTERM to its supervisor through a pidfd pinned against the
    recorded start time, then wait (its grace plus STOP_SLACK) for it to exit, SIGKILL if it
    has not (the launch dies with it); then make sure the service's cgroup is gone and drop
    the state file. Nothing running is fine: what a dead supervisor left is cleaned up."""
    state = read_state(host, env)
    if state is not None:
        pidfd = _pin(state, host.boot_id)
        if pidfd is not None:
            try:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGTERM)
                grace = float(state.get("grace") or DEFAULT_GRACE)
                if not wait_fd(pidfd, grace + STOP_SLACK):
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    wait_fd(pidfd, STOP_SLACK)
            finally:
                os.close(pidfd)
        _remove_cgroup(host, env, state)
    with contextlib.suppress(FileNotFoundError):
        state_path(host, env).unlink()


def _remove_cgroup(host: Host, env: str, state: dict[str, Any]) -> None:
    """Kill what is left in the service's cgroup (a supervisor killed mid-run leaves its empty
    directory) and remove it; gone already is fine. Only a record of this boot names one."""
    cg = state.get("cgroup")
    if not cg or (host.boot_id and state.get("boot_id") not in (None, "", host.boot_id)):
        return
    controllers = tuple(cg.get("controllers") or ()) or None
    host.cgroups.for_parent(cg.get("parent", "")).remove(cg["name"], controllers)


def _env_int(name: str, default: int) -> int:
    try:
        return max(0, int(os.environ.get(name, default)))
    except ValueError:
        return default


def _grace() -> float:
    try:
        grace = float(os.environ.get("ENVCTL_KILL_GRACE", DEFAULT_GRACE))
    except ValueError:
        return DEFAULT_GRACE
    # At most 365 days, as every duration envctl takes (jobs.MAX_DURATION); nan: the default.
    return min(max(0.0, grace), float(MAX_DURATION)) if grace == grace else DEFAULT_GRACE


@contextlib.contextmanager
def _held():  # noqa: ANN202 - a context manager
    """The signals the CLI handles (engine.signals.STOPPING) blocked across the fork: the
    child installs its own handlers first; none of the CLI's ever runs in it."""
    stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# ---------------------------------------------------------------- the supervisor


class _Supervisor:
    """The state of the supervisor process (runs only in the forked grandchild)."""

    def __init__(self, host: Host, ctx: EnvContext, service: Service, report: int,
                 grace: float):
        self.host = host
        self.ctx = ctx
        self.service = service
        self.report_fd: int | None = report
        self.grace = grace
        self.stopping = False
        self.dir = host.run_dir / service.env
        self.log_fd = -1
        self.log_max = _env_int("ENVCTL_SERVICE_LOG_MAX", LOG_MAX)
        self.log_keep = _env_int("ENVCTL_SERVICE_LOG_KEEP", LOG_KEEP)
        cgroup = None
        if ctx.cgroup.driver == "cgroupfs":
            cgroup = {"parent": ctx.cgroup.parent_name,
                      "name": f"{service.env}/{CGROUP_NAME}",
                      "controllers": list(ctx.cgroup.controllers)}
        self.state: dict[str, Any] = {
            "env": service.env, "command": list(service.command), "restart": service.restart,
            "restart_sec": service.restart_sec, "supervisor": identity(),
            "boot_id": host.boot_id, "state": "starting", "pid": None, "launcher": None,
            "restarts": 0, "last_exit": None, "since": time.time(), "started": None,
            "next_start": None, "grace": grace, "cgroup": cgroup,
            "log": str(self.dir / LOG_FILE)}

    # -- talking to `up` and writing the record
    def tell(self, line: str) -> None:
        if self.report_fd is None:
            return
        with contextlib.suppress(OSError):  # EPIPE: `up` is gone; go on
            os.write(self.report_fd, (line.replace("\n", " ") + "\n").encode())

    def done_telling(self) -> None:
        if self.report_fd is not None:
            os.close(self.report_fd)
            self.report_fd = None

    def save(self, **changes: Any) -> None:
        self.state.update(changes)
        write_json(self.dir / STATE_FILE, self.state, durable=False)

    # -- process set-up
    def detach(self) -> None:
        """Become a daemon: cyclic GC on for its own objects only (the CLI's are frozen: a
        finalizer of one could flush a buffer the CLI flushes too, or close a descriptor
        number since reused), stdio on /dev/null,
        `/` as cwd, every other inherited descriptor closed, signal handlers of its own."""
        gc.freeze()
        gc.enable()
        os.chdir("/")
        os.umask(0o022)
        protect_from_oom()  # the service gets 0 back (Launch.oom_score_adj)
        self.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        for fd in (0, 1, 2):
            os.dup2(self.devnull, fd)
        keep = {0, 1, 2, self.devnull, self.report_fd}  # (service.log: opened at the start)
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in keep:
                with contextlib.suppress(OSError):
                    os.close(int(name))
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())

    def _on_stop(self, signum: int, frame: Any) -> None:
        self.stopping = True

    # -- the loop
    def run(self) -> None:
        self.save()
        self.tell(f"P {os.getpid()}")
        delay: float | None = None
        first = True
        while True:
            began = time.monotonic()
            status, error, code = self.run_once(first)
            if first and error is not None:
                self.tell(f"E {code} {error}")  # `up` fails the step; nobody restarts it
                self.save(state="failed", pid=None, launcher=None, since=time.time(),
                          last_exit={"code": code, "signal": None, "error": error})
                return
            first = False
            self.done_telling()
            last = _last_exit(status, error, code)
            if self.stopping:
                self.save(state="stopped", pid=None, launcher=None, since=time.time(),
                          last_exit=last, next_start=None)
                return
            if not restarts(self.service.restart, None if error else status):
                ok = error is None and status is not None and os.waitstatus_to_exitcode(
                    status) == 0
                # `ended`: its policy ended it, not a stop nor a death of the supervisor, so
                # neither the monitor nor `up` starts it again (ended_by_policy).
                self.save(state="stopped" if ok else "failed", pid=None, launcher=None,
                          since=time.time(), last_exit=last, next_start=None, ended="policy")
                return
            if time.monotonic() - began >= RESET_AFTER:
                delay = None  # it ran long enough: a new failure starts the backoff afresh
            delay = next_delay(delay, self.service.restart_sec)
            self.save(state="backoff", pid=None, launcher=None, since=time.time(),
                      last_exit=last, next_start=time.time() + delay)
            if not self.sleep(delay):
                self.save(state="stopped", next_start=None, since=time.time())
                return
            self.state["restarts"] += 1

    def sleep(self, seconds: float) -> bool:
        """Wait `seconds`; False when asked to stop meanwhile."""
        end = time.monotonic() + seconds
        while not self.stopping:
            left = end - time.monotonic()
            if left <= 0:
                return True
            if wait_fd(self.wake_r, left):
                self._drain()
        return False

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_r, 256)

    def run_once(self, first: bool) -> tuple[int | None, str | None, int | None]:
        """One run of the command: (its raw wait status, None, None), or (None, why, exit
        code) when it could not be started."""
        from envctl.runtime.launch import (
            Launch,
            LaunchError,
            User,
            create_cgroup,
            job_environ,
            remove_cgroup,
            start,
            supervisor_scope,
            systemd_attach,
        )

        ctx = self.ctx
        user = User(0, 0, tuple(g for g in ctx.device_gids if g != 0))
        log = out_r = -1
        status_r = status_w = -1
        started = None
        try:
            # The first run moves the supervisor out of the cgroup of what ran `up` (systemd
            # driver; see there), beside the launch, and says "R" only once it is done.
            scoped = supervisor_scope(ctx, "service-supervisor") if first else None
            dirs = create_cgroup(ctx, CGROUP_NAME)
            self.log_file()  # opened now: a log that cannot be written fails the start
            out_r, log = os.pipe2(os.O_CLOEXEC)  # `log`: the service's end
            status_r, status_w = os.pipe2(os.O_CLOEXEC)
            launch = Launch(ctx=ctx, argv=list(self.service.command),
                            environ=job_environ(ctx, user, {"ENVCTL_SERVICE": ctx.env}),
                            user=user, cgroup_dirs=dirs, stdio=(self.devnull, log, log),
                            status_fd=status_w, attach=systemd_attach(ctx), oom_score_adj=0)
            started = start(launch)
            os.close(status_w)
            status_w = -1
            if scoped is not None:
                scoped()
        except (EnvctlError, OSError) as exc:
            code = exc.exit_code if isinstance(exc, LaunchError) else 1
            why = str(exc) if isinstance(exc, EnvctlError) else \
                f"{exc.filename or 'start'}: {exc.strerror}"
            if started is not None:  # it runs, but its supervisor would die with `up`'s caller
                started.kill()
                self.watch(started, status_r)  # which closes status_r
                status_r = -1
            for fd in (status_r, status_w, log, out_r):
                if fd >= 0:
                    os.close(fd)
            self._cleanup(remove_cgroup)
            return None, why, code
        os.close(log)
        now = time.time()
        self.save(state="running", pid=_service_pid(started.pid), launcher=started.pid,
                  started=now, since=now, next_start=None)
        if first:
            self.tell("R")
        status = self.watch(started, status_r, out_r)
        self._cleanup(remove_cgroup)
        return status, None, None

    def _cleanup(self, remove_cgroup: Any) -> None:
        try:
            remove_cgroup(self.ctx, CGROUP_NAME)
        except (EnvctlError, OSError) as exc:
            self.state["error"] = f"remove its cgroup: {exc}"

    def log_file(self) -> int:
        """The descriptor of service.log, opened (appending) when none is."""
        if self.log_fd < 0:
            self.log_fd = os.open(self.dir / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND
                                  | os.O_CLOEXEC, 0o640)
        return self.log_fd

    def copy_out(self, out_r: int) -> int:
        """Append what the service wrote (what the pipe holds now) to service.log, rotating
        it first when this would take it past the bound; the bytes copied, 0 at EOF, -1 when
        the pipe is empty for now."""
        try:
            data = os.read(out_r, 65536)
        except BlockingIOError:
            return -1
        if not data:
            return 0
        try:
            size = os.fstat(self.log_file()).st_size
            if size and size + len(data) > self.log_max > 0:  # (one read may be longer)
                self._rotate()
            os.write(self.log_file(), data)
        except OSError as exc:  # a full /run: the output is dropped, the service goes on
            self.state["error"] = f"service.log: {exc.strerror}"
        return len(data)

    def _rotate(self) -> None:
        """service.log -> service.log.1 -> … -> service.log.KEEP (the oldest goes), then a
        new service.log. The service never notices: it writes to its pipe. The name is never
        absent (a reader tailing it by name sees the old file until the new one replaces it):
        the current file is hard-linked as .1 and a new one renamed over it."""
        path = self.dir / LOG_FILE
        os.close(self.log_fd)
        self.log_fd = -1
        old = [path.with_name(f"{LOG_FILE}.{n}") for n in range(1, self.log_keep + 1)]
        for n in range(len(old) - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                old[n - 1].replace(old[n])
        if old:
            old[0].unlink(missing_ok=True)  # (KEEP=1: the one old file goes)
            os.link(path, old[0])
        fresh = path.with_name(f".{LOG_FILE}.new")
        fresh.unlink(missing_ok=True)  # left by a supervisor killed here
        self.log_fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
                              | os.O_CLOEXEC, 0o640)
        fresh.replace(path)

    def watch(self, started: Started, status_r: int, out_r: int = -1) -> int | None:
        """Wait until the launch ends, stopping it on request, copying its output (`out_r`,
        closed here) to service.log; the command's raw wait status (None when unknown)."""
        poller = select.poll()
        for fd in (self.wake_r, status_r, started.pidfd):
            poller.register(fd, select.POLLIN)
        if out_r >= 0:
            os.set_blocking(out_r, False)
            poller.register(out_r, select.POLLIN)
        kill_at: float | None = None
        termed = False
        buf = b""
        ended = False
        while not ended:
            now = time.monotonic()
            if self.stopping and not termed:
                termed = True
                kill_at = now + self.grace
                started.signal(signal.SIGTERM)  # the launcher and the init forward it
            if kill_at is not None and now >= kill_at:
                kill_at = None
                started.kill()  # the init dies with it, and the namespace with the init
            for fd, _ in poller.poll(None if kill_at is None else poll_ms(kill_at - now)):
                if fd == self.wake_r:
                    self._drain()
                elif fd == status_r:
                    data = os.read(status_r, 64)
                    if data:
                        buf += data
                    else:
                        poller.unregister(status_r)
                elif fd == out_r:
                    if self.copy_out(out_r) == 0:
                        poller.unregister(out_r)
                elif fd == started.pidfd:
                    ended = True
        if out_r >= 0:
            # What is still in the pipe: the namespace's processes died with the init, so
            # nothing writes any more (EAGAIN ends it where a dying one still holds its end).
            while self.copy_out(out_r) > 0:
                pass
            os.close(out_r)
        from envctl.runtime.launch import final_status

        return final_status(started, status_r, buf)


def _last_exit(status: int | None, error: str | None, code: int | None) -> dict[str, Any]:
    if error is not None or status is None:
        return {"code": code, "signal": None, "error": error or "its status was lost"}
    if os.WIFSIGNALED(status):
        return {"code": None, "signal": os.WTERMSIG(status), "error": None}
    return {"code": os.waitstatus_to_exitcode(status), "signal": None, "error": None}


def _service_pid(launcher: int) -> int:
    """The command's own pid on the host: the launcher's child is the init, whose child is the
    command (/proc/PID/task/PID/children); the launcher's when that cannot be read."""
    pid = launcher
    for _ in range(2):
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return launcher
        if not kids:
            return launcher
        pid = int(kids[0])
    return pid


def _main(host: Host, ctx: EnvContext, service: Service, report: int, grace: float) -> None:
    """The grandchild: supervise the service, then leave without returning into the CLI."""
    code = 0
    sup = None
    try:
        sup = _Supervisor(host, ctx, service, report, grace)
        sup.detach()
        sup.run()
    except BaseException as exc:  # a bug: say so in the record and to `up`, never hang
        code = 1
        if sup is not None:
            with contextlib.suppress(BaseException):
                sup.save(state="failed", pid=None, error=f"supervisor failed: {exc!r}")
            with contextlib.suppress(BaseException):
                sup.tell(f"E 1 supervisor failed: {exc!r}")
            with contextlib.suppress(BaseException):
                from envctl.runtime.launch import remove_cgroup

                remove_cgroup(sup.ctx, CGROUP_NAME)
    finally:
        os._exit(code)
