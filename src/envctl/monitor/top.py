"""`envctl top`: a live view of the environments, the GPUs and the jobs (the monitor's sampler,
drawn with rich and redrawn in place), and the renderable `status --watch` redraws.

Read-only: it samples as the monitor does, but never checks, heals or writes anything. Both
views fit the terminal: one row per environment first, then as much detail as the height
leaves room for (and a line saying what was left out). `q` quits, as in top(1); Ctrl-C too.
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from envctl.render import STATE_COLOUR

if TYPE_CHECKING:
    from envctl.monitor.collect import Sampler, Snapshot

GIB = 1 << 30
MIB = 1 << 20


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:5.1f}%"


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    if value >= GIB:
        return f"{value / GIB:.1f}G"
    return f"{value / MIB:.0f}M"


class Keys:
    """Key presses on a terminal's stdin while a live view runs: the terminal is put in cbreak
    mode (keys arrive unbuffered and unechoed; Ctrl-C still interrupts) and restored on the
    way out. When stdin is not a terminal (a pipe, /dev/null, a unit), nothing is read and
    `wait` only sleeps."""

    def __init__(self, stream: Any = None, *, sleep: Callable[[float], None] = time.sleep):
        stream = sys.stdin if stream is None else stream
        try:
            self.fd: int | None = stream.fileno() if stream.isatty() else None
        except (AttributeError, ValueError, OSError):
            self.fd = None  # pytest's captured stdin, a closed one
        self.sleep = sleep
        self._saved: Any = None

    def __enter__(self) -> Keys:
        if self.fd is not None:
            import termios
            import tty

            try:
                self._saved = termios.tcgetattr(self.fd)
                tty.setcbreak(self.fd)
            except termios.error:
                self.fd = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None and self._saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def wait(self, seconds: float) -> bool:
        """Wait `seconds`; True as soon as `q` (or Q) is pressed."""
        if self.fd is None:
            self.sleep(seconds)
            return False
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                data = os.read(self.fd, 64)
                if not data or b"q" in data.lower():
                    return True  # q, or the terminal went away


def fit(head: list[str], blocks: list[tuple[str, list[str]]], height: int, *,
        more: str) -> list[str]:
    """`head`, then whole `blocks` ((name, lines) each, in order) while they fit in `height`
    lines, keeping one line to say which did not: `more` with {n} and {names} in it."""
    out = list(head)
    shown = 0
    for _, lines in blocks:
        if len(out) + len(lines) > height - 1:
            break
        out += lines
        shown += 1
    left = [name for name, _ in blocks[shown:]]
    if left:
        out.append(more.format(n=len(left), names=", ".join(left[:5])
                               + (", …" if len(left) > 5 else "")))
    return out


def view(snap: Snapshot, jobs: list[Any] | None = None, *, events: dict[str, Any] | None = None,
         height: int | None = None, states: dict[str, str] | None = None) -> Group:
    """The renderable of one sample: a row per environment, then the GPUs, the active jobs,
    the GPUs' MIG instances and problems for as many lines as `height` (the terminal's;
    None: no limit) leaves."""
    room = [height - 1 if height else 1 << 30]  # lines left below the head line

    def take(items: list[Any], *, table: bool = True) -> tuple[list[Any], int]:
        """As many of `items` as fit (a table's title and header take two lines; one line
        says how many were left out), and how many were left out."""
        fixed = 2 if table else 0
        if fixed + len(items) <= room[0]:
            room[0] -= fixed + len(items)
            return items, 0
        if room[0] <= 0:
            return [], 0  # no line left even to say so: what came before already did
        n = max(0, room[0] - fixed - 1)
        room[0] = 0
        return items[:n], len(items) - n
    when = time.strftime("%H:%M:%S", time.localtime(snap.time))
    head = Text(f"envctl top  {when}  host CPU {_pct(snap.host_cpu_percent).strip()}  "
                f"memory {_pct(snap.host_mem_percent).strip()}", style="bold")
    envs = Table(title="environments", title_justify="left", expand=False, box=None,
                 header_style="bold")
    for col, just in (("ENV", "left"), ("STATE", "left"), ("CPU%", "right"), ("CPUS", "right"),
                      ("MEMORY", "right"), ("LIMIT", "right"), ("PEAK", "right"),
                      ("OOM", "right"), ("TASKS", "right"), ("THROTTLED", "right"),
                      ("JOBS", "right"), ("SERVICE", "left"), ("GPU MEM", "right"),
                      ("LAST EVENT", "left"), ("DESCRIPTION", "left")):
        envs.add_column(col, justify=just, no_wrap=True)
    env_rows, envs_left = take(snap.envs)
    for s in env_rows:
        running = s.jobs.get("RUNNING", 0) + s.jobs.get("PENDING", 0)
        svc = "-" if s.service is None else (
            f"[green]{s.service['state']}[/]" if s.service["up"]
            else f"[red]{escape(str(s.service['state']))}[/]")
        last = (events or {}).get(s.env) or []
        state = (states or {}).get(s.env, "-")
        colour = STATE_COLOUR.get(state)
        envs.add_row(escape(s.env), f"[{colour}]{state}[/]" if colour else state,
                     _pct(s.cpu_percent), str(s.cpus or "-"),
                     _bytes(s.mem_usage), _bytes(s.mem_limit) if s.mem_limit else "none",
                     _bytes(s.mem_peak), str(s.oom_kills if s.oom_kills is not None else "-"),
                     str(s.tasks if s.tasks is not None else "-"),
                     "-" if s.throttled_seconds is None else f"{s.throttled_seconds:.1f}s",
                     str(running), svc, _bytes(sum(s.gpu_memory.values()) or None),
                     escape(f"{last[-1]['event']}") if last else "", escape(s.description))
    parts: list[Any] = [head, envs]
    if envs_left:
        parts.append(Text(f"… {envs_left} more environments (envctl list)", style="dim"))
    gpu_rows, gpus_left = take(snap.gpus) if snap.gpus else ([], 0)
    if gpu_rows:
        gpus = Table(title="GPUs", title_justify="left", box=None, header_style="bold")
        for col in ("GPU", "NAME", "UTIL", "MEMORY", "TEMP", "POWER", "ENVIRONMENT",
                    "PROCESSES"):
            gpus.add_column(col, no_wrap=True)
        for g in gpu_rows:
            mem = "-" if g.fb_used is None or not g.fb_total else \
                f"{g.fb_used // MIB}/{g.fb_total // MIB} MiB"
            gpus.add_row(str(g.index), escape(g.name), _pct(g.util), mem,
                         "-" if g.temp is None else f"{g.temp}C",
                         "-" if g.power_w is None else f"{g.power_w:.0f}W",
                         escape(snap.gpu_env.get(g.uuid, "") or "-"), str(len(g.processes)))
        parts.append(gpus)
    if gpus_left:
        parts.append(Text(f"… {gpus_left} more GPUs (envctl gpus)", style="dim"))
    job_rows, jobs_left = take(jobs[1:]) if jobs else ([], 0)
    if job_rows:
        table = Table(title="jobs", title_justify="left", box=None, header_style="bold")
        for col in jobs[0]:
            table.add_column(col, no_wrap=True)
        for r in job_rows:
            table.add_row(*(escape(c) for c in r))
        parts.append(table)
    if jobs_left:
        parts.append(Text(f"… {jobs_left} more active jobs (envctl jobs)", style="dim"))
    # After the jobs: 56 instances on an HGX host must not crowd the active jobs out.
    mig_rows, migs_left = take(snap.migs) if snap.migs else ([], 0)
    if mig_rows:
        migs = Table(title="MIG instances", title_justify="left", box=None,
                     header_style="bold")
        for col in ("GPU", "GI", "CI", "PROFILE", "UTIL", "SM", "MEMORY", "ENVIRONMENT",
                    "PROCESSES"):
            migs.add_column(col, no_wrap=True)
        for m in mig_rows:
            mem = "-" if m.fb_used is None or not m.fb_total else \
                f"{m.fb_used // MIB}/{m.fb_total // MIB} MiB"
            migs.add_row(str(m.parent), str(m.gi), str(m.ci), escape(m.profile), _pct(m.util),
                         _pct(m.sm_util), mem, escape(snap.gpu_env.get(m.uuid, "") or "-"),
                         str(len(m.processes)))
        parts.append(migs)
    if migs_left:
        parts.append(Text(f"… {migs_left} more MIG instances (envctl gpus)", style="dim"))
    problems, problems_left = take(snap.problems, table=False)
    for line in problems:
        parts.append(Text(f"! {line}", style="yellow"))
    if problems_left:
        parts.append(Text(f"… {problems_left} more problems", style="dim"))
    return Group(*parts)


def run_top(host: Any, *, interval: float, sampler: Sampler | None = None,
            console: Any = None, iterations: int | None = None,
            sleep: Callable[[float], None] = time.sleep, keys: Keys | None = None,
            states: Callable[[list[str]], dict[str, str]] | None = None) -> None:
    """Redraw every `interval` seconds until `q` or Ctrl-C (or `iterations` draws, for
    tests), fitted to the terminal's height. `states(names)` gives each environment's state
    as `envctl list` says it."""
    from envctl.monitor import events as ev
    from envctl.monitor.collect import Sampler
    from envctl.runtime import jobs as jb

    sampler = sampler or Sampler.for_host(host)
    keys = keys or Keys(sleep=sleep)
    try:
        sampler.prime()
        with keys, Live(console=console, auto_refresh=False, transient=False) as live:
            n = 0
            while iterations is None or n < iterations:
                if keys.wait(interval if n else min(interval, 1.0)):
                    break
                snap = sampler.tick()
                listed = jb.listing(host.state_dir, host.boot_id)
                rows = jb.table(listed) if listed else None
                height = live.console.height if live.console.is_terminal else None
                said = states([e.env for e in snap.envs]) if states else None
                live.update(view(snap, rows, events=ev.recent(host.state_dir, per_env=1),
                                 height=height, states=said), refresh=True)
                n += 1
    except KeyboardInterrupt:
        pass
    finally:
        sampler.close()


def watch(render: Callable[[Any], None], *, interval: float, console: Any,
          iterations: int | None = None, sleep: Callable[[float], None] = time.sleep,
          keys: Keys | None = None) -> None:
    """`status --watch`: call `render(console)` into a buffer every `interval` seconds and
    show the result in place of the last one, until `q` or Ctrl-C. The buffer's console has
    the terminal's width and height (None when not a terminal): `render` fits itself."""
    keys = keys or Keys(sleep=sleep)
    try:
        with keys, Live(console=console, auto_refresh=False) as live:
            n = 0
            while iterations is None or n < iterations:
                inner = buffer_console(console)
                render(inner)
                live.update(Text.from_ansi(inner.file.getvalue()), refresh=True)
                n += 1
                if (iterations is None or n < iterations) and keys.wait(interval):
                    break
    except KeyboardInterrupt:
        pass


def buffer_console(like: Any) -> Any:
    """A console writing to a string buffer (`.file`), with the colours, width and height of
    `like` (height None when `like` is not a terminal: nothing to fit)."""
    import io

    from rich.console import Console

    inner = Console(file=io.StringIO(), force_terminal=like.is_terminal,
                    color_system=like.color_system, width=like.width,
                    height=like.height if like.is_terminal else None, highlight=False,
                    emoji=False)
    inner.fit_height = like.height if like.is_terminal else None
    return inner


def captured(like: Any, draw: Callable[[Any], None]) -> list[str]:
    """The lines `draw(console)` prints on a buffer console like `like` (wrapped as `like`
    would wrap them)."""
    inner = buffer_console(like)
    draw(inner)
    return inner.file.getvalue().splitlines()
