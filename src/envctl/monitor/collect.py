"""One monitor tick's sample of the host: every environment that is up (its cgroup's usage, its
service, its jobs, the GPU memory its processes hold), every GPU (through one NVML session),
and the host's CPU and memory (psutil).

What is up, and where its cgroup is, comes from the journals (runtime.context.read_journal,
which imports neither the engine nor the resource kinds), re-read only when a journal file
changes. Cgroup files are read with one open/read/close each, from paths computed once per
environment; job records are cached (a finished record never changes, so only active ones are
read again). Nothing here imports typer or rich.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envctl.runtime.context import parse_cpus, read_journal, spec_names

if TYPE_CHECKING:
    from envctl.host.cgroups import Cgroups
    from envctl.monitor.nvml import GpuSample, MigSample, NvmlSession
    from envctl.monitor.nvmlkeep import NvmlKeeper

# Kinds whose presence in this boot's journal means the environment is up (their objects die
# with a reboot; runtime.context drops entries of another boot).
_UP_KINDS = ("mntns", "netns", "cgroup", "cgroup-slice", "env-dev", "service")
JOB_STATES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
              "OUT_OF_MEMORY", "LOST")


@dataclass(slots=True)
class EnvSample:
    """One environment at one tick; None where its cgroup (or this host) does not count it.
    Times in seconds, memory in bytes, `mem_limit` None when unlimited."""

    env: str
    driver: str | None = None  # "cgroupfs" / "systemd"; None: no cgroup recorded
    cgroup: str = ""  # relative to a hierarchy's root: /envctl/box
    cpus: int = 0  # CPUs of its cpuset (every online CPU when it has none)
    cpu_seconds: float | None = None
    cpu_percent: float | None = None  # of its CPUs, since the last tick
    periods: int | None = None
    throttled_periods: int | None = None
    throttled_seconds: float | None = None
    mem_usage: int | None = None
    mem_working_set: int | None = None  # usage minus inactive file cache, as cAdvisor counts
    mem_limit: int | None = None
    mem_peak: int | None = None
    oom_kills: int | None = None
    # memory.events (v2): high, max, oom, oom_kill; v1 counts only oom_kill (memory.oom_control)
    mem_events: dict[str, int] = field(default_factory=dict)
    cpu_quota: float | None = None  # seconds of CPU per period (cpu.max); None: no quota
    cpu_period: float | None = None  # seconds
    # PSI (v2 only): (resource, "some"/"full") -> seconds of stall since the cgroup was made
    pressure: dict[tuple[str, str], float] = field(default_factory=dict)
    io_read_bytes: int | None = None  # over every device (io.stat / blkio)
    io_write_bytes: int | None = None
    veth: str = ""  # the host end of its veth, as its journal records it
    net_rx_bytes: int | None = None  # received by the environment (its veth's host end sent)
    net_tx_bytes: int | None = None  # sent by the environment
    tasks: int | None = None  # pids.current: processes and threads
    service: dict[str, Any] | None = None  # {"state", "up", "restarts", "pid"} when it has one
    jobs: dict[str, int] = field(default_factory=dict)  # state -> count (retained records)
    gpus: tuple[str, ...] = ()  # UUIDs it holds
    gpu_memory: dict[str, int] = field(default_factory=dict)  # UUID -> bytes its procs use
    description: str = ""  # the spec's `description`, as `up` recorded it

    @property
    def mem_percent(self) -> float | None:
        """Memory used, in percent of its limit (None when unlimited or unknown)."""
        if self.mem_usage is None or not self.mem_limit:
            return None
        return 100.0 * self.mem_usage / self.mem_limit


@dataclass(slots=True)
class Snapshot:
    """What one tick saw."""

    time: float
    envs: list[EnvSample]
    gpus: list[GpuSample]
    host_cpu_percent: float | None = None
    host_mem_percent: float | None = None
    host_mem_total: int | None = None
    host_mem_used: int | None = None
    gpu_env: dict[str, str] = field(default_factory=dict)  # UUID -> environment holding it
    migs: list[MigSample] = field(default_factory=list)  # MIG instances of MIG-enabled GPUs
    configured: list[str] = field(default_factory=list)  # specs in the config directory
    problems: list[str] = field(default_factory=list)
    # Filled by the health loop (envctl.monitor.health.Health.view): env -> {"state", "drift",
    # "heals", "heal_failures", "retry_in"}.
    health: dict[str, dict[str, Any]] = field(default_factory=dict)
    # GPU UUID -> why it is quarantined (the ledger, envctl.engine.quarantine), read each tick.
    quarantined: dict[str, str] = field(default_factory=dict)
    gpus_paused: bool = False  # GPU sampling paused by the operator: no GPU sampled, NVML shut


# ---------------------------------------------------------------- reading files


def _read(path: str) -> bytes | None:
    """A small kernel file's bytes; None when it (or its cgroup) does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return None  # EACCES and friends: this value is simply not known
    try:
        return os.read(fd, 65536)
    except OSError:
        return None
    finally:
        os.close(fd)


