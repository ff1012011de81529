"""NVML across the monitor's life (monitor/nvmlkeep.py, monitor/nvml.py) with the fake pynvml
(tests/fakes/pynvml, "live": re-read at every call): a failed init is retried with backoff and
a logged reason; a driver reload (every call failing RM_VERSION_MISMATCH) shuts the session
down and opens it again; one GPU's failing identity or sampling never drops the others."""

from __future__ import annotations

import json
import os
import time

from envctl.monitor.nvml import NvmlSession
from envctl.monitor.nvmlkeep import NvmlKeeper
from tests.unit.test_monitor import GIB, Clock, fake_host, gpu_uuid
from tests.unit.test_monitor import fake_nvml as fake_nvml  # noqa: F401 - the fixture


def _keeper(fake, clock, said):
    def opener(root, *, mode=None):
        try:
            return NvmlSession(fake), ""
        except fake.NVMLError as exc:
            return None, f"GPUs not sampled: NVML failed to initialise: {exc}"

    return NvmlKeeper(None, opener=opener, clock=clock, say=said.append)


def _config(fh, **changes):
    cfg = json.loads(fh.nvml_json.read_text())
    cfg["live"] = True
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    fh.nvml_json.write_text(json.dumps(cfg))
    return cfg


def test_a_failed_init_is_retried_with_backoff_and_a_reason(tmp_path, fake_nvml, monkeypatch):
    fh = fake_host(tmp_path, 1, gpus=2)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    _config(fh, fail_init=9)  # DRIVER_NOT_LOADED
    clock, said = Clock(0.0), []
    k = _keeper(fake_nvml, clock, said)
    assert k.sample() == [] and k.problems == [
        "GPUs not sampled: NVML failed to initialise: Driver Not Loaded"]
    assert said == ["GPUs not sampled: NVML failed to initialise: Driver Not Loaded; NVML "
                    "tried again in 10 s, then less and less often"]
    attempts = []
    for t in range(0, 200):  # 200 s of 1 s ticks: tried at 10, 30, 70, 150 s only
        clock.t = float(t)
        before = k.failures
        k.sample()
        if k.failures != before:
            attempts.append(t)
    assert attempts == [10, 30, 70, 150]
    assert len(said) == 1  # the same reason is said once
    _config(fh, fail_init=None)
    clock.t = 1000.0
    gpus = k.sample()
    assert [g.uuid for g in gpus] == [gpu_uuid(0), gpu_uuid(1)] and k.problems == []
    assert said[-1] == "NVML initialised (driver 550.54.15, 2 GPU(s))"


def test_a_driver_reload_shuts_nvml_down_and_opens_it_again(tmp_path, fake_nvml, monkeypatch):
    fh = fake_host(tmp_path, 1, gpus=2)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    _config(fh)
    clock, said = Clock(0.0), []
    k = _keeper(fake_nvml, clock, said)
    assert [g.util for g in k.sample()] == [40, 41]
    _config(fh, error=18)  # every call: RM has detected an NVML/RM version mismatch
    assert k.sample() == []  # nothing stale exported
    assert fake_nvml.calls["shutdown"] == 1 and k.session is None
    assert "NVML/RM version mismatch" in said[-1] and "shut down" in said[-1]
    _config(fh, error=None)  # the new driver is up
    clock.t = 5.0
    assert k.sample() == []  # backing off: 10 s
    clock.t = 10.0
    assert [g.util for g in k.sample()] == [40, 41]
    assert fake_nvml.calls["init"] == 2 and said[-1].startswith("NVML initialised again")
    assert k.failures == 0


