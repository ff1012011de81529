"""The planner's host section: modules, governor and sysctls against hand-made host facts."""

from __future__ import annotations

from pathlib import Path

import pytest

from envctl.facts import HostFacts, ModuleFact
from envctl.plan.builder import PlanError
from envctl.plan.host import find_host_conflicts
from envctl.plan.planner import plan_env
from envctl.resources.governor import CpuGovernor
from envctl.resources.kmod import KernelModule
from envctl.resources.sysctl import Sysctl
from envctl.spec.conflicts import find_conflicts
from envctl.spec.loader import load_spec, parse_spec
from envctl.spec.sysctls import canonical, proc_path

REPO = Path(__file__).resolve().parents[2]
ALL_GOVS = ("performance", "powersave", "schedutil")
FREQ = {0: ALL_GOVS, 1: ALL_GOVS, 2: ALL_GOVS, 3: ALL_GOVS}


def spec(host: str, extra: str = "", name: str = "demo"):
    return parse_spec(f"name: {name}\nkind: gpu\n{extra}host:\n{host}", f"{name}.yaml")


def host_resources(plan):
    return [r for r in plan.resources if r.kind in ("sysctl", "kmod", "governor")]


def errors_of(ls, facts) -> str:
    with pytest.raises(PlanError) as exc:
        plan_env(ls.spec, facts)
    return str(exc.value)


# ---------------------------------------------------------------- modules


def test_available_module_plans_its_dependencies_first_with_sorted_options():
    facts = HostFacts(modules={"nvidia_uvm": ModuleFact("available", ("drm", "nvidia")),
                               "nvidia": ModuleFact("available")})
    ls = spec("  modules:\n    - nvidia-uvm\n    - {name: nvidia, options: {b: 2, a: x}}\n")
    plan = plan_env(ls.spec, facts)
    assert host_resources(plan) == [KernelModule("drm"), KernelModule("nvidia", ("a=x", "b=2")),
                                    KernelModule("nvidia_uvm")]
    assert not plan.warnings


def test_missing_required_module_is_an_error_naming_module_kernel_and_why():
    facts = HostFacts(kernel="6.18.0-test", modules={"nvidia": ModuleFact(
        "missing", reason="/lib/modules/6.18.0-test does not exist")})
    msg = errors_of(spec("  modules: [nvidia]\n"), facts)
    assert "host.modules.0" in msg
    assert "kernel module nvidia is not available on kernel 6.18.0-test" in msg
    assert "/lib/modules/6.18.0-test does not exist" in msg and "policy: required" in msg


def test_missing_best_effort_module_is_skipped_with_a_warning():
    facts = HostFacts(modules={"nvidia": ModuleFact("missing", reason="no file")})
    plan = plan_env(spec("  modules: [{name: nvidia, policy: best-effort}]\n").spec, facts)
    assert host_resources(plan) == []
    assert any("kernel module nvidia" in w and "skipped (policy: best-effort)" in w
               for w in plan.warnings)


def test_builtin_or_loaded_module_is_planned_and_ignored_options_are_said():
    facts = HostFacts(modules={"vfio": ModuleFact("builtin"), "kvm": ModuleFact("loaded")})
    plan = plan_env(spec("  modules: [vfio, {name: kvm, options: {nested: 1}}]\n").spec, facts)
    assert host_resources(plan) == [KernelModule("vfio"), KernelModule("kvm", ("nested=1",))]
    assert any("kvm is already loaded" in w and "nested=1" in w for w in plan.warnings)


def test_module_unknown_to_the_facts_counts_as_missing():
    assert "not looked up" in errors_of(spec("  modules: [nvidia]\n"), HostFacts())


# ---------------------------------------------------------------- governor


def test_governor_on_all_cpus_one_shared_resource_per_cpu_without_policies():
    facts = HostFacts(cpus=(0, 1, 2, 3), cpufreq=FREQ)
    plan = plan_env(spec("  governor: performance\n").spec, facts)
    assert host_resources(plan) == [CpuGovernor(c, (c,), "performance") for c in range(4)]
    assert all(r.shared for r in host_resources(plan))
    assert [r.key for r in host_resources(plan)] == [f"governor:policy{c}" for c in range(4)]


