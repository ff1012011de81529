"""The monitor's sampling and exporters against a fake host: a cgroup tree of plain files (v1
and v2 layouts), journals as the engine writes them, job and service records, the fake pynvml
(tests/fakes/pynvml) and a fake /proc for GPU process attribution. No root needed.

`fake_host` is also what bench/monitor_tick.py measures.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from envctl.host.cgroups import CgroupLayout, Cgroups
from envctl.monitor import csvout, events, prom
from envctl.monitor import http as mhttp
from envctl.monitor.collect import Sampler
from envctl.monitor.nvml import NvmlSession
from envctl.runtime import jobs as jb
from tests.fakes import PYNVML_DIR

REPO = Path(__file__).resolve().parents[2]
BOOT = "11111111-2222-3333-4444-555555555555"
V1 = ("cpu", "cpuacct", "cpuset", "memory", "pids", "blkio")
GIB = 1 << 30


# ---------------------------------------------------------------- the fake host


@dataclass
class FakeHost:
    root: Path
    state: Path
    run: Path
    proc: Path
    cgroups: Cgroups
    nvml_json: Path | None
    envs: list[str]
    version: int

    def cgroup_dir(self, env: str, controller: str) -> Path:
        return Path(self.cgroups.path(env, controller))

    def write(self, env: str, controller: str, file: str, value: str) -> None:
        (self.cgroup_dir(env, controller) / file).write_text(value)

    def sampler(self, nvml: NvmlSession | None = None, **kwargs) -> Sampler:
        return Sampler(state_dir=self.state, run_dir=self.run, boot_id=BOOT,
                       cgroups=self.cgroups, nvml=nvml, proc=self.proc, **kwargs)


def gpu_uuid(i: int) -> str:
    return f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}"


def _psi(some_us: int, full_us: int) -> str:
    return (f"some avg10=0.00 avg60=0.00 avg300=0.00 total={some_us}\n"
            f"full avg10=0.00 avg60=0.00 avg300=0.00 total={full_us}\n")


def _cgroup_files(version: int, i: int) -> dict[str, dict[str, str]]:
    """controller -> file -> content of environment number `i`'s cgroup."""
    if version == 2:
        return {"": {
            "cpu.stat": f"usage_usec {1_000_000 * (i + 1)}\nuser_usec 1\nsystem_usec 1\n"
                        "nr_periods 100\nnr_throttled 7\nthrottled_usec 2500000\n",
            "memory.current": str(512 << 20),
            "memory.max": "max" if i % 2 else str(GIB),
            "memory.peak": str(600 << 20),
            "memory.stat": "anon 1\nfile 2\nactive_file 3\ninactive_file 104857600\n",
            "memory.events": "low 0\nhigh 5\nmax 3\noom 2\noom_kill 2\n",
            "pids.current": "12\n",
            "cpuset.cpus.effective": "0-1\n",
            "cpu.max": "max 100000\n" if i % 2 else "50000 100000\n",
            "cpu.pressure": _psi(1_500_000, 500_000),
            "memory.pressure": _psi(250_000, 0),
            "io.pressure": _psi(3_000_000, 2_000_000),
            "io.stat": "8:0 rbytes=1000 wbytes=2000 rios=1 wios=2 dbytes=0 dios=0\n"
                       "8:16 rbytes=24 wbytes=48 rios=1 wios=1 dbytes=0 dios=0\n"}}
    return {
        "cpuacct": {"cpuacct.usage": str(1_000_000_000 * (i + 1))},
        "cpu": {"cpu.stat": "nr_periods 100\nnr_throttled 7\nthrottled_time 2500000000\n",
                "cpu.cfs_quota_us": "-1\n" if i % 2 else "50000\n",
                "cpu.cfs_period_us": "100000\n"},
        "blkio": {"blkio.throttle.io_service_bytes": "8:0 Read 1000\n8:0 Write 2000\n"
                  "8:0 Sync 0\n8:0 Async 3000\n8:0 Total 3000\n8:16 Read 24\n8:16 Write 48\n"
                  "8:16 Total 72\nTotal 3072\n"},
        "memory": {"memory.usage_in_bytes": str(512 << 20),
                   "memory.limit_in_bytes": "9223372036854771712" if i % 2 else str(GIB),
                   "memory.max_usage_in_bytes": str(600 << 20),
                   "memory.stat": "cache 1\nrss 2\ninactive_file 5\n"
                                  "total_inactive_file 104857600\n",
                   "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"},
        "pids": {"pids.current": "12\n"},
        "cpuset": {"cpuset.cpus": "0-1\n"},
    }


