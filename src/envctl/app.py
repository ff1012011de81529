"""What the CLI commands do to the host, without rendering: drive the engine, read the journal.

Kept free of spec parsing and planning (envctl.workspace) so that `down`, which works from the
journal alone, starts without pydantic, YAML or the planner.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from envctl.engine.engine import KEEP, REMOVE, Engine, Outcome, Step
from envctl.engine.journal import Entry, Journal, Ledger
from envctl.errors import EnvctlError, HostError, NeedsRootError, SpecError, StateCorrupt
from envctl.host.context import Host
from envctl.resources.base import Status

if TYPE_CHECKING:
    from envctl.plan.builder import Plan
    from envctl.workspace import Workspace


def require_root(action: str) -> None:
    if os.geteuid() != 0:
        raise NeedsRootError(f"envctl {action} changes the host and needs root: run it with sudo")


@dataclass
class UpResult:
    """What `up` did: an outcome per environment brought up, and why the others were not."""

    outcomes: list[Outcome] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # env -> the error (rolled back)
    cdi_error: str = ""  # the CDI file could not be brought in step (the environments are up)


def up(plans: list[Plan], engine: Engine, claims: dict[str, dict]) -> UpResult:
    """Each environment in turn, under one lock hold (Engine.up_many). A failing one is rolled
    back and the others still come up: at boot, one broken partition must not keep the rest
    down. A signal (Ctrl-C, SIGTERM) stops everything after the rollback. Each journal records
    the environment's `claims` and its plan's warnings (for `status`)."""
    items = [(p.env, p.resources, {"claims": claims.get(p.env, {}), "warnings": p.warnings})
             for p in plans]
    with engine.locked():
        try:
            outcomes, failed = engine.up_many(items, locked=True)
        finally:
            # Also after a failure or a signal: what was rolled back holds nothing.
            cdi_error = sync_cdi(engine.host)
    return UpResult(outcomes, {env: str(exc) for env, exc in failed.items()}, cdi_error)


MIG_KINDS = ("mig-mode", "mig-instance")


def make_mig(plans: list[Plan], engine: Engine, claims: dict[str, dict]
             ) -> tuple[list[Outcome], dict[str, str]]:
    """The first half of `up` for environments with MIG instances to make (plan.mig): their
    plans up to the last MIG step, without touching the rest of what their journals hold.
    The instances' UUIDs and access nodes exist only once made, so the caller plans these
    environments again and then runs `up`, which finds the MIG steps done (with_made shows
    them as made). What was done, and env -> the error of each one that failed (rolled
    back)."""
    items = []
    for p in plans:
        last = max(i for i, r in enumerate(p.resources) if r.kind in MIG_KINDS)
        items.append((p.env, p.resources[:last + 1],
                      {"claims": claims.get(p.env, {}), "warnings": p.warnings}))
    with engine.locked():
        # MIG instances the spec no longer asks for go first: their slots may be wanted now.
        outcomes, failed = engine.up_many(items, locked=True, prune=MIG_KINDS)
    return outcomes, {env: str(exc) for env, exc in failed.items()}


def with_made(outcomes: list[Outcome], first: list[Outcome]) -> list[Outcome]:
    """`outcomes` with each step the first half of `up` (make_mig) made or changed shown as
    made there, not as kept: the second half found it done."""
    done = {(o.env, s.resource.key): s for o in first for s in o.steps if s.op != KEEP}
    for o in outcomes:
        o.steps = [done.get((o.env, s.resource.key), s) for s in o.steps]
    return outcomes


def quarantine_findings(host: Host, findings: list, held: dict[str, str]) -> dict[str, str]:
    """Record health findings (envctl.host.gpuhealth) in the GPU quarantine ledger and raise a
    `gpu-quarantined` event for each GPU newly quarantined or with new evidence, under the
    environment holding it ("host" when none does). GPU UUID -> reason of those."""
    from envctl.engine import quarantine
    from envctl.monitor import events

    changed = quarantine.record(host.state_dir, findings, boot=host.boot_id)
    index = {f.uuid: f.index for f in findings}
    for uuid, why in changed.items():
        with contextlib.suppress(OSError):  # the ledger is the record; the event a courtesy
            events.append(host.state_dir, held.get(uuid, "host"), "gpu-quarantined",
                          f"GPU {index.get(uuid, '?')} ({uuid}): {why}")
    return changed


def down(engine: Engine, names: list[str]) -> list[Outcome]:
    with engine.locked():
        before = sync_cdi(engine.host, leaving=names)
        outcomes = engine.down_many(names, locked=True)
        after = sync_cdi(engine.host)
        return _purged(engine, _with_cdi_error(outcomes, before or after))


def sync_cdi(host: Host, *, leaving: list[str] | tuple[str, ...] = ()) -> str:
    """Bring the CDI file (ENVCTL_CDI_DIR/envctl.yaml) in step with the journals, less the
    environments `leaving`: "" when done, else why not, in one line. `down` calls it before
    its first step, so that no moment exists in which the file hands out a GPU that is being
    given back, and after its last (the file goes when nothing is held)."""
    from envctl import gpus

    try:
        # The default file, and any other that `gpus --cdi --cdi-path` wrote: each is kept in
        # step, or it would go stale.
        paths = dict.fromkeys([gpus.cdi_path(), *gpus.written_cdi_paths(host)])
    except EnvctlError as exc:
        return f"CDI spec: {exc}"
    problems = []
    for path in paths:
        try:
            gpus.sync_cdi(host, host.gpu_root, path, leaving=leaving)
        except EnvctlError as exc:
            if not leaving:
                problems.append(f"CDI spec: {exc}")
                continue
            # The file may still list what is being given back: without it, nothing is
            # handed out that another environment could take next.
            try:
                gpus.remove_cdi(host, path)
            except EnvctlError as again:
                problems.append(f"CDI spec: {exc}; and removing it: {again}")
                continue
            problems.append(f"CDI spec: {exc}; removed it instead")
    return "; ".join(problems)


def _with_cdi_error(outcomes: list[Outcome], error: str) -> list[Outcome]:
    if error:
        for o in outcomes:
            o.errors.append(error)
    return outcomes


def _purged(engine: Engine, outcomes: list[Outcome]) -> list[Outcome]:
    """`outcomes`, once `down --purge` has deleted the data of each environment that was not
    up (`down` and `down --force` alike)."""
    if engine.host.options.get("purge"):
        for o in outcomes:
            if not o.steps and not o.errors:
                _purge_data_of_down(engine.host, o)
    return outcomes


def _purge_data_of_down(host: Host, outcome: Outcome) -> None:
    """`down --purge` of an environment that is not up: its data directories outlive a plain
    `down` (and a journal), so `<state>/data/ENV/` is deleted all the same, as the data
    directory resource deletes its own (through descriptors, never through a symlink)."""
    from envctl.resources.base import Check
    from envctl.resources.dirs import Directory

    res = Directory("state", f"data/{outcome.env}", 0o755, keep=True)
    if not os.path.lexists(host.state_dir / "data" / outcome.env):
        return
    try:
        res.remove(host, {"existed": True})
    except HostError as exc:
        outcome.errors.append(f"remove {res.describe()}: {exc}")
        return
    outcome.steps.append(Step(REMOVE, res, Check.absent(),
                              "it was not up: its data directories deleted (--purge)"))


def known_environments(ws: Workspace | None, host: Host) -> list[str]:
    """Environments in the config directory plus any the journal says exist."""
    names = list(ws.names()) if ws else []
    for n in Journal.environments(host.state_dir):
        if n not in names:
            names.append(n)
    return names


# ---------------------------------------------------------------- down --force


@dataclass
class Repair:
    """What `down --force` did to envctl's state before taking the environments down."""

    kept: list[str] = field(default_factory=list)  # damaged files moved aside, kept
    found: dict[str, list[str]] = field(default_factory=dict)  # env -> objects found by name
    lost: dict[str, list[str]] = field(default_factory=dict)  # env -> shared, memo lost


