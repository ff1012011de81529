"""Gathering the facts planning needs (CPUs, memory, NUMA nodes, kernel, cgroups, modules):
read-only; the value types live in envctl.facts."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from envctl.facts import GpuHostFacts, HostFacts, ModuleFact, RootfsFacts, RunscFacts
from envctl.spec.units import parse_cpu_list

if TYPE_CHECKING:
    from envctl.host.kmod import KernelModules


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


def _nft_installed() -> bool:
    from envctl.host.firewall import nft_installed

    return nft_installed()


def read_module(kmod: KernelModules, name: str) -> ModuleFact:
    from envctl.host.kmod import BUILTIN, LOADED

    state = kmod.state(name)
    if state == BUILTIN:
        return ModuleFact(state)
    found = kmod.availability(name)
    if state == LOADED:
        # Its chain still, so that `up` re-run with the module loaded plans the same steps
        # (and does not drop the dependencies an earlier run loaded); nothing when modules.dep
        # does not know it.
        return ModuleFact(state, found.deps, post=found.post, soft=found.soft) if found.ok \
            else ModuleFact(state)
    return ModuleFact("available" if found.ok else "missing", found.deps, found.reason,
                      post=found.post, soft=found.soft, note=found.note)


def read_cpufreq(sys_root: Path, cpus: tuple[int, ...]) -> dict[int, tuple[str, ...]]:
    from envctl.host.cpufreq import read_available

    found = {cpu: read_available(sys_root, cpu) for cpu in cpus}
    return {cpu: avail for cpu, avail in found.items() if avail is not None}


def read_cpufreq_policies(sys_root: Path, cpus: list[int]) -> dict[int, tuple[int, ...]]:
    """The cpufreq policy of each of `cpus` (those with cpufreq), by policy number."""
    from envctl.host.cpufreq import read_policy

    return dict(read_policy(sys_root, cpu) for cpu in cpus)


def read_rootfs(wants: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]]
                ) -> dict[str, RootfsFacts]:
    """What each environment's rootfs needs from this host (binaries found on PATH, their
    shared-library closures, Python), by name; specs asking the same share one reading."""
    if not wants:
        return {}
    from envctl.host.elf import resolve_rootfs

    done: dict[tuple, RootfsFacts] = {}
    out = {}
    for env, want in wants.items():
        if want not in done:
            done[want] = resolve_rootfs(list(want[0]), list(want[1]), want[2])
        out[env] = done[want]
    return out


def read_gpus(root: Path, *, libraries: bool = True) -> GpuHostFacts:
    """The NVIDIA driver, its GPUs and (`libraries`) its libraries, read under `root`
    (ENVCTL_GPU_ROOT in tests: a fake /proc, /dev and ld.so.cache)."""
    from envctl.host.gpus import discover_gpus, nvml_mode

    found = discover_gpus(root, nvml=nvml_mode())
    if not found.driver or not libraries:
        return found
    from envctl.host.elf import driver_libraries

    return dataclasses.replace(found, libraries=tuple(driver_libraries(found.driver, root)))


def _read_runsc() -> RunscFacts:
    from envctl.host.runsc import read_runsc

    return read_runsc()


def read_groups(names: frozenset[str]) -> dict[str, int]:
    import grp

    return _ids(names, grp.getgrnam, "gr_gid")


def read_users(names: frozenset[str]) -> dict[str, int]:
    import pwd

    return _ids(names, pwd.getpwnam, "pw_uid")


def _ids(names: frozenset[str], lookup: object, field: str) -> dict[str, int]:
    out = {}
    for name in names:
        with contextlib.suppress(KeyError):  # no such user or group: the planner says so
            out[name] = getattr(lookup(name), field)
    return out


def read_unsafe_paths(paths: dict[str, list[tuple[tuple, str]]]
                      ) -> dict[str, tuple[tuple[tuple, str], ...]]:
    """Environment -> (location, why) for each of its operator paths that root must not go
    through (safepath.root_controlled_problem); environments with none are left out."""
    from envctl.host.safepath import root_controlled_problem

    out = {}
    for env, items in paths.items():
        found = tuple((loc, why) for loc, path in items if (why := root_controlled_problem(path)))
        if found:
            out[env] = found
    return out


def gather(*, proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys"),
           sysctls: frozenset[str] = frozenset(), modules: frozenset[str] = frozenset(),
           kmod: KernelModules | None = None, cpufreq: bool = False,
           rootfs: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]] | None = None,
           gpu_root: Path | None = None, groups: frozenset[str] = frozenset(),
           users: frozenset[str] = frozenset(),
           state_dir: Path = Path("/var/lib/envctl"), runsc: bool = False,
           operator_paths: dict[str, list[tuple[tuple, str]]] | None = None) -> HostFacts:
    """Read the facts once; cheap enough (a handful of small files) for every command.
    Modules (through `kmod`), cpufreq, rootfs closures (`rootfs`: env -> binaries, libraries,
    python) and GPUs (under `gpu_root`) are read only when a spec asks about them."""
    # Here, not at the top: `envctl gpus` reads this module's read_gpus only, and the cgroup
    # adapter's import (~4 ms) is not its to pay.
    from envctl.host.cgroups import read_cgroup_facts
    from envctl.host.procfs import sysctl_path
    from envctl.spec.sysctls import canonical

    cpus = read_cpus(sys_root)
    freq = read_cpufreq(sys_root, cpus) if cpufreq else {}
    return HostFacts(
        rootfs=read_rootfs(rootfs or {}),
        gpu=read_gpus(gpu_root) if gpu_root is not None else GpuHostFacts(),
        groups=read_groups(groups),
        users=read_users(users),
        unsafe_paths=read_unsafe_paths(operator_paths or {}),
        resolv_conf=(_read(Path("/etc/resolv.conf")) or "") if rootfs else "",
        state_dir=str(state_dir),
        cpus=cpus,
        memory_bytes=read_memory(proc_root),
        numa_nodes=read_numa_nodes(sys_root),
        kernel=os.uname().release,
        firewall=_firewall_backend(),
        sysctls=frozenset(canonical(n) for n in sysctls if sysctl_path(proc_root, n).exists()),
        modules={n.replace("-", "_"): read_module(kmod, n) for n in modules} if kmod else {},
        cpufreq=freq,
        cpufreq_policies=read_cpufreq_policies(sys_root, sorted(freq)),
        cgroup=read_cgroup_facts(proc_root=proc_root, sys_root=sys_root),
        runsc=_read_runsc() if runsc else None,
        # Anti-spoofing uses nft's bridge family whatever the backend of the NAT rules.
        extra={"nft": _nft_installed()},
    )
