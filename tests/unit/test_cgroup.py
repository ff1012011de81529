"""Cgroup planning, layout detection, value normalisation and the BPF assembler (no root)."""

from __future__ import annotations

import struct

import pytest
from pydantic import ValidationError

from envctl.facts import CgroupFacts, HostFacts
from envctl.host import bpf
from envctl.host.cgroups import CgroupLayout, detect_layout, normalize
from envctl.plan.builder import PlanError
from envctl.plan.cgroup import DEFAULT_DEVICES, bfq_weight, blkio_weight, cpu_shares
from envctl.plan.planner import plan_env
from envctl.resources.base import Resource
from envctl.resources.cgroup import Cgroup, CgroupDevices, CgroupParent, _order
from envctl.spec.models import EnvSpec

V1 = CgroupFacts(layout="hybrid", version=1,
                 controllers=("cpu", "cpuacct", "cpuset", "memory", "blkio", "pids", "devices"),
                 swap=True, io_weight="blkio.bfq.weight", cpus="0-3", mems="0")
V2 = CgroupFacts()

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
50 23 0:40 /docker/abc /other/memory rw - cgroup cgroup rw,memory
"""


def spec(resources: dict | None = None, name: str = "e1") -> EnvSpec:
    return EnvSpec.model_validate({"name": name, "kind": "cpu", "resources": resources or {}})


def facts(cg: CgroupFacts, **kw) -> HostFacts:
    return HostFacts(cpus=(0, 1, 2, 3), memory_bytes=8 << 30, cgroup=cg, **kw)


def cgroup_of(plan) -> Cgroup:
    return next(r for r in plan.resources if isinstance(r, Cgroup))


def settings(plan) -> dict[str, str]:
    return {f: v for _, f, v in cgroup_of(plan).settings}


def test_layout_from_mountinfo(tmp_path):
    (tmp_path / "self").mkdir()
    (tmp_path / "self/mountinfo").write_text(HYBRID_MOUNTINFO)
    lay = detect_layout(proc_root=tmp_path)
    assert lay.layout == "hybrid" and lay.version == 1
    assert lay.v1["cpu"] == lay.v1["cpuacct"] == "/sys/fs/cgroup/cpu,cpuacct"
    assert lay.v1["memory"] == "/sys/fs/cgroup/memory"  # not the container's bind
    assert lay.controllers() == ("cpu", "cpuacct", "cpuset", "memory")
    assert CgroupLayout({}, "/sys/fs/cgroup", frozenset({"cpu", "memory"})).layout == "v2"
    assert CgroupLayout().layout == "none"


def test_v1_mapping_of_every_limit():
    s = spec({"cpu": {"quota": "50%", "weight": 200, "dedicated": "1-2"},
              "memory": {"max": "1G", "high": "512M", "swap_max": "256M"},
              "io": {"weight": 500}, "pids": {"max": 100}})
    plan = plan_env(s, facts(V1))
    got = settings(plan)
    assert got["cpu.cfs_quota_us"] == "50000" and got["cpu.cfs_period_us"] == "100000"
    assert got["cpu.shares"] == "2048"
    assert got["cpuset.cpus"] == "1-2" and got["cpuset.mems"] == "0"
    assert got["memory.limit_in_bytes"] == str(1 << 30)
    assert got["memory.soft_limit_in_bytes"] == str(512 << 20)
    assert got["memory.memsw.limit_in_bytes"] == str((1 << 30) + (256 << 20))
    assert got["blkio.bfq.weight"] == str(bfq_weight(500))
    assert got["pids.max"] == "100"
    assert any("soft_limit" in w for w in plan.warnings)
    assert any("bfq" in w for w in plan.warnings)  # no device uses bfq in these facts
    assert plan.resolved["cgroup.driver"] == "cgroupfs"


def test_v2_mapping_and_defaults():
    plan = plan_env(spec({"cpu": {"quota": "150%", "period_us": 50000}}), facts(V2))
    got = settings(plan)
    assert got["cpu.max"] == "75000 50000"
    assert got["cpu.weight"] == "100"
    assert got["memory.max"] == got["memory.high"] == got["memory.swap.max"] == "max"
    assert got["pids.max"] == "max" and got["cpuset.cpus"] == ""
    devices = next(r for r in plan.resources if isinstance(r, CgroupDevices))
    assert devices.rules == DEFAULT_DEVICES and devices.version == 2


def test_percent_memory_resolves_page_aligned():
    plan = plan_env(spec({"memory": {"max": "33.3%"}}), facts(V2))
    assert int(settings(plan)["memory.max"]) % 4096 == 0


def test_weight_conversions():
    assert cpu_shares(100) == 1024 and cpu_shares(1) == 10 and cpu_shares(10000) == 102400
    assert blkio_weight(100) == 500 and blkio_weight(1) == 10 and blkio_weight(10000) == 1000
    assert bfq_weight(100) == 100 and bfq_weight(1) == 1 and bfq_weight(10000) == 1000


@pytest.mark.parametrize(("resources", "cg", "needle"), [
    ({"cpu": {"quota": "0.5%"}}, V1, "1000 µs minimum"),
    ({"memory": {"swap_max": "1G"}}, V1, "set memory.max too"),
    ({"memory": {"max": "1G", "swap_max": "1G"}}, CgroupFacts(swap=False), "swap"),
    ({"pids": {"max": 10}}, CgroupFacts(controllers=("cpu", "memory")), "'pids'"),
    ({"cpu": {"dedicated": [1]}}, CgroupFacts(controllers=("cpu",)), "'cpuset'"),
    ({"memory": {"max": "10%", "high": "2G"}}, V2, "above memory.max"),
    ({"driver": "systemd"}, V2, "systemd"),
    ({}, CgroupFacts(layout="none", version=0, controllers=()), "no usable cgroup"),
])
def test_values_the_host_cannot_honour(resources, cg, needle):
    # (A quota below the kernel's minimum is refused by the spec itself, before planning.)
    with pytest.raises((PlanError, ValidationError)) as exc:
        plan_env(spec(resources), facts(cg))
    assert needle in str(exc.value)


@pytest.mark.parametrize("cg", [CgroupFacts(io_weight=""), CgroupFacts(systemd=True,
                                                                        io_weight="")])
def test_io_weight_on_a_kernel_without_one_is_a_warning_and_writes_nothing(cg):
    plan = plan_env(spec({"io": {"weight": 900}}), facts(cg))
    assert any("io.weight 900 is not applied" in w and "no proportional IO weight" in w
               for w in plan.warnings)
    written = str([r for r in plan.resources])
    assert "io.weight" not in written and "bfq" not in written and "IOWeight" not in written


def test_auto_driver_follows_pid1():
    plan = plan_env(spec({}), facts(V2))
    assert plan.resolved["cgroup.driver"] == "cgroupfs"


def test_resources_round_trip_through_the_journal_form():
    plan = plan_env(spec({"cpu": {"quota": "50%"}, "memory": {"max": "1G"}}), facts(V1))
    for res in plan.resources:
        if isinstance(res, CgroupParent | Cgroup | CgroupDevices):
            import json

            assert Resource.from_dict(json.loads(json.dumps(res.to_dict()))) == res


def test_normalize_compares_as_the_kernel_means():
    assert normalize("memory.limit_in_bytes", "9223372036854771712\n") == "max"
    assert normalize("memory.limit_in_bytes", "-1") == "max"
    assert normalize("memory.limit_in_bytes", "50000000") == "49999872"
    assert normalize("cpuset.cpus", "0,1,2\n") == "0-2"
    assert normalize("io.weight", "default 500\n8:0 100\n") == "500"
    assert normalize("cpu.max", "max  100000\n") == "max 100000"


def test_memsw_goes_first_when_the_memory_limit_grows():
    todo = [(("memory", "memory.limit_in_bytes", "2097152"), "1048576"),
            (("memory", "memory.memsw.limit_in_bytes", "4194304"), "1048576")]
    assert [s[1] for s in _order(todo)] == ["memory.memsw.limit_in_bytes",
                                            "memory.limit_in_bytes"]
    todo[1] = (todo[1][0], "8388608")
    assert [s[1] for s in _order(todo)] == ["memory.limit_in_bytes",
                                            "memory.memsw.limit_in_bytes"]


def test_bpf_program_shape():
    code = bpf.assemble(("c 1:3 rwm", "c 136:* rw", "a"))
    insns = [struct.unpack_from("<BBhi", code, i) for i in range(0, len(code), 8)]
    assert insns[-1][0] == bpf.EXIT and insns[-2] == (bpf.MOV64_K, 0, 0, 0)
    # Every jump lands inside the program, on the next rule's first instruction or later.
    for i, (op, _, off, _) in enumerate(insns):
        if op == bpf.JNE_K:
            assert 0 < i + 1 + off < len(insns)
    assert bpf.parse_rule("c 136:* rw") == ("c", 136, -1, bpf.ACC_READ | bpf.ACC_WRITE)
    assert len(bpf.program_name(DEFAULT_DEVICES)) <= 15
    with pytest.raises(ValueError):
        bpf.parse_rule("x 1:2 r")


# ---------------------------------------------------------------- teardown restores the host


def _fake_v2(tmp_path, monkeypatch, busy: frozenset[str] = frozenset()):
    """A cgroup2 tree in tmp_path whose cgroup.subtree_control takes '+c'/'-c' as the kernel
    does; disabling a controller of `busy` in the root fails with EBUSY (another user's child
    cgroup delegates it further)."""
    import errno
    import os

    import envctl.host.cgroups as hc

    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.subtree_control").write_text("memory\n")  # enabled before envctl
    real_mkdir = type(root).mkdir

    def mkdir(self, *a, **kw):
        real_mkdir(self, *a, **kw)
        (self / "cgroup.subtree_control").touch()

    def write(path, value):
        if path.name != "cgroup.subtree_control":
            return path.write_text(value)
        have = path.read_text().split()
        for tok in value.split():
            if tok[0] == "-" and tok[1:] in busy and path.parent == root:
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
            have = [c for c in have if c != tok[1:]] + ([tok[1:]] if tok[0] == "+" else [])
        path.write_text(" ".join(have) + "\n")

    def rmdir(path):
        (path / "cgroup.subtree_control").unlink(missing_ok=True)
        os.rmdir(path)

    monkeypatch.setattr(type(root), "mkdir", mkdir)
    monkeypatch.setattr(hc, "_write", write)
    monkeypatch.setattr(hc, "_rmdir", rmdir)

    class FakeHost:
        cgroups = hc.Cgroups(CgroupLayout(unified=str(root),
                                          v2_controllers=frozenset({"cpu", "memory", "pids"})))
    return root, FakeHost()


def test_v2_parent_removal_disables_only_the_controllers_envctl_enabled(tmp_path, monkeypatch):
    root, host = _fake_v2(tmp_path, monkeypatch)
    parent = CgroupParent(2, ("cpu", "memory", "pids"), "envctl")
    memo = parent.snapshot(host)
    assert memo == {"existed": False, "had": [],
                    "subtree_control": {"root": ["memory"], "parent": []}}
    parent.apply(host, memo)
    assert parent.check(host).ok
    assert set((root / "cgroup.subtree_control").read_text().split()) == {"cpu", "memory",
                                                                          "pids"}
    for _ in range(2):  # repeatable
        parent.remove(host, memo)
    assert not (root / "envctl").exists()
    assert (root / "cgroup.subtree_control").read_text().split() == ["memory"]


def test_v2_parent_that_existed_gets_its_delegation_back(tmp_path, monkeypatch):
    root, host = _fake_v2(tmp_path, monkeypatch, busy=frozenset({"pids"}))
    (root / "envctl").mkdir()
    (root / "envctl/cgroup.subtree_control").write_text("cpu\n")
    parent = CgroupParent(2, ("cpu", "memory", "pids"), "envctl")
    memo = parent.snapshot(host)
    assert memo["existed"] and memo["subtree_control"] == {"root": ["memory"],
                                                           "parent": ["cpu"]}
    parent.apply(host, memo)
    parent.remove(host, memo)
    assert (root / "envctl").is_dir()  # not ours: kept
    assert (root / "envctl/cgroup.subtree_control").read_text().split() == ["cpu"]
    # pids is busy (another user's cgroup delegates it further): left enabled, not an error.
    assert (root / "cgroup.subtree_control").read_text().split() == ["memory", "pids"]


def test_cgroup_resources_use_the_parent_they_recorded(tmp_path, monkeypatch):
    from envctl.host.cgroups import read_cgroup_facts

    monkeypatch.setenv("ENVCTL_CGROUP_PARENT", "envctl-old")
    assert read_cgroup_facts().parent == "envctl-old"
    plan = plan_env(spec({}), facts(CgroupFacts(controllers=("cpu",), parent="envctl-old")))
    assert {r.parent for r in plan.resources if r.kind.startswith("cgroup")} == {"envctl-old"}
    parent = next(r for r in plan.resources if isinstance(r, CgroupParent))
    assert parent.key == "cgroup-parent:parent:envctl-old"  # not the default parent's holding
    assert CgroupParent(2, (), "envctl").key == CgroupParent(2, ()).key == "cgroup-parent:parent"

    # `down` after ENVCTL_CGROUP_PARENT changed still removes the cgroups `up` made.
    root, host = _fake_v2(tmp_path, monkeypatch)
    host.cgroups = host.cgroups.for_parent("envctl-new")
    cg = Cgroup("e1", 2, ("cpu",), (), "envctl-old")
    memo = parent.snapshot(host)
    parent.apply(host, memo)
    cg.apply(host, {})
    assert (root / "envctl-old/e1").is_dir() and cg.check(host).ok and parent.check(host).ok
    cg.remove(host, {})
    parent.remove(host, memo)
    assert sorted(p.name for p in root.iterdir()) == ["cgroup.subtree_control"]


# ---------------------------------------------------------------- teardown signals only its own


def _sleeper():
    """A process that belongs to no environment: it must outlive any teardown."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _swap_on_signal(monkeypatch, listing, pid: int) -> None:
    """The process `listing` names exits between the read and the signal, and its pid now
    belongs to `pid`, a process outside the cgroup: whichever of kill() / pidfd_open() gets
    that pid first sees the swap (the listing empties, the real call reaches `pid`)."""
    import os

    for name in ("kill", "pidfd_open"):
        real = getattr(os, name)

        def swapped(target, *args, _real=real):
            if target == pid and listing.exists():
                listing.write_text("")
            return _real(target, *args)

        monkeypatch.setattr(os, name, swapped)


