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
compute instances, in GI-id then CI-id order. A GPU instance may carry what the monitor samples
of it through a MIG device handle: `"used"` (bytes of its memory used) and `"processes"`
([[pid, used bytes or null], …], as nvmlDeviceGetComputeRunningProcesses on the MIG handle
answers), and `"gpm"` (GPM, below). Handles are numbers: a GPU's is its index, a MIG
device's, a GPU instance's and a compute instance's are tagged above 0x10000, so a wrong kind
of handle is INVALID_ARGUMENT as in NVML. Functions that fill caller arrays take ctypes arrays
and byref(c_uint()) counts, as nvidia-ml-py's do (NULL array: the count only).

MIG (write paths): nvmlDeviceSetMigMode (IN_USE while `"processes"` hold the GPU; with
`"mig_reset_required": true` the new mode is only pending and the activation status is
RESET_REQUIRED, as on an A100; an H100/H200 changes at once), nvmlDeviceCreateGpuInstance
[WithPlacement] (the profiles' own placements; INSUFFICIENT_RESOURCES on taken slots),
nvmlGpuInstanceCreateComputeInstance (the full-size one), nvmlComputeInstanceDestroy and
nvmlGpuInstanceDestroy (IN_USE while it has compute instances). Each is written back to the
JSON file under a lock (separate processes see it), appended to its `"writes"` log, and
mirrored in the fake tree's capabilities/gpuN/mig/giX[/ciY]/access files. Profiles and
placements: tests/fakes/gpuhost.py (NVIDIA's MIG user guide, "Supported MIG Profiles",
https://docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html).

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
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
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
NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 8
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
            NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
            NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
            NVML_ERROR_IN_USE: "Resource in use",
            NVML_ERROR_INSUFFICIENT_RESOURCES: "Insufficient resources",
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
    index, gi_id, ci_id = (handle >> 8) & 0xFF, (handle >> 4) & 0xF, handle & 0xF
    gpu = _gpu(index, call)
    for gi, ci in _mig_devices(gpu):
        if (gi["id"], ci["id"]) == (gi_id, ci_id):
            return index, gpu, gi, ci
    raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # destroyed since: the handle is stale


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
        sampled["calls"] += 1
        return c_nvmlMemory_t(_profile(gpu, index=gi["profile"])["memory_mb"] << 20,
                              int(gi.get("used", 0)))
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
    devices = _mig_devices(gpu)
    if index >= len(devices):
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    # The handle names the instance, not the index: once it is destroyed the handle is
    # stale (INVALID_ARGUMENT), as NVML's own, even when another device takes its index.
    gi, ci = devices[index]
    return _MIG | handle << 8 | gi["id"] << 4 | ci["id"]


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
    if isinstance(handle, int) and handle & ~0xFFFF == _MIG:  # the GPU instance's own
        _, _, gi, _ = _mig(handle, "nvmlDeviceGetComputeRunningProcesses")
        sampled["calls"] += 1
        return [c_nvmlProcessInfo_t(int(pid), used) for pid, used in gi.get("processes") or ()]
    procs = _sampled(handle, "nvmlDeviceGetComputeRunningProcesses", "processes")
    return [c_nvmlProcessInfo_t(int(pid), used) for pid, used in procs]


def nvmlDeviceGetTotalEnergyConsumption(handle: int) -> int:  # noqa: N802
    energy = _sampled(handle, "nvmlDeviceGetTotalEnergyConsumption", "energy")
    if isinstance(energy, list):
        return int(energy.pop(0) if len(energy) > 1 else energy[0])
    return int(energy)


# ---------------------------------------------------------------- GPM (Hopper and newer)
# A GPU with `"gpm": true` offers GPM; a GPU instance's `"gpm"` ({"graphics": %, "sm": %}) is
# its activity, read by nvmlGpmMigSampleGet into a sample. nvmlGpmMetricsGet answers, per
# metric, the newer sample's activity (NVML computes it from the two samples' counters; the
# fake has no clock): NOT_SUPPORTED in the metric for an id it does not know, and
# INVALID_ARGUMENT for a sample never filled, two samples of different GPU instances, or a
# sample2 not taken after sample1 (NVML computes the activity over sample1 -> sample2).

NVML_GPM_METRIC_GRAPHICS_UTIL = 1
NVML_GPM_METRIC_SM_UTIL = 2
NVML_GPM_METRIC_SM_OCCUPANCY = 3
NVML_GPM_METRIC_MAX = 477
NVML_GPM_METRICS_GET_VERSION = 1
NVML_GPM_SUPPORT_VERSION = 1
_GPM_KEYS = {NVML_GPM_METRIC_GRAPHICS_UTIL: "graphics", NVML_GPM_METRIC_SM_UTIL: "sm"}


class _GpmSample:
    """nvmlGpmSample_t: opaque; here what nvmlGpmMigSampleGet read."""

    def __init__(self):
        self.source: tuple[int, int] | None = None  # (GPU index, GPU instance id)
        self.values: dict = {}
        self.taken = 0  # the order samples were taken in (NVML's timestamps)
        self.freed = False


class c_nvmlGpmMetric_t:  # noqa: N801 - pynvml's name
    def __init__(self):
        self.metricId, self.nvmlReturn, self.value = 0, NVML_SUCCESS, 0.0


class c_nvmlGpmMetricsGet_t:  # noqa: N801 - pynvml's name
    def __init__(self):
        self.version, self.numMetrics = 0, 0
        self.sample1 = self.sample2 = None
        self.metrics = [c_nvmlGpmMetric_t() for _ in range(NVML_GPM_METRIC_MAX)]


gpm = {"samples": 0, "alloc": 0, "free": 0}  # what tests count


def nvmlGpmQueryDeviceSupport(device: int):  # noqa: N802
    gpu = _gpu(device, "nvmlGpmQueryDeviceSupport")
    return _Info(version=NVML_GPM_SUPPORT_VERSION, isSupportedDevice=int(bool(gpu.get("gpm"))))


def nvmlGpmSampleAlloc():  # noqa: N802
    _live()
    gpm["alloc"] += 1
    return _GpmSample()


def nvmlGpmSampleFree(gpmSample) -> None:  # noqa: N802, N803
    if not isinstance(gpmSample, _GpmSample) or gpmSample.freed:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    gpmSample.freed = True
    gpm["free"] += 1


def nvmlGpmMigSampleGet(device: int, gpuInstanceId: int, gpmSample):  # noqa: N802, N803
    gpu = _gpu(device, "nvmlGpmMigSampleGet")
    if not gpu.get("gpm"):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    if not isinstance(gpmSample, _GpmSample) or gpmSample.freed:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    for gi in gpu.get("gpu_instances") or [] if gpu.get("mig") else []:
        if gi["id"] == gpuInstanceId:
            gpm["samples"] += 1
            gpmSample.source, gpmSample.values = (device, gpuInstanceId), dict(gi.get("gpm") or {})
            gpmSample.taken = gpm["samples"]
            return gpmSample
    raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)


def nvmlGpmMetricsGet(metricsGet):  # noqa: N802, N803
    _live()
    one, two = metricsGet.sample1, metricsGet.sample2
    if metricsGet.version != NVML_GPM_METRICS_GET_VERSION:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if not all(isinstance(x, _GpmSample) and x.source and not x.freed for x in (one, two)) \
            or one.source != two.source or one.taken >= two.taken:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    for metric in metricsGet.metrics[:metricsGet.numMetrics]:
        key = _GPM_KEYS.get(metric.metricId)
        if key is None or key not in two.values:
            metric.nvmlReturn, metric.value = NVML_ERROR_NOT_SUPPORTED, 0.0
        else:
            metric.nvmlReturn, metric.value = NVML_SUCCESS, float(two.values[key])
    return metricsGet


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


# ---------------------------------------------------------------- MIG (write paths)
#
# As NVML does them (nvml.h, "MIG Management"): each change is read-modify-written to the JSON
# file under a lock, so separate processes see what earlier ones made, and logged in its
# "writes" list ([call, GPU index, …]) for tests to assert on what changed. The driver's
# capability files (proc/driver/nvidia/capabilities/gpuN/mig/giX[/ciY]/access) of the fake
# tree that holds the JSON file follow the instances, as nvidia.ko's do.


def _mutate(call: str, handle: int, change) -> object:
    """Run change(gpu dict) on GPU `handle` of the file's current state and save it."""
    import fcntl

    global _config
    _live()
    path = os.environ["FAKE_NVML_JSON"]
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(path) as f:
            fresh = json.load(f)
        _config = fresh  # what other processes wrote since this one's nvmlInit
        gpu = _gpu(handle, call)
        result = change(gpu)
        fresh.setdefault("writes", []).append([call, handle])
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(fresh, f, indent=1)
        os.replace(tmp, path)
    return result


def _caps_dir(gpu: dict) -> str | None:
    """The fake tree's proc/driver/nvidia/capabilities/gpu<minor>/mig (None: no tree)."""
    root = _live().get("root") or os.path.dirname(os.environ["FAKE_NVML_JSON"])
    nv = os.path.join(root, "proc", "driver", "nvidia")
    if not os.path.isdir(nv):
        return None
    return os.path.join(nv, "capabilities", f"gpu{gpu['minor']}", "mig")


def _minor_of(gpu: dict, key: str) -> int | None:
    root = _live().get("root") or os.path.dirname(os.environ["FAKE_NVML_JSON"])
    try:
        with open(os.path.join(root, "proc", "driver", "nvidia-caps", "mig-minors")) as f:
            for line in f:
                name, _, minor = line.strip().rpartition(" ")
                if name == f"gpu{gpu['minor']}/{key}":
                    return int(minor)
    except FileNotFoundError:
        pass
    return None


def _write_cap(gpu: dict, key: str) -> None:
    """The access file of capability `key` (gi3/access, gi3/ci0/access), mode 0444 (292)."""
    base = _caps_dir(gpu)
    minor = _minor_of(gpu, key)
    if base is None or minor is None:
        return
    path = os.path.join(base, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")


def _drop_cap(gpu: dict, key: str) -> None:
    import shutil

    base = _caps_dir(gpu)
    if base is not None:
        shutil.rmtree(os.path.join(base, os.path.dirname(key)), ignore_errors=True)


def nvmlDeviceSetMigMode(handle: int, mode: int) -> int:  # noqa: N802
    """Returns the activation status: NVML_SUCCESS, or NVML_ERROR_RESET_REQUIRED when the
    mode is only pending (`"mig_reset_required": true`, as A100s need a GPU reset; an
    H100/H200 changes at once). IN_USE while processes hold the GPU (`"processes"`) or, to
    turn it off, while GPU instances exist."""
    if mode not in (NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    def change(gpu: dict) -> int:
        if gpu.get("mig") is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if gpu.get("processes") or (mode == NVML_DEVICE_MIG_DISABLE
                                    and gpu.get("gpu_instances")):
            raise NVMLError(NVML_ERROR_IN_USE)
        gpu["mig_pending"] = bool(mode)
        if gpu.get("mig_reset_required"):
            return NVML_ERROR_RESET_REQUIRED
        gpu["mig"] = bool(mode)
        return NVML_SUCCESS

    return _mutate("nvmlDeviceSetMigMode", handle, change)


def _gi_id(size: int, start: int) -> int:
    # One id per slot, as tests/fakes/gpuhost.py lays them out: 7g 0, 3g/4g 1-2, 2g 3-6, 1g 7-13.
    return {8: 0, 4: 1 + start // 4, 2: 3 + start // 2}.get(size, 7 + start)


def _create_gi(call: str, handle: int, profile_id: int, placement) -> int:
    def change(gpu: dict) -> int:
        if not gpu.get("mig"):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        p = _profile(gpu, pid=profile_id)
        gis = gpu.setdefault("gpu_instances", [])
        used = {s for gi in gis for s in range(gi["start"], gi["start"] + gi["size"])}
        if sum(1 for gi in gis if gi["profile"] == p["index"]) >= p["instances"]:
            raise NVMLError(NVML_ERROR_INSUFFICIENT_RESOURCES)
        if placement is None:
            free = [(s, n) for s, n in p["placements"] if not used & set(range(s, s + n))]
            if not free:
                raise NVMLError(NVML_ERROR_INSUFFICIENT_RESOURCES)
            start, size = free[0]
        else:
            start, size = placement.start, placement.size
            if [start, size] not in [list(x) for x in p["placements"]]:
                raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
            if used & set(range(start, start + size)):
                raise NVMLError(NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = _gi_id(size, start)
        gis.append({"id": gi_id, "profile": p["index"], "start": start, "size": size,
                    "cis": []})
        _write_cap(gpu, f"gi{gi_id}/access")
        return _GI | handle << 8 | gi_id

    return _mutate(call, handle, change)


def nvmlDeviceCreateGpuInstance(handle: int, profileId: int) -> int:  # noqa: N802, N803
    """At the first free placement of the profile, as NVML picks one."""
    return _create_gi("nvmlDeviceCreateGpuInstance", handle, profileId, None)


def nvmlDeviceCreateGpuInstanceWithPlacement(handle: int, profileId: int,  # noqa: N802, N803
                                             placement) -> int:
    """placement: a c_nvmlGpuInstancePlacement_t (or byref() of one)."""
    return _create_gi("nvmlDeviceCreateGpuInstanceWithPlacement", handle, profileId,
                      getattr(placement, "_obj", placement))


def nvmlGpuInstanceGetComputeInstanceProfileInfo(gpuInstance: int, profile: int,  # noqa: N802, N803
                                                 engProfile: int):  # noqa: N803
    """Only the compute instance profile that spans its GPU instance (the one envctl makes);
    smaller ones answer NOT_SUPPORTED here."""
    _, gpu, gi = _gi(gpuInstance, "nvmlGpuInstanceGetComputeInstanceProfileInfo")
    p = _profile(gpu, index=gi["profile"])
    if profile != p["ci_profile"] or engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return _Info(id=profile, sliceCount=p["slices"], instanceCount=1,
                 multiprocessorCount=16 * p["slices"])


def nvmlGpuInstanceCreateComputeInstance(gpuInstance: int, profileId: int) -> int:  # noqa: N802, N803
    index, _, gi_known = _gi(gpuInstance, "nvmlGpuInstanceCreateComputeInstance")

    def change(gpu: dict) -> int:
        gi = next((g for g in gpu.get("gpu_instances") or [] if g["id"] == gi_known["id"]),
                  None)
        if gi is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if profileId != _profile(gpu, index=gi["profile"])["ci_profile"]:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if gi["cis"]:  # the full-size compute instance fills its GPU instance
            raise NVMLError(NVML_ERROR_INSUFFICIENT_RESOURCES)
        serial = _config.get("mig_serial", 0) + 1
        _config["mig_serial"] = serial
        digit = "123456789abcdef0"[index % 16]
        gi["cis"].append({"id": 0, "profile": profileId,
                          "uuid": f"MIG-{digit * 8}-{gi['id']:04x}-0000-{serial:04x}-"
                                  f"{index:012x}"})
        _write_cap(gpu, f"gi{gi['id']}/ci0/access")
        return _CI | index << 12 | gi["id"] << 4

    return _mutate("nvmlGpuInstanceCreateComputeInstance", index, change)


def nvmlGpuInstanceDestroy(gpuInstance: int) -> None:  # noqa: N802, N803
    """IN_USE while it has compute instances, as NVML refuses."""
    index, _, gi_known = _gi(gpuInstance, "nvmlGpuInstanceDestroy")

    def change(gpu: dict) -> None:
        gis = gpu.get("gpu_instances") or []
        gi = next((g for g in gis if g["id"] == gi_known["id"]), None)
        if gi is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if gi["cis"]:
            raise NVMLError(NVML_ERROR_IN_USE)
        gis.remove(gi)
        _drop_cap(gpu, f"gi{gi['id']}/access")

    _mutate("nvmlGpuInstanceDestroy", index, change)


def nvmlComputeInstanceDestroy(computeInstance: int) -> None:  # noqa: N802, N803
    info = nvmlComputeInstanceGetInfo(computeInstance)
    index, gi_id, ci_id = info.device, computeInstance >> 4 & 0xFF, info.id

    def change(gpu: dict) -> None:
        gi = next((g for g in gpu.get("gpu_instances") or [] if g["id"] == gi_id), None)
        ci = next((c for c in (gi or {}).get("cis", []) if c["id"] == ci_id), None)
        if ci is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gi["cis"].remove(ci)
        _drop_cap(gpu, f"gi{gi_id}/ci{ci_id}/access")

    _mutate("nvmlComputeInstanceDestroy", index, change)
