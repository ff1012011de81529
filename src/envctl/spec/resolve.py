"""Resolving a spec's host-relative values (CPU reservations, % of memory) against host facts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from envctl.spec.models import ReservedCpus
from envctl.spec.units import format_cpu_list

if TYPE_CHECKING:
    from envctl.facts import HostFacts
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