def test_one_gpus_errors_never_drop_the_others(tmp_path, fake_nvml, monkeypatch):
    fh = fake_host(tmp_path, 1, gpus=3)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    cfg = _config(fh)
    cfg["gpus"][1]["fail"] = ["nvmlDeviceGetName"]  # GPU 1 cannot say its name
    cfg["gpus"][2]["fail"] = ["nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage"]
    fh.nvml_json.write_text(json.dumps(cfg))
    session = NvmlSession(fake_nvml)
    gpus = session.sample()
    assert [g.uuid for g in gpus] == [gpu_uuid(0), gpu_uuid(2)]
    assert session.problems == ["GPU 1: not sampled: NVML: Unknown Error"]
    g0, g2 = gpus
    assert (g0.temp, g0.power_w) == (50, 300.0)
    assert (g2.temp, g2.power_w, g2.util, g2.fb_used) == (None, None, 42, 10 * GIB)
    assert not session.broken
    session.close()


def test_every_gpu_lost_is_reported_then_nvml_opened_again(tmp_path, fake_nvml, monkeypatch):
    fh = fake_host(tmp_path, 1, gpus=1)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    cfg = _config(fh)
    clock, said = Clock(0.0), []
    k = _keeper(fake_nvml, clock, said)
    k.sample()
    cfg["gpus"][0]["lost"] = True
    fh.nvml_json.write_text(json.dumps(cfg))
    (g,) = k.sample()  # this tick says it is lost (the quarantine reads it) …
    assert g.lost and k.session is None and "every GPU is lost" in said[-1]
    cfg["gpus"][0]["lost"] = False  # … `nvidia-smi -r` brought it back
    fh.nvml_json.write_text(json.dumps(cfg))
    clock.t = 10.0
    (g,) = k.sample()
    assert not g.lost and g.util == 40


def test_a_surprise_from_the_binding_costs_the_gpus_not_the_tick(tmp_path, fake_nvml,
                                                                 monkeypatch):
    fh = fake_host(tmp_path, 1, gpus=1)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    _config(fh)
    clock, said = Clock(0.0), []
    k = _keeper(fake_nvml, clock, said)
    temperature = fake_nvml.nvmlDeviceGetTemperature
    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetTemperature",
                        lambda *a: (_ for _ in ()).throw(TypeError("a new signature")))
    assert k.sample() == [] and "bug: TypeError('a new signature')" in said[-1]
    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetTemperature", temperature)
    clock.t = 10.0
    assert [g.temp for g in k.sample()] == [50]


# ---------------------------------------------------------------- the operator's GPU pause


def _pausable(fh, fake, said, clock=None):
    def opener(root, *, mode=None):
        return NvmlSession(fake), ""

    return NvmlKeeper(None, opener=opener, clock=clock or Clock(0.0), say=said.append,
                      run_dir=fh.run)


def test_a_gpu_pause_shuts_nvml_down_and_sampling_resumes_after(tmp_path, fake_nvml,
                                                                  monkeypatch):
    """`maintenance --gpus on` (the mark): the keeper shuts NVML down (the fake's session
    closed: no handle open), samples no GPU and does not open NVML again while paused; the
    mark gone, the next sample opens it and the GPUs are back."""
    from envctl.monitor import maintenance
    from envctl.monitor.nvmlkeep import HELD, holders

    fh = fake_host(tmp_path, 1, gpus=2)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    said = []
    k = _pausable(fh, fake_nvml, said)
    assert len(k.sample()) == 2 and fake_nvml.calls == {"init": 1, "shutdown": 0}
    assert not fh.run.exists()  # no environment up, no run directory: the monitor makes none
    fh.run.mkdir()
    assert len(k.sample()) == 2 and fake_nvml.calls == {"init": 1, "shutdown": 0}
    assert holders(fh.run) == [os.getpid()]  # nvml-held.d/PID: this process holds NVML

    assert maintenance.set_mode(fh.run, maintenance.GPUS, True, now=5.0)
    assert k.poll_pause() is True
    assert fake_nvml.calls == {"init": 1, "shutdown": 1} and fake_nvml._config is None
    assert k.session is None and k.releases == 1
    assert not (fh.run / HELD).exists() and holders(fh.run) == []
    sampled = fake_nvml.sampled["calls"]
    for _ in range(3):  # ticks while paused: no GPU, no NVML call, a problem that says why
        assert k.sample() == []
    assert fake_nvml.calls["init"] == 1 and fake_nvml.sampled["calls"] == sampled
    assert len(k.problems) == 1 and "GPU sampling paused since" in k.problems[0]
    assert any("no GPU node is held by the monitor" in line for line in said)

    assert maintenance.set_mode(fh.run, maintenance.GPUS, False)
    assert [g.uuid for g in k.sample()] == [gpu_uuid(0), gpu_uuid(1)]
    assert fake_nvml.calls == {"init": 2, "shutdown": 1} and k.problems == []
    assert holders(fh.run) == [os.getpid()] and "GPU sampling resumed" in said[-1]
    k.close()
    assert fake_nvml.calls["shutdown"] == 2 and not (fh.run / HELD).exists()


