"""CPU frequency governors under <sys>/devices/system/cpu/cpuN/cpufreq: read and write, and
which CPUs share one cpufreq policy (one governor for all of them)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from envctl.errors import HostError


def cpufreq_dir(sys_root: Path, cpu: int) -> Path:
    return sys_root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "cpufreq"


def read_available(sys_root: Path, cpu: int) -> tuple[str, ...] | None:
    """The governors `cpu` offers, or None when it has no cpufreq (a VM, a disabled driver)."""
    d = cpufreq_dir(sys_root, cpu)
    if not (d / "scaling_governor").exists():
        return None
    try:
        return tuple((d / "scaling_available_governors").read_text().split())
    except OSError:
        return ()  # a driver without the list (intel_pstate active mode lists two): unknown


def read_policy(sys_root: Path, cpu: int) -> tuple[int, tuple[int, ...]]:
    """The cpufreq policy of `cpu` (which has cpufreq) and the CPUs it covers. The kernel keeps
    one governor per policy: cpuN/cpufreq links to ../cpufreq/policyM, whose related_cpus
    lists every CPU it covers (online or not). A CPU without related_cpus (an old kernel, a
    driver with per-CPU policies) is a policy of its own."""
    d = cpufreq_dir(sys_root, cpu)
    try:
        related = tuple(sorted(int(c) for c in (d / "related_cpus").read_text().split()))
    except (OSError, ValueError):
        return cpu, (cpu,)
    if cpu not in related:
        return cpu, (cpu,)  # not a list this CPU belongs to: trust nothing of it
    found = re.fullmatch(r"policy(\d+)", os.path.basename(os.path.realpath(d)))
    # Before policyN directories (kernels < 4.3) the first CPU of the policy named it.
    return (int(found.group(1)) if found else related[0]), related


class CpuFreq:
    """The governor adapter; `sys` is the sysfs root (tests point it at a fake tree)."""

    def __init__(self, sys: Path):
        self.sys = sys

    def governor(self, cpu: int) -> str | None:
        """The current governor, or None when this CPU has no cpufreq."""
        path = cpufreq_dir(self.sys, cpu) / "scaling_governor"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HostError(f"read cpu governor 'cpu{cpu}': {path}: {exc.strerror}") from exc

    def available(self, cpu: int) -> tuple[str, ...] | None:
        return read_available(self.sys, cpu)

    def set_governor(self, cpu: int, name: str) -> None:
        path = cpufreq_dir(self.sys, cpu) / "scaling_governor"
        try:
            with open(path, "w") as f:
                f.write(name)
        except OSError as exc:
            # EINVAL: the driver does not offer that governor.
            raise HostError(f"set cpu governor 'cpu{cpu}': write {name} to {path}: "
                            f"{exc.strerror}") from exc
