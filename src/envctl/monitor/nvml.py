"""One NVML session for the monitor's life: initialised once, device handles kept, sampled each
tick (utilisation, memory, temperature, power and its limit, the energy counter, SM/memory
clocks and the reasons they are held down, ECC counts, remapped rows, PCIe replays, XID events,
per-process memory), and each MIG instance of a MIG-enabled GPU (MigSample).

MIG instances are sampled through their MIG device handles: memory (nvmlDeviceGetMemoryInfo on
the MIG handle: the GPU instance's own memory) and processes (nvmlDeviceGetComputeRunningProcesses
on it). NVML's utilisation rates are the whole GPU's and answer NOT_SUPPORTED in MIG mode; an
instance's utilisation comes from GPM (GPU performance monitoring, Hopper and newer):
nvmlGpmMigSampleGet(parent, GPU instance id) each tick, and nvmlGpmMetricsGet between this
tick's sample and the last one (graphics engine activity and SM activity, as dcgm-exporter's
DCGM_FI_PROF_GR_ENGINE_ACTIVE and DCGM_FI_PROF_SM_ACTIVE). Where GPM is not offered (Ampere,
a driver or pynvml without it), an instance's utilisation stays None. Instances are listed
again when the MIG UUIDs environments hold change (an `up` or `down` made or destroyed some),
when a MIG handle fails, and every REDISCOVER_TICKS ticks (a change made outside envctl).

The rule that decides whether NVML may be asked at all is discovery's (envctl.host.gpus): the
driver is loaded and every node libnvidia-ml would otherwise create exists, and ENVCTL_NVML is
not "off". When it may not, `open_session` says why and the monitor samples no GPU.

A call a GPU does not support (ECC on a consumer board, power on some, events in a container)
answers NOT_SUPPORTED: it is asked once, remembered, and not asked again, so a tick never pays
for an exception it already knows. A GPU that falls off the bus (GPU_IS_LOST) is reported in
`problems` and its values are None from then on.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

# Errors that are NVML's as a whole, not one GPU's: the driver was unloaded or reloaded
# (LIB_RM_VERSION_MISMATCH), the library went away, NVML is not initialised any more.
SESSION_ERRORS = (1, 9, 12, 18)  # UNINITIALIZED, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, RM mismatch

# At most this many XID events are drained per tick (a GPU in an error storm must not hold
# the tick up).
MAX_EVENTS = 64
# MIG instances are listed again at least this often (in ticks): nvidia-smi may have made or
# destroyed some that no environment holds.
REDISCOVER_TICKS = 60
# nvml.h's GPM metric ids (nvmlGpmMetricId_t), for a pynvml that lacks the names.
GPM_GRAPHICS_UTIL = 1  # NVML_GPM_METRIC_GRAPHICS_UTIL: % of time any engine was active
GPM_SM_UTIL = 2  # NVML_GPM_METRIC_SM_UTIL: % of SMs busy


@dataclass(slots=True)
class GpuSample:
    """One GPU at one tick; None where NVML does not say. Memory in bytes, power in watts."""

    index: int
    uuid: str
    name: str
    minor: int
    util: int | None = None  # percent of the last sample period a kernel ran
    mem_util: int | None = None  # percent of it memory was read or written
    fb_total: int | None = None
    fb_used: int | None = None
    fb_free: int | None = None
    temp: int | None = None  # degrees C
    power_w: float | None = None
    pci_bus_id: str = ""  # NVML's busId: 00000000:3B:00.0, as dcgm-exporter's pci_bus_id
    power_limit_w: float | None = None  # the enforced power limit
    energy_j: float | None = None  # energy since the driver loaded (Volta and newer)
    sm_clock_hz: int | None = None
    mem_clock_hz: int | None = None
    clock_reasons: int | None = None  # nvmlClocksEventReason* bits now active
    remapped: tuple[int, int, int, int] | None = None  # correctable, uncorrectable, pending, failed
    pcie_replays: int | None = None
    ecc: dict[str, int] = field(default_factory=dict)  # sbe_vol, dbe_vol, sbe_agg, dbe_agg
    xid: int | None = None  # the last XID seen since the monitor started (dcgm's XID_ERRORS)
    xid_count: int = 0  # XID events seen since the monitor started
    xids: dict[int, int] = field(default_factory=dict)  # err_code -> events since the start
    fatal_xids: list[int] = field(default_factory=list)  # those of them that quarantine it
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes)
    lost: bool = False
    mig: bool = False  # MIG mode on: its processes are counted through its MIG instances


@dataclass(slots=True)
class MigSample:
    """One MIG device (a compute instance of a GPU instance) at one tick; None where NVML does
    not say. Memory is the GPU instance's, in bytes; utilisation in percent (GPM)."""

    parent: int  # the parent GPU's index (dcgm-exporter's `gpu`)
    parent_uuid: str  # dcgm-exporter's `UUID` of a MIG series is the parent's
    uuid: str  # MIG-…: what environments hold
    gi: int  # GPU instance id (dcgm-exporter's GPU_I_ID)
    ci: int  # compute instance id
    profile: str  # 1g.18gb (dcgm-exporter's GPU_I_PROFILE)
    fb_total: int | None = None
    fb_used: int | None = None
    fb_free: int | None = None
    util: float | None = None  # GPM graphics engine activity since the last tick, percent
    sm_util: float | None = None  # GPM SM activity, percent
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _metric(metric: Any) -> float | None:
    """A GPM metric's value (percent), None when NVML did not compute it."""
    value = float(metric.value)
    return value if metric.nvmlReturn == 0 and math.isfinite(value) else None