def force_down(engine: Engine, names: list[str], plans: dict[str, list]) -> tuple[
        list[Outcome], Repair]:
    """`down` for environments whose journal (or the ledger) is damaged or lost.

    Damaged state files are moved aside (kept, named `FILE.damaged-TIME`) and replaced by what
    could still be read of them. To that, objects the environment's spec (`plans`: its planned
    resources, when a spec is there) names and the host has are added as envctl's own: found
    by name, where no journal names them. Shared settings (sysctls, modules, governors, the
    bridge) whose memo was lost are left as they are and reported, never "restored" to a
    guess. Then it is a normal `down`."""
    repair = Repair()
    host = engine.host
    with engine.locked():
        try:
            ledger = engine.ledger()
        except StateCorrupt:
            ledger = Ledger.open(host.state_dir, salvage=True)
            repair.kept += _move_aside(ledger.store.path, ledger.store.logs())
            ledger.store.gen = 0
        for env in names:
            try:
                journal = engine.journal(env)
            except StateCorrupt:
                journal = Journal.salvage(host.state_dir, env)
                repair.kept += _move_aside(journal.path, journal.store.logs())
                journal.store.gen = 0
            held = set(ledger.held_by(env))
            for entry in journal.entries:
                if entry.shared and entry.key not in held:
                    repair.lost.setdefault(env, []).append(entry.load().describe())
            for res in plans.get(env, ()):
                if journal.get(res.key) is not None or res.key in held:
                    continue
                try:
                    found = res.check(host).status is not Status.ABSENT
                except HostError:
                    found = False
                if not found:
                    continue
                if res.shared:
                    repair.lost.setdefault(env, []).append(res.describe())
                    continue
                # Found by name: treated as made by envctl, which is what --force asks for.
                journal.put(Entry(res.key, res.to_dict(), {}, "applied", False, host.boot_id))
                repair.found.setdefault(env, []).append(res.describe())
            journal.save(durable=True)
        ledger.save(durable=True)
        before = sync_cdi(host, leaving=names)
        outcomes = engine.down_many(names, locked=True)
        after = sync_cdi(host)
        return _purged(engine, _with_cdi_error(outcomes, before or after)), repair