def fake_host(root: Path, n_envs: int = 2, *, version: int = 1, gpus: int = 0,
              procs_per_gpu: int = 1) -> FakeHost:
    """`n_envs` environments env0… up (journals of this boot, cgroups with usage), `gpus`
    fake GPUs (env i holds GPU i mod gpus) each running `procs_per_gpu` processes of its
    holder, visible in a fake /proc."""
    cg = root / "cgroup"
    if version == 2:
        lay = CgroupLayout({}, str(cg / "unified"), frozenset(("cpu", "memory", "pids",
                                                                 "cpuset")))
    else:
        lay = CgroupLayout({c: str(cg / c) for c in V1})
    cgroups = Cgroups(lay, "envctl")
    state, run, proc = root / "state", root / "run", root / "proc"
    (state / "journal").mkdir(parents=True)
    proc.mkdir()
    envs = [f"env{i}" for i in range(n_envs)]
    held: dict[str, list[str]] = {e: [] for e in envs}
    for g in range(gpus):
        if envs:
            held[envs[g % n_envs]].append(gpu_uuid(g))
    for i, env in enumerate(envs):
        for controller, files in _cgroup_files(version, i).items():
            d = Path(cgroups.path(env, controller or "memory"))
            d.mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (d / name).write_text(text)
        res = {"kind": "cgroup", "env": env, "version": version, "controllers": list(
            lay.controllers()), "settings": [], "parent": ""}
        journal = {"version": 1, "log": 0, "meta": {"claims": {"gpus": {"uuids": held[env]}}},
                   "entries": [{"key": f"cgroup:{env}", "resource": res, "memo": {},
                                "status": "applied", "shared": False, "boot": BOOT}]}
        (state / "journal" / f"{env}.json").write_text(json.dumps(journal))
    nvml_json = None
    if gpus:
        pid = 100000
        cfg = []
        for g in range(gpus):
            owner = envs[g % n_envs] if envs else ""
            procs = []
            for _ in range(procs_per_gpu):
                pid += 1
                (proc / str(pid)).mkdir()
                (proc / str(pid) / "cgroup").write_text(
                    f"12:memory:/envctl/{owner}/job-1\n11:cpu,cpuacct:/envctl/{owner}/job-1\n"
                    "0::/\n")
                procs.append([pid, 256 << 20])
            cfg.append({"uuid": gpu_uuid(g), "name": "NVIDIA H200", "minor": g,
                        "memory": 141 * GIB, "mig": False, "pci": f"00000000:{g + 1:02X}:00.0",
                        "used": 10 * GIB, "util": 40 + g, "mem_util": 10, "temp": 50 + g,
                        "power": 300_000, "ecc": None if g % 2 else
                        {"sbe_vol": 1, "dbe_vol": 0, "sbe_agg": 3, "dbe_agg": 0},
                        "processes": procs, "xids": [],
                        "clocks": {"sm": 1980, "mem": 2619}, "clock_reasons": 0x4 if g == 0
                        else 0x1, "power_limit": 700_000, "energy": 5_000_000 + g,
                        "remapped": [2, 0, 0, 0], "pcie_replays": g})
        nvml_json = root / "nvml.json"
        nvml_json.write_text(json.dumps({"driver": "550.54.15", "gpus": cfg}))
    return FakeHost(root, state, run, proc, cgroups, nvml_json, envs, version)


def import_fake_pynvml():
    """The fake pynvml module (tests/fakes/pynvml), imported afresh."""
    sys.modules.pop("pynvml", None)
    sys.path.insert(0, str(PYNVML_DIR))
    try:
        module = importlib.import_module("pynvml")
    finally:
        sys.path.remove(str(PYNVML_DIR))
    assert Path(module.__file__).parent == PYNVML_DIR
    return module


@pytest.fixture
def fake_nvml(monkeypatch):
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    module = import_fake_pynvml()
    yield module
    sys.modules.pop("pynvml", None)


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------- cgroups


@pytest.mark.parametrize("version", [1, 2])
def test_environment_usage_from_its_cgroup(tmp_path, version):
    fh = fake_host(tmp_path, 2, version=version)
    clock = Clock()
    s = fh.sampler(host_stats=False, clock=clock)
    snap = s.tick()
    assert [e.env for e in snap.envs] == ["env0", "env1"]
    e0, e1 = snap.envs
    assert e0.cgroup == "/envctl/env0" and e0.driver == "cgroupfs"
    assert e0.cpu_seconds == 1.0 and e1.cpu_seconds == 2.0
    assert e0.periods == 100 and e0.throttled_periods == 7 and e0.throttled_seconds == 2.5
    assert e0.mem_usage == 512 << 20 and e0.mem_peak == 600 << 20
    assert e0.mem_working_set == (512 << 20) - (100 << 20)  # minus inactive file cache
    assert e0.mem_limit == GIB and e1.mem_limit is None  # "max" / PAGE_COUNTER_MAX: none
    assert e0.mem_percent == 50.0
    assert e0.oom_kills == 2 and e0.tasks == 12 and e0.cpus == 2
    assert (e0.cpu_quota, e0.cpu_period, e1.cpu_quota) == (0.05, 0.1, None)
    assert (e0.io_read_bytes, e0.io_write_bytes) == (1024, 2048)
    if version == 2:
        assert e0.mem_events == {"high": 5, "max": 3, "oom": 2, "oom_kill": 2}
        assert e0.pressure == {("cpu", "some"): 1.5, ("cpu", "full"): 0.5,
                               ("memory", "some"): 0.25, ("memory", "full"): 0.0,
                               ("io", "some"): 3.0, ("io", "full"): 2.0}
    else:  # v1 has no PSI and counts only OOM kills
        assert e0.mem_events == {"oom_kill": 2} and e0.pressure == {}
    assert e0.cpu_percent is None  # one reading: no rate yet
    # One CPU-second more over 2 s on 2 CPUs: 25 %.
    if version == 2:
        fh.write("env0", "cpu", "cpu.stat", "usage_usec 2000000\nnr_periods 1\n")
    else:
        fh.write("env0", "cpuacct", "cpuacct.usage", str(2_000_000_000))
    clock.t += 2.0
    e0 = s.tick().envs[0]
    assert e0.cpu_percent == pytest.approx(25.0)


def test_only_environments_up_in_this_boot_are_sampled(tmp_path):
    fh = fake_host(tmp_path, 3)
    j = fh.state / "journal" / "env1.json"
    data = json.loads(j.read_text())
    data["entries"][0]["boot"] = "another-boot"  # up before a reboot: gone now
    j.write_text(json.dumps(data))
    (fh.state / "journal" / "env2.json").unlink()  # taken down
    s = fh.sampler(host_stats=False)
    assert [e.env for e in s.tick().envs] == ["env0"]
    # A journal that changes is read again: env1 comes up in this boot.
    data["entries"][0]["boot"] = BOOT
    j.write_text(json.dumps(data) + " ")
    assert [e.env for e in s.tick().envs] == ["env0", "env1"]


def test_a_missing_cgroup_file_is_unknown_not_an_error(tmp_path):
    fh = fake_host(tmp_path, 1)
    (fh.cgroup_dir("env0", "memory") / "memory.max_usage_in_bytes").unlink()
    e0 = fh.sampler(host_stats=False).tick().envs[0]
    assert e0.mem_peak is None and e0.mem_usage == 512 << 20


