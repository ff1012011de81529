"""What the CLI commands do to the host, without rendering: drive the engine, read the journal.

Kept free of spec parsing and planning (envctl.workspace) so that `down`, which works from the
journal alone, starts without pydantic, YAML or the planner.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from envctl.engine.engine import Engine, Outcome, Step
from envctl.engine.journal import Journal
from envctl.errors import NeedsRootError, SpecError
from envctl.host.context import Host
from envctl.host.files import read_json, write_json

if TYPE_CHECKING:
    from envctl.plan.builder import Plan
    from envctl.workspace import Workspace


def require_root(action: str) -> None:
    if os.geteuid() != 0:
        raise NeedsRootError(f"envctl {action} changes the host and needs root: run it with sudo")


def up(ws: Workspace, plans: list[Plan], engine: Engine) -> list[Outcome]:
    with engine.locked():
        outcomes = []
        for p in plans:
            outcomes.append(engine.up(p.env, p.resources, locked=True))
            _record_warnings(engine.host, p)
        return outcomes


def _warnings_file(host: Host, env: str) -> Path:
    # In the environment's own state directory: `down` removes it with the directory.
    return host.state_dir / "envs" / env / "warnings.json"


def _record_warnings(host: Host, plan: Plan) -> None:
    """Keep what `up` skipped (best-effort host tuning the host lacks) for `status`."""
    path = _warnings_file(host, plan.env)
    if path.parent.is_dir():
        write_json(path, {"warnings": plan.warnings})


def down(engine: Engine, names: list[str]) -> list[Outcome]:
    with engine.locked():
        return engine.down_many(names, locked=True)


def known_environments(ws: Workspace | None, host: Host) -> list[str]:
    """Environments in the config directory plus any the journal says exist."""
    names = list(ws.names()) if ws else []
    for n in Journal.environments(host.state_dir):
        if n not in names:
            names.append(n)
    return names


def status_rows(ws: Workspace | None, host: Host, names: list[str]) -> dict[str, list[Step]]:
    engine = Engine(host)
    out = {}
    for name in names:
        resources = None
        if ws is not None and name in ws.names():
            try:
                resources = ws.plan(ws.get(name)).resources
            except SpecError:
                resources = None
        out[name] = engine.status(name, resources)
    return out


def status_warnings(ws: Workspace | None, host: Host, names: list[str]) -> dict[str, list[str]]:
    """What the last `up` of each environment skipped or warned about; the plan's warnings
    for one that is not up."""
    out = {}
    for name in names:
        recorded = read_json(_warnings_file(host, name))
        if recorded is not None:
            out[name] = list(recorded.get("warnings", []))
        elif ws is not None and name in ws.names():
            try:
                out[name] = ws.plan(ws.get(name)).warnings
            except SpecError:
                out[name] = []
    return out


def cgroup_usage(host: Host, rows: dict[str, list[Step]]) -> dict[str, dict]:
    """Per environment: the cgroup driver in use and, when its cgroup exists, its usage."""
    from envctl.errors import HostError

    out: dict[str, dict] = {}
    for env, steps in rows.items():
        for s in steps:
            driver = getattr(s.resource, "driver", None)
            if s.resource.kind not in ("cgroup", "cgroup-slice") or driver is None:
                continue
            info: dict = {"driver": driver, "version": getattr(s.resource, "version", None)}
            if s.op in ("=", "~") and s.note != "not applied":
                try:
                    info["stats"] = host.cgroups.stats(env, driver=driver).to_json()
                except HostError as exc:
                    info["error"] = str(exc)
            out[env] = info
    return out
