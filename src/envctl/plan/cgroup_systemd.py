"""Planning the environment's slice for the systemd cgroup driver: the spec's limits as systemd
unit properties (CPUQuota, MemoryMax, …), checked against what systemd can set on this host."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envctl.plan.builder import Plan
from envctl.plan.limits import (
    DEFAULT_DEVICES,
    GPU_DEVICES_KEY,
    NO_IO_WEIGHT,
    need,
    page,
    quota_micros,
)
from envctl.resources.cgroup_systemd import SystemdCharLink, SystemdParentSlice, SystemdSlice
from envctl.spec.resolve import dedicated_cpus, memory_nodes
from envctl.spec.units import format_cpu_list, format_size

if TYPE_CHECKING:
    from envctl.facts import HostFacts
    from envctl.spec.models import EnvSpec

# systemd sets these only on the unified (v2) hierarchy; on v1 it would ignore them silently.
V2_ONLY = "systemd sets {what} only on the unified (v2) cgroup hierarchy, and this host drives " \
          "cgroup v1; remove it, or use resources.driver: cgroupfs"


def plan_systemd(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    cg = facts.cgroup
    if not cg.systemd:
        plan.error(("resources", "driver"), "the systemd cgroup driver needs systemd as PID 1, "
                   "and PID 1 here is not systemd; use driver: cgroupfs (or auto)")
        return
    props = properties(spec, facts, plan)
    if props is None:
        return
    rules = DEFAULT_DEVICES + tuple(plan.resolved.get(GPU_DEVICES_KEY, ()))
    # The parent is recorded in each resource: `down` uses it, not ENVCTL_CGROUP_PARENT then.
    plan.add(SystemdParentSlice(cg.version, cg.parent), ("resources",))
    # Before the slice: systemd resolves its DeviceAllow= paths when it loads the unit.
    for major, minor in char_nodes(rules):
        plan.add(SystemdCharLink(major, minor), ("resources",))
    plan.add(SystemdSlice(spec.name, cg.version, tuple(props), rules, cg.parent),
             ("resources",))


def char_nodes(rules: tuple[str, ...]) -> list[tuple[int, int]]:
    """(major, minor) of each single character device the rules allow ("c 195:0 rw"), once
    each, in order; whole majors ("c 136:* rwm") and block devices have no /dev/char link."""
    out: list[tuple[int, int]] = []
    for rule in rules:
        kind, numbers, _ = rule.split()
        major, minor = numbers.split(":")
        if kind == "c" and major.isdigit() and minor != "*" and \
                (int(major), int(minor)) not in out:
            out.append((int(major), int(minor)))
    return out


def properties(spec: EnvSpec, facts: HostFacts, plan: Plan) -> list[tuple[str, str]] | None:
    """(setting, value) for the slice's unit file. Every limit systemd can set here is
    written, defaults included, so that one dropped from the spec is reset by the next `up`."""
    cg, res, v1 = facts.cgroup, spec.resources, facts.cgroup.version == 1
    ok = True
    loc_cpu, loc_mem = ("resources", "cpu"), ("resources", "memory")
    # Accounting makes systemd realise the slice in every controller, so stats can read it.
    out = [("CPUAccounting", "yes"), ("MemoryAccounting", "yes"), ("TasksAccounting", "yes")]

    # -- cpu: quota (percent of one CPU, as systemd's CPUQuota) and period, weight
    cpu = res.cpu
    if cpu.percent is not None and quota_micros(cpu, plan) is None:
        ok = False
    if (cpu.percent is not None or cpu.weight is not None) and not need(
            cg, "cpu", loc_cpu, "a CPU quota or weight", plan):
        ok = False
    if "cpu" in cg.controllers:
        # systemd keeps the quota in 1/100 percent: two decimals are exact.
        quota = f"{round(cpu.percent, 2):g}%" if cpu.percent is not None else ""
        out += [("CPUQuota", quota), ("CPUQuotaPeriodSec", f"{cpu.period_us}us"),
                ("CPUWeight", str(cpu.weight or 100))]

    # -- cpuset: dedicated CPUs and memory nodes (validated in plan/base.py)
    try:
        placement = dedicated_cpus(spec, facts).cpus
    except ValueError:
        placement, ok = (), False  # reported by the base section
    try:
        nodes = memory_nodes(spec, facts)
    except ValueError:
        nodes, ok = None, False  # reported by the base section
    if placement or nodes:
        if v1:
            plan.error(loc_cpu + ("dedicated",), V2_ONLY.format(
                what="AllowedCPUs/AllowedMemoryNodes (dedicated CPUs, memory nodes)"))
            ok = False
        elif not need(cg, "cpuset", loc_cpu + ("dedicated",),
                       "dedicated CPUs or memory nodes", plan):
            ok = False
    if "cpuset" in cg.controllers and not v1:
        out += [("AllowedCPUs", format_cpu_list(placement)),
                ("AllowedMemoryNodes", format_cpu_list(nodes) if nodes else "")]

    # -- memory: max, high, swap
    mem = res.memory
    total = facts.memory_bytes
    mx = page(mem.max.resolve(total)) if mem.max else None
    hi = page(mem.high.resolve(total)) if mem.high else None
    sw = page(mem.swap_max.resolve(total)) if mem.swap_max else None
    if any(x is not None for x in (mx, hi, sw)) and not need(cg, "memory", loc_mem,
                                                              "a memory limit", plan):
        ok = False
    if mx is not None and hi is not None and hi > mx:
        plan.error(loc_mem + ("high",), f"memory.high ({format_size(hi)}) is above memory.max "
                   f"({format_size(mx)})")
        ok = False
    if v1 and hi is not None:
        plan.error(loc_mem + ("high",), V2_ONLY.format(what="MemoryHigh (memory.high)"))
        ok = False
    if sw is not None and (v1 or not cg.swap):
        plan.error(loc_mem + ("swap_max",), V2_ONLY.format(what="MemorySwapMax (swap_max)")
                   if v1 else "this host does not account swap per cgroup; remove swap_max")
        ok = False
    if "memory" in cg.controllers:
        out.append(("MemoryMax", str(mx) if mx is not None else "infinity"))
        if not v1:
            out.append(("MemoryHigh", str(hi) if hi is not None else "infinity"))
            if cg.swap:
                out.append(("MemorySwapMax", str(sw) if sw is not None else "infinity"))

    # -- io weight (systemd converts it to blkio.weight / bfq weights itself)
    weight = res.io.weight
    if weight is not None:
        if not need(cg, "blkio" if v1 else "io", ("resources", "io", "weight"),
                     "an IO weight", plan):
            ok = False
        elif not cg.io_weight:
            plan.warn(NO_IO_WEIGHT.format(weight=weight))
        elif cg.io_weight.endswith("bfq.weight") and not cg.bfq_devices:
            plan.warn(f"io.weight {weight} becomes a bfq weight, which acts only on block "
                      "devices using the bfq scheduler, and none does here")
    if cg.io_weight:
        out += [("IOAccounting", "yes"), ("IOWeight", str(weight or 100))]

    # -- pids
    if res.pids.max is not None and not need(cg, "pids", ("resources", "pids", "max"),
                                              "a pids limit", plan):
        ok = False
    if "pids" in cg.controllers:
        out.append(("TasksMax", str(res.pids.max) if res.pids.max else "infinity"))

    # -- devices: v1 through the devices controller; v2 systemd's own BPF program
    if v1 and not need(cg, "devices", ("resources",), "the device allow-list", plan):
        ok = False
    return out if ok else None
