"""The fake NVML's MIG writes (tests/fakes/pynvml): mode changes with NVML's pending and
in-use answers, GPU and compute instances at H200 placements, kept in the JSON file so that a
separate process sees them, the driver's capability files following them, and a log of every
changing call."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

from tests.fakes import gpuhost
from tests.fakes.gpuhost import PYNVML_DIR


@pytest.fixture
def nvml(monkeypatch, tmp_path):
    env = gpuhost.make_host(tmp_path / "hgx", gpus=2, numa=1, nodes=False, libraries=False)
    monkeypatch.setenv("FAKE_NVML_JSON", env["FAKE_NVML_JSON"])
    monkeypatch.syspath_prepend(str(PYNVML_DIR))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    import pynvml

    pynvml.nvmlInit()
    yield pynvml, tmp_path / "hgx"
    sys.modules.pop("pynvml", None)


def _placement(pynvml, start, size):
    return pynvml.c_nvmlGpuInstancePlacement_t(start, size)


def _state(root):
    return json.loads((root / "nvml.json").read_text())


def test_mig_mode_in_use_pending_and_at_once(nvml):
    pynvml, root = nvml
    cfg = _state(root)
    cfg["gpus"][0]["processes"] = [[4242, 1 << 20]]
    cfg["gpus"][1]["mig_reset_required"] = True  # as an A100: pending until a GPU reset
    (root / "nvml.json").write_text(json.dumps(cfg))
    with pytest.raises(pynvml.NVMLError) as exc:
        pynvml.nvmlDeviceSetMigMode(0, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert exc.value.value == pynvml.NVML_ERROR_IN_USE
    assert pynvml.nvmlDeviceSetMigMode(1, 1) == pynvml.NVML_ERROR_RESET_REQUIRED
    assert pynvml.nvmlDeviceGetMigMode(1) == [0, 1]
    cfg = _state(root)
    cfg["gpus"][0]["processes"] = []
    (root / "nvml.json").write_text(json.dumps(cfg))
    assert pynvml.nvmlDeviceSetMigMode(0, 1) == pynvml.NVML_SUCCESS  # H200: at once
    assert pynvml.nvmlDeviceGetMigMode(0) == [1, 1]
    assert [w[0] for w in _state(root)["writes"]] == ["nvmlDeviceSetMigMode"] * 2


def test_instances_at_placements_seen_by_another_process(nvml):
    pynvml, root = nvml
    pynvml.nvmlDeviceSetMigMode(0, 1)
    with pytest.raises(pynvml.NVMLError) as exc:  # MIG is off on GPU 1
        pynvml.nvmlDeviceCreateGpuInstance(1, 9)
    assert exc.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(0, 9, _placement(pynvml, 0, 4))
    with pytest.raises(pynvml.NVMLError) as exc:  # 3g.71gb starts at 0 or 4 only
        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(0, 9, _placement(pynvml, 2, 4))
    assert exc.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(pynvml.NVMLError) as exc:  # slots 0-3 are taken
        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(0, 19, _placement(pynvml, 2, 1))
    assert exc.value.value == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 2, 0)
    ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    caps = root / "proc/driver/nvidia/capabilities/gpu0/mig"
    assert (caps / "gi1/access").read_text().startswith(
        f"DeviceFileMinor: {gpuhost.gi_minor(0, 1)}\n")
    assert (caps / "gi1/ci0/access").read_text().startswith(
        f"DeviceFileMinor: {gpuhost.ci_minor(0, 1, 0)}\n")
    # A separate process (a later envctl) lists what this one made.
    code = ("import pynvml; pynvml.nvmlInit();"
            "h = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(0, 0);"
            "print(pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetName(h))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(PYNVML_DIR),
                              "FAKE_NVML_JSON": str(root / "nvml.json")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0].startswith("MIG-") and "MIG 3g.71gb" in out.stdout
    with pytest.raises(pynvml.NVMLError) as exc:  # a GPU instance with a CI is in use
        pynvml.nvmlGpuInstanceDestroy(gi)
    assert exc.value.value == pynvml.NVML_ERROR_IN_USE
    with pytest.raises(pynvml.NVMLError) as exc:  # and MIG cannot go off under it
        pynvml.nvmlDeviceSetMigMode(0, 0)
    assert exc.value.value == pynvml.NVML_ERROR_IN_USE
    pynvml.nvmlComputeInstanceDestroy(ci)
    pynvml.nvmlGpuInstanceDestroy(gi)
    assert not (caps / "gi1").exists()
    assert _state(root)["gpus"][0]["gpu_instances"] == []
    assert [w[0] for w in _state(root)["writes"]] == [
        "nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceCreateComputeInstance", "nvmlComputeInstanceDestroy",
        "nvmlGpuInstanceDestroy"]


def test_h200_profiles_and_placements_as_nvidia_smi_lists_them(nvml):
    pynvml, _ = nvml
    seen = {}
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(0, index)
        except pynvml.NVMLError:
            continue
        count = ctypes.c_uint()
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(0, info.id, None, ctypes.byref(count))
        array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(0, info.id, array,
                                                          ctypes.byref(count))
        seen[info.name] = [(p.start, p.size) for p in array]
    assert seen == {"MIG 1g.18gb": [(i, 1) for i in range(7)],
                    "MIG 1g.18gb+me": [(i, 1) for i in range(7)],
                    "MIG 1g.35gb": [(0, 2), (2, 2), (4, 2), (6, 2)],
                    "MIG 2g.35gb": [(0, 2), (2, 2), (4, 2)],
                    "MIG 3g.71gb": [(0, 4), (4, 4)], "MIG 4g.71gb": [(0, 4)],
                    "MIG 7g.141gb": [(0, 8)]}


def _with_instances(pynvml, root, gpm=True):
    cfg = _state(root)
    gis = gpuhost.layout("H200", ["3g.71gb", "1g.18gb"])
    for gi in gis:
        gi["cis"][0]["uuid"] = gpuhost.mig_uuid(0, gi["id"], 0)
    gis[0].update(used=1 << 30, processes=[[4242, 1 << 30]], gpm={"graphics": 80.0, "sm": 60.0})
    cfg["gpus"][0].update(mig=True, gpu_instances=gis, gpm=gpm)
    (root / "nvml.json").write_text(json.dumps(cfg))
    pynvml.nvmlInit()  # read the file again
    return gis


def test_a_mig_handle_reads_its_instance_and_goes_stale_with_it(nvml):
    pynvml, root = nvml
    gis = _with_instances(pynvml, root)
    h = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(0, 0)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    assert (mem.total, mem.used) == (69632 << 20, 1 << 30)
    assert [(p.pid, p.usedGpuMemory) for p in
            pynvml.nvmlDeviceGetComputeRunningProcesses(h)] == [(4242, 1 << 30)]
    # The 3g.71gb instance is destroyed: the 1g.18gb one is MIG device 0 now, and the old
    # handle names nothing (NVML's handles are the instance's, not the index's).
    cfg = _state(root)
    cfg["gpus"][0]["gpu_instances"] = [g for g in cfg["gpus"][0]["gpu_instances"]
                                       if g["id"] != gis[0]["id"]]
    (root / "nvml.json").write_text(json.dumps(cfg))
    pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError) as exc:
        pynvml.nvmlDeviceGetMemoryInfo(h)
    assert exc.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert pynvml.nvmlDeviceGetGpuInstanceId(
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(0, 0)) == gis[1]["id"]


def test_gpm_of_a_gpu_instance_between_two_samples(nvml):
    pynvml, root = nvml
    gis = _with_instances(pynvml, root)
    assert pynvml.nvmlGpmQueryDeviceSupport(0).isSupportedDevice == 1
    one, two = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    get = pynvml.c_nvmlGpmMetricsGet_t()
    get.version, get.numMetrics = pynvml.NVML_GPM_METRICS_GET_VERSION, 3
    get.metrics[0].metricId = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
    get.metrics[1].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    get.metrics[2].metricId = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    pynvml.nvmlGpmMigSampleGet(0, gis[0]["id"], one)
    get.sample1, get.sample2 = one, two
    with pytest.raises(pynvml.NVMLError):  # sample2 never taken
        pynvml.nvmlGpmMetricsGet(get)
    pynvml.nvmlGpmMigSampleGet(0, gis[0]["id"], two)
    pynvml.nvmlGpmMetricsGet(get)
    assert [(m.nvmlReturn, m.value) for m in get.metrics[:3]] == [
        (0, 80.0), (0, 60.0), (pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0)]
    get.sample1, get.sample2 = two, one  # the wrong way round
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlGpmMetricsGet(get)
    pynvml.nvmlGpmMigSampleGet(0, gis[1]["id"], one)  # another GPU instance's
    get.sample1, get.sample2 = two, one
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlGpmMetricsGet(get)
    with pytest.raises(pynvml.NVMLError) as exc:  # no such GPU instance
        pynvml.nvmlGpmMigSampleGet(0, 99, one)
    assert exc.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
    pynvml.nvmlGpmSampleFree(one)
    pynvml.nvmlGpmSampleFree(two)


def test_no_gpm_where_the_gpu_does_not_offer_it(nvml):
    pynvml, root = nvml
    gis = _with_instances(pynvml, root, gpm=False)
    assert pynvml.nvmlGpmQueryDeviceSupport(0).isSupportedDevice == 0
    with pytest.raises(pynvml.NVMLError) as exc:
        pynvml.nvmlGpmMigSampleGet(0, gis[0]["id"], pynvml.nvmlGpmSampleAlloc())
    assert exc.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
