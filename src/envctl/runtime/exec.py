"""`envctl exec ENV [--user U] [-e K=V] [-w DIR] -- CMD ARGS…`: run one command inside an
environment, attached.

stdin, stdout and stderr pass through (a pseudo-terminal, made inside the environment, when
both stdin and stdout are terminals: the real terminal goes raw, its window size follows),
but never the caller's terminal itself, for whoever holds a terminal's descriptor may change
its line discipline (TIOCSETD: an operator's session dead after the job), its modes and, where
its ids are mapped, its owner: a terminal among them (`envctl exec ENV -- cmd | less`: stdin
and stderr) is relayed through a pipe, as Docker relays; stdin only with `-i` (else the
command's stdin is /dev/null, as `docker exec` without -i: a relay reads what is typed
whether or not the command wants it, which `less` reading the same terminal would miss);
the signals envctl receives go to the command; envctl's exit code is the command's (128+N for
signal N). The command runs in its own cgroup `exec-<envctl's pid>` below the environment's
(cgroupfs driver; a transient scope of the environment's slice with the systemd driver),
removed when it ends.

Start-up time counts here (`envctl exec ENV -- /bin/true` is the launch-latency benchmark):
nothing of the spec, the planner, pydantic or YAML is imported, and `fast_entry` runs the
command without building the typer CLI at all.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import sys
from collections.abc import Mapping

from envctl.errors import NeedsRootError, UsageError
from envctl.runtime.context import EnvContext
from envctl.runtime.launch import (
    FORWARDED_SIGNALS,
    Launch,
    Started,
    create_cgroup,
    job_environ,
    remove_cgroup,
    resolve_user,
    start,
    systemd_attach,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: see record.py
if TYPE_CHECKING:
    from typing import Any

    from envctl.host.context import Host

TIOCGWINSZ, TIOCSWINSZ = 0x5413, 0x5414


def run(env: str, argv: list[str], *, user: str | None = None, host: Host | None = None,
        env_vars: list[str] | None = None, workdir: str = "/",
        environ: Mapping[str, str] = os.environ, keep_stdin: bool = False) -> int:
    """Run `argv` in environment `env` attached to this process's stdio; its exit code.
    `env_vars` ("KEY=VALUE", as `docker exec -e`) are added to the environment's variables;
    `workdir` is where it starts, inside the environment; `keep_stdin` (-i) relays a
    terminal's input when stdin is one and stdout is not (else /dev/null).

    UsageError (exit 2) when the environment is not up, a variable or the directory is
    malformed, or no user is given where one must be; LaunchError when entering fails
    (CommandNotFound: exit 127)."""
    variables = parse_env_vars(env_vars or [])
    if not workdir.startswith("/"):
        raise UsageError(f"-w/--workdir '{workdir}': an absolute path inside the environment")
    if host is None:
        from envctl.host.context import Host

        host = Host.from_env()
    ctx = EnvContext.load(host, env)
    if os.geteuid() != 0:
        raise NeedsRootError("envctl exec enters the environment's namespaces and needs root: "
                             "run it with sudo")
    who = resolve_user(user, ctx, environ)
    from envctl.runtime.supervisor import exec_devices

    devices = exec_devices(host, ctx)
    interactive = os.isatty(0) and os.isatty(1)
    extra = {"TERM": environ.get("TERM") or "xterm"} if interactive else {}
    launch = Launch(ctx, list(argv), job_environ(ctx, who, {**extra, **variables}), who,
                    cwd=workdir, pty=interactive,
                    winsize=_winsize(1) if interactive else None,
                    attach=systemd_attach(ctx, devices=devices))
    name = f"exec-{os.getpid()}"
    relays: list[tuple[int, int]] = []
    if not interactive:
        launch.stdio, relays = _relayed_terminals(keep_stdin)
        launch.keep_out = tuple(fd for pair in relays for fd in pair if fd > 2
                                and fd not in launch.stdio)
    launch.cgroup_dirs = create_cgroup(ctx, name, devices=devices)
    try:
        return _attached(launch, relays)
    finally:
        remove_cgroup(ctx, name)
        for src, dst in relays:
            for fd in (src, dst):
                if fd > 2:
                    with contextlib.suppress(OSError):
                        os.close(fd)


def _relayed_terminals(keep_stdin: bool
                       ) -> tuple[tuple[int, int, int], list[tuple[int, int]]]:
    """The job's stdio: ours, but a pipe in place of each that is a terminal (stdin: with
    `keep_stdin`, else /dev/null); and the relays (source, destination) this process copies
    while the job runs: the terminal to the pipe for stdin, the pipe to the terminal for
    stdout and stderr."""
    stdio = [0, 1, 2]
    relays = []
    for target in (0, 1, 2):
        try:
            if not os.isatty(target):
                continue
        except OSError:
            continue  # closed: the launch gives /dev/null
        if target == 0 and not keep_stdin:
            stdio[0] = -1  # the launch gives the environment's /dev/null for a closed one
            continue
        r, w = os.pipe2(os.O_CLOEXEC)
        if target == 0:
            os.set_blocking(w, False)  # a full pipe must never hold up the outputs
            stdio[0] = r
            relays.append((0, w))
        else:
            stdio[target] = w
            relays.append((r, target))
    return (stdio[0], stdio[1], stdio[2]), relays


def _attached(launch: Launch, relays: list[tuple[int, int]]) -> int:
    """Start the launch with the forwarding handlers in place, then wait (or copy the pty, or
    the relayed terminals)."""
    target: list[Started] = []

    def forward(sig: int, frame: object) -> None:
        if target:
            if sig == signal.SIGWINCH and target[0].pty is not None:
                _copy_winsize(1, target[0].pty)  # the kernel tells the job, as a terminal does
            else:
                target[0].signal(sig)

    # Blocked until `target` is set: a signal during the start is forwarded, not lost, and
    # never raises KeyboardInterrupt half-way through it.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    old = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        try:
            started = start(launch)
            target.append(started)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if started.pty is not None:
            return _copy_pty(started)
        if relays:
            return _copy_relays(started, launch.stdio, relays)
        return started.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _winsize(fd: int) -> tuple[int, int] | None:
    import fcntl

    try:
        rows, cols, _, _ = struct.unpack("HHHH", fcntl.ioctl(fd, TIOCGWINSZ, b"\0" * 8))
    except OSError:
        return None
    return (rows, cols) if rows and cols else None


def _copy_winsize(src: int, master: int) -> None:
    import fcntl

    with contextlib.suppress(OSError):
        fcntl.ioctl(master, TIOCSWINSZ, fcntl.ioctl(src, TIOCGWINSZ, b"\0" * 8))


def _copy_pty(started: Started) -> int:
    """Copy the terminal to the pty's master and back, raw, until the launch ends."""
    import termios
    import tty

    master = started.pty
    assert master is not None
    saved = termios.tcgetattr(0)
    tty.setraw(0)
    try:
        poller = select.poll()
        poller.register(0, select.POLLIN)
        poller.register(master, select.POLLIN)
        poller.register(started.pidfd, select.POLLIN)
        while True:
            events = dict(poller.poll())
            if master in events and not _pass(master, 1):
                poller.unregister(master)  # EIO: every slave closed, the job is gone
                master = -1
            if 0 in events and not _pass(0, master if master >= 0 else -1):
                poller.unregister(0)  # EOF on the terminal
            if started.pidfd in events:
                break
        if master >= 0:
            os.set_blocking(master, False)
            while _pass(master, 1):
                pass  # what the job wrote last
        return started.wait()
    finally:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)
        os.close(started.pty)