def _cgroupfs_rmdir(monkeypatch) -> list[str]:
    """rmdir as cgroupfs does it for a fake tree (its files go with it); returns the log."""
    import envctl.host.cgroups as hc

    removed: list[str] = []

    def rmdir(path):
        removed.append(path.name)
        for f in path.iterdir():
            f.unlink()  # a real cgroup's files vanish with it; a sub-cgroup makes this fail
        path.rmdir()

    monkeypatch.setattr(hc, "_rmdir", rmdir)
    return removed


def test_teardown_never_signals_a_process_outside_the_cgroup(tmp_path, monkeypatch):
    from envctl.host.cgroups import Cgroups

    innocent = _sleeper()
    try:
        env = tmp_path / "cg/envctl/e1"
        env.mkdir(parents=True)
        (env / "cgroup.procs").write_text(f"{innocent.pid}\n")
        _swap_on_signal(monkeypatch, env / "cgroup.procs", innocent.pid)
        _cgroupfs_rmdir(monkeypatch)
        cg = Cgroups(CgroupLayout(unified=str(tmp_path / "cg")), "envctl", kill_grace=0.1)
        cg.remove("e1")
        assert innocent.poll() is None, "a process outside the environment was signalled"
        assert not env.exists()
    finally:
        innocent.kill()
        innocent.wait()


