"""The monitor's MIG instances (monitor/nvml.py's MigSample) with the fake pynvml: each
instance's memory and processes through its MIG device handle, its utilisation through GPM
(nvmlGpmMigSampleGet on the parent, nvmlGpmMetricsGet between two ticks' samples), the
processes' memory attributed to the environment holding the instance, and the Prometheus
series, CSV rows and `top` rows they become, labelled as dcgm-exporter labels MIG instances."""

from __future__ import annotations

import json

from rich.console import Console

from envctl.monitor import csvout, top
from envctl.monitor.nvml import REDISCOVER_TICKS, NvmlSession
from tests.fakes import gpuhost
from tests.unit.test_monitor import GIB, _exposition, fake_host, gpu_uuid
from tests.unit.test_monitor import fake_nvml as fake_nvml  # noqa: F401 - the fixture

MIB = 1 << 20


def _mig_host(tmp_path, monkeypatch, *, gpm: bool = True):
    """Two H200s: GPU 0 whole (env0's), GPU 1 in MIG mode with 1g.18gb and 3g.71gb instances,
    env1 holding both; the 3g.71gb one runs one of env1's processes."""
    fh = fake_host(tmp_path, 2, gpus=2, procs_per_gpu=1)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    doc = json.loads(fh.nvml_json.read_text())
    gpu = doc["gpus"][1]
    gis = gpuhost.layout("H200", ["1g.18gb", "3g.71gb"])
    for gi in gis:
        gi["cis"] = [{**ci, "uuid": gpuhost.mig_uuid(1, gi["id"], ci["id"])} for ci in gi["cis"]]
    pid = gpu["processes"][0][0]  # env1's process: on the 3g.71gb instance now
    gis[1].update(used=3 * GIB, processes=[[pid, 3 * GIB]], gpm={"graphics": 62.5, "sm": 40.0})
    gis[0].update(used=0, gpm={"graphics": 0.0, "sm": 0.0})
    gpu.update(mig=True, mig_pending=True, mig_profiles=gpuhost.profiles("H200"),
               gpu_instances=gis, gpm=gpm)
    fh.nvml_json.write_text(json.dumps(doc))
    migs = [ci["uuid"] for gi in gis for ci in gi["cis"]]
    path = fh.state / "journal" / "env1.json"
    journal = json.loads(path.read_text())
    journal["meta"]["claims"]["gpus"]["uuids"] = migs
    path.write_text(json.dumps(journal))
    return fh, migs, gis


def test_each_mig_instance_is_sampled_through_its_handle_and_gpm(tmp_path, fake_nvml,
                                                                  monkeypatch):
    fh, (small, big), gis = _mig_host(tmp_path, monkeypatch)
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    snap = s.tick()
    # In NVML's order: GPU instance id (the 3g.71gb one at slots 4-7 is 2, the 1g.18gb at
    # slot 0 is 7).
    b, a = snap.migs
    assert (a.uuid, a.parent, a.parent_uuid, a.gi, a.ci, a.profile) == (
        small, 1, gpu_uuid(1), gis[0]["id"], 0, "1g.18gb")
    assert (b.uuid, b.gi, b.profile) == (big, gis[1]["id"], "3g.71gb")
    assert (b.fb_total, b.fb_used, b.fb_free) == (69632 * MIB, 3 * GIB, 69632 * MIB - 3 * GIB)
    assert b.processes == [(b.processes[0][0], 3 * GIB)] and a.processes == []
    # GPM needs two samples: nothing at the first tick, the activity between them after.
    assert (b.util, b.sm_util) == (None, None)
    snap = s.tick()
    b, a = snap.migs
    assert (a.util, a.sm_util, b.util, b.sm_util) == (0.0, 0.0, 62.5, 40.0)
    # The process's memory is env1's, under the instance's UUID; the MIG-enabled parent's own
    # list (the same processes) is not counted again.
    e0, e1 = snap.envs
    assert e0.gpu_memory == {gpu_uuid(0): 256 << 20}
    assert e1.gpu_memory == {big: 3 * GIB}
    assert snap.gpu_env[big] == "env1"
    s.close()
    assert fake_nvml.gpm["alloc"] == fake_nvml.gpm["free"] == 4  # two per GPU instance


