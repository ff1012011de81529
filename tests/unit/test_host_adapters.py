"""Module and governor adapters and resources against fake trees (no root, no real kernel)."""

from __future__ import annotations

import os
import shutil
import subprocess

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
    parse_show_depends,
)
from envctl.host.procfs import sysctl_path
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


def test_governor_set_and_restored_per_cpu_without_policies(tmp_path):
    fake = FakeCpufreq(tmp_path, {0: "powersave", 1: "schedutil"})
    host = Host(sys=tmp_path)
    memos = {}
    for cpu in (0, 1):
        res = CpuGovernor(cpu, (cpu,), "performance")
        assert res.check(host).describe().endswith("-> performance")
        memos[cpu] = res.snapshot(host)
        res.apply(host, memos[cpu])
    assert fake.governors() == {0: "performance", 1: "performance"}
    for cpu in (0, 1):
        CpuGovernor(cpu, (cpu,), "performance").remove(host, memos[cpu])
    assert fake.governors() == {0: "powersave", 1: "schedutil"}


def test_governor_not_offered_is_refused_and_no_cpufreq_is_wrong_kind(tmp_path):
    FakeCpufreq(tmp_path, {0: "powersave", 1: None}, available={0: ("powersave",)})
    host = Host(sys=tmp_path)
    with pytest.raises(HostError, match="performance is not offered"):
        CpuGovernor(0, (0,), "performance").apply(host, {})
    assert CpuGovernor(1, (1,), "performance").check(host).status is Status.WRONG_KIND


def test_facts_read_cpufreq_only_where_present(tmp_path):
    FakeCpufreq(tmp_path, {0: "powersave", 1: None, 2: "ondemand"},
                available={2: ("ondemand", "performance")})
    facts = gather(proc_root=tmp_path, sys_root=tmp_path, cpufreq=True)
    assert facts.cpus == (0, 1, 2)
    assert facts.cpufreq == {0: FakeCpufreq.DEFAULT, 2: ("ondemand", "performance")}


def test_facts_read_cpufreq_policies_from_related_cpus(tmp_path):
    FakeCpufreq(tmp_path, {0: "powersave", 1: "powersave", 2: "ondemand", 3: None},
                policies={0: (0, 1)})
    facts = gather(proc_root=tmp_path, sys_root=tmp_path, cpufreq=True)
    # cpu2 has cpufreq but no related_cpus: its own policy; cpu3 has no cpufreq at all.
    assert facts.cpufreq_policies == {0: (0, 1), 2: (2,)}
    assert set(facts.cpufreq) == {0, 1, 2}


def test_governor_of_a_policy_is_read_through_any_of_its_cpus_and_restored_once(tmp_path):
    fake = FakeCpufreq(tmp_path, {0: "powersave", 1: "powersave", 2: "schedutil"},
                       policies={0: (0, 1)})
    host = Host(sys=tmp_path)
    res = CpuGovernor(0, (0, 1), "performance")
    assert res.describe() == "cpu governor policy0 (cpu 0-1) = performance"
    memo = res.snapshot(host)
    assert memo == {"old": "powersave"}
    res.apply(host, memo)
    assert fake.governors() == {0: "performance", 1: "performance", 2: "schedutil"}
    assert res.check(host).ok
    assert res.undo_note(host, memo) == "restored performance -> powersave"
    res.remove(host, memo)
    assert fake.governors() == {0: "powersave", 1: "powersave", 2: "schedutil"}


# ---------------------------------------------------------------- module soft dependencies

# `modprobe -D g` from kmod 30 on a tree built with depmod: g needs f (modules.dep), f has
# `softdep f post: c`, g has `softdep g pre: d post: b`, d has `pre: x` (modules.softdep) and
# a has `install a /bin/true`, b has `softdep b pre: a post: c`.
KMOD30_SHOW_DEPENDS = "".join(line + "\n" for line in (
    "insmod /tmp/k/lib/modules/9.9.9/kernel/f.ko ",  # kmod ends each line with its options
    "insmod /tmp/k/lib/modules/9.9.9/kernel/c.ko foo=1 ",
    "insmod /tmp/k/lib/modules/9.9.9/kernel/x.ko ",
    "insmod /tmp/k/lib/modules/9.9.9/kernel/d.ko ",
    "insmod /tmp/k/lib/modules/9.9.9/kernel/g.ko ",
    "install /bin/true ",
    "insmod /tmp/k/lib/modules/9.9.9/kernel/b.ko ",
    "builtin crc32c"))


def test_parse_show_depends_gives_load_order_and_marks_install_commands():
    assert parse_show_depends(KMOD30_SHOW_DEPENDS) == ("f", "c", "x", "d", "g", None, "b")
    assert parse_show_depends("insmod /l/kernel/nvidia-uvm.ko.zst \n") == ("nvidia_uvm",)


@pytest.mark.skipif(not all(shutil.which(t) for t in ("gcc", "depmod", "modprobe")),
                    reason="needs gcc, depmod and kmod's modprobe")