def test_teardown_walks_the_subtree_deepest_first(tmp_path, monkeypatch):
    from envctl.host.cgroups import Cgroups

    env = tmp_path / "cg/envctl/e1"
    (env / "sub/deeper").mkdir(parents=True)
    (env / "other").mkdir()
    for d in (env, env / "sub", env / "sub/deeper", env / "other"):
        (d / "cgroup.procs").write_text("")
    removed = _cgroupfs_rmdir(monkeypatch)
    cg = Cgroups(CgroupLayout(unified=str(tmp_path / "cg")), "envctl", kill_grace=0.1)
    cg.remove("e1")
    assert not env.exists()
    assert removed.index("deeper") < removed.index("sub") < removed.index("e1")
    assert removed.index("other") < removed.index("e1")


def test_membership_is_read_from_proc_and_respects_path_boundaries():
    import os
    from pathlib import Path

    from envctl.host.cgroups import in_cgroup, lists_cgroup

    v1 = "12:freezer:/envctl/lim/job\n8:pids:/envctl/lim\n1:name=systemd:/user.slice\n"
    assert lists_cgroup(v1, "/envctl/lim") and lists_cgroup(v1, "/envctl")
    assert not lists_cgroup(v1, "/envctl/li")  # a name that is a prefix is another cgroup
    assert not lists_cgroup("0::/envctl/lim2\n", "/envctl/lim")
    assert lists_cgroup("0::/envctl.slice/envctl-x.slice/run-1.scope\n",
                        "/envctl.slice/envctl-x.slice")
    mine = Path("/proc/self/cgroup").read_text().splitlines()[0].split(":", 2)[2]
    assert in_cgroup(os.getpid(), mine)
    assert not in_cgroup(os.getpid(), "/envctl-nonexistent/e1")
    assert not in_cgroup(2**22 + 1, mine)  # no such process


