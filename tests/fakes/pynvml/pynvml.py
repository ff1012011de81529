"""A stand-in for nvidia-ml-py's `pynvml` with exactly what envctl's GPU discovery calls,
driven by the JSON file named in FAKE_NVML_JSON:

    {"driver": "550.54.15", "bytes": false, "fail_init": false,
     "gpus": [{"uuid": "GPU-…", "name": "NVIDIA A100-SXM4-80GB", "minor": 0,
               "memory": 85899345920, "mig": false, "pci": "00000000:3B:00.0"}]}

For the monitor (envctl.monitor.nvml), a GPU may also carry what a sample reads:
`"used"` (bytes of memory used), `"util"` / `"mem_util"` (percent), `"temp"` (C), `"power"`
(milliwatts), `"ecc"` ({"sbe_vol", "dbe_vol", "sbe_agg", "dbe_agg"} counts, or null: "not
supported", as on GPUs without ECC), `"processes"` ([[pid, used bytes or null], …]) and
`"xids"` (XID numbers delivered once each through the event set, in order), `"clocks"`
({"sm": MHz, "mem": MHz}), `"clock_reasons"` (the nvmlClocksEventReason bit mask),
`"power_limit"` (milliwatts) and `"pcie_replays"` (a count); a key left out answers
NOT_SUPPORTED. For a job's
accounting (envctl.monitor.nvml.JobGpuMeter): `"energy"` (millijoules since the driver loaded:
a number, or a list read one value a call, the last one staying). A missing sample key makes
its call raise NOT_SUPPORTED.

`"live": true` makes every call read the file again (a test changes what a running job's
supervisor sees). Health (envctl.host.gpuhealth): `"remapped"` ([corrected, uncorrected,
pending, failure], as nvmlDeviceGetRemappedRows answers; missing: NOT_SUPPORTED, as before
Ampere), `"retired_pending"` (0 or 1; missing: NOT_SUPPORTED, as on Ampere and newer), and
`"lost": true`, which makes every call on that GPU raise GPU_IS_LOST.

Placement: `"cpu_affinity"` (CPU numbers) and `"memory_affinity"` (NUMA node numbers), served
as NVML's masks by nvmlDeviceGetCpuAffinity / nvmlDeviceGetMemoryAffinity (missing:
NOT_SUPPORTED).

`fail_init`: true (or an NVML_ERROR_* number) makes nvmlInit raise, as on a
host without libnvidia-ml; `"mig": null` makes nvmlDeviceGetMigMode raise NOT_SUPPORTED (a
pre-Ampere GPU);
`"mig_pending"` is the pending mode (default: the current one);
`"fail": "nvmlDeviceGetName"` makes that call raise UNKNOWN (on a GPU: `"fail": [calls]`, on
that GPU only); `"error": N` (an NVML_ERROR_* number) makes every call after nvmlInit raise N,
as after a driver reload (18, LIB_RM_VERSION_MISMATCH) or an unload (9, DRIVER_NOT_LOADED);
`bytes` returns bytes for strings, as pynvml did before nvidia-ml-py 11.515.

MIG (read paths, with nvidia-ml-py's signatures): a GPU's `"mig_profiles"` (the GPU instance
profiles by NVML profile index: id, name, slices, memory_mb, instances, placements [[start,
size], …]) and `"gpu_instances"` ([{"id", "profile" (index), "start", "size", "cis": [{"id",
"profile", "uuid": "MIG-…"}]}]), as tests/fakes/gpuhost.py writes them. MIG devices are the
compute instances, in GI-id then CI-id order. Handles are numbers: a GPU's is its index, a MIG
device's, a GPU instance's and a compute instance's are tagged above 0x10000, so a wrong kind
of handle is INVALID_ARGUMENT as in NVML. Functions that fill caller arrays take ctypes arrays
and byref(c_uint()) counts, as nvidia-ml-py's do (NULL array: the count only).

Tests put this directory first on sys.path /
PYTHONPATH so that `import pynvml` finds it. `calls` counts init and shutdown.
"""

from __future__ import annotations

