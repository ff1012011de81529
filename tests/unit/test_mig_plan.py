"""Placing the MIG instances specs ask for (plan.mig.assign_mig) and planning them
(plan_mig through plan_env): sticky slots, what others hold, instances envctl did not make,
the refusals' words. Pure: facts are built by hand."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from envctl.facts import GpuFact, GpuHostFacts, HostFacts, MigFact
from envctl.plan.mig import PENDING_KEY, assign_mig
from envctl.spec.migprofiles import model_profiles
from envctl.spec.models import EnvSpec

H200 = [GpuFact(index=i, uuid=f"GPU-{i}", name="NVIDIA H200", minor=i) for i in range(2)]


def spec(name: str, mig) -> EnvSpec:
    return EnvSpec.model_validate({"name": name, "kind": "gpu", "gpus": {"mig": mig}})


def facts(gpus=H200, **kw) -> HostFacts:
    return HostFacts(gpu=GpuHostFacts(driver="550.54.15", gpus=tuple(gpus)), **kw)


def test_placements_in_spec_order_at_the_lowest_free_slots():
    placed, why = assign_mig([spec("a", [{"gpu": 0, "profile": "3g.71gb"},
                                         {"gpu": 0, "profile": "1g.18gb", "count": 2},
                                         {"gpu": 0, "profile": "1g.35gb"}])], facts())
    assert why == {}
    assert [(p[2], p[3], p[4], p[5]) for p in placed["a"]] == [
        ("3g.71gb", 0, 4, ""), ("1g.18gb", 4, 1, ""), ("1g.18gb", 5, 1, ""),
        ("1g.35gb", 6, 2, "")]


def test_a_2g_after_two_1g_has_no_placement_left_and_the_refusal_names_the_free_slots():
    _, why = assign_mig([spec("a", [{"gpu": 0, "profile": "3g.71gb"},
                                    {"gpu": 0, "profile": "1g.18gb", "count": 2},
                                    {"gpu": 0, "profile": "2g.35gb"}])], facts())
    assert why == {"a": "mig.2: no room on GPU 0 for 2g.35gb (it needs slots 0-1 or 2-3 or "
                        "4-5; free slots: 6-7; its instances before it take slots 0-3, 4, 5)"}


def test_others_claims_instances_not_envctls_and_stickiness():
    held = (("up-env", "GPU-0", "3g.71gb", 0, 4),)
    foreign = MigFact(uuid="MIG-x", parent=0, gi=1, ci=0, profile="3g.71gb", start=4, size=4)
    gpu0 = dataclasses.replace(H200[0], mig=True, mig_devices=(foreign,))
    f = facts([gpu0, H200[1]], mig_held=held)
    _, why = assign_mig([spec("b", [{"gpu": 0, "profile": "3g.71gb"}])], f)
    assert why["b"] == ("mig.0: no room on GPU 0 for 3g.71gb (it needs slots 0-3 or 4-7; free "
                        "slots: none; held by environment 'up-env'; an instance envctl did not "
                        "make holds some)")
    # The environment that holds slots 0-3 keeps them, and finds its instance there.
    mine = MigFact(uuid="MIG-mine", parent=0, gi=2, ci=0, profile="3g.71gb", start=0, size=4)
    gpu0 = dataclasses.replace(gpu0, mig_devices=(foreign, mine))
    placed, why = assign_mig([spec("up-env", [{"gpu": 0, "profile": "3g.71gb"}])],
                             facts([gpu0, H200[1]], mig_held=held))
    assert why == {} and placed["up-env"] == ((0, "GPU-0", "3g.71gb", 0, 4, "MIG-mine"),)


def test_specs_read_together_never_share_slots():
    placed, why = assign_mig([spec("b", [{"gpu": 1, "profile": "4g.71gb"}]),
                              spec("a", [{"gpu": 1, "profile": "3g.71gb", "count": 2}])],
                             facts())
    assert [(p[3], p[4]) for p in placed["a"]] == [(0, 4), (4, 4)]
    assert "held by environment 'a'" in why["b"]


@pytest.mark.parametrize(("mig", "words"), [
    ([{"gpu": 5, "profile": "1g.18gb"}], "mig.0: no GPU with index 5 here"),
    ([{"gpu": 0, "profile": "1g.10gb"}], "GPU 0 is an H200: its MIG profiles are 1g.18gb"),
    ([{"gpu": 0, "profile": "3g.71gb", "start": 2}], "3g.71gb starts at slot 0 or 4, not 2"),
    ([{"gpu": 0, "profile": "4g.71gb", "count": 2}], "a GPU holds at most 1 4g.71gb instance"),
])
def test_refusals(mig, words):
    _, why = assign_mig([spec("a", mig)], facts())
    assert words in why["a"]


def test_a_model_without_a_table_and_a_gpu_held_whole():
    old = GpuFact(index=0, uuid="GPU-v", name="Tesla V100-SXM2-32GB")
    _, why = assign_mig([spec("a", [{"gpu": 0, "profile": "1g.18gb"}])], facts([old]))
    assert "is not a model envctl knows the MIG profiles of (H200, H100 NVL" in why["a"]
    _, why = assign_mig([spec("a", [{"gpu": 0, "profile": "1g.18gb"}])],
                        facts(gpu_held={"GPU-0": "whole"}))
    assert why["a"] == "mig.0: GPU 0 is held whole by environment 'whole'"


def test_spec_errors_name_the_allowed_profiles_and_the_start_rule():
    with pytest.raises(ValidationError) as exc:
        spec("a", [{"gpu": 0, "profile": "3g.70gb"}])
    assert "no MIG profile '3g.70gb': allowed are the names `nvidia-smi mig -lgip` prints: " \
        "1g.10gb" in str(exc.value)
    with pytest.raises(ValidationError) as exc:
        spec("a", [{"gpu": 0, "profile": "1g.18gb", "count": 2, "start": 0}])
    assert "start places one instance" in str(exc.value)
    with pytest.raises(ValidationError) as exc:
        EnvSpec.model_validate({"name": "a", "kind": "gpu",
                                "gpus": {"count": 1, "mig": [{"gpu": 0, "profile": "1g.18gb"}]}})
    assert "give one of all, count, indices, uuids or mig" in str(exc.value)


def test_the_h200_table_is_nvidia_smis():
    model, table = model_profiles("NVIDIA H200")
    assert model == "H200"
    assert {n: (p.size, p.starts, p.most) for n, p in table.items()} == {
        "1g.18gb": (1, (0, 1, 2, 3, 4, 5, 6), 7), "1g.18gb+me": (1, (0, 1, 2, 3, 4, 5, 6), 1),
        "1g.35gb": (2, (0, 2, 4, 6), 4), "2g.35gb": (2, (0, 2, 4), 3),
        "3g.71gb": (4, (0, 4), 2), "4g.71gb": (4, (0,), 1), "7g.141gb": (8, (0,), 1)}
    assert model_profiles("NVIDIA H100 80GB HBM3")[0] == "H100 80GB"
    assert model_profiles("NVIDIA H100 NVL")[0] == "H100 NVL"
    assert model_profiles("NVIDIA A100-SXM4-80GB")[0] == "A100 80GB"


def test_plan_shows_the_placements_and_what_is_yet_to_be_made():
    from envctl.plan.planner import plan_env

    f = dataclasses.replace(facts(), groups={"video": 44})
    f.gpu.majors.update({"nvidia-frontend": 195, "nvidia-uvm": 509, "nvidia-caps": 508})
    plan = plan_env(spec("a", [{"gpu": 0, "profile": "3g.71gb"},
                               {"gpu": 0, "profile": "1g.18gb"}]), f)
    assert plan.resolved["mig"] == "GPU 0: 3g.71gb at slots 0-3 (new); GPU 0: 1g.18gb at " \
        "slot 4 (new)"
    assert plan.resolved[PENDING_KEY] == 2
    kinds = [r.kind for r in plan.resources if r.kind.startswith("mig")]
    assert kinds == ["mig-mode", "mig-instance", "mig-instance"]
