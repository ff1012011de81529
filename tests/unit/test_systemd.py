"""The systemd cgroup driver without systemd: slice names and escaping, the spec -> unit
property mapping, driver selection, unit files, and check/apply/remove against a fake
systemctl that behaves like systemd's (properties change only at daemon-reload)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from envctl.errors import HostError
from envctl.facts import CgroupFacts, HostFacts
from envctl.host import systemd as sd
from envctl.host.cgroups import CgroupLayout, Cgroups
from envctl.plan.builder import PlanError
from envctl.plan.cgroup import DEFAULT_DEVICES
from envctl.plan.planner import plan_env
from envctl.resources.base import Resource, Status
from envctl.resources.cgroup import Cgroup
from envctl.resources.cgroup_systemd import SystemdParentSlice, SystemdSlice
from envctl.spec.models import EnvSpec

SD_V2 = CgroupFacts(systemd=True)
SD_V1 = CgroupFacts(layout="hybrid", version=1, systemd=True,
                    controllers=("cpu", "cpuacct", "cpuset", "memory", "blkio", "pids",
                                 "devices"), io_weight="blkio.bfq.weight", cpus="0-3", mems="0")
PROC_DEVICES = "Character devices:\n  1 mem\n  5 /dev/tty\n136 pts\n195 nvidia\n\n" \
               "Block devices:\n  8 sd\n"


def spec(resources: dict, name: str = "cpu-compute") -> EnvSpec:
    return EnvSpec.model_validate({"name": name, "kind": "cpu", "resources": resources})


def facts(cg: CgroupFacts) -> HostFacts:
    return HostFacts(cpus=(0, 1, 2, 3), memory_bytes=8 * 2**30, cgroup=cg)


def props(plan) -> dict[str, str]:
    (res,) = [r for r in plan.resources if isinstance(r, SystemdSlice)]
    return dict(res.properties)


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("text", ["cpu-compute", "a/b", "x y", ".hidden", "caf\u00e9", "a:b_c.d"])
def test_escape_matches_systemd_escape(text):
    if shutil.which("systemd-escape") is None:
        pytest.skip("no systemd-escape")
    real = subprocess.run(["systemd-escape", "--", text], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert sd.escape(text) == real


def test_slice_names_keep_dashes_out_of_the_hierarchy():
    assert sd.parent_slice() == "envctl.slice"
    assert sd.env_slice("cpu-compute") == "envctl-cpu_compute.slice"
    assert sd.slice_cgroup("gpu-a-1") == "envctl.slice/envctl-gpu_a_1.slice"
    # A test parent with dashes stays one level: no envctl-test.slice in between.
    assert sd.parent_slice("envctl-test-12-ab") == "envctl_test_12_ab.slice"
    assert sd.env_slice("lim", "envctl-test-12-ab") == "envctl_test_12_ab-lim.slice"
    # Distinct environment names never share a slice.
    names = ["a-b", "ab", "a-b-c", "a-bc", "ab-c"]
    assert len({sd.env_slice(n) for n in names}) == len(names)


@pytest.mark.parametrize(("text", "us"), [("500ms", "500000"), ("1s 500ms", "1500000"),
                                          ("100ms", "100000"), ("infinity", "infinity"),
                                          ("2min 3s", "123000000"), ("50us", "50")])
def test_timespans_as_systemctl_prints_them(text, us):
    assert sd.parse_timespan(text) == us


# ---------------------------------------------------------------- planning


def test_auto_is_systemd_when_pid1_is_systemd_and_maps_the_spec():
    plan = plan_env(spec({"cpu": {"quota": "150%", "period_us": 50000, "weight": 200,
                                  "dedicated": [1, 2]},
                          "memory": {"max": "1G", "high": "512M", "swap_max": "256M",
                                     "nodes": [0]},
                          "io": {"weight": 300}, "pids": {"max": 64}}), facts(SD_V2))
    assert plan.resolved["cgroup.driver"] == "systemd"
    kinds = [r.kind for r in plan.resources if r.kind.startswith("cgroup")]
    # One /dev/char link per single node of the default allow-list, between the two slices.
    assert kinds == ["cgroup-parent-slice", *["cgroup-char-link"] * 7, "cgroup-slice"]
    assert props(plan) == {
        "CPUAccounting": "yes", "MemoryAccounting": "yes", "TasksAccounting": "yes",
        "CPUQuota": "150%", "CPUQuotaPeriodSec": "50000us", "CPUWeight": "200",
        "AllowedCPUs": "1-2", "AllowedMemoryNodes": "0",
        "MemoryMax": str(2**30), "MemoryHigh": str(2**29), "MemorySwapMax": str(2**28),
        "IOAccounting": "yes", "IOWeight": "300", "TasksMax": "64"}
    (res,) = [r for r in plan.resources if isinstance(r, SystemdSlice)]
    assert res.devices == DEFAULT_DEVICES


def test_defaults_are_written_so_dropped_limits_reset():
    p = props(plan_env(spec({}), facts(SD_V2)))
    assert (p["CPUQuota"], p["CPUWeight"], p["MemoryMax"], p["MemoryHigh"], p["TasksMax"],
            p["AllowedCPUs"], p["IOWeight"]) == ("", "100", "infinity", "infinity",
                                                 "infinity", "", "100")


def test_v1_host_gets_only_what_systemd_sets_on_v1():
    p = props(plan_env(spec({"cpu": {"quota": "12.5%"}, "memory": {"max": "1G"}}),
                       facts(SD_V1)))
    assert p["CPUQuota"] == "12.5%" and p["MemoryMax"] == str(2**30)
    assert not {"AllowedCPUs", "MemoryHigh", "MemorySwapMax"} & set(p)


@pytest.mark.parametrize(("resources", "cg", "needle"), [
    ({"cpu": {"dedicated": [1]}}, SD_V1, "unified (v2)"),
    ({"memory": {"max": "1G", "high": "512M"}}, SD_V1, "MemoryHigh"),
    ({"memory": {"max": "1G", "swap_max": "1G"}}, SD_V1, "MemorySwapMax"),
    ({"memory": {"max": "1G", "swap_max": "1G"}}, CgroupFacts(systemd=True, swap=False),
     "does not account swap"),
    ({"cpu": {"quota": "0.5%"}}, SD_V2, "1000 µs minimum"),
    ({"pids": {"max": 10}}, CgroupFacts(systemd=True, controllers=("cpu",)), "'pids'"),
    ({"driver": "systemd"}, CgroupFacts(), "PID 1 here is not systemd"),
])
def test_values_systemd_cannot_set_are_plan_errors(resources, cg, needle):
    # (A quota below the kernel's minimum is refused by the spec itself, before planning.)
    with pytest.raises((PlanError, ValidationError)) as exc:
        plan_env(spec(resources), facts(cg))
    assert needle in str(exc.value)


@pytest.mark.parametrize(("default", "systemd", "driver", "want"), [
    ("", True, "auto", "systemd"), ("", False, "auto", "cgroupfs"),
    ("cgroupfs", True, "auto", "cgroupfs"), ("systemd", True, "auto", "systemd"),
    ("systemd", True, "cgroupfs", "cgroupfs"),  # the spec's explicit choice wins
])
def test_driver_selection(default, systemd, driver, want):
    cg = CgroupFacts(systemd=systemd, default_driver=default)
    plan = plan_env(spec({"driver": driver}), facts(cg))
    assert plan.resolved["cgroup.driver"] == want
    kinds = {r.kind for r in plan.resources}
    assert ("cgroup-slice" in kinds) == (want == "systemd")
    assert ("cgroup" in kinds) == (want == "cgroupfs")


def test_unknown_driver_override_is_a_plan_error():
    with pytest.raises(PlanError, match="ENVCTL_CGROUP_DRIVER"):
        plan_env(spec({}), facts(CgroupFacts(default_driver="sytemd")))


def test_driver_override_is_read_into_facts(monkeypatch):
    from envctl.host.cgroups import read_cgroup_facts

    monkeypatch.setenv("ENVCTL_CGROUP_DRIVER", "systemd")
    assert read_cgroup_facts().default_driver == "systemd"
    monkeypatch.setenv("ENVCTL_CGROUP_DRIVER", "auto")
    assert read_cgroup_facts().default_driver == ""


def test_slices_round_trip_through_the_journal_form():
    import json

    for res in plan_env(spec({"memory": {"max": "1G"}}), facts(SD_V2)).resources:
        if res.kind.startswith("cgroup"):
            assert Resource.from_dict(json.loads(json.dumps(res.to_dict()))) == res


# ---------------------------------------------------------------- unit files, devices


def test_device_rules_become_device_allow_entries(tmp_path):
    names = sd.read_proc_devices(_fake_proc(tmp_path))
    assert sd.device_allow("c 1:3 rwm", names) == "/dev/char/1:3 rwm"
    assert sd.device_allow("c 136:* rwm", names) == "char-pts rwm"
    assert sd.device_allow("c 195:255 rw", names) == "/dev/char/195:255 rw"
    with pytest.raises(HostError, match="major 240"):
        sd.device_allow("c 240:* rwm", names)
    # A GPU rule naming a dynamic major is systemd's char-NAME (the whole major).
    assert sd.device_allow("c nvidia-uvm:1 rw", names) == "char-nvidia-uvm rw"
    from envctl.plan.cgroup_systemd import char_nodes

    assert char_nodes(("c 195:0 rw", "c nvidia-uvm:0 rw", "c 136:* rwm")) == [(195, 0)]


def _fake_proc(tmp: Path) -> Path:
    (tmp / "devices").write_text(PROC_DEVICES)
    return tmp


def test_unit_text_and_what_systemd_will_report():
    settings = [("CPUQuota", "50%"), ("CPUQuotaPeriodSec", "100000us"), ("MemoryMax", "1024"),
                ("AllowedCPUs", "1,2,3"), ("TasksMax", "infinity")]
    allow = ["/dev/char/1:3 rwm", "char-pts rwm"]
    text = sd.unit_text("envctl environment x", settings, allow)
    assert "[Slice]\nCPUQuota=50%\nCPUQuotaPeriodSec=100000us\n" in text
    assert text.endswith("DevicePolicy=closed\nDeviceAllow=/dev/char/1:3 rwm\n"
                         "DeviceAllow=char-pts rwm\n")
    assert sd.expected(settings, allow) == {
        "CPUQuota": "500000", "CPUQuotaPeriodSec": "100000", "MemoryMax": "1024",
        "AllowedCPUs": "1-3", "TasksMax": "infinity", "DevicePolicy": "closed",
        "DeviceAllow": "/dev/char/1:3 rwm; char-pts rwm"}


def test_char_nodes_are_found_in_dev():
    s = sd.Systemd(CgroupLayout(), dev=Path("/dev"))
    assert s.char_link(1, 3) == Path("/dev/char/1:3")
    assert (s.char_node(1, 3), s.char_node(1, 9)) == ("../null", "../urandom")


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_char_links_read_made_and_removed(tmp_path):
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    os.mknod(dev / "nvidia0", 0o666 | 0o020000, os.makedev(195, 0))
    os.mknod(dev / "nvidia-caps/nvidia-cap1", 0o666 | 0o020000, os.makedev(237, 1))
    s = sd.Systemd(CgroupLayout(), dev=dev)
    assert s.char_node(237, 1) == "../nvidia-caps/nvidia-cap1"
    assert s.char_node(195, 7) is None
    assert s.read_char_link(195, 0) == sd.CharLinkFact("missing")
    s.set_char_link(195, 0, "../gone")  # makes /dev/char
    assert s.read_char_link(195, 0) == sd.CharLinkFact("wrong", "../gone")
    s.set_char_link(195, 0, "../nvidia0")  # replaces a link, atomically
    assert s.read_char_link(195, 0) == sd.CharLinkFact("ok", "../nvidia0")
    assert [p.name for p in (dev / "char").iterdir()] == ["195:0"]  # no temporary left
    s.remove_char_link(195, 0, expect="../other")  # not what it points to: kept
    assert os.readlink(dev / "char/195:0") == "../nvidia0"
    for _ in range(2):  # already gone is success
        s.remove_char_link(195, 0, expect="../nvidia0")
    assert not os.path.lexists(dev / "char/195:0")
    (dev / "char/1:3").mkdir()
    fact = s.read_char_link(1, 3)
    assert (fact.state, fact.detail) == ("foreign", f"{dev / 'char/1:3'} is a directory")


# ---------------------------------------------------------------- a fake systemctl


def _span(us: int) -> str:
    if us % 1_000_000 == 0:
        return f"{us // 1_000_000}s"
    return f"{us // 1000}ms" if us % 1000 == 0 else f"{us}us"


class FakeSystemctl:
    """systemctl over a unit directory: a unit's settings change at daemon-reload (its file)
    or set-property --runtime (a drop-in), as systemd's do; `show` prints them its way."""

    def __init__(self, unit_dir: Path, control_dir: Path, etc_dir: Path):
        self.unit_dir, self.control_dir, self.etc_dir = unit_dir, control_dir, etc_dir
        self.loaded: dict[str, list[tuple[str, str]]] = {}
        self.fragment: dict[str, Path] = {}
        self.runtime: dict[str, list[tuple[str, str]]] = {}
        self.active: set[str] = set()
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> subprocess.CompletedProcess:
        args = [a for a in argv[1:] if a != "--"]
        self.calls.append(args)
        rc, out = getattr(self, "do_" + args[0].replace("-", "_"))(*args[1:]) or (0, "")
        return subprocess.CompletedProcess(argv, rc, out, "" if rc == 0 else "Unit not loaded.")

    def do_daemon_reload(self):
        self.loaded, self.fragment = {}, {}
        # /etc/systemd/system comes before /run/systemd/system, as in systemd's search path.
        for d in (self.unit_dir, self.etc_dir):
            for f in d.glob("*.slice"):
                self.fragment[f.name] = f
                self.loaded[f.name] = [tuple(line.split("=", 1)) for line in
                                       f.read_text().splitlines() if "=" in line
                                       and not line.startswith("#")]

    def do_start(self, unit):
        if unit not in self.loaded:
            return 5, ""
        self.active.add(unit)

    def do_stop(self, unit):
        if unit not in self.loaded and unit not in self.active:
            return 5, ""
        self.active.discard(unit)

    def do_set_property(self, runtime, unit, *assignments):
        assert runtime == "--runtime"
        d = self.control_dir / f"{unit}.d"
        d.mkdir(parents=True, exist_ok=True)
        for a in assignments:
            key, value = a.split("=", 1)
            self.runtime.setdefault(unit, []).append((key, value))
            (d / f"50-{key}.conf").write_text(a + "\n")

    def do_revert(self, unit):
        # As systemctl's: every drop-in goes, the operator's in /etc included.
        shutil.rmtree(self.control_dir / f"{unit}.d", ignore_errors=True)
        shutil.rmtree(self.etc_dir / f"{unit}.d", ignore_errors=True)
        self.runtime.pop(unit, None)

    def settings(self, unit) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for key, value in self.loaded.get(unit, []) + self.runtime.get(unit, []):
            if key == "DeviceAllow":
                out[key] = [] if not value else [value, *out.get(key, [])]
            else:
                out[key] = [value]
        return out

    def do_show(self, _p, keys, unit):
        have = self.settings(unit)
        lines = [f"LoadState={'loaded' if unit in self.loaded else 'not-found'}",
                 f"ActiveState={'active' if unit in self.active else 'inactive'}",
                 f"FragmentPath={self.fragment.get(unit, '')}"]
        for key in keys.split(","):
            if key == "CPUQuotaPerSecUSec":
                q = (have.get("CPUQuota") or [""])[0]
                lines.append(f"{key}=" + (_span(int(float(q[:-1]) * 10000)) if q
                                          else "infinity"))
            elif key == "CPUQuotaPeriodUSec":
                p = (have.get("CPUQuotaPeriodSec") or [""])[0]
                lines.append(f"{key}=" + (_span(int(p[:-2])) if p else "infinity"))
            elif key not in ("LoadState", "ActiveState", "FragmentPath"):
                lines += [f"{key}={v}" for v in have.get(key, [""])]
        return 0, "\n".join(lines) + "\n"


