"""The specs of one config directory, validated together, planned against this host's facts.

Only the commands that read specs (validate, plan, up, status) load this module: `down` works
from the journal alone and never imports pydantic, YAML or the planner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from envctl.engine.engine import Engine
from envctl.engine.journal import Journal
from envctl.errors import Problem, SpecError, StateCorrupt, UsageError
from envctl.facts import HostFacts
from envctl.host.context import Host
from envctl.host.facts import gather
from envctl.host.idranges import host_id_ranges
from envctl.plan.access import access_names
from envctl.plan.builder import Plan, PlanError
from envctl.plan.claims import held_conflicts, spec_claims
from envctl.plan.gpus import assign_gpus
from envctl.plan.host import find_host_conflicts
from envctl.plan.planner import plan_env
from envctl.plan.rootfs import wants_rootfs
from envctl.plan.userns import assign_userns, wants_userns
from envctl.runtime.context import SYSTEM_CONFIG_DIR, config_dir  # noqa: F401 - re-exported
from envctl.spec.conflicts import find_conflicts
from envctl.spec.loader import LoadedSpec, read_each, spec_files, unsafe_spec_paths
from envctl.spec.models import EnvSpec, NearGpuCpus
from envctl.spec.resolve import assign_near_cpus


@dataclass
class Workspace:
    """The specs of one config directory, validated together, and the host they apply to."""

    directory: Path
    specs: list[LoadedSpec]
    facts: HostFacts
    host: Host
    # What the specs say that is valid but surprising (spec.surprises), file:line each.
    warnings: list[Problem] = dataclasses.field(default_factory=list)
    # The specs' problems, when opened with `collect` (the specs above are the valid ones).
    problems: list[Problem] = dataclasses.field(default_factory=list)

    @classmethod
    def open(cls, directory: Path, *, extra_files: list[Path] = (), host: Host | None = None,
             facts: HostFacts | None = None, pure: bool = False,
             secure: bool = False, collect: bool = False) -> Workspace:
        """Load and validate the specs of `directory` (and `extra_files`) together.

        `pure`: only what the specs say, the same on any machine (no host facts, no journals:
        `validate`). Otherwise conflicts are also checked against this host (memory, CPUs,
        governors) and against environments that are up here without a spec among these.
        `secure` (commands that change the host as root): refuse spec files and directories
        that anyone but root can write, since they choose sysctls and modules.
        `collect` (`validate --host`): keep the problems in `problems` rather than raise them,
        so that the valid specs are planned too and every problem comes in one run."""
        host = host or Host.from_env()
        files = spec_files(directory) if directory.is_dir() else []
        if not directory.is_dir() and not extra_files:
            raise UsageError(f"config directory {directory} does not exist (set --config-dir or "
                             "ENVCTL_CONFIG_DIR)")
        for f in extra_files:
            if f.resolve() not in {x.resolve() for x in files}:
                files.append(f)
        if secure:
            problems = unsafe_spec_paths([directory, *files] if directory.is_dir() else files)
            if problems:
                raise SpecError(problems)
        loaded = read_each(files)
        specs, problems, checked = loaded.specs, loaded.problems, loaded.checked
        if pure:
            facts = None
        elif facts is None:
            facts = _facts_for([ls.spec for ls in specs], host)
        # Conflicts are checked on what is valid of invalid specs too (LoadedSpec.partial):
        # every problem in one run.
        problems += find_conflicts(checked, facts)
        problems += find_host_conflicts(specs, facts)  # governors, module options
        if facts is not None:
            problems += held_conflicts(checked, _held(host, {ls.spec.name for ls in checked}),
                                       facts)
        if problems and not collect:
            raise SpecError(problems, warnings=tuple(loaded.warnings))
        return cls(directory, specs, facts or HostFacts(), host, loaded.warnings, problems)

    def with_host_facts(self) -> Workspace:
        """This workspace with this host's facts (one opened `pure` has none)."""
        facts = _facts_for([ls.spec for ls in self.specs], self.host)
        return Workspace(self.directory, self.specs, facts, self.host, self.warnings)

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
            plan = plan_env(ls.spec, self.facts)
        except PlanError as exc:
            raise SpecError([ls.problem(loc, msg) for loc, msg in exc.issues],
                            warnings=ls.warnings) from None
        # What the spec says that rarely means what it says, first, with its file and line.
        plan.warnings[:0] = [str(w) for w in ls.warnings]
        return plan

    def plan_each(self, selected: list[LoadedSpec]) -> tuple[list[Plan], dict[str, SpecError]]:
        """Plan every selected spec; those this host cannot serve (a required module missing,
        CPUs not online) are returned apart, with why, instead of stopping the others."""
        plans, skipped = [], {}
        for ls in selected:
            try:
                plans.append(self.plan(ls))
            except SpecError as exc:
                skipped[ls.spec.name] = exc
        return plans, skipped

    def claims(self, name: str) -> dict:
        """What environment `name` holds exclusively, for its journal (spec.claims)."""
        return spec_claims(self.get(name).spec, self.facts)

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