def test_a_pause_asked_while_nvml_opens_is_waited_for_and_honoured(tmp_path, fake_nvml,
                                                                    monkeypatch):
    """NVML's open takes from 0.1 s to seconds on real GPUs: the held file was written only
    after it, so a `maintenance --gpus on` during the open found no holder and returned 0
    while the keeper went on to open NVML. Now the file says so before the open, and a mark
    made meanwhile is honoured at once after it."""
    from envctl.monitor import maintenance
    from envctl.monitor.nvmlkeep import holders

    fh = fake_host(tmp_path, 1, gpus=1)
    fh.run.mkdir()
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    seen = []

    def opener(root, *, mode=None):
        seen.append(holders(fh.run))  # what `maintenance --gpus on` would find now
        maintenance.set_mode(fh.run, maintenance.GPUS, True)  # the operator, meanwhile
        return NvmlSession(fake_nvml), ""

    k = NvmlKeeper(None, opener=opener, clock=Clock(0.0), say=[].append, run_dir=fh.run)
    assert seen == [[os.getpid()]]
    assert k.session is None and fake_nvml.calls == {"init": 1, "shutdown": 1}
    assert holders(fh.run) == [] and k.sample() == []


def test_a_monitor_started_while_paused_never_opens_nvml(tmp_path, fake_nvml, monkeypatch):
    from envctl.monitor import maintenance

    fh = fake_host(tmp_path, 1, gpus=1)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    maintenance.set_mode(fh.run, maintenance.GPUS, True)
    k = _pausable(fh, fake_nvml, [])
    assert k.sample() == [] and fake_nvml.calls["init"] == 0


