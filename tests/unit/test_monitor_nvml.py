"""NVML across the monitor's life (monitor/nvmlkeep.py, monitor/nvml.py) with the fake pynvml
(tests/fakes/pynvml, "live": re-read at every call): a failed init is retried with backoff and
a logged reason; a driver reload (every call failing RM_VERSION_MISMATCH) shuts the session
down and opens it again; one GPU's failing identity or sampling never drops the others."""

from __future__ import annotations

import json

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
