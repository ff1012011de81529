"""`envctl up|down|status|plan|list` as functions: what the CLI runs in-process and what the
daemon's `operate` runs in a request's child (envctl.server.handlers), one implementation.

Each takes the parsed arguments and the command's settings (Options: what the CLI's global
options say), writes its output (rendered by envctl.render, or JSON) to sys.stdout and its
warnings to sys.stderr, and returns its exit status; a usage error is raised as BadArgs
(exit 2, the line the CLI gives). The doing is envctl.app's, envctl.workspace's and
envctl.listing's; this module only puts them together and renders.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envctl.errors import EnvctlError, SpecError, UsageError


@dataclass
class Options:
    """The settings the CLI's global options give (--config-dir, --lock-timeout)."""

    config_dir: str | None = None
    lock_timeout: float = 120.0


class BadArgs(UsageError):
    """A command line these commands refuse, worded as the CLI words its usage errors."""

    def __init__(self, command: str, message: str) -> None:
        super().__init__(f"Invalid value: {message} (see `envctl {command} --help`)")


# ---------------------------------------------------------------- helpers


def split(names: list[str] | None) -> tuple[list[str], list[Path]]:
    """Arguments naming spec files (a path that exists, or ends in .yaml) are loaded as files."""
    env_names, files = [], []
    for n in names or []:
        if n.endswith((".yaml", ".yml")) or "/" in n:
            files.append(Path(n))
        else:
            env_names.append(n)
    return env_names, files


def workspace(names: list[str] | None, opts: Options, **kwargs: Any):
    from envctl.workspace import Workspace, config_dir

    env_names, files = split(names)
    ws = Workspace.open(config_dir(opts.config_dir), extra_files=files, **kwargs)
    for f in files:  # a file with problems is not among the specs (Workspace.open `collect`)
        env_names += [ls.spec.name for ls in ws.specs if Path(ls.path).resolve() == f.resolve()]
    return ws, env_names


def require_known(names: list[str], host: Any, opts: Options, ws: Any = None) -> None:
    """envctl.known.require_known with this command's --config-dir (exit 2 for a typo)."""
    from envctl.known import require_known as known

    known(names, host, ws, opts.config_dir)


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def console():
    from rich.console import Console

    # No emoji codes: a MAC address holding ":cd:" must not print as a picture.
    out = Console(highlight=False, emoji=False)
    if not out.is_terminal:
        # Piped to a file or a program: one line per line, never wrapped at 80 columns.
        out.soft_wrap = True
    return out


def stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def warned(warnings: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each warning, once -> the environments that have it, in order."""
    who: dict[str, list[str]] = {}
    for env, found in warnings.items():
        for w in dict.fromkeys(found):
            who.setdefault(w, []).append(env)
    return who


def recent_events(host: Any, envs: list[str]) -> dict[str, list[dict[str, Any]]]:
    """The monitor's last events of each environment (for `status`)."""
    from envctl.monitor import events

    return events.recent(host.state_dir, per_env=3, envs=envs)


def render_events(out: Any, recent: dict[str, list[dict[str, Any]]]) -> None:
    from rich.markup import escape

    from envctl.monitor.events import format_event

    for env, got in recent.items():
        out.print(f"[bold]{env}[/]  monitor events:")
        for rec in got:
            out.print(f"  [dim]{escape(format_event(rec))}[/]")


def targets(names: list[str] | None, host: Any, opts: Options, *, pure: bool = False
            ) -> tuple[Any, list[str]]:
    """The workspace (None when its specs cannot be read) and the environments named, else
    every one known. Read-only commands work from the journals when a spec is gone or broken:
    a bad spec elsewhere must not make `status --check` of what is up fail. The problems are
    still shown."""
    from envctl import app as ops

    ws = None
    try:
        ws, env_names = workspace(names, opts, pure=pure)
    except EnvctlError as exc:
        for line in (exc.problems if isinstance(exc, SpecError) else [exc]):
            stderr(f"warning: {line}")
        stderr("warning: specs not read: showing what the journals record")
        env_names = [n for n in names or [] if not n.endswith((".yaml", ".yml"))]
    if env_names:
        require_known(env_names, host, opts, ws)
    return ws, env_names or ops.known_environments(ws, host)


# ---------------------------------------------------------------- plan


def plan(names: list[str] | None, opts: Options, *, all_: bool = False, down_: bool = False,
         json_: bool = False) -> int:
    from envctl import app as ops
    from envctl.render import render_plan

    ws, env_names = workspace(names, opts)
    engine = ws.engine()
    out = []
    if down_:
        envs = ops.known_environments(ws, ws.host) if all_ else env_names
        if not envs:
            raise BadArgs("plan", "name at least one environment, or use --all")
        require_known(envs, ws.host, opts, ws)
        for n in envs:
            steps = engine.diff_down(n)  # each removal says what it restores
            out.append({"env": n, "warnings": [], "resolved": {}, "steps": steps})
    else:
        from envctl.listing import spec_limits

        for p in ws.plan_all(ws.select(env_names, all_=all_)):
            out.append({"env": p.env, "limits": spec_limits(ws.get(p.env).spec, p.resolved),
                        "warnings": p.warnings, "resolved": p.resolved,
                        "steps": engine.diff(p.env, p.resources)})
    if json_:
        emit_json([{**o, "steps": [s.to_json() for s in o["steps"]]} for o in out])
    else:
        # A warning several environments share is about this host (memory.high on cgroup
        # v1, no cpufreq): said once, naming them, rather than under each.
        c = console()
        shared = {w: envs for w, envs in warned({o["env"]: o["warnings"] for o in out}).items()
                  if len(envs) > 1}
        for w, envs in shared.items():
            from rich.markup import escape

            c.print(f"[yellow]warning: {escape(w)}[/]  [dim]({', '.join(envs)})[/]")
        render_plan(c, [{**o, "warnings": [w for w in o["warnings"] if w not in shared]}
                        for o in out], down=down_)
    return 0


# ---------------------------------------------------------------- up, down


def up(names: list[str] | None, opts: Options, *, all_: bool = False,
       json_: bool = False, each: bool = False) -> int:
    """`each` (a retry's round): the named environments planned one by one as --all plans
    them (one this host cannot serve is skipped), and a name with no spec left is dropped."""
    from envctl import app as ops
    from envctl.engine.signals import interruptible
    from envctl.render import bar_printer, render_outcomes, step_printer

    ws, env_names = workspace(names, opts, secure=os.geteuid() == 0)
    if os.geteuid() == 0:
        # Before planning: an environment refused for a GPU's health still records it.
        from envctl.workspace import FINDINGS_KEY

        for uuid, why in ops.quarantine_findings(ws.host, ws.facts.extra.get(FINDINGS_KEY, []),
                                                 ws.facts.gpu_held).items():
            stderr(f"warning: GPU {uuid} quarantined: {why}")
    if each:
        gone = [n for n in env_names if n not in ws.names()]
        _record_not_up(ws.host, gone, [])  # its spec was removed: nothing to retry
        env_names = [n for n in env_names if n not in gone]
        if not env_names:
            return 0
    selected = ws.select(env_names, all_=all_)
    if all_ or each:
        plans, skipped = ws.plan_each(selected)
    else:
        plans, skipped = ws.plan_all(selected), {}
    ops.require_root("up")
    interruptible()  # SIGTERM / SIGHUP roll back like Ctrl-C
    for w, envs in warned({p.env: p.warnings for p in plans}).items():  # each once
        stderr(f"warning: {', '.join(envs)}: {w}")
    for env, exc in skipped.items():
        for problem in exc.problems:
            stderr(f"error: {problem}")
        stderr(f"skipped {env}: this host cannot serve it")
    if not json_:
        ws.host.progress = bar_printer(console())
    engine = ws.engine(lock_timeout=opts.lock_timeout, on_wait=stderr,
                       progress=None if json_ else step_printer(console()))
    from envctl.listing import spec_digest
    from envctl.plan.mig import PENDING_KEY

    def claims() -> dict[str, dict]:
        # With what the spec said (its digest), for `list` to tell up from not-applied quickly.
        return {p.env: {**ws.claims(p.env), "spec_digest": spec_digest(ws.get(p.env).spec)}
                for p in plans}

    carving = [p for p in plans if p.resolved.get(PENDING_KEY)]
    # One hold of the global lock for both halves of a MIG `up` (the instances, then the
    # environments planned again with them): no other envctl runs between them.
    with engine.locked():
        mig_failed: dict[str, str] = {}
        rolled_back: dict[str, str] = {}
        first: list = []
        fresh = set()
        if carving:
            # MIG instances first: their UUIDs and access nodes exist only once made, then the
            # environments are planned again with them (as if named by MIG UUID).
            fresh = {p.env for p in carving if not engine.journal(p.env).entries}
            first, rolled_back = ops.make_mig(carving, engine, claims())
            mig_failed = dict(rolled_back)
            ws = ws.with_host_facts()
            again = [ws.get(p.env) for p in plans if p.env not in mig_failed]
            plans, more = ws.plan_each(again) if all_ or each else (ws.plan_all(again), {})
            skipped.update(more)
            for p in plans:
                if p.resolved.get(PENDING_KEY):  # made, yet discovery does not show them
                    mig_failed[p.env] = (f"the MIG instances made for it are not among those NVML "
                                         f"lists ({p.resolved['mig']}); `envctl gpus` shows them")
            plans = [p for p in plans if p.env not in mig_failed]
        result = ops.up(plans, engine, claims())
        if carving:
            result.outcomes = ops.with_made(result.outcomes, first)
        result.failed = {**mig_failed, **result.failed}
        for env in fresh & set(result.failed) - set(rolled_back):
            # It held nothing before this `up`: its MIG instances go too, as a rollback would.
            ops.down(engine, [env])
    for env, err in result.failed.items():
        stderr(f"error: {env}: {err}")
    if result.cdi_error:
        stderr(f"error: {result.cdi_error}")
    # What waits for `up --retry` (envctl-retry.service): after --all (and a retry's round),
    # exactly what is not up. An `up NAME` that failed is the operator's to run again, never
    # retried by itself: it only takes what came up off the list.
    _record_not_up(ws.host, [ls.spec.name for ls in selected],
                   [*result.failed, *skipped] if all_ or each else [])
    if json_:
        emit_json([o.to_json() for o in result.outcomes]
                  + [{"env": env, "error": err} for env, err in result.failed.items()]
                  + [{"env": env, "skipped": [str(p) for p in exc.problems]}
                     for env, exc in skipped.items()])
    else:
        render_outcomes(console(), result.outcomes, verb="up")
    if result.cdi_error and not (result.failed or skipped):
        return 1
    if result.failed or skipped:
        # Last, in one line: what `systemctl status envctl` shows of a boot's `up --all`.
        not_up = [f"{env} (failed)" for env in result.failed] + \
            [f"{env} (skipped)" for env in skipped]
        stderr(f"not up: {', '.join(not_up)}")
        return 1
    return 0


def _record_not_up(host: Any, tried: list[str], not_up: list[str], *,
                   everything: bool = False) -> None:
    """envctl.retry.record_attempt (`everything`: the whole list goes); a run directory that
    cannot be written only warns."""
    from envctl.retry import read_not_up, record_attempt

    try:
        if everything:
            tried = [*tried, *read_not_up(host.run_dir, host.boot_id)]
        record_attempt(host.run_dir, host.boot_id, tried, not_up)
    except OSError as exc:
        stderr(f"warning: retry list {host.run_dir}: {exc.strerror or exc}")


def retry(opts: Options, *, window: float) -> int:
    """`up --retry`: the environments this boot's `up --all` could not bring up, tried again
    with backoff (envctl.retry) until all are up (exit 0) or `window` seconds have passed
    (exit 1, naming those still not up)."""
    from envctl import app as ops
    from envctl import retry as rt
    from envctl.engine.signals import Interrupted, interruptible
    from envctl.host.context import Host

    ops.require_root("up --retry")
    host = Host.from_env()
    interruptible()  # systemctl stop envctl (PartOf=): a clean end, not a failed unit
    try:
        return _retry_rounds(host, opts, window, rt)
    except Interrupted as exc:
        stderr(f"retry stopped ({exc}): what was still not up stays on the list")
        return 0


def _retry_rounds(host: Any, opts: Options, window: float, rt: Any) -> int:
    """`up --retry`'s rounds (commands.retry)."""

    def attempt(names: list[str]) -> list[str]:
        # Only what is still on the list now: a `down NAME` during the wait took NAME off
        # (the operator decided), and it is never brought back.
        names = [n for n in names if n in rt.read_not_up(host.run_dir, host.boot_id)]
        if not names:
            return rt.read_not_up(host.run_dir, host.boot_id)
        try:
            up(names, opts, each=True)
        except EnvctlError as exc:  # a spec being edited, a lock held: the next round
            for line in (exc.problems if isinstance(exc, SpecError) else [exc]):
                stderr(f"error: {line}")
        return rt.read_not_up(host.run_dir, host.boot_id)

    pending = rt.read_not_up(host.run_dir, host.boot_id)
    if not pending:
        stderr("nothing to retry: every environment `up --all` tried this boot is up")
        return 0
    left = rt.retry(attempt, pending, window=window, on_wait=lambda d, names: stderr(
        f"retrying {', '.join(names)} in {d:g} s"))
    if left:
        stderr(f"still not up after {window:g} s: {', '.join(left)} (envctl up NAME, or "
               "systemctl restart envctl-retry, once fixed)")
        return 1
    stderr("every environment is up")
    return 0


def down(names: list[str] | None, opts: Options, *, all_: bool = False, force: bool = False,
         purge: bool = False, json_: bool = False) -> int:
    from envctl import app as ops
    from envctl.engine.engine import Engine
    from envctl.engine.signals import interruptible
    from envctl.host.context import Host
    from envctl.render import render_outcomes

    if all_ and names:
        raise BadArgs("down", "give environment names or --all, not both")
    host = Host.from_env()
    if purge:
        host.options["purge"] = "1"
    if all_:
        envs = ops.known_environments(None, host)
    elif names:
        envs = [split([n])[0][0] if split([n])[0] else _name_of_file(n) for n in names]
    else:
        raise BadArgs("down", "name at least one environment, or use --all")
    ops.require_root("down")
    if not force:
        require_known(envs, host, opts)
    _jobs_before_down(host, envs, force=force)
    interruptible()
    engine = Engine(host, lock_timeout=opts.lock_timeout, on_wait=stderr)
    if force:
        outcomes, repair = ops.force_down(engine, envs, _planned_by_name(envs, opts))
        for path in repair.kept:
            stderr(f"kept damaged state file as {path}")
        for env, what in repair.found.items():
            stderr(f"{env}: found by name: {'; '.join(what)}")
        for env, what in repair.lost.items():
            stderr(f"{env}: left as found (its memo was lost with the damaged state): "
                   f"{'; '.join(what)}")
    else:
        outcomes = ops.down(engine, envs)
    # Taken down on purpose: never brought back by a retry (`down --all`: nothing is).
    _record_not_up(host, envs, [], everything=all_)
    if json_:
        emit_json([o.to_json() for o in outcomes])
    else:
        render_outcomes(console(), outcomes, verb="down")
    return 1 if any(o.errors for o in outcomes) else 0


def _jobs_before_down(host: Any, envs: list[str], *, force: bool) -> None:
    """Jobs still running in an environment stop its `down` (exit 3, naming every such
    environment and its jobs, nothing taken down: the host's state refuses it, the command is
    right) unless --force, or the host is shutting down (`systemctl is-system-running` says
    "stopping": envctl.service's ExecStop= at shutdown), which cancel them first (recorded
    CANCELLED; at shutdown with the reason "host shutdown")."""
    from envctl.runtime.jobs import jobs_dir

    if not jobs_dir(host.state_dir).is_dir():
        return  # no job was ever submitted here
    from envctl.runtime import supervisor as sv

    reason = None
    if not force:
        busy = sv.busy_envs(host, envs)
        if not busy:
            return
        if not host.systemd.stopping():
            raise sv.refuse_down(busy)
        reason = sv.SHUTDOWN_REASON
        stderr(f"the host is shutting down: cancelling the jobs of {', '.join(busy)}")
        envs = list(busy)
    from envctl.host.cgroups import kill_grace_from_env

    for env in envs:  # with teardown's grace (ENVCTL_KILL_GRACE) between SIGTERM and SIGKILL
        for job in sv.stop_env_jobs(host, env, grace=kill_grace_from_env(), reason=reason):
            stderr(f"{env}: job {job.id} {job.state}")


def _planned_by_name(names: list[str], opts: Options) -> dict[str, list]:
    """For `down --force`: the resources each named environment's spec plans on this host
    (what envctl would have made, by name), when its spec is in the config directory."""
    from envctl.workspace import Workspace, config_dir

    try:
        ws = Workspace.open(config_dir(opts.config_dir), pure=True)
    except EnvctlError as exc:
        stderr(f"warning: specs not read ({exc}): only what the journals name is removed")
        return {}
    ws = ws.with_host_facts()
    out = {}
    for name in names:
        if name not in ws.names():
            stderr(f"warning: no spec for {name}: only what its journal names is removed")
            continue
        try:
            out[name] = ws.plan(ws.get(name)).resources
        except EnvctlError as exc:
            stderr(f"warning: {name} cannot be planned here ({exc}): only what its journal "
                   "names is removed")
    return out


def _name_of_file(path: str) -> str:
    from envctl.spec.loader import load_spec

    return load_spec(path).spec.name


# ---------------------------------------------------------------- status, list


def status(names: list[str] | None, opts: Options, *, json_: bool = False,
           check: bool = False) -> int:
    from envctl import app as ops
    from envctl import listing
    from envctl.host.context import Host
    from envctl.render import render_status

    host = Host.from_env()
    ws, envs = targets(names, host, opts)
    rows = ops.status_rows(ws, host, envs)
    warnings = ops.status_warnings(ws, host, envs)
    cgroups = ops.cgroup_usage(host, rows)
    isolation = ops.status_isolation(ws, host, list(rows))
    descriptions = ops.status_descriptions(ws, host, list(rows))
    states = listing.status_states(ws, host, rows)
    limits = listing.limit_summaries(ws, host, list(rows), states)
    events = recent_events(host, list(rows))
    from envctl.monitor.maintenance import paused

    marks = paused(host.run_dir, list(rows))
    if json_:
        emit_json([{"env": env, "state": states[env], "up": states[env] != "down",
                    "description": descriptions.get(env, ""), "limits": limits.get(env),
                    "isolation": isolation.get(env, {"level": "native"}),
                    "steps": [s.to_json() for s in steps],
                    "warnings": warnings.get(env, []), "cgroup": cgroups.get(env),
                    "events": events.get(env, []), "maintenance": marks.get(env)}
                   for env, steps in rows.items()])
    else:
        render_status(console(), rows, warnings, cgroups=cgroups, isolation=isolation,
                      descriptions=descriptions, states=states, limits=limits)
        from envctl.monitor.maintenance import GPUS, read
        from envctl.monitor.nvmlkeep import holders

        gpus = read(host.run_dir, GPUS)
        render_maintenance(console(), marks, gpus,
                           holders(host.run_dir) if gpus is not None else [])
        render_events(console(), events)
    if check and any(s.op != "=" for steps in rows.values() for s in steps
                     if s.note != "not applied"):
        return 1
    return 0


def maintenance(env: str, mode: str, opts: Options, *, json_: bool = False) -> int:
    """`envctl maintenance ENV on|off`: pause or resume the monitor's healing of `env`."""
    from envctl import app as ops
    from envctl.host.context import Host
    from envctl.monitor import maintenance as mt

    if mode not in ("on", "off"):
        raise BadArgs("maintenance", f"'{mode}': give on or off")
    host = Host.from_env()
    _, envs = targets([env], host, opts)  # an unknown name is refused here (exit 2)
    if len(envs) != 1 or env.endswith((".yaml", ".yml")):
        raise BadArgs("maintenance", "name one environment (not a spec file)")
    ops.require_root(f"maintenance {env} {mode} (the monitor heals as root)")
    changed = mt.set_mode(host.run_dir, env, mode == "on")
    if json_:
        emit_json({"env": env, "maintenance": mode == "on", "changed": changed})
    else:
        said = {"on": "healing paused", "off": "healing resumed"}[mode]
        console().print(f"{env}: maintenance {mode}: {said}" if changed else
                        f"{env}: maintenance already {mode}: nothing changed")
    return 0


GPU_RELEASE_WAIT = 60.0  # seconds `maintenance --gpus on` waits for the monitor to let go


def maintenance_gpus(mode: str, opts: Options, *, json_: bool = False,
                     wait: float = GPU_RELEASE_WAIT) -> int:
    """`envctl maintenance --gpus on|off`: pause or resume the monitor's GPU sampling. `on`
    then waits (at most `wait` s) until the running monitor has shut NVML down, so that the
    next command (`nvidia-smi -r`) finds no handle of envctl's; exit 1 if it has not by then."""
    import time

    from envctl import app as ops
    from envctl.host.context import Host
    from envctl.monitor import maintenance as mt
    from envctl.monitor.nvmlkeep import PAUSE_POLL, holders

    if mode not in ("on", "off"):
        raise BadArgs("maintenance", f"--gpus '{mode}': give on or off")
    ops.require_root(f"maintenance --gpus {mode} (the monitor runs as root)")
    host = Host.from_env()
    changed = mt.set_mode(host.run_dir, mt.GPUS, mode == "on")
    held = holders(host.run_dir) if mode == "on" else []
    if held and not json_:
        console().print(f"waiting for pid {', '.join(map(str, held))} (the monitor, top) to "
                        "shut NVML down …")
    deadline = time.monotonic() + wait
    while held and time.monotonic() < deadline:
        time.sleep(min(0.1, PAUSE_POLL))
        held = holders(host.run_dir)
    pids = ", ".join(map(str, held))
    if json_:
        emit_json({"gpus": "paused" if mode == "on" else "sampled", "changed": changed,
                   "nvml_held_by": held})
    elif mode == "on":
        console().print("GPU sampling paused: no envctl process holds NVML" if not held
                        else f"GPU sampling paused, but pid {pids} still holds NVML after "
                        f"{wait:.0f} s (a heal in progress?)")
    else:
        console().print("GPU sampling resumed: the monitor opens NVML at its next tick"
                        if changed else "GPU sampling was not paused: nothing changed")
    if held:
        stderr(f"maintenance --gpus on: pid {pids} still holds NVML")
        return 1
    return 0


def render_maintenance(out: Any, marks: dict[str, dict[str, Any]],
                       gpus: dict[str, Any] | None = None,
                       held: list[int] | None = None) -> None:
    from envctl.monitor.maintenance import describe

    for env, mark in marks.items():
        out.print(f"[bold]{env}[/]  [yellow]{describe(mark)}[/]")
    if gpus is not None:
        text = describe(gpus).replace("healing paused", "GPU sampling paused")
        who = ("NVML released" if not held else
               f"pid {', '.join(map(str, held))} still holds NVML")
        out.print(f"[bold]GPUs[/]  [yellow]{text}: {who}[/]")


def list_(names: list[str] | None, opts: Options, *, json_: bool = False) -> int:
    from envctl import listing
    from envctl.host.context import Host
    from envctl.render import render_list

    host = Host.from_env()
    ws, envs = targets(names, host, opts, pure=True)  # host facts only as rows need them
    rows = listing.rows(ws, host, envs)
    if json_:
        emit_json([r.to_json() for r in rows])
    else:
        render_list(console(), rows)
    return 0


# ---------------------------------------------------------------- errors


def report(exc: BaseException, *, json_: bool, debug: bool) -> int:
    """An expected error of a command as one line (a spec's problems, one each) on stderr;
    its exit status. What the CLI and the daemon's operate both say."""
    if isinstance(exc, SpecError):
        if json_:
            emit_json({"ok": False, "problems": [vars(p) for p in exc.problems],
                       "warnings": [vars(w) for w in exc.warnings]})
        for p in exc.problems:
            stderr(f"error: {p}")
        for w in exc.warnings:
            stderr(f"warning: {w}")
        stderr(f"{len(exc.problems)} problem(s); nothing was changed")
        return exc.exit_code
    if isinstance(exc, EnvctlError):
        if debug:
            import traceback

            traceback.print_exc()
        stderr(f"error: {exc}")
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        # Outside a step (waiting for the lock, between environments, during down): what was
        # done is journalled; running the command again finishes it.
        stderr("interrupted")
        return 128 + getattr(exc, "signum", 2)
    raise exc


# ---------------------------------------------------------------- the daemon's form

# What a no-op `up` (and the other commands) import beyond the daemon's own modules: imported
# once by the daemon (preload), so that a request's forked child does not (~140 ms of ~200).
PRELOAD = (
    "envctl.app", "envctl.engine.engine", "envctl.engine.signals", "envctl.host.cgroups",
    "envctl.host.cpufreq", "envctl.host.devices", "grp", "pwd",
    "envctl.host.elf", "envctl.host.facts", "envctl.host.firewall", "envctl.host.mounts",
    "envctl.known", "envctl.listing", "envctl.monitor.events", "envctl.plan.planner",
    "envctl.render", "envctl.resources.bridge", "envctl.resources.cgroup",
    "envctl.resources.dirs", "envctl.resources.firewall", "envctl.resources.governor",
    "envctl.resources.kmod", "envctl.resources.mounts", "envctl.resources.netns",
    "envctl.resources.rootfs", "envctl.resources.service", "envctl.resources.sysctl",
    "envctl.resources.veth", "envctl.workspace", "elftools.elf.elffile", "rich.console",
    "rich.markup",
)


def preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)


