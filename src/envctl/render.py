"""Human-readable rendering of plans, outcomes and status (rich; plain when not a TTY)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envctl.engine.engine import env_state
from envctl.spec.units import format_size

if TYPE_CHECKING:
    from rich.console import Console

    from envctl.engine.engine import Outcome, Step

STYLE = {"+": "green", "~": "yellow", "=": "dim", "-": "red", ".": "dim", "!": "bold red"}
STATE_COLOUR = {"up": "green", "down": "dim", "degraded": "yellow", "not-applied": "cyan"}
WORD = {"+": "create", "~": "change", "=": "keep", "-": "remove", ".": "gone", "!": "refuse"}


def _step_line(step: Step) -> str:
    from rich.markup import escape

    text = f"[{STYLE[step.op]}]{step.op} {escape(step.resource.describe())}[/]"
    # `+` of a host setting (a module) has an old state too: "state: not loaded -> loaded".
    extra = step.check.describe() if step.op in ("~", "+") else ""
    notes = [x for x in (extra, step.note) if x]
    if notes:
        text += f"  [dim]({escape('; '.join(notes))})[/]"
    return text


def _resolved(resolved: dict[str, Any]) -> str:
    parts = []
    if "cpus" in resolved:
        how = "dedicated" if resolved.get("dedicated") else "shared"
        parts.append(f"cpus {resolved['cpus']} ({how}), {resolved['threads']} threads")
    for k, v in resolved.items():
        if k.startswith("memory."):
            parts.append(f"{k} {format_size(v)}")
    return ", ".join(parts)


def render_plan(console: Console, plans: list[dict[str, Any]], *, down: bool) -> None:
    from rich.markup import escape

    for p in plans:
        head = f"[bold]{p['env']}[/]"
        if p.get("limits"):  # the spec's limits in its own units, and what it resolved to
            threads = p["resolved"].get("threads")
            head += f"  [dim]{escape(p['limits'])}" + (f", {threads} threads" if threads
                                                      else "") + "[/]"
        elif p["resolved"]:
            head += f"  [dim]{_resolved(p['resolved'])}[/]"
        console.print(head)
        for line in p["resolved"].get("placement", ()):  # GPU 3 <-> NUMA 1 <-> CPUs 48-63
            console.print(f"  [dim]placement: {escape(line)}[/]")
        for w in p["warnings"]:  # `!` marks a refused step; a warning says so
            console.print(f"  [yellow]warning: {w}[/]")
        if not p["steps"]:
            console.print("  [dim]nothing recorded for this environment[/]")
        for step in p["steps"]:
            console.print("  " + _step_line(step))
        counts = {op: sum(1 for s in p["steps"] if s.op == op) for op in "+~=-.!"}
        if down:
            summary = f"{counts['-']} to remove, {counts['=']} kept for other environments"
        else:
            summary = (f"{counts['+']} to create, {counts['~']} to change, {counts['=']} "
                       f"unchanged" + (f", {counts['-']} to remove" if counts["-"] else "")
                       + (f", {counts['!']} refused: `up` would stop there" if counts["!"]
                          else ""))
        console.print(f"  [bold]{summary}[/]")


def step_printer(console: Console):
    def progress(event: str, step: Step) -> None:
        if event == "apply" and console.is_terminal:
            console.print(f"  [dim]… {step.resource.describe()}[/]")

    return progress


def bar_printer(console: Console):
    """A progress bar for long steps (rootfs assembly) on a terminal: (what, done, total) calls
    from Host.progress; the bar goes when done reaches total."""
    state: dict[str, Any] = {}

    def progress(what: str, done: int, total: int) -> None:
        if not console.is_terminal:
            return
        if "bar" not in state:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            bar = Progress(TextColumn("  {task.description}"), BarColumn(),
                           MofNCompleteColumn(), console=console, transient=True)
            bar.start()
            state["bar"], state["task"] = bar, bar.add_task(what, total=total)
        bar = state["bar"]
        bar.update(state["task"], description=what, completed=done, total=total)
        if done >= total:
            bar.stop()
            state.clear()

    return progress


def render_outcomes(console: Console, outcomes: list[Outcome], *, verb: str) -> None:
    for o in outcomes:
        console.print(f"[bold]{o.env}[/]")
        for step in o.steps:
            if step.op != "=" or verb == "down":
                console.print("  " + _step_line(step))
        for err in o.errors:
            console.print(f"  [red]error: {err}[/]")
        if verb == "up":
            # The same counts, in the same words, as `plan`'s summary.
            removed = f", {o.count('-')} removed" if o.count("-") else ""
            console.print(f"  [bold]up: {o.count('+')} created, {o.count('~')} changed, "
                          f"{o.count('=')} unchanged{removed}[/]")
        elif not o.steps and not o.errors:
            # Nothing recorded: it was not up (exit 0, as `docker stop` of a stopped one).
            console.print("  [bold]down: it was not up; nothing to take down[/]")
        else:
            left = " — run `envctl down` again to retry" if o.errors else ""
            console.print(f"  [bold]down: {o.count('-')} removed, {o.count('=')} kept for other "
                          f"environments, {len(o.errors)} failed{left}[/]")


def render_status(console: Console, rows: dict[str, list[Step]],
                  warnings: dict[str, list[str]] | None = None, *,
                  cgroups: dict[str, dict] | None = None,
                  isolation: dict[str, dict] | None = None,
                  descriptions: dict[str, str] | None = None,
                  states: dict[str, str] | None = None,
                  limits: dict[str, str] | None = None) -> None:
    if not rows:
        console.print("no environments")
    for env, steps in rows.items():
        state = (states or {}).get(env) or env_state(steps)
        colour = STATE_COLOUR.get(state, "")
        about = (descriptions or {}).get(env, "")
        from rich.markup import escape

        console.print(f"[bold]{env}[/]  [{colour}]{state}[/]"
                      + (f"  [dim]{escape(about)}[/]" if about else ""))
        sandbox = (isolation or {}).get(env) or {}
        if sandbox.get("level", "native") != "native":  # native: the default, not shown
            platform = f" ({sandbox['platform']})" if sandbox.get("platform") else ""
            console.print(f"  {'isolation':<12} {sandbox['level']}{platform}")
        if (limits or {}).get(env):
            console.print(f"  {'limits':<12} {escape(limits[env])}")
        if (cgroups or {}).get(env):
            console.print(f"  {'cgroup':<12} {_cgroup_line(cgroups[env])}")
        for s in steps:
            word = {"+": "missing", "~": "drifted", "=": "ok"}.get(s.op, s.op)
            if s.note == "not applied":
                word = "not applied"
            detail = s.check.describe() if s.op != "=" else ""
            # Notes say what envctl found on the host and restores at down.
            notes = "; ".join(x for x in (detail, s.note if s.note != "not applied" else "")
                              if x)
            console.print(f"  {word:<12} {s.resource.describe()}"
                          + (f"  [dim]({notes})[/]" if notes else ""))
        for w in (warnings or {}).get(env, []):  # as plan says them: `!` is a refusal
            console.print(f"  [yellow]warning: {w}[/]")


def _cgroup_line(info: dict[str, Any]) -> str:
    """`cgroupfs (v1): cpu 1.2 s, throttled 3/10 periods, memory 12M (peak 20M), ...`"""
    text = f"driver {info['driver']} (cgroup v{info.get('version')})"
    st = info.get("stats") or {}
    parts = []
    if st.get("cpu_usage_us") is not None:
        parts.append(f"cpu {st['cpu_usage_us'] / 1e6:.1f} s")
    if st.get("nr_periods"):
        parts.append(f"throttled {st.get('nr_throttled') or 0}/{st['nr_periods']} periods")
    if st.get("memory_current") is not None:
        peak = st.get("memory_peak")
        parts.append(f"memory {format_size(st['memory_current'])}"
                     + (f" (peak {format_size(peak)})" if peak is not None else ""))
    if st.get("oom_kills") is not None:
        parts.append(f"{st['oom_kills']} OOM kills")
    if st.get("pids_current") is not None:
        parts.append(f"{st['pids_current']} pids")
    return text + (": " + ", ".join(parts) if parts else "")


def list_lines(rows: list[Any], *, markup: bool = True) -> list[str]:
    """`envctl list`'s lines (envctl.listing.Row): a header, then one aligned line per
    environment (the description last, never padded); rich markup colours the state."""
    from rich.markup import escape

    from envctl.listing import HEADER

    table = [list(HEADER)] + [r.cells() for r in rows]
    widths = [max(len(line[c]) for line in table) for c in range(len(HEADER) - 1)]
    out = []
    for i, line in enumerate(table):
        cells = [escape(v.ljust(w)) for v, w in zip(line, widths, strict=False)]
        if i == 0 and markup:
            cells = [f"[bold]{c}[/]" for c in cells]
        elif markup:
            colour = STATE_COLOUR.get(line[1], "")
            cells[1] = f"[{colour}]{cells[1]}[/]" if colour else cells[1]
        out.append(("  ".join(cells + [escape(line[-1])])).rstrip())
    return out


def render_list(console: Console, rows: list[Any]) -> None:
    if not rows:
        console.print("no environments")
        return
    # One line each, as ps(1) on a terminal: cut at its width (never when piped).
    cut: dict[str, Any] = {"no_wrap": True, "overflow": "ellipsis"} \
        if console.is_terminal and not console.soft_wrap else {}
    for line in list_lines(rows):
        console.print(line, **cut)
    from rich.markup import escape

    for r in rows:  # why a row is not plainly up or down, under the table
        for why in r.reasons:
            console.print(f"[dim]{escape(r.name)}: {escape(why)}[/]", **cut)