def _move_aside(path: Path, logs: list[Path]) -> list[str]:
    """Keep damaged state files under new names no envctl reads."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    kept = []
    for p in [path, *logs]:
        if p.exists():
            dest = p.with_name(f"{p.name}.damaged-{stamp}")
            p.rename(dest)
            kept.append(str(dest))
    return kept


# ---------------------------------------------------------------- status


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


def _up_journal(host: Host, name: str) -> Journal | None:
    """The journal of an environment that is (partly) up; None when it has none, it is
    empty, or it cannot be read (`status` shows the damage through its steps)."""
    try:
        journal = Journal.open(host.state_dir, name, boot=host.boot_id)
    except StateCorrupt:
        return None
    return journal if journal.entries else None


def status_warnings(ws: Workspace | None, host: Host, names: list[str]) -> dict[str, list[str]]:
    """What the last `up` of each environment skipped or warned about. None for one that is
    not up: what `up` would warn about there is `plan`'s to say (once per command), not
    repeated by every `status`."""
    from envctl.engine import quarantine

    try:
        sick = quarantine.load(host.state_dir)
    except StateCorrupt as exc:
        sick, broken = quarantine.Quarantine(), str(exc)
    else:
        broken = ""
    out = {}
    for name in names:
        journal = _up_journal(host, name)
        out[name] = list(journal.meta.get("warnings", [])) if journal is not None else []
        if journal is None:
            continue
        uuids = (journal.claims or {}).get("gpus", {}).get("uuids", [])
        for gpu in dict.fromkeys(u for x in uuids if (u := sick.covering(x))):
            out[name].append(f"GPU {sick.gpus[gpu].get('index', '?')} ({gpu}) is quarantined: "
                             f"{sick.reason(gpu)}; its jobs fail until `envctl gpus --clear`")
        if broken and uuids:
            out[name].append(broken)
    return out


def status_isolation(ws: Workspace | None, host: Host, names: list[str]) -> dict[str, dict]:
    """Per environment: how its programs run ({"level": native|gvisor, "platform": …}), as
    its last `up` recorded it, else as its spec says."""
    out = {}
    for name in names:
        journal = _up_journal(host, name)
        if journal is not None:
            out[name] = journal.claims.get("isolation") or {"level": "native"}
        elif ws is not None and name in ws.names():
            runtime = ws.get(name).spec.runtime
            out[name] = {"level": runtime.isolation} if runtime.isolation == "native" else \
                {"level": runtime.isolation, "platform": runtime.gvisor.platform}
    return out


def status_descriptions(ws: Workspace | None, host: Host, names: list[str]) -> dict[str, str]:
    """Per environment: its spec's `description`, as its last `up` recorded it, else as its
    spec says now ("" for none)."""
    out = {}
    for name in names:
        journal = _up_journal(host, name)
        if journal is not None and "description" in journal.claims:
            out[name] = str(journal.claims["description"])
        elif ws is not None and name in ws.names():
            out[name] = ws.get(name).spec.description
    return out


def cgroup_usage(host: Host, rows: dict[str, list[Step]]) -> dict[str, dict]:
    """Per environment: the cgroup driver in use and, when its cgroup exists, its usage."""
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