@pytest.fixture
def host(tmp_path):
    class FakeHost:
        pass

    unit_dir, control = tmp_path / "run/systemd/system", tmp_path / "run/systemd/system.control"
    fake = FakeSystemctl(unit_dir, control, tmp_path / "etc/systemd/system")
    h = FakeHost()
    h.fake = fake
    (tmp_path / "proc").mkdir()
    h.systemd = sd.Systemd(CgroupLayout(unified=str(tmp_path / "cg")), unit_dir=unit_dir,
                           control_dir=control, runner=fake,
                           proc=_fake_proc(tmp_path / "proc"), dev=tmp_path / "dev",
                           kill_grace=0.1)
    (tmp_path / "dev").mkdir()
    h.cgroups = Cgroups(CgroupLayout(unified=str(tmp_path / "cg")))
    return h


def _slice(**kw) -> SystemdSlice:
    base = {"env": "cpu-compute", "version": 2,
            "properties": (("CPUQuota", "50%"), ("CPUQuotaPeriodSec", "100000us"),
                           ("MemoryMax", str(2**30)), ("TasksMax", "64")),
            "devices": ("c 1:3 rwm", "c 136:* rwm")}
    return SystemdSlice(**{**base, **kw})


def test_apply_check_drift_and_remove(host):
    res, parent = _slice(), SystemdParentSlice(2)
    assert res.check(host).status is Status.ABSENT
    assert parent.snapshot(host) == {"existed": False}
    parent.apply(host, {})
    res.apply(host, {})
    path = host.systemd.unit_dir / "envctl-cpu_compute.slice"
    assert "MemoryMax=1073741824" in path.read_text()
    assert host.fake.active == {"envctl.slice", "envctl-cpu_compute.slice"}
    assert res.check(host).ok and parent.check(host).ok
    # Applying again changes nothing: no write, no reload.
    calls = len(host.fake.calls)
    res.apply(host, {})
    assert [c[0] for c in host.fake.calls[calls:]] == ["start", "show"]

    # An operator's set-property shadows the file: drift, named precisely, then repaired.
    host.fake.do_set_property("--runtime", "envctl-cpu_compute.slice", "TasksMax=5")
    check = res.check(host)
    assert check.status is Status.DRIFTED
    assert [(d.field, d.want, d.have) for d in check.diffs] == [("TasksMax", "64", "5")]
    res.apply(host, {})
    assert res.check(host).ok

    # A changed spec rewrites the file and reloads.
    new = _slice(properties=(("CPUQuota", "25%"), ("CPUQuotaPeriodSec", "100000us"),
                             ("MemoryMax", str(2**30)), ("TasksMax", "64")))
    assert [d.field for d in new.check(host).diffs] == ["unit file", "CPUQuota"]
    new.apply(host, {})
    assert new.check(host).ok and "daemon-reload" in [c[0] for c in host.fake.calls]

    for _ in range(2):  # remove is repeatable
        new.remove(host, {})
        parent.remove(host, {})
    assert not path.exists() and not list(host.systemd.control_dir.glob("*"))
    assert host.fake.active == set() and host.fake.loaded == {}
    assert new.check(host).status is Status.ABSENT


