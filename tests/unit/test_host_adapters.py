"""Module and governor adapters and resources against fake trees (no root, no real kernel)."""

from __future__ import annotations

import os

import pytest

from envctl.errors import HostError
from envctl.host.context import Host
from envctl.host.facts import gather
from envctl.host.kmod import (
    ABSENT,
    BUILTIN,
    LOADED,
    KernelModules,
    parse_modules_dep,
    parse_proc_modules,
)
from envctl.resources.base import Status
from envctl.resources.governor import CpuGovernor
from envctl.resources.kmod import KernelModule
from tests.integration.sandbox import FakeCpufreq, FakeKmod

RELEASE = os.uname().release


def kmod_host(fake: FakeKmod) -> Host:
    env = fake.env()
    return Host(kmod_root=fake.root, modprobe=env["ENVCTL_MODPROBE"],
                rmmod=env["ENVCTL_RMMOD"])


def test_parse_proc_modules_reads_refcount_and_holders():
    text = ("nvidia_uvm 1646592 0 - Live 0x0\n"
            "nvidia 56500224 3 nvidia_uvm,nvidia_modeset, Live 0x0\n"
            "noexit 16384 - - Live 0x0\n")
    mods = parse_proc_modules(text)
    assert mods["nvidia_uvm"].refcount == 0 and not mods["nvidia_uvm"].in_use
    assert mods["nvidia"].holders == ("nvidia_uvm", "nvidia_modeset")
    assert mods["nvidia"].in_use
    assert mods["noexit"].refcount is None and mods["noexit"].in_use  # cannot be unloaded


def test_parse_modules_dep_gives_load_order_and_equal_dash_underscore():
    text = ("kernel/a/nvidia-uvm.ko.xz: kernel/b/nvidia.ko.xz kernel/c/drm.ko\n"
            "kernel/b/nvidia.ko.xz:\n")
    assert parse_modules_dep(text, "nvidia_uvm") == ("drm", "nvidia")
    assert parse_modules_dep(text, "nvidia") == ()
    assert parse_modules_dep(text, "bogus") is None


def test_state_loaded_builtin_absent(tmp_path):
    fake = FakeKmod(tmp_path, {"nvidia": []}, loaded={"bridge": (0, [])}, builtin=("ext4",))
    (tmp_path / "sys" / "module" / "vt").mkdir()  # built in with parameters: no initstate
    km = kmod_host(fake).kmod
    assert km.state("bridge") == LOADED
    assert km.state("vt") == BUILTIN and km.state("ext4") == BUILTIN
    assert km.state("nvidia") == ABSENT


def test_availability_names_the_missing_tree_and_the_kernel(tmp_path):
    km = KernelModules(proc=tmp_path / "proc", sys=tmp_path / "sys", lib=tmp_path / "lib")
    found = km.availability("nvidia")
    assert not found.ok
    assert str(tmp_path / "lib" / RELEASE) in found.reason and RELEASE in found.reason


def test_availability_module_file_absent_and_no_module_support(tmp_path):
    FakeKmod(tmp_path, {"nvidia": []})
    km = KernelModules(proc=tmp_path / "proc", sys=tmp_path / "sys",
                       lib=tmp_path / "lib" / "modules")
    assert "not in modules.dep" in km.availability("nvidia_uvm").reason
    assert km.availability("nvidia").ok
    (tmp_path / "proc" / "modules").unlink()  # a kernel built without CONFIG_MODULES
    assert "no loadable-module support" in km.availability("nvidia").reason


def test_module_loaded_by_envctl_is_unloaded_with_options_passed(tmp_path):
    fake = FakeKmod(tmp_path, {"nvidia": []})
    host = kmod_host(fake)
    mod = KernelModule("nvidia", ("NVreg_OpenRmEnableUnsupportedGpus=1",))
    check = mod.check(host)
    assert check.status is Status.ABSENT and check.describe() == "state: not loaded -> loaded"
    memo = mod.snapshot(host)
    mod.apply(host, memo)
    assert fake.loaded() == ["nvidia"] and mod.check(host).ok
    assert fake.log() == ["modprobe nvidia NVreg_OpenRmEnableUnsupportedGpus=1"]
    mod.apply(host, memo)  # already so: no second modprobe
    assert len(fake.log()) == 1
    mod.remove(host, memo)
    assert fake.loaded() == [] and fake.log()[-1] == "rmmod nvidia"
    mod.remove(host, memo)  # already gone: success, no call
    assert len(fake.log()) == 2


