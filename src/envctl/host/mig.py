"""MIG changes through NVML (the `pynvml` module of nvidia-ml-py): a GPU's MIG mode, and GPU
instances with one compute instance spanning each, found, made and destroyed by placement.

The only module that calls NVML's MIG write functions. Each call opens NVML, finds the GPU by
index and checks its UUID (an index can move between boots), and shuts NVML down again;
NVML errors become one HostError naming the GPU and the call. NVML is asked only when
discovery may ask it (host.gpus.nvml_refusal: it would create missing device nodes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envctl.errors import HostError
from envctl.host.gpus import nvml_refusal, nvml_text, profile_infos


@dataclass(frozen=True)
class GpuInstance:
    """A GPU instance at a placement, and whether its compute instance exists."""

    gi: int
    cis: int


class _Gpu:
    """One GPU, opened through NVML for the duration of a `with mig_gpu(…)` block."""

    def __init__(self, pynvml: Any, handle: Any, what: str):
        self.nvml, self.handle, self.what = pynvml, handle, what

    def fail(self, action: str, exc: Exception) -> HostError:
        return HostError(f"{action} {self.what}: {exc}")

    def mode(self) -> tuple[bool, bool]:
        """(current, pending) MIG mode."""
        current, pending = self.nvml.nvmlDeviceGetMigMode(self.handle)
        return bool(current), bool(pending)

    def processes(self) -> list[int]:
        try:
            return [int(p.pid) for p in
                    self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)]
        except self.nvml.NVMLError:
            return []

    def set_mode(self, on: bool) -> None:
        """MIG mode on or off; HostError with the reason when NVML only makes it pending (a
        GPU reset is needed) or refuses because the GPU is in use."""
        nvml = self.nvml
        action = f"turn MIG mode {'on' if on else 'off'} on"
        pids = self.processes()
        if pids:
            raise HostError(f"{action} {self.what}: processes hold the GPU (pid "
                            f"{', '.join(map(str, pids))}); stop them first")
        try:
            status = nvml.nvmlDeviceSetMigMode(
                self.handle, nvml.NVML_DEVICE_MIG_ENABLE if on else nvml.NVML_DEVICE_MIG_DISABLE)
        except nvml.NVMLError as exc:
            if exc.value == getattr(nvml, "NVML_ERROR_IN_USE", 19):
                raise HostError(f"{action} {self.what}: the GPU is in use (NVML: {exc}); "
                                "stop what holds it (nvidia-smi shows it)") from None
            raise self.fail(action, exc) from None
        if status == getattr(nvml, "NVML_ERROR_RESET_REQUIRED", 16):
            raise HostError(f"{action} {self.what}: the change is pending a GPU reset "
                            "(nvidia-smi -r, or a reboot); `up` again after it")

    def profile(self, name: str) -> Any:
        """NVML's profile info of GPU instance profile `name` (3g.71gb)."""
        infos = profile_infos(self.nvml, self.handle)
        if name not in infos:
            raise HostError(f"find MIG profile {name} on {self.what}: the driver offers "
                            f"{', '.join(infos) or 'none'}")
        return infos[name]

    def find(self, name: str, start: int) -> GpuInstance | None:
        """The GPU instance of profile `name` whose placement starts at `start`."""
        import ctypes

        nvml = self.nvml
        info = self.profile(name)
        # NVML fills a buffer as large as the profile's instance count (nvml.h), no size query.
        count = ctypes.c_uint()
        array = (nvml.c_nvmlGpuInstance_t * max(int(info.instanceCount), 1))()
        nvml.nvmlDeviceGetGpuInstances(self.handle, info.id, array, ctypes.byref(count))
        for gi in list(array)[:count.value]:
            gi_info = nvml.nvmlGpuInstanceGetInfo(gi)
            if int(gi_info.placement.start) == start:
                return GpuInstance(int(gi_info.id), len(self._cis(gi)))
        return None

    def _gi(self, gi_id: int) -> Any:
        return self.nvml.nvmlDeviceGetGpuInstanceById(self.handle, gi_id)

    def _ci_profiles(self, gi: Any) -> list[Any]:
        """The compute instance profiles NVML offers in `gi` (those it lacks are skipped)."""
        nvml = self.nvml
        out = []
        for p in range(getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 8)):
            try:
                out.append(nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, p, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED))
            except nvml.NVMLError as exc:
                if exc.value not in (nvml.NVML_ERROR_NOT_SUPPORTED,
                                     nvml.NVML_ERROR_INVALID_ARGUMENT):
                    raise
        return out

    def _cis(self, gi: Any) -> list[Any]:
        import ctypes

        nvml = self.nvml
        found = []
        for p in self._ci_profiles(gi):
            count = ctypes.c_uint()
            array = (nvml.c_nvmlComputeInstance_t * max(int(p.instanceCount), 1))()
            nvml.nvmlGpuInstanceGetComputeInstances(gi, p.id, array, ctypes.byref(count))
            found += list(array)[:count.value]
        return found

    def create(self, name: str, start: int, size: int) -> None:
        """A GPU instance of `name` at (start, size) and its full compute instance; the parts
        that exist already are kept (a run killed between the two)."""
        import ctypes

        nvml = self.nvml
        action = f"create MIG {name} at slots {start}-{start + size - 1} on"
        info = self.profile(name)
        try:
            have = self.find(name, start)
            if have is None:
                placement = nvml.c_nvmlGpuInstancePlacement_t(start, size)
                # NVML takes the placement by pointer.
                gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(self.handle, info.id,
                                                                   ctypes.byref(placement))
            else:
                gi = self._gi(have.gi)
            if have is None or not have.cis:
                # The compute instance spanning the GPU instance: as many slices as it has.
                full = [p for p in self._ci_profiles(gi) if p.sliceCount == info.sliceCount]
                if not full:
                    raise HostError(f"{action} {self.what}: no compute instance profile "
                                    f"spans a {name} instance")
                nvml.nvmlGpuInstanceCreateComputeInstance(gi, full[0].id)
        except nvml.NVMLError as exc:
            raise self.fail(action, exc) from None

    def destroy(self, name: str, start: int) -> None:
        """The GPU instance of `name` at `start`, its compute instances first; nothing when
        there is none."""
        nvml = self.nvml
        try:
            have = self.find(name, start)
            if have is None:
                return
            gi = self._gi(have.gi)
            for ci in self._cis(gi):
                nvml.nvmlComputeInstanceDestroy(ci)
            nvml.nvmlGpuInstanceDestroy(gi)
        except nvml.NVMLError as exc:
            raise self.fail(f"destroy MIG {name} at slot {start} on", exc) from None


@contextlib.contextmanager
def mig_gpu(root: Path, index: int, uuid: str) -> Iterator[_Gpu]:
    """GPU `index` through NVML, checked to be `uuid`; HostError when NVML may not or cannot
    be asked, or the GPU is another one now."""
    what = f"GPU {index} ({uuid})"
    why = nvml_refusal(root)
    if why:
        raise HostError(f"reach {what}: {why}")
    try:
        import pynvml
    except ImportError as exc:
        raise HostError(f"reach {what}: the pynvml module cannot be imported ({exc})") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise HostError(f"reach {what}: NVML failed to initialise: {exc}") from None
    try:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            have = nvml_text(pynvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError as exc:
            raise HostError(f"reach {what}: {exc}") from None
        if have != uuid:
            raise HostError(f"reach {what}: GPU {index} is {have} now")
        try:
            yield _Gpu(pynvml, handle, what)
        except pynvml.NVMLError as exc:
            raise HostError(f"{what}: {exc}") from None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