def test_governor_on_dedicated_cpus_only():
    facts = HostFacts(cpus=(0, 1, 2, 3), cpufreq=FREQ)
    ls = spec("  governor: {name: performance, cpus: dedicated}\n",
              "resources:\n  cpu: {dedicated: 2-3}\n")
    assert host_resources(plan_env(ls.spec, facts)) == [CpuGovernor(2, (2,), "performance"),
                                                        CpuGovernor(3, (3,), "performance")]


def test_no_cpufreq_best_effort_warns_required_refuses():
    facts = HostFacts(cpus=(0, 1))
    plan = plan_env(spec("  governor: performance\n").spec, facts)  # best-effort by default
    assert host_resources(plan) == []
    assert any("no cpufreq" in w and "skipped" in w for w in plan.warnings)
    msg = errors_of(spec("  governor: {name: performance, policy: required}\n"), facts)
    assert "host.governor" in msg and "this host has no cpufreq" in msg


def test_governor_not_offered_names_what_is():
    facts = HostFacts(cpus=(0, 1), cpufreq={0: ALL_GOVS, 1: ("powersave",)})
    msg = errors_of(spec("  governor: {name: performance, policy: required}\n"), facts)
    assert "host.governor.name" in msg
    assert "not offered by cpu 1 (scaling_available_governors: powersave)" in msg
    plan = plan_env(spec("  governor: performance\n").spec, facts)
    assert host_resources(plan) == [CpuGovernor(0, (0,), "performance")]  # the cpu that can


def test_some_cpus_without_cpufreq_are_named():
    facts = HostFacts(cpus=(0, 1, 2), cpufreq={0: ALL_GOVS})
    plan = plan_env(spec("  governor: performance\n").spec, facts)
    assert any("cpu 1-2 of this host have no cpufreq" in w for w in plan.warnings)


# ---------------------------------------------------------------- sysctls


def test_sysctls_required_missing_is_an_error_best_effort_missing_is_skipped():
    facts = HostFacts(sysctls=frozenset({"net.ipv4.ip_forward"}))
    ls = spec("  sysctls:\n    net.ipv4.ip_forward: 1\n"
              "    kernel.numa_balancing: {value: 0, policy: best-effort}\n")
    plan = plan_env(ls.spec, facts)
    assert host_resources(plan) == [Sysctl("net.ipv4.ip_forward", "1")]
    assert any("kernel.numa_balancing" in w and "skipped" in w for w in plan.warnings)
    msg = errors_of(spec("  sysctls: {kernel.numa_balancing: 0}\n"), facts)
    assert "host.sysctls.kernel.numa_balancing" in msg and "policy: required" in msg


# ---------------------------------------------------------------- shipped configs


def test_shipped_gpu_compute_requires_nvidia_and_cpu_compute_is_best_effort():
    gpu = load_spec(REPO / "configs" / "gpu-compute.yaml").spec
    cpu = load_spec(REPO / "configs" / "cpu-compute.yaml").spec
    assert {m.policy for m in gpu.host.modules} == {"required"}
    assert not cpu.host.modules and cpu.host.governor.policy == "best-effort"
    assert {i.policy for n, i in cpu.host.sysctls.items() if n != "net.ipv4.ip_forward"} \
        == {"best-effort"}


# ---------------------------------------------------------------- across environments


def test_two_environments_wanting_different_governors_on_one_cpu_conflict():
    facts = HostFacts(cpus=(0, 1, 2, 3), cpufreq=FREQ)
    a = spec("  governor: performance\n", name="a")
    b = spec("  governor: {name: powersave, cpus: dedicated}\n",
             "resources:\n  cpu: {dedicated: 3}\n", name="b")
    problems = find_host_conflicts([a, b], facts)
    assert len(problems) == 1
    assert problems[0].file == "b.yaml" and problems[0].field == "host.governor.name"
    assert "cpu 3" in problems[0].message and "'a'" in problems[0].message