def test_parent_slice_that_existed_is_kept(host):
    host.fake.loaded["envctl.slice"] = []
    host.fake.active.add("envctl.slice")
    parent = SystemdParentSlice(2)
    memo = parent.snapshot(host)
    assert memo == {"existed": True}
    parent.apply(host, memo)
    path = host.systemd.unit_dir / "envctl.slice"
    assert path.exists()
    for _ in range(2):  # repeatable
        parent.remove(host, memo)
    assert "envctl.slice" in host.fake.active
    # The unit file envctl wrote goes (and systemd forgets it); the slice keeps running.
    assert not path.exists() and "envctl.slice" not in host.fake.loaded
    assert host.fake.calls[-1] == ["daemon-reload"]


def test_a_unit_file_envctl_did_not_write_is_kept(host):
    host.fake.active.add("envctl.slice")
    path = host.systemd.unit_dir / "envctl.slice"
    path.parent.mkdir(parents=True)
    path.write_text("[Slice]\nCPUWeight=50\n")  # an operator's, written after the snapshot
    SystemdParentSlice(2).remove(host, {"existed": True})
    assert path.exists() and "envctl.slice" in host.fake.active


def test_slices_use_the_parent_they_recorded(host, monkeypatch):
    monkeypatch.setenv("ENVCTL_CGROUP_PARENT", "envctl-old")
    from envctl.host.cgroups import read_cgroup_facts

    cg = read_cgroup_facts()
    plan = plan_env(spec({"cpu": {"quota": "50%"}}),
                    facts(CgroupFacts(systemd=True, parent=cg.parent)))
    parent, res = (next(r for r in plan.resources if isinstance(r, k))
                   for k in (SystemdParentSlice, SystemdSlice))
    assert (parent.parent, res.parent) == ("envctl-old", "envctl-old")
    assert parent.key == "cgroup-parent-slice:parent:envctl-old"
    parent.apply(host, parent.snapshot(host))
    res.apply(host, {})
    assert host.fake.active == {"envctl_old.slice", "envctl_old-cpu_compute.slice"}
    # ENVCTL_CGROUP_PARENT changed before `down`: the recorded parent is what goes.
    host.systemd = host.systemd.for_parent("envctl-new")
    assert res.check(host).ok and parent.check(host).ok
    res.remove(host, {})
    parent.remove(host, {"existed": False})
    assert host.fake.active == set() and not list(host.systemd.unit_dir.glob("*"))