def test_the_monitor_lets_nvml_go_between_ticks(tmp_path, fake_nvml, monkeypatch):
    """With a 60 s interval, the mark made after the first tick is seen by the loop's look
    between ticks (PAUSE_POLL): NVML is shut down with still one tick done, and the snapshot
    of the next tick says paused (envctl_monitor_gpu_sampling_paused 1, no GPU series)."""
    import threading

    from envctl.monitor import maintenance
    from envctl.monitor.daemon import Monitor, Options

    fh = fake_host(tmp_path, 1, gpus=1)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    k = _pausable(fh, fake_nvml, [], clock=time.monotonic)
    mon = Monitor(None, Options(interval=60.0, csv_dir=None), sampler=fh.sampler(nvml=k),
                  health=False, say=lambda line: None)
    ticks = []
    real_tick = mon.tick
    mon.tick = lambda: ticks.append(1) or real_tick()
    seen = {}

    def operator():
        deadline = time.monotonic() + 20
        while not ticks and time.monotonic() < deadline:
            time.sleep(0.01)
        maintenance.set_mode(fh.run, maintenance.GPUS, True)
        while fake_nvml.calls["shutdown"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.update(ticks=len(ticks), shutdown=fake_nvml.calls["shutdown"])
        mon.stopping = True  # as SIGTERM would; the loop sees it at its next wake (<= 1 s)

    t = threading.Thread(target=operator)
    t.start()
    mon.run()
    t.join(10)
    assert seen == {"ticks": 1, "shutdown": 1}
    snap = fh.sampler(nvml=k).tick()  # the next tick (run() closed the monitor's sampler)
    assert snap.gpus == [] and snap.gpus_paused and fake_nvml.calls["init"] == 1
    mon.collector.update(snap)
    from envctl.monitor.prom import exposition

    text = exposition(mon.registry).decode()
    assert "envctl_monitor_gpu_sampling_paused 1.0" in text and "envctl_gpu_" not in text


def test_maintenance_gpus_on_waits_for_the_monitor_to_let_go(tmp_path, monkeypatch):
    """`envctl maintenance --gpus on` returns once no nvml-held.d/PID names a live holder (the
    monitor let go; a second holder, `top`, too), at once when a file names a process that is
    not (any more) the one that wrote it, and exit 1 when NVML is still held at the end of the
    wait."""
    import subprocess
    import sys
    import threading

    from envctl import app as ops
    from envctl import commands
    from envctl.host.files import write_json
    from envctl.monitor import maintenance
    from envctl.monitor.nvmlkeep import HELD, holders, start_time

    run = tmp_path / "run"
    monkeypatch.setenv("ENVCTL_RUN_DIR", str(run))
    monkeypatch.setenv("ENVCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(ops, "require_root", lambda action: None)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = {"pid": os.getpid(), "start": start_time(os.getpid())}
        them = {"pid": other.pid, "start": start_time(other.pid)}
        write_json(run / HELD / str(me["pid"]), me)
        write_json(run / HELD / str(them["pid"]), them)
        assert holders(run) == sorted([me["pid"], them["pid"]], key=str)
        threading.Timer(0.2, (run / HELD / str(me["pid"])).unlink).start()
        threading.Timer(0.4, (run / HELD / str(them["pid"])).unlink).start()
        assert commands.maintenance_gpus("on", commands.Options(), json_=True, wait=20) == 0
        assert holders(run) == [] and maintenance.read(run, maintenance.GPUS)["since"] > 0

        # A reused pid (another start time) and a dead one are not holders.
        write_json(run / HELD / "1", {"pid": os.getpid(), "start": me["start"] + 1})
        other.kill()
        other.wait()
        write_json(run / HELD / str(them["pid"]), them)
        assert commands.maintenance_gpus("on", commands.Options(), json_=True, wait=20) == 0
        write_json(run / HELD / str(me["pid"]), me)
        assert commands.maintenance_gpus("on", commands.Options(), json_=True, wait=0.3) == 1
        assert commands.maintenance_gpus("off", commands.Options(), json_=True) == 0
        assert maintenance.read(run, maintenance.GPUS) is None
    finally:
        other.kill()
        other.wait()


def test_two_holders_one_file_each(tmp_path, fake_nvml, monkeypatch):
    """The monitor and `envctl top` (or `monitor --once`) each hold NVML: each has its own
    nvml-held.d/PID, so the one that stops first does not take the other's away."""
    from envctl.monitor.nvmlkeep import HELD

    fh = fake_host(tmp_path, 1, gpus=1)
    fh.run.mkdir()
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    real = os.getpid()
    a = _pausable(fh, fake_nvml, [])
    a.sample()
    monkeypatch.setattr(os, "getpid", lambda: 1)  # the second keeper as another process
    b = _pausable(fh, fake_nvml, [])
    b.sample()
    assert sorted(os.listdir(fh.run / HELD)) == sorted(["1", str(real)])
    b.close()
    assert os.listdir(fh.run / HELD) == [str(real)]
    monkeypatch.setattr(os, "getpid", lambda: real)
    a.close()
    assert not (fh.run / HELD).exists()  # the last one out takes the directory