def _int(data: bytes | None) -> int | None:
    if not data:
        return None
    try:
        return int(data.split(None, 1)[0])
    except ValueError:
        return None  # "max"


def _field(data: bytes | None, key: bytes) -> int | None:
    """The value of `key` in a "key value" file (cpu.stat, memory.stat, memory.events)."""
    if not data:
        return None
    at = data.find(key + b" ")
    while at > 0 and data[at - 1:at] != b"\n":
        at = data.find(key + b" ", at + 1)
    if at < 0:
        return None
    end = data.find(b"\n", at)
    try:
        return int(data[at + len(key) + 1: end if end >= 0 else None])
    except ValueError:
        return None


# Values at or above this in a v1 limit file mean "no limit" (PAGE_COUNTER_MAX, rounded).
_UNLIMITED_FLOOR = 2**62
# What a host veth name envctl made looks like (IFNAMSIZ): nothing a path could climb out of.
_IFNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}")
_MEM_EVENTS = (b"high", b"max", b"oom", b"oom_kill")


def _pressure(data: bytes | None, resource: str, out: dict[tuple[str, str], float]) -> None:
    """`some`/`full` totals (microseconds) of a PSI file into `out`, in seconds."""
    for line in (data or b"").splitlines():
        kind, _, rest = line.partition(b" ")
        at = rest.rfind(b"total=")
        if kind in (b"some", b"full") and at >= 0:
            try:
                out[(resource, kind.decode())] = int(rest[at + 6:]) / 1e6
            except ValueError:
                continue


def _io_bytes(data: bytes | None, version: int) -> tuple[int | None, int | None]:
    """Bytes read and written over every device: io.stat's rbytes=/wbytes= (v2), or
    blkio.throttle.io_service_bytes' `MAJ:MIN Read|Write N` lines (v1)."""
    if data is None:
        return None, None
    rd = wr = 0
    for line in data.splitlines():
        parts = line.split()
        if version == 2:
            for p in parts[1:]:
                if p.startswith(b"rbytes="):
                    rd += int(p[7:])
                elif p.startswith(b"wbytes="):
                    wr += int(p[7:])
        elif len(parts) == 3 and parts[1] == b"Read":
            rd += int(parts[2])
        elif len(parts) == 3 and parts[1] == b"Write":
            wr += int(parts[2])
    return rd, wr


def _cpu_quota(files: dict[str, str], version: int) -> tuple[float | None, float | None]:
    """(quota, period) in seconds: cpu.max (v2, `max` quota: none) or cpu.cfs_quota_us and
    cpu.cfs_period_us (v1, -1: none)."""
    if version == 2:
        data = _read(files["cpu.max"]) if "cpu.max" in files else None
        parts = (data or b"").split()
        if len(parts) != 2 or not parts[1].isdigit():
            return None, None
        period = int(parts[1]) / 1e6
        return (None if parts[0] == b"max" else int(parts[0]) / 1e6), period
    period_us = _int(_read(files["cpu.period"])) if "cpu.period" in files else None
    quota_us = _int(_read(files["cpu.quota"])) if "cpu.quota" in files else None
    return (None if quota_us is None or quota_us < 0 else quota_us / 1e6,
            None if period_us is None else period_us / 1e6)