def test_a_failing_systemctl_is_a_host_error(host):
    host.systemd.runner = lambda argv: subprocess.CompletedProcess(argv, 1, "", "Access denied")
    with pytest.raises(HostError, match="load slice 'envctl-cpu_compute.slice': "
                       "systemctl daemon-reload: Access denied"):
        _slice().apply(host, {})


def test_stats_read_the_slice_cgroup(tmp_path):
    d = tmp_path / "envctl.slice/envctl-cpu_compute.slice"
    d.mkdir(parents=True)
    (d / "cpu.stat").write_text("usage_usec 10\nnr_periods 4\nnr_throttled 2\n"
                                "throttled_usec 7\n")
    (d / "memory.current").write_text("4096\n")
    (d / "pids.current").write_text("3\n")
    cg = Cgroups(CgroupLayout(unified=str(tmp_path), v2_controllers=frozenset({"cpu"})))
    for driver in ("systemd", None):
        st = cg.stats("cpu-compute", driver=driver)
        assert (st.cpu_usage_us, st.nr_throttled, st.memory_current, st.pids_current) == \
            (10, 2, 4096, 3)


def test_status_reports_the_systemd_driver():
    assert SystemdSlice.driver == "systemd" and Cgroup.driver == "cgroupfs"


def test_run_and_attach_argv(host, tmp_path):
    s = host.systemd
    assert s.run_argv("cpu-compute", ["python3", "job.py"]) == [
        "systemd-run", "--quiet", "--scope", "--collect", "--slice=envctl-cpu_compute.slice",
        "--", "python3", "job.py"]
    seen = []

    def busctl(argv):
        seen.append(argv)
        (s.proc / "42").mkdir(exist_ok=True)
        (s.proc / "42/cgroup").write_text(
            "0::/envctl.slice/envctl-cpu_compute.slice/envctl-cpu_compute-42.scope\n")
        return subprocess.CompletedProcess(argv, 0, 'o "/org/freedesktop/systemd1/job/7"', "")

    s.runner = busctl
    assert s.attach("cpu-compute", 42) == "envctl-cpu_compute-42.scope"
    assert seen[0][:7] == ["busctl", "call", "org.freedesktop.systemd1",
                           "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager",
                           "StartTransientUnit", "ssa(sv)a(sa(sv))"]
    assert seen[0][7:] == ["envctl-cpu_compute-42.scope", "fail", "3", "PIDs", "au", "1", "42",
                           "Slice", "s", "envctl-cpu_compute.slice", "CollectMode", "s",
                           "inactive-or-failed", "0"]


