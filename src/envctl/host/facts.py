"""Read-only facts about the host that planning needs: CPUs, memory, NUMA nodes, kernel."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from envctl.host.cgroups import CgroupFacts, read_cgroup_facts
from envctl.spec.units import parse_cpu_list

if TYPE_CHECKING:
    from envctl.host.kmod import KernelModules


@dataclass(frozen=True)
class ModuleFact:
    """One kernel module: `loaded`, `builtin`, `available` (modprobe can load it, after `deps`)
    or `missing` (`reason` says why: no /lib/modules/<release>, no file, no module support)."""

    state: str
    deps: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class HostFacts:
    """What the planner may know about the host; tests build these by hand."""

    cpus: tuple[int, ...] = (0, 1)
    memory_bytes: int = 24 * 1024**3
    numa_nodes: tuple[int, ...] = (0,)
    kernel: str = "6.1.0"
    # Sysctls that exist on this kernel, among those the specs ask about.
    sysctls: frozenset[str] = field(default_factory=frozenset)
    # Cgroup layout, controllers, swap/IO-weight support and whether PID 1 is systemd.
    cgroup: CgroupFacts = field(default_factory=CgroupFacts)
    # Kernel modules the specs ask about, by name with '_' (see ModuleFact).
    modules: dict[str, ModuleFact] = field(default_factory=dict)
    # CPUs that have cpufreq, each with its scaling_available_governors; empty: no cpufreq.
    cpufreq: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # The firewall backend `network.firewall: auto` means here (nftables or iptables).
    firewall: str = "nftables"
    # Extra facts contributed by resource families (cgroup layout, GPUs, firewall, …).
    extra: dict[str, object] = field(default_factory=dict, compare=False)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def read_cpus(sys_root: Path) -> tuple[int, ...]:
    text = _read(sys_root / "devices/system/cpu/online")
    if text is None:
        return tuple(range(os.cpu_count() or 1))
    return parse_cpu_list(text.strip())


def read_memory(proc_root: Path) -> int:
    text = _read(proc_root / "meminfo") or ""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def read_numa_nodes(sys_root: Path) -> tuple[int, ...]:
    text = _read(sys_root / "devices/system/node/online")
    return parse_cpu_list(text.strip()) if text else (0,)


def _firewall_backend() -> str:
    from envctl.host.firewall import detect_backend

    return detect_backend()


def sysctl_path(proc_root: Path, name: str) -> Path:
    return proc_root / "sys" / name.replace(".", "/")


def read_module(kmod: KernelModules, name: str) -> ModuleFact:
    from envctl.host.kmod import ABSENT

    state = kmod.state(name)
    if state != ABSENT:
        return ModuleFact(state)
    found = kmod.availability(name)
    return ModuleFact("available" if found.ok else "missing", found.deps, found.reason)


def read_cpufreq(sys_root: Path, cpus: tuple[int, ...]) -> dict[int, tuple[str, ...]]:
    from envctl.host.cpufreq import read_available

    found = {cpu: read_available(sys_root, cpu) for cpu in cpus}
    return {cpu: avail for cpu, avail in found.items() if avail is not None}


def gather(*, proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys"),
           sysctls: frozenset[str] = frozenset(), modules: frozenset[str] = frozenset(),
           kmod: KernelModules | None = None, cpufreq: bool = False) -> HostFacts:
    """Read the facts once; cheap enough (a handful of small files) for every command.
    Modules (through `kmod`) and cpufreq are read only when a spec asks about them."""
    cpus = read_cpus(sys_root)
    return HostFacts(
        cpus=cpus,
        memory_bytes=read_memory(proc_root),
        numa_nodes=read_numa_nodes(sys_root),
        kernel=os.uname().release,
        firewall=_firewall_backend(),
        sysctls=frozenset(n for n in sysctls if sysctl_path(proc_root, n).exists()),
        modules={n.replace("-", "_"): read_module(kmod, n) for n in modules} if kmod else {},
        cpufreq=read_cpufreq(sys_root, cpus) if cpufreq else {},
        cgroup=read_cgroup_facts(proc_root=proc_root, sys_root=sys_root),
    )
