"""An attacker's review, round 2, of what issue #22 added after the daemon's first review
(tests/integration/test_attacks_daemon.py): the job queue (a queued job's outputs opened at
its start with the submitter's rights, its request file, cancel/wait of a PENDING job), the
operator's commands through the daemon, and per-job GPU slices. Each test makes one attempt
on the real kernel, in the sandbox's own mount namespace, with real users made for the test
(tests/integration/test_daemon.py's `team`: alice in access.submit, bob in nothing, carol in
access.operate) or on the fake GPU host (tests/integration/test_slices.py).

A test marked xfail(strict=True, reason="ATTACK: ...") is an attempt that succeeds today: it
asserts the safe behaviour. The others record attempts that are stopped and stay real threats.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.integration.test_daemon import (  # noqa: F401 (team: a fixture)
    ALICE,
    BOB,
    CAROL,
    SPEC,
    _job,
    _wait_for,
    team,
)
from tests.integration.test_gpu_env import gpu_host  # noqa: F401 (a fixture)
from tests.integration.test_jobs import script
from tests.integration.test_slices import GPU_SPEC, PROBE, cancel_all, started, submit

pytestmark = pytest.mark.root

FOREVER = "import time\ntime.sleep(3600)\n"


def _one_at_a_time(t) -> None:
    """box with jobs.max_running: 1, brought up again as root."""
    t.sb.write_spec("box", SPEC + "jobs:\n  max_running: 1\n")
    res = t.sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr


def _record(t, jid: int) -> dict:
    return json.loads((t.sb.state / "jobs" / f"{jid}.json").read_text())


def _ended(t, jid: int) -> dict:
    return _wait_for(lambda: (r := _record(t, jid))["state"] not in ("PENDING", "RUNNING")
                     and r, f"job {jid} to end", timeout=120)


def test_another_users_pending_job_cannot_be_cancelled_waited_for_or_read(team):  # noqa: F811
    """bob (in no list) on alice's PENDING job: cancel, wait and logs are refused, one line,
    and the job stays queued; `jobs` shows him what squeue would (no argv, outputs). carol,
    an operator of box, may cancel it."""
    _one_at_a_time(team)
    prog = team.script(ALICE, "forever.py", FOREVER)
    first = _job(team.as_user(ALICE, "submit-job", "--json", "box", prog))
    queued = _job(team.as_user(ALICE, "submit-job", "--json", "box", prog))
    assert (first["state"], queued["state"]) == ("RUNNING", "PENDING"), (first, queued)
    try:
        for cmd in (["cancel"], ["wait"], ["logs"]):
            res = team.as_user(BOB, *cmd, str(queued["id"]))
            assert res.returncode == 1 and "bob may not" in res.stderr, (cmd, res.stderr)
            assert res.stderr.count("\n") == 1, res.stderr
        assert _record(team, queued["id"])["state"] == "PENDING"
        res = team.as_user(BOB, "jobs", "--json")
        assert res.returncode == 0, res.stderr
        other = {j["id"]: j for j in json.loads(res.stdout)}[queued["id"]]
        assert (other["state"], other["argv"], other.get("stdout", "")) == ("PENDING", [], "")
        res = team.as_user(CAROL, "cancel", str(queued["id"]))
        assert res.returncode == 0, res.stderr
        assert _record(team, queued["id"])["state"] == "CANCELLED"
    finally:
        team.as_user(ALICE, "cancel", "--grace", "0", str(first["id"]))
        _ended(team, first["id"])


@pytest.mark.parametrize("swap", ["symlink", "fifo"])
def test_a_queued_jobs_output_swapped_before_its_start(team, swap):  # noqa: F811
    """alice names --output FILE for a job that waits in the queue, then, before it starts,
    replaces FILE with a symlink to a root file (so that the start, run by root, would
    truncate it) or with a FIFO (so that the start would hang the queue). The start opens the
    path with alice's rights and O_NOFOLLOW|O_NONBLOCK: the job ends FAILED, never started,
    the root file is untouched, and the queue moves on (the next job runs)."""
    _one_at_a_time(team)
    victim = team.shared / "victim"
    victim.write_text("root's\n")
    victim.chmod(0o666)  # even one alice could write: root must not follow her link to it
    hold = team.script(ALICE, "forever.py", FOREVER)
    hi = team.script(ALICE, "hi.py", "print('hi')\n")
    out = team.shared / str(ALICE) / "out.txt"
    first = _job(team.as_user(ALICE, "submit-job", "--json", "box", hold))
    swapped = _job(team.as_user(ALICE, "submit-job", "--json", "-o", str(out), "box", hi))
    after = _job(team.as_user(ALICE, "submit-job", "--json", "box", hi))
    assert (swapped["state"], after["state"]) == ("PENDING", "PENDING")
    out.unlink()
    if swap == "symlink":
        out.symlink_to(victim)
        os.lchown(out, ALICE, ALICE)
    else:
        os.mkfifo(out)
        os.chown(out, ALICE, ALICE)
    team.as_user(ALICE, "cancel", "--grace", "0", str(first["id"]))
    rec = _ended(team, swapped["id"])
    assert (rec["state"], rec["start_time"]) == ("FAILED", None), rec
    assert "could not be started" in rec["error"], rec
    assert victim.read_text() == "root's\n"
    assert _ended(team, after["id"])["state"] == "COMPLETED"


def test_an_operator_of_one_environment_cannot_act_on_another(team, tmp_path):  # noqa: F811
    """carol operates box only. `down other` (other's spec lists nobody), `status` with no
    name (every environment), and a spec directory of her own (ENVCTL_CONFIG_DIR, whose
    `other` lists her) are all refused; other's state is unchanged."""
    team.sb.write_spec("other", SPEC.replace("name: box", "name: other")
                       .replace("users: [carol]", "users: [alice]"))
    res = team.sb.envctl("up", "other")
    assert res.returncode == 0, res.stderr
    try:
        mine = team.shared / "carol-specs"
        mine.mkdir()
        (mine / "other.yaml").write_text(SPEC.replace("name: box", "name: other"))
        os.chown(mine, CAROL, CAROL)
        for args, extra in ((["down", "other"], {}),
                            (["down", "other"], {"ENVCTL_CONFIG_DIR": str(mine)}),
                            (["status"], {})):
            res = team.sb.run(*team.argv(CAROL, *args),
                              env={"ENVCTL_SOCKET": team.socket, "HOME": "/", **extra},
                              timeout=60)
            assert res.returncode in (1, 2) and res.stderr.count("\n") == 1, (args, res.stderr)
        assert (team.sb.state / "journal" / "other.json").exists()
    finally:
        assert team.sb.envctl("down", "other", "--force").returncode == 0


GATED_PROBE = "#!/bin/bash\nwhile [ ! -e /job/go ]; do sleep 0.05; done\n" + PROBE[12:]


def test_an_exclusive_gpu_is_closed_to_a_job_that_started_before_it(gpu_host):  # noqa: F811
    """ATTACK (fixed): a job started without --gpus holds every GPU's node (its cgroup's
    device list is the environment's, never narrowed while it runs); a later `--gpus 1` job
    was given one of them as its own, and the first job could still open it. Now a count
    takes only GPUs no active job can open: the later job waits (Resources)."""
    sb, env = gpu_host
    sb.write_spec("gpu-ab", GPU_SPEC)
    res = sb.envctl("up", "gpu-ab", env=env)
    assert res.returncode == 0, res.stderr
    probe = script(sb, "probe.sh", GATED_PROBE)
    hold = script(sb, "hold.sh", "#!/bin/bash\nexec sleep 600\n")
    early = started(submit(sb, "gpu-ab", probe, extra=env))  # no --gpus: every GPU
    assert early["state"] == "RUNNING" and len(early["gpus"]) == 2, early
    late = started(submit(sb, "gpu-ab", "--gpus", "1", hold, extra=env))
    try:
        if late["state"] == "RUNNING":
            (gpu,) = late["gpus"]
            minor = early["gpus"].index(gpu)  # the fake host's minors follow the UUIDs' order
            (sb.state / "jobs" / str(early["id"]) / "go").write_text("")
            res = sb.envctl("wait", str(early["id"]), timeout=120, env=env)
            assert res.returncode == 0, res.stderr
            lines = Path(early["stdout"]).read_text().splitlines()
            assert f"nvidia{minor} Operation not permitted" in lines, (late, lines)
        else:  # or it waits until the GPU is no other job's
            assert (late["state"], late["reason"]) == ("PENDING", "Resources"), late
    finally:
        cancel_all(sb, *(j["id"] for j in (early, late)
                         if _state(sb, j["id"]) in ("PENDING", "RUNNING")), extra=env)
        assert sb.envctl("down", "gpu-ab", env=env).returncode == 0


def _state(sb, jid: int) -> str:
    return json.loads((sb.state / "jobs" / f"{jid}.json").read_text())["state"]


# ESCAPE (fixed): `envctl exec` ran with the environment's whole device list and opened the
# node of a GPU another job holds exclusively (`--gpus 1`). (An exec is still counted by
# neither the queue nor max_running: it is a session, not a job.)
def test_an_exec_cannot_open_a_gpu_another_job_holds(gpu_host):  # noqa: F811
    sb, env = gpu_host
    sb.write_spec("gpu-ab", GPU_SPEC)
    res = sb.envctl("up", "gpu-ab", env=env)
    assert res.returncode == 0, res.stderr
    hold = script(sb, "hold.sh", "#!/bin/bash\nexec sleep 600\n")
    holder = started(submit(sb, "gpu-ab", "--gpus", "1", hold, extra=env))
    try:
        assert holder["state"] == "RUNNING" and holder["gpus_exclusive"], holder
        res = sb.envctl("exec", "--user", "root", "gpu-ab", "--", "bash", "-c",
                        PROBE.split("\n", 1)[1], env=env, timeout=120)
        assert res.returncode == 0, res.stderr
        # The fake host's UUIDs are in minor order; the holder has the first free: GPU 0.
        assert "nvidia0 Operation not permitted" in res.stdout.splitlines(), res.stdout
    finally:
        cancel_all(sb, holder["id"], extra=env)
        assert sb.envctl("down", "gpu-ab", env=env).returncode == 0
