"""A job's output bound (jobs.max_output) and its accounting, on the real kernel: past the bound
the file holds the bound and one line saying so, the job's next write gets EPIPE, and the record
says the output was cut; an unbounded environment's job writes its file itself; a finished
job's record carries its CPU time split user/system, as `jobs --format` shows it."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.integration.test_jobs import assert_clean_down, record, script, submit, wait

pytestmark = pytest.mark.root

SPEC = """
name: box
kind: cpu
rootfs:
  binaries: [sh, python3]
  python: true
resources:
  memory: {max: 128M}
jobs:
  max_output: %s
"""

# Writes N bytes to stdout in 64K chunks; says on stderr what it got (and what stdout is).
WRITER = """\
import errno, os, stat, sys
kind = "fifo" if stat.S_ISFIFO(os.fstat(1).st_mode) else "file"
total = int(sys.argv[1])
done = 0
try:
    while done < total:
        n = min(65536, total - done)
        os.write(1, b"x" * n)
        done += n
    note = f"wrote {done} to a {kind}\\n"
except OSError as exc:
    note = f"{errno.errorcode[exc.errno]} after {done} to a {kind}\\n"
try:
    os.write(2, note.encode())
except OSError:  # its stderr is the same cut pipe
    pass
"""


def up(sb, bound: str) -> None:
    sb.write_spec("box", SPEC % bound)
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr


@pytest.fixture
def bounded(sandbox):
    up(sandbox, "1M")
    yield sandbox
    if sandbox.proc.poll() is None:
        sandbox.envctl("down", "box", "--force")


def test_output_past_the_bound_is_cut_the_job_gets_epipe_and_the_record_says_so(bounded):
    sb = bounded
    prog = script(sb, "writer.py", WRITER, 0o644)
    j = submit(sb, prog, str(3 << 20))
    rc, (done,) = wait(sb, j["id"])
    assert rc == 0 and done["state"] == "COMPLETED", Path(done["stderr"]).read_text()
    data = Path(done["stdout"]).read_bytes()
    line = b"\nenvctl: output truncated at 1048576 bytes (jobs.max_output)\n"
    assert data[:1 << 20] == b"x" * (1 << 20) and data[1 << 20:] == line
    err = Path(done["stderr"]).read_text()
    assert err.startswith("EPIPE after ") and err.endswith(" to a fifo\n"), err
    # Told at its next write once the pipe was closed: at most one pipe's worth beyond.
    assert (1 << 20) <= int(err.split()[2]) < (3 << 20)
    assert done["output_truncated"] == ["stdout"] == record(sb, j["id"])["output_truncated"]
    shown = sb.envctl("jobs", "--all", "--format", "id,state,truncated").stdout.split()
    assert shown == ["ID", "STATE", "TRUNCATED", str(j["id"]), "COMPLETED", "stdout"]
    # Up to the bound exactly: nothing is cut, and stdout and stderr are bounded apart.
    k = submit(sb, prog, str(1 << 20))
    rc, (whole,) = wait(sb, k["id"])
    assert rc == 0 and whole["output_truncated"] == []
    assert Path(whole["stdout"]).read_bytes() == b"x" * (1 << 20)
    assert Path(whole["stderr"]).read_text() == f"wrote {1 << 20} to a fifo\n"
    # One file for both: one bound, shared, and the supervisor's line lands in it once.
    both = sb.root / "both.log"
    m = submit(sb, "-o", str(both), "-e", str(both), prog, str(2 << 20))
    rc, (one,) = wait(sb, m["id"])
    assert rc == 0 and one["output_truncated"] == ["stdout"]
    text = both.read_bytes()
    assert text.count(line) == 1 and text.startswith(b"x" * (1 << 20) + line)
    assert not text.endswith(b" to a fifo\n")  # its note went into the cut pipe too: lost
    logs = sb.envctl("logs", str(j["id"]))
    assert logs.returncode == 0 and logs.stdout.encode() == data
    assert_clean_down(sb)


def test_an_unbounded_job_writes_its_file_itself(sandbox):
    up(sandbox, "none")
    sb = sandbox
    try:
        prog = script(sb, "writer.py", WRITER, 0o644)
        j = submit(sb, prog, str(2 << 20))
        rc, (done,) = wait(sb, j["id"])
        assert rc == 0 and done["output_truncated"] == []
        assert os.path.getsize(done["stdout"]) == 2 << 20
        assert Path(done["stderr"]).read_text() == f"wrote {2 << 20} to a file\n"
        assert stat.S_ISREG(os.stat(done["stdout"]).st_mode)
        assert_clean_down(sb)
    finally:
        if sb.proc.poll() is None:
            sb.envctl("down", "box", "--force")


BURN = """\
import os
# Until the kernel itself counts 0.4 s of each (os.times: the split the cgroup sums up).
x = 0
while os.times().user < 0.4:
    x += 1
fd = os.open("/dev/zero", os.O_RDONLY)
while os.times().system < 0.4:  # the kernel zero-fills
    os.read(fd, 1 << 20)
