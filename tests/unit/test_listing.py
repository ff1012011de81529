"""`envctl list` without root: its columns from the specs alone (everything down), from a
journal whose spec is gone, the limits and ports read back from resources as journals hold
them, and its JSON keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envctl.listing import limits_of, ports_of
from tests.unit.test_cli import isolated, run  # noqa: F401 - isolated: autouse, here too

BOOT_FILE = Path("/proc/sys/kernel/random/boot_id")
JSON_KEYS = {"name", "state", "reasons", "address", "ports", "cpus", "memory", "limits", "gpus",
             "gpu_uuids", "gpus_wanted", "jobs", "description", "spec"}


@pytest.fixture(autouse=True)
def no_cgroups(monkeypatch):
    """test_cli's isolation (state, run and config directories), with a cgroup parent that
    does not exist: nothing of a journal's cgroup is there."""
    monkeypatch.setenv("ENVCTL_CGROUP_PARENT", "envctl-unit-listing-none")


def test_the_shipped_specs_are_listed_down_with_what_up_would_give_them(capsys):
    code, out, err = run(capsys, "list")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "ADDRESS", "PORTS", "CPUS", "MEMORY", "GPUS",
                                "JOBS", "DESCRIPTION"]
    cpu = next(x for x in lines if x.startswith("cpu-compute "))
    assert cpu.split()[1:4] == ["down", "10.200.0.21", "0.0.0.0:9090->9090/tcp"]
    assert "- / " in cpu and " 0/0 " in cpu  # nothing used yet; the limit it would get
    assert cpu.endswith("Dedicated-core CPU partition for batch and benchmark jobs")
    gpu = next(x for x in lines if x.startswith("gpu-compute "))
    assert "  all   0/0  " in gpu  # its spec asks for every GPU; none is held while down
    assert run(capsys, "ps")[1] == out  # the alias