def test_mig_series_carry_dcgm_exporters_mig_labels(tmp_path, fake_nvml, monkeypatch):
    fh, (small, big), gis = _mig_host(tmp_path, monkeypatch)
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    s.tick()
    snap = s.tick()
    m = _exposition(snap)
    used = {lab["mig_uuid"]: (lab, v) for lab, v in m["envctl_mig_memory_used_bytes"]}
    lab, value = used[big]
    assert value == 3 * GIB
    assert lab == {"gpu": "1", "UUID": gpu_uuid(1), "pci_bus_id": "00000000:02:00.0",
                   "device": "nvidia1", "modelName": "NVIDIA H200", "Hostname": lab["Hostname"],
                   "GPU_I_ID": str(gis[1]["id"]), "GPU_I_PROFILE": "3g.71gb", "mig_uuid": big,
                   "envctl_environment": "env1"}
    util = {lab["mig_uuid"]: v for lab, v in m["envctl_mig_graphics_utilization_ratio"]}
    assert util == {small: 0.0, big: 0.625}
    assert {lab["mig_uuid"]: v for lab, v in m["envctl_mig_sm_utilization_ratio"]}[big] == 0.4
    assert {lab["mig_uuid"]: v for lab, v in m["envctl_mig_memory_total_bytes"]} == {
        small: 16384 * MIB, big: 69632 * MIB}
    per_env = [(lab, v) for lab, v in m["envctl_environment_gpu_memory_used_bytes"]
               if lab["envctl_environment"] == "env1"]
    assert per_env == [({"envctl_environment": "env1", "gpu": "1", "UUID": gpu_uuid(1),
                         "GPU_I_ID": str(gis[1]["id"]), "GPU_I_PROFILE": "3g.71gb",
                         "mig_uuid": big}, 3 * GIB)]
    s.close()


def test_mig_rows_in_csv_and_top(tmp_path, fake_nvml, monkeypatch):
    fh, (small, big), gis = _mig_host(tmp_path, monkeypatch)
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    s.tick()
    snap = s.tick()
    csvout.CsvWriter(tmp_path / "csv").write(snap)
    rows = (tmp_path / "csv" / csvout.GPU_FILE).read_text().splitlines()
    assert [r.split(",", 1)[1] for r in rows[3:]] == [
        f"GPU1/GI{gis[1]['id']}/CI0,62.5,3072,,env1", f"GPU1/GI{gis[0]['id']}/CI0,0.0,0,,env1"]
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(top.view(snap))
    text = console.export_text()
    assert "MIG instances" in text
    line = next(x for x in text.splitlines() if "3g.71gb" in x)
    assert line.split() == ["1", str(gis[1]["id"]), "0", "3g.71gb", "62.5%", "40.0%",
                            "3072/69632", "MiB", "env1", "1"]
    console.file.close()
    s.close()


def test_without_gpm_memory_and_processes_only(tmp_path, fake_nvml, monkeypatch):
    fh, (small, big), _ = _mig_host(tmp_path, monkeypatch, gpm=False)
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    for _ in range(3):
        snap = s.tick()
    b = snap.migs[0]
    assert b.uuid == big and (b.util, b.sm_util, b.fb_used) == (None, None, 3 * GIB)
    assert fake_nvml.gpm["samples"] == 0 and fake_nvml.gpm["alloc"] == 0
    m = _exposition(snap)
    assert "envctl_mig_graphics_utilization_ratio" not in m
    assert len(m["envctl_mig_memory_used_bytes"]) == 2
    s.close()


