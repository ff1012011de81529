"""No silent surprises in a spec: `cpus` as Docker means it, a warning for a bare quota that
is almost certainly CPUs, and every error of a spec (field errors and conflicts, within a spec
and across specs) in one run, each at the line of the entry at fault."""

from __future__ import annotations

import json

import pytest

from envctl.errors import SpecError
from envctl.facts import CgroupFacts, HostFacts
from envctl.plan.cgroup_systemd import SystemdSlice
from envctl.plan.planner import plan_env
from envctl.resources.cgroup import Cgroup
from envctl.spec.loader import parse_spec
from tests.unit.test_cli import isolated, run  # noqa: F401 (isolated: an autouse fixture)

V1 = CgroupFacts(layout="hybrid", version=1,
                 controllers=("cpu", "cpuacct", "cpuset", "memory", "blkio", "pids", "devices"),
                 cpus="0-3", mems="0")
V2 = CgroupFacts()
SYSTEMD = CgroupFacts(systemd=True)


def loaded(cpu: str, name: str = "demo"):
    return parse_spec(f"name: {name}\nkind: cpu\nresources:\n  cpu:\n{cpu}", f"{name}.yaml")


def errors_of(text: str, path: str = "demo.yaml"):
    with pytest.raises(SpecError) as exc:
        parse_spec(text, path)
    return exc.value


def limits(spec, cg: CgroupFacts) -> dict[str, str]:
    plan = plan_env(spec, HostFacts(cpus=(0, 1, 2, 3), memory_bytes=8 << 30, cgroup=cg))
    for r in plan.resources:
        if isinstance(r, Cgroup):
            return {f: v for _, f, v in r.settings if f.startswith("cpu.")}
        if isinstance(r, SystemdSlice):
            return {k: v for k, v in r.properties if k.startswith("CPU")}
    raise AssertionError("no cgroup planned")


# ---------------------------------------------------------------- cpus, as Docker means it


@pytest.mark.parametrize("cpus, quota", [
    ("1.5", "150%"), ("'0.50'", "50%"), ("2", "200%"), ("0.01", "1%"), ("0.333", "33.3%"),
])
@pytest.mark.parametrize("cg", [V1, V2, SYSTEMD], ids=["v1", "v2", "systemd"])
def test_cpus_plans_the_same_cgroup_values_as_the_equivalent_quota(cpus, quota, cg):
    as_cpus = loaded(f"    cpus: {cpus}\n").spec
    as_quota = loaded(f"    quota: {quota}\n").spec
    assert as_cpus.resources.cpu.percent == pytest.approx(as_quota.resources.cpu.quota)
    assert limits(as_cpus, cg) == limits(as_quota, cg)


def test_cpus_values_on_each_cgroup_version():
    spec = loaded("    cpus: 1.5\n    period_us: 50000\n").spec
    assert limits(spec, V1)["cpu.cfs_quota_us"] == "75000"
    assert limits(spec, V1)["cpu.cfs_period_us"] == "50000"
    assert limits(spec, V2)["cpu.max"] == "75000 50000"
    assert limits(spec, SYSTEMD)["CPUQuota"] == "150%"


def test_quota_and_cpus_together_is_an_error_at_the_line_of_cpus():
    exc = errors_of("name: demo\nkind: cpu\nresources:\n  cpu:\n    quota: 150%\n"
                    "    cpus: 1.5\n")
    (p,) = exc.problems
    assert (p.line, p.field) == (6, "resources.cpu.cpus")
    assert "quota" in p.message and "cpus" in p.message and "not both" in p.message


@pytest.mark.parametrize("value, words", [
    ("150%", ["number of CPUs", "quota: 150%"]),
    ("0", ["above 0"]),
    ("-1", ["above 0"]),
    ("true", ["not true"]),
    ("lots", ["like 1.5"]),
    ("70000", ["at most 65536"]),
    (".nan", ["number of CPUs"]),
    ("0.001", ["100 µs", "1000 µs minimum"]),
])
def test_bad_cpus_are_errors_naming_what_is_allowed(value, words):
    exc = errors_of(f"name: demo\nkind: cpu\nresources:\n  cpu:\n    cpus: {value}\n")
    (p,) = exc.problems
    assert (p.line, p.field) == (5, "resources.cpu.cpus"), str(p)
    for w in words:
        assert w in p.message, str(p)


