"""Host tuning on the real kernel (sysctls) and on fake trees (cpufreq, kernel modules):
set, shared, restored exactly; hosts lacking a capability refused or warned before any change."""

from __future__ import annotations

import json
import os

import pytest

from tests.integration.sandbox import FakeCpufreq, FakeKmod

pytestmark = pytest.mark.root
RELEASE = os.uname().release


def spec(name: str, host: str, extra: str = "") -> str:
    return f"name: {name}\nkind: cpu\n{extra}host:\n{host}"


def steps_by_key(sb, env, *, extra=None):
    res = sb.envctl("status", env, "--json", env=extra, check=True)
    status = json.loads(res.stdout)[0]
    return {s["key"]: s for s in status["steps"]}, status["warnings"]


# ---------------------------------------------------------------- sysctls (real kernel)

SYSCTLS = """\
  sysctls:
    net.ipv4.ip_forward: 1
    vm.zone_reclaim_mode: 1
    net.ipv4.ip_local_port_range: "20000 30000"
"""


def test_sysctls_already_equal_shared_by_two_envs_restored_exactly(clean):
    sb = clean
    sb.set_sysctl("net.ipv4.ip_forward", "1")  # already what both want
    sb.set_sysctl("vm.zone_reclaim_mode", "0")
    sb.set_sysctl("net.ipv4.ip_local_port_range", "'32768 60999'")
    sb.write_spec("a", spec("a", SYSCTLS))
    sb.write_spec("b", spec("b", SYSCTLS))
    plan = sb.envctl("plan", "a", check=True).stdout
    assert "= sysctl net.ipv4.ip_forward = 1" in plan
    assert "~ sysctl vm.zone_reclaim_mode = 1  (value: 0 -> 1)" in plan
    sb.envctl("up", "a", check=True)
    sb.envctl("up", "b", check=True)
    steps, _ = steps_by_key(sb, "a")
    assert "at down: restored 1 -> 0" in steps["sysctl:vm.zone_reclaim_mode"]["note"]
    assert "held with b" in steps["sysctl:vm.zone_reclaim_mode"]["note"]
    assert "at down: left at 1, as found" in steps["sysctl:net.ipv4.ip_forward"]["note"]
    sb.envctl("down", "a", check=True)
    assert sb.sysctl("vm.zone_reclaim_mode") == "1"  # b still holds it
    down_plan = sb.envctl("plan", "--down", "b", check=True).stdout
    assert "- sysctl vm.zone_reclaim_mode = 1  (restored 1 -> 0)" in down_plan
    sb.envctl("down", "b", check=True)
    assert (sb.sysctl("net.ipv4.ip_forward"), sb.sysctl("vm.zone_reclaim_mode"),
            sb.sysctl("net.ipv4.ip_local_port_range")) == ("1", "0", "32768\t60999")


def test_missing_sysctl_required_refused_best_effort_skipped_and_recorded(clean):
    sb = clean
    sb.set_sysctl("vm.zone_reclaim_mode", "0")
    sb.write_spec("a", spec("a", "  sysctls:\n    vm.zone_reclaim_mode: 1\n"
                                 "    vm.envctl_no_such_knob: 1\n"))
    res = sb.envctl("up", "a")
    assert res.returncode == 2
    assert "a.yaml:6:5: host.sysctls.vm.envctl_no_such_knob" in res.stderr
    assert "has no sysctl vm.envctl_no_such_knob" in res.stderr
    assert sb.sysctl("vm.zone_reclaim_mode") == "0" and not sb.state.exists()
    sb.write_spec("a", spec("a", "  sysctls:\n    vm.zone_reclaim_mode: 1\n"
                                 "    vm.envctl_no_such_knob: {value: 1, policy: best-effort}\n"))
    assert "  warning: this kernel" in sb.envctl("plan", "a", check=True).stdout
    res = sb.envctl("up", "a", check=True)
    assert "warning: a: this kernel" in res.stderr and "skipped" in res.stderr
    _, warnings = steps_by_key(sb, "a")
    assert any("vm.envctl_no_such_knob" in w for w in warnings)
    assert "vm.envctl_no_such_knob" in sb.envctl("status", "a", check=True).stdout
    sb.envctl("down", "a", check=True)
    assert sb.sysctl("vm.zone_reclaim_mode") == "0"