def test_jobs_by_state_and_lost_ones(tmp_path):
    fh = fake_host(tmp_path, 2)
    me = jb.identity()
    for jid, env, state, sup in [(1, "env0", jb.State.RUNNING, me),
                                 (2, "env0", jb.State.RUNNING, {"pid": me["pid"], "start": 1}),
                                 (3, "env0", jb.State.COMPLETED, None),
                                 (4, "env1", jb.State.FAILED, None)]:
        jb.write(fh.state, jb.Job(id=jid, env=env, argv=["x"], state=state, supervisor=sup,
                                  boot_id=BOOT))
    s = fh.sampler(host_stats=False)
    e0, e1 = s.tick().envs
    # Job 2's recorded supervisor started at another time: it is gone, the job LOST.
    assert e0.jobs == {"RUNNING": 1, "LOST": 1, "COMPLETED": 1}
    assert e1.jobs == {"FAILED": 1}
    jb.write(fh.state, jb.Job(id=1, env="env0", argv=["x"], state=jb.State.COMPLETED,
                              boot_id=BOOT))
    (jb.record_path(fh.state, 3)).unlink()
    assert s.tick().envs[0].jobs == {"COMPLETED": 1, "LOST": 1}


def test_service_state_from_its_record(tmp_path):
    fh = fake_host(tmp_path, 1)
    j = fh.state / "journal" / "env0.json"
    data = json.loads(j.read_text())
    data["entries"].append({"key": "service:env0", "resource": {
        "kind": "service", "env": "env0", "command": ["sleep", "1"], "restart": "always",
        "restart_sec": 1.0}, "memo": {}, "status": "applied", "shared": False, "boot": BOOT})
    j.write_text(json.dumps(data))
    rec = fh.run / "env0" / "service.json"
    rec.parent.mkdir(parents=True)
    rec.write_text(json.dumps({"state": "running", "supervisor": jb.identity(), "pid": 42,
                               "boot_id": BOOT, "restarts": 3}))
    s = fh.sampler(host_stats=False)
    assert s.tick().envs[0].service == {"state": "running", "up": True, "restarts": 3,
                                        "pid": 42}
    rec.write_text(json.dumps({"state": "running", "pid": 42, "boot_id": BOOT, "restarts": 3,
                               "supervisor": {"pid": os.getpid(), "start": 1}}))
    assert s.tick().envs[0].service["up"] is False  # its supervisor is gone
    rec.unlink()
    assert s.tick().envs[0].service["state"] == "absent"


# ---------------------------------------------------------------- NVML


def test_gpus_sampled_through_one_nvml_session(tmp_path, fake_nvml, monkeypatch):
    fh = fake_host(tmp_path, 2, gpus=2, procs_per_gpu=2)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    cfg = json.loads(fh.nvml_json.read_text())
    cfg["gpus"][0]["xids"] = [13, 31]
    fh.nvml_json.write_text(json.dumps(cfg))
    session = NvmlSession(fake_nvml)
    s = fh.sampler(nvml=session, host_stats=False)
    for _ in range(3):
        snap = s.tick()
    assert fake_nvml.calls["init"] == 1 and fake_nvml.calls["shutdown"] == 0
    g0, g1 = snap.gpus
    assert (g0.uuid, g0.util, g0.temp, g0.power_w) == (gpu_uuid(0), 40, 50, 300.0)
    assert g0.fb_used == 10 * GIB and g0.fb_free == 131 * GIB
    assert g0.ecc == {"sbe_vol": 1, "dbe_vol": 0, "sbe_agg": 3, "dbe_agg": 0}
    assert g1.ecc == {}  # not supported on this one
    assert (g0.xid, g0.xid_count, g1.xid_count) == (31, 2, 0)
    assert g0.xids == {13: 1, 31: 1} and g1.xids == {}
    assert g0.pci_bus_id == "00000000:01:00.0"
    assert (g0.sm_clock_hz, g0.mem_clock_hz, g0.clock_reasons) == (1980e6, 2619e6, 0x4)
    assert (g0.power_limit_w, g0.energy_j, g0.remapped, g1.pcie_replays) == (
        700.0, 5000.0, (2, 0, 0, 0), 1)
    assert snap.gpu_env == {gpu_uuid(0): "env0", gpu_uuid(1): "env1"}
    # Each process's memory goes to the environment whose cgroup holds it.
    e0, e1 = snap.envs
    assert e0.gpu_memory == {gpu_uuid(0): 512 << 20} and e1.gpu_memory == {
        gpu_uuid(1): 512 << 20}
    # NOT_SUPPORTED is asked once, then remembered: ticks stop paying for the exception.
    before = fake_nvml.sampled["calls"]
    s.tick()
    per_tick = fake_nvml.sampled["calls"] - before
    # util, temp, power, procs, SM and memory clocks, clock reasons, power limit, energy,
    # remapped rows, PCIe replays each; ECC x4 on GPU 0 only.
    assert per_tick == 2 * 11 + 4
    s.close()
    assert fake_nvml.calls["shutdown"] == 1