def test_stopping_is_what_is_system_running_says(host):
    s = host.systemd
    for out, code, want in (("stopping\n", 1, True), ("running\n", 0, False),
                            ("degraded\n", 1, False), ("offline\n", 1, False)):
        seen: list[list[str]] = []
        s.runner = lambda argv, out=out, code=code, seen=seen: (
            seen.append(argv) or subprocess.CompletedProcess(argv, code, out, ""))
        assert s.stopping() is want
        assert seen == [[*s.systemctl, "is-system-running"]]

    def missing(argv):
        raise FileNotFoundError(2, "No such file or directory", argv[0])

    s.runner = missing
    assert s.stopping() is False


# ---------------------------------------------------------------- ownership and teardown


def test_teardown_of_a_slice_never_signals_a_process_outside_it(host, tmp_path, monkeypatch):
    from tests.unit.test_cgroup import _sleeper, _swap_on_signal

    res = _slice()
    res.apply(host, {})
    scope = tmp_path / "cg/envctl.slice/envctl-cpu_compute.slice/job.scope"
    scope.mkdir(parents=True)
    innocent = _sleeper()
    try:
        (scope / "cgroup.procs").write_text(f"{innocent.pid}\n")
        _swap_on_signal(monkeypatch, scope / "cgroup.procs", innocent.pid)
        res.remove(host, {})
        assert innocent.poll() is None, "a process outside the slice was signalled"
    finally:
        innocent.kill()
        innocent.wait()


