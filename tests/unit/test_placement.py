"""Placement near the GPUs: `dedicated: {near_gpus: true, count: N}` and `memory.nodes:
near_gpus` resolved from the GPUs' NUMA node and local CPUs (fake HGX facts; no root)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from envctl.errors import SpecError
from envctl.facts import CgroupFacts, GpuFact, GpuHostFacts, HostFacts, MigFact
from envctl.host import gpus as hg
from envctl.plan.builder import PlanError
from envctl.plan.planner import plan_env
from envctl.resources.cgroup import Cgroup
from envctl.spec.loader import load_spec
from envctl.spec.models import EnvSpec
from envctl.spec.resolve import assign_near_cpus, dedicated_cpus, near_gpu_cpus
from tests.fakes import gpuhost

V1 = CgroupFacts(layout="hybrid", version=1,
                 controllers=("cpu", "cpuacct", "cpuset", "memory", "pids", "devices"),
                 cpus="0-63", mems="0-1")


def hgx(*, cpus: int = 64) -> tuple[GpuFact, ...]:
    """Eight GPUs, 0-3 on NUMA 0 (CPUs 0-31), 4-7 on NUMA 1 (CPUs 32-63), as gpuhost makes."""
    half = cpus // 2
    return tuple(GpuFact(i, f"GPU-{i}", minor=i, pci=f"0000:{gpuhost.HGX_BUSES[i]:02x}:00.0",
                         numa_node=i // 4,
                         local_cpus=tuple(range(i // 4 * half, (i // 4 + 1) * half)),
                         affinity="sysfs")
                 for i in range(8))


def facts(assigned: dict[str, tuple[str, ...]], **kw) -> HostFacts:
    return HostFacts(cpus=tuple(range(64)), numa_nodes=(0, 1), cgroup=V1,
                     gpu=GpuHostFacts(driver="550.54.15", gpus=hgx(),
                                      majors={"nvidia-frontend": 195, "nvidia-uvm": 509}),
                     groups={"video": 44}, gpu_assigned=assigned, **kw)


def spec(name: str = "g1", *, count: int = 4, gpus: object = None, nodes: object = "near_gpus",
         **cpu) -> EnvSpec:
    return EnvSpec.model_validate({
        "name": name, "kind": "gpu", "gpus": gpus if gpus is not None else {"count": 1},
        "resources": {"cpu": {"dedicated": {"near_gpus": True, "count": count}, **cpu},
                      "memory": {"nodes": nodes} if nodes is not None else {}}})


def cpuset(plan) -> dict[str, str]:
    cg = next(r for r in plan.resources if isinstance(r, Cgroup))
    return {f: v for _, f, v in cg.settings if f.startswith("cpuset.")}


# ---------------------------------------------------------------- the spec


def _load(tmp_path, text: str):
    path = tmp_path / "e.yaml"
    path.write_text(text)
    return load_spec(path)


def test_the_spec_form_and_its_errors_at_their_lines(tmp_path):
    ok = _load(tmp_path, "name: g\nkind: gpu\ngpus: {count: 2}\nresources:\n  cpu:\n"
                         "    dedicated: {near_gpus: true, count: 8}\n"
                         "  memory:\n    nodes: near_gpus\n").spec
    assert ok.resources.cpu.dedicated.count == 8 and ok.resources.memory.nodes == "near_gpus"
    with pytest.raises(SpecError) as exc:
        _load(tmp_path, "name: g\nkind: gpu\ngpus: {count: 2}\nresources:\n  cpu:\n"
                        "    dedicated: {near_gpus: false, count: 0}\n"
                        "  memory:\n    nodes: nearby\n")
    text = str(exc.value)
    assert "e.yaml:6:17: resources.cpu.dedicated.near_gpus: near_gpus: true is the only" in text
    assert "e.yaml:6:35: resources.cpu.dedicated.count: must be a whole number from 1" in text
    assert "e.yaml:8:5: resources.memory.nodes: memory.nodes is a list of NUMA nodes like " \
           "0-1, or near_gpus" in text
    assert "NearGpuCpus" not in text  # the union's tag is not a field of the spec


def test_near_gpus_without_gpus_is_refused_where_it_is_written(tmp_path):
    with pytest.raises(SpecError) as exc:
        _load(tmp_path, "name: g\nkind: gpu\nresources:\n  cpu:\n"
                        "    dedicated: {near_gpus: true, count: 2}\n"
                        "  memory:\n    nodes: near_gpus\n")
    text = str(exc.value)
    assert "e.yaml:5:17: resources.cpu.dedicated.near_gpus: dedicated CPUs near_gpus need " \
           "GPUs" in text
    assert "e.yaml:7:5: resources.memory.nodes: memory nodes near_gpus need GPUs" in text


def test_an_unknown_key_lists_the_fields_of_its_own_form(tmp_path):
    with pytest.raises(SpecError) as exc:
        _load(tmp_path, "name: g\nkind: gpu\ngpus: 1\nresources:\n  cpu:\n"
                        "    dedicated: {near_gpus: true, count: 2, reserve_first: 2}\n")
    assert "unknown field 'reserve_first'; allowed here: count, near_gpus" in str(exc.value)
    with pytest.raises(SpecError) as exc:
        _load(tmp_path, "name: g\nkind: gpu\ngpus: 1\nresources:\n  cpu:\n"
                        "    dedicated: {reserve_first: 2, count: 2}\n")
    assert "unknown field 'count'; allowed here: reserve_first, reserve_last, small_host" \
        in str(exc.value)


def test_listed_memory_nodes_still_parse():
    s = EnvSpec.model_validate({"name": "c", "kind": "cpu",
                                "resources": {"memory": {"nodes": "0-1"}}})
    assert s.resources.memory.nodes == (0, 1)


# ---------------------------------------------------------------- choosing the CPUs


def test_cpus_come_from_the_gpus_node_lowest_first():
    gpus = hgx()
    assert near_gpu_cpus(4, [gpus[5]], tuple(range(64)), {}) == (32, 33, 34, 35)
    assert near_gpu_cpus(2, [gpus[0]], tuple(range(64)), {0: "other"}) == (1, 2)


def test_cpus_are_spread_over_gpus_on_two_nodes():
    gpus = hgx()
    assert near_gpu_cpus(4, [gpus[3], gpus[4]], tuple(range(64)), {}) == (0, 1, 32, 33)


def test_too_few_free_near_the_gpus_names_what_is_free():
    gpus = hgx()
    taken = {c: "train" for c in range(32, 62)}
    with pytest.raises(ValueError) as exc:
        near_gpu_cpus(4, [gpus[6]], tuple(range(64)), taken)
    assert str(exc.value) == ("wants 4 dedicated CPUs near GPU 6 (CPUs 32-63), and only 62-63 "
                              "are free there (32-61 dedicated to train); lower count or free "
                              "those CPUs")


def test_a_gpu_whose_local_cpus_are_all_offline():
    with pytest.raises(ValueError) as exc:
        near_gpu_cpus(1, [hgx()[4]], (0, 1), {})
    assert str(exc.value) == ("wants 1 dedicated CPU near GPU 4, and none of its local CPUs "
                              "(32-63) is online (online: 0-1)")


def test_a_gpu_with_no_known_affinity_is_near_every_cpu():
    gpu = GpuFact(0, "GPU-0")
    assert near_gpu_cpus(2, [gpu], (0, 1, 2), {0: "x"}) == (1, 2)


def test_joint_assignment_avoids_listed_reserved_and_held_cpus():
    a = spec("a", count=4, gpus={"indices": [4]})
    b = spec("b", count=4, gpus={"indices": [5]})
    listed = EnvSpec.model_validate({"name": "c", "kind": "cpu",
                                     "resources": {"cpu": {"dedicated": "32-33"}}})
    f = facts({"a": ("GPU-4",), "b": ("GPU-5",)})
    out, why = assign_near_cpus([b, listed, a], f, {"up-elsewhere": [34, 35]})
    assert why == {}
    assert out == {"a": (36, 37, 38, 39), "b": (40, 41, 42, 43)}


def test_an_environment_keeps_the_near_cpus_it_holds():
    a = spec("a", count=2, gpus={"indices": [4]})
    f = facts({"a": ("GPU-4",)})
    assert assign_near_cpus([a], f, {"a": [50, 51]})[0] == {"a": (50, 51)}
    # Held CPUs no longer near its GPUs are not kept.
    assert assign_near_cpus([a], f, {"a": [1, 51]})[0] == {"a": (32, 51)}


def test_mig_devices_count_as_their_parent():
    gpus = list(hgx())
    gpus[6] = dataclasses.replace(gpus[6], mig=True, mig_devices=(
        MigFact("MIG-6-7-0", parent=6, gi=7, ci=0, profile="1g.18gb"),))
    f = dataclasses.replace(facts({"a": ("MIG-6-7-0",)}),
                            gpu=GpuHostFacts(driver="550.54.15", gpus=tuple(gpus)))
    assert dedicated_cpus(spec("a", count=2, gpus={"uuids": ["MIG-6-7-0"]}), f).cpus == (32, 33)


# ---------------------------------------------------------------- the plan


def test_plan_writes_the_cpuset_and_prints_the_placement():
    s = spec("g1", count=4, gpus={"indices": [3]})
    plan = plan_env(s, facts({"g1": ("GPU-3",)}))
    assert cpuset(plan) == {"cpuset.cpus": "0-3", "cpuset.mems": "0"}
    assert plan.resolved["placement"] == ["GPU 3 <-> NUMA 0 <-> CPUs 0-3"]
    assert plan.resolved["dedicated"] is True and plan.resolved["numa_nodes"] == "0"


def test_plan_of_gpus_on_both_nodes():
    s = spec("g1", count=8, gpus={"indices": [3, 4]})
    plan = plan_env(s, facts({"g1": ("GPU-3", "GPU-4")}))
    assert cpuset(plan) == {"cpuset.cpus": "0-3,32-35", "cpuset.mems": "0-1"}
    assert plan.resolved["placement"] == ["GPU 3 <-> NUMA 0 <-> CPUs 0-3",
                                          "GPU 4 <-> NUMA 1 <-> CPUs 32-35"]


def test_plan_refusal_when_the_cpus_are_taken_is_an_input_error():
    s = spec("g1", count=4, gpus={"indices": [3]})
    f = facts({"g1": ("GPU-3",)}, cpu_refused={"g1": "wants 4 dedicated CPUs near GPU 3 …"})
    with pytest.raises(PlanError) as exc:
        plan_env(s, f)
    assert "resources.cpu.dedicated" in str(exc.value)
    assert "wants 4 dedicated CPUs near GPU 3" in str(exc.value)


def test_memory_nodes_of_a_gpu_on_a_node_the_host_lacks_are_refused():
    s = spec("g1", count=1, gpus={"indices": [4]})
    f = dataclasses.replace(facts({"g1": ("GPU-4",)}), numa_nodes=(0,))
    with pytest.raises(PlanError) as exc:
        plan_env(s, f)
    assert "memory nodes 1 are not online (online: 0) (the NUMA nodes of the environment's " \
           "GPUs)" in str(exc.value)


def test_plan_without_its_gpus_says_so():
    s = spec("g1", count=1, gpus={"count": 1})
    f = facts({}, gpu_refused={"g1": "wants 1 GPU and 0 of this host's 8 are free"})
    with pytest.raises(PlanError) as exc:
        plan_env(s, f)
    assert "dedicated CPUs near the GPUs: this environment gets no GPUs here (wants 1 GPU" \
           in str(exc.value)


# ---------------------------------------------------------------- discovery


def test_discovery_reads_where_each_gpu_sits_from_sysfs(tmp_path):
    env = gpuhost.make_host(tmp_path / "hgx", gpus=8, numa=2, nodes=False, libraries=False)
    found = hg.discover_gpus(tmp_path / "hgx")  # no nodes: /proc and sysfs only
    assert found.source == "proc"
    assert [(g.index, g.numa_node, g.local_cpus[0], len(g.local_cpus), g.affinity)
            for g in found.gpus] == [(i, i // 4, i // 4 * 32, 32, "sysfs") for i in range(8)]
    assert env["ENVCTL_GPU_ROOT"] == str(tmp_path / "hgx")


@pytest.fixture
def fake_nvml(monkeypatch):
    from tests.fakes import PYNVML_DIR

    monkeypatch.syspath_prepend(str(PYNVML_DIR))
    monkeypatch.delitem(__import__("sys").modules, "pynvml", raising=False)
    monkeypatch.setattr(hg, "device_nodes", lambda root: {
        "nvidiactl": (195, 255), **{f"nvidia{i}": (195, i) for i in range(8)}})
    yield
    __import__("sys").modules.pop("pynvml", None)


def test_nvml_affinity_is_used_and_a_disagreement_with_sysfs_is_a_problem(tmp_path,
                                                                          monkeypatch,
                                                                          fake_nvml):
    import json

    env = gpuhost.make_host(tmp_path / "hgx", gpus=2, numa=2, cpus=4, nodes=False,
                            libraries=False)
    monkeypatch.setenv("FAKE_NVML_JSON", env["FAKE_NVML_JSON"])
    with open(env["FAKE_NVML_JSON"]) as f:
        doc = json.load(f)
    doc["gpus"][1]["cpu_affinity"] = [0, 1]  # NVML says node 0's CPUs, sysfs node 1's
    with open(env["FAKE_NVML_JSON"], "w") as f:
        json.dump(doc, f)
    found = hg.discover_gpus(tmp_path / "hgx")
    assert found.source == "nvml"
    assert [(g.numa_node, g.local_cpus, g.affinity) for g in found.gpus] == [
        (0, (0, 1), "nvml"), (1, (0, 1), "nvml")]
    assert "GPU 1: NVML's CPU affinity is 0-1, sysfs local_cpulist 2-3; NVML's is used" \
        in found.problems


def test_affinity_masks_of_many_words():
    assert hg._bits([0b101, 0, 1 << 63]) == (0, 2, 191)


def test_sysfs_without_numa_says_none(tmp_path):
    pci = tmp_path / "sys/bus/pci/devices/0000:3b:00.0"
    pci.mkdir(parents=True)
    (pci / "numa_node").write_text("-1\n")
    (pci / "local_cpulist").write_text("0-3\n")
    assert hg.read_pci_affinity(tmp_path, "0000:3b:00.0") == (None, (0, 1, 2, 3))
    assert hg.read_pci_affinity(tmp_path, "0000:00:00.0") == (None, ())
    assert os.path.exists(pci)


# ---------------------------------------------------------------- a job's CPUs near its GPUs


def test_a_jobs_cpus_by_count_come_from_its_gpus_node_first():
    from envctl.runtime.slices import Ask, Pool, Slice, allocate

    near = {"GPU-0": (0, 1, 2, 3), "GPU-1": (0, 1, 2, 3), "GPU-4": (4, 5, 6, 7),
            "GPU-5": (4, 5, 6, 7)}
    pool = Pool(cpus=tuple(range(8)), gpus=("GPU-0", "GPU-1", "GPU-4", "GPU-5"), near=near)
    held = [(1, Slice(cpus=(), gpus=("GPU-0", "GPU-1"), gpus_exclusive=True))]
    got = allocate(pool, held, Ask(cpus=2, gpus=1))
    assert got == Slice(cpus=(4, 5), cpus_exclusive=True, gpus=("GPU-4",), gpus_exclusive=True)
    # Two GPUs on two nodes: CPUs from both; more CPUs than are near: the rest after them.
    got = allocate(pool, [], Ask(cpus=6, gpus=3))
    assert got.gpus == ("GPU-0", "GPU-1", "GPU-4") and got.cpus == (0, 1, 2, 4, 5, 6)
    got = allocate(Pool(cpus=tuple(range(8)), gpus=("GPU-4",), near=near), [],
                   Ask(cpus=6, gpus=1))
    assert got.cpus == (0, 1, 4, 5, 6, 7)
    # Without a GPU, or without affinity known, the lowest CPUs as before.
    assert allocate(pool, [], Ask(cpus=2)).cpus == (0, 1)
    assert allocate(Pool(cpus=tuple(range(8)), gpus=("GPU-4",)), [],
                    Ask(cpus=2, gpus=1)).cpus == (0, 1)


def test_near_cpus_held_by_another_job_are_passed_over():
    from envctl.runtime.slices import Ask, Pool, Slice, allocate

    pool = Pool(cpus=tuple(range(8)), gpus=("GPU-4", "GPU-5"),
                near={"GPU-4": (4, 5, 6, 7), "GPU-5": (4, 5, 6, 7)})
    held = [(1, Slice(cpus=(4, 5, 6), cpus_exclusive=True, gpus=("GPU-4",),
                      gpus_exclusive=True))]
    assert allocate(pool, held, Ask(cpus=2, gpus=1)).cpus == (0, 7)


def test_up_records_where_each_gpu_sits_for_the_jobs():
    from envctl.plan.claims import spec_claims

    s = spec("g1", count=2, gpus={"indices": [4]})
    assert spec_claims(s, facts({"g1": ("GPU-4",)}))["gpu_cpus"] == {
        "GPU-4": list(range(32, 64))}