# ---------------------------------------------------------------- governor (fake sysfs)

ORIGINAL_GOVS = {0: "powersave", 1: "schedutil", 2: "ondemand", 3: "performance"}


@pytest.fixture
def cpufreq(clean, tmp_path):
    return FakeCpufreq(tmp_path / "sysfs", dict(ORIGINAL_GOVS))


def test_governor_per_cpu_saved_shared_and_restored(clean, cpufreq):
    sb, env = clean, cpufreq.env()
    sb.write_spec("a", spec("a", "  governor: performance\n"))
    sb.write_spec("b", spec("b", "  governor: {name: performance, cpus: all}\n"))
    plan = sb.envctl("plan", "a", env=env, check=True).stdout
    # No related_cpus in this fake tree: each CPU is a cpufreq policy of its own.
    assert ("~ cpu governor policy0 (cpu 0) = performance  (governor: powersave -> "
            "performance)") in plan
    assert "= cpu governor policy3 (cpu 3) = performance" in plan
    sb.envctl("up", "a", env=env, check=True)
    assert cpufreq.governors() == {c: "performance" for c in range(4)}
    sb.envctl("up", "b", env=env, check=True)
    steps, _ = steps_by_key(sb, "a", extra=env)
    assert "at down: restored performance -> schedutil (held with b" in \
        steps["governor:policy1"]["note"]
    sb.envctl("down", "a", env=env, check=True)
    assert cpufreq.governors() == {c: "performance" for c in range(4)}  # b holds them
    sb.envctl("down", "b", env=env, check=True)
    assert cpufreq.governors() == ORIGINAL_GOVS


def test_governor_not_offered_required_refused_best_effort_partial(clean, tmp_path):
    sb = clean
    fake = FakeCpufreq(tmp_path / "sysfs", {0: "powersave", 1: "powersave"},
                       available={1: ("powersave", "ondemand")})
    env = fake.env()
    sb.write_spec("a", spec("a", "  governor: {name: performance, policy: required}\n"))
    res = sb.envctl("up", "a", env=env)
    assert res.returncode == 2
    assert "host.governor.name" in res.stderr
    assert "not offered by cpu 1 (scaling_available_governors: powersave ondemand)" in res.stderr
    assert fake.governors() == {0: "powersave", 1: "powersave"}
    sb.write_spec("a", spec("a", "  governor: {name: performance, policy: best-effort}\n"))
    res = sb.envctl("up", "a", env=env, check=True)
    assert "not offered by cpu 1" in res.stderr
    assert fake.governors() == {0: "performance", 1: "powersave"}
    sb.envctl("down", "a", env=env, check=True)
    assert fake.governors() == {0: "powersave", 1: "powersave"}


def test_two_envs_wanting_different_governors_refused(clean, cpufreq):
    sb, env = clean, cpufreq.env()
    sb.write_spec("a", spec("a", "  governor: performance\n"))
    sb.write_spec("b", spec("b", "  governor: powersave\n"))
    res = sb.envctl("up", "a", env=env)
    assert res.returncode == 2, res.stderr
    assert "b.yaml" in res.stderr and "one cpu has one governor" in res.stderr
    assert cpufreq.governors() == ORIGINAL_GOVS


def test_no_cpufreq_on_this_vm_required_refused_best_effort_recorded(clean):
    sb = clean
    if any(os.path.exists(f"/sys/devices/system/cpu/cpu{c}/cpufreq/scaling_governor")
           for c in range(os.cpu_count() or 1)):
        pytest.skip("this machine has cpufreq")
    sb.write_spec("a", spec("a", "  governor: {name: performance, policy: required}\n"))
    res = sb.envctl("up", "a")
    assert res.returncode == 2 and "this host has no cpufreq" in res.stderr
    sb.write_spec("a", spec("a", "  governor: performance\n"))  # best-effort by default
    res = sb.envctl("up", "a", check=True)
    assert "no cpufreq" in res.stderr
    _, warnings = steps_by_key(sb, "a")
    assert any("no cpufreq" in w and "skipped" in w for w in warnings)
    sb.envctl("down", "a", check=True)


# ---------------------------------------------------------------- modules (this VM)