def _bus_id(nvml: ModuleType, handle: Any) -> str:
    """The GPU's PCI address as NVML writes it (dcgm-exporter's pci_bus_id); "" when unknown."""
    try:
        return _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
    except (nvml.NVMLError, AttributeError):
        return ""


def _clock_reasons_call(nvml: ModuleType) -> Any:
    """nvmlDeviceGetCurrentClocksEventReasons (nvidia-ml-py >= 12.535), else its old name."""
    return getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)


def _key(handle: Any) -> Any:
    """A hashable identity of a device handle (a ctypes pointer in pynvml, an int in fakes)."""
    import ctypes

    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


class NvmlSession:
    """An initialised NVML and its GPUs. `close()` shuts NVML down (once)."""

    def __init__(self, nvml: ModuleType):
        self.nv = nvml
        self.problems: list[str] = []
        self._unsupported: set[tuple[int, str]] = set()
        self._closed = False
        self.broken = ""  # an error of the whole session (a driver reload): NvmlKeeper reopens
        nvml.nvmlInit()
        try:
            self.driver = _text(nvml.nvmlSystemGetDriverVersion())
            self.gpus: list[GpuSample] = []
            self._handles: list[Any] = []
            for index in range(nvml.nvmlDeviceGetCount()):
                try:  # one GPU that cannot say who it is must not hide the others
                    h = nvml.nvmlDeviceGetHandleByIndex(index)
                    gpu = GpuSample(
                        index=index, uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                        name=_text(nvml.nvmlDeviceGetName(h)),
                        minor=int(nvml.nvmlDeviceGetMinorNumber(h)),
                        pci_bus_id=_bus_id(nvml, h))
                except nvml.NVMLError as exc:
                    if exc.value in SESSION_ERRORS:
                        raise
                    self.problems.append(f"GPU {index}: not sampled: NVML: {exc}")
                    continue
                self._handles.append(h)
                self.gpus.append(gpu)
            self._by_key = {_key(h): i for i, h in enumerate(self._handles)}
            self._events = self._register_events()
            self.migs: list[MigSample] = []
            # (position of the parent in self.gpus, MIG device handle) of each of self.migs:
            # a GPU that could not say who it is is not in self.gpus, so its index is not a
            # position there.
            self._mig_handles: list[tuple[int, Any]] = []
            self._mig_stale = True  # listed at the first sample
            self._mig_held: frozenset[str] = frozenset()
            self._mig_ticks = 0
            # (parent's position, GPU instance id) -> [older sample, newer sample, older filled]
            self._gpm: dict[tuple[int, int], list[Any]] = {}
            self._gpm_get: Any = None  # one nvmlGpmMetricsGet_t, reused
        except BaseException:
            self.close()
            raise

    def _register_events(self) -> Any:
        nv = self.nv
        try:
            es = nv.nvmlEventSetCreate()
        except (nv.NVMLError, AttributeError):
            return None
        registered = 0
        for i, h in enumerate(self._handles):
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
                registered += 1
            except nv.NVMLError as exc:
                if exc.value != nv.NVML_ERROR_NOT_SUPPORTED:
                    self.problems.append(f"GPU {i}: XID events not watched: {exc}")
        if not registered:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlEventSetFree(es)
            return None
        return es

    # -- sampling
    def _ask(self, i: int, what: str, call: Any, *args: Any) -> Any:
        """`call(handle, *args)`, None when this GPU does not support it (remembered): NVML
        says NOT_SUPPORTED, or FUNCTION_NOT_FOUND (a driver older than the call), or this
        pynvml has no such function (`call` None)."""
        if (i, what) in self._unsupported:
            return None
        nv = self.nv
        if call is None:
            self._unsupported.add((i, what))
            return None
        try:
            return call(self._handles[i], *args)
        except nv.NVMLError as exc:
            if exc.value in (nv.NVML_ERROR_NOT_SUPPORTED,
                             getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)):
                self._unsupported.add((i, what))
            elif exc.value in SESSION_ERRORS:  # all of NVML, not this GPU: open it again
                self.broken = self.broken or str(exc)
            elif exc.value == getattr(nv, "NVML_ERROR_GPU_IS_LOST", 15):
                if not self.gpus[i].lost:
                    self.problems.append(f"GPU {i} ({self.gpus[i].uuid}) is lost: it fell off "
                                         "the bus or its driver state is broken")
                self.gpus[i].lost = True
            return None

    def sample(self, held: frozenset[str] | set[str] = frozenset()) -> list[GpuSample]:
        """Every GPU's values now (the same GpuSample objects, updated in place), and every
        MIG instance's into `migs`. `held`: the GPU and MIG UUIDs environments hold now (when
        its MIG UUIDs change, the instances are listed again)."""
        nv = self.nv
        for i, g in enumerate(self.gpus):
            if g.lost:
                continue
            util = self._ask(i, "util", nv.nvmlDeviceGetUtilizationRates)
            g.util, g.mem_util = (int(util.gpu), int(util.memory)) if util else (None, None)
            mem = self._ask(i, "memory", nv.nvmlDeviceGetMemoryInfo)
            if mem is not None:
                g.fb_total, g.fb_used, g.fb_free = int(mem.total), int(mem.used), int(mem.free)
            temp = self._ask(i, "temp", nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)
            g.temp = None if temp is None else int(temp)
            power = self._ask(i, "power", nv.nvmlDeviceGetPowerUsage)
            g.power_w = None if power is None else int(power) / 1000.0
            self._sample_more(i, g)
            if (i, "ecc") not in self._unsupported:
                for key, etype, ctype in (
                        ("sbe_vol", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
                        ("dbe_vol", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
                        ("sbe_agg", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
                        ("dbe_agg", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                         nv.NVML_AGGREGATE_ECC)):
                    n = self._ask(i, "ecc", nv.nvmlDeviceGetTotalEccErrors, etype, ctype)
                    if n is None:
                        g.ecc.clear()
                        break
                    g.ecc[key] = int(n)
            procs = self._ask(i, "procs", nv.nvmlDeviceGetComputeRunningProcesses)
            g.processes = [(int(p.pid), None if p.usedGpuMemory is None else int(
                p.usedGpuMemory)) for p in procs or ()]
            if g.lost:  # lost during this tick: nothing of it is current any more
                g.util = g.mem_util = g.fb_total = g.fb_used = g.fb_free = g.temp = None
                g.power_w = g.power_limit_w = g.energy_j = None
                g.sm_clock_hz = g.mem_clock_hz = g.clock_reasons = g.pcie_replays = None
                g.remapped = None
                g.ecc.clear()
                g.processes = []
        self._drain_events()
        held_migs = frozenset(u for u in held if u.startswith("MIG-"))
        self._mig_ticks += 1
        if self._mig_stale or held_migs != self._mig_held or \
                self._mig_ticks >= REDISCOVER_TICKS:
            self._list_migs()
            self._mig_held = held_migs
        self._sample_migs()
        return self.gpus

    # -- MIG instances
    def _list_migs(self) -> None:
        """Find every MIG device of every MIG-enabled GPU (read calls only), and whether its
        parent offers GPM."""
        from envctl.host.gpus import profile_infos

        nv = self.nv
        self._mig_stale, self._mig_ticks = False, 0
        gpm: dict[tuple[int, int], list[Any]] = {}
        migs: list[MigSample] = []
        handles: list[tuple[int, Any]] = []
        for i, g in enumerate(self.gpus):
            mode = None if g.lost else self._ask(i, "mig_mode",
                                                 getattr(nv, "nvmlDeviceGetMigMode", None))
            g.mig = bool(mode and mode[0])
            if not g.mig:
                continue
            h = self._handles[i]
            try:
                names: dict[int, str] | None = None  # profile id -> name, when needed
                for n in range(int(nv.nvmlDeviceGetMaxMigDeviceCount(h))):
                    try:
                        m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, n)
                    except nv.NVMLError as exc:
                        if exc.value == nv.NVML_ERROR_NOT_FOUND:  # an index with no device
                            continue
                        raise
                    gi = int(nv.nvmlDeviceGetGpuInstanceId(m))
                    # A MIG device's name ends with its profile ("NVIDIA H200 MIG 1g.18gb"):
                    # no privileged call. Else the GPU instance's profile, as discovery
                    # reads it (nvmlDeviceGetGpuInstanceById wants root).
                    _, said, profile = _text(nv.nvmlDeviceGetName(m)).rpartition(" MIG ")
                    if not said or not profile:
                        if names is None:
                            names = {int(info.id): name
                                     for name, info in profile_infos(nv, h).items()}
                        info = nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceGetGpuInstanceById(h, gi))
                        profile = names.get(int(info.profileId), "")
                    migs.append(MigSample(
                        parent=g.index, parent_uuid=g.uuid, uuid=_text(nv.nvmlDeviceGetUUID(m)),
                        gi=gi, ci=int(nv.nvmlDeviceGetComputeInstanceId(m)), profile=profile))
                    handles.append((i, m))
            except nv.NVMLError as exc:
                if exc.value in SESSION_ERRORS:
                    self.broken = self.broken or str(exc)
                    self._gpm.update(gpm)  # freed by close(), as the keeper closes it now
                    return
                problem = f"GPU {g.index}: MIG instances not sampled: NVML: {exc}"
                if problem not in self.problems:
                    self.problems.append(problem)
                continue
            if self._gpm_supported(i):
                for gi in {m.gi for m, (pos, _) in zip(migs, handles, strict=True)
                           if pos == i}:
                    # A GPU instance listed again keeps its last sample: no gap in its
                    # utilisation at each listing.
                    gpm[(i, gi)] = self._gpm.pop((i, gi), None) or [None, None, False]
        self._free_gpm()  # those of GPU instances that are gone
        self._gpm = gpm
        self.migs, self._mig_handles = migs, handles

    def _gpm_supported(self, i: int) -> bool:
        """Whether GPU `i` offers GPM (Hopper and newer, through this pynvml)."""
        nv = self.nv
        if getattr(nv, "nvmlGpmMigSampleGet", None) is None:
            return False
        support = self._ask(i, "gpm", getattr(nv, "nvmlGpmQueryDeviceSupport", None))
        return bool(support is not None and support.isSupportedDevice)

    def _sample_migs(self) -> None:
        nv = self.nv
        util: dict[tuple[int, int], tuple[float | None, float | None]] = {}
        for m, (i, h) in zip(self.migs, self._mig_handles, strict=True):
            m.fb_total = m.fb_used = m.fb_free = None
            m.util = m.sm_util = None
            m.processes = []
            if self.gpus[i].lost:
                continue
            mem = self._ask_mig(i, m, h, "memory", nv.nvmlDeviceGetMemoryInfo)
            if mem is not None:
                m.fb_total, m.fb_used, m.fb_free = int(mem.total), int(mem.used), int(mem.free)
            procs = self._ask_mig(i, m, h, "procs", nv.nvmlDeviceGetComputeRunningProcesses)
            m.processes = [(int(p.pid), None if p.usedGpuMemory is None else int(
                p.usedGpuMemory)) for p in procs or ()]
            key = (i, m.gi)
            if key in self._gpm:
                if key not in util:  # one GPM sample a GPU instance (its CIs share it)
                    util[key] = self._gpm_sample(key)
                m.util, m.sm_util = util[key]

    def _ask_mig(self, i: int, m: MigSample, handle: Any, what: str, call: Any) -> Any:
        """`call(MIG handle)`, None when NVML does not say; a stale handle (the instance was
        destroyed) has the instances listed again at the next tick."""
        if (m.uuid, what) in self._unsupported:
            return None
        nv = self.nv
        try:
            return call(handle)
        except nv.NVMLError as exc:
            if exc.value in (nv.NVML_ERROR_NOT_SUPPORTED,
                             getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)):
                self._unsupported.add((m.uuid, what))
            elif exc.value in SESSION_ERRORS:
                self.broken = self.broken or str(exc)
            elif exc.value == getattr(nv, "NVML_ERROR_GPU_IS_LOST", 15):
                if not self.gpus[i].lost:
                    self.problems.append(f"GPU {self.gpus[i].index} ({self.gpus[i].uuid}) is "
                                         "lost: it fell off the bus or its driver state is "
                                         "broken")
                self.gpus[i].lost = True
            else:  # INVALID_ARGUMENT, NOT_FOUND: gone since it was listed
                self._mig_stale = True
            return None

    def _gpm_sample(self, key: tuple[int, int]) -> tuple[float | None, float | None]:
        """Take this tick's GPM sample of a GPU instance; the graphics and SM activity
        (percent) between it and the last tick's, None at the first or where NVML refuses."""
        nv = self.nv
        pair = self._gpm[key]
        try:
            if pair[0] is None:
                pair[0], pair[1] = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
            nv.nvmlGpmMigSampleGet(self._handles[key[0]], key[1], pair[1])
            out: tuple[float | None, float | None] = (None, None)
            if pair[2]:
                get = self._gpm_get
                if get is None:
                    get = self._gpm_get = nv.c_nvmlGpmMetricsGet_t()
                    get.version = getattr(nv, "NVML_GPM_METRICS_GET_VERSION", 1)
                    get.numMetrics = 2
                    get.metrics[0].metricId = getattr(nv, "NVML_GPM_METRIC_GRAPHICS_UTIL",
                                                      GPM_GRAPHICS_UTIL)
                    get.metrics[1].metricId = getattr(nv, "NVML_GPM_METRIC_SM_UTIL",
                                                      GPM_SM_UTIL)
                get.sample1, get.sample2 = pair[0], pair[1]
                nv.nvmlGpmMetricsGet(get)
                out = (_metric(get.metrics[0]), _metric(get.metrics[1]))
        except nv.NVMLError as exc:
            if exc.value in SESSION_ERRORS:
                self.broken = self.broken or str(exc)
            elif exc.value in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_NO_PERMISSION,
                               getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)):
                self._drop_gpm(key)  # not offered here: not asked again
            else:
                self._mig_stale = True  # the GPU instance went away
            return None, None
        pair[0], pair[1], pair[2] = pair[1], pair[0], True
        return out

    def _drop_gpm(self, key: tuple[int, int]) -> None:
        pair = self._gpm.pop(key, None)
        for sample in (pair or [])[:2]:
            if sample is not None:
                with contextlib.suppress(self.nv.NVMLError):
                    self.nv.nvmlGpmSampleFree(sample)

    def _free_gpm(self) -> None:
        for key in list(self._gpm):
            self._drop_gpm(key)

    def _sample_more(self, i: int, g: GpuSample) -> None:
        """Clocks and their event reasons, the power limit, the energy counter, remapped rows
        and PCIe replays: one call each, every tick (NOT_SUPPORTED ones once)."""
        nv = self.nv
        clock = getattr(nv, "nvmlDeviceGetClockInfo", None)
        sm = self._ask(i, "sm_clock", clock, getattr(nv, "NVML_CLOCK_SM", 1))
        g.sm_clock_hz = None if sm is None else int(sm) * 1_000_000  # NVML says MHz
        mem = self._ask(i, "mem_clock", clock, getattr(nv, "NVML_CLOCK_MEM", 2))
        g.mem_clock_hz = None if mem is None else int(mem) * 1_000_000
        reasons = self._ask(i, "clock_reasons", _clock_reasons_call(nv))
        g.clock_reasons = None if reasons is None else int(reasons)
        limit = self._ask(i, "power_limit", getattr(nv, "nvmlDeviceGetEnforcedPowerLimit", None))
        g.power_limit_w = None if limit is None else int(limit) / 1000.0  # mW
        energy = self._ask(i, "energy", getattr(nv, "nvmlDeviceGetTotalEnergyConsumption", None))
        g.energy_j = None if energy is None else int(energy) / 1000.0  # mJ
        rows = self._ask(i, "remapped", getattr(nv, "nvmlDeviceGetRemappedRows", None))
        g.remapped = None if rows is None else (int(rows[0]), int(rows[1]), int(rows[2]),
                                                int(rows[3]))
        replays = self._ask(i, "pcie_replays", getattr(nv, "nvmlDeviceGetPcieReplayCounter", None))
        g.pcie_replays = None if replays is None else int(replays)

    def _drain_events(self) -> None:
        """Read the XID events that arrived since the last tick, without waiting."""
        if self._events is None:
            return
        nv = self.nv
        for _ in range(MAX_EVENTS):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError as exc:
                if exc.value in SESSION_ERRORS:
                    self.broken = self.broken or str(exc)
                    return
                if exc.value != nv.NVML_ERROR_TIMEOUT:
                    # Said once: the event set stops being read (the problem would otherwise
                    # be appended, and copied into every snapshot, at every tick).
                    self.problems.append(f"reading XID events: {exc}; XID events no longer "
                                         "watched")
                    with contextlib.suppress(nv.NVMLError):
                        nv.nvmlEventSetFree(self._events)
                    self._events = None
                return
            i = self._by_key.get(_key(data.device))
            if i is not None and data.eventType == nv.nvmlEventTypeXidCriticalError:
                from envctl.host.gpuhealth import FATAL_XIDS

                g = self.gpus[i]
                g.xid = int(data.eventData)
                g.xid_count += 1
                g.xids[g.xid] = g.xids.get(g.xid, 0) + 1
                if self.gpus[i].xid in FATAL_XIDS:
                    self.gpus[i].fatal_xids.append(self.gpus[i].xid)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        nv = self.nv
        if getattr(self, "_gpm", None):
            self._free_gpm()
        if getattr(self, "_events", None) is not None:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlEventSetFree(self._events)
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()


