"""Per-job slices on the real kernel: `submit-job --mem` is the job cgroup's own memory limit,
`--cpus N` gives CPUs no other job gets, `--gpus N` GPUs no other job gets and a device
allow-list (on the fake GPU host) that refuses the other GPUs' nodes with EPERM; what does not
fit now waits in the queue, PENDING (Resources), holding nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_gpu_env import fake_gpu_host, gpu_host  # noqa: F401 - a fixture
from tests.integration.test_jobs import assert_clean_down, box, script  # noqa: F401 - box

pytestmark = pytest.mark.root

CGROUP_ROOT = Path("/sys/fs/cgroup")


def submit(sb, env: str, *args: str, extra=None):
    return sb.envctl("submit-job", "--json", "--user", "root", env, *args, env=extra)


def started(res) -> dict:
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def pending(sb, res, reason: str = "Resources") -> dict:
    """The record of a job `submit-job` queued: PENDING with `reason`, holding nothing, and
    shown so by `envctl jobs`."""
    rec = started(res)
    assert (rec["state"], rec["queued"], rec["cpus"], rec["gpus"]) == ("PENDING", True, [], []), rec
    listed = {j["id"]: j for j in json.loads(sb.envctl("jobs", "--json").stdout)}
    assert listed[rec["id"]]["reason"] == reason, listed[rec["id"]]
    return rec


def job_file(sb, env: str, jid: int, controller: str, name: str) -> str:
    """A file of job `jid`'s cgroup on the host (v1 hierarchy `controller`, or v2)."""
    for top in (CGROUP_ROOT / controller, CGROUP_ROOT):
        path = top / sb.cgroup_parent / env / f"job-{jid}" / name
        if path.exists():
            return path.read_text().strip()
    raise AssertionError(f"no {name} for job {jid}")


def cancel_all(sb, *ids: int, extra=None) -> None:
    for jid in ids:
        assert sb.envctl("cancel", str(jid), "--grace", "0", env=extra).returncode == 0
    res = sb.envctl("wait", *map(str, ids), timeout=120, env=extra)
    assert res.returncode != 0 or res.returncode == 0  # waited for: every one has ended
    for jid in ids:
        rec = json.loads((sb.state / "jobs" / f"{jid}.json").read_text())
        assert rec["state"] == "CANCELLED", rec


def test_mem_is_the_jobs_own_memory_limit_and_shared_out_of_the_environments(box):  # noqa: F811
    sb = box
    hold = script(sb, "hold.sh", "#!/bin/sh\nexec sleep 600\n")
    before = sorted(p.name for p in (sb.state / "jobs").glob("*")) \
        if (sb.state / "jobs").exists() else []
    res = submit(sb, "box", "--mem", "128M", hold)
    assert res.returncode == 2 and "more than environment 'box''s memory limit" in res.stderr
    res = submit(sb, "box", "--mem", "lots", hold)
    assert res.returncode == 2 and "--mem 'lots'" in res.stderr, res.stderr
    after = sorted(p.name for p in (sb.state / "jobs").glob("*")) \
        if (sb.state / "jobs").exists() else []
    assert after == before  # no id taken, nothing made
    a = started(submit(sb, "box", "--mem", "40M", hold))
    assert a["mem_bytes"] == 40 << 20 and a["requested"] == {"mem": 40 << 20}
    assert int(job_file(sb, "box", a["id"], "memory", "memory.limit_in_bytes"
                        if (CGROUP_ROOT / "memory").is_dir() else "memory.max")) == 40 << 20
    waiting = pending(sb, submit(sb, "box", "--mem", "30M", hold))
    cancel_all(sb, waiting["id"])  # out of the queue: nothing waits ahead of the next
    b = started(submit(sb, "box", "--mem", "24M", hold))  # what is left fits
    # A job without --mem has no limit of its own: the environment's applies.
    c = started(submit(sb, "box", hold))
    assert c["mem_bytes"] is None
    cancel_all(sb, a["id"], b["id"], c["id"])
    # Ended, they hold nothing: the memory is free again.
    d = started(submit(sb, "box", "--mem", "64M", hold))
    listing = json.loads(sb.envctl("jobs", "--json").stdout)
    shown = {j["id"]: j for j in listing}[d["id"]]
    assert shown["mem_bytes"] == 64 << 20
    table = sb.envctl("jobs").stdout
    assert "MEM" in table.splitlines()[0] and "64M" in table, table
    cancel_all(sb, d["id"])
    assert_clean_down(sb)