def _copy_relays(started: Started, stdio: tuple[int, int, int],
                 relays: list[tuple[int, int]]) -> int:
    """Copy each relay until the launch ends: the terminal to the job's stdin pipe (closed at
    the terminal's end of input; not read while the pipe is full, and no more once the job
    closed its end), the job's output pipes to the terminal, drained without waiting once the
    job is gone (a descriptor it handed away must not hold envctl)."""
    for fd in stdio:  # the job's ends, which the launch holds now
        if fd > 2:
            os.close(fd)
    poller = select.poll()
    outputs = {src: dst for src, dst in relays if src != 0}
    stdin_w = dict(relays).get(0, -1)
    pending = b""
    watched = -1  # which stdin end is polled: 0 (the terminal) or stdin_w (room in the pipe)
    for src in outputs:
        poller.register(src, select.POLLIN)
    poller.register(started.pidfd, select.POLLIN)

    def arm() -> int:
        """Poll the terminal when nothing waits for the pipe, else the pipe for room."""
        want = -1 if stdin_w < 0 else (stdin_w if pending else 0)
        if want != watched:
            if watched >= 0:
                poller.unregister(watched)
            if want >= 0:
                poller.register(want, select.POLLOUT if want == stdin_w else select.POLLIN)
        return want

    watched = arm()
    while True:
        try:
            events = dict(poller.poll())
        except InterruptedError:
            continue
        for src in [fd for fd in outputs if fd in events]:
            if not _pass(src, outputs[src]):
                poller.unregister(src)
                del outputs[src]
        if watched >= 0 and watched in events:
            if watched == 0:
                try:
                    pending = os.read(0, 65536)
                except OSError:
                    pending = b""
                if not pending:  # the terminal's end of input: the job's stdin ends too
                    os.close(stdin_w)
                    stdin_w = -1
            if pending:
                try:
                    pending = pending[os.write(stdin_w, pending):]
                except BlockingIOError:
                    pass
                except OSError:  # EPIPE: the job closed its stdin; read no more of ours
                    pending = b""
                    os.close(stdin_w)
                    stdin_w = -1
            watched = arm()
        if started.pidfd in events:
            break
    if stdin_w >= 0:
        os.close(stdin_w)
    for src, dst in outputs.items():
        os.set_blocking(src, False)
        while _pass(src, dst):
            pass  # what the job wrote last
    return started.wait()