def test_same_governor_or_disjoint_cpus_do_not_conflict():
    facts = HostFacts(cpus=(0, 1, 2, 3), cpufreq=FREQ)
    a = spec("  governor: {name: performance, cpus: dedicated}\n",
             "resources:\n  cpu: {dedicated: 0-1}\n", name="a")
    b = spec("  governor: {name: powersave, cpus: dedicated}\n",
             "resources:\n  cpu: {dedicated: 2-3}\n", name="b")
    c = spec("  governor: performance\n", name="c")
    assert find_host_conflicts([a, b], facts) == []
    assert find_host_conflicts([a, c], facts) == []


def test_one_module_with_different_options_conflicts():
    a = spec("  modules: [{name: nvidia, options: {x: 1}}]\n", name="a")
    b = spec("  modules: [{name: nvidia, options: {x: 2}}]\n", name="b")
    c = spec("  modules: [{name: nvidia, options: {x: 1}}]\n", name="c")
    problems = find_host_conflicts([a, b, c], HostFacts())
    assert [p.file for p in problems] == ["b.yaml"]
    assert problems[0].field == "host.modules[0].options"


# ---------------------------------------------------------------- module soft dependencies


def test_softdeps_are_resources_around_the_module_each_loaded_alone():
    # modprobe nvidia would load: drm (hard dep), ecc (pre softdep), nvidia, nvidia_uvm (post).
    facts = HostFacts(modules={"nvidia": ModuleFact("available", ("drm", "ecc"),
                                                    post=("nvidia_uvm",),
                                                    soft=("ecc", "nvidia_uvm"))})
    plan = plan_env(spec("  modules: [{name: nvidia, options: {a: 1}}]\n").spec, facts)
    assert host_resources(plan) == [
        KernelModule("drm", alone=True), KernelModule("ecc", alone=True, soft=True),
        KernelModule("nvidia", ("a=1",), alone=True),
        KernelModule("nvidia_uvm", alone=True, soft=True)]
    assert "soft dependency" in host_resources(plan)[1].describe()


def test_a_module_both_listed_and_a_softdep_is_one_resource_loaded_as_listed():
    facts = HostFacts(modules={
        "nvidia": ModuleFact("available", post=("nvidia_uvm",), soft=("nvidia_uvm",)),
        "nvidia_uvm": ModuleFact("available", ("nvidia",))})
    ls = spec("  modules: [nvidia, {name: nvidia_uvm, options: {x: 1}}]\n")
    assert host_resources(plan_env(ls.spec, facts)) == [
        KernelModule("nvidia", alone=True), KernelModule("nvidia_uvm", ("x=1",), alone=True)]


def test_softdeps_not_tracked_are_said():
    facts = HostFacts(modules={"nvidia": ModuleFact(
        "available", note="modprobe runs an install command for it")})
    plan = plan_env(spec("  modules: [nvidia]\n").spec, facts)
    assert host_resources(plan) == [KernelModule("nvidia")]
    assert any("kernel module nvidia: modprobe runs an install command" in w
               for w in plan.warnings)


# ---------------------------------------------------------------- cpufreq policies

POLICIES = {0: (0, 1), 2: (2, 3)}


def test_governor_is_one_resource_per_cpufreq_policy():
    facts = HostFacts(cpus=(0, 1, 2, 3), cpufreq=FREQ, cpufreq_policies=POLICIES)
    plan = plan_env(spec("  governor: performance\n").spec, facts)
    assert host_resources(plan) == [CpuGovernor(0, (0, 1), "performance"),
                                    CpuGovernor(2, (2, 3), "performance")]
    assert [r.key for r in host_resources(plan)] == ["governor:policy0", "governor:policy2"]
    assert not plan.warnings