def test_calls_an_old_driver_or_pynvml_lacks_are_absent_and_not_asked_again(
        tmp_path, fake_nvml, monkeypatch):
    fh = fake_host(tmp_path, 1, gpus=1)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    asked = []

    def old_driver(handle, clock_type):
        asked.append(clock_type)
        raise fake_nvml.NVMLError(fake_nvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetClockInfo", old_driver)
    monkeypatch.delattr(fake_nvml, "nvmlDeviceGetPcieReplayCounter")  # an older pynvml
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    for _ in range(3):
        g = s.tick().gpus[0]
    assert (g.sm_clock_hz, g.mem_clock_hz, g.pcie_replays) == (None, None, None)
    assert g.power_limit_w == 700.0 and g.util == 40  # the rest is sampled as before
    assert len(asked) == 2  # SM and memory clock, once each
    s.close()


def test_a_lost_gpu_is_reported_once_and_not_asked_again(tmp_path, fake_nvml, monkeypatch):
    fh = fake_host(tmp_path, 1, gpus=1)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    session = NvmlSession(fake_nvml)
    real = fake_nvml.nvmlDeviceGetUtilizationRates

    def lost(handle):
        raise fake_nvml.NVMLError(fake_nvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetUtilizationRates", lost)
    s = fh.sampler(nvml=session, host_stats=False)
    snap = s.tick()
    assert snap.gpus[0].lost and snap.gpus[0].util is None
    assert any("is lost" in p for p in snap.problems)
    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetUtilizationRates", real)
    assert s.tick().gpus[0].util is None  # lost stays lost
    s.close()


def test_a_gpu_lost_after_good_ticks_keeps_no_stale_values(tmp_path, fake_nvml, monkeypatch):
    fh = fake_host(tmp_path, 1, gpus=1)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    s = fh.sampler(nvml=NvmlSession(fake_nvml), host_stats=False)
    assert s.tick().gpus[0].fb_used is not None

    def lost(*args):
        raise fake_nvml.NVMLError(fake_nvml.NVML_ERROR_GPU_IS_LOST)

    for name in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo",
                 "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage"):
        monkeypatch.setattr(fake_nvml, name, lost)
    for _ in range(2):
        g = s.tick().gpus[0]
        assert g.lost and (g.util, g.fb_used, g.fb_total, g.temp, g.power_w) == (None,) * 5
    s.close()


def test_a_broken_xid_event_set_is_reported_once(tmp_path, fake_nvml, monkeypatch):
    fh = fake_host(tmp_path, 1, gpus=1)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    session = NvmlSession(fake_nvml)

    def broken(event_set, timeout):
        raise fake_nvml.NVMLError(fake_nvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(fake_nvml, "nvmlEventSetWait_v2", broken)
    s = fh.sampler(nvml=session, host_stats=False)
    for _ in range(50):
        snap = s.tick()
    assert len([p for p in snap.problems if "XID" in p]) <= 1
    assert len([p for p in session.problems if "XID" in p]) == 1
    s.close()


def test_nvml_is_not_opened_when_discovery_would_not_ask_it(tmp_path, fake_nvml, monkeypatch):
    from envctl.monitor.nvml import open_session
    from tests.fakes import FakeGpu, make_tree

    root = make_tree(tmp_path / "gpu", [FakeGpu(gpu_uuid(0), "0000:3b:00.0", 0)])
    session, why = open_session(root, mode="auto")
    assert session is None and "nvidiactl" in why  # no nodes: NVML would create them
    assert fake_nvml.calls["init"] == 0
    assert open_session(root, mode="off")[0] is None
    assert open_session(tmp_path / "none", mode="auto") == (None, "")  # no driver


# ---------------------------------------------------------------- CSV


def test_csv_keeps_the_original_columns_plus_environment(tmp_path, fake_nvml, monkeypatch):
    fh = fake_host(tmp_path, 2, gpus=2)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    s = fh.sampler(nvml=NvmlSession(fake_nvml))
    out = tmp_path / "csv"
    w = csvout.CsvWriter(out)
    w.write(s.tick())
    w.write(s.tick())
    gpu = (out / "gpu-metrics.csv").read_text().splitlines()
    cpu = (out / "cpu-metrics.csv").read_text().splitlines()
    assert gpu[0] == "Timestamp,Type,Utilization,Memory,Temperature,Environment"
    assert cpu[0] == "Timestamp,Type,CPU_Utilization,Memory_Utilization,Environment"
    assert len(gpu) == 1 + 2 * 2 and gpu.count(gpu[0]) == 1
    stamp, kind, util, mem, temp, env = gpu[1].split(",")
    assert (kind, util, mem, temp, env) == ("GPU0", "40", str(10 * 1024), "50", "env0")
    assert len(stamp) == 25 and stamp[4] == "-" and stamp[13] == ":" and stamp[19:] == "+00:00"
    rows = [r.split(",") for r in cpu[1:4]]
    assert rows[0][1] == "host" and rows[0][4] == "" and float(rows[0][3]) > 0
    assert [r[1] for r in rows[1:]] == ["environment"] * 2
    assert [r[4] for r in rows[1:]] == ["env0", "env1"]
    assert rows[1][3] == "50.0"  # 512 MiB of its 1 GiB limit
    s.close()


def test_csv_rotates_by_size(tmp_path):
    fh = fake_host(tmp_path, 1)
    s = fh.sampler(host_stats=False)
    out = tmp_path / "csv"
    w = csvout.CsvWriter(out, max_bytes=300, keep=2)
    for _ in range(40):
        w.write(s.tick())
    names = sorted(p.name for p in out.iterdir())
    assert names == ["cpu-metrics.csv", "cpu-metrics.csv.1", "cpu-metrics.csv.2"]
    for name in names:
        text = (out / name).read_text()
        assert text.startswith(csvout.CPU_HEADER + "\n")  # every file starts with the header
        assert len(text) <= 300 + 200
    assert not (out / "gpu-metrics.csv").exists()  # no GPU: no GPU file


# ---------------------------------------------------------------- Prometheus


def _exposition(snap, health=None, **kwargs) -> dict:
    col = prom.SnapshotCollector(**kwargs)
    if health:
        snap.health = health
    col.update(snap, tick_cpu_seconds=0.002)
    return prom.parse_exposition(prom.exposition(prom.registry_for(col)).decode())


def _by_env(m: dict) -> dict:
    """name -> {environment: value} of the single-valued per-environment series."""
    return {k: {x["envctl_environment"]: v for x, v in samples} for k, samples in m.items()
            if samples and "envctl_environment" in samples[0][0]
            and not {"gpu", "state", "result", "event", "direction", "resource"}
            & samples[0][0].keys()}


def _gpu_snapshot(tmp_path, fake_nvml, monkeypatch, version: int = 1):
    fh = fake_host(tmp_path, 2, gpus=2, version=version)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    cfg = json.loads(fh.nvml_json.read_text())
    cfg["gpus"][0]["xids"] = [79, 119]
    fh.nvml_json.write_text(json.dumps(cfg))
    jb.write(fh.state, jb.Job(id=1, env="env1", argv=["x"], state=jb.State.COMPLETED))
    s = fh.sampler(nvml=NvmlSession(fake_nvml))
    snap = s.tick()
    s.close()
    snap.health = {"env0": {"state": "up", "drift": 0, "heals": 2, "heal_failures": 1,
                            "retry_in": 5.0}}
    return snap


def test_prometheus_names_units_and_labels_parse_back(tmp_path, fake_nvml, monkeypatch):
    m = _exposition(_gpu_snapshot(tmp_path, fake_nvml, monkeypatch))
    assert not [n for n in m if not n.startswith("envctl_")]  # no compat names by default
    (labels, value), _ = m["envctl_gpu_utilization_ratio"]
    assert labels == {"gpu": "0", "UUID": gpu_uuid(0), "pci_bus_id": "00000000:01:00.0",
                      "device": "nvidia0", "modelName": "NVIDIA H200",
                      "Hostname": socket.gethostname(), "envctl_environment": "env0"}
    assert value == 0.40
    gpu = {k: {x["gpu"]: v for x, v in samples} for k, samples in m.items()
           if samples and "gpu" in samples[0][0] and len(samples[0][0]) == 7}
    assert gpu["envctl_gpu_memory_used_bytes"] == {"0": 10 * GIB, "1": 10 * GIB}
    assert gpu["envctl_gpu_memory_free_bytes"]["0"] == 131 * GIB
    assert gpu["envctl_gpu_temperature_celsius"]["1"] == 51
    assert gpu["envctl_gpu_power_watts"]["0"] == 300 and gpu[
        "envctl_gpu_power_limit_watts"]["0"] == 700
    assert gpu["envctl_gpu_energy_joules_total"] == {"0": 5000.0, "1": 5000.001}
    assert gpu["envctl_gpu_sm_clock_hertz"]["0"] == 1.98e9
    assert gpu["envctl_gpu_memory_clock_hertz"]["0"] == 2.619e9
    assert gpu["envctl_gpu_pcie_replays_total"] == {"0": 0, "1": 1}
    assert gpu["envctl_gpu_xid_events_total"] == {"0": 2, "1": 0}
    assert gpu["envctl_gpu_last_xid"] == {"0": 119}  # absent until one is seen
    assert gpu["envctl_gpu_quarantined"] == {"0": 0, "1": 0}
    assert gpu["envctl_gpu_lost"] == {"0": 0, "1": 0}
    xids = {(x["gpu"], x["err_code"]): v for x, v in m["envctl_gpu_xid_errors_total"]}
    assert xids[("0", "79")] == 1 and xids[("0", "119")] == 1
    assert xids[("1", "79")] == 0 and ("1", "119") not in xids  # 0 before the first one
    assert all(xids[("1", str(c))] == 0 for c in prom.XID_CODES)
    reasons = {(x["gpu"], x["reason"]): v for x, v in m["envctl_gpu_clock_event_active"]}
    assert reasons[("0", "sw_power_cap")] == 1 and reasons[("0", "gpu_idle")] == 0
    assert reasons[("1", "gpu_idle")] == 1
    ecc = {(x["gpu"], x["error"], x["counter"]): v for x, v in m["envctl_gpu_ecc_errors_total"]}
    assert ecc == {("0", "corrected", "volatile"): 1, ("0", "uncorrected", "volatile"): 0,
                   ("0", "corrected", "aggregate"): 3, ("0", "uncorrected", "aggregate"): 0}
    assert {(x["gpu"], x["error"]): v for x, v in m["envctl_gpu_remapped_rows_total"]}[
        ("0", "corrected")] == 2
    by_env = _by_env(m)
    assert by_env["envctl_environment_cpu_usage_seconds_total"] == {"env0": 1.0, "env1": 2.0}
    assert by_env["envctl_environment_cpu_throttled_seconds_total"]["env0"] == 2.5
    assert by_env["envctl_environment_cpu_throttled_periods_total"]["env0"] == 7
    assert by_env["envctl_environment_cpu_quota_seconds"] == {"env0": 0.05}  # env1: none
    assert by_env["envctl_environment_cpu_period_seconds"]["env0"] == 0.1
    assert by_env["envctl_environment_memory_working_set_bytes"]["env0"] == 412 << 20
    assert by_env["envctl_environment_memory_usage_bytes"]["env0"] == 512 << 20
    assert by_env["envctl_environment_memory_max_usage_bytes"]["env0"] == 600 << 20
    assert by_env["envctl_environment_memory_limit_bytes"] == {"env0": GIB, "env1": 0}
    assert by_env["envctl_environment_tasks"]["env0"] == 12
    assert m["envctl_environment_cpu_usage_seconds_total"][0][0]["id"] == "/envctl/env0"
    assert by_env["envctl_environment_up"] == {"env0": 1}
    events = {(x["envctl_environment"], x["event"]): v
              for x, v in m["envctl_environment_memory_events_total"]}
    assert events == {("env0", "oom_kill"): 2, ("env1", "oom_kill"): 2}  # v1: OOM kills only
    io = {(x["envctl_environment"], x["direction"]): v
          for x, v in m["envctl_environment_io_bytes_total"]}
    assert io[("env0", "read")] == 1024 and io[("env0", "write")] == 2048
    assert "envctl_environment_pressure_stalled_seconds_total" not in m  # v1: no PSI
    assert {(x["envctl_environment"], x["result"]): v for x, v in m["envctl_heals_total"]} == {
        ("env0", "ok"): 2, ("env0", "failed"): 1}
    jobs = {(x["envctl_environment"], x["state"]): v for x, v in m["envctl_jobs"]}
    assert jobs[("env1", "COMPLETED")] == 1 and jobs[("env0", "RUNNING")] == 0
    assert {(x["envctl_environment"], x["UUID"]): v for x, v in m[
        "envctl_environment_gpu_memory_used_bytes"]} == {("env0", gpu_uuid(0)): 256 << 20,
                                                         ("env1", gpu_uuid(1)): 256 << 20}
    assert m["envctl_monitor_ticks_total"][0][1] == 1
    assert 0 < m["envctl_host_memory_utilization_ratio"][0][1] < 1
    assert 0 <= m["envctl_host_cpu_utilization_ratio"][0][1] <= 1


def test_pressure_and_memory_events_on_cgroup_v2(tmp_path, fake_nvml, monkeypatch):
    m = _exposition(_gpu_snapshot(tmp_path, fake_nvml, monkeypatch, version=2))
    psi = {(x["envctl_environment"], x["resource"], x["kind"]): v
           for x, v in m["envctl_environment_pressure_stalled_seconds_total"]}
    assert psi[("env0", "cpu", "some")] == 1.5 and psi[("env0", "io", "full")] == 2.0
    assert psi[("env1", "memory", "some")] == 0.25
    events = {(x["envctl_environment"], x["event"]): v
              for x, v in m["envctl_environment_memory_events_total"]}
    assert {k: v for k, v in events.items() if k[0] == "env0"} == {
        ("env0", "high"): 5, ("env0", "max"): 3, ("env0", "oom"): 2, ("env0", "oom_kill"): 2}


def test_compat_names_are_only_there_when_asked(tmp_path, fake_nvml, monkeypatch):
    snap = _gpu_snapshot(tmp_path, fake_nvml, monkeypatch)
    m = _exposition(snap, compat={"dcgm", "cadvisor"})
    (labels, value), _ = m["DCGM_FI_DEV_GPU_UTIL"]
    assert labels["environment"] == "env0" and labels["UUID"] == gpu_uuid(0) and value == 40
    assert dict((x["gpu"], v) for x, v in m["DCGM_FI_DEV_FB_USED"]) == {"0": 10240, "1": 10240}
    assert m["DCGM_FI_DEV_POWER_USAGE"][0][1] == 300
    assert [x["gpu"] for x, _ in m["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"]] == ["0"]
    assert m["DCGM_FI_DEV_XID_ERRORS"][0][1] == 119
    cadv = {k: {x["environment"]: v for x, v in samples} for k, samples in m.items()
            if k.startswith("container_")}
    assert cadv["container_cpu_usage_seconds_total"] == {"env0": 1.0, "env1": 2.0}
    assert cadv["container_spec_memory_limit_bytes"] == {"env0": GIB, "env1": 0}
    assert cadv["container_oom_events_total"]["env1"] == 2
    assert "envctl_gpu_utilization_ratio" in m  # envctl's own stay
    only_dcgm = _exposition(snap, compat={"dcgm"})
    assert "DCGM_FI_DEV_GPU_UTIL" in only_dcgm and not [
        n for n in only_dcgm if n.startswith("container_")]


def promtool() -> str | None:
    """promtool on PATH, else beside this interpreter (scripts/install-deps puts it in
    .venv/bin, unpacked from Debian's prometheus package without installing the server)."""
    beside = Path(sys.executable).parent / "promtool"
    return shutil.which("promtool") or (str(beside) if os.access(beside, os.X_OK) else None)


@pytest.mark.skipif(promtool() is None, reason="promtool not found (scripts/install-deps puts "
                    "it in .venv/bin)")
@pytest.mark.parametrize("version, mig", [(1, False), (2, False), (2, True)])
def test_promtool_finds_nothing_but_the_dcgm_label_case(tmp_path, fake_nvml, monkeypatch,
                                                        version, mig):
    """`promtool check metrics` (its naming lint: _total, base units, no percents) passes but
    for dcgm-exporter's camelCase labels (UUID, modelName, Hostname), kept to join with it: on
    cgroup v1 and v2, with the compat names, with MIG on (seven instances a GPU, the
    environments holding instances), a degraded environment and GPU sampling paused."""
    if mig:
        import bench.monitor_tick as bench

        fh = fake_host(tmp_path, 2, gpus=2, version=version)
        bench.with_mig(fh)
        monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
        s = fh.sampler(nvml=NvmlSession(fake_nvml))
        snap = s.tick()
        s.close()
        snap.health = {"env0": {"state": "up"}, "env1": {"state": "degraded", "drift": 1,
                                                          "heals": 3, "heal_failures": 2,
                                                          "retry_in": 40.0}}
        snap.gpus_paused = True
    else:
        snap = _gpu_snapshot(tmp_path, fake_nvml, monkeypatch, version=version)
    col = prom.SnapshotCollector(compat={"dcgm", "cadvisor"})
    col.update(snap)
    res = subprocess.run([promtool(), "check", "metrics"], capture_output=True, text=True,
                         input=prom.exposition(prom.registry_for(col)).decode(), timeout=60)
    lines = (res.stdout + res.stderr).splitlines()
    assert lines and not [x for x in lines if "not 'camelCase'" not in x], lines


@pytest.mark.parametrize("text, want", [("dcgm,cadvisor", {"dcgm", "cadvisor"}),
                                        (" cAdvisor ", {"cadvisor"}), ("none", set()),
                                        ("", set())])
def test_parse_compat(text, want):
    assert prom.parse_compat(text) == want


def test_parse_compat_refuses_unknown_names():
    from envctl.errors import InputError

    with pytest.raises(InputError, match="unknown node; allowed: dcgm, cadvisor"):
        prom.parse_compat("dcgm,node")


def test_one_series_per_configured_spec(tmp_path):
    fh = fake_host(tmp_path, 2)
    conf = tmp_path / "conf"
    conf.mkdir()
    for name in ("env0", "skipped"):
        (conf / f"{name}.yaml").write_text(f"name: {name}\nkind: cpu\n")
    s = fh.sampler(host_stats=False, config_dir=conf)
    snap = s.tick()
    snap.health = {"env0": {"state": "up"}, "env1": {"state": "up"}}
    m = _by_env(_exposition(snap))
    assert m["envctl_environment_configured"] == {"env0": 1, "env1": 0, "skipped": 1}
    assert m["envctl_environment_up"] == {"env0": 1, "env1": 1, "skipped": 0}
    (conf / "skipped.yaml").unlink()  # read again once the directory changes
    assert s.tick().configured == ["env0"]


def test_network_bytes_of_the_veth_envctl_made(tmp_path):
    fh = fake_host(tmp_path, 2)
    net = tmp_path / "sys-class-net"
    for name, rx, tx in (("ve-env0-1a2b", 111, 222), ("eth0", 9, 9)):
        (net / name / "statistics").mkdir(parents=True)
        (net / name / "statistics" / "rx_bytes").write_text(f"{rx}\n")
        (net / name / "statistics" / "tx_bytes").write_text(f"{tx}\n")
    for env, veth in (("env0", "ve-env0-1a2b"), ("env1", "../eth0")):
        j = fh.state / "journal" / f"{env}.json"
        data = json.loads(j.read_text())
        data["entries"].append({"key": f"veth:{veth}", "resource": {
            "kind": "veth", "name": veth, "bridge": "br", "netns": env, "interface": "eth0",
            "isolated": False}, "memo": {}, "status": "applied", "shared": False, "boot": BOOT})
        j.write_text(json.dumps(data))
    e0, e1 = fh.sampler(host_stats=False, sys_class_net=net).tick().envs
    # The host end's tx is what the environment received.
    assert (e0.veth, e0.net_rx_bytes, e0.net_tx_bytes) == ("ve-env0-1a2b", 222, 111)
    assert (e1.veth, e1.net_rx_bytes) == ("", None)  # not a link name: never read
    snap = fh.sampler(host_stats=False, sys_class_net=net).tick()
    net_m = {(x["envctl_environment"], x["direction"]): v for x, v in _exposition(snap)[
        "envctl_environment_network_bytes_total"]}
    assert net_m == {("env0", "receive"): 222, ("env0", "transmit"): 111}


def test_textfile_is_replaced_whole(tmp_path):
    fh = fake_host(tmp_path, 1)
    col = prom.SnapshotCollector()
    reg = prom.registry_for(col)
    col.update(fh.sampler(host_stats=False).tick())
    out = tmp_path / "tf" / "envctl.prom"
    prom.write_textfile(out, reg)
    prom.write_textfile(out, reg)
    assert os.listdir(out.parent) == ["envctl.prom"]  # no temporary file left
    assert "envctl_environment_memory_usage_bytes{" in out.read_text()


def test_metrics_served_on_loopback(tmp_path):
    fh = fake_host(tmp_path, 1)
    col = prom.SnapshotCollector()
    col.update(fh.sampler(host_stats=False).tick())
    server = mhttp.MetricsServer(("127.0.0.1", 0))
    server.publish(prom.exposition(prom.registry_for(col)))
    host, port = server.address
    got = {}

    def scrape():
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
            got["type"] = r.headers["Content-Type"]
            got["body"] = r.read().decode()

    t = threading.Thread(target=scrape)
    t.start()
    mhttp.serve_until(server, lambda: "body" in got)  # as the monitor's loop steps it
    t.join(10)
    server.close()
    assert got["type"].startswith("text/plain; version=0.0.4")
    assert prom.parse_exposition(got["body"])["envctl_environment_tasks"][0][1] == 12


@pytest.mark.parametrize("text, want", [("127.0.0.1:9464", ("127.0.0.1", 9464)),
                                        ("[::1]:9400", ("::1", 9400)), ("none", None)])
def test_parse_listen(text, want):
    assert mhttp.parse_listen(text) == want


@pytest.mark.parametrize("text", ["9464", "localhost", ":9464", "a:99999"])
def test_parse_listen_refuses(text):
    from envctl.errors import InputError

    with pytest.raises(InputError, match="ADDR:PORT"):
        mhttp.parse_listen(text)


# ---------------------------------------------------------------- events log


def test_events_recent_per_environment(tmp_path):
    for i in range(8):
        events.append(tmp_path, "a" if i % 2 else "b", "drift", f"n{i}", now=100.0 + i)
    with open(events.path(tmp_path), "ab") as f:
        f.write(b'{"torn": ')  # a crash mid-append
    got = events.recent(tmp_path, per_env=2)
    assert [r["detail"] for r in got["a"]] == ["n5", "n7"]
    assert [r["detail"] for r in got["b"]] == ["n4", "n6"]
    assert events.recent(tmp_path, envs=["a"]).keys() == {"a"}
    assert events.format_event(got["a"][-1]).endswith(" drift: n7")
    assert events.recent(tmp_path / "nothing") == {}


def test_events_log_rotates(tmp_path):
    for _ in range(50):
        events.append(tmp_path, "a", "heal-failed", "x" * 100, max_bytes=1000)
    assert events.path(tmp_path).stat().st_size <= 1000 + 200
    assert (tmp_path / "events.jsonl.1").exists()
    assert events.recent(tmp_path)["a"][-1]["event"] == "heal-failed"


# ---------------------------------------------------------------- the tick path


def test_the_tick_imports_neither_typer_nor_rich(tmp_path):
    fake_host(tmp_path, 2, gpus=2)
    code = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
sys.path.insert(0, {str(PYNVML_DIR)!r})
from pathlib import Path
from tests.unit.test_monitor import fake_host_again
from envctl.monitor.daemon import Monitor, Options
import pynvml
from envctl.monitor.nvml import NvmlSession
fh, sampler = fake_host_again(Path({str(tmp_path)!r}), NvmlSession(pynvml))
mon = Monitor(None, Options(csv_dir=Path({str(tmp_path / 'csv')!r}),
              textfile=Path({str(tmp_path / 'm.prom')!r})), sampler=sampler, health=False)
mon.tick()
mon.tick()
bad = sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'rich', 'click',
                                                             'pydantic', 'yaml'))
