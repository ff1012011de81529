"""The specs of one config directory, validated together, planned against this host's facts.

Only the commands that read specs (validate, plan, up, status) load this module: `down` works
from the journal alone and never imports pydantic, YAML or the planner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from envctl.engine.engine import Engine
from envctl.errors import SpecError, UsageError
from envctl.facts import HostFacts
from envctl.host.context import Host
from envctl.host.facts import gather
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