def test_real_modprobe_dry_run_orders_softdeps_as_envctl_plans_them(tmp_path):
    """kmod itself, on a tree of stub modules built with depmod; nothing is loaded (-D)."""
    release = "0.0.0-envctl-test"
    kernel = tmp_path / "lib" / "modules" / release / "kernel"
    kernel.mkdir(parents=True)
    for name in ("a", "b", "c"):
        src = tmp_path / f"{name}.c"
        src.write_text('static const char mi[] __attribute__((section(".modinfo"), used)) = '
                       f'"name={name}\\0license=GPL\\0";\n')
        subprocess.run(["gcc", "-c", "-o", str(kernel / f"{name}.ko"), str(src)], check=True)
    subprocess.run(["depmod", "-b", str(tmp_path), release], check=True, capture_output=True)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "soft.conf").write_text("softdep b pre: a post: c\n")
    km = KernelModules(proc=tmp_path / "proc", sys=tmp_path / "sys", lib=tmp_path / "lib" /
                       "modules", release=release,
                       modprobe=["modprobe", "-d", str(tmp_path), "-S", release, "-C", str(conf)])
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "modules").write_text("")
    found = km.availability("b")
    assert (found.deps, found.post, found.soft) == (("a",), ("c",), ("a", "c"))
    # What `alone` relies on: --ignore-install leaves out the module's own softdeps.
    res = subprocess.run([*km.modprobe, "--show-depends", "--ignore-install", "b"],
                         capture_output=True, text=True, check=True)
    assert parse_show_depends(res.stdout) == ("b",)


def softdep_kmod(tmp_path, **kw) -> FakeKmod:
    return FakeKmod(tmp_path, {"nvidia": ["drm"], "drm": [], "ecc": [], "nvidia_uvm": ["nvidia"],
                               "vfio": []},
                    softdeps={"nvidia": (["ecc"], ["nvidia_uvm"])}, **kw)


def test_fake_modprobe_loads_softdeps_like_kmod_and_ignore_install_skips_them(tmp_path):
    fake = softdep_kmod(tmp_path)
    km = kmod_host(fake).kmod
    # nvidia again: kmod walks the softdeps of nvidia_uvm's dependency without a visited check.
    assert km.show_depends("nvidia") == ("drm", "ecc", "nvidia", "nvidia", "nvidia_uvm")
    km.load("nvidia", alone=True)
    assert fake.loaded() == ["drm", "nvidia"]
    km.load("nvidia")
    assert fake.loaded() == ["drm", "nvidia"]  # already loaded: nothing else happens
    km.unload("nvidia")
    km.load("nvidia")
    assert fake.loaded() == ["drm", "ecc", "nvidia", "nvidia_uvm"]
    assert fake.log()[-1] == "modprobe nvidia" and "modprobe --ignore-install nvidia" in fake.log()


def test_availability_names_soft_dependencies_before_and_after(tmp_path):
    fake = softdep_kmod(tmp_path)
    found = kmod_host(fake).kmod.availability("nvidia")
    assert found.ok and found.deps == ("drm", "ecc") and found.post == ("nvidia_uvm",)
    assert found.soft == ("ecc", "nvidia_uvm") and not found.note
    plain = kmod_host(fake).kmod.availability("vfio")
    assert plain.ok and plain.deps == () and plain.post == () and plain.soft == ()


def test_an_install_command_in_the_chain_is_noted_and_softdeps_left_to_modprobe(tmp_path):
    fake = softdep_kmod(tmp_path, install={"ecc": "/bin/true"})
    found = kmod_host(fake).kmod.availability("nvidia")
    assert found.ok and found.deps == ("drm",) and found.post == () and found.soft == ()
    assert "install command" in found.note


def test_facts_carry_soft_dependencies(tmp_path):
    fake = softdep_kmod(tmp_path)
    facts = gather(proc_root=tmp_path / "proc", sys_root=tmp_path / "sys",
                   modules=frozenset({"nvidia"}), kmod=kmod_host(fake).kmod)
    fact = facts.modules["nvidia"]
    assert (fact.deps, fact.post, fact.soft) == (("drm", "ecc"), ("nvidia_uvm",),
                                                 ("ecc", "nvidia_uvm"))


def test_facts_of_a_loaded_module_keep_its_chain_so_a_second_up_plans_the_same(tmp_path):
    fake = softdep_kmod(tmp_path, loaded={"drm": (1, ["nvidia"]), "nvidia": (0, [])})
    facts = gather(proc_root=tmp_path / "proc", sys_root=tmp_path / "sys",
                   modules=frozenset({"nvidia"}), kmod=kmod_host(fake).kmod)
    fact = facts.modules["nvidia"]
    assert fact.state == "loaded"
    assert (fact.deps, fact.post, fact.soft) == (("drm", "ecc"), ("nvidia_uvm",),
                                                 ("ecc", "nvidia_uvm"))


def test_a_soft_dependency_that_fails_to_load_is_skipped_as_modprobe_does(tmp_path):
    fake = softdep_kmod(tmp_path, broken=("ecc", "vfio"))
    host = kmod_host(fake)
    soft = KernelModule("ecc", alone=True, soft=True)
    soft.apply(host, soft.snapshot(host))  # modprobe itself goes on without it
    assert fake.loaded() == []
    with pytest.raises(HostError, match="load kernel module 'vfio'"):
        KernelModule("vfio").apply(host, {})


def test_module_loaded_alone_passes_ignore_install(tmp_path):
    fake = softdep_kmod(tmp_path)
    host = kmod_host(fake)
    KernelModule("drm", alone=True).apply(host, {})
    KernelModule("nvidia", ("a=1",), alone=True).apply(host, {})
    assert fake.log() == ["modprobe --ignore-install drm", "modprobe --ignore-install nvidia a=1"]
    assert fake.loaded() == ["drm", "nvidia"]


# ---------------------------------------------------------------- sysctl names


def test_sysctl_path_follows_sysctl_8_separators(tmp_path):
    assert sysctl_path(tmp_path, "net.ipv4.ip_forward") == tmp_path / "sys/net/ipv4/ip_forward"
    assert sysctl_path(tmp_path, "net.ipv4.conf.eth0/100.rp_filter") == \
        tmp_path / "sys/net/ipv4/conf/eth0.100/rp_filter"
