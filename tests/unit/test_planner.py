"""The planner is a pure function of spec + facts: ordered resources, resolved values, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from envctl.facts import HostFacts
from envctl.plan.builder import PlanError
from envctl.plan.planner import plan_env
from envctl.resources.base import Resource
from envctl.spec.loader import load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]
SYSCTLS = frozenset({"net.ipv4.ip_forward", "kernel.numa_balancing", "vm.zone_reclaim_mode"})
SMALL = HostFacts(cpus=(0, 1), memory_bytes=24 << 30, sysctls=SYSCTLS,
                  groups={"users": 100})  # the shipped cpu-compute admits it
BIG = HostFacts(cpus=tuple(range(16)), memory_bytes=256 << 30, sysctls=SYSCTLS,
                groups={"users": 100})


def cpu_compute():
    return load_spec(REPO / "configs" / "cpu-compute.yaml").spec


def test_cpu_compute_on_a_two_core_host_shares_cpus_with_a_warning():
    plan = plan_env(cpu_compute(), SMALL)
    assert plan.resolved["cpus"] == "0-1" and plan.resolved["dedicated"] is False
    assert plan.resolved["threads"] == 2
    assert any("sharing all online CPUs" in w for w in plan.warnings)


def test_cpu_compute_on_a_big_host_dedicates_cores_2_to_n_minus_2():
    plan = plan_env(cpu_compute(), BIG)
    assert plan.resolved["cpus"] == "2-14" and plan.resolved["dedicated"] is True
    assert plan.resolved["threads"] == 13
    assert plan.resolved["memory.max"] == int(256 * 0.7 * 1024**3) // 4096 * 4096
    assert not [w for w in plan.warnings if "sharing all online CPUs" in w]
    # 15 CPUs (1500%) on 13 dedicated CPUs can never throttle: said, not hidden.
    assert any("cpus 15 (quota 1500%) is at least the 13 CPU(s)" in w for w in plan.warnings)


def test_small_host_error_policy_refuses():
    spec = parse_spec("name: x\nkind: cpu\nresources:\n  cpu:\n    dedicated:\n"
                      "      reserve_first: 2\n", "x.yaml").spec
    with pytest.raises(PlanError) as exc:
        plan_env(spec, SMALL)
    loc, msg = exc.value.issues[0]
    assert loc == ("resources", "cpu", "dedicated") and "small_host: share" in msg


def test_offline_cpus_and_nodes_are_plan_errors():
    spec = parse_spec("name: x\nkind: cpu\nresources:\n  cpu: {dedicated: 1-3}\n"
                      "  memory: {nodes: 1}\n", "x.yaml").spec
    with pytest.raises(PlanError) as exc:
        plan_env(spec, SMALL)
    assert "2-3 are not online" in str(exc.value)
    assert "memory nodes 1 are not online" in str(exc.value)


def test_missing_sysctls_required_vs_best_effort():
    spec = parse_spec("name: x\nkind: cpu\nhost:\n  sysctls:\n    vm.nope: 1\n"
                      "    vm.maybe: {value: 1, policy: best-effort}\n", "x.yaml").spec
    with pytest.raises(PlanError) as exc:
        plan_env(spec, SMALL)
    assert exc.value.issues == [(("host", "sysctls", "vm.nope"),
                                 "this kernel (6.1.0) has no sysctl vm.nope (policy: required)")]
    spec = parse_spec("name: x\nkind: cpu\nhost:\n  sysctls:\n"
                      "    vm.maybe: {value: 1, policy: best-effort}\n", "x.yaml").spec
    plan = plan_env(spec, SMALL)
    assert any("vm.maybe" in w and "best-effort" in w for w in plan.warnings)
    assert not any(r.key == "sysctl:vm.maybe" for r in plan.resources)


def test_plan_order_and_unique_keys():
    plan = plan_env(cpu_compute(), SMALL)
    keys = [r.key for r in plan.resources]
    assert len(keys) == len(set(keys))
    assert keys[0] == "dir:state:envs/cpu-compute"
    assert keys.index("sysctl:net.ipv4.ip_forward") < keys.index("netns:cpu-compute")


def test_resources_round_trip_through_the_journal_format():
    for r in plan_env(cpu_compute(), SMALL).resources:
        assert Resource.from_dict(r.to_dict()) == r


def test_planner_is_pure_and_deterministic():
    spec = cpu_compute()
    a = plan_env(spec, SMALL)
    b = plan_env(spec, SMALL)
    assert a.resources == b.resources and a.warnings == b.warnings


def test_every_section_is_set_up_so_none_is_named_as_only_validated():
    plan = plan_env(cpu_compute(), SMALL)
    assert not any("validated" in w for w in plan.warnings)
    assert plan.resources[-1].kind == "service"  # the last step: down stops it first