# The options each command takes through the daemon (the only ones: nothing that changes
# which specs, state or host settings are used) -> its keyword argument.
FLAGS: dict[str, dict[str, str]] = {
    "up": {"--json": "json_"},
    "down": {"--json": "json_", "--force": "force"},
    "status": {"--json": "json_", "--check": "check"},
    "plan": {"--json": "json_", "--down": "down_"},
    "list": {"--json": "json_"},
}
COMMANDS = {"up": up, "down": down, "status": status, "plan": plan, "list": list_}


def run_argv(argv: list[str], opts: Options | None = None) -> int:
    """`argv` (a command of FLAGS, its flags and names, `--debug` anywhere) run here as
    the CLI runs it, errors included; its exit status."""
    command, words = argv[0], argv[1:]
    debug = "--debug" in words
    names, kwargs = [], {}
    try:
        for word in words:
            if word == "--debug":
                continue
            if word.startswith("-"):
                if word not in FLAGS[command]:
                    raise UsageError(f"No such option: {word} (see `envctl {command} --help`)")
                kwargs[FLAGS[command][word]] = True
            else:
                names.append(word)
        return COMMANDS[command](names or None, opts or Options(), **kwargs)
    except (EnvctlError, KeyboardInterrupt) as exc:
        return report(exc, json_="--json" in words, debug=debug)


