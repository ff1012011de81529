"""Diff rendering: the plan's symbols, old -> new values, summaries."""

from __future__ import annotations

from rich.console import Console

from envctl.engine.engine import Outcome, Step
from envctl.render import render_outcomes, render_plan, render_status
from envctl.resources.base import Check, Diff, Status
from envctl.resources.netns import NetNamespace
from envctl.resources.sysctl import Sysctl


def text_of(fn, *args, **kwargs) -> str:
    console = Console(record=True, width=200, color_system=None)
    fn(console, *args, **kwargs)
    return console.export_text()


def test_plan_shows_symbols_old_and_new_values_and_a_summary():
    steps = [
        Step("+", NetNamespace("demo"), Check.absent()),
        Step("~", Sysctl("net.ipv4.ip_forward", "1"),
             Check(Status.DRIFTED, (Diff("value", "1", "0"),))),
        Step("=", Sysctl("vm.swappiness", "10"), Check.present()),
        Step("-", NetNamespace("old"), Check.present(), "no longer in the spec"),
    ]
    out = text_of(render_plan, [{"env": "demo", "warnings": ["careful"],
                                 "resolved": {"cpus": "0-1", "dedicated": False, "threads": 2,
                                              "memory.max": 1 << 30},
                                 "steps": steps}], down=False)
    assert "demo  cpus 0-1 (shared), 2 threads, memory.max 1G" in out
    assert "warning: careful" in out and "! careful" not in out  # `!` is a refusal
    assert "+ network namespace demo" in out
    assert "~ sysctl net.ipv4.ip_forward = 1  (value: 0 -> 1)" in out
    assert "= sysctl vm.swappiness = 10" in out
    assert "- network namespace old  (no longer in the spec)" in out
    assert "1 to create, 1 to change, 1 unchanged, 1 to remove" in out


def test_plan_down_summary_counts_shared_keeps():
    steps = [Step("-", NetNamespace("demo"), Check.present()),
             Step("=", Sysctl("net.ipv4.ip_forward", "1"), Check.present(),
                  "still used by other")]
    out = text_of(render_plan, [{"env": "demo", "warnings": [], "resolved": {},
                                 "steps": steps}], down=True)
    assert "still used by other" in out
    assert "1 to remove, 1 kept for other environments" in out


def test_outcomes_and_status():
    o = Outcome("demo", [Step("+", NetNamespace("demo"), Check.absent())], ["remove x: busy"])
    out = text_of(render_outcomes, [o], verb="down")
    assert "error: remove x: busy" in out and "run `envctl down` again" in out
    rows = {"demo": [Step("=", NetNamespace("demo"), Check.present()),
                     Step("~", Sysctl("a.b", "1"),
                          Check(Status.DRIFTED, (Diff("value", "1", "0"),)))],
            "idle": [Step("+", NetNamespace("idle"), Check.absent(), "not applied")]}
    out = text_of(render_status, rows, {"demo": ["careful"]})
    assert "demo  degraded" in out and "drifted      sysctl a.b = 1  (value: 0 -> 1)" in out
    assert "idle  down" in out
    assert "warning: careful" in out and "! careful" not in out  # as plan: `!` is a refusal


def test_the_progress_bar_draws_on_a_terminal_and_nothing_elsewhere():
    import io

    from rich.console import Console

    from envctl.render import bar_printer

    tty = io.StringIO()
    show = bar_printer(Console(file=tty, force_terminal=True, width=80))
    for done in range(1, 4):
        show("rootfs cpu-compute", done, 3)
    assert "rootfs cpu-compute" in tty.getvalue()
    piped = io.StringIO()
    show = bar_printer(Console(file=piped, force_terminal=False, width=80))
    for done in range(1, 4):
        show("rootfs cpu-compute", done, 3)
    assert piped.getvalue() == ""


def test_down_of_an_environment_that_was_not_up_says_so():
    import io

    from rich.console import Console

    from envctl.engine.engine import Outcome
    from envctl.render import render_outcomes

    out = io.StringIO()
    render_outcomes(Console(file=out, width=120, color_system=None), [Outcome("box")],
                    verb="down")
    assert out.getvalue().splitlines() == ["box", "  down: it was not up; nothing to take down"]