def _held(host: Host, specs: set[str]) -> dict[str, tuple[str, dict]]:
    """The claims of every environment that is up here and has no spec among `specs`."""
    out = {}
    for env in Journal.environments(host.state_dir):
        if env in specs:
            continue
        try:
            journal = Journal.open(host.state_dir, env, boot=host.boot_id)
        except (StateCorrupt, UsageError):
            continue  # `status` reports a damaged journal; its claims cannot be known
        if journal.entries and journal.claims:
            out[env] = (str(journal.path), journal.claims)
    return out


def _facts_for(specs: list[EnvSpec], host: Host) -> HostFacts:
    """Host facts, reading the optional ones (sysctls, modules, cpufreq, rootfs closures,
    GPUs) only as specs ask, with the GPUs each spec gets resolved for all of them together."""
    sysctls = {name for s in specs for name in s.host.sysctls}
    modules = {m.name for s in specs for m in s.host.modules}
    rootfs = {s.name: (tuple(s.rootfs.binaries), tuple(s.rootfs.libraries), s.rootfs.python)
              for s in specs if wants_rootfs(s)}
    gpus = [s for s in specs if s.gpus.wanted]
    facts = gather(proc_root=host.proc, sys_root=host.sys, sysctls=frozenset(sysctls),
                   modules=frozenset(modules), kmod=host.kmod if modules else None,
                   cpufreq=any(s.host.governor for s in specs), rootfs=rootfs,
                   gpu_root=host.gpu_root if gpus else None,
                   groups=frozenset({s.gpus.group for s in gpus}
                                    | {g for s in specs for g in access_names(s, "groups")}),
                   users=frozenset(u for s in specs for u in access_names(s, "users")),
                   state_dir=host.state_dir,
                   runsc=any(s.runtime.isolation == "gvisor" for s in specs),
                   operator_paths={s.name: _operator_paths(s) for s in specs if wants_rootfs(s)})
    if any(wants_userns(s) for s in specs):
        held = _userns_held(host)
        facts = dataclasses.replace(facts, host_ids=host_id_ranges(), userns_held=held)
        facts = _assign_userns(specs, facts, held)
    if not gpus:
        return facts
    facts = dataclasses.replace(facts, gpu_held=_gpus_held(host))
    facts = _with_quarantine(facts, host)
    assigned, refused = assign_gpus(gpus, facts)
    facts = dataclasses.replace(facts, gpu_assigned=assigned, gpu_refused=refused)
    if not any(isinstance(s.resources.cpu.dedicated, NearGpuCpus) for s in specs):
        return facts
    # CPUs near the GPUs, once the GPUs are known, around what every environment that is up
    # dedicates (its own included: it keeps them).
    held = {env: claims.get("cpus", []) for env, claims in _up_claims(host)}
    near, why = assign_near_cpus(specs, facts, held)
    return dataclasses.replace(facts, cpu_assigned=near, cpu_refused=why)


