"""`envctl top`: a live view of the environments, the GPUs and the jobs (the monitor's sampler,
drawn with rich and redrawn in place), and the renderable `status --watch` redraws.

Read-only: it samples as the monitor does, but never checks, heals or writes anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

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


def view(snap: Snapshot, jobs: list[Any] | None = None, *, events: dict[str, Any] | None = None
         ) -> Group:
    """The renderable of one sample: environments, GPUs, active jobs."""
    when = time.strftime("%H:%M:%S", time.localtime(snap.time))
    head = Text(f"envctl top  {when}  host CPU {_pct(snap.host_cpu_percent).strip()}  "
                f"memory {_pct(snap.host_mem_percent).strip()}", style="bold")
    envs = Table(title="environments", title_justify="left", expand=False, box=None,
                 header_style="bold")
    for col, just in (("ENV", "left"), ("CPU%", "right"), ("CPUS", "right"),
                      ("MEMORY", "right"), ("LIMIT", "right"), ("PEAK", "right"),
                      ("OOM", "right"), ("TASKS", "right"), ("THROTTLED", "right"),
                      ("JOBS", "right"), ("SERVICE", "left"), ("GPU MEM", "right"),
                      ("LAST EVENT", "left"), ("DESCRIPTION", "left")):
        envs.add_column(col, justify=just, no_wrap=True)
    for s in snap.envs:
        running = s.jobs.get("RUNNING", 0) + s.jobs.get("PENDING", 0)
        svc = "-" if s.service is None else (
            f"[green]{s.service['state']}[/]" if s.service["up"]
            else f"[red]{escape(str(s.service['state']))}[/]")
        last = (events or {}).get(s.env) or []
        envs.add_row(escape(s.env), _pct(s.cpu_percent), str(s.cpus or "-"),
                     _bytes(s.mem_usage), _bytes(s.mem_limit) if s.mem_limit else "none",
                     _bytes(s.mem_peak), str(s.oom_kills if s.oom_kills is not None else "-"),
                     str(s.tasks if s.tasks is not None else "-"),
                     "-" if s.throttled_seconds is None else f"{s.throttled_seconds:.1f}s",
                     str(running), svc, _bytes(sum(s.gpu_memory.values()) or None),
                     escape(f"{last[-1]['event']}") if last else "", escape(s.description))
    parts: list[Any] = [head, envs]
    if snap.gpus:
        gpus = Table(title="GPUs", title_justify="left", box=None, header_style="bold")
        for col in ("GPU", "NAME", "UTIL", "MEMORY", "TEMP", "POWER", "ENVIRONMENT",
                    "PROCESSES"):
            gpus.add_column(col, no_wrap=True)
        for g in snap.gpus:
            mem = "-" if g.fb_used is None or not g.fb_total else \
                f"{g.fb_used // MIB}/{g.fb_total // MIB} MiB"
            gpus.add_row(str(g.index), escape(g.name), _pct(g.util), mem,
                         "-" if g.temp is None else f"{g.temp}C",
                         "-" if g.power_w is None else f"{g.power_w:.0f}W",
                         escape(snap.gpu_env.get(g.uuid, "") or "-"), str(len(g.processes)))
        parts.append(gpus)
    if jobs:
        table = Table(title="jobs", title_justify="left", box=None, header_style="bold")
        rows = jobs
        for col in rows[0]:
            table.add_column(col, no_wrap=True)
        for r in rows[1:]:
            table.add_row(*(escape(c) for c in r))
        parts.append(table)
    for line in snap.problems:
        parts.append(Text(f"! {line}", style="yellow"))
    return Group(*parts)


def run_top(host: Any, *, interval: float, sampler: Sampler | None = None,
            console: Any = None, iterations: int | None = None,
            sleep: Callable[[float], None] = time.sleep) -> None:
    """Redraw every `interval` seconds until Ctrl-C (or `iterations` draws, for tests)."""
    from envctl.monitor import events as ev
    from envctl.monitor.collect import Sampler
    from envctl.runtime import jobs as jb

    sampler = sampler or Sampler.for_host(host)
    try:
        sampler.prime()
        with Live(console=console, auto_refresh=False, transient=False) as live:
            n = 0
            while iterations is None or n < iterations:
                sleep(interval if n else min(interval, 1.0))
                snap = sampler.tick()
                listed = jb.listing(host.state_dir, host.boot_id)
                rows = jb.table(listed) if listed else None
                live.update(view(snap, rows, events=ev.recent(host.state_dir, per_env=1)),
                            refresh=True)
                n += 1
    except KeyboardInterrupt:
        pass
    finally:
        sampler.close()


def watch(render: Callable[[Any], None], *, interval: float, console: Any,
          iterations: int | None = None, sleep: Callable[[float], None] = time.sleep) -> None:
    """`status --watch`: call `render(console)` into a buffer every `interval` seconds and
    show the result in place of the last one, until Ctrl-C."""
    import io

    from rich.console import Console

    try:
        with Live(console=console, auto_refresh=False) as live:
            n = 0
            while iterations is None or n < iterations:
                buf = io.StringIO()
                inner = Console(file=buf, force_terminal=console.is_terminal,
                                color_system=console.color_system, width=console.width,
                                highlight=False, emoji=False)
                render(inner)
                live.update(Text.from_ansi(buf.getvalue()), refresh=True)
                n += 1
                if iterations is None or n < iterations:
                    sleep(interval)
    except KeyboardInterrupt:
        pass
