"""Planning the environment's own directories and host-relative values (CPUs, memory)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envctl.plan.builder import Plan
from envctl.plan.limits import PAGE
from envctl.resources.dirs import BaseDirectory, Directory
from envctl.spec.models import NEAR_GPUS, NearGpuCpus
from envctl.spec.resolve import dedicated_cpus, memory_nodes, placement_lines
from envctl.spec.units import format_cpu_list, format_size

if TYPE_CHECKING:
    from envctl.facts import HostFacts
    from envctl.spec.models import EnvSpec


def plan_dirs(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    plan.add(Directory("state", f"envs/{spec.name}", 0o755))
    # The run base (/run/envctl) is every environment's: a shared step, so whichever goes
    # down last removes it if envctl made it. (The state base is the global lock's to tidy.)
    plan.add(BaseDirectory("run"))
    plan.add(Directory("run", spec.name, 0o755))
    _resolve(spec, facts, plan)


def _resolve(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    """Resolve host-relative values now so that `plan` shows them and bad ones fail early."""
    try:
        placement = dedicated_cpus(spec, facts)
    except ValueError as exc:
        plan.error(("resources", "cpu", "dedicated"), str(exc))
    else:
        if placement.note:
            plan.warn(placement.note)
        cpus = placement.effective(facts)
        plan.resolved["cpus"] = format_cpu_list(cpus)
        plan.resolved["dedicated"] = bool(placement.cpus)
        plan.resolved["threads"] = len(cpus)
        cpu = spec.resources.cpu
        if cpu.percent is not None and cpu.percent >= 100 * len(cpus):
            limit = (f"cpu quota {cpu.quota:g}%" if cpu.quota is not None
                     else f"cpus {cpu.cpus:g} (quota {cpu.percent:g}%)")
            plan.warn(f"{limit} is at least the {len(cpus)} CPU(s) the environment runs on, "
                      "so it never throttles")
    mem = spec.resources.memory
    for name in ("max", "high", "swap_max"):
        q = getattr(mem, name)
        if q is not None:
            plan.resolved[f"memory.{name}"] = q.resolve(facts.memory_bytes)
            if name != "swap_max" and plan.resolved[f"memory.{name}"] < PAGE:
                # A share of this host's memory that is not one page: a limit of 0.
                plan.error(("resources", "memory", name), (
                    f"memory.{name} {q} of this host's {format_size(facts.memory_bytes)} is "
                    "below one 4K page; give a larger share or a size like 512M"))
    mx, hi = plan.resolved.get("memory.max"), plan.resolved.get("memory.high")
    if mx is not None and hi is not None and hi > mx:
        plan.error(("resources", "memory", "high"), "memory.high resolves above memory.max on "
                   "this host")
    try:
        nodes = memory_nodes(spec, facts)
    except ValueError as exc:
        plan.error(("resources", "memory", "nodes"), str(exc))
        nodes = None
    if nodes is not None:
        missing = [n for n in nodes if n not in facts.numa_nodes]
        if missing:
            plan.error(("resources", "memory", "nodes"),
                       f"memory nodes {format_cpu_list(missing)} are not online (online: "
                       f"{format_cpu_list(facts.numa_nodes)})"
                       + (" (the NUMA nodes of the environment's GPUs)"
                          if mem.nodes == NEAR_GPUS else ""))
        if mem.nodes == NEAR_GPUS:
            plan.resolved["numa_nodes"] = format_cpu_list(nodes) if nodes else "all"
    if (isinstance(spec.resources.cpu.dedicated, NearGpuCpus) or mem.nodes == NEAR_GPUS) \
            and "cpus" in plan.resolved:
        # Where the environment sits: each GPU with its node and the CPUs near it.
        cpus = dedicated_cpus(spec, facts).effective(facts)
        plan.resolved["placement"] = placement_lines(spec, facts, cpus)
