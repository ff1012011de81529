"""A stand-in for nvidia-ml-py's `pynvml` with exactly what envctl's GPU discovery calls,
driven by the JSON file named in FAKE_NVML_JSON:

    {"driver": "550.54.15", "bytes": false, "fail_init": false,
     "gpus": [{"uuid": "GPU-…", "name": "NVIDIA A100-SXM4-80GB", "minor": 0,
               "memory": 85899345920, "mig": false, "pci": "00000000:3B:00.0"}]}

For the monitor (envctl.monitor.nvml), a GPU may also carry what a sample reads:
`"used"` (bytes of memory used), `"util"` / `"mem_util"` (percent), `"temp"` (C), `"power"`
(milliwatts), `"ecc"` ({"sbe_vol", "dbe_vol", "sbe_agg", "dbe_agg"} counts, or null: "not
supported", as on GPUs without ECC), `"processes"` ([[pid, used bytes or null], …]) and
`"xids"` (XID numbers delivered once each through the event set, in order). For a job's
accounting (envctl.monitor.nvml.JobGpuMeter): `"energy"` (millijoules since the driver loaded:
a number, or a list read one value a call, the last one staying). A missing sample key makes
its call raise NOT_SUPPORTED.

`"live": true` makes every call read the file again (a test changes what a running job's
supervisor sees). `fail_init`: true (or an NVML_ERROR_* number) makes nvmlInit raise, as on a
host without libnvidia-ml; `"mig": null` makes nvmlDeviceGetMigMode raise NOT_SUPPORTED (a
pre-Ampere GPU);
`"fail": "nvmlDeviceGetName"` makes that call raise UNKNOWN; `bytes` returns bytes for strings,
as pynvml did before nvidia-ml-py 11.515. Tests put this directory first on sys.path /
PYTHONPATH so that `import pynvml` finds it. `calls` counts init and shutdown.
"""

from __future__ import annotations

import json
import os

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_TEMPERATURE_GPU = 0
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
nvmlEventTypeXidCriticalError = 0x8  # noqa: N816 - pynvml's name

_STRINGS = {NVML_ERROR_UNINITIALIZED: "Uninitialized",
            NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
            NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
            NVML_ERROR_TIMEOUT: "Timeout",
            NVML_ERROR_GPU_IS_LOST: "GPU is lost",
            NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
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


def _str(value: str):
    return value.encode() if (_config or {}).get("bytes") else value


def _live() -> dict:
    global _config
    if _config is None:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    if _config.get("live"):  # read afresh at every call: a test changes it while a job runs
        with open(os.environ["FAKE_NVML_JSON"]) as f:
            _config = json.load(f)
    return _config


def _gpu(handle: int, call: str) -> dict:
    cfg = _live()
    if cfg.get("fail") == call:
        raise NVMLError(NVML_ERROR_UNKNOWN)
    if not isinstance(handle, int) or not 0 <= handle < len(cfg.get("gpus", [])):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return cfg["gpus"][handle]


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
    _live()
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
    return _str(_gpu(handle, "nvmlDeviceGetUUID")["uuid"])


def nvmlDeviceGetName(handle: int):  # noqa: N802
    return _str(_gpu(handle, "nvmlDeviceGetName")["name"])


def nvmlDeviceGetMinorNumber(handle: int) -> int:  # noqa: N802
    return int(_gpu(handle, "nvmlDeviceGetMinorNumber")["minor"])


def nvmlDeviceGetMemoryInfo(handle: int) -> c_nvmlMemory_t:  # noqa: N802
    gpu = _gpu(handle, "nvmlDeviceGetMemoryInfo")
    return c_nvmlMemory_t(int(gpu["memory"]), int(gpu.get("used", 0)))


def nvmlDeviceGetMigMode(handle: int) -> list[int]:  # noqa: N802
    mig = _gpu(handle, "nvmlDeviceGetMigMode").get("mig", False)
    if mig is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    mode = NVML_DEVICE_MIG_ENABLE if mig else NVML_DEVICE_MIG_DISABLE
    return [mode, mode]  # [current, pending]


def nvmlDeviceGetPciInfo(handle: int) -> nvmlPciInfo_t:  # noqa: N802
    # NVML writes an 8-digit domain and upper-case hex: 00000000:3B:00.0.
    return nvmlPciInfo_t(_str(_gpu(handle, "nvmlDeviceGetPciInfo")["pci"]))


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