# ---------------------------------------------------------------- routing a plain user's


# Options of the envctl command itself, and whether each takes a value: accepted after the
# subcommand too (`envctl plan X --config-dir D`), as operators type them.
GLOBAL_OPTIONS = {"--config-dir": True, "-C": True, "--debug": False, "--lock-timeout": True,
                  "--firewall": True, "--cgroup-driver": True}

def hoist_global_options(argv: list[str]) -> list[str]:
    """`argv` with global options given after the subcommand moved before it. Nothing after a
    `--` moves (it belongs to the command being run)."""
    i = 0
    while i < len(argv):  # find the subcommand: the first word that is not a global option
        word = argv[i]
        name = word.split("=", 1)[0]
        if word == "--" or not word.startswith("-"):
            break
        i += 2 if GLOBAL_OPTIONS.get(name) and "=" not in word else 1
    head, rest = argv[: i + 1], argv[i + 1:]
    moved, kept = [], []
    j = 0
    while j < len(rest):
        word = rest[j]
        if word == "--":
            kept += rest[j:]
            break
        name = word.split("=", 1)[0]
        if name in GLOBAL_OPTIONS:
            takes = GLOBAL_OPTIONS[name] and "=" not in word
            moved += rest[j:j + 2] if takes else [word]
            j += 2 if takes else 1
            continue
        kept.append(word)
        j += 1
    return head[:i] + moved + head[i:] + kept


