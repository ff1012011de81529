"""Resolving a spec's host-relative values (CPU reservations, % of memory) against host facts."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from envctl.spec.models import NEAR_GPUS, NearGpuCpus, ReservedCpus
from envctl.spec.units import format_cpu_list

if TYPE_CHECKING:
    from envctl.facts import GpuFact, HostFacts
    from envctl.spec.models import EnvSpec


@dataclass(frozen=True)
class CpuPlacement:
    """The CPUs an environment runs on; `cpus` empty means it shares every online CPU."""

    cpus: tuple[int, ...]
    note: str = ""

    def effective(self, facts: HostFacts) -> tuple[int, ...]:
        return self.cpus or facts.cpus


def dedicated_cpus(spec: EnvSpec, facts: HostFacts) -> CpuPlacement:
    """Resolve `resources.cpu.dedicated`; ValueError names what the host lacks."""
    ded = spec.resources.cpu.dedicated
    online = facts.cpus
    if ded is None:
        return CpuPlacement(())
    if isinstance(ded, tuple):
        missing = [c for c in ded if c not in online]
        if missing:
            raise ValueError(f"dedicated CPUs {format_cpu_list(missing)} are not online on this "
                             f"host (online: {format_cpu_list(online)})")
        return CpuPlacement(ded)
    if isinstance(ded, NearGpuCpus):
        if spec.name in facts.cpu_refused:
            raise ValueError(facts.cpu_refused[spec.name])
        if spec.name in facts.cpu_assigned:
            return CpuPlacement(facts.cpu_assigned[spec.name])
        alone, why = assign_near_cpus([spec], facts, {})
        if spec.name in why:
            raise ValueError(why[spec.name])
        return CpuPlacement(alone[spec.name])
    assert isinstance(ded, ReservedCpus)
    end = len(online) - ded.reserve_last
    chosen = online[ded.reserve_first:end] if end > ded.reserve_first else ()
    if chosen:
        return CpuPlacement(tuple(chosen))
    msg = (f"the host has {len(online)} online CPU(s) and the spec reserves "
           f"{ded.reserve_first} first + {ded.reserve_last} last, leaving none to dedicate")
    if ded.small_host == "error":
        raise ValueError(msg + " (set small_host: share to share all CPUs instead)")
    return CpuPlacement((), note=msg + "; sharing all online CPUs instead (small_host: share)")


# ---------------------------------------------------------------- near the GPUs


def spec_gpus(spec: EnvSpec, facts: HostFacts) -> list[GpuFact]:
    """The whole GPUs behind what the environment was assigned (a MIG device counts as its
    parent), in index order; [] when its GPUs are not resolved (the GPU section says why)."""
    by_uuid = {g.uuid: g for g in facts.gpu.gpus}
    migs = facts.gpu.migs()
    found: dict[int, GpuFact] = {}
    for u in facts.gpu_assigned.get(spec.name, ()):
        g = by_uuid.get(u) or (migs[u][0] if u in migs else None)
        if g is not None:
            found[g.index] = g
    return [found[i] for i in sorted(found)]


def _no_gpus(spec: EnvSpec, facts: HostFacts, what: str) -> str:
    why = facts.gpu_refused.get(spec.name)
    return (f"{what} near the GPUs: this environment gets no GPUs here"
            + (f" ({why})" if why else ""))


def _local(g: GpuFact, online: tuple[int, ...]) -> tuple[int, ...]:
    # A GPU whose affinity nobody reports is local to every CPU (sysfs's -1: no NUMA).
    return tuple(c for c in g.local_cpus if c in online) if g.local_cpus else online


def near_gpu_cpus(count: int, gpus: Sequence[GpuFact], online: tuple[int, ...],
                  taken: Mapping[int, str]) -> tuple[int, ...]:
    """`count` CPUs local to `gpus`, none of them in `taken` (CPU -> the environment that
    dedicates it), spread evenly over the GPUs' distinct local CPU sets (a job on each GPU
    gets CPUs near it), lowest numbers first. ValueError names what is free near them."""
    groups: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for g in gpus:
        local = _local(g, online)
        if local not in seen:
            seen.add(local)
            groups.append([c for c in local if c not in taken])
    free = sorted({c for grp in groups for c in grp})
    if len(free) < count:
        near = sorted({c for g in gpus for c in _local(g, online)})
        wants = (f"wants {count} dedicated CPU{'s' if count > 1 else ''} near GPU "
                 f"{', '.join(str(g.index) for g in gpus)}")
        if not near:
            listed = sorted({c for g in gpus for c in g.local_cpus})
            raise ValueError(f"{wants}, and none of its local CPUs ({format_cpu_list(listed)}) "
                             f"is online (online: {format_cpu_list(online)})")
        busy = [c for c in near if c in taken]
        owners = sorted({taken[c] for c in busy})
        raise ValueError(
            f"{wants} (CPUs {format_cpu_list(near)}), and "
            f"{'only ' if free else ''}{format_cpu_list(free) if free else 'none'} "
            f"{'is' if len(free) == 1 else 'are'} free there"
            + (f" ({format_cpu_list(busy)} dedicated to {', '.join(owners)})" if busy else "")
            + "; lower count or free those CPUs")
    picked: list[int] = []
    cursor = [0] * len(groups)
    while len(picked) < count:
        for i, grp in enumerate(groups):
            while cursor[i] < len(grp) and grp[cursor[i]] in picked:
                cursor[i] += 1
            if cursor[i] < len(grp) and len(picked) < count:
                picked.append(grp[cursor[i]])
                cursor[i] += 1
    return tuple(sorted(picked))


def assign_near_cpus(specs: Sequence[EnvSpec], facts: HostFacts,
                     held: Mapping[str, Sequence[int]]
                     ) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """The CPUs each spec with `dedicated: {near_gpus: true}` gets, and why one gets none.

    Never a CPU that another spec read with them dedicates (listed or reserved), nor one an
    environment that is up dedicates (`held`: environment -> its CPUs, from the journals);
    a spec keeps the near CPUs it already holds, so a re-`up` never moves it. Specs are
    served in name order, after GPUs are (facts.gpu_assigned)."""
    near = sorted((s for s in specs if isinstance(s.resources.cpu.dedicated, NearGpuCpus)),
                  key=lambda s: s.name)
    names = {s.name for s in near}
    taken: dict[int, str] = {}
    for env, cpus in held.items():
        if env not in names:
            taken.update((c, env) for c in cpus)
    for s in specs:
        if s.name not in names and s.resources.cpu.dedicated is not None:
            with contextlib.suppress(ValueError):  # reported by that spec's own plan
                taken.update((c, s.name) for c in dedicated_cpus(s, facts).cpus)
    out: dict[str, tuple[int, ...]] = {}
    why: dict[str, str] = {}
    for s in near:
        ded = s.resources.cpu.dedicated
        assert isinstance(ded, NearGpuCpus)
        gpus = spec_gpus(s, facts)
        if not gpus:
            why[s.name] = _no_gpus(s, facts, "dedicated CPUs")
            continue
        local = {c for g in gpus for c in _local(g, facts.cpus)}
        mine = [c for c in held.get(s.name, ()) if c in local and c not in taken][:ded.count]
        try:
            rest = near_gpu_cpus(ded.count - len(mine), gpus, facts.cpus,
                                 {**taken, **{c: s.name for c in mine}}) if \
                len(mine) < ded.count else ()
        except ValueError as exc:
            why[s.name] = str(exc)
            continue
        out[s.name] = tuple(sorted((*mine, *rest)))
        taken.update((c, s.name) for c in out[s.name])
    return out, why


def memory_nodes(spec: EnvSpec, facts: HostFacts) -> tuple[int, ...] | None:
    """`resources.memory.nodes` resolved: listed nodes as they are; near_gpus the NUMA nodes of
    the environment's GPUs (() when the host reports none: the parent's nodes). ValueError
    when its GPUs are not resolved."""
    nodes = spec.resources.memory.nodes
    if nodes != NEAR_GPUS:
        return nodes  # type: ignore[return-value]
    gpus = spec_gpus(spec, facts)
    if not gpus:
        raise ValueError(_no_gpus(spec, facts, "memory nodes"))
    return tuple(sorted({g.numa_node for g in gpus if g.numa_node is not None}))


def placement_lines(spec: EnvSpec, facts: HostFacts, cpus: tuple[int, ...]) -> list[str]:
    """One `GPU 3 <-> NUMA 1 <-> CPUs 48-63` line a GPU: its node and the environment's CPUs
    local to it (all it runs on when none are)."""
    out = []
    for g in spec_gpus(spec, facts):
        mine = [c for c in cpus if c in _local(g, facts.cpus)] or list(cpus)
        node = "?" if g.numa_node is None else str(g.numa_node)
        out.append(f"GPU {g.index} <-> NUMA {node} <-> CPUs {format_cpu_list(mine)}")
    return out