import json
import os

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0
NVML_GPU_INSTANCE_PROFILE_2_SLICE = 1
NVML_GPU_INSTANCE_PROFILE_3_SLICE = 2
NVML_GPU_INSTANCE_PROFILE_4_SLICE = 3
NVML_GPU_INSTANCE_PROFILE_7_SLICE = 4
NVML_GPU_INSTANCE_PROFILE_8_SLICE = 5
NVML_GPU_INSTANCE_PROFILE_6_SLICE = 6
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 = 7
NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 = 8
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 = 9
NVML_GPU_INSTANCE_PROFILE_COUNT = 10
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
nvmlEventTypeXidCriticalError = 0x8  # noqa: N816 - pynvml's name

_STRINGS = {NVML_ERROR_UNINITIALIZED: "Uninitialized",
            NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
            NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            NVML_ERROR_NOT_FOUND: "Not Found",
            NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
            NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
            NVML_ERROR_TIMEOUT: "Timeout",
            NVML_ERROR_GPU_IS_LOST: "GPU is lost",
            NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
            NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
            NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
            NVML_ERROR_UNKNOWN: "Unknown Error"}

calls = {"init": 0, "shutdown": 0}
sampled = {"calls": 0}  # calls of the sampling functions (the monitor's), all together
_config: dict | None = None


class NVMLError(Exception):
    """As pynvml's: the error code in `.value`, its text as str()."""

    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _STRINGS.get(self.value, f"NVML Error with code {self.value}")


class c_nvmlMemory_t:  # noqa: N801 - pynvml's name
    def __init__(self, total: int, used: int = 0):
        self.total = total
        self.used = used
        self.free = total - used


class c_nvmlUtilization_t:  # noqa: N801 - pynvml's name
    def __init__(self, gpu: int, memory: int):
        self.gpu = gpu
        self.memory = memory


class c_nvmlProcessInfo_t:  # noqa: N801 - pynvml's (friendly object) fields
    def __init__(self, pid: int, used):
        self.pid = pid
        self.usedGpuMemory = used


class c_nvmlEventData_t:  # noqa: N801 - pynvml's name
    def __init__(self, device: int, event_type: int, data: int):
        self.device = device
        self.eventType = event_type
        self.eventData = data


class nvmlPciInfo_t:  # noqa: N801 - pynvml's name
    def __init__(self, bus_id):
        self.busId = bus_id


def _ctypes_types() -> dict:
    """pynvml's ctypes structures, made on first use: importing ctypes at import time would
    dlopen, which discovery's tests check it never does."""
    import ctypes

    class c_nvmlGpuInstancePlacement_t(ctypes.Structure):  # noqa: N801 - pynvml's name
        _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]

    return {"c_nvmlGpuInstancePlacement_t": c_nvmlGpuInstancePlacement_t,
            "c_nvmlComputeInstancePlacement_t": c_nvmlGpuInstancePlacement_t,  # same shape
            "c_nvmlGpuInstance_t": ctypes.c_void_p,  # opaque handles
            "c_nvmlComputeInstance_t": ctypes.c_void_p}


def __getattr__(name: str):
    if name.startswith("c_nvml") and name in (types := _ctypes_types()):
        globals().update(types)
        return types[name]
    raise AttributeError(name)


def _placement(start: int, size: int):
    # Through the module's globals once made: a second class of the same name would be
    # another type to ctypes' arrays.
    cls = globals().get("c_nvmlGpuInstancePlacement_t") or __getattr__(
        "c_nvmlGpuInstancePlacement_t")
    return cls(start, size)


class _Info:
    """pynvml's friendly structures: the fields as attributes."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


_MIG, _GI, _CI = 0x10000, 0x20000, 0x30000  # handle tags above any GPU index


def _str(value: str):
    return value.encode() if (_config or {}).get("bytes") else value


def _live() -> dict:
    global _config
    if _config is None:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    if _config.get("live"):  # read afresh at every call: a test changes it while a job runs
        with open(os.environ["FAKE_NVML_JSON"]) as f:
            _config = json.load(f)
    if _config.get("error"):
        raise NVMLError(int(_config["error"]))
    return _config


def _gpu(handle: int, call: str) -> dict:
    cfg = _live()
    if cfg.get("fail") == call:
        raise NVMLError(NVML_ERROR_UNKNOWN)
    if not isinstance(handle, int) or not 0 <= handle < len(cfg.get("gpus", [])):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if cfg["gpus"][handle].get("lost"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    if call in (cfg["gpus"][handle].get("fail") or ()):
        raise NVMLError(NVML_ERROR_UNKNOWN)
    return cfg["gpus"][handle]


def _mig_devices(gpu: dict) -> list[tuple[dict, dict]]:
    """(GPU instance, compute instance) of each MIG device, in NVML's index order."""
    if not gpu.get("mig"):
        return []
    return [(gi, ci) for gi in sorted(gpu.get("gpu_instances") or [], key=lambda g: g["id"])
            for ci in sorted(gi["cis"], key=lambda c: c["id"])]