OPERATE_COMMANDS = ("up", "down", "status", "plan", "list")


def through_daemon(argv: list[str]) -> int | None:
    """A plain user's up/down/status/plan/list go through the daemon when it answers (it
    checks access.operate and uses its own specs and settings): the command's exit code.
    Without a daemon, None: in-process as before (read-only views; `up` and `down`
    say they need root)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 2 if GLOBAL_OPTIONS.get(argv[i].split("=", 1)[0]) and "=" not in argv[i] else 1
    if i >= len(argv) or argv[i] not in OPERATE_COMMANDS:
        return None
    from envctl.server import client

    try:
        daemon = client.route()
    except client.DaemonDown:
        return None
    assert daemon is not None  # route() returns None for root only
    given = [a for a in argv[:i] if a != "--debug"]
    if given:
        if argv[i] not in ("up", "down"):
            return None  # the user's own read-only view, in-process
        raise UsageError(f"envctl {argv[i]}: {given[0].split('=', 1)[0]} is not taken through "
                         "the daemon, which uses its own specs and settings")
    sys.stdout.flush()
    return client.operate(daemon, argv[i:] + (["--debug"] if "--debug" in argv[:i] else []))


def fast_entry() -> None:
    """`envctl up|down|status|plan|list …` of a plain user (envctl.entry) without the typer
    CLI: through the daemon, leaving with its exit code. Returns, doing nothing, when the
    daemon does not take it (not running, --help, the user's own read-only view)."""
    argv = hoist_global_options(sys.argv[1:])
    if os.geteuid() == 0 or any(a in ("--help", "-h") for a in argv):
        return
    try:
        code = through_daemon(argv)
    except EnvctlError as exc:
        stderr(f"error: {exc}")
        code = exc.exit_code
    if code is None:
        return
    from envctl.runtime.fastpath import run_fast

    run_fast(lambda: code)
