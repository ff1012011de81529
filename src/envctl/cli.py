"""The command line: parse, call one function in envctl.app, render (rich on a TTY, or JSON)."""

from __future__ import annotations

import gc
import json
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from envctl import __version__
from envctl.errors import EnvctlError, SpecError

app = typer.Typer(
    name="envctl",
    help="Carve one Linux host into static, isolated partitions for GPU and CPU work.\n\n"
         "Examples:\n\n"
         "  envctl validate                 check every spec in the config directory\n\n"
         "  envctl plan cpu-compute         show what `up` would change\n\n"
         "  sudo envctl up cpu-compute      bring the partition up (safe to re-run)\n\n"
         "  envctl status --json            what envctl made and whether it still matches\n\n"
         "  sudo envctl down --all          take every partition down, restore the host",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class Firewall(StrEnum):
    nftables = "nftables"
    iptables = "iptables"


class CgroupDriver(StrEnum):
    cgroupfs = "cgroupfs"
    systemd = "systemd"


class Ctx:
    config_dir: str | None = None
    debug: bool = False
    lock_timeout: float = 120.0


CTX = Ctx()

EnvNames = Annotated[list[str] | None, typer.Argument(help="Environment names (or spec files).",
                                                       show_default=False)]
AllOpt = Annotated[bool, typer.Option("--all", "-a", help="Every environment.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


def _version(value: bool) -> None:
    if value:
        print(f"envctl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    config_dir: Annotated[str | None, typer.Option(
        "--config-dir", "-C", help="Directory of environment specs (default: $ENVCTL_CONFIG_DIR, "
        "/etc/envctl/environments, or ./configs in a checkout).", show_default=False)] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    lock_timeout: Annotated[float, typer.Option(
        "--lock-timeout", help="Seconds to wait for another envctl to finish.")] = 120.0,
    firewall: Annotated[Firewall | None, typer.Option(
        "--firewall", help="The firewall backend `network.firewall: auto` uses (default: "
        "$ENVCTL_FIREWALL, else nftables when installed, else iptables).",
        show_default=False)] = None,
    cgroup_driver: Annotated[CgroupDriver | None, typer.Option(
        "--cgroup-driver", help="The cgroup driver `resources.driver: auto` uses (default: "
        "$ENVCTL_CGROUP_DRIVER, else systemd when it is PID 1, else cgroupfs).",
        show_default=False)] = None,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    CTX.config_dir, CTX.debug, CTX.lock_timeout = config_dir, debug, lock_timeout
    # The flags are the environment variables' command-line form: the host facts read those.
    if firewall is not None:
        os.environ["ENVCTL_FIREWALL"] = firewall.value
    if cgroup_driver is not None:
        os.environ["ENVCTL_CGROUP_DRIVER"] = cgroup_driver.value


# ---------------------------------------------------------------- helpers


def _split(names: list[str] | None) -> tuple[list[str], list[Path]]:
    """Arguments naming spec files (a path that exists, or ends in .yaml) are loaded as files."""
    env_names, files = [], []
    for n in names or []:
        if n.endswith((".yaml", ".yml")) or "/" in n:
            files.append(Path(n))
        else:
            env_names.append(n)
    return env_names, files


def _workspace(names: list[str] | None):
    from envctl.workspace import Workspace, config_dir

    env_names, files = _split(names)
    ws = Workspace.open(config_dir(CTX.config_dir), extra_files=files)
    for f in files:
        env_names.append(next(ls.spec.name for ls in ws.specs
                              if Path(ls.path).resolve() == f.resolve()))
    return ws, env_names


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- commands


@app.command()
def validate(
    path: Annotated[str | None, typer.Argument(help="A spec file or a directory of specs.",
                                                show_default=False)] = None,
    json_: JsonOpt = False,
) -> None:
    """Check specs, every conflict between them, and that this host can honour them.

    A directory is checked whole; a file is checked together with the specs of the
    config directory (conflicts) and planned alone. Exit 2 lists every problem.

    Example: envctl validate configs/
    """
    from envctl.workspace import Workspace, config_dir

    target = Path(path) if path else config_dir(CTX.config_dir)
    if target.is_dir():
        ws = Workspace.open(target)
        selected = ws.specs
    else:
        ws, names = _workspace([str(target)])
        selected = [ws.get(n) for n in names]
    ws.plan_all(selected)
    checked = [ls.spec.name for ls in selected]
    if json_:
        _emit_json({"ok": True, "environments": checked})
    else:
        print(f"ok: {', '.join(checked)} ({len(ws.specs)} spec(s) in {ws.directory} "
              "checked for conflicts)")


@app.command()
def plan(
    names: EnvNames = None,
    all_: AllOpt = False,
    down_: Annotated[bool, typer.Option("--down", help="Show what `down` would remove.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Show what `up` (or `down`) would do against the live host: + create, ~ change, = keep.

    Example: envctl plan cpu-compute
    """
    from envctl import app as ops
    from envctl.render import render_plan

    ws, env_names = _workspace(names)
    engine = ws.engine()
    out = []
    if down_:
        targets = ops.known_environments(ws, ws.host) if all_ else env_names
        if not targets:
            raise typer.BadParameter("name at least one environment, or use --all")
        for n in targets:
            steps = engine.diff_down(n)  # each removal says what it restores
            out.append({"env": n, "warnings": [], "resolved": {}, "steps": steps})
    else:
        for p in ws.plan_all(ws.select(env_names, all_=all_)):
            out.append({"env": p.env, "warnings": p.warnings, "resolved": p.resolved,
                        "steps": engine.diff(p.env, p.resources)})
    if json_:
        _emit_json([{**o, "steps": [s.to_json() for s in o["steps"]]} for o in out])
    else:
        render_plan(_console(), out, down=down_)


@app.command()
def up(names: EnvNames = None, all_: AllOpt = False, json_: JsonOpt = False) -> None:
    """Bring environments up: apply their plan in order, repairing drift; safe to re-run.

    A failing step rolls back what this run applied and exits 1.

    Example: sudo envctl up cpu-compute
    """
    from envctl import app as ops
    from envctl.render import render_outcomes, step_printer

    ws, env_names = _workspace(names)
    plans = ws.plan_all(ws.select(env_names, all_=all_))
    ops.require_root("up")
    for p in plans:
        for w in p.warnings:
            _stderr(f"warning: {p.env}: {w}")
    engine = ws.engine(lock_timeout=CTX.lock_timeout, on_wait=_stderr,
                       progress=None if json_ else step_printer(_console()))
    outcomes = ops.up(ws, plans, engine)
    if json_:
        _emit_json([o.to_json() for o in outcomes])
    else:
        render_outcomes(_console(), outcomes, verb="up")


@app.command()
def down(names: EnvNames = None, all_: AllOpt = False, json_: JsonOpt = False) -> None:
    """Take environments down: remove what envctl made and restore what it changed.

    Works from the journal, newest step first, so a deleted or changed spec still tears
    down exactly what was made.

    Example: sudo envctl down --all
    """
    from envctl import app as ops
    from envctl.host.context import Host
    from envctl.render import render_outcomes

    if all_ and names:
        raise typer.BadParameter("give environment names or --all, not both")
    host = Host.from_env()
    if all_:
        targets = ops.known_environments(None, host)
    elif names:
        targets = [_split([n])[0][0] if _split([n])[0] else _name_of_file(n) for n in names]
    else:
        raise typer.BadParameter("name at least one environment, or use --all")
    ops.require_root("down")
    from envctl.engine.engine import Engine

    engine = Engine(host, lock_timeout=CTX.lock_timeout, on_wait=_stderr)
    outcomes = ops.down(engine, targets)
    if json_:
        _emit_json([o.to_json() for o in outcomes])
    else:
        render_outcomes(_console(), outcomes, verb="down")
    if any(o.errors for o in outcomes):
        raise typer.Exit(1)


def _name_of_file(path: str) -> str:
    from envctl.spec.loader import load_spec

    return load_spec(path).spec.name


@app.command()
def status(
    names: EnvNames = None,
    json_: JsonOpt = False,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 unless every applied resource "
                                                        "is ok (for monitoring).")] = False,
) -> None:
    """Each resource of each environment: ok, missing or drifted, against the live host.

    Example: envctl status cpu-compute --json
    """
    from envctl import app as ops
    from envctl.host.context import Host
    from envctl.render import render_status

    host = Host.from_env()
    ws = None
    try:
        ws, env_names = _workspace(names)
    except EnvctlError:
        if not names:
            raise
        env_names = list(names)  # status still works from the journal when a spec is gone
    targets = env_names or ops.known_environments(ws, host)
    rows = ops.status_rows(ws, host, targets)
    warnings = ops.status_warnings(ws, host, targets)
    cgroups = ops.cgroup_usage(host, rows)
    if json_:
        _emit_json([{"env": env, "up": any(s.op != "+" for s in steps) and bool(steps),
                     "steps": [s.to_json() for s in steps],
                     "warnings": warnings.get(env, []), "cgroup": cgroups.get(env)}
                    for env, steps in rows.items()])
    else:
        render_status(_console(), rows, warnings, cgroups=cgroups)
    if check and any(s.op != "=" for steps in rows.values() for s in steps
                     if s.note != "not applied"):
        raise typer.Exit(1)


# ---------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every expected error becomes one line on stderr and its exit code."""
    # Newer typer vendors click; find its exception base without importing click directly.
    click_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    debug = "--debug" in (argv if argv is not None else sys.argv)
    try:
        rc = app(args=argv, standalone_mode=False)
    except typer.Exit as exc:
        rc = exc.exit_code
    except typer.Abort:
        _stderr("aborted")
        rc = 130
    except click_error as exc:
        exc.show()
        rc = 2
    except SpecError as exc:
        if "--json" in (argv if argv is not None else sys.argv):
            _emit_json({"ok": False, "problems": [vars(p) for p in exc.problems]})
        for p in exc.problems:
            _stderr(f"error: {p}")
        _stderr(f"{len(exc.problems)} problem(s); nothing was changed")
        rc = exc.exit_code
    except EnvctlError as exc:
        if debug:
            import traceback

            traceback.print_exc()
        _stderr(f"error: {exc}")
        rc = exc.exit_code
    except KeyboardInterrupt:
        rc = 130
    sys.exit(rc or 0)


def entry() -> None:
    """The `envctl` command (console script and `python -m envctl`): `main` as a short-lived
    process, which is what every command is. Two things an interpreter does for long-lived
    programs are skipped: the cyclic garbage collector (a command allocates a few MB and
    exits; the collector ran during pydantic's model building for ~10 ms) and the teardown
    that frees every module at exit (~13 ms with ~330 modules), once output is flushed. An
    error that escapes `main` (a bug) still ends the normal way, with its traceback."""
    gc.disable()
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    else:  # pragma: no cover - main always exits
        code = 0
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # e.g. `envctl status | head`
        code = code or 1
    os._exit(code)
