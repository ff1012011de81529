"""`envctl up --retry` (envctl-retry.service) on the real kernel: an environment `up --all`
skipped comes up by itself once its spec is fixed, within the window; one still broken when
the window closes is named (exit 1); one the operator took down is never brought back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.sandbox import FakeKmod, stderr_of

pytestmark = pytest.mark.root

GOOD = "name: late\nkind: cpu\n"
BROKEN = "name: late\nkind: cpu\nhost:\n  modules: [nvidia]\n"  # not on this host


@pytest.fixture
def late(sandbox, tmp_path):
    """`up --all` with `ok` up and `late` skipped (a kernel module this host lacks)."""
    env = FakeKmod(tmp_path / "kmod", {"bridge": []}).env()
    sandbox.write_spec("ok", "name: ok\nkind: cpu\n")
    sandbox.write_spec("late", BROKEN)
    res = sandbox.envctl("up", "--all", env=env)
    assert res.returncode == 1 and "skipped late" in res.stderr, res.stderr
    assert json.loads((sandbox.run_dir / "not-up.json").read_text())["envs"] == ["late"]
    yield sandbox, env
    sandbox.envctl("down", "--all", env=env)


def start_retry(sb, env, window: float) -> subprocess.Popen:
    cmd = ["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable, "-m", "envctl",
           "up", "--retry", "--window", str(window)]
    return subprocess.Popen(cmd, env=sb.env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 30) -> str:
    """Read proc's stderr until a line holds `text`; what was read."""
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
        if text in line:
            return seen
    raise AssertionError(f"no {text!r} from the retry:\n{seen}{stderr_of(proc)}")


def states(sb, env) -> dict[str, str]:
    return {e["env"]: e["state"] for e in sb.envctl_json("status", env=env)}


def test_a_spec_fixed_after_boot_comes_up_by_itself_within_the_window(late):
    sb, env = late
    proc = start_retry(sb, env, window=120)
    wait_for_line(proc, "retrying late in 2 s")  # the first try (after 1 s) failed
    sb.write_spec("late", GOOD)  # the operator fixes it; nobody runs `up`
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "every environment is up" in err
    assert states(sb, env) == {"late": "up", "ok": "up"}
    assert not (sb.run_dir / "not-up.json").exists()


def test_still_broken_when_the_window_closes_is_named(late):
    sb, env = late
    proc = start_retry(sb, env, window=2)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert err.strip().splitlines()[-1].startswith("still not up after 2 s: late"), err
    assert "late" not in sb.netns()


def test_an_environment_taken_down_is_not_brought_back(late):
    sb, env = late
    sb.envctl("down", "late", env=env, check=True)  # the operator gives up on it for now
    sb.write_spec("late", GOOD)
    res = sb.envctl("up", "--retry", "--window", "5", env=env)
    assert res.returncode == 0 and "nothing to retry" in res.stderr, res.stderr
    assert "late" not in states(sb, env) or states(sb, env)["late"] != "up"


def test_a_stop_ends_the_retry_cleanly_and_keeps_the_list(late):
    """`systemctl stop envctl` stops envctl-retry.service too (PartOf=): SIGTERM is a clean
    end (exit 0), not a failed unit, and what was not up still is on the list."""
    sb, env = late
    proc = start_retry(sb, env, window=120)
    wait_for_line(proc, "retrying late in 2 s")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "retry stopped (SIGTERM)" in err, err
    assert json.loads((sb.run_dir / "not-up.json").read_text())["envs"] == ["late"]