def _may_ask(gpu_root: Path, mode: str | None) -> tuple[ModuleType | None, str]:
    """The pynvml module when discovery's rule allows asking NVML on this host, else (None,
    why); "" why: no NVIDIA driver is loaded, nothing to say."""
    from envctl.host import gpus as hg

    mode = mode or hg.nvml_mode()
    if mode == "off":
        return None, "ENVCTL_NVML=off: GPUs are not sampled"
    if not hg.read_driver(gpu_root):
        return None, ""
    proc_gpus, _ = hg.read_proc_gpus(gpu_root)
    nodes = hg.device_nodes(gpu_root)
    missing = [n for n in ["nvidiactl"] + [f"nvidia{g.minor}" for g in proc_gpus]
               if n not in nodes]
    if missing:
        return None, (f"GPUs not sampled: {', '.join(str(gpu_root / 'dev' / n) for n in missing)}"
                      " missing (NVML would create them)")
    try:
        import pynvml
    except ImportError as exc:
        return None, f"GPUs not sampled: the pynvml module cannot be imported ({exc})"
    return pynvml, ""


def open_session(gpu_root: Path, *, mode: str | None = None) -> tuple[NvmlSession | None, str]:
    """An NVML session when discovery's rule allows asking NVML on this host, else (None, why).
    ("" why with no session: no NVIDIA driver is loaded, nothing to say.)"""
    pynvml, why = _may_ask(gpu_root, mode)
    if pynvml is None:
        return None, why
    try:
        return NvmlSession(pynvml), ""
    except pynvml.NVMLError as exc:
        return None, f"GPUs not sampled: NVML failed to initialise: {exc}"