# ---------------------------------------------------------------- a bare quota that is CPUs


@pytest.mark.parametrize("quota", ["1.5", "1", "4", "9.5", "2.5"])
def test_a_bare_small_quota_warns_with_what_it_means_and_how_to_write_cpus(quota):
    ls = loaded(f"    quota: {quota}\n")
    assert ls.spec.resources.cpu.quota == float(quota)  # still what it always meant
    (w,) = ls.warnings
    assert (w.file, w.line, w.field) == ("demo.yaml", 5, "resources.cpu.quota")
    n = float(quota)
    assert f"{n:g}% of one CPU" in w.message
    assert f"quota: {n * 100:g}%" in w.message and f"cpus: {n:g}" in w.message


@pytest.mark.parametrize("cpu", ["    quota: 1.5%\n", "    quota: 10\n", "    quota: 150\n",
                                 "    quota: '150%'\n", "    cpus: 1.5\n", "    weight: 5\n"])
def test_no_warning_when_the_unit_is_written_or_the_number_is_a_plausible_percent(cpu):
    assert loaded(cpu).warnings == ()


def test_validate_prints_the_warning_at_its_line_and_json_carries_it(capsys, tmp_path):
    (tmp_path / "a.yaml").write_text("name: a\nkind: cpu\nresources:\n  cpu:\n    quota: 1.5\n")
    code, out, err = run(capsys, "validate", str(tmp_path))
    assert code == 0 and out.startswith("ok: a")
    assert f"warning: {tmp_path}/a.yaml:5:5: resources.cpu.quota: quota 1.5 is 1.5% " in err
    code, out, _ = run(capsys, "validate", str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] is True
    (w,) = data["warnings"]
    assert (w["line"], w["field"]) == (5, "resources.cpu.quota") and "cpus: 1.5" in w["message"]