def test_no_lib_modules_here_required_names_module_and_kernel(clean):
    sb = clean
    if os.path.isdir(f"/lib/modules/{RELEASE}"):
        pytest.skip("this machine has /lib/modules for its kernel")
    sb.write_spec("a", spec("a", "  modules: [envctl_test_mod]\n"))
    res = sb.envctl("plan", "a")
    assert res.returncode == 2
    assert (f"kernel module envctl_test_mod is not available on kernel {RELEASE}: "
            f"/lib/modules/{RELEASE} does not exist") in res.stderr
    sb.write_spec("a", spec("a", "  modules: [{name: envctl_test_mod, policy: best-effort}]\n"))
    assert "envctl_test_mod" in sb.envctl("plan", "a", check=True).stdout
    res = sb.envctl("up", "a", check=True)
    assert "warning: a: kernel module envctl_test_mod" in res.stderr
    _, warnings = steps_by_key(sb, "a")
    assert any("envctl_test_mod" in w and "skipped" in w for w in warnings)
    sb.envctl("down", "a", check=True)


def test_shipped_gpu_compute_fails_clearly_here_cpu_compute_plans(shipped):
    sb = shipped
    if os.path.isdir(f"/lib/modules/{RELEASE}"):
        pytest.skip("this machine has /lib/modules for its kernel")
    res = sb.envctl("plan", "gpu-compute")
    assert res.returncode == 2
    assert "gpu-compute.yaml" in res.stderr and "host.modules[0]" in res.stderr
    assert f"kernel module nvidia is not available on kernel {RELEASE}" in res.stderr
    assert sb.envctl("plan", "cpu-compute").returncode == 0
    assert sb.residue() == {}


# ---------------------------------------------------------------- modules (fake modprobe)


@pytest.fixture
def kmod(clean, tmp_path):
    return FakeKmod(tmp_path / "kmod", {"nvidia_uvm": ["nvidia"], "nvidia": [], "vfio": []},
                    loaded={"bridge": (0, [])})


def test_modules_loaded_by_envctl_are_unloaded_the_hosts_stay(clean, kmod):
    sb, env = clean, kmod.env()
    sb.write_spec("a", spec("a", "  modules:\n    - {name: nvidia-uvm, options: {uvm_x: 1}}\n"
                                 "    - bridge\n"))
    plan = sb.envctl("plan", "a", env=env, check=True).stdout
    assert "+ kernel module nvidia  (state: not loaded -> loaded)" in plan
    assert "+ kernel module nvidia_uvm uvm_x=1  (state: not loaded -> loaded)" in plan
    assert "= kernel module bridge" in plan
    sb.envctl("up", "a", env=env, check=True)
    assert kmod.loaded() == ["bridge", "nvidia", "nvidia_uvm"]
    assert kmod.log() == ["modprobe nvidia", "modprobe nvidia_uvm uvm_x=1"]
    steps, _ = steps_by_key(sb, "a", extra=env)
    assert "stays loaded" in steps["kmod:bridge"]["note"]
    assert "at down: unloaded: envctl loaded it" in steps["kmod:nvidia_uvm"]["note"]
    sb.envctl("down", "a", env=env, check=True)
    assert kmod.loaded() == ["bridge"]
    assert kmod.log()[2:] == ["rmmod nvidia_uvm", "rmmod nvidia"]


def test_module_in_use_at_down_stays_loaded(clean, kmod):
    sb, env = clean, kmod.env()
    sb.write_spec("a", spec("a", "  modules: [nvidia_uvm]\n"))
    sb.envctl("up", "a", env=env, check=True)
    kmod.use("nvidia_uvm")  # a process holds /dev/nvidia-uvm
    sb.envctl("down", "a", env=env, check=True)
    assert kmod.loaded() == ["bridge", "nvidia", "nvidia_uvm"]
    assert not [x for x in kmod.log() if x.startswith("rmmod")]


def test_module_shared_by_two_envs_unloaded_when_the_last_goes(clean, kmod):
    sb, env = clean, kmod.env()
    sb.write_spec("a", spec("a", "  modules: [vfio]\n"))
    sb.write_spec("b", spec("b", "  modules: [vfio]\n"))
    sb.envctl("up", "a", env=env, check=True)
    sb.envctl("up", "b", env=env, check=True)
    sb.envctl("down", "a", env=env, check=True)
    assert "vfio" in kmod.loaded()
    sb.envctl("down", "b", env=env, check=True)
    assert kmod.loaded() == ["bridge"] and kmod.log() == ["modprobe vfio", "rmmod vfio"]


