"""The CPU frequency governor of one CPU: set to the spec's, restored to the one found."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.errors import HostError
from envctl.resources.base import Check, Resource

if TYPE_CHECKING:
    from envctl.host.context import Host


@dataclass(frozen=True)
class CpuGovernor(Resource):
    """CPU `cpu` runs `governor`. One resource per CPU, shared: two environments on all CPUs
    hold each CPU's governor together, one on dedicated cores holds only those, and each CPU
    gets back its own previous governor when its last holder goes."""

    kind = "governor"
    shared = True
    cpu: int
    governor: str

    def ident(self) -> str:
        return f"cpu{self.cpu}"

    def describe(self) -> str:
        return f"cpu governor cpu{self.cpu} = {self.governor}"

    def check(self, host: Host) -> Check:
        have = host.cpufreq.governor(self.cpu)
        if have is None:
            return Check.wrong_kind(f"cpu{self.cpu} has no cpufreq")
        return Check.compare({"governor": self.governor}, {"governor": have})

    def snapshot(self, host: Host) -> dict[str, Any]:
        return {"old": host.cpufreq.governor(self.cpu)}

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        have = host.cpufreq.governor(self.cpu)
        if have is None:
            raise HostError(f"set cpu governor 'cpu{self.cpu}': this cpu has no cpufreq")
        if have == self.governor:
            return  # already so
        available = host.cpufreq.available(self.cpu)
        if available and self.governor not in available:
            # Validated at plan time too; the driver may have changed since.
            raise HostError(f"set cpu governor 'cpu{self.cpu}': {self.governor} is not offered "
                            f"(scaling_available_governors: {' '.join(available)})")
        host.cpufreq.set_governor(self.cpu, self.governor)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        old = memo.get("old")
        if old is None:
            return  # there was no governor to restore
        if host.cpufreq.governor(self.cpu) in (None, old):
            return  # already the governor we found (or cpufreq went away)
        host.cpufreq.set_governor(self.cpu, old)

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        old, have = memo.get("old"), host.cpufreq.governor(self.cpu)
        if old is None or have is None:
            return ""
        return f"restored {have} -> {old}" if have != old else f"left at {old}, as found"