def test_cpus_by_count_are_the_jobs_alone(box):  # noqa: F811
    sb = box
    hold = script(sb, "hold.sh", "#!/bin/sh\nexec sleep 600\n")
    a = started(submit(sb, "box", "--cpus", "1", hold))
    b = started(submit(sb, "box", "--cpus", "1", hold))
    assert (a["cpus"], a["cpus_exclusive"], b["cpus"]) == ([0], True, [1])
    assert job_file(sb, "box", a["id"], "cpuset", "cpuset.cpus") == "0"
    assert job_file(sb, "box", b["id"], "cpuset", "cpuset.cpus") == "1"
    # Neither a count, nor a list naming a CPU another job holds, nor no --cpus (none free)
    # fits: each waits (cancelled before the next, which would wait behind it: Priority).
    for ask in (["--cpus", "1"], ["--cpus", "1-1"], []):
        waiting = pending(sb, submit(sb, "box", *ask, hold))
        cancel_all(sb, waiting["id"])
    assert not (sb.state / "jobs" / f"{waiting['id']}").exists()  # its staged program: gone
    res = submit(sb, "box", "--cpus", "3", hold)
    assert res.returncode == 2 and "has 2 CPU(s)" in res.stderr, res.stderr
    cancel_all(sb, a["id"])
    c = started(submit(sb, "box", hold))  # no --cpus: what nobody holds alone
    assert (c["cpus"], c["cpus_exclusive"]) == ([0], False)
    assert job_file(sb, "box", c["id"], "cpuset", "cpuset.cpus") == "0"
    cancel_all(sb, b["id"], c["id"])
    assert_clean_down(sb)


GPU_SPEC = """
name: gpu-ab
kind: gpu
rootfs:
  binaries: [bash, sleep]
gpus: all
"""

PROBE = """#!/bin/bash
for n in nvidia0 nvidia1 nvidiactl nvidia-uvm nvidia-uvm-tools; do
  err=$( { exec 3<>/dev/$n; } 2>&1 )
  echo "$n ${err##*: }"
done
echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}"
"""


def test_a_job_opens_only_its_own_gpus_nodes(gpu_host):  # noqa: F811 - the fixture
    sb, env = gpu_host
    sb.write_spec("gpu-ab", GPU_SPEC)
    res = sb.envctl("up", "gpu-ab", env=env)
    assert res.returncode == 0, res.stderr
    hold = script(sb, "hold.sh", "#!/bin/bash\nexec sleep 600\n")
    probe = script(sb, "probe.sh", PROBE)
    uuids = json.loads(sb.envctl("jobs", "--json", env=env).stdout or "[]")  # none yet
    assert uuids == []
    a = started(submit(sb, "gpu-ab", "--gpus", "1", hold, extra=env))
    assert a["gpus_exclusive"] and len(a["gpus"]) == 1
    b = started(submit(sb, "gpu-ab", "--gpus", "1", "--wait", probe, extra=env))
    assert b["state"] == "COMPLETED" and b["gpus"] != a["gpus"], b
    out = Path(b["stdout"]).read_text().splitlines()
    # Job a holds GPU 0: EPERM from the job's own device list. Its own GPU 1 and the control
    # nodes pass the device rules (ENXIO: the fake nodes have no driver behind them).
    assert out == ["nvidia0 Operation not permitted", "nvidia1 No such device or address",
                   "nvidiactl No such device or address",
                   "nvidia-uvm No such device or address",
                   "nvidia-uvm-tools No such device or address",
                   f"CUDA_VISIBLE_DEVICES={b['gpus'][0]}"], out
    # Both held: a third is refused, naming who holds them.
    c_hold = started(submit(sb, "gpu-ab", "--gpus", "1", hold, extra=env))
    waiting = started(submit(sb, "gpu-ab", "--gpus", "1", hold, extra=env))
    assert (waiting["state"], waiting["reason"], waiting["gpus"]) == ("PENDING", "Resources", [])
    cancel_all(sb, waiting["id"], a["id"], c_hold["id"], extra=env)
    # Nobody holds a GPU: a job without --gpus is as before, every GPU's node opens.
    d = started(submit(sb, "gpu-ab", "--wait", probe, extra=env))
    out = Path(d["stdout"]).read_text().splitlines()
    assert out[:2] == ["nvidia0 No such device or address",
                       "nvidia1 No such device or address"], out
    assert out[-1] == "CUDA_VISIBLE_DEVICES=unset" or "," in out[-1], out
    assert sb.envctl("down", "gpu-ab", env=env).returncode == 0
    residue = sb.residue()
    assert residue.pop("state_dir", None) in (["jobs", "lock"], None), residue
    assert residue == {}, residue