def test_module_the_host_had_stays(tmp_path):
    fake = FakeKmod(tmp_path, {"nvidia": []}, loaded={"nvidia": (0, [])})
    host = kmod_host(fake)
    mod = KernelModule("nvidia")
    memo = mod.snapshot(host)
    assert memo == {"state": "loaded"}
    mod.apply(host, memo)
    mod.remove(host, memo)
    assert fake.loaded() == ["nvidia"] and fake.log() == []


def test_module_in_use_at_teardown_stays(tmp_path):
    fake = FakeKmod(tmp_path, {"nvidia": []})
    host = kmod_host(fake)
    mod = KernelModule("nvidia")
    memo = mod.snapshot(host)
    mod.apply(host, memo)
    fake.use("nvidia")
    mod.remove(host, memo)
    assert fake.loaded() == ["nvidia"] and not any(x.startswith("rmmod") for x in fake.log())


def test_modprobe_failure_is_a_host_error_naming_the_module(tmp_path):
    fake = FakeKmod(tmp_path, {})
    host = kmod_host(fake)
    with pytest.raises(HostError, match=r"load kernel module 'nvidia': .*not found"):
        KernelModule("nvidia").apply(host, {})


def test_missing_modprobe_says_which_package(tmp_path):
    fake = FakeKmod(tmp_path, {"nvidia": []})
    host = Host(kmod_root=fake.root, modprobe="/nonexistent/modprobe")
    with pytest.raises(HostError, match="not installed"):
        KernelModule("nvidia").apply(host, {})


def test_facts_read_module_states_and_dependencies(tmp_path):
    fake = FakeKmod(tmp_path, {"nvidia_uvm": ["nvidia"], "nvidia": []},
                    loaded={"bridge": (0, [])})
    facts = gather(proc_root=tmp_path / "proc", sys_root=tmp_path / "sys",
                   modules=frozenset({"nvidia-uvm", "bridge", "nope"}),
                   kmod=kmod_host(fake).kmod)
    assert facts.modules["nvidia_uvm"].state == "available"
    assert facts.modules["nvidia_uvm"].deps == ("nvidia",)
    assert facts.modules["bridge"].state == "loaded"
    assert facts.modules["nope"].state == "missing"


# ---------------------------------------------------------------- governor


def test_governor_set_and_restored_per_cpu(tmp_path):
    fake = FakeCpufreq(tmp_path, {0: "powersave", 1: "schedutil"})
    host = Host(sys=tmp_path)
    memos = {}
    for cpu in (0, 1):
        res = CpuGovernor(cpu, "performance")
        assert res.check(host).describe().endswith("-> performance")
        memos[cpu] = res.snapshot(host)
        res.apply(host, memos[cpu])
    assert fake.governors() == {0: "performance", 1: "performance"}
    for cpu in (0, 1):
        CpuGovernor(cpu, "performance").remove(host, memos[cpu])
    assert fake.governors() == {0: "powersave", 1: "schedutil"}


def test_governor_not_offered_is_refused_and_no_cpufreq_is_wrong_kind(tmp_path):
    FakeCpufreq(tmp_path, {0: "powersave", 1: None}, available={0: ("powersave",)})
    host = Host(sys=tmp_path)
    with pytest.raises(HostError, match="performance is not offered"):
        CpuGovernor(0, "performance").apply(host, {})
    assert CpuGovernor(1, "performance").check(host).status is Status.WRONG_KIND


def test_facts_read_cpufreq_only_where_present(tmp_path):
    FakeCpufreq(tmp_path, {0: "powersave", 1: None, 2: "ondemand"},
                available={2: ("ondemand", "performance")})
    facts = gather(proc_root=tmp_path, sys_root=tmp_path, cpufreq=True)
    assert facts.cpus == (0, 1, 2)
    assert facts.cpufreq == {0: FakeCpufreq.DEFAULT, 2: ("ondemand", "performance")}
