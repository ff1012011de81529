"""Read-only facts about the host that planning needs: CPUs, memory, NUMA nodes, kernel."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from envctl.spec.units import parse_cpu_list


@dataclass(frozen=True)
class HostFacts:
    """What the planner may know about the host; tests build these by hand."""

    cpus: tuple[int, ...] = (0, 1)
    memory_bytes: int = 24 * 1024**3
    numa_nodes: tuple[int, ...] = (0,)
    kernel: str = "6.1.0"
    # Sysctls that exist on this kernel, among those the specs ask about.
    sysctls: frozenset[str] = field(default_factory=frozenset)
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


def gather(*, proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys"),
           sysctls: frozenset[str] = frozenset()) -> HostFacts:
    """Read the facts once; cheap enough (a handful of small files) for every command."""
    return HostFacts(
        cpus=read_cpus(sys_root),
        memory_bytes=read_memory(proc_root),
        numa_nodes=read_numa_nodes(sys_root),
        kernel=os.uname().release,
        firewall=_firewall_backend(),
        sysctls=frozenset(n for n in sysctls if sysctl_path(proc_root, n).exists()),
    )