def _foreign(host, how: str) -> None:
    unit = "envctl-cpu_compute.slice"
    if how == "active":  # started by somebody (systemd-run --slice=...), no unit file at all
        host.fake.active.add(unit)
    elif how == "etc":  # defined by an operator's unit file, not started
        (host.fake.etc_dir).mkdir(parents=True)
        (host.fake.etc_dir / unit).write_text("[Slice]\nCPUWeight=50\n")
        host.fake.do_daemon_reload()
    elif how == "run":  # a unit file in envctl's directory that envctl did not write
        host.systemd.unit_dir.mkdir(parents=True)
        (host.systemd.unit_dir / unit).write_text("[Slice]\nCPUWeight=50\n")
        host.fake.do_daemon_reload()


@pytest.mark.parametrize("how", ["active", "etc", "run"])
def test_slice_envctl_did_not_make_is_refused_and_left_alone(host, tmp_path, how):
    from envctl.engine.engine import Engine
    from envctl.errors import StepFailed
    from envctl.host.context import Host

    _foreign(host, how)
    res = _slice()
    why = res.refuses(res.snapshot(host))
    assert "envctl-cpu_compute.slice" in why and "envctl did not" in why, why
    real = Host(state_dir=tmp_path / "state", run_dir=tmp_path / "run-envctl")
    real.systemd, real.cgroups = host.systemd, host.cgroups
    before = {f: f.read_text() for f in tmp_path.rglob("*.slice")}
    active = set(host.fake.active)
    with pytest.raises(StepFailed, match="envctl did not"):
        Engine(real).up("cpu-compute", [SystemdParentSlice(2), res])
    Engine(real).down("cpu-compute")
    assert {f: f.read_text() for f in tmp_path.rglob("*.slice")} == before
    assert host.fake.active == active
    assert not [c for c in host.fake.calls if "envctl-cpu_compute.slice" in c
                and c[0] in ("stop", "revert", "set-property")]


def test_a_stopped_slice_with_envctl_s_own_unit_file_is_taken_over(host):
    res = _slice()
    res.apply(host, {})
    host.fake.active.discard("envctl-cpu_compute.slice")  # e.g. after a lost journal
    assert res.refuses(res.snapshot(host)) == ""
    assert res.refuses(_slice().snapshot(host)) == ""


def test_removal_keeps_drop_ins_envctl_did_not_make(host):
    unit = "envctl-cpu_compute.slice"
    res = _slice()
    memo = res.snapshot(host)
    res.apply(host, memo)
    # An operator's persistent drop-in, and a runtime one for a property envctl leaves alone.
    etc = host.fake.etc_dir / f"{unit}.d"
    etc.mkdir(parents=True)
    (etc / "10-ops.conf").write_text("[Slice]\nIOWeight=50\n")
    host.fake.do_set_property("--runtime", unit, "IOWeight=50")
    # A runtime override of a property envctl sets: envctl's next up overrides it in turn.
    host.fake.do_set_property("--runtime", unit, "TasksMax=5")
    res.apply(host, memo)
    control = host.systemd.control_dir / f"{unit}.d"
    assert (control / "50-TasksMax.conf").read_text() == "TasksMax=64\n"
    res.remove(host, memo)
    assert (etc / "10-ops.conf").exists()
    assert sorted(p.name for p in control.iterdir()) == ["50-IOWeight.conf"]
    assert "revert" not in [c[0] for c in host.fake.calls]