def test_modules_with_different_options_refused(clean, kmod):
    sb, env = clean, kmod.env()
    sb.write_spec("a", spec("a", "  modules: [{name: vfio, options: {x: 1}}]\n"))
    sb.write_spec("b", spec("b", "  modules: [{name: vfio, options: {x: 2}}]\n"))
    res = sb.envctl("up", "a", env=env)
    assert res.returncode == 2, res.stderr
    assert "b.yaml" in res.stderr and "host.modules[0].options" in res.stderr
    assert kmod.log() == []


def test_softdeps_envctl_loaded_go_the_hosts_stay_one_in_use_stays(clean, tmp_path):
    sb = clean
    # `softdep nvidia pre: ecc drm post: nvidia_uvm i2c`; the host had i2c loaded already.
    kmod = FakeKmod(tmp_path / "kmod", {"nvidia": [], "ecc": [], "drm": [],
                                        "nvidia_uvm": ["nvidia"], "i2c": []},
                    loaded={"i2c": (0, [])},
                    softdeps={"nvidia": (["ecc", "drm"], ["nvidia_uvm", "i2c"])})
    env = kmod.env()
    sb.write_spec("a", spec("a", "  modules: [nvidia]\n"))
    plan = sb.envctl("plan", "a", env=env, check=True).stdout
    assert "+ kernel module ecc (soft dependency)  (state: not loaded -> loaded)" in plan
    assert "+ kernel module nvidia_uvm (soft dependency)" in plan
    assert "= kernel module i2c (soft dependency)" in plan
    sb.envctl("up", "a", env=env, check=True)
    assert kmod.loaded() == ["drm", "ecc", "i2c", "nvidia", "nvidia_uvm"]
    # Each alone, in modprobe's own order, so each snapshot precedes its own load.
    assert kmod.log() == ["modprobe --ignore-install ecc", "modprobe --ignore-install drm",
                          "modprobe --ignore-install nvidia",
                          "modprobe --ignore-install nvidia_uvm"]
    steps, _ = steps_by_key(sb, "a", extra=env)
    assert "at down: unloaded: envctl loaded it" in steps["kmod:nvidia_uvm"]["note"]
    assert "stays loaded: it was loaded before envctl" in steps["kmod:i2c"]["note"]
    # Safe to re-run: with nvidia loaded the plan is the same chain, nothing is unloaded.
    res = sb.envctl("up", "a", env=env, check=True)
    assert len(kmod.log()) == 4, (kmod.log(), res.stdout)
    kmod.use("ecc")  # a process opened it meanwhile
    sb.envctl("down", "a", env=env, check=True)
    assert kmod.loaded() == ["ecc", "i2c"]
    assert kmod.log()[4:] == ["rmmod nvidia_uvm", "rmmod nvidia", "rmmod drm"]
    assert sb.residue() == {}


# ---------------------------------------------------------------- cpufreq policies


def dedicated(name: str, cpu: int, governor: str) -> str:
    return spec(name, f"  governor: {{name: {governor}, cpus: dedicated}}\n",
                f"resources:\n  cpu: {{dedicated: [{cpu}]}}\n")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs for two cpusets")
def test_cpus_of_one_cpufreq_policy_share_one_governor_restored_once(clean, tmp_path):
    sb = clean
    fake = FakeCpufreq(tmp_path / "sysfs", {0: "powersave", 1: "powersave"},
                       policies={0: (0, 1)})
    env = fake.env()
    sb.write_spec("a", dedicated("a", 1, "performance"))
    sb.write_spec("b", dedicated("b", 0, "performance"))
    res = sb.envctl("up", "a", env=env, check=True)
    assert "cpu 0" in res.stderr and "policy0" in res.stderr  # a also changes cpu 0
    assert fake.governors() == {0: "performance", 1: "performance"}
    sb.envctl("up", "b", env=env, check=True)
    steps, _ = steps_by_key(sb, "b", extra=env)
    assert "at down: restored performance -> powersave (held with a" in \
        steps["governor:policy0"]["note"]
    sb.envctl("down", "a", env=env, check=True)
    assert fake.governors() == {0: "performance", 1: "performance"}  # b runs on policy0
    sb.envctl("down", "b", env=env, check=True)
    assert fake.governors() == {0: "powersave", 1: "powersave"}
    assert sb.residue() == {}


