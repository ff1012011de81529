"""The engine on the real kernel: up/down idempotence, rollback, kill -9, locking, drift."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.integration.sandbox import stderr_of

pytestmark = pytest.mark.root

SPEC = """\
name: alpha
kind: cpu
network:
  bridge: t-br0
  bridge_address: 10.231.0.1/24
  address: 10.231.0.2
host:
  sysctls:
    net.ipv4.ip_forward: 1
    net.ipv4.ip_local_port_range: "20000 30000"
    vm.zone_reclaim_mode: {value: 1, policy: best-effort}
"""


def plan_keys(sb, env="alpha"):
    return [s["key"] for s in sb.envctl_json("plan", env)[0]["steps"]]


@pytest.fixture
def alpha(sandbox):
    sandbox.write_spec("alpha", SPEC)
    sandbox.set_sysctl("net.ipv4.ip_forward", "0")
    sandbox.set_sysctl("net.ipv4.ip_local_port_range", "'32768 60999'")
    sandbox.set_sysctl("vm.zone_reclaim_mode", "0")
    return sandbox


def host_values(sb):
    return (sb.sysctl("net.ipv4.ip_forward"), sb.sysctl("net.ipv4.ip_local_port_range"),
            sb.sysctl("vm.zone_reclaim_mode"))


ORIGINAL = ("0", "32768\t60999", "0")
CHANGED = ("1", "20000\t30000", "1")


def test_up_down_three_times_each_is_idempotent(alpha):
    for _ in range(3):
        alpha.envctl("up", "alpha", check=True)
        assert alpha.netns() == ["alpha"]
        assert host_values(alpha) == CHANGED
    status = alpha.envctl_json("status", "alpha")[0]
    assert {s["status"] for s in status["steps"]} == {"ok"}
    for _ in range(3):
        alpha.envctl("down", "alpha", check=True)
        assert host_values(alpha) == ORIGINAL
    assert alpha.residue() == {}


def test_values_already_equal_are_kept_and_restored(alpha):
    alpha.set_sysctl("net.ipv4.ip_forward", "1")
    alpha.envctl("up", "alpha", check=True)
    alpha.envctl("down", "alpha", check=True)
    assert alpha.sysctl("net.ipv4.ip_forward") == "1"
    assert alpha.residue() == {}


@pytest.mark.parametrize("point", ["before", "apply", "after"])
def test_fault_at_every_step_rolls_back_to_zero_residue(alpha, point):
    keys = plan_keys(alpha)
    assert len(keys) >= 5
    for i, key in enumerate(keys):
        res = alpha.envctl("up", "alpha", env={"ENVCTL_FAULT": f"fail@{point}:#{i}"})
        assert res.returncode == 1, res.stderr
        assert "step '" in res.stderr and "injected fault" in res.stderr
        assert host_values(alpha) == ORIGINAL, key
        assert alpha.residue() == {}, key


def test_failure_keeps_what_earlier_runs_made(alpha):
    alpha.envctl("up", "alpha", check=True)
    alpha.run("ip", "netns", "delete", "alpha", check=True)  # drift: the namespace is gone
    res = alpha.envctl("up", "alpha", env={"ENVCTL_FAULT": "fail@after:netns:*"})
    assert res.returncode == 1
    # The sysctls and dirs came from the earlier run: rollback does not take them back.
    assert host_values(alpha) == CHANGED
    alpha.envctl("up", "alpha", check=True)
    assert alpha.netns() == ["alpha"]
    alpha.envctl("down", "alpha", check=True)
    assert alpha.residue() == {}


@pytest.mark.parametrize("point", ["before", "apply", "after"])
def test_kill_9_at_every_step_then_down_leaves_nothing(alpha, point):
    keys = plan_keys(alpha)
    for i, key in enumerate(keys):
        res = alpha.envctl("up", "alpha", env={"ENVCTL_FAULT": f"kill@{point}:#{i}"})
        assert res.returncode == -9, (key, res.stderr)
        alpha.envctl("down", "alpha", check=True)
        assert host_values(alpha) == ORIGINAL, key
        assert alpha.residue() == {}, key


@pytest.mark.parametrize("point", ["apply", "after"])
def test_kill_9_then_up_converges(alpha, point):
    keys = plan_keys(alpha)
    res = alpha.envctl("up", "alpha", env={"ENVCTL_FAULT": f"kill@{point}:#{len(keys) - 1}"})
    assert res.returncode == -9
    alpha.envctl("up", "alpha", check=True)
    status = alpha.envctl_json("status", "alpha")[0]
    assert {s["status"] for s in status["steps"]} == {"ok"}
    alpha.envctl("down", "alpha", check=True)
    assert host_values(alpha) == ORIGINAL
    assert alpha.residue() == {}


def test_down_failing_halfway_keeps_the_rest_for_a_retry(alpha):
    alpha.envctl("up", "alpha", check=True)
    res = alpha.envctl("down", "alpha", env={"ENVCTL_FAULT": "fail@remove:netns:*"})
    assert res.returncode == 1
    assert alpha.netns() == ["alpha"]  # the failed step stays
    assert host_values(alpha) == ORIGINAL  # the others were undone
    assert alpha.journals() == ["alpha.json"]
    alpha.envctl("down", "alpha", check=True)
    assert alpha.residue() == {}


def test_kill_9_during_down_then_down_again(alpha):
    alpha.envctl("up", "alpha", check=True)
    res = alpha.envctl("down", "alpha", env={"ENVCTL_FAULT": "kill@remove:#2"})
    assert res.returncode == -9
    alpha.envctl("down", "alpha", check=True)
    assert host_values(alpha) == ORIGINAL
    assert alpha.residue() == {}


def test_two_concurrent_ups_serialize(alpha, tmp_path):
    go = tmp_path / "go"
    first = alpha.popen(sys.executable, "-m", "envctl", "up", "alpha",
                        env={"ENVCTL_FAULT": f"until={go}@apply:netns:*"})
    try:
        # The first holds the lock, stopped mid-plan (its journal exists) until `go` exists.
        wait_for("the first envctl to journal a step", alpha.journals, first)
        second = alpha.popen(sys.executable, "-m", "envctl", "up", "alpha")
        line = second.stderr.readline()  # its first word: it found the lock taken
        assert "waiting for another envctl" in line, line + stderr_of(second)
    finally:
        go.touch()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    out2, err2 = second.communicate(timeout=120)
    assert second.returncode == 0, err2
    # The second run found everything made by the first: nothing left to create.
    assert "0 created" in out2
    alpha.envctl("down", "alpha", check=True)
    assert alpha.residue() == {}


def wait_for(what, predicate, proc, timeout=60.0):
    """Wait until `predicate()` holds; fail with the child's stderr if it died first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"envctl exited {proc.returncode} before {what}:\n{proc.stderr.read()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_drift_is_reported_and_repaired(alpha):
    alpha.envctl("up", "alpha", check=True)
    alpha.set_sysctl("net.ipv4.ip_forward", "0")
    alpha.run("ip", "netns", "delete", "alpha", check=True)
    status = alpha.envctl_json("status", "alpha")[0]
    by_key = {s["key"]: s["status"] for s in status["steps"]}
    assert by_key["sysctl:net.ipv4.ip_forward"] == "drifted"
    assert by_key["netns:alpha"] == "missing"
    assert alpha.envctl("status", "alpha", "--check").returncode == 1
    plan = alpha.envctl_json("plan", "alpha")[0]
    ops = {s["key"]: s["op"] for s in plan["steps"]}
    assert ops["sysctl:net.ipv4.ip_forward"] == "~" and ops["netns:alpha"] == "+"
    alpha.envctl("up", "alpha", check=True)
    assert alpha.envctl("status", "alpha", "--check").returncode == 0
    alpha.envctl("down", "alpha", check=True)
    assert host_values(alpha) == ORIGINAL
    assert alpha.residue() == {}


