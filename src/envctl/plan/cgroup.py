"""Planning the environment's cgroup: driver, limits mapped to this host's cgroup version, and
its device allow-list. Values the host cannot honour are plan errors, never silent skips."""

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
from envctl.resources.cgroup import Cgroup, CgroupDevices, CgroupParent
from envctl.spec.resolve import dedicated_cpus, memory_nodes
from envctl.spec.units import format_cpu_list, format_size

if TYPE_CHECKING:
    from envctl.facts import HostFacts
    from envctl.spec.models import EnvSpec

CGROUP_WEIGHT_DEFAULT, CGROUP_WEIGHT_MAX = 100, 10_000


def cpu_shares(weight: int) -> int:
    """v2 cpu.weight (1..10000, default 100) -> v1 cpu.shares (2..262144, default 1024)."""
    return max(2, min(262_144, weight * 1024 // CGROUP_WEIGHT_DEFAULT))


def blkio_weight(weight: int) -> int:
    """io.weight -> v1 blkio.weight (CFQ, 10..1000, default 500), as systemd converts it."""
    return max(10, min(1000, weight * 500 // CGROUP_WEIGHT_DEFAULT))


def bfq_weight(weight: int) -> int:
    """io.weight -> bfq weight (1..1000, default 100), as systemd converts it."""
    if weight <= CGROUP_WEIGHT_DEFAULT:
        return 100 - (CGROUP_WEIGHT_DEFAULT - weight) * 99 // (CGROUP_WEIGHT_DEFAULT - 1)
    return 100 + (weight - CGROUP_WEIGHT_DEFAULT) * 900 // (CGROUP_WEIGHT_MAX -
                                                             CGROUP_WEIGHT_DEFAULT)


def plan_cgroup(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    cg = facts.cgroup
    res = spec.resources
    driver = res.driver
    if driver == "auto":
        # ENVCTL_CGROUP_DRIVER (read into the facts) says what `auto` means on this host.
        driver = cg.default_driver or ("systemd" if cg.systemd else "cgroupfs")
    plan.resolved["cgroup.driver"] = driver
    plan.resolved["cgroup.layout"] = cg.layout
    if driver not in ("cgroupfs", "systemd"):
        plan.error(("resources", "driver"), f"ENVCTL_CGROUP_DRIVER={driver!r} is not a cgroup "
                   "driver; use cgroupfs or systemd")
        return
    if cg.version not in (1, 2):
        plan.error(("resources",), f"this host has no usable cgroup hierarchy (layout: "
                   f"{cg.layout}); mount cgroup2 on /sys/fs/cgroup or the v1 controllers")
        return
    if driver == "systemd":
        # Imported here: a cgroupfs host never loads the systemd driver's code (start-up time).
        from envctl.plan.cgroup_systemd import plan_systemd

        plan_systemd(spec, facts, plan)
        return
    settings = _settings(spec, facts, plan)
    if settings is None:
        return
    # The parent is recorded in each resource: `down` uses it, not ENVCTL_CGROUP_PARENT then.
    plan.add(CgroupParent(cg.version, cg.controllers, cg.parent), ("resources",))
    plan.add(Cgroup(spec.name, cg.version, cg.controllers, tuple(settings), cg.parent),
             ("resources",))
    rules = DEFAULT_DEVICES + tuple(plan.resolved.get(GPU_DEVICES_KEY, ()))
    plan.add(CgroupDevices(spec.name, cg.version, rules, cg.parent), ("resources",))



def _settings(spec: EnvSpec, facts: HostFacts, plan: Plan) -> list[tuple[str, str, str]] | None:
    """(controller, file, value) for every limit the controllers hold, defaults included so
    that a limit dropped from the spec is reset by the next `up`."""
    cg, res, v1 = facts.cgroup, spec.resources, facts.cgroup.version == 1
    ok = True
    out: list[tuple[str, str, str]] = []
    loc_cpu, loc_mem = ("resources", "cpu"), ("resources", "memory")

    # -- cpu: quota and period, weight
    cpu = res.cpu
    quota_us = quota_micros(cpu, plan)
    if cpu.percent is not None and quota_us is None:
        ok = False
    wants_cpu = cpu.percent is not None or cpu.weight is not None
    if wants_cpu and not need(cg, "cpu", loc_cpu, "a CPU quota or weight", plan):
        ok = False
    if "cpu" in cg.controllers:
        if v1:
            out += [("cpu", "cpu.cfs_period_us", str(cpu.period_us)),
                    ("cpu", "cpu.cfs_quota_us", str(quota_us) if quota_us else "-1"),
                    ("cpu", "cpu.shares", str(cpu_shares(cpu.weight or 100)))]
        else:
            out += [("cpu", "cpu.max", f"{quota_us or 'max'} {cpu.period_us}"),
                    ("cpu", "cpu.weight", str(cpu.weight or 100))]

    # -- cpuset: dedicated CPUs and memory nodes (validated in plan/base.py)
    try:
        placement = dedicated_cpus(spec, facts).cpus
    except ValueError:
        placement, ok = (), False  # reported by the base section
    try:
        nodes = memory_nodes(spec, facts)
    except ValueError:
        nodes, ok = None, False  # reported by the base section
    if (placement or nodes) and not need(cg, "cpuset", loc_cpu + ("dedicated",),
                                          "dedicated CPUs or memory nodes", plan):
        ok = False
    if "cpuset" in cg.controllers:
        if v1:
            # An empty v1 cpuset takes no task: the defaults are the root's.
            all_cpus = cg.cpus or format_cpu_list(facts.cpus)
            all_mems = cg.mems or format_cpu_list(facts.numa_nodes)
            out += [("cpuset", "cpuset.cpus", format_cpu_list(placement) if placement
                     else all_cpus),
                    ("cpuset", "cpuset.mems", format_cpu_list(nodes) if nodes else all_mems)]
        else:
            # v2: empty means "the parent's".
            out += [("cpuset", "cpuset.cpus", format_cpu_list(placement)),
                    ("cpuset", "cpuset.mems", format_cpu_list(nodes) if nodes else "")]

    # -- memory: max, high (v1: soft limit), swap
    mem = res.memory
    total = facts.memory_bytes
    mx = page(mem.max.resolve(total)) if mem.max else None
    hi = page(mem.high.resolve(total)) if mem.high else None
    sw = page(mem.swap_max.resolve(total)) if mem.swap_max else None
    wants_mem = any(x is not None for x in (mx, hi, sw))
    if wants_mem and not need(cg, "memory", loc_mem, "a memory limit", plan):
        ok = False
    if mx is not None and hi is not None and hi > mx:
        plan.error(loc_mem + ("high",), f"memory.high ({format_size(hi)}) is above memory.max "
                   f"({format_size(mx)})")
        ok = False
    if sw is not None and not cg.swap:
        plan.error(loc_mem + ("swap_max",), "this host does not account swap per cgroup (v1: "
                   "no memory.memsw.*, boot with swapaccount=1; v2: no swap support); "
                   "remove swap_max")
        ok = False
    if sw is not None and v1 and mx is None:
        plan.error(loc_mem + ("swap_max",), "on cgroup v1 swap is limited as memory+swap "
                   "(memory.memsw.limit_in_bytes): set memory.max too")
        ok = False
    if "memory" in cg.controllers:
        if v1:
            if hi is not None:
                plan.warn("memory.high becomes memory.soft_limit_in_bytes on cgroup v1: "
                          "reclaimed first under host memory pressure, never throttled")
            out += [("memory", "memory.limit_in_bytes", str(mx) if mx is not None else "-1"),
                    ("memory", "memory.soft_limit_in_bytes", str(hi) if hi is not None
                     else "-1")]
            if cg.swap:
                memsw = str(mx + sw) if (mx is not None and sw is not None) else "-1"
                out.append(("memory", "memory.memsw.limit_in_bytes", memsw))
        else:
            out += [("memory", "memory.max", str(mx) if mx is not None else "max"),
                    ("memory", "memory.high", str(hi) if hi is not None else "max")]
            if cg.swap:
                out.append(("memory", "memory.swap.max", str(sw) if sw is not None else "max"))

    # -- io weight (none to write on a kernel without one: a warning, see NO_IO_WEIGHT)
    weight = res.io.weight
    io_ctrl = "blkio" if v1 else "io"
    if weight is not None:
        if not need(cg, io_ctrl, ("resources", "io", "weight"), "an IO weight", plan):
            ok = False
        elif not cg.io_weight:
            plan.warn(NO_IO_WEIGHT.format(weight=weight))
        else:
            if cg.io_weight == "blkio.weight":
                value = blkio_weight(weight)
            elif cg.io_weight.endswith("bfq.weight"):
                value = bfq_weight(weight)
                if not cg.bfq_devices:
                    plan.warn(f"io.weight {weight} is written as {cg.io_weight} {value}, which "
                              "acts only on block devices using the bfq scheduler, and none "
                              "does here")
            else:
                value = weight
            out.append((io_ctrl, cg.io_weight, str(value)))

    # -- pids
    if res.pids.max is not None and not need(cg, "pids", ("resources", "pids", "max"),
                                              "a pids limit", plan):
        ok = False
    if "pids" in cg.controllers:
        out.append(("pids", "pids.max", str(res.pids.max) if res.pids.max else "max"))

    # -- devices: v1 needs the controller; v2 uses a BPF program, no controller
    if v1 and not need(cg, "devices", ("resources",), "the device allow-list", plan):
        ok = False
    return out if ok else None