def test_instances_are_listed_again_when_the_held_ones_change(tmp_path, fake_nvml,
                                                               monkeypatch):
    fh, (small, big), gis = _mig_host(tmp_path, monkeypatch)
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    s.tick()
    s.tick()
    calls = fake_nvml.sampled["calls"]
    s.tick()
    per_tick = fake_nvml.sampled["calls"] - calls
    # `down` of env1 destroyed the 1g.18gb instance and an `up` made a 1g.35gb one.
    doc = json.loads(fh.nvml_json.read_text())
    new = gpuhost.layout("H200", ["1g.18gb", "3g.71gb", "1g.35gb"])[2]
    new["cis"] = [{**new["cis"][0], "uuid": gpuhost.mig_uuid(1, new["id"], 0)}]
    new["used"] = GIB
    doc["gpus"][1]["gpu_instances"] = [doc["gpus"][1]["gpu_instances"][1], new]
    fh.nvml_json.write_text(json.dumps(doc))
    fake_nvml.nvmlInit()  # the fake reads its file at init: what a live NVML would show
    path = fh.state / "journal" / "env1.json"
    journal = json.loads(path.read_text())
    journal["meta"]["claims"]["gpus"]["uuids"] = [big, new["cis"][0]["uuid"]]
    path.write_text(json.dumps(journal))
    snap = s.tick()
    assert sorted((m.uuid, m.profile, m.fb_used) for m in snap.migs) == sorted([
        (big, "3g.71gb", 3 * GIB), (new["cis"][0]["uuid"], "1g.35gb", GIB)])
    assert small not in snap.gpu_env
    # Listing is not paid at every tick: a steady tick samples what it listed.
    calls = fake_nvml.sampled["calls"]
    s.tick()
    assert fake_nvml.sampled["calls"] - calls == per_tick
    s.close()


def test_a_destroyed_instance_is_noticed_and_listed_again(tmp_path, fake_nvml, monkeypatch):
    fh, (small, big), gis = _mig_host(tmp_path, monkeypatch)
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    s.tick()
    # nvidia-smi destroyed the 3g.71gb instance (no environment's claims changed).
    doc = json.loads(fh.nvml_json.read_text())
    doc["gpus"][1]["gpu_instances"] = [gi for gi in doc["gpus"][1]["gpu_instances"]
                                       if gi["id"] != gis[1]["id"]]
    fh.nvml_json.write_text(json.dumps(doc))
    fake_nvml.nvmlInit()
    snap = s.tick()  # its handle is stale: nothing of it is said
    assert {m.uuid: m.fb_total for m in snap.migs} == {big: None, small: 16384 * MIB}
    snap = s.tick()
    assert [m.uuid for m in snap.migs] == [small]
    s.close()


def test_instances_made_outside_envctl_appear_within_the_rediscovery_period(
        tmp_path, fake_nvml, monkeypatch):
    fh, (small, big), gis = _mig_host(tmp_path, monkeypatch)
    doc = json.loads(fh.nvml_json.read_text())
    only = doc["gpus"][1]["gpu_instances"]
    doc["gpus"][1]["gpu_instances"] = only[:1]
    fh.nvml_json.write_text(json.dumps(doc))
    path = fh.state / "journal" / "env1.json"
    journal = json.loads(path.read_text())
    journal["meta"]["claims"]["gpus"]["uuids"] = [small]
    path.write_text(json.dumps(journal))
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    s.tick()
    doc["gpus"][1]["gpu_instances"] = only
    fh.nvml_json.write_text(json.dumps(doc))
    fake_nvml.nvmlInit()
    counts = [len(s.tick().migs) for _ in range(REDISCOVER_TICKS)]
    assert counts[0] == 1 and counts[-1] == 2
    s.close()