print(bad, pynvml.calls['init'])
"""
    env = {**os.environ, "FAKE_NVML_JSON": str(tmp_path / "nvml.json"),
           "PYTHONPATH": str(REPO / "src")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[] 1"
    assert (tmp_path / "m.prom").read_text().count("envctl_gpu_utilization_ratio{") == 2


def fake_host_again(root: Path, nvml: NvmlSession | None = None) -> tuple[FakeHost, Sampler]:
    """A sampler over the fake host fake_host already made under `root` (for subprocesses)."""
    lay = CgroupLayout({c: str(root / "cgroup" / c) for c in V1})
    fh = FakeHost(root, root / "state", root / "run", root / "proc", Cgroups(lay, "envctl"),
                  root / "nvml.json", [], 1)
    return fh, fh.sampler(nvml=nvml, host_stats=False)


# ---------------------------------------------------------------- top, status --watch, CLI


def test_top_draws_environments_gpus_and_jobs(tmp_path, fake_nvml, monkeypatch):
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from envctl.monitor.top import run_top

    fh = fake_host(tmp_path, 2, gpus=2)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    jb.write(fh.state, jb.Job(id=7, env="env1", argv=["x"], name="train",
                              state=jb.State.RUNNING, supervisor=jb.identity(), boot_id=BOOT))
    events.append(fh.state, "env0", "healed", "+ service env0")
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False, color_system=None)
    host = SimpleNamespace(state_dir=fh.state, boot_id=BOOT)
    sampler = fh.sampler(nvml=NvmlSession(fake_nvml))
    run_top(host, interval=2.0, sampler=sampler, console=console, iterations=2,
            sleep=lambda s: None, states=lambda names: {n: "up" for n in names})
    text = out.getvalue()
    env_rows = [line.split() for line in text.splitlines() if line.lstrip().startswith("env")]
    assert env_rows[-2][:4] == ["env0", "up", "0.0%", "2"] and env_rows[-2][-1] == "healed"
    assert env_rows[-1][0] == "env1" and "1" in env_rows[-1]  # its running job
    assert "NVIDIA H200" in text and "train" in text and "RUNNING" in text
    assert fake_nvml.calls["shutdown"] == 1  # closed on the way out


def test_status_watch_redraws(tmp_path):
    import io

    from rich.console import Console

    from envctl.monitor.top import watch

    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=False, color_system=None)
    drawn = []

    def render(inner):
        drawn.append(1)
        inner.print(f"draw {len(drawn)}")

    waits = []
    watch(render, interval=0.5, console=console, iterations=3, sleep=waits.append)
    assert len(drawn) == 3 and waits == [0.5, 0.5]
    assert "draw 3" in out.getvalue()


@pytest.mark.parametrize("argv, message", [
    (["monitor", "--no-heal", "--listen", "9464"], "--listen '9464'"),
    (["monitor", "--no-heal", "--interval", "0"], "--interval 0"),
    (["monitor", "--no-heal", "--compat", "dcgm,prometheus"], "--compat 'dcgm,prometheus'"),
    (["status", "--watch", "--json"], "--watch"),
    (["top", "-n", "-1"], "--interval -1"),
])
def test_cli_refuses_bad_options(capsys, tmp_path, monkeypatch, argv, message):
    from envctl.cli import main

    monkeypatch.setenv("ENVCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ENVCTL_CONFIG_DIR", str(REPO / "configs"))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "state").exists()


def test_systemd_driver_reads_the_environment_slice(tmp_path):
    fh = fake_host(tmp_path, 0, version=2)
    unified = Path(fh.cgroups.lay.unified)
    d = unified / "envctl.slice" / "envctl-box.slice"
    d.mkdir(parents=True)
    for name, text in _cgroup_files(2, 0)[""].items():
        (d / name).write_text(text)
    journal = {"version": 1, "log": 0, "meta": {}, "entries": [{
        "key": "cgroup-slice:box", "memo": {}, "status": "applied", "shared": False,
        "boot": BOOT, "resource": {"kind": "cgroup-slice", "env": "box", "version": 2,
                                   "properties": [], "devices": [], "parent": ""}}]}
    (fh.state / "journal" / "box.json").write_text(json.dumps(journal))
    (e,) = fh.sampler(host_stats=False).tick().envs
    assert (e.driver, e.cgroup) == ("systemd", "/envctl.slice/envctl-box.slice")
    assert e.mem_usage == 512 << 20 and e.cpu_seconds == 1.0 and e.tasks == 12


# ---------------------------------------------------------------- a job's GPU accounting


def _meter_cfg(tmp_path, gpus: list[dict], **extra) -> Path:
    path = tmp_path / "nvml-job.json"
    path.write_text(json.dumps({"driver": "550.54.15", **extra, "gpus": [
        {"name": "NVIDIA H100", "minor": i, "memory": 80 * GIB, **g}
        for i, g in enumerate(gpus)]}))
    return path


def test_job_meter_counts_energy_and_sampled_peak_memory_of_the_jobs_pids(
        tmp_path, monkeypatch, fake_nvml):
    from envctl.monitor.nvml import JobGpuMeter

    procs = [[100, 3 * GIB], [200, 5 * GIB]]  # 200 is somebody else's
    cfg = _meter_cfg(tmp_path, [
        {"uuid": "GPU-a", "energy": [1_000_000, 1_250_500], "processes": procs},
        {"uuid": "GPU-b", "energy": [7_000, 9_000], "processes": [[101, None], [102, GIB]]},
        {"uuid": "GPU-c", "energy": 5, "processes": []}])  # not the job's
    monkeypatch.setenv("FAKE_NVML_JSON", str(cfg))
    meter = JobGpuMeter(fake_nvml, ["GPU-a", "GPU-b"])
    mine = {100, 101, 102}.__contains__
    meter.sample(mine)
    # The fake read its configuration at nvmlInit: the job's use changes in it live.
    fake_nvml._config["gpus"][0]["processes"] = [[100, 4 * GIB], [200, 5 * GIB]]
    meter.sample(mine)
    fake_nvml._config["gpus"][0]["processes"] = [[100, GIB]]
    meter.sample(mine)
    got = meter.finish()
    assert got["gpu_energy_joules"] == 252.5  # (250500 + 2000) mJ
    assert got["gpu_usage"] == {"GPU-a": {"energy_mj": 250_500, "peak_memory_bytes": 4 * GIB},
                                "GPU-b": {"energy_mj": 2_000, "peak_memory_bytes": GIB}}
    assert got["gpu_peak_memory_bytes"] == 5 * GIB and got["gpu_note"] is None
    assert fake_nvml.calls["shutdown"] == fake_nvml.calls["init"]


def test_job_meter_without_energy_or_nvml_leaves_fields_empty_with_a_note(
        tmp_path, monkeypatch, fake_nvml):
    from envctl.monitor.nvml import JobGpuMeter

    monkeypatch.setenv("FAKE_NVML_JSON", str(_meter_cfg(tmp_path, [
        {"uuid": "GPU-old", "processes": None}])))  # pre-Volta: no energy; no process list
    meter = JobGpuMeter(fake_nvml, ["GPU-old"])
    meter.sample(lambda pid: True)
    got = meter.finish()
    assert got["gpu_energy_joules"] is None and got["gpu_peak_memory_bytes"] is None
    assert got["gpu_usage"] == {"GPU-old": {"energy_mj": None, "peak_memory_bytes": None}}
    assert "no energy counter" in got["gpu_note"] and "cannot be listed" in got["gpu_note"]
    monkeypatch.setenv("FAKE_NVML_JSON", str(_meter_cfg(tmp_path, [], fail_init=9)))
    broken = JobGpuMeter(fake_nvml, ["GPU-x"])
    broken.sample(lambda pid: True)
    got = broken.finish()
    assert got["gpu_energy_joules"] is None and "Driver Not Loaded" in got["gpu_note"]
