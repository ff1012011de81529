"""Planning an environment's GPUs: which ones (exclusive, deterministic, and stable across `up`),
their device nodes, the cgroup allow-list rules, and the variables naming them. Pure.

The section adds no resource of its own: it leaves its results in `plan.resolved` for the
sections after it (the rootfs's /dev and /etc/environment, the cgroup allow-list), so that one
list feeds both the nodes an environment sees and the devices its cgroup may open."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from envctl.plan.limits import GPU_DEVICES_KEY

if TYPE_CHECKING:
    from envctl.facts import GpuFact, HostFacts
    from envctl.plan.builder import Plan
    from envctl.spec.models import EnvSpec

# /dev/nvidiaN is char 195:N; nvidiactl and nvidia-modeset are 195:255 and 195:254. The
# nvidia-uvm and nvidia-caps majors are dynamic: named here, read from /proc/devices when the
# step runs (the module may only be loaded by this very `up`, and a major can change at reboot).
NVIDIA_MAJOR = 195
CTL_MINOR = 255
MODESET_MINOR = 254
UVM = "nvidia-uvm"
CAPS = "nvidia-caps"
NODE_MODE = 0o660
# What plan.resolved carries for the sections after this one.
NODES_KEY = "gpu.nodes"  # ((name under /dev, major or its /proc/devices name, minor, mode, gid),)
ENV_KEY = "gpu.env"  # {"CUDA_VISIBLE_DEVICES": "GPU-…,GPU-…", "NVIDIA_VISIBLE_DEVICES": …}


def assign_gpus(specs: Sequence[EnvSpec], facts: HostFacts, *,
                reserved: dict[str, str] | None = None
                ) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """The GPUs (UUIDs, in index order) each spec that wants some gets, and why a spec gets
    none. Explicit claims (all, indices, UUIDs) are served first, then counts in name order;
    a count keeps the GPUs its environment already holds (it never moves at re-`up`) and
    takes the lowest free indices for the rest. GPUs held by environments that are up
    (`facts.gpu_held`) are never given to another; quarantined ones (`facts.gpu_quarantined`,
    a whole GPU covering its MIG devices) are given to no one; nor are those `reserved` (GPU
    UUID -> the spec that carves it into MIG instances: plan.mig)."""
    by_index = {g.index: g for g in facts.gpu.gpus}
    by_uuid = {g.uuid: g for g in facts.gpu.gpus}
    migs = facts.gpu.migs()
    taken = {**(reserved or {}), **facts.gpu_held}  # uuid -> environment
    out: dict[str, tuple[str, ...]] = {}
    why: dict[str, str] = {}

    def key(u: str) -> tuple[int, int, int]:
        if u in migs:
            parent, m = migs[u]
            return (parent.index, m.gi, m.ci)
        return (by_uuid[u].index, -1, -1)

    def label(u: str) -> str:
        if u in migs:
            parent, m = migs[u]
            return f"MIG {m.profile or '?'} GI {m.gi} CI {m.ci} of GPU {parent.index} ({u})"
        return f"GPU {by_uuid[u].index} ({u})"

    def overlaps(u: str) -> list[str]:
        # A whole GPU and its MIG devices are the same hardware: holding one holds the other.
        if u in migs:
            return [u, migs[u][0].uuid]
        return [u] + [m.uuid for m in by_uuid[u].mig_devices]

    def sick(u: str) -> str:
        # A MIG device is its parent's hardware: the parent's quarantine covers it.
        for x in [u] + ([migs[u][0].uuid] if u in migs else []):
            if x in facts.gpu_quarantined:
                return f"{label(x)} is quarantined ({facts.gpu_quarantined[x]}); after a reset, " \
                    f"`envctl gpus --clear {by_uuid[x].index if x in by_uuid else x}`"
        return ""

    def order(uuids: list[str]) -> tuple[str, ...]:
        return tuple(sorted(uuids, key=key))

    def grant(name: str, uuids: list[str]) -> None:
        if bad := [w for u in uuids if (w := sick(u))]:
            why[name] = "; ".join(bad)
            return
        held = sorted({x for u in uuids for x in overlaps(u) if taken.get(x, name) != name},
                      key=key)
        if held:
            why[name] = "; ".join(
                f"{label(u)} is held by environment '{taken[u]}'"
                if facts.gpu_held.get(u) == taken[u] else
                f"{label(u)} is also claimed by environment '{taken[u]}'"
                for u in held)
            return
        out[name] = order(uuids)
        for u in uuids:
            taken[u] = name

    wanting = sorted((s for s in specs if s.gpus.wanted), key=lambda s: s.name)
    for s in wanting:
        g = s.gpus
        if g.all:
            grant(s.name, list(by_uuid))
        elif g.indices:
            absent = [i for i in g.indices if i not in by_index]
            if absent:
                why[s.name] = f"no GPU with index {', '.join(map(str, absent))} here"
            else:
                grant(s.name, [by_index[i].uuid for i in g.indices])
        elif g.uuids:
            absent = [u for u in g.uuids if u not in by_uuid and u not in migs]
            if absent:
                why[s.name] = f"no GPU {', '.join(absent)} here" + (
                    " (`envctl gpus` lists the MIG devices)" if any(
                        u.startswith("MIG-") for u in absent) else "")
            else:
                grant(s.name, list(g.uuids))
    for s in wanting:
        count = s.gpus.count
        if not count:
            continue
        mine = sorted((u for u, env in facts.gpu_held.items()
                       if env == s.name and u in by_uuid and not sick(u)),
                      key=lambda u: by_uuid[u].index)[:count]
        free = [g.uuid for g in sorted(by_uuid.values(), key=lambda g: g.index)
                if not any(x in taken for x in overlaps(g.uuid)) and not sick(g.uuid)]
        pick = mine + free[:count - len(mine)]
        if len(pick) < count:
            others = sorted({env for u, env in taken.items() if env != s.name and u in by_uuid})
            sick_ones = [str(by_uuid[u].index) for u in by_uuid if sick(u)]
            why[s.name] = (f"wants {count} GPU{'s' if count > 1 else ''} and {len(pick)} of "
                           f"this host's {len(by_uuid)} {'is' if len(pick) == 1 else 'are'} "
                           "free" + (f" (the others are held or claimed by "
                                     f"{', '.join(others)})" if others else "")
                           + (f" (quarantined: GPU {', '.join(sick_ones)}; `envctl gpus` "
                              "shows why)" if sick_ones else ""))
            continue
        grant(s.name, pick)
    return out, why


def _wanted(spec: EnvSpec) -> str:
    g = spec.gpus
    if g.all:
        return "every GPU"
    if g.count:
        return f"{g.count} GPU{'s' if g.count > 1 else ''}"
    if g.mig:
        return "MIG instances"
    items = [str(i) for i in g.indices] or list(g.uuids)
    return f"GPU {', '.join(items)}"


def _found(facts: HostFacts) -> str:
    gpu = facts.gpu
    driver = f"NVIDIA driver {gpu.driver}" if gpu.driver else \
        "no NVIDIA driver loaded (no /proc/driver/nvidia/version)"
    count = len(gpu.gpus)
    text = f"{driver} and {count or 'no'} GPU{'' if count == 1 else 's'}"
    return text + (f" ({'; '.join(gpu.problems)})" if gpu.problems else "")


def plan_gpus(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    if not spec.gpus.wanted:
        return
    if not facts.gpu.gpus:
        plan.error(("gpus",), f"wants {_wanted(spec)}, but this host has {_found(facts)}")
        return
    if spec.gpus.mig:
        # Its MIG instances: those that exist resolve like MIG UUIDs named in the spec; those
        # `up` makes first are planned again, with their nodes, once made (app.up).
        from envctl.plan.mig import plan_mig

        made = plan_mig(spec, facts, plan)
        if made is None:
            return
        _plan_nodes(spec, facts, plan, made)
        return
    assigned = facts.gpu_assigned.get(spec.name)
    if spec.name in facts.gpu_refused:
        # Resolved with the other specs read together: planning it alone would not see theirs.
        plan.error(("gpus",), f"{facts.gpu_refused[spec.name]} (this host has {_found(facts)})")
        return
    if assigned is None:
        alone, why = assign_gpus([spec], facts)
        if spec.name in why:
            plan.error(("gpus",), f"{why[spec.name]} (this host has {_found(facts)})")
            return
        assigned = alone[spec.name]
    _plan_nodes(spec, facts, plan, assigned)


def _plan_nodes(spec: EnvSpec, facts: HostFacts, plan: Plan, assigned: tuple[str, ...]) -> None:
    """The nodes, allow-list rules and variables of the GPUs and MIG devices `assigned`."""
    gid = _gid(spec, facts, plan)
    if gid is None:
        return
    by_uuid: dict[str, GpuFact] = {g.uuid: g for g in facts.gpu.gpus}
    migs = facts.gpu.migs()
    gpus = [by_uuid[u] for u in assigned if u in by_uuid]
    mine = [migs[u] for u in assigned if u in migs]
    # A MIG device is its parent's node plus its own GPU-instance and compute-instance access
    # capabilities; never nvidia-cap1 (MIG config: it could destroy every other partition's
    # instances) nor nvidia-cap2 (monitor).
    parents = list(dict.fromkeys([g.minor for g in gpus] + [p.minor for p, _ in mine]))
    nodes: list[tuple[str, int | str, int, int, int]] = [
        (f"nvidia{minor}", NVIDIA_MAJOR, minor, NODE_MODE, gid) for minor in parents]
    nodes += [("nvidiactl", NVIDIA_MAJOR, CTL_MINOR, NODE_MODE, gid),
              ("nvidia-uvm", UVM, 0, NODE_MODE, gid),
              ("nvidia-uvm-tools", UVM, 1, NODE_MODE, gid)]
    if spec.gpus.modeset:
        nodes.append(("nvidia-modeset", NVIDIA_MAJOR, MODESET_MINOR, NODE_MODE, gid))
    if mine and CAPS not in facts.gpu.majors:
        plan.error(("gpus",), "MIG devices need the nvidia-caps device, which /proc/devices "
                   "does not list here")
        return
    for parent, m in mine:
        if m.gi_minor is None or m.ci_minor is None:
            plan.error(("gpus",), f"{m.uuid} (GPU {parent.index}, GI {m.gi}, CI {m.ci}) has no "
                       "access minors in /proc/driver/nvidia-caps/mig-minors: its nodes cannot "
                       "be made")
            return
        nodes += [(f"nvidia-caps/nvidia-cap{minor}", CAPS, minor, NODE_MODE, gid)
                  for minor in (m.gi_minor, m.ci_minor)]
    plan.resolved["gpus"] = ", ".join(
        [f"{g.index} ({g.uuid})" for g in gpus]
        + [f"{p.index}: MIG {m.profile} GI {m.gi} CI {m.ci} ({m.uuid})" for p, m in mine])
    plan.resolved[NODES_KEY] = tuple(nodes)
    plan.resolved[GPU_DEVICES_KEY] = tuple(f"c {major}:{minor} rw"
                                           for _, major, minor, _, _ in nodes)
    visible = ",".join(u for u in assigned if u in by_uuid or u in migs)
    plan.resolved[ENV_KEY] = {"CUDA_VISIBLE_DEVICES": visible, "NVIDIA_VISIBLE_DEVICES": visible}
    for name in plan.resolved[ENV_KEY]:
        given = spec.rootfs.env.get(name)
        if given is not None and given != visible:
            plan.warn(f"rootfs.env.{name} is '{given}'; envctl sets it to this environment's "
                      f"GPUs instead ({visible})")
    if not facts.gpu.libraries:
        plan.warn(f"no NVIDIA driver libraries for driver {facts.gpu.driver} in ld.so.cache: "
                  "the environment gets its GPUs' nodes but no libcuda/libnvidia-ml")


def _gid(spec: EnvSpec, facts: HostFacts, plan: Plan) -> int | None:
    group = spec.gpus.group
    if group.isdigit():
        return int(group)
    if group in facts.groups:
        return facts.groups[group]
    plan.error(("gpus", "group"), f"group '{group}' does not exist on this host (the GPU "
               "nodes are mode 0660 with this group); create it or name another")
    return None