def test_spec_change_removes_what_is_no_longer_wanted(alpha):
    alpha.envctl("up", "alpha", check=True)
    alpha.write_spec("alpha", SPEC.replace('    net.ipv4.ip_local_port_range: "20000 30000"\n', ""))
    plan = alpha.envctl_json("plan", "alpha")[0]
    assert any(s["op"] == "-" and s["key"] == "sysctl:net.ipv4.ip_local_port_range"
               for s in plan["steps"])
    alpha.envctl("up", "alpha", check=True)
    assert alpha.sysctl("net.ipv4.ip_local_port_range") == "32768\t60999"
    alpha.envctl("down", "alpha", check=True)
    assert host_values(alpha) == ORIGINAL
    assert alpha.residue() == {}


def test_down_works_after_the_spec_is_deleted(alpha):
    alpha.envctl("up", "alpha", check=True)
    (alpha.config_dir / "alpha.yaml").unlink()
    alpha.envctl("down", "alpha", check=True)
    assert host_values(alpha) == ORIGINAL
    assert alpha.residue() == {}


def test_shared_sysctl_restored_when_the_last_holder_goes(alpha):
    alpha.write_spec("beta", SPEC.replace("alpha", "beta").replace("10.231.0.2", "10.231.0.3"))
    alpha.envctl("up", "alpha", check=True)
    alpha.envctl("up", "beta", check=True)
    alpha.envctl("down", "alpha", check=True)
    assert host_values(alpha) == CHANGED  # beta still wants them
    plan = alpha.envctl_json("plan", "--down", "beta")[0]
    assert {s["op"] for s in plan["steps"]} == {"-"}
    alpha.envctl("down", "beta", check=True)
    assert host_values(alpha) == ORIGINAL
    assert alpha.residue() == {}


def test_conflicting_sysctl_values_refused_before_any_change(alpha):
    alpha.write_spec("beta", SPEC.replace("alpha", "beta").replace("10.231.0.2", "10.231.0.3")
                     .replace("ip_forward: 1", "ip_forward: 0"))
    res = alpha.envctl("up", "alpha")
    assert res.returncode == 2
    assert "beta.yaml" in res.stderr and "net.ipv4.ip_forward" in res.stderr
    assert host_values(alpha) == ORIGINAL
    assert alpha.residue() == {}


def test_up_json_reports_each_step(alpha):
    out = json.loads(alpha.envctl("up", "alpha", "--json", check=True).stdout)
    assert out[0]["env"] == "alpha"
    assert {s["op"] for s in out[0]["steps"]} <= {"+", "~", "="}
    alpha.envctl("down", "--all", check=True)
    assert alpha.residue() == {}