def test_json_keys_are_stable(capsys):
    code, out, _ = run(capsys, "list", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert {"cpu-compute", "gpu-compute"} <= set(rows)
    for r in rows.values():
        assert set(r) == JSON_KEYS
        assert set(r["memory"]) == {"used", "limit"} and set(r["jobs"]) == {"running",
                                                                              "pending"}
    cpu = rows["cpu-compute"]
    assert cpu["state"] == "down" and cpu["memory"]["used"] is None
    assert cpu["cpus"]["quota"] == 15.0  # quota: 1500% of one CPU
    assert cpu["limits"]["pids_max"] == 16384
    assert cpu["ports"] == [{"host_address": "0.0.0.0", "host_port": 9090, "port": 9090,
                             "protocol": "tcp"}]


def test_an_unknown_name_is_exit_2(capsys):
    code, _, err = run(capsys, "list", "nosuch")
    assert code == 2 and "nosuch" in err


def _journal(state: Path, env: str, entries: list[tuple[str, dict, str]], claims: dict) -> None:
    boot = BOOT_FILE.read_text().strip() if BOOT_FILE.exists() else ""
    (state / "journal").mkdir(parents=True, exist_ok=True)
    data = {"version": 1, "log": 0, "meta": {"claims": claims},
            "entries": [{"key": k, "resource": r, "memo": {}, "status": st, "shared": False,
                         "boot": boot} for k, r, st in entries]}
    (state / "journal" / f"{env}.json").write_text(json.dumps(data))


def test_an_environment_known_only_from_its_journal_is_listed_with_what_is_wrong(
        capsys, tmp_path):
    cg = {"kind": "cgroup", "env": "orphan", "version": 1, "controllers": ["memory", "pids"],
          "parent": "envctl-unit-listing-none",
          "settings": [["memory", "memory.limit_in_bytes", str(96 << 20)],
                       ["pids", "pids.max", "50"]]}
    fw = {"kind": "firewall", "backend": "nftables", "env": "orphan", "address": "10.9.0.5",
          "bridge": "b0", "isolate": True, "nat": True, "ports": ["tcp:8443:443"],
          "subnet": "10.9.0.0/24"}
    _journal(tmp_path / "state", "orphan", [("cgroup:orphan", cg, "applied"),
                                            ("firewall:nftables:orphan", fw, "applying")],
             {"address": "10.9.0.5", "description": "left over"})
    code, out, err = run(capsys, "list", "--json")
    assert code == 0, err
    row = {r["name"]: r for r in json.loads(out)}["orphan"]
    assert row["state"] == "degraded" and row["spec"] is None
    assert row["reasons"] == [
        "left half done by a failed or interrupted `up`: firewall:nftables:orphan",
        "its cgroup is gone"]
    assert row["address"] == "10.9.0.5" and row["description"] == "left over"
    assert row["ports"][0]["host_port"] == 8443 and row["ports"][0]["port"] == 443
    assert row["memory"]["limit"] == 96 << 20
    code, out, _ = run(capsys, "list")
    assert "orphan: its cgroup is gone" in out  # why, under the table


def test_limits_read_back_from_each_driver():
    v1 = limits_of([{"kind": "cgroup", "settings": [
        ["cpu", "cpu.cfs_period_us", "100000"], ["cpu", "cpu.cfs_quota_us", "150000"],
        ["cpuset", "cpuset.cpus", "0-1"], ["memory", "memory.limit_in_bytes", "-1"],
        ["memory", "memory.soft_limit_in_bytes", str(1 << 30)], ["pids", "pids.max", "max"]]}])
    assert (v1.cpu_quota, v1.cpuset, v1.memory_max, v1.memory_high, v1.pids_max) == (
        1.5, "0-1", None, 1 << 30, None)
    v2 = limits_of([{"kind": "cgroup", "settings": [
        ["cpu", "cpu.max", "max 100000"], ["memory", "memory.max", str(10 << 30)],
        ["memory", "memory.high", "max"], ["pids", "pids.max", "16384"]]}])
    assert (v2.cpu_quota, v2.memory_max, v2.memory_high, v2.pids_max) == (
        None, 10 << 30, None, 16384)
    sd = limits_of([{"kind": "cgroup-slice", "properties": [
        ["CPUQuota", "250%"], ["AllowedCPUs", "2-5"], ["MemoryMax", str(8 << 30)],
        ["MemoryHigh", "infinity"], ["TasksMax", "infinity"]]}])
    assert (sd.cpu_quota, sd.cpuset, sd.memory_max, sd.memory_high, sd.pids_max) == (
        2.5, "2-5", 8 << 30, None, None)


def test_ports_come_from_the_firewall_rule_else_from_the_claims():
    fw = [{"kind": "firewall", "ports": ["udp:5353:53", "tcp:80:8080"]}]
    assert [str(p) for p in ports_of(fw, {})] == ["0.0.0.0:5353->53/udp",
                                                   "0.0.0.0:80->8080/tcp"]
    assert [str(p) for p in ports_of([], {"ports": ["tcp/9090"]})] == ["0.0.0.0:9090->9090/tcp"]


# ---------------------------------------------------------------- limits in words, states


def _spec(tmp: Path, text: str):
    from envctl.spec.loader import load_spec

    p = tmp / "x.yaml"
    p.write_text(text)
    return load_spec(p).spec


def test_limits_are_said_in_the_units_the_spec_used(tmp_path):
    from envctl.listing import spec_limits

    spec = _spec(tmp_path, "name: x\nkind: cpu\nresources:\n  cpu: {quota: 150%, weight: 100}\n"
                 "  memory: {max: 10G, high: 8G}\n  pids: {max: 16384}\n  io: {weight: 900}\n")
    assert spec_limits(spec, {"cpus": "0-1", "dedicated": False}) == (
        "cpu 150% of one CPU (1.5 CPUs) on 0-1, weight 100, memory 10G (high 8G), "
        "pids 16384, io weight 900")
    spec = _spec(tmp_path, "name: x\nkind: cpu\nresources:\n  cpu: {dedicated: [2, 3]}\n"
                 "  memory: {max: 70%}\n")
    assert spec_limits(spec, {"cpus": "2-3", "dedicated": True, "memory.max": 7 << 30}) == (
        "cpu no quota on 2-3 (dedicated), memory 70% of host = 7G")
    plain = _spec(tmp_path, "name: x\nkind: cpu\n")
    assert spec_limits(plain, {}) == "cpu no quota, memory no limit"


def test_a_cpus_count_is_said_as_cpus(tmp_path):
    """The Docker form (`cpus: 1.5`), where the model keeps it beside the quota."""
    from types import SimpleNamespace

    from envctl.listing import spec_limits

    spec = _spec(tmp_path, "name: x\nkind: cpu\nresources:\n  cpu: {quota: 150%}\n")
    cpu = SimpleNamespace(**{**vars(spec.resources.cpu), "cpus": 1.5})
    fake = SimpleNamespace(resources=SimpleNamespace(**{**vars(spec.resources), "cpu": cpu}))
    assert spec_limits(fake, {"cpus": "0-3"}).startswith("cpu 1.5 CPUs on 0-3, memory")


def test_applied_limits_for_a_spec_that_is_gone():
    from envctl.listing import Limits, applied_limits

    assert applied_limits(Limits(0.5, "0-1", 64 << 20, None, 100)) == (
        "cpu 0.5 CPUs on 0-1, memory 64M, pids 100")
    assert applied_limits(Limits()) == "cpu no quota, memory no limit"


def test_status_gives_the_same_state_words_as_list():
    from envctl.engine.engine import NOT_APPLIED, Step
    from envctl.listing import status_state
    from envctl.resources.base import Check, Diff, Status
    from envctl.resources.netns import NetNamespace
    from envctl.resources.sysctl import Sysctl

    ok = Step("=", NetNamespace("a"), Check.present())
    drifted = Step("~", Sysctl("a.b", "1"), Check(Status.DRIFTED, (Diff("value", "1", "0"),)))
    new = Step("+", NetNamespace("b"), Check.absent(), NOT_APPLIED)
    half = Step("=", NetNamespace("c"), Check.present(), "interrupted while applying")
    assert status_state([ok]) == "up"
    assert status_state([ok], "1 to change") == "not-applied"
    assert status_state([ok, new]) == "not-applied"
    assert status_state([ok, drifted]) == "degraded"
    assert status_state([ok, half]) == "degraded"
    assert status_state([new]) == "down"


def test_plan_heads_each_environment_with_its_limits(capsys):
    code, out, err = run(capsys, "plan", "cpu-compute")
    assert code == 0, err
    head = out.splitlines()[0]
    assert head.startswith("cpu-compute  cpu 15 CPUs on ")  # the shipped spec's `cpus: 15`
    assert "memory 70% of host = " in head and "pids 16384, io weight 900" in head
    code, out, _ = run(capsys, "plan", "cpu-compute", "--json")
    assert json.loads(out)[0]["limits"].startswith("cpu 15 CPUs on ")
    code, out, _ = run(capsys, "status", "cpu-compute")
    assert "limits       cpu 15 CPUs on " in out


def test_the_spec_digest_changes_with_what_the_spec_says_only(tmp_path):
    from envctl.listing import spec_digest

    base = "name: x\nkind: cpu\nresources:\n  memory: {max: 64M}\n"
    same = [base, "# why\n" + base, base + "description: ''\n",
            "kind: cpu\nname: x\nresources: {memory: {max: 67108864}}\n"]
    assert len({spec_digest(_spec(tmp_path, t)) for t in same}) == 1
    assert spec_digest(_spec(tmp_path, base.replace("64M", "65M"))) != spec_digest(
        _spec(tmp_path, base))


def test_a_damaged_journal_is_degraded_not_a_crash(capsys, tmp_path):
    (tmp_path / "state" / "journal").mkdir(parents=True)
    (tmp_path / "state" / "journal" / "broken.json").write_text("{not json")
    code, out, err = run(capsys, "list", "--json")
    assert code == 0, err
    row = {r["name"]: r for r in json.loads(out)}["broken"]
    assert row["state"] == "degraded" and row["reasons"][0].startswith("journal cannot be read")