def test_undo_notes_say_what_down_will_do(host, tmp_path):
    res, parent = _slice(), SystemdParentSlice(2)
    res.apply(host, {})
    assert res.undo_note(host, {}) == ""
    scope = tmp_path / "cg/envctl.slice/envctl-cpu_compute.slice/job.scope"
    scope.mkdir(parents=True)
    (scope / "cgroup.procs").write_text("4242\n4243\n")
    assert res.undo_note(host, {}) == "stops 2 processes"
    assert parent.undo_note(host, {"existed": True}) == "kept: it was active before envctl"
    assert parent.undo_note(host, {"existed": False}) == ""


# ---------------------------------------------------------------- /dev/char links, shared


def _node(dev: Path, name: str, major: int, minor: int) -> None:
    os.mknod(dev / name, 0o666 | 0o020000, os.makedev(major, minor))


def _engine(host, tmp_path):
    from envctl.engine.engine import Engine
    from envctl.host.context import Host

    real = Host(state_dir=tmp_path / "state", run_dir=tmp_path / "run-envctl")
    real.systemd, real.cgroups = host.systemd, host.cgroups
    return Engine(real)


def _env_plan(name: str, rules: tuple[str, ...] = ("c 195:0 rw",)) -> list[Resource]:
    """What the planner makes for a systemd environment whose GPU section allows `rules`."""
    from envctl.plan.builder import Plan
    from envctl.plan.cgroup_systemd import plan_systemd
    from envctl.plan.limits import GPU_DEVICES_KEY

    plan = Plan(name)
    plan.resolved[GPU_DEVICES_KEY] = list(rules)
    plan_systemd(spec({}, name=name), facts(SD_V2), plan)
    return plan.finish().resources


