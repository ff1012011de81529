"""The governor of one cpufreq policy (the CPUs that share it): set to the spec's, restored to
the one found."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.errors import HostError
from envctl.resources.base import Check, Resource
from envctl.spec.units import format_cpu_list

if TYPE_CHECKING:
    from envctl.host.context import Host


@dataclass(frozen=True)
class CpuGovernor(Resource):
    """cpufreq policy `policy`, which covers `cpus`, runs `governor`. The kernel keeps one
    governor per policy, so the policy is the object: writing it through any of its CPUs
    changes all of them. One resource per policy, shared: two environments on CPUs of one
    policy hold it together (one memo, restored once, when the last goes), one on dedicated
    cores holds only the policies of those cores, and each policy gets back its own previous
    governor."""

    kind = "governor"
    shared = True
    policy: int
    cpus: tuple[int, ...]
    governor: str

    def ident(self) -> str:
        return f"policy{self.policy}"

    def describe(self) -> str:
        return f"cpu governor policy{self.policy} (cpu {format_cpu_list(self.cpus)}) = " \
               f"{self.governor}"

    def _current(self, host: Host) -> tuple[int, str] | None:
        """The policy's governor and a CPU to reach it through: the first of its CPUs that
        has cpufreq now (an offline CPU has none); None when none has."""
        for cpu in self.cpus:
            have = host.cpufreq.governor(cpu)
            if have is not None:
                return cpu, have
        return None

    def check(self, host: Host) -> Check:
        found = self._current(host)
        if found is None:
            return Check.wrong_kind(f"cpu {format_cpu_list(self.cpus)} has no cpufreq")
        return Check.compare({"governor": self.governor}, {"governor": found[1]})

    def snapshot(self, host: Host) -> dict[str, Any]:
        found = self._current(host)
        return {"old": found[1] if found else None}

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        found = self._current(host)
        if found is None:
            raise HostError(f"set cpu governor 'policy{self.policy}': cpu "
                            f"{format_cpu_list(self.cpus)} has no cpufreq")
        cpu, have = found
        if have == self.governor:
            return  # already so
        available = host.cpufreq.available(cpu)
        if available and self.governor not in available:
            # Validated at plan time too; the driver may have changed since.
            raise HostError(f"set cpu governor 'policy{self.policy}': {self.governor} is not "
                            f"offered (scaling_available_governors: {' '.join(available)})")
        host.cpufreq.set_governor(cpu, self.governor)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        old = memo.get("old")
        if old is None:
            return  # there was no governor to restore
        found = self._current(host)
        if found is None or found[1] == old:
            return  # already the governor we found (or cpufreq went away)
        host.cpufreq.set_governor(found[0], old)

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        old, found = memo.get("old"), self._current(host)
        if old is None or found is None:
            return ""
        return f"restored {found[1]} -> {old}" if found[1] != old else f"left at {old}, as found"