@dataclass(slots=True)
class _Target:
    """An environment that is up, and the files its sample reads."""

    env: str
    signature: tuple
    driver: str | None = None
    cgroup: str = ""
    version: int = 0
    files: dict[str, str] = field(default_factory=dict)  # what -> absolute path
    cpus: int = 0
    gpus: tuple[str, ...] = ()
    has_service: bool = False
    description: str = ""  # the spec's, as `up` recorded it
    veth: str = ""  # the host end of its veth (a name envctl made, from its journal)
    last_cpu: tuple[float, float] | None = None  # (monotonic time, cpu seconds)
    cpu_quota: tuple[float | None, float | None] = (None, None)  # read when the journal changes


def _cgroup_files(cgroups: Cgroups, driver: str, parent: str, env: str
                  ) -> tuple[str, dict[str, str]]:
    """The cgroup (relative path) of an environment and the files its sample reads."""
    from envctl.host.cgroups import Cgroups as Adapter

    if driver == "systemd":
        from envctl.spec.naming import env_slice, parent_slice

        adapter = Adapter(cgroups.lay, parent_slice(parent or cgroups.parent))
        name = env_slice(env, parent or cgroups.parent)
    else:
        adapter = cgroups.for_parent(parent)
        name = env
    rel = f"/{adapter.parent}/{name}"

    def at(controller: str, file: str) -> str | None:
        try:
            return str(adapter.path(name, controller, file))
        except KeyError:
            return None  # this v1 controller is not mounted here

    if adapter.version == 2:
        wanted = {"cpu.stat": ("cpu", "cpu.stat"), "mem": ("memory", "memory.current"),
                  "mem.limit": ("memory", "memory.max"), "mem.peak": ("memory", "memory.peak"),
                  "mem.stat": ("memory", "memory.stat"), "mem.oom": ("memory", "memory.events"),
                  "pids": ("pids", "pids.current"), "cpuset": ("cpuset", "cpuset.cpus.effective"),
                  "cpu.max": ("cpu", "cpu.max"), "io": ("io", "io.stat"),
                  "psi.cpu": ("cpu", "cpu.pressure"), "psi.memory": ("memory", "memory.pressure"),
                  "psi.io": ("io", "io.pressure")}
    else:
        wanted = {"cpu.usage": ("cpuacct", "cpuacct.usage"), "cpu.stat": ("cpu", "cpu.stat"),
                  "mem": ("memory", "memory.usage_in_bytes"),
                  "mem.limit": ("memory", "memory.limit_in_bytes"),
                  "mem.peak": ("memory", "memory.max_usage_in_bytes"),
                  "mem.stat": ("memory", "memory.stat"),
                  "mem.oom": ("memory", "memory.oom_control"),
                  "pids": ("pids", "pids.current"), "cpuset": ("cpuset", "cpuset.cpus"),
                  "cpu.quota": ("cpu", "cpu.cfs_quota_us"),
                  "cpu.period": ("cpu", "cpu.cfs_period_us"),
                  "io": ("blkio", "blkio.throttle.io_service_bytes")}
    files = {}
    for what, (controller, file) in wanted.items():
        p = at(controller, file)
        if p is not None:
            files[what] = p
    return rel, files


# ---------------------------------------------------------------- jobs


