"""What the planner may know about the host: plain values, gathered by envctl.host.facts.

Pure: this module imports nothing that touches the kernel, so the planner (which imports only
this and the spec) provably cannot; tests build these values by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The default name of envctl's parent cgroup / slice (ENVCTL_CGROUP_PARENT overrides it);
# envctl.spec.naming holds the same value for the launch path (facts import nothing of
# envctl's: tests/unit/test_layering.py checks both).
DEFAULT_PARENT = "envctl"
# cgroup v2 controllers an environment's cgroup uses, in the order they are delegated.
V2_CONTROLLERS = ("cpu", "cpuset", "memory", "io", "pids")


@dataclass(frozen=True)
class CgroupFacts:
    """What the planner knows about cgroups; the default is a modern v2 host without systemd."""

    layout: str = "v2"
    version: int = 2
    controllers: tuple[str, ...] = V2_CONTROLLERS
    # v1: memory.memsw.* exists (swapaccount); v2: memory.swap.max exists.
    swap: bool = True
    # The IO weight file in an environment's cgroup and its range; "" when there is none.
    io_weight: str = "io.weight"
    # Block devices using the bfq scheduler (a bfq weight acts only on those).
    bfq_devices: tuple[str, ...] = ()
    systemd: bool = False
    # What `resources.driver: auto` means here when ENVCTL_CGROUP_DRIVER says so ("" = by PID 1).
    default_driver: str = ""
    cpus: str = ""  # the root cpuset (v1 parents are initialised to it)
    mems: str = ""
    # The parent cgroup / slice name (ENVCTL_CGROUP_PARENT); recorded in every cgroup resource
    # so that `down` removes what `up` made even when the variable has changed since.
    parent: str = DEFAULT_PARENT


@dataclass(frozen=True)
class ModuleFact:
    """One kernel module: `loaded`, `builtin`, `available` (modprobe can load it, after `deps`)
    or `missing` (`reason` says why: no /lib/modules/<release>, no file, no module support)."""

    state: str
    # What `modprobe NAME` loads before it (modules.dep dependencies and `pre:` softdeps) and
    # after it (`post:` softdeps), in its order; `soft` names the soft dependencies among them.
    deps: tuple[str, ...] = ()
    reason: str = ""
    post: tuple[str, ...] = ()
    soft: tuple[str, ...] = ()
    # What envctl cannot follow about loading it (an install command in modprobe's config).
    note: str = ""


@dataclass(frozen=True)
class PlacedFile:
    """One host file a root filesystem gets: `path` inside the environment (absolute, the
    host's canonical path: directory symlinks such as /bin -> usr/bin resolved), `source` on
    the host. `link` is the symlink's target, as readlink gives it, when the file is a symlink
    (placed as a symlink; the file it names is another PlacedFile)."""

    path: str
    source: str
    link: str = ""


@dataclass(frozen=True)
class RootfsFacts:
    """What one spec's rootfs needs from this host, resolved without executing anything."""

    # The binaries and libraries the spec lists with their shared-library closures and ELF
    # interpreters, sorted by path, each once.
    files: tuple[PlacedFile, ...] = ()
    # The top of the tree: (name, symlink target) for the host's /bin, /lib, /lib64, /sbin …
    # that are symlinks (merged /usr: ("bin", "usr/bin")); the others are real directories.
    links: tuple[tuple[str, str], ...] = ()
    # Host directories bind-mounted read-only at the same path (the Python standard library).
    binds: tuple[str, ...] = ()
    # The interpreter `python: true` gives, inside the environment ("" when not asked).
    python: str = ""
    # What cannot be had: (the spec's item, why), e.g. ("nvidia-smi", "not found in /usr/bin,
    # /bin, …"); a plan error each.
    missing: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class MigFact:
    """One MIG device (a compute instance of a GPU instance) as NVML reports it, with the
    nvidia-caps minors of its access nodes (/proc/driver/nvidia-caps/mig-minors)."""

    uuid: str  # MIG-…
    parent: int  # the parent GPU's index
    gi: int  # GPU instance id
    ci: int  # compute instance id
    profile: str = ""  # the GPU instance profile, as nvidia-smi mig -lgip names it: 3g.71gb
    profile_id: int = -1
    start: int = 0  # placement: first memory slice
    size: int = 0  # placement: memory slices
    memory_bytes: int = 0
    gi_minor: int | None = None  # /dev/nvidia-caps/nvidia-cap<gi_minor>: gpuN/giX/access
    ci_minor: int | None = None  # /dev/nvidia-caps/nvidia-cap<ci_minor>: gpuN/giX/ciY/access


@dataclass(frozen=True)
class GpuFact:
    """One NVIDIA GPU as NVML (or /proc/driver/nvidia) reports it."""

    index: int
    uuid: str
    name: str = ""
    minor: int = 0  # /dev/nvidia<minor> = char 195:<minor>
    memory_bytes: int = 0
    mig: bool = False  # MIG mode enabled
    pci: str = ""  # bus id, 0000:3b:00.0
    mig_pending: bool = False  # MIG mode after the next GPU reset
    mig_devices: tuple[MigFact, ...] = ()  # its MIG devices (NVML only)
    # Where it sits: its NUMA node (None: the host has no NUMA, sysfs says -1) and the CPUs
    # local to it, from NVML's memory and CPU affinity where NVML answers, else sysfs PCI
    # (numa_node, local_cpulist); `affinity` says which ("nvml", "sysfs" or "").
    numa_node: int | None = None
    local_cpus: tuple[int, ...] = ()
    affinity: str = ""


@dataclass(frozen=True)
class GpuHostFacts:
    """The NVIDIA driver and GPUs of this host (all empty on a host without them)."""

    driver: str = ""  # the running driver's version, "" when no driver is loaded
    gpus: tuple[GpuFact, ...] = ()
    # Character-device majors from /proc/devices: "nvidia-frontend" (195), "nvidia-uvm",
    # "nvidia-caps" (the last two are dynamic).
    majors: dict[str, int] = field(default_factory=dict)
    # Driver libraries from ld.so.cache whose version matches the driver (with their soname
    # symlinks), bind-mounted read-only into GPU environments.
    libraries: tuple[PlacedFile, ...] = ()
    # Where the GPU list came from: "nvml", "proc" or "" (none found).
    source: str = ""
    # What went wrong looking (NVML failed to initialise, …): shown when a spec wants GPUs.
    problems: tuple[str, ...] = ()

    def migs(self) -> dict[str, tuple[GpuFact, MigFact]]:
        """MIG UUID -> (its parent GPU, the MIG device)."""
        return {m.uuid: (g, m) for g in self.gpus for m in g.mig_devices}


@dataclass(frozen=True)
class RunscFacts:
    """gVisor's runsc on this host (read only when a spec asks for `isolation: gvisor`)."""

    path: str = ""  # "" when runsc is not installed
    version: str = ""  # `runsc --version`'s first line
    platforms: tuple[str, ...] = ()  # what its --platform accepts (ptrace, kvm, systrap)
    nvproxy: bool = False  # whether it has --nvproxy (GPUs inside the sandbox)
    problem: str = ""  # why it could not be read, when it is installed


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
    # cpufreq policies by number (policyN), each with its CPUs (related_cpus): CPUs of one
    # policy share one governor. A CPU in none of them is a policy of its own.
    cpufreq_policies: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # The firewall backend `network.firewall: auto` means here (nftables or iptables).
    firewall: str = "nftables"
    # Each spec's rootfs needs, by environment name (read only for specs with a rootfs).
    rootfs: dict[str, RootfsFacts] = field(default_factory=dict)
    # NVIDIA driver and GPUs (read only when a spec wants GPUs).
    gpu: GpuHostFacts = field(default_factory=GpuHostFacts)
    # GPU UUID -> the environment that is up and holds it (from the journals' claims).
    gpu_held: dict[str, str] = field(default_factory=dict)
    # Environment -> the GPU UUIDs it gets, resolved for all specs read together (see
    # envctl.plan.gpus.assign_gpus); a spec missing here is resolved alone.
    gpu_assigned: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Environment -> why it gets none, from the same joint resolution.
    gpu_refused: dict[str, str] = field(default_factory=dict)
    # GPU UUID -> why it is quarantined (the ledger's evidence, and what a health probe found
    # now): never assigned to anyone until `envctl gpus --clear`.
    gpu_quarantined: dict[str, str] = field(default_factory=dict)
    # Environment -> the CPUs `dedicated: {near_gpus: true}` gives it, resolved for all specs
    # read together (envctl.spec.resolve.assign_near_cpus), and environment -> why it gets none.
    cpu_assigned: dict[str, tuple[int, ...]] = field(default_factory=dict)
    cpu_refused: dict[str, str] = field(default_factory=dict)
    # Ids the host's users, groups and /etc/subuid, /etc/subgid ranges hold, (first, end,
    # what) (read only when a spec wants a user namespace).
    host_ids: tuple[tuple[int, int, str], ...] = ()
    # Environment that is up -> the first host id of its user namespace block (journals).
    userns_held: dict[str, int] = field(default_factory=dict)
    # Environment -> the first host id of its block, resolved for all specs read together
    # (envctl.plan.userns.assign_userns); and environment -> why it has none.
    userns_assigned: dict[str, int] = field(default_factory=dict)
    userns_refused: dict[str, str] = field(default_factory=dict)
    # Group names the specs ask about -> gid (a name missing here does not exist).
    groups: dict[str, int] = field(default_factory=dict)
    # Login names the specs ask about (access:) -> uid (a name missing here does not exist).
    users: dict[str, int] = field(default_factory=dict)
    # Environment -> (spec location, why) for each operator path of its spec (a data mount's
    # absolute source, rootfs.path, a rootfs file's source, the CUDA toolkit) that goes
    # through a directory or symlink someone other than root could change.
    unsafe_paths: dict[str, tuple[tuple[tuple, str], ...]] = field(default_factory=dict)
    # The host's /etc/resolv.conf, which environments' rootfs get a copy of.
    resolv_conf: str = ""
    # Where envctl keeps state on this host (ENVCTL_STATE_DIR), for resources that need
    # absolute paths (a rootfs and data directories under the state directory).
    state_dir: str = "/var/lib/envctl"
    # gVisor's runsc (read only when a spec asks for isolation: gvisor; None: not read).
    runsc: RunscFacts | None = None
    # Extra facts contributed by resource families (cgroup layout, GPUs, firewall, …).
    extra: dict[str, object] = field(default_factory=dict, compare=False)