def test_a_dedicated_cpu_whose_policy_covers_another_cpu_warns():
    facts = HostFacts(cpus=(0, 1, 2, 3), cpufreq=FREQ, cpufreq_policies=POLICIES)
    ls = spec("  governor: {name: performance, cpus: dedicated}\n",
              "resources:\n  cpu: {dedicated: 1}\n")
    plan = plan_env(ls.spec, facts)
    assert host_resources(plan) == [CpuGovernor(0, (0, 1), "performance")]
    assert any("cpu 0" in w and "policy0" in w and "cpu 1" in w for w in plan.warnings), \
        plan.warnings


def test_two_environments_on_cpus_of_one_policy_wanting_different_governors_conflict():
    facts = HostFacts(cpus=(0, 1, 2, 3), cpufreq=FREQ, cpufreq_policies=POLICIES)
    a = spec("  governor: {name: powersave, cpus: dedicated}\n",
             "resources:\n  cpu: {dedicated: 0}\n", name="a")
    b = spec("  governor: {name: performance, cpus: dedicated}\n",
             "resources:\n  cpu: {dedicated: 1}\n", name="b")
    c = spec("  governor: {name: performance, cpus: dedicated}\n",
             "resources:\n  cpu: {dedicated: 2}\n", name="c")
    problems = find_host_conflicts([a, b, c], facts)
    assert [p.file for p in problems] == ["b.yaml"]
    assert problems[0].field == "host.governor.name"
    msg = problems[0].message
    assert "cpu 1" in msg and "'a'" in msg and "cpu 0" in msg and "policy0" in msg, msg


# ---------------------------------------------------------------- sysctl aliases


def test_sysctl_names_are_canonical():
    assert canonical("net.ipv4.conf.all.forwarding") == "net.ipv4.ip_forward"
    assert canonical("net/ipv4/conf/all/forwarding") == "net.ipv4.ip_forward"
    assert canonical("net/ipv4/ip_forward") == "net.ipv4.ip_forward"
    assert canonical("vm.swappiness") == "vm.swappiness"
    # sysctl(8): when the first separator is '/', dots and slashes trade places.
    assert canonical("net/ipv4/conf/eth0.100/rp_filter") == "net.ipv4.conf.eth0/100.rp_filter"
    assert proc_path("net.ipv4.conf.eth0/100.rp_filter") == "net/ipv4/conf/eth0.100/rp_filter"
    assert proc_path("net.ipv4.conf.all.forwarding") == "net/ipv4/ip_forward"


def test_a_sysctl_alias_is_planned_under_its_canonical_name():
    facts = HostFacts(sysctls=frozenset({"net.ipv4.ip_forward"}))
    plan = plan_env(spec("  sysctls:\n    net.ipv4.conf.all.forwarding: 1\n").spec, facts)
    assert [r.key for r in host_resources(plan)] == ["sysctl:net.ipv4.ip_forward"]


def test_both_spellings_in_one_spec_are_one_resource_or_an_error():
    facts = HostFacts(sysctls=frozenset({"net.ipv4.ip_forward"}))
    same = spec("  sysctls:\n    net.ipv4.ip_forward: 1\n    net.ipv4.conf.all.forwarding: 1\n")
    assert [r.key for r in host_resources(plan_env(same.spec, facts))] == \
        ["sysctl:net.ipv4.ip_forward"]
    differ = spec("  sysctls:\n    net.ipv4.ip_forward: 1\n    net.ipv4.conf.all.forwarding: 0\n")
    assert "conflicts with" in errors_of(differ, facts)


def test_two_environments_asking_one_value_by_two_names_conflict_or_share():
    a = spec("  sysctls:\n    net.ipv4.conf.all.forwarding: 0\n", name="a")
    b = spec("  sysctls:\n    net.ipv4.ip_forward: 1\n", name="b")
    found = find_conflicts([a, b])
    assert [p.file for p in found] == ["b.yaml"]
    assert found[0].field == "host.sysctls.net.ipv4.ip_forward"
    assert "net.ipv4.conf.all.forwarding=0" in found[0].message and "'a'" in found[0].message
    c = spec("  sysctls:\n    net.ipv4.conf.all.forwarding: 1\n", name="c")
    assert find_conflicts([b, c]) == []
