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
    assert text.endswith(b" to a fifo\n") is False  # its EPIPE note went to the cut pipe too
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
    # The split is the kernel's, in ticks on v1 (cpuacct.stat) or exact: about the total.
    assert abs(user + system - total) < 0.1 + 0.05 * total, (user, system, total)
    assert done["elapsed"] >= 0.8 and done["peak_memory_bytes"] > 0
    res = sb.envctl("jobs", "--all", "--json")
    listed = {r["id"]: r for r in json.loads(res.stdout)}
    assert listed[j["id"]]["cpu_user_seconds"] == user
    row = sb.envctl("jobs", "--all", "--format", "id,cpu_user,cpu_sys,maxrss").stdout
    assert row.splitlines()[0].split() == ["ID", "USERCPU", "SYSCPU", "MAXRSS"]
    assert_clean_down(sb)
