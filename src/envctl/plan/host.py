"""Planning host tuning: sysctls, kernel modules and the CPU frequency governor.

Each item the host cannot honour is decided here, before any change, by its policy:
`required` makes the plan fail naming what is missing, `best-effort` skips it with a warning
(shown by `plan` and `up`, recorded for `status`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from envctl.facts import ModuleFact
from envctl.plan.builder import Loc, Plan
from envctl.resources.governor import CpuGovernor
from envctl.resources.kmod import KernelModule
from envctl.resources.sysctl import Sysctl
from envctl.spec.resolve import dedicated_cpus
from envctl.spec.sysctls import canonical
from envctl.spec.units import format_cpu_list

if TYPE_CHECKING:
    from envctl.errors import Problem
    from envctl.facts import HostFacts
    from envctl.spec.loader import LoadedSpec
    from envctl.spec.models import EnvSpec, Module

# Words in best-effort warnings, so `status` can list what `up` skipped.
SKIPPED = "skipped (policy: best-effort)"


def plan_host(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    _plan_sysctls(spec, facts, plan)
    _plan_modules(spec, facts, plan)
    _plan_governor(spec, facts, plan)


def _missing(plan: Plan, policy: str, loc: Loc, msg: str) -> None:
    """The host lacks something the spec asks for: an error or a warning, as the spec says."""
    if policy == "required":
        plan.error(loc, f"{msg} (policy: required)")
    else:
        plan.warn(f"{msg}; {SKIPPED}")


def _plan_sysctls(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    for name, item in spec.host.sysctls.items():
        if name not in facts.sysctls and canonical(name) not in facts.sysctls:
            _missing(plan, item.policy, ("host", "sysctls", name),
                     f"this kernel ({facts.kernel}) has no sysctl {name}")
            continue
        # Canonical: two spellings of one value (in this spec or another) are one resource,
        # so one memo is taken and restored once; differing values are a plan error here.
        plan.add(Sysctl(canonical(name), item.value), ("host", "sysctls", name))


def module_name(name: str) -> str:
    return name.replace("-", "_")


def module_options(mod: Module) -> tuple[str, ...]:
    # Sorted: two environments asking for the same options get the same resource.
    return tuple(f"{k}={v}" for k, v in sorted(mod.options.items()))


def _plan_modules(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    listed = {module_name(m.name): m for m in spec.host.modules}
    # Every module to load, by name, in the order of the first chain that needs it.
    chain: dict[str, tuple[KernelModule, Loc]] = {}

    def need(name: str, fact: ModuleFact, loc: Loc) -> None:
        spec_mod = listed.get(name)
        res = KernelModule(name, module_options(spec_mod) if spec_mod else (),
                           alone=bool(fact.soft), soft=name in fact.soft and spec_mod is None)
        if name in chain:
            # One module in two chains: loaded alone if either loads it so (that chain has
            # its softdeps as resources), soft only if soft in both.
            old = chain[name][0]
            res = replace(old, alone=old.alone or res.alone, soft=old.soft and res.soft)
        chain[name] = (res, chain[name][1] if name in chain else loc)

    for i, mod in enumerate(spec.host.modules):
        name = module_name(mod.name)
        loc: Loc = ("host", "modules", i)
        fact = facts.modules.get(name, ModuleFact("missing", reason="not looked up on this host"))
        if fact.state == "missing":
            _missing(plan, mod.policy, loc,
                     f"kernel module {mod.name} is not available on kernel {facts.kernel}: "
                     f"{fact.reason}")
            continue
        if fact.state in ("loaded", "builtin") and mod.options:
            how = "loaded" if fact.state == "loaded" else "built into the kernel"
            plan.warn(f"kernel module {mod.name} is already {how}: its options "
                      f"({' '.join(module_options(mod))}) are not applied")
        if fact.note:
            plan.warn(f"kernel module {mod.name}: {fact.note}")
        # What modprobe loads with it are resources of their own, in modprobe's order: its
        # dependencies and `pre:` softdeps before it, `post:` softdeps after it. Teardown (the
        # reverse) unloads each only when envctl loaded it and nothing (another environment
        # included) holds it.
        for dep in fact.deps:
            need(dep, fact, loc)
        need(name, fact, loc)
        for dep in fact.post:
            need(dep, fact, loc)
    for res, loc in chain.values():
        plan.add(res, loc)


def governor_cpus(spec: EnvSpec, facts: HostFacts) -> tuple[int, ...]:
    """The CPUs whose governor the spec sets: all online, or those the environment runs on."""
    gov = spec.host.governor
    if gov is None:
        return ()
    if gov.cpus == "all":
        return facts.cpus
    try:
        return dedicated_cpus(spec, facts).effective(facts)
    except ValueError:
        return ()  # the dedicated-CPU error is reported by the base section


def _plan_governor(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    gov = spec.host.governor
    if gov is None:
        return
    loc: Loc = ("host", "governor")
    cpus = governor_cpus(spec, facts)
    no_freq = [c for c in cpus if c not in facts.cpufreq]
    # An empty list means the driver does not say; the write is checked at apply.
    lacking = [c for c in cpus if facts.cpufreq.get(c) and gov.name not in facts.cpufreq[c]]
    if no_freq:
        where = "this host has" if len(no_freq) == len(cpus) else \
            f"cpu {format_cpu_list(no_freq)} of this host have"
        _missing(plan, gov.policy, loc,
                 f"{where} no cpufreq (no cpufreq/scaling_governor under "
                 f"/sys/devices/system/cpu/cpuN): governor {gov.name} cannot be set")
    if lacking:
        offered = " ".join(facts.cpufreq[lacking[0]])
        _missing(plan, gov.policy, loc + ("name",),
                 f"governor {gov.name} is not offered by cpu {format_cpu_list(lacking)} "
                 f"(scaling_available_governors: {offered})")
    # One resource per cpufreq policy: the kernel has one governor for all its CPUs.
    usable = [c for c in cpus if c not in no_freq and c not in lacking]
    policies: dict[int, tuple[int, ...]] = {}
    for cpu in usable:
        number, members = cpufreq_policy(cpu, facts)
        policies.setdefault(number, members)
    for number, members in policies.items():
        # A policy reaching past the environment's CPUs changes the others' governor too.
        others = [c for c in members if c not in cpus and c in facts.cpus]
        if others:
            plan.warn(f"governor {gov.name} on cpu "
                      f"{format_cpu_list([c for c in members if c in cpus])} also applies to "
                      f"cpu {format_cpu_list(others)}: they share cpufreq policy{number}, "
                      "which has one governor")
        plan.add(CpuGovernor(number, members, gov.name), loc)


def cpufreq_policy(cpu: int, facts: HostFacts) -> tuple[int, tuple[int, ...]]:
    """The cpufreq policy of `cpu` (its number and CPUs); a CPU in none is its own."""
    for number, members in facts.cpufreq_policies.items():
        if cpu in members:
            return number, members
    return cpu, (cpu,)


def find_host_conflicts(specs: list[LoadedSpec], facts: HostFacts | None) -> list[Problem]:
    """Host tuning two environments want differently: a governor on a cpufreq policy both
    set (on one CPU, or on two CPUs of one policy), or one module with different options.
    (Differing sysctl values are found in spec.conflicts.) Without `facts` (`validate`, the
    same on any machine) governors are compared only where the specs alone decide: all CPUs,
    or listed dedicated CPUs."""
    problems: list[Problem] = []
    governors: dict[int, tuple[LoadedSpec, str, int]] = {}
    modules: dict[str, tuple[LoadedSpec, tuple[str, ...]]] = {}
    if facts is None:
        problems += _pure_governor_conflicts(specs)
    for ls in specs:
        gov = ls.spec.host.governor
        for cpu in governor_cpus(ls.spec, facts) if gov and facts is not None else ():
            number, members = cpufreq_policy(cpu, facts)
            first = governors.setdefault(number, (ls, gov.name, cpu))
            if first[1] != gov.name:
                why = "one cpu has one governor" if first[2] == cpu else \
                    f"cpu {format_cpu_list(members)} share cpufreq policy{number}, which " \
                    "has one governor"
                problems.append(ls.problem(
                    ("host", "governor", "name"),
                    f"wants governor {gov.name} on cpu {cpu} but environment "
                    f"'{first[0].spec.name}' ({first[0].path}) wants {first[1]} on cpu "
                    f"{first[2]}; {why}"))
                break
        for i, mod in enumerate(ls.spec.host.modules):
            opts = module_options(mod)
            first_mod = modules.setdefault(module_name(mod.name), (ls, opts))
            if first_mod[1] != opts:
                problems.append(ls.problem(
                    ("host", "modules", i, "options"),
                    f"loads {mod.name} with options '{' '.join(opts)}' but environment "
                    f"'{first_mod[0].spec.name}' ({first_mod[0].path}) uses "
                    f"'{' '.join(first_mod[1])}'; a module is loaded once for all"))
    return problems


def _pure_governor_conflicts(specs: list[LoadedSpec]) -> list[Problem]:
    """Governor conflicts the specs decide without a host: `cpus: all` meets every other
    environment's governor; listed dedicated CPUs meet where the lists overlap. (CPUs reserved
    by count, and cpufreq policies, depend on the host: `validate --host` checks those.)"""
    problems: list[Problem] = []
    seen: list[tuple[LoadedSpec, str, set[int] | None]] = []  # None: every CPU
    for ls in specs:
        gov = ls.spec.host.governor
        if gov is None:
            continue
        ded = ls.spec.resources.cpu.dedicated
        if gov.cpus == "all":
            cpus: set[int] | None = None
        elif isinstance(ded, tuple):
            cpus = set(ded)
        else:
            continue
        for other, name, theirs in seen:
            both = None if cpus is None and theirs is None else \
                (cpus if theirs is None else theirs if cpus is None else cpus & theirs)
            if name != gov.name and (both is None or both):
                where = "every cpu" if both is None else f"cpu {format_cpu_list(sorted(both))}"
                problems.append(ls.problem(
                    ("host", "governor", "name"),
                    f"wants governor {gov.name} on {where} but environment "
                    f"'{other.spec.name}' ({other.path}) wants {name} there; one cpu has one "
                    "governor"))
                break
        seen.append((ls, gov.name, cpus))
    return problems
