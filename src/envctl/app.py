"""What the CLI commands do, without rendering: find specs, plan them, drive the engine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from envctl.engine.engine import Engine, Outcome, Step
from envctl.engine.journal import Journal, Ledger
from envctl.errors import NeedsRootError, SpecError, UsageError
from envctl.host.context import Host
from envctl.host.facts import HostFacts, gather
from envctl.host.files import read_json, write_json
from envctl.plan.builder import Plan, PlanError
from envctl.plan.host import find_host_conflicts
from envctl.plan.planner import plan_env
from envctl.spec.conflicts import find_conflicts
from envctl.spec.loader import LoadedSpec, load_each, spec_files
from envctl.spec.models import EnvSpec

SYSTEM_CONFIG_DIR = Path("/etc/envctl/environments")


def config_dir(explicit: str | None) -> Path:
    """--config-dir, else $ENVCTL_CONFIG_DIR, else /etc/envctl/environments, else ./configs."""
    if explicit:
        return Path(explicit)
    if os.environ.get("ENVCTL_CONFIG_DIR"):
        return Path(os.environ["ENVCTL_CONFIG_DIR"])
    if SYSTEM_CONFIG_DIR.is_dir() or not Path("configs").is_dir():
        return SYSTEM_CONFIG_DIR
    return Path("configs")


def require_root(action: str) -> None:
    if os.geteuid() != 0:
        raise NeedsRootError(f"envctl {action} changes the host and needs root: run it with sudo")


@dataclass
class Workspace:
    """The specs of one config directory, validated together, and the host they apply to."""

    directory: Path
    specs: list[LoadedSpec]
    facts: HostFacts
    host: Host

    @classmethod
    def open(cls, directory: Path, *, extra_files: list[Path] = (), host: Host | None = None,
             facts: HostFacts | None = None) -> Workspace:
        host = host or Host.from_env()
        files = spec_files(directory) if directory.is_dir() else []
        if not directory.is_dir() and not extra_files:
            raise UsageError(f"config directory {directory} does not exist (set --config-dir or "
                             "ENVCTL_CONFIG_DIR)")
        for f in extra_files:
            if f.resolve() not in {x.resolve() for x in files}:
                files.append(f)
        specs, problems = load_each(files)
        if facts is None:
            facts = _facts_for([ls.spec for ls in specs], host)
        problems += find_conflicts(specs, facts)
        problems += find_host_conflicts(specs, facts)  # governors, module options
        if problems:
            raise SpecError(problems)
        return cls(directory, specs, facts, host)

    def names(self) -> list[str]:
        return [ls.spec.name for ls in self.specs]

    def get(self, name: str) -> LoadedSpec:
        for ls in self.specs:
            if ls.spec.name == name:
                return ls
        known = ", ".join(self.names()) or "none"
        raise UsageError(f"no environment '{name}' in {self.directory} (known: {known})")

    def select(self, names: list[str], *, all_: bool) -> list[LoadedSpec]:
        if all_ and names:
            raise UsageError("give environment names or --all, not both")
        if all_:
            return list(self.specs)
        if not names:
            raise UsageError("name at least one environment, or use --all")
        return [self.get(n) for n in names]

    def plan(self, ls: LoadedSpec) -> Plan:
        try:
            return plan_env(ls.spec, self.facts)
        except PlanError as exc:
            raise SpecError([ls.problem(loc, msg) for loc, msg in exc.issues]) from None

    def plan_all(self, selected: list[LoadedSpec]) -> list[Plan]:
        """Plan every selected spec first, so bad input is refused before any host change."""
        plans, problems = [], []
        for ls in selected:
            try:
                plans.append(self.plan(ls))
            except SpecError as exc:
                problems.extend(exc.problems)
        if problems:
            raise SpecError(problems)
        return plans

    def engine(self, **kwargs) -> Engine:
        return Engine(self.host, **kwargs)


def _facts_for(specs: list[EnvSpec], host: Host) -> HostFacts:
    """Host facts, reading the optional ones (sysctls, modules, cpufreq) only as specs ask."""
    sysctls = {name for s in specs for name in s.host.sysctls}
    modules = {m.name for s in specs for m in s.host.modules}
    return gather(proc_root=host.proc, sys_root=host.sys, sysctls=frozenset(sysctls),
                  modules=frozenset(modules), kmod=host.kmod if modules else None,
                  cpufreq=any(s.host.governor for s in specs))


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
        return [engine.down(n, locked=True) for n in names]


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
        annotate_restores(host, name, out[name])
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


def annotate_restores(host: Host, env: str, steps: list[Step]) -> None:
    """Say, on each host setting envctl holds, what it found and will restore at `down`."""
    ledger = Ledger.open(host.state_dir)
    for step in steps:
        item = ledger.get(step.resource.key) if step.resource.shared else None
        if item is None or env not in item["holders"]:
            continue
        memo = item["memo"]
        restores = getattr(step.resource, "restores", None)
        if restores is not None:
            text = restores(memo)
        elif memo.get("old") is not None:
            text = f"found {memo['old']}: restored at down"  # a sysctl
        else:
            continue
        others = [h for h in item["holders"] if h != env]
        if others:
            text += f" (held with {', '.join(others)}: when the last of them goes)"
        step.note = "; ".join(x for x in (step.note, text) if x)


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