def job_meter(gpu_root: Path, uuids: list[str]) -> tuple[JobGpuMeter | None, str]:
    """A JobGpuMeter of these GPUs when NVML may be asked here (open_session's rule), else
    (None, why the job's GPU fields stay empty)."""
    pynvml, why = _may_ask(gpu_root, None)
    if pynvml is None:
        return None, why or "no NVIDIA driver loaded: no GPU accounting"
    return JobGpuMeter(pynvml, uuids), ""


# ---------------------------------------------------------------- one job's GPU accounting


class JobGpuMeter:
    """What a job's supervisor counts of the job's GPUs (sacct's TRES gres/gpu, energy):

    - energy: the difference of nvmlDeviceGetTotalEnergyConsumption (millijoules since the
      driver loaded; Volta and newer) between the job's start and its end, per GPU. It is the
      board's, shared with whatever else ran on that GPU meanwhile.
    - peak GPU memory: sampled. nvmlDeviceGetComputeRunningProcesses every `sample()` call,
      summing usedGpuMemory of the processes that are the job's (`is_job_pid`); the largest sum
      per GPU and over all its GPUs. Not NVML's per-process accounting
      (nvmlDeviceGetAccountingStats): that needs accounting mode, which is off by default,
      host-wide, and only root may turn on; and its buffer is keyed by pids the job no
      longer has at the end. A peak between two samples is missed: it is a lower bound.

    Never raises NVMLError: what NVML cannot say stays None, with a line in `notes`."""

    def __init__(self, nvml: ModuleType, uuids: list[str]):
        self.nv = nvml
        self.notes: list[str] = []
        self.uuids = list(uuids)
        self.handles: dict[str, Any] = {}
        self.energy_start: dict[str, int | None] = {}
        self.energy_end: dict[str, int | None] = {}
        self.peak: dict[str, int] = {}
        self.peak_total: int | None = None
        self._memory_unknown = False
        self.open = False
        try:
            nvml.nvmlInit()
            self.open = True
            # By index and UUID, as NvmlSession finds them (old pynvml answers bytes).
            for index in range(nvml.nvmlDeviceGetCount()):
                h = nvml.nvmlDeviceGetHandleByIndex(index)
                u = _text(nvml.nvmlDeviceGetUUID(h))
                if u in self.uuids:
                    self.handles[u] = h
            if missing := [u for u in self.uuids if u not in self.handles]:
                self.notes.append(f"NVML does not list GPU {', '.join(missing)}")
        except nvml.NVMLError as exc:
            self.notes.append(f"NVML: {exc}; no GPU accounting")
            self.handles.clear()
        self.energy_start = self._energy()

    def _energy(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for u, h in self.handles.items():
            try:
                out[u] = int(self.nv.nvmlDeviceGetTotalEnergyConsumption(h))
            except self.nv.NVMLError as exc:
                out[u] = None
                note = f"GPU {u}: no energy counter ({exc}; Volta and newer have one)"
                if note not in self.notes:
                    self.notes.append(note)
        return out

    def sample(self, is_job_pid: Any) -> None:
        """Add one sample of the job's GPU memory (`is_job_pid(pid)`: whether a process is
        the job's)."""
        total = 0
        for u, h in self.handles.items():
            try:
                procs = self.nv.nvmlDeviceGetComputeRunningProcesses(h)
            except self.nv.NVMLError as exc:
                if not self._memory_unknown:
                    self.notes.append(f"GPU {u}: its processes cannot be listed ({exc}): no "
                                      "peak GPU memory")
                self._memory_unknown = True
                continue
            used = sum(int(p.usedGpuMemory) for p in procs or ()
                       if p.usedGpuMemory is not None and is_job_pid(int(p.pid)))
            self.peak[u] = max(self.peak.get(u, 0), used)
            total += used
        if not self._memory_unknown and self.handles:
            self.peak_total = max(self.peak_total or 0, total)

    def finish(self) -> dict[str, Any]:
        """The record's GPU fields at the job's end (gpu_seconds is the supervisor's: elapsed
        times the GPUs held, NVML or not); shuts NVML down."""
        self.energy_end = self._energy()
        usage: dict[str, dict[str, Any]] = {}
        joules: float | None = 0.0
        for u in self.uuids:
            a, b = self.energy_start.get(u), self.energy_end.get(u)
            mj = b - a if a is not None and b is not None and b >= a else None
            if mj is None:
                joules = None
            elif joules is not None:
                joules += mj / 1000.0
            usage[u] = {"energy_mj": mj, "peak_memory_bytes": None if self._memory_unknown
                        or u not in self.handles else self.peak.get(u, 0)}
        if not self.handles:
            joules = None
        if self.open:
            with contextlib.suppress(self.nv.NVMLError):
                self.nv.nvmlShutdown()
            self.open = False
        return {"gpu_energy_joules": None if joules is None else round(joules, 3),
                "gpu_peak_memory_bytes": self.peak_total if self.handles else None,
                "gpu_usage": usage, "gpu_note": "; ".join(self.notes) or None}