class _JobCounts:
    """Job records by environment and state, read incrementally: a record is read again only
    while it is active (a finished one is never rewritten); active ones whose supervisor is
    gone count as LOST, as `envctl jobs` shows them."""

    def __init__(self, state_dir: Path, boot_id: str):
        self.dir = state_dir / "jobs"
        self.boot_id = boot_id
        self.known: dict[str, tuple[str, str, Any]] = {}  # file -> (env, state, job if active)

    def counts(self) -> dict[str, dict[str, int]]:
        from envctl.runtime import jobs as jb

        try:
            names = [n for n in os.listdir(self.dir) if n.endswith(".json")]
        except FileNotFoundError:
            self.known.clear()
            return {}
        except PermissionError:
            from envctl.errors import NeedsRootError

            raise NeedsRootError(jb.RECORDS_NEED_ROOT) from None
        listed = set(names)
        for gone in [n for n in self.known if n not in listed]:
            del self.known[gone]
        out: dict[str, dict[str, int]] = {}
        for name in names:
            seen = self.known.get(name)
            if seen is None or seen[2] is not None:
                seen = self._read(jb, name)
                if seen is None:
                    continue
                self.known[name] = seen
            env, state, job = seen
            if job is not None and not jb.supervisor_alive(job, self.boot_id):
                state = "LOST"
            per = out.setdefault(env, {})
            per[state] = per.get(state, 0) + 1
        return out

    def _read(self, jb: Any, name: str) -> tuple[str, str, Any] | None:
        from envctl.errors import StateCorrupt

        if not name[:-5].isdigit():
            return None
        try:
            job = jb.read(self.dir.parent, int(name[:-5]))
        except StateCorrupt:
            return None
        if job is None:
            return None
        return job.env, str(job.state), job if job.active else None


# ---------------------------------------------------------------- the sampler