def _pass(src: int, dst: int) -> bool:
    """Move what `src` has to `dst` (dropped when dst < 0); False at its end (EOF, EIO)."""
    try:
        data = os.read(src, 65536)
    except BlockingIOError:
        return False
    except OSError:
        return False  # EIO: the pty's other side is closed
    if not data:
        return False
    view = memoryview(data)
    while dst >= 0 and view:
        try:
            view = view[os.write(dst, view):]
        except OSError:
            return True  # the other side went away; keep draining src
    return True


# ---------------------------------------------------------------- fast path, without typer


# exec's options that take a value (-> run's keyword), read by the fast path as typer does.
_VALUE_OPTIONS = {"--user": "user", "-u": "user", "--env": "env_vars", "-e": "env_vars",
                  "--workdir": "workdir", "-w": "workdir"}


def parse_env_vars(items: list[str]) -> dict[str, str]:
    """`--env KEY=VALUE` options as a mapping; UsageError for one without `=` or a key."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key or "\0" in item:
            raise UsageError(f"-e/--env {item!r}: give KEY=VALUE")
        out[key] = value
    return out


def parse_args(args: list[str]) -> tuple[str, list[str], dict[str, Any]] | None:
    """(env, command, run's keywords) of `exec [OPTIONS] ENV [OPTIONS] -- CMD…` as the typer
    command reads it (--user/-u, --env/-e, --workdir/-w, -i), or None for anything else (help,
    other options, a missing part): the typer CLI then answers, with its own messages."""
    if not args or args[0] != "exec":
        return None
    words: list[str] = []
    kw: dict[str, Any] = {}
    i = 1
    while i < len(args):
        word = args[i]
        if word == "--":
            words += args[i + 1:]
            break
        opt, eq, value = word.partition("=")
        if word.startswith("-") and opt in _VALUE_OPTIONS and (not eq or opt.startswith("--")):
            if not eq:
                if i + 1 >= len(args):
                    return None
                value = args[i + 1]
            key = _VALUE_OPTIONS[opt]
            if key == "env_vars":
                kw.setdefault(key, []).append(value)
            else:
                kw[key] = value
            i += 1 if eq else 2
            continue
        if word in ("-i", "--interactive"):
            kw["keep_stdin"] = True
            i += 1
            continue
        if word.startswith("-"):
            return None
        words.append(word)
        i += 1
    if len(words) < 2:
        return None
    return words[0], words[1:], kw


def fast_entry(argv: list[str] | None = None) -> None:
    """`envctl exec …` without the typer CLI: run and leave with the command's exit code.
    Returns, doing nothing, when the arguments are not plain `exec` ones, or for a user who
    is not root (the CLI's exec goes through the daemon)."""
    if os.geteuid() != 0:
        return
    parsed = parse_args(list(sys.argv[1:] if argv is None else argv))
    if parsed is None:
        return
    from envctl.runtime.fastpath import run_fast

    env, command, kw = parsed
    run_fast(lambda: run(env, command, **kw))