def test_char_links_are_planned_before_the_slice_one_per_node():
    res = _env_plan("gpu-a", ("c 195:0 rw", "c 195:0 rwm", "c 195:255 rw", "c 237:* rw"))
    keys = [r.key for r in res]
    assert keys[0] == "cgroup-parent-slice:parent" and keys[-1] == "cgroup-slice:gpu-a"
    # Every single character node of the allow-list (the defaults and the GPU's), once each;
    # whole majors (136:*, 237:*) have no link.
    assert keys[1:-1] == [f"cgroup-char-link:{n}" for n in (
        "1:3", "1:5", "1:7", "1:8", "1:9", "5:0", "5:2", "195:0", "195:255")]
    assert all(r.shared for r in res[1:-1])


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
@pytest.mark.parametrize("first", ["a", "b"])
def test_a_char_link_two_environments_allow_goes_with_the_last_of_them(host, tmp_path, first):
    dev = host.systemd.dev
    _node(dev, "nvidia0", 195, 0)
    link = dev / "char/195:0"
    engine = _engine(host, tmp_path)
    engine.up("a", _env_plan("a"))
    assert os.readlink(link) == "../nvidia0"
    engine.up("b", _env_plan("b"))  # finds the link A made: it is envctl's all the same
    second = "b" if first == "a" else "a"
    notes = {s.resource.key: s.note for s in engine.diff_down(first)}
    assert notes["cgroup-char-link:195:0"] == f"still used by {second}"
    engine.down(first)
    assert os.readlink(link) == "../nvidia0"  # the other environment's slice still allows it
    notes = {s.resource.key: s.note for s in engine.diff_down(second)}
    assert notes["cgroup-char-link:195:0"] == f"removes {link}"
    engine.down(second)
    assert not os.path.lexists(link)
    assert not [k for k in engine.ledger().items if "char-link" in k]


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
@pytest.mark.parametrize("link_to", ["relative", "absolute", "node"])
def test_a_char_link_there_before_envctl_is_never_removed(host, tmp_path, link_to):
    dev = host.systemd.dev
    _node(dev, "nvidia0", 195, 0)
    (dev / "char").mkdir()
    link = dev / "char/195:0"
    if link_to == "node":  # the node itself, not a link: right all the same
        _node(dev / "char", "195:0", 195, 0)
    else:  # udev's, or somebody's absolute one
        link.symlink_to("../nvidia0" if link_to == "relative" else dev / "nvidia0")
    before = os.lstat(link)
    engine = _engine(host, tmp_path)
    for env in ("a", "b"):
        engine.up(env, _env_plan(env))
    step = {s.resource.key: s for s in engine.status("a", None)}["cgroup-char-link:195:0"]
    assert step.note.startswith("at down: kept: it existed before envctl"), step.note
    for env in ("b", "a"):
        notes = {s.resource.key: s.note for s in engine.diff_down(env)}
        engine.down(env)
    assert notes["cgroup-char-link:195:0"] == "kept: it existed before envctl"
    after = os.lstat(link)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_char_link_check_apply_drift_and_remove(host):
    from envctl.resources.cgroup_systemd import SystemdCharLink

    dev = host.systemd.dev
    (dev / "nvidia-caps").mkdir()
    _node(dev / "nvidia-caps", "nvidia-cap1", 237, 1)
    res = SystemdCharLink(237, 1)
    assert res.describe() == "/dev/char/237:1 link" and res.key == "cgroup-char-link:237:1"
    assert res.check(host).status is Status.ABSENT
    memo = res.snapshot(host)
    assert memo == {"existed": False, "was": None, "target": "../nvidia-caps/nvidia-cap1"}
    assert res.refuses(memo) == ""
    res.apply(host, memo)
    link = dev / "char/237:1"
    assert os.readlink(link) == "../nvidia-caps/nvidia-cap1" and res.check(host).ok
    res.apply(host, memo)  # already so
    # Gone (udev's rules, an operator): drift, repaired by apply.
    link.unlink()
    assert res.check(host).status is Status.ABSENT
    res.apply(host, memo)
    assert res.undo_note(host, memo) == f"removes {link}"
    for _ in range(2):  # repeatable
        res.remove(host, memo)
    assert not os.path.lexists(link)
    assert res.undo_note(host, memo) == ""
    # No node with those numbers: nothing to link, nothing to report.
    none = SystemdCharLink(195, 7)
    assert none.check(host).ok and none.snapshot(host)["target"] is None
    none.apply(host, none.snapshot(host))
    assert not os.path.lexists(dev / "char/195:7")


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_char_link_repointed_since_is_kept(host):
    from envctl.resources.cgroup_systemd import SystemdCharLink

    dev = host.systemd.dev
    _node(dev, "nvidia0", 195, 0)
    res = SystemdCharLink(195, 0)
    memo = res.snapshot(host)
    res.apply(host, memo)
    (dev / "char/195:0").unlink()
    (dev / "char/195:0").symlink_to("/dev/null")  # somebody else's now
    assert res.undo_note(host, memo) == "kept: it points to /dev/null now, not where envctl " \
                                        "set it"
    res.remove(host, memo)
    assert os.readlink(dev / "char/195:0") == "/dev/null"


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_wrong_char_link_is_replaced_and_given_back(host):
    from envctl.resources.cgroup_systemd import SystemdCharLink

    dev = host.systemd.dev
    _node(dev, "nvidia0", 195, 0)
    (dev / "char").mkdir()
    (dev / "char/195:0").symlink_to("../gone")  # dangling: systemd could not resolve it
    res = SystemdCharLink(195, 0)
    check = res.check(host)
    assert check.status is Status.DRIFTED
    assert [(d.field, d.want, d.have) for d in check.diffs] == [
        ("target", "../nvidia0", "../gone")]
    memo = res.snapshot(host)
    assert memo == {"existed": False, "was": "../gone", "target": "../nvidia0"}
    res.apply(host, memo)
    assert os.readlink(dev / "char/195:0") == "../nvidia0"
    assert res.undo_note(host, memo) == f"restores {dev / 'char/195:0'} -> ../gone"
    res.remove(host, memo)
    assert os.readlink(dev / "char/195:0") == "../gone"  # as envctl found it
    # A wrong link with no node to point it at instead: left as it is, and so at removal.
    (dev / "char/195:9").symlink_to("../nvidia9")
    res = SystemdCharLink(195, 9)
    memo = res.snapshot(host)
    assert res.check(host).ok and memo["target"] is None
    res.apply(host, memo)
    assert res.undo_note(host, memo) == ""
    res.remove(host, memo)
    assert os.readlink(dev / "char/195:9") == "../nvidia9"


def test_something_else_at_a_char_link_path_is_refused(host):
    from envctl.resources.cgroup_systemd import SystemdCharLink

    dev = host.systemd.dev
    (dev / "char").mkdir()
    (dev / "char/195:0").write_text("not a link\n")
    res = SystemdCharLink(195, 0)
    why = res.refuses(res.snapshot(host))
    assert f"{dev / 'char/195:0'} is a regular file" in why, why
    assert res.check(host).status is Status.WRONG_KIND
    with pytest.raises(HostError, match="regular file"):
        res.apply(host, {})
    assert (dev / "char/195:0").read_text() == "not a link\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_slice_journalled_before_char_link_steps_still_removes_its_links(host, elsewhere):
    """Journals of the version that kept the links in the slice's memo: the links it made go
    with its slice, as then (unless another slice of envctl's allows them)."""
    dev = host.systemd.dev
    _node(dev, "nvidia0", 195, 0)
    (dev / "char").mkdir()
    (dev / "char/195:0").symlink_to("../nvidia0")
    res = _slice(devices=("c 195:0 rw",))
    res.apply(host, {})
    memo = {"foreign": "", "char_links": {str(dev / "char/195:0"): "../nvidia0"}}
    if elsewhere:
        _slice(env="other", devices=("c 195:0 rw",)).apply(host, {})
    assert res.undo_note(host, memo) == ("" if elsewhere else f"removes {dev / 'char/195:0'}")
    res.remove(host, memo)
    assert os.path.lexists(dev / "char/195:0") == elsewhere
