"""The queue's per-user bounds on the real kernel (issue #22): jobs.max_queued_per_user counts
a user's jobs in the environment, pending and running (Slurm's MaxSubmitJobs), and
jobs.max_staged_per_user the bytes their queued jobs' staged programs hold; a submit past
either is refused, exit 1, one line naming the limit, and leaves nothing (no record, no job
directory, no staged copy, no index line)."""

from __future__ import annotations

import os

import pytest

from tests.integration.test_jobs import script
from tests.integration.test_queue import GATE, open_gate, submit, up

pytestmark = pytest.mark.root


@pytest.fixture
def qbox(sandbox):
    yield sandbox
    if sandbox.proc.poll() is None:
        sandbox.envctl("down", "qbox", "--force")

SPEC = """
name: qbox
kind: cpu
rootfs:
  binaries: [sh, sleep, "true"]
resources:
  cpu: {dedicated: "0"}
  memory: {max: 64M}
jobs:
  max_running: 1
  max_queued_per_user: 3
  max_staged_per_user: 10K
"""


def _left(sb) -> set[str]:
    return set(os.listdir(sb.state / "jobs"))


def _index(sb) -> bytes:
    path = sb.state / "jobs" / ".queue" / "qbox"
    return path.read_bytes() if path.exists() else b""


def test_a_user_past_its_queued_jobs_or_staged_bytes_is_refused_and_nothing_is_left(qbox):
    sb = qbox
    sb.write_spec("qbox", SPEC)
    res = sb.envctl("up", "qbox")
    assert res.returncode == 0, res.stderr
    gate = script(sb, "gate.sh", GATE)
    big = script(sb, "big.sh", "#!/bin/sh\n" + "#" * 6000 + "\ntrue\n")
    first = submit(sb, gate)
    assert first["state"] == "RUNNING", first
    second = submit(sb, big)  # queued, 6 KB staged
    assert (second["state"], second["staged_bytes"]) == ("PENDING", os.path.getsize(big))
    before, index = _left(sb), _index(sb)
    res = sb.envctl("submit-job", "--user", "root", "qbox", big)  # 12 KB > 10K
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "jobs.max_staged_per_user (10K" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stdout == ""
    assert _left(sb) == before and _index(sb) == index
    # A program of the environment stages nothing: it is queued while jobs remain.
    third = submit(sb, "true")
    assert third["state"] == "PENDING", third
    before, index = _left(sb), _index(sb)
    res = sb.envctl("submit-job", "--user", "root", "qbox", "true")  # 1 running + 2 pending
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert ("root has 1 job(s) running and 2 pending in environment 'qbox', its "
            "jobs.max_queued_per_user (3)") in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert _left(sb) == before and _index(sb) == index
    # Once they end, the user may submit again.
    open_gate(sb, first["id"])
    res = sb.envctl("wait", str(first["id"]), str(second["id"]), str(third["id"]), timeout=300)
    assert res.returncode == 0, res.stderr
    assert submit(sb, big)["state"] in ("RUNNING", "COMPLETED")


def test_logs_of_a_pending_job_says_so_with_its_current_reason(qbox):
    sb = qbox
    up(sb, limit=1)
    gate = script(sb, "gate.sh", GATE)
    first = submit(sb, gate)
    second = submit(sb, "true")
    assert second["state"] == "PENDING", second
    res = sb.envctl("logs", str(second["id"]))
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert res.stderr.strip().splitlines() == [
        f"error: job {second['id']} is PENDING (MaxRunning): no output yet"], res.stderr
    open_gate(sb, first["id"])
    res = sb.envctl("wait", str(first["id"]), str(second["id"]), timeout=300)
    assert res.returncode == 0, res.stderr
    assert sb.envctl("logs", str(second["id"])).returncode == 0