def test_different_governors_on_cpus_of_one_policy_refused_before_any_change(clean, tmp_path):
    sb = clean
    fake = FakeCpufreq(tmp_path / "sysfs", {0: "powersave", 1: "powersave"},
                       policies={0: (0, 1)})
    env = fake.env()
    sb.write_spec("a", dedicated("a", 1, "performance"))
    sb.write_spec("b", dedicated("b", 0, "schedutil"))
    res = sb.envctl("up", "a", env=env)
    assert res.returncode == 2, res.stderr
    assert "b.yaml" in res.stderr and "policy0" in res.stderr
    assert fake.governors() == {0: "powersave", 1: "powersave"}
    assert sb.residue() == {}


# ---------------------------------------------------------------- sysctl aliases (real kernel)


def test_two_spellings_of_ip_forward_are_one_value_restored_once(clean):
    sb = clean
    sb.set_sysctl("net.ipv4.ip_forward", "0")
    sb.write_spec("a", spec("a", "  sysctls:\n    net.ipv4.conf.all.forwarding: 1\n"))
    sb.write_spec("b", spec("b", "  sysctls:\n    net.ipv4.ip_forward: 1\n"))
    sb.envctl("up", "a", check=True)
    sb.envctl("up", "b", check=True)
    steps, _ = steps_by_key(sb, "b")
    assert "at down: restored 1 -> 0 (held with a" in steps["sysctl:net.ipv4.ip_forward"]["note"]
    sb.envctl("down", "a", check=True)
    assert sb.sysctl("net.ipv4.ip_forward") == "1"  # b still holds it
    sb.envctl("down", "b", check=True)
    assert (sb.sysctl("net.ipv4.ip_forward"), sb.sysctl("net.ipv4.conf.all.forwarding")) == \
        ("0", "0")
    assert sb.residue() == {}


def test_two_spellings_of_ip_forward_with_different_values_refused(clean):
    sb = clean
    sb.set_sysctl("net.ipv4.ip_forward", "0")
    sb.write_spec("a", spec("a", "  sysctls:\n    net.ipv4.conf.all.forwarding: 0\n"))
    sb.write_spec("b", spec("b", "  sysctls:\n    net.ipv4.ip_forward: 1\n"))
    res = sb.envctl("up", "b")
    assert res.returncode == 2, res.stderr
    assert "net.ipv4.conf.all.forwarding=0" in res.stderr and "a.yaml" in res.stderr
    assert sb.sysctl("net.ipv4.ip_forward") == "0" and sb.residue() == {}


# ---------------------------------------------------------------- kill -9 mid-change

ALL = """\
  sysctls:
    vm.zone_reclaim_mode: 1
    net.ipv4.ip_forward: 1
  modules: [nvidia_uvm]
  governor: performance
"""


@pytest.mark.parametrize("key", ["sysctl:vm.zone_reclaim_mode", "kmod:nvidia", "kmod:nvidia_uvm",
                                 "governor:policy0", "governor:policy2"])
def test_kill_9_after_a_host_change_then_down_restores_everything(clean, kmod, cpufreq, key):
    sb = clean
    env = {**kmod.env(), **cpufreq.env()}
    sb.set_sysctl("vm.zone_reclaim_mode", "0")
    sb.set_sysctl("net.ipv4.ip_forward", "0")
    sb.write_spec("a", spec("a", ALL))
    res = sb.envctl("up", "a", env={**env, "ENVCTL_FAULT": f"kill@after:{key}"})
    assert res.returncode == -9, res.stderr
    sb.envctl("down", "a", env=env, check=True)
    assert (sb.sysctl("vm.zone_reclaim_mode"), sb.sysctl("net.ipv4.ip_forward")) == ("0", "0")
    assert kmod.loaded() == ["bridge"]
    assert cpufreq.governors() == ORIGINAL_GOVS