"""


def test_a_finished_job_carries_its_cpu_time_split_user_and_system(bounded):
    sb = bounded
    prog = script(sb, "burn.py", BURN, 0o644)
    j = submit(sb, prog)
    rc, (done,) = wait(sb, j["id"])
    assert rc == 0, Path(done["stderr"]).read_text()
    user, system, total = (done[k] for k in ("cpu_user_seconds", "cpu_system_seconds",
                                             "cpu_seconds"))
    assert user >= 0.35 and system >= 0.35, (user, system, total)
    # The split is the kernel's, sampled at ticks on v1 (cpuacct.usage_user/_sys, or
    # cpuacct.stat) while the total is exact: about the total, further off on a loaded VM
    # (a fresh-clone run with four suites beside it: 0.47 + 1.26 against 1.49).
    assert abs(user + system - total) < 0.15 + 0.25 * total, (user, system, total)
    assert done["elapsed"] >= 0.8 and done["peak_memory_bytes"] > 0
    res = sb.envctl("jobs", "--all", "--json")
    listed = {r["id"]: r for r in json.loads(res.stdout)}
    assert listed[j["id"]]["cpu_user_seconds"] == user
    row = sb.envctl("jobs", "--all", "--format", "id,cpu_user,cpu_sys,maxrss").stdout
    assert row.splitlines()[0].split() == ["ID", "USERCPU", "SYSCPU", "MAXRSS"]
    assert_clean_down(sb)


# ---------------------------------------------------------------- a GPU job (the fake GPU host)

from tests.integration.test_gpu_env import UUIDS, gpu_host  # noqa: E402, F401 - a fixture

GPU_SPEC = """
name: gpu-ab
kind: gpu
rootfs:
  binaries: [bash, sleep, test]
gpus: all
"""


def _replace(path: Path, cfg: dict) -> None:
    """Write the fake NVML's file atomically: the supervisor reads it at every call."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg))
    os.replace(tmp, path)


def _until(predicate, timeout: float = 30.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_gpu_job_carries_gpu_seconds_sampled_peak_memory_and_energy(gpu_host):  # noqa: F811
    sb, env = gpu_host
    nvml_path = Path(env["FAKE_NVML_JSON"])
    cfg = json.loads(nvml_path.read_text())
    cfg["live"] = True
    for g in cfg["gpus"]:
        g["processes"], g["energy"] = [], 1_000_000
    _replace(nvml_path, cfg)
    env = {**env, "ENVCTL_JOB_GPU_SAMPLE": "0.1"}
    sb.write_spec("gpu-ab", GPU_SPEC)
    assert sb.envctl("up", "gpu-ab", env=env).returncode == 0
    hold = script(sb, "hold.sh", "#!/bin/bash\nwhile ! test -e /job/go; do sleep 0.05; done\n")
    res = sb.envctl("submit-job", "--json", "--user", "root", "gpu-ab", "--gpus", "1", hold,
                    env=env)
    assert res.returncode == 0, res.stderr
    j = json.loads(res.stdout)
    mine = UUIDS.index(j["gpus"][0])
    procs = (Path("/sys/fs/cgroup/cpuacct") / sb.cgroup_parent / "gpu-ab" / f"job-{j['id']}"
             / "cgroup.procs")
    if not procs.exists():
        procs = Path("/sys/fs/cgroup") / sb.cgroup_parent / "gpu-ab" / f"job-{j['id']}" \
            / "cgroup.procs"
    pid = int(procs.read_text().split()[0])
    # NVML now sees the job's process using 3 GiB of its GPU, and a stranger 5 GiB (and the
    # job's pid on the other GPU, not its: never counted).
    cfg["gpus"][mine].update(processes=[[pid, 3 << 30], [1, 5 << 30]])
    cfg["gpus"][1 - mine].update(processes=[[pid, 7 << 30]])
    _replace(nvml_path, cfg)
    # A new peak is in the record while the job runs (its start energy was read before).
    assert _until(lambda: record(sb, j["id"]).get("gpu_peak_memory_bytes") == 3 << 30), \
        record(sb, j["id"])
    # The counters move by 12.5 J on its GPU (and 99 J on the other).
    cfg["gpus"][mine].update(processes=[], energy=1_012_500)
    cfg["gpus"][1 - mine].update(energy=1_099_000)
    _replace(nvml_path, cfg)
    (Path(sb.state) / "jobs" / str(j["id"]) / "go").touch()
    rc, (done,) = wait(sb, j["id"])
    assert rc == 0 and done["state"] == "COMPLETED", done
    assert done["gpu_energy_joules"] == 12.5 and done["gpu_peak_memory_bytes"] == 3 << 30
    assert done["gpu_usage"] == {j["gpus"][0]: {"energy_mj": 12_500,
                                                "peak_memory_bytes": 3 << 30}}
    assert done["gpu_seconds"] == round(done["elapsed"], 3) and done["gpu_note"] is None
    row = sb.envctl("jobs", "--all", "--format", "id,gpus,gpu_mem,energy_j", env=env).stdout
    assert row.splitlines()[1].split() == [str(j["id"]), "1", "3G", "12.5"]
    assert sb.envctl("down", "gpu-ab", env=env).returncode == 0
