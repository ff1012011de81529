"""GPU health gating, pure parts: kernel-log XID parsing, the NVML probe against the fake
NVML, the quarantine ledger's record/fresh/clear, and assignment that keeps quarantined GPUs
(and their MIG devices) out."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from envctl.engine import quarantine
from envctl.facts import GpuFact, GpuHostFacts, HostFacts, MigFact
from envctl.host import gpuhealth
from envctl.host.gpuhealth import Finding
from envctl.plan.gpus import assign_gpus
from envctl.spec.models import EnvSpec
from tests.fakes import PYNVML_DIR


def spec(name: str, gpus) -> EnvSpec:
    return EnvSpec.model_validate({"name": name, "kind": "gpu", "gpus": gpus})


G0, G1 = GpuFact(0, "GPU-0", pci="0000:3b:00.0"), GpuFact(1, "GPU-1", pci="0000:b1:00.0")


def test_parse_kmsg_keeps_fatal_xids_with_their_sequence():
    records = ["6,10,1,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=1, Graphics Exception",
               "4,11,2,-;NVRM: Xid (PCI:0000:B1:00): 79, pid=2, GPU has fallen off the bus.",
               "4,12,3,-;something else", "garbage"]
    assert gpuhealth.parse_kmsg(records) == [(11, "0000:b1:00", 79)]  # 13 is not fatal


def test_count_goes_around_a_quarantined_gpu_and_a_claim_of_it_is_refused():
    facts = HostFacts(gpu=GpuHostFacts(gpus=(G0, G1)), gpu_quarantined={"GPU-0": "XID 79"})
    got, why = assign_gpus([spec("a", 1), spec("b", [0])], facts)
    assert got == {"a": ("GPU-1",)}
    assert "GPU 0 (GPU-0) is quarantined (XID 79)" in why["b"]
    assert "envctl gpus --clear 0" in why["b"]
    got, why = assign_gpus([spec("a", 2)], facts)
    assert "quarantined: GPU 0" in why["a"]
    # An environment that held it keeps no claim to it at re-up.
    held = HostFacts(gpu=GpuHostFacts(gpus=(G0, G1)), gpu_quarantined={"GPU-0": "XID 79"},
                     gpu_held={"GPU-0": "a"})
    assert assign_gpus([spec("a", 1)], held)[0] == {"a": ("GPU-1",)}


def test_a_quarantined_parent_covers_its_mig_devices():
    mig = MigFact(uuid="MIG-x", parent=0, gi=1, ci=0, profile="3g.71gb", gi_minor=12,
                  ci_minor=13)
    parent = GpuFact(0, "GPU-0", mig=True, mig_devices=(mig,))
    facts = HostFacts(gpu=GpuHostFacts(gpus=(parent,)), gpu_quarantined={"GPU-0": "ECC"})
    _, why = assign_gpus([spec("a", ["MIG-x"])], facts)
    assert "is quarantined (ECC)" in why["a"]


def test_ledger_record_dedupes_clear_forgets_old_xids(tmp_path):
    f = Finding("GPU-1", 1, "xid", "XID 79 (kernel log record 812)", 812, ("MIG-a",))
    assert quarantine.record(tmp_path, [f, f], boot="b1", now=5.0) == {
        "GPU-1": "XID 79 (kernel log record 812)"}
    assert quarantine.record(tmp_path, [f], boot="b1") == {}  # nothing new: nothing written
    q = quarantine.load(tmp_path)
    assert q.covering("MIG-a") == "GPU-1" and q.gpus["GPU-1"]["since"] == 5.0
    with pytest.raises(Exception, match="quarantined: XID 79"):
        quarantine.refuse_quarantined(tmp_path, ["MIG-a"])
    assert quarantine.clear(tmp_path, "GPU-1", boot="b1", seq=900)["index"] == 1
    quarantine.refuse_quarantined(tmp_path, ["GPU-1"])
    # The same XID record is not evidence again in this boot; a later one is; another boot's
    # log starts afresh.
    q = quarantine.load(tmp_path)
    later = Finding("GPU-1", 1, "xid", "XID 79 (kernel log record 950)", 950)
    assert q.fresh([f, later], "b1") == [later]
    assert q.fresh([f], "b2") == [f]
    assert quarantine.clear(tmp_path, "GPU-1", boot="b1", seq=0) is None


def test_a_damaged_ledger_is_named(tmp_path):
    (tmp_path / quarantine.FILE).write_text("[1]")
    with pytest.raises(Exception, match="gpu-quarantine.json"):
        quarantine.load(tmp_path)


@pytest.fixture
def fake_nvml(tmp_path, monkeypatch):
    def use(gpus: list[dict]) -> object:
        path = tmp_path / "nvml.json"
        path.write_text(json.dumps({"driver": "550.54.15", "gpus": gpus}))
        monkeypatch.setenv("FAKE_NVML_JSON", str(path))
        monkeypatch.syspath_prepend(str(PYNVML_DIR))
        sys.modules.pop("pynvml", None)
        nv = importlib.import_module("pynvml")
        nv.nvmlInit()
        return nv

    yield use
    sys.modules.pop("pynvml", None)


def test_nvml_findings_on_the_fake(fake_nvml):
    base = {"name": "H100", "minor": 0, "memory": 1, "mig": False, "pci": "00000000:3B:00.0"}
    nv = fake_nvml([
        {**base, "uuid": "GPU-0", "ecc": {"dbe_vol": 2}, "remapped": [0, 0, 0, 1]},
        {**base, "uuid": "GPU-1", "retired_pending": 1},
        {**base, "uuid": "GPU-2", "lost": True},
        {**base, "uuid": "GPU-3", "ecc": {"dbe_vol": 0}, "remapped": [3, 0, 0, 0],
         "retired_pending": 0}])
    facts = GpuHostFacts(gpus=tuple(GpuFact(i, f"GPU-{i}") for i in range(4)))
    found = {(f.uuid, f.what, f.detail) for f in gpuhealth._nvml_findings(nv, facts)}
    assert found == {
        ("GPU-0", "ecc", "2 volatile uncorrectable ECC error(s) since the last reset"),
        ("GPU-0", "row-remap", "row remapping failed"),
        ("GPU-1", "retired-pages", "retired pages pending (a reset retires them)"),
        ("GPU-2", "lost", "NVML: GPU is lost (fallen off the bus or its driver state is "
                          "broken)")}