def _mig(handle: int, call: str) -> tuple[int, dict, dict, dict]:
    """The parent index, parent, GPU instance and compute instance of a MIG device handle."""
    if not isinstance(handle, int) or handle & ~0xFFFF != _MIG:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    index, n = (handle >> 8) & 0xFF, handle & 0xFF
    gpu = _gpu(index, call)
    devices = _mig_devices(gpu)
    if n >= len(devices):  # destroyed since: the handle is stale
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return index, gpu, *devices[n]


def _profile(gpu: dict, *, index: int | None = None, pid: int | None = None) -> dict:
    for p in gpu.get("mig_profiles") or []:
        if p["index"] == index or p["id"] == pid:
            return p
    raise NVMLError(NVML_ERROR_NOT_SUPPORTED)


def _gi(handle: int, call: str) -> tuple[int, dict, dict]:
    if not isinstance(handle, int) or handle & ~0xFFFF != _GI:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    index, gi_id = (handle >> 8) & 0xFF, handle & 0xFF
    gpu = _gpu(index, call)
    for gi in gpu.get("gpu_instances") or []:
        if gi["id"] == gi_id and gpu.get("mig"):
            return index, gpu, gi
    raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)


def _fill(array, count_ref, items: list) -> None:
    """nvidia-ml-py's array-and-count convention: the count always, the items when there is
    an array large enough (INSUFFICIENT_SIZE otherwise)."""
    count = getattr(count_ref, "_obj", count_ref)
    if array is None:
        count.value = len(items)
        return
    if len(array) < len(items):
        count.value = len(items)
        raise NVMLError(NVML_ERROR_INSUFFICIENT_SIZE)
    for i, item in enumerate(items):
        array[i] = item
    count.value = len(items)


def nvmlInit() -> None:  # noqa: N802 - pynvml's names
    global _config
    with open(os.environ["FAKE_NVML_JSON"]) as f:
        cfg = json.load(f)
    fail = cfg.get("fail_init")
    if fail:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND if fail is True else int(fail))
    calls["init"] += 1
    _config = cfg


def nvmlShutdown() -> None:  # noqa: N802
    global _config
    if _config is None:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    calls["shutdown"] += 1
    _config = None


def nvmlSystemGetDriverVersion():  # noqa: N802
    return _str(_live().get("driver", ""))


def nvmlDeviceGetCount() -> int:  # noqa: N802
    return len(_live().get("gpus", []))


def nvmlDeviceGetHandleByIndex(index: int) -> int:  # noqa: N802
    _gpu(index, "nvmlDeviceGetHandleByIndex")
    return index


def nvmlDeviceGetUUID(handle: int):  # noqa: N802
    if isinstance(handle, int) and handle & ~0xFFFF == _MIG:
        return _str(_mig(handle, "nvmlDeviceGetUUID")[3]["uuid"])
    return _str(_gpu(handle, "nvmlDeviceGetUUID")["uuid"])


def nvmlDeviceGetName(handle: int):  # noqa: N802
    if isinstance(handle, int) and handle & ~0xFFFF == _MIG:
        _, gpu, gi, _ = _mig(handle, "nvmlDeviceGetName")
        return _str(f"{gpu['name']} MIG {_profile(gpu, index=gi['profile'])['name']}")
    return _str(_gpu(handle, "nvmlDeviceGetName")["name"])


def nvmlDeviceGetMinorNumber(handle: int) -> int:  # noqa: N802
    return int(_gpu(handle, "nvmlDeviceGetMinorNumber")["minor"])


def nvmlDeviceGetMemoryInfo(handle: int) -> c_nvmlMemory_t:  # noqa: N802
    if isinstance(handle, int) and handle & ~0xFFFF == _MIG:
        _, gpu, gi, _ = _mig(handle, "nvmlDeviceGetMemoryInfo")
        return c_nvmlMemory_t(_profile(gpu, index=gi["profile"])["memory_mb"] << 20)
    gpu = _gpu(handle, "nvmlDeviceGetMemoryInfo")
    return c_nvmlMemory_t(int(gpu["memory"]), int(gpu.get("used", 0)))