def test_stats_split_cpu_time_into_user_and_system(tmp_path):
    """v2 cpu.stat user_usec/system_usec; v1 cpuacct.usage_user/usage_sys (ns), else
    cpuacct.stat's clock ticks."""
    import os

    from envctl.host.cgroups import Cgroups

    v2 = tmp_path / "v2" / "envctl" / "e1"
    v2.mkdir(parents=True)
    (v2 / "cpu.stat").write_text("usage_usec 30\nuser_usec 20\nsystem_usec 10\n")
    cg = Cgroups(CgroupLayout(unified=str(tmp_path / "v2"),
                              v2_controllers=frozenset({"cpu"})), "envctl")
    st = cg.stats("e1", driver="cgroupfs")
    assert (st.cpu_usage_us, st.cpu_user_us, st.cpu_system_us) == (30, 20, 10)
    acct = tmp_path / "cpuacct" / "envctl" / "e1"
    acct.mkdir(parents=True)
    (acct / "cpuacct.usage").write_text("5000000\n")
    (acct / "cpuacct.stat").write_text("user 7\nsystem 3\n")
    v1 = Cgroups(CgroupLayout(v1={"cpuacct": str(tmp_path / "cpuacct")}), "envctl")
    hz = os.sysconf("SC_CLK_TCK")
    st = v1.stats("e1", driver="cgroupfs")
    assert (st.cpu_user_us, st.cpu_system_us) == (7 * 10**6 // hz, 3 * 10**6 // hz)
    (acct / "cpuacct.usage_user").write_text("4000000\n")
    (acct / "cpuacct.usage_sys").write_text("1000000\n")
    st = v1.stats("e1", driver="cgroupfs")
    assert (st.cpu_usage_us, st.cpu_user_us, st.cpu_system_us) == (5000, 4000, 1000)