class Sampler:
    """Samples the host once per `tick()`. Keeps what is worth keeping across ticks: the NVML
    session, each environment's file paths, the last CPU counters (for percentages), job
    records. `close()` shuts NVML down."""

    def __init__(self, *, state_dir: Path, run_dir: Path, boot_id: str, cgroups: Cgroups,
                 nvml: NvmlSession | NvmlKeeper | None = None, nvml_problem: str = "",
                 proc: Path = Path("/proc"), host_stats: bool = True,
                 clock: Callable[[], float] = time.monotonic,
                 config_dir: Path | None = None, sys_class_net: Path = Path("/sys/class/net")):
        """`config_dir`: where the specs are (one `envctl_environment_configured` series
        each); None: not looked at."""
        self.state_dir = state_dir
        self.run_dir = run_dir
        self.boot_id = boot_id
        self.cgroups = cgroups
        self.nvml = nvml
        self.nvml_problem = nvml_problem
        self.proc = proc
        self.host_stats = host_stats
        self.clock = clock
        self.config_dir = config_dir
        self.sys_class_net = sys_class_net
        self._configured: tuple[tuple, list[str]] = ((), [])
        self.targets: dict[str, _Target] = {}
        self.jobs = _JobCounts(state_dir, boot_id)
        self._service_cache: dict[str, tuple[tuple, dict[str, Any] | None]] = {}
        self._online = 0
        if host_stats:
            import psutil

            self._psutil = psutil
            psutil.cpu_percent(None)  # the first call starts the interval; it says 0.0

    @classmethod
    def for_host(cls, host: Any, *, say: Callable[[str], None] | None = None,
                 **kwargs: Any) -> Sampler:
        """A sampler of `host` (envctl.host.context.Host), with NVML when this host allows it,
        opened again after a failure (monitor/nvmlkeep.py, which tells `say` why)."""
        from envctl.monitor.nvmlkeep import NvmlKeeper
        from envctl.runtime.context import config_dir

        kwargs.setdefault("config_dir", config_dir())
        # /sys/class/net lists the links of the netns that mounted that sysfs: the host's.
        kwargs.setdefault("sys_class_net", host.sys / "class" / "net")

        return cls(state_dir=host.state_dir, run_dir=host.run_dir, boot_id=host.boot_id,
                   cgroups=host.cgroups,
                   nvml=NvmlKeeper(host.gpu_root, say=say, run_dir=host.run_dir),
                   proc=host.proc, **kwargs)

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None

    @property
    def pausable(self) -> bool:
        """Whether GPU sampling can be paused by the operator (monitor/nvmlkeep.py): the
        monitor then looks for the mark between ticks too."""
        return bool(getattr(self.nvml, "pausable", False))

    def poll_pause(self) -> None:
        """Between ticks: let NVML go at once when the operator paused GPU sampling."""
        poll = getattr(self.nvml, "poll_pause", None)
        if poll is not None:
            poll()

    # -- environments that are up
    def _journals(self) -> dict[str, tuple]:
        """env -> a signature of its journal files (name, size, mtime): when it changes, the
        environment is read again."""
        d = self.state_dir / "journal"
        out: dict[str, list] = {}
        try:
            it = os.scandir(d)
        except FileNotFoundError:
            return {}
        with it:
            for e in it:
                name = e.name
                if name.startswith(".") or not name.endswith((".json", ".log")):
                    continue
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                out.setdefault(name.split(".", 1)[0], []).append(
                    (name, st.st_size, st.st_mtime_ns))
        return {env: tuple(sorted(sig)) for env, sig in out.items()}

    def refresh_targets(self) -> list[str]:
        """Re-read the journals that changed; problems reading them (a damaged journal)."""
        from envctl.errors import EnvctlError

        problems = []
        journals = self._journals()
        for env in [e for e in self.targets if e not in journals]:
            del self.targets[env]
        for env, sig in journals.items():
            old = self.targets.get(env)
            if old is not None and old.signature == sig:
                continue
            try:
                found, claims = read_journal(self.state_dir, env, self.boot_id)
            except EnvctlError as exc:
                problems.append(f"{env}: {exc}")
                self.targets.pop(env, None)
                continue
            if not any(k in found for k in _UP_KINDS):
                self.targets.pop(env, None)  # down, or up in another boot only
                continue
            t = _Target(env, sig, gpus=tuple((claims.get("gpus") or {}).get("uuids") or ()),
                        has_service="service" in found,
                        description=str(claims.get("description") or ""),
                        veth=_veth_name(found))
            cg = found.get("cgroup") or found.get("cgroup-slice")
            if cg is not None:
                t.driver = "systemd" if "cgroup-slice" in found and "cgroup" not in found \
                    else "cgroupfs"
                t.version = int(cg.get("version") or 0)
                t.cgroup, t.files = _cgroup_files(self.cgroups, t.driver,
                                                  str(cg.get("parent") or ""), env)
                cpus = parse_cpus((_read(t.files["cpuset"]) or b"").decode().strip()) \
                    if "cpuset" in t.files else ()
                t.cpus = len(cpus) or self._online_cpus()
                # cpu.max is envctl's to set, by an `up` that rewrites the journal: read then.
                t.cpu_quota = _cpu_quota(t.files, t.version)
                if old is not None and old.cgroup == t.cgroup:
                    t.last_cpu = old.last_cpu
            self.targets[env] = t
        return problems

    def configured(self) -> list[str]:
        """The specs in the config directory, read again only when a file there changes."""
        if self.config_dir is None:
            return []
        sig: list[tuple] = []
        try:
            with os.scandir(self.config_dir) as it:
                for e in it:
                    if e.name.endswith((".yaml", ".yml")):
                        st = e.stat()
                        sig.append((e.name, st.st_size, st.st_mtime_ns))
        except OSError:
            sig = []  # no config directory (yet): nothing configured here
        key = tuple(sorted(sig))
        if key != self._configured[0]:
            self._configured = (key, sorted(spec_names(self.config_dir)) if key else [])
        return self._configured[1]

    def _online_cpus(self) -> int:
        if not self._online:
            self._online = os.cpu_count() or 1
        return self._online

    # -- one environment
    def _sample_env(self, t: _Target, now: float) -> EnvSample:
        s = EnvSample(t.env, driver=t.driver, cgroup=t.cgroup, cpus=t.cpus, gpus=t.gpus,
                      description=t.description)
        f = t.files
        if f:
            cpu = _read(f["cpu.stat"]) if "cpu.stat" in f else None
            if t.version == 2 or "cpu.usage" not in f:
                usage_us = _field(cpu, b"usage_usec")
                s.cpu_seconds = None if usage_us is None else usage_us / 1e6
                thr = _field(cpu, b"throttled_usec")
                s.throttled_seconds = None if thr is None else thr / 1e6
                inactive = b"inactive_file"
                events = _read(f["mem.oom"]) if "mem.oom" in f else None
                oom = _field(events, b"oom_kill")
            else:
                usage_ns = _int(_read(f["cpu.usage"]))
                s.cpu_seconds = None if usage_ns is None else usage_ns / 1e9
                thr = _field(cpu, b"throttled_time")
                s.throttled_seconds = None if thr is None else thr / 1e9
                inactive = b"total_inactive_file"
                oom = _field(_read(f["mem.oom"]) if "mem.oom" in f else None, b"oom_kill")
            s.periods = _field(cpu, b"nr_periods")
            s.throttled_periods = _field(cpu, b"nr_throttled")
            s.oom_kills = oom
            s.cpu_quota, s.cpu_period = t.cpu_quota
            if t.version == 2:
                for key in _MEM_EVENTS:
                    n = _field(events, key)
                    if n is not None:
                        s.mem_events[key.decode()] = n
                for res in ("cpu", "memory", "io"):
                    if f"psi.{res}" in f:
                        _pressure(_read(f[f"psi.{res}"]), res, s.pressure)
            elif oom is not None:
                s.mem_events["oom_kill"] = oom
            if "io" in f:
                # A line this kernel writes differently: unknown, not an error.
                with contextlib.suppress(ValueError):
                    s.io_read_bytes, s.io_write_bytes = _io_bytes(_read(f["io"]), t.version)
            if "mem" in f:
                s.mem_usage = _int(_read(f["mem"]))
                limit = _int(_read(f["mem.limit"])) if "mem.limit" in f else None
                s.mem_limit = None if limit is None or limit >= _UNLIMITED_FLOOR else limit
                s.mem_peak = _int(_read(f["mem.peak"])) if "mem.peak" in f else None
                if s.mem_usage is not None:
                    cache = _field(_read(f["mem.stat"]), inactive) if "mem.stat" in f else None
                    s.mem_working_set = max(0, s.mem_usage - (cache or 0))
            s.tasks = _int(_read(f["pids"])) if "pids" in f else None
            if s.cpu_seconds is not None:
                if t.last_cpu is not None and now > t.last_cpu[0]:
                    used = s.cpu_seconds - t.last_cpu[1]
                    s.cpu_percent = max(0.0, 100.0 * used / ((now - t.last_cpu[0]) * t.cpus))
                t.last_cpu = (now, s.cpu_seconds)
        if t.veth:
            s.veth = t.veth
            stats = f"{self.sys_class_net}/{t.veth}/statistics/"
            # The host end's tx is what the environment received, and its rx what it sent.
            s.net_rx_bytes = _int(_read(stats + "tx_bytes"))
            s.net_tx_bytes = _int(_read(stats + "rx_bytes"))
        if t.has_service:
            s.service = self._service(t.env)
        return s

    def _service(self, env: str) -> dict[str, Any]:
        """The service's recorded state (re-read when its file changes) and whether its
        supervisor is alive now."""
        from envctl.runtime import service as rs

        path = rs.state_path(_HostPaths(self.run_dir), env)
        try:
            st = os.stat(path)
            sig: tuple = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            sig = ()
        cached = self._service_cache.get(env)
        if cached is None or cached[0] != sig:
            state = rs.read_state(_HostPaths(self.run_dir), env) if sig else None
            cached = (sig, state)
            self._service_cache[env] = cached
        state = cached[1]
        if state is None:
            return {"state": "absent", "up": False, "restarts": 0, "pid": None}
        alive = rs.alive(state, self.boot_id)
        return {"state": state.get("state") if alive else "dead",
                "up": alive and state.get("state") == "running",
                "restarts": int(state.get("restarts") or 0), "pid": state.get("pid")}

    # -- the tick
    def prime(self) -> None:
        """Read the CPU counters only, so that the next tick can say percentages (`--once`)."""
        self.refresh_targets()
        now = self.clock()
        for t in self.targets.values():
            self._sample_env(t, now)

    def tick(self) -> Snapshot:
        problems = self.refresh_targets()
        now = self.clock()
        envs = [self._sample_env(t, now) for t in sorted(self.targets.values(),
                                                          key=lambda t: t.env)]
        jobs = self.jobs.counts()
        for s in envs:
            s.jobs = jobs.get(s.env, {})
        gpus: list[GpuSample] = []
        migs: list[MigSample] = []
        gpu_env = {u: s.env for s in envs for u in s.gpus}
        paused = False
        if self.nvml is not None:
            gpus = self.nvml.sample(frozenset(gpu_env))
            migs = getattr(self.nvml, "migs", None) or []
            problems += self.nvml.problems
            paused = getattr(self.nvml, "paused", None) is not None
            self._attribute(envs, gpus, migs)
        elif self.nvml_problem:
            problems.append(self.nvml_problem)
        snap = Snapshot(time=time.time(), envs=envs, gpus=gpus, gpu_env=gpu_env, migs=migs,
                        problems=problems, configured=self.configured(), gpus_paused=paused)
        if self.host_stats:
            snap.host_cpu_percent = self._psutil.cpu_percent(None)
            vm = self._psutil.virtual_memory()
            snap.host_mem_percent = vm.percent
            snap.host_mem_total, snap.host_mem_used = vm.total, vm.total - vm.available
        return snap

    def resample(self, snap: Snapshot, envs: set[str]) -> None:
        """Sample `envs` again into `snap` (after the health loop healed them, so that what is
        exported is what is there now, its service included)."""
        self.refresh_targets()
        now = self.clock()
        for i, s in enumerate(snap.envs):
            t = self.targets.get(s.env)
            if s.env in envs and t is not None:
                new = self._sample_env(t, now)
                new.jobs, new.gpu_memory = s.jobs, s.gpu_memory
                snap.envs[i] = new

    def _attribute(self, envs: list[EnvSample], gpus: list[GpuSample],
                   migs: list[MigSample] | None = None) -> None:
        """Each GPU process's memory to the environment whose cgroup holds it
        (/proc/PID/cgroup, any hierarchy), under the GPU's UUID, or the MIG instance's for a
        process of a MIG instance (a MIG-enabled GPU's own list repeats its instances'
        processes: it is not counted again)."""
        rels = [(s.cgroup, s) for s in envs if s.cgroup]
        if not rels:
            return
        owner: dict[int, EnvSample | None] = {}
        holders = [(g.uuid, g.processes) for g in gpus if not g.mig]
        holders += [(m.uuid, m.processes) for m in migs or ()]
        for uuid, processes in holders:
            for pid, used in processes:
                if pid not in owner:
                    owner[pid] = _owner(self.proc, pid, rels)
                s = owner[pid]
                if s is not None and used:
                    s.gpu_memory[uuid] = s.gpu_memory.get(uuid, 0) + used


def _veth_name(found: dict[str, dict[str, Any]]) -> str:
    """The host end of the environment's veth, as its journal records it (envctl made it: a
    veth name already taken is refused, never adopted); "" when none or not a link name."""
    name = str((found.get("veth") or {}).get("name") or "")
    return name if _IFNAME.fullmatch(name) else ""


def _owner(proc: Path, pid: int, rels: list[tuple[str, EnvSample]]) -> EnvSample | None:
    data = _read(f"{proc}/{pid}/cgroup")
    if not data:
        return None
    for line in data.decode(errors="replace").splitlines():
        path = line.split(":", 2)[-1]
        for rel, s in rels:
            if path == rel or path.startswith(rel + "/"):
                return s
    return None


@dataclass(frozen=True)
class _HostPaths:
    """What envctl.runtime.service reads of a Host: its run directory."""

    run_dir: Path