def nvmlDeviceGetMigMode(handle: int) -> list[int]:  # noqa: N802
    mig = _gpu(handle, "nvmlDeviceGetMigMode").get("mig", False)
    if mig is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    pending = _live()["gpus"][handle].get("mig_pending", mig)
    return [NVML_DEVICE_MIG_ENABLE if mig else NVML_DEVICE_MIG_DISABLE,
            NVML_DEVICE_MIG_ENABLE if pending else NVML_DEVICE_MIG_DISABLE]  # current, pending


# ---------------------------------------------------------------- MIG (read paths)


def nvmlDeviceGetMaxMigDeviceCount(handle: int) -> int:  # noqa: N802
    gpu = _gpu(handle, "nvmlDeviceGetMaxMigDeviceCount")
    if gpu.get("mig") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return max((p["instances"] for p in gpu.get("mig_profiles") or []), default=0)


def nvmlDeviceGetMigDeviceHandleByIndex(handle: int, index: int) -> int:  # noqa: N802
    gpu = _gpu(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
    if gpu.get("mig") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    if not 0 <= index < nvmlDeviceGetMaxMigDeviceCount(handle):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if index >= len(_mig_devices(gpu)):
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    return _MIG | handle << 8 | index


def nvmlDeviceIsMigDeviceHandle(handle: int) -> int:  # noqa: N802
    _live()
    return int(isinstance(handle, int) and handle & ~0xFFFF == _MIG)


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle: int) -> int:  # noqa: N802
    return _mig(handle, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle")[0]


def nvmlDeviceGetGpuInstanceId(handle: int) -> int:  # noqa: N802
    return int(_mig(handle, "nvmlDeviceGetGpuInstanceId")[2]["id"])


def nvmlDeviceGetComputeInstanceId(handle: int) -> int:  # noqa: N802
    return int(_mig(handle, "nvmlDeviceGetComputeInstanceId")[3]["id"])


def nvmlDeviceGetGpuInstanceProfileInfo(handle: int, profile: int, version: int = 2):  # noqa: N802
    p = _profile(_gpu(handle, "nvmlDeviceGetGpuInstanceProfileInfo"), index=profile)
    info = _Info(id=p["id"], isP2pSupported=0, sliceCount=p["slices"],
                 instanceCount=p["instances"], multiprocessorCount=16 * p["slices"],
                 copyEngineCount=p["slices"], decoderCount=p["slices"],
                 encoderCount=0, jpegCount=p["slices"], ofaCount=int(p["slices"] == 7),
                 memorySizeMB=p["memory_mb"])
    if version == 2:  # v2 adds the name, as nvidia-smi mig -lgip prints it
        info.version, info.name = 2, _str(f"MIG {p['name']}")
    return info


def nvmlDeviceGetGpuInstancePossiblePlacements(handle: int, profileId: int,  # noqa: N802, N803
                                               placementsRef, countRef) -> int:
    p = _profile(_gpu(handle, "nvmlDeviceGetGpuInstancePossiblePlacements"), pid=profileId)
    _fill(placementsRef, countRef,
          [_placement(start, size) for start, size in p["placements"]])
    return NVML_SUCCESS


def nvmlDeviceGetGpuInstanceRemainingCapacity(handle: int, profileId: int) -> int:  # noqa: N802, N803
    gpu = _gpu(handle, "nvmlDeviceGetGpuInstanceRemainingCapacity")
    p = _profile(gpu, pid=profileId)
    used = {s for gi in gpu.get("gpu_instances") or []
            for s in range(gi["start"], gi["start"] + gi["size"])}
    free = sum(1 for start, size in p["placements"] if not used & set(range(start, start + size)))
    same = sum(1 for gi in gpu.get("gpu_instances") or [] if gi["profile"] == p["index"])
    return min(free, p["instances"] - same) if gpu.get("mig") else 0


def nvmlDeviceGetGpuInstances(handle: int, profileId: int, gpuInstancesRef,  # noqa: N802, N803
                              countRef) -> int:
    gpu = _gpu(handle, "nvmlDeviceGetGpuInstances")
    p = _profile(gpu, pid=profileId)
    found = [_GI | handle << 8 | gi["id"] for gi in sorted(
        gpu.get("gpu_instances") or [], key=lambda g: g["id"]) if gi["profile"] == p["index"]]
    _fill(gpuInstancesRef, countRef, found if gpu.get("mig") else [])
    return NVML_SUCCESS


def nvmlDeviceGetGpuInstanceById(handle: int, gi_id: int) -> int:  # noqa: N802
    gpu = _gpu(handle, "nvmlDeviceGetGpuInstanceById")
    if not gpu.get("mig"):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if not any(gi["id"] == gi_id for gi in gpu.get("gpu_instances") or []):
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    return _GI | handle << 8 | gi_id


def nvmlGpuInstanceGetInfo(gpuInstance: int):  # noqa: N802, N803
    index, gpu, gi = _gi(gpuInstance, "nvmlGpuInstanceGetInfo")
    return _Info(device=index, id=gi["id"], profileId=_profile(gpu, index=gi["profile"])["id"],
                 placement=_Info(start=gi["start"], size=gi["size"]))


def nvmlGpuInstanceGetComputeInstances(gpuInstance: int, profileId: int,  # noqa: N802, N803
                                       computeInstancesRef, countRef) -> int:
    index, _, gi = _gi(gpuInstance, "nvmlGpuInstanceGetComputeInstances")
    found = [_CI | index << 12 | gi["id"] << 4 | ci["id"]
             for ci in sorted(gi["cis"], key=lambda c: c["id"]) if ci["profile"] == profileId]
    _fill(computeInstancesRef, countRef, found)
    return NVML_SUCCESS


def nvmlComputeInstanceGetInfo(computeInstance: int):  # noqa: N802, N803
    if not isinstance(computeInstance, int) or computeInstance & ~0xFFFF != _CI:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    index, gi_id, ci_id = (computeInstance >> 12) & 0xF, (computeInstance >> 4) & 0xFF, \
        computeInstance & 0xF
    _, gpu, gi = _gi(_GI | index << 8 | gi_id, "nvmlComputeInstanceGetInfo")
    for ci in gi["cis"]:
        if ci["id"] == ci_id:
            return _Info(device=index, gpuInstance=_GI | index << 8 | gi_id, id=ci_id,
                         profileId=ci["profile"],
                         placement=_Info(start=0, size=gi["size"]))
    raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)