def test_instances_of_a_gpu_after_one_that_could_not_be_identified(tmp_path, fake_nvml,
                                                                   monkeypatch):
    fh, (small, big), gis = _mig_host(tmp_path, monkeypatch)
    doc = json.loads(fh.nvml_json.read_text())
    doc["gpus"][0]["fail"] = ["nvmlDeviceGetName"]  # GPU 0 is not sampled: GPU 1 comes first
    fh.nvml_json.write_text(json.dumps(doc))
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    s.tick()
    snap = s.tick()
    assert [g.index for g in snap.gpus] == [1]
    assert {m.uuid: (m.parent, m.fb_used, m.util) for m in snap.migs} == {
        big: (1, 3 * GIB, 62.5), small: (1, 0, 0.0)}
    s.close()


def test_the_profile_comes_from_the_instance_s_info_when_its_name_lacks_it(
        tmp_path, fake_nvml, monkeypatch):
    fh, (small, big), gis = _mig_host(tmp_path, monkeypatch)
    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetName", lambda h: "NVIDIA H200")
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    snap = s.tick()
    assert {m.uuid: m.profile for m in snap.migs} == {small: "1g.18gb", big: "3g.71gb"}
    s.close()


def test_listing_needs_no_privileged_call(tmp_path, fake_nvml, monkeypatch):
    """A plain user's `envctl top`: nvmlDeviceGetGpuInstanceById wants root; the MIG device's
    name says its profile."""
    fh, (small, big), gis = _mig_host(tmp_path, monkeypatch)

    def refused(*args):
        raise fake_nvml.NVMLError(fake_nvml.NVML_ERROR_NO_PERMISSION)

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetGpuInstanceById", refused)
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    snap = s.tick()
    assert {m.uuid: m.profile for m in snap.migs} == {small: "1g.18gb", big: "3g.71gb"}
    assert snap.problems == []
    s.close()


def test_compat_dcgm_gives_the_instances_dcgm_exporters_names_and_labels(tmp_path, fake_nvml,
                                                                         monkeypatch):
    fh, (small, big), gis = _mig_host(tmp_path, monkeypatch)
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    s.tick()
    snap = s.tick()
    s.close()
    m = _exposition(snap, compat={"dcgm"})
    used = m["DCGM_FI_DEV_FB_USED"]
    # The whole GPUs' samples and the instances' in one family, as dcgm-exporter writes them.
    assert sorted(lab["gpu"] for lab, _ in used if "GPU_I_ID" not in lab) == ["0", "1"]
    mine = {lab["GPU_I_ID"]: (lab, v) for lab, v in used if "GPU_I_ID" in lab}
    lab, value = mine[str(gis[1]["id"])]
    assert value == 3 * 1024 and (lab["gpu"], lab["UUID"], lab["GPU_I_PROFILE"],
                                  lab["environment"]) == ("1", gpu_uuid(1), "3g.71gb", "env1")
    active = {lab["GPU_I_ID"]: v for lab, v in m["DCGM_FI_PROF_GR_ENGINE_ACTIVE"]}
    assert active == {str(gis[1]["id"]): 0.625, str(gis[0]["id"]): 0.0}
    assert {lab["GPU_I_ID"]: v for lab, v in m["DCGM_FI_PROF_SM_ACTIVE"]}[
        str(gis[1]["id"])] == 0.4
    assert "DCGM_FI_PROF_GR_ENGINE_ACTIVE" not in _exposition(snap)  # only when asked


def test_listing_again_leaves_no_gap_in_utilisation(tmp_path, fake_nvml, monkeypatch):
    fh, (small, big), gis = _mig_host(tmp_path, monkeypatch)
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    s.tick()
    utils = [{m.uuid: m.util for m in s.tick().migs}[big] for _ in range(REDISCOVER_TICKS + 2)]
    assert utils == [62.5] * (REDISCOVER_TICKS + 2)
    s.close()
    assert fake_nvml.gpm["alloc"] == fake_nvml.gpm["free"] == 4