FINDINGS_KEY = "gpu.findings"  # facts.extra: what the health probe found now (for `up`)


def _with_quarantine(facts: HostFacts, host: Host) -> HostFacts:
    """`facts` with the GPUs the quarantine ledger holds and those a health probe finds unfit
    now (read-only: `up` records the new findings, see app.quarantine_findings)."""
    from envctl.engine import quarantine
    from envctl.host.gpuhealth import probe

    ledger = quarantine.load(host.state_dir)
    findings, _ = probe(host.gpu_root, facts.gpu)
    findings = ledger.fresh(findings, host.boot_id)
    sick = ledger.reasons()
    for f in findings:
        if f.uuid:
            sick[f.uuid] = "; ".join(x for x in (sick.get(f.uuid, ""), f.detail) if x)
    facts.extra[FINDINGS_KEY] = findings
    return dataclasses.replace(facts, gpu_quarantined=sick)


def _operator_paths(spec: EnvSpec) -> list[tuple[tuple, str]]:
    """The host paths a spec names that envctl opens, binds or creates as root, with their
    locations in the spec: each must be reached through root-controlled directories only."""
    paths: list[tuple[tuple, str]] = [(("mounts", i, "source"), m.source)
                                      for i, m in enumerate(spec.mounts)
                                      if m.source.startswith("/")]
    paths += [(("rootfs", "files", i, "source"), f.source)
              for i, f in enumerate(spec.rootfs.files) if f.source]
    if spec.rootfs.path:
        paths.append((("rootfs", "path"), spec.rootfs.path))
    if spec.gpus.wanted and spec.gpus.toolkit:
        paths.append((("gpus", "toolkit"), spec.gpus.toolkit))
    return paths


def _assign_userns(specs: list[EnvSpec], facts: HostFacts, held: dict[str, int]) -> HostFacts:
    """The user namespace blocks, allocated (plan.userns) and then checked against the name
    service for the id each environment's root would be (only that id is mapped today): one a
    directory user or group holds moves the block on, as a local one does."""
    from envctl.host.idranges import nss_holder

    for _ in range(8):
        assigned, refused = assign_userns(specs, facts)
        found = {env: (base, base + 1, who) for env, base in assigned.items()
                 if held.get(env) != base and (who := nss_holder(base))}
        if not found:
            break
        facts = dataclasses.replace(facts, host_ids=tuple(sorted(
            (*facts.host_ids, *found.values()))))
    else:  # still one the name service holds after as many tries: refused, never used
        for env, (base, _, who) in found.items():
            del assigned[env]
            refused[env] = (f"user namespace host id {base} and the blocks after it are held "
                            f"({who}, …)")
    return dataclasses.replace(facts, userns_assigned=assigned, userns_refused=refused)


def _up_claims(host: Host) -> Iterator[tuple[str, dict]]:
    """(environment, its recorded claims) of every environment that is up here (its journal
    has entries of this boot); damaged journals are skipped (`status` reports them)."""
    for env in Journal.environments(host.state_dir):
        try:
            journal = Journal.open(host.state_dir, env, boot=host.boot_id)
        except (StateCorrupt, UsageError):
            continue
        if journal.entries:
            yield env, journal.claims or {}


def _userns_held(host: Host) -> dict[str, int]:
    """Environment that is up -> the first host id of its user namespace block (its claims)."""
    held = {}
    for env, claims in _up_claims(host):
        base = (claims.get("userns") or {}).get("base")
        if isinstance(base, int):
            held[env] = base
    return held


def _gpus_held(host: Host) -> dict[str, str]:
    """GPU UUID -> the environment that is up and holds it, from every journal's claims."""
    return {uuid: env for env, claims in _up_claims(host)
            for uuid in claims.get("gpus", {}).get("uuids", [])}