def nvmlDeviceGetPciInfo(handle: int) -> nvmlPciInfo_t:  # noqa: N802
    # NVML writes an 8-digit domain and upper-case hex: 00000000:3B:00.0.
    return nvmlPciInfo_t(_str(_gpu(handle, "nvmlDeviceGetPciInfo")["pci"]))


# ---------------------------------------------------------------- affinity (placement)

NVML_AFFINITY_SCOPE_NODE = 0
NVML_AFFINITY_SCOPE_SOCKET = 1


def _mask(items: list[int], words: int) -> list[int]:
    """A list of numbers as NVML's mask of `words` unsigned longs (64 bits each)."""
    out = [0] * words
    for n in items:
        if n < 64 * words:
            out[n // 64] |= 1 << (n % 64)
    return out


def nvmlDeviceGetCpuAffinity(handle: int, cpuSetSize: int) -> list[int]:  # noqa: N802, N803
    gpu = _gpu(handle, "nvmlDeviceGetCpuAffinity")
    if gpu.get("cpu_affinity") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return _mask(gpu["cpu_affinity"], cpuSetSize)


def nvmlDeviceGetMemoryAffinity(handle: int, nodeSetSize: int, scope: int) -> list[int]:  # noqa: N802, N803
    gpu = _gpu(handle, "nvmlDeviceGetMemoryAffinity")
    if gpu.get("memory_affinity") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    if scope not in (NVML_AFFINITY_SCOPE_NODE, NVML_AFFINITY_SCOPE_SOCKET):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _mask(gpu["memory_affinity"], nodeSetSize)


# ---------------------------------------------------------------- what the monitor samples


def _sampled(handle: int, call: str, key: str):
    gpu = _gpu(handle, call)
    sampled["calls"] += 1
    if gpu.get(key) is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return gpu[key]


def nvmlDeviceGetUtilizationRates(handle: int) -> c_nvmlUtilization_t:  # noqa: N802
    util = _sampled(handle, "nvmlDeviceGetUtilizationRates", "util")
    return c_nvmlUtilization_t(int(util), int(_live()["gpus"][handle].get("mem_util", 0)))


def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:  # noqa: N802
    if sensor != NVML_TEMPERATURE_GPU:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return int(_sampled(handle, "nvmlDeviceGetTemperature", "temp"))


def nvmlDeviceGetPowerUsage(handle: int) -> int:  # noqa: N802
    return int(_sampled(handle, "nvmlDeviceGetPowerUsage", "power"))


def nvmlDeviceGetTotalEccErrors(handle: int, error_type: int, counter_type: int) -> int:  # noqa: N802
    ecc = _sampled(handle, "nvmlDeviceGetTotalEccErrors", "ecc")
    key = ("sbe" if error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED else "dbe") + (
        "_vol" if counter_type == NVML_VOLATILE_ECC else "_agg")
    return int(ecc.get(key, 0))


def nvmlDeviceGetClockInfo(handle: int, clock_type: int) -> int:  # noqa: N802
    clocks = _sampled(handle, "nvmlDeviceGetClockInfo", "clocks")
    key = {NVML_CLOCK_SM: "sm", NVML_CLOCK_MEM: "mem"}.get(clock_type)
    if key is None or key not in clocks:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return int(clocks[key])  # MHz


def nvmlDeviceGetCurrentClocksEventReasons(handle: int) -> int:  # noqa: N802
    return int(_sampled(handle, "nvmlDeviceGetCurrentClocksEventReasons", "clock_reasons"))


def nvmlDeviceGetEnforcedPowerLimit(handle: int) -> int:  # noqa: N802
    return int(_sampled(handle, "nvmlDeviceGetEnforcedPowerLimit", "power_limit"))  # mW


def nvmlDeviceGetPcieReplayCounter(handle: int) -> int:  # noqa: N802
    return int(_sampled(handle, "nvmlDeviceGetPcieReplayCounter", "pcie_replays"))


def nvmlDeviceGetRemappedRows(handle: int) -> tuple:  # noqa: N802
    return tuple(int(x) for x in _sampled(handle, "nvmlDeviceGetRemappedRows", "remapped"))


def nvmlDeviceGetRetiredPagesPendingStatus(handle: int) -> int:  # noqa: N802
    return int(_sampled(handle, "nvmlDeviceGetRetiredPagesPendingStatus", "retired_pending"))


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list:  # noqa: N802
    procs = _sampled(handle, "nvmlDeviceGetComputeRunningProcesses", "processes")
    return [c_nvmlProcessInfo_t(int(pid), used) for pid, used in procs]


def nvmlDeviceGetTotalEnergyConsumption(handle: int) -> int:  # noqa: N802
    energy = _sampled(handle, "nvmlDeviceGetTotalEnergyConsumption", "energy")
    if isinstance(energy, list):
        return int(energy.pop(0) if len(energy) > 1 else energy[0])
    return int(energy)


_event_sets: dict[int, list[int]] = {}


def nvmlEventSetCreate() -> int:  # noqa: N802
    _live()
    handle = len(_event_sets) + 1000
    _event_sets[handle] = []
    return handle


def nvmlDeviceRegisterEvents(handle: int, event_types: int, event_set: int) -> None:  # noqa: N802
    gpu = _gpu(handle, "nvmlDeviceRegisterEvents")
    if gpu.get("xids") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    _event_sets[event_set].append(handle)


def nvmlEventSetWait_v2(event_set: int, timeoutms: int) -> c_nvmlEventData_t:  # noqa: N802
    cfg = _live()
    for handle in _event_sets[event_set]:
        pending = cfg["gpus"][handle].get("xids") or []
        if pending:
            return c_nvmlEventData_t(handle, nvmlEventTypeXidCriticalError, pending.pop(0))
    raise NVMLError(NVML_ERROR_TIMEOUT)


def nvmlEventSetWait(event_set: int, timeoutms: int) -> c_nvmlEventData_t:  # noqa: N802
    return nvmlEventSetWait_v2(event_set, timeoutms)


def nvmlEventSetFree(event_set: int) -> None:  # noqa: N802
    _event_sets.pop(event_set, None)