def test_validate_of_a_bad_spec_keeps_its_warnings(capsys, tmp_path):
    (tmp_path / "a.yaml").write_text("name: a\nkind: cpu\nresources:\n  cpu:\n    quota: 2\n"
                                     "  memory: {max: lots}\n")
    code, out, err = run(capsys, "validate", str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 2 and [p["field"] for p in data["problems"]] == ["resources.memory.max"]
    assert [w["field"] for w in data["warnings"]] == ["resources.cpu.quota"]
    assert "warning: " in err and "quota: 200%" in err


def test_plan_shows_the_warning_first(capsys, tmp_path):
    (tmp_path / "a.yaml").write_text("name: a\nkind: cpu\nresources:\n  cpu:\n    quota: 1.5\n")
    code, out, _ = run(capsys, "--config-dir", str(tmp_path), "plan", "a", "--json")
    assert code == 0
    first = json.loads(out)[0]["warnings"][0]
    assert first.startswith(f"{tmp_path}/a.yaml:5:5: resources.cpu.quota: quota 1.5 is 1.5%")


def test_a_bare_quota_below_the_kernels_minimum_is_an_error_that_comes_with_the_hint():
    exc = errors_of("name: demo\nkind: cpu\nresources:\n  cpu:\n    quota: 0.5\n")
    assert [p.field for p in exc.problems] == ["resources.cpu.quota"]
    assert "1000 µs minimum" in exc.problems[0].message
    (w,) = exc.warnings
    assert "cpus: 0.5" in w.message and "quota: 50%" in w.message


# ---------------------------------------------------------------- warnings once per command

NO_USERNS = "kind: cpu\nrootfs: {binaries: [sh]}\nruntime: {userns: false}\n"


def test_a_warning_several_environments_share_is_said_once_and_marked_apart_from_refusals(
        capsys, tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text(f"name: {name}\n{NO_USERNS}")
    code, out, _ = run(capsys, "--config-dir", str(tmp_path), "plan", "--all")
    assert code == 0
    lines = [line for line in out.splitlines() if "runtime.userns is false" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: runtime.userns is false")
    assert lines[0].endswith("(a, b)")
    assert not any(line.lstrip().startswith("! ") for line in out.splitlines())
    code, out, _ = run(capsys, "--config-dir", str(tmp_path), "plan", "--all", "--json")
    assert all(any("runtime.userns is false" in w for w in p["warnings"])
               for p in json.loads(out))  # --json: each environment's own, whole


def test_one_environments_warnings_stay_under_it(capsys, tmp_path):
    (tmp_path / "a.yaml").write_text(f"name: a\n{NO_USERNS}")
    (tmp_path / "b.yaml").write_text("name: b\nkind: cpu\n")
    code, out, _ = run(capsys, "--config-dir", str(tmp_path), "plan", "--all")
    assert code == 0 and "  warning: runtime.userns is false" in out and "(a" not in out


def test_warned_names_every_environment_of_each_warning_once():
    from envctl.cli import _warned

    assert _warned({"a": ["x", "y", "x"], "b": ["y"], "c": []}) == {"x": ["a"], "y": ["a", "b"]}


def test_status_of_an_environment_that_is_down_repeats_no_plan_warning(capsys, tmp_path):
    (tmp_path / "a.yaml").write_text(f"name: a\n{NO_USERNS}")
    code, out, _ = run(capsys, "--config-dir", str(tmp_path), "status")
    assert code == 0 and "a  down" in out and "userns" not in out
    code, out, _ = run(capsys, "--config-dir", str(tmp_path), "status", "--json")
    assert code == 0 and json.loads(out)[0]["warnings"] == []


def test_validate_host_says_what_plan_would_warn_about_here_once(capsys, tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text(f"name: {name}\n{NO_USERNS}")
    code, _, err = run(capsys, "validate", str(tmp_path))
    assert code == 0 and "userns" not in err  # the same on any machine: no plan, no warning
    code, _, err = run(capsys, "validate", "--host", str(tmp_path))
    lines = [line for line in err.splitlines() if "runtime.userns is false" in line]
    assert code == 0 and len(lines) == 1 and lines[0].startswith("warning: a, b: "), err
    code, out, _ = run(capsys, "validate", "--host", str(tmp_path), "--json")
    found = [w for w in json.loads(out)["warnings"] if "runtime.userns" in w["message"]]
    assert [w["file"].rsplit("/", 1)[-1] for w in found] == ["a.yaml", "b.yaml"]


def test_validate_host_reports_what_the_host_refuses_with_the_specs_own_errors(capsys, tmp_path):
    (tmp_path / "a.yaml").write_text("name: a\nkind: cpu\nresources:\n  memory: {max: lots}\n")
    (tmp_path / "b.yaml").write_text("name: b\nkind: cpu\nrootfs:\n"
                                     "  binaries: [sh, envctl-no-such-program]\n")
    code, out, _ = run(capsys, "validate", "--host", str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 2 and data["ok"] is False
    assert [(p["file"].rsplit("/", 1)[-1], p["line"], p["field"]) for p in data["problems"]] == [
        ("a.yaml", 4, "resources.memory.max"), ("b.yaml", 4, "rootfs.binaries[1]")]
    # A spec file named alone, while another in the config directory is wrong: both said.
    code, _, err = run(capsys, "--config-dir", str(tmp_path), "validate", "--host",
                       str(tmp_path / "b.yaml"))
    assert code == 2 and "a.yaml:4" in err and "envctl-no-such-program: not found" in err
    code, _, err = run(capsys, "--config-dir", str(tmp_path), "validate", "--host", "a")
    assert code == 2 and "a.yaml:4" in err and "no environment" not in err
