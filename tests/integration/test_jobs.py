"""The job system end to end through the CLI, on the real kernel: `submit-job` stages a program
and a detached supervisor runs it; each way a job can end lands in its state (COMPLETED,
FAILED with a code or a signal, TIMEOUT, CANCELLED, OUT_OF_MEMORY from the cgroup's OOM
counter); the job's cgroup is gone afterwards; a killed supervisor leaves a LOST job and no
process; `down` refuses while jobs run and `down --force` cancels them; 200 jobs in a row leave
no supervisor, cgroup, mount or namespace behind."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

SPEC = """
name: box
kind: cpu
rootfs:
  binaries: [sh, cat, sleep, "true", python3]
  python: true
resources:
  memory: {max: 64M}
"""


@pytest.fixture
def box(sandbox):
    """The sandbox with environment `box` up (a rootfs with sh and python3, 64M of memory)."""
    sandbox.write_spec("box", SPEC)
    res = sandbox.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    yield sandbox
    if sandbox.proc.poll() is None:
        sandbox.envctl("down", "box", "--force")


def script(sb, name: str, text: str, mode: int = 0o755) -> str:
    path = sb.root / name
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def submit(sb, *args: str, user: str | None = "root", env: dict[str, str] | None = None
           ) -> dict:
    """`submit-job --json [--user USER] box ARGS…`; the record it prints."""
    res = sb.envctl("submit-job", "--json", *(["--user", user] if user else []), "box", *args,
                    env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def record(sb, job_id: int) -> dict:
    return json.loads((sb.state / "jobs" / f"{job_id}.json").read_text())


def wait(sb, *ids: int) -> tuple[int, list[dict]]:
    res = sb.envctl("wait", "--json", *map(str, ids), timeout=300)
    return res.returncode, json.loads(res.stdout)


def job_cgroups(sb) -> list[str]:
    return [c for c in sb.cgroups() if "/job-" in c]


def ours(sb) -> list[int]:
    """Processes of this sandbox's jobs: in its cgroups, or started with a path of its own on
    their command line (the CLI and the supervisors it forks). Other tests may run beside
    this one on the host: their processes and namespaces are theirs."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            with contextlib.suppress(OSError):
                if (sb.cgroup_parent in Path(f"/proc/{pid}/cgroup").read_text()
                        or str(sb.root).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()):
                    out.append(int(pid))
    return out


def ns_mounts(sb) -> list[str]:
    """Namespace files bound somewhere in the sandbox (a namespace held without a process)."""
    text = Path(f"/proc/{sb.pid}/mountinfo").read_text()
    return sorted(line.split()[4] for line in text.splitlines() if " - nsfs " in line)


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        p = select.poll()
        p.register(fd, select.POLLIN)
        return bool(p.poll(timeout * 1000))
    finally:
        os.close(fd)


def alive(identity: dict) -> bool:
    """Whether the process a record names still exists (a zombie included)."""
    try:
        stat = Path(f"/proc/{identity['pid']}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[19] == str(identity["start"])


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def assert_clean_down(sb, data: tuple[str, ...] = ()) -> None:
    """`down` of box leaves nothing but job records and box's `data` directories (its spec's
    relative mount sources), which survive `down` as data does."""
    res = sb.envctl("down", "box")
    assert res.returncode == 0, res.stderr
    residue = sb.residue()
    # Job records are history: they outlive the environment (and keep the state directory).
    kept = residue.pop("state_dir", None)
    assert kept in ([*(["data"] if data else []), "jobs", "lock"], None), residue
    assert residue == {}, residue
    if data:
        assert sorted(os.listdir(sb.state / "data")) == ["box"]
        assert sorted(os.listdir(sb.state / "data" / "box")) == sorted(data)


# ---------------------------------------------------------------- how jobs end


def test_exit_codes_signals_and_outputs_land_in_the_record(box):
    sb = box
    ok = script(sb, "ok.sh", "#!/bin/sh\necho out \"$@\"\necho err >&2\n")
    three = script(sb, "three.sh", "#!/bin/sh\necho before\nexit 3\n")
    killed = script(sb, "killed.sh", "#!/bin/sh\nkill -SEGV $$\n")
    a = submit(sb, "--name", "first", ok, "-x", "$(id)", "a b")
    b = submit(sb, three)
    c = submit(sb, killed)
    # Printed once the job runs (or, as fast as these are, once it ended).
    assert all(j["start_time"] and j["state"] != "PENDING" for j in (a, b, c))
    assert a["argv"] == ["/job/ok.sh", "-x", "$(id)", "a b"] and a["name"] == "first"
    rc, done = wait(sb, a["id"], b["id"], c["id"])
    assert rc == 3  # the first non-zero exit
    first, second, third = done
    assert (first["state"], first["exit_code"], first["signal"]) == ("COMPLETED", 0, None)
    assert (second["state"], second["exit_code"], second["signal"]) == ("FAILED", 3, None)
    # Death by a signal is FAILED with the signal, not OUT_OF_MEMORY: no OOM kill counted.
    assert (third["state"], third["signal"], third["oom_kills"]) == ("FAILED", 11, 0)
    for j in done:
        assert j["submit_time"] <= j["start_time"] <= j["end_time"]
        assert j["cpu_seconds"] is not None and j["peak_memory_bytes"] > 0
        assert j["cgroup"]["name"] == f"box/job-{j['id']}"
    assert Path(first["stdout"]).read_text() == "out -x $(id) a b\n"
    assert Path(first["stderr"]).read_text() == "err\n"
    assert Path(second["stdout"]).read_text() == "before\n"
    logs = sb.envctl("logs", str(a["id"]))
    assert logs.stdout == "out -x $(id) a b\n"
    assert sb.envctl("logs", str(a["id"]), "--stderr").stdout == "err\n"
    assert job_cgroups(sb) == []
    table = sb.envctl("jobs", "--all").stdout.splitlines()
    assert table[0].split() == ["ID", "NAME", "ENV", "USER", "STATE", "ELAPSED", "EXIT",
                                "CPUS", "MEM", "GPUS", "START", "PROGRAM"]
    assert [row.split()[:5] for row in table[1:]] == [
        [str(a["id"]), "first", "box", "root", "COMPLETED"],
        [str(b["id"]), "three.sh", "box", "root", "FAILED"],
        [str(c["id"]), "killed.sh", "box", "root", "FAILED"]]
    assert sb.envctl("jobs").stdout.splitlines()[1:] == []  # none active
    assert_clean_down(sb)


def test_time_limit_ends_in_timeout(box):
    sb = box
    sleeper = script(sb, "sleeper.sh", "#!/bin/sh\nexec sleep 1000\n")
    j = submit(sb, "--time-limit", "1s", sleeper)
    assert j["time_limit"] == 1
    rc, (done,) = wait(sb, j["id"])
    assert (done["state"], done["signal"]) == ("TIMEOUT", signal.SIGTERM)
    assert 1.0 <= done["end_time"] - done["start_time"] < 10.0
    assert rc == 128 + signal.SIGTERM
    assert job_cgroups(sb) == []
    assert_clean_down(sb)


def test_cancel_ends_in_cancelled_and_kills_what_ignores_sigterm(box):
    sb = box
    # A job that ignores SIGTERM: the grace runs out, SIGKILL ends it.
    stubborn = script(sb, "stubborn.sh", "#!/bin/sh\ntrap '' TERM\nsleep 1000 &\nwait\n"
                      "while :; do sleep 1000; done\n")
    j = submit(sb, stubborn)
    res = sb.envctl("cancel", "--json", "--grace", "0.5", str(j["id"]))
    assert res.returncode == 0, res.stderr
    (done,) = json.loads(res.stdout)
    assert done["state"] == "CANCELLED" and done["end_time"] is not None
    assert done["signal"] == signal.SIGKILL
    assert job_cgroups(sb) == []
    assert not (sb.state / "jobs" / f"{j['id']}.cancel").exists()
    # Cancelling it again, or any finished job, changes nothing.
    again = sb.envctl("cancel", str(j["id"]))
    assert again.returncode == 0 and "was CANCELLED" in again.stdout
    # The record as stored: what the CLI printed less `elapsed`, derived for readers.
    assert record(sb, j["id"]) | {"elapsed": done["elapsed"]} == done
    assert sb.envctl("cancel", "999").returncode == 2
    assert_clean_down(sb)


def test_a_memory_hog_ends_out_of_memory_from_the_oom_counter(box):
    sb = box
    hog = script(sb, "hog.py", "import sys\nb = b'x' * (200 << 20)\nprint(len(b))\n", 0o644)
    j = submit(sb, hog)
    rc, (done,) = wait(sb, j["id"])
    assert done["state"] == "OUT_OF_MEMORY", done
    assert done["oom_kills"] >= 1 and done["signal"] == signal.SIGKILL
    # The peak is the limit's, not the 200M asked for (give or take the kernel's per-CPU
    # charge batches).
    assert 48 << 20 < done["peak_memory_bytes"] < 72 << 20
    assert rc == 128 + signal.SIGKILL
    assert job_cgroups(sb) == []
    assert_clean_down(sb)


def test_a_python_job_runs_with_the_environments_python_and_sees_job_read_only(box):
    sb = box
    prog = script(sb, "probe.py", """
import errno, os, sys
print(sys.executable)
print(sorted(os.listdir('/job')))
try:
    open('/job/x', 'w')
except OSError as exc:
    print(errno.errorcode[exc.errno])
print(os.environ['ENVCTL_JOB_ID'], os.getcwd(), os.getuid(), sys.argv[1:])
""", 0o600)
    j = submit(sb, "--workdir", "/tmp", prog, "--flag")
    assert j["argv"][1:] == ["/job/probe.py", "--flag"] and j["argv"][0].endswith("/python3")
    rc, (done,) = wait(sb, j["id"])
    assert rc == 0, Path(done["stderr"]).read_text()
    lines = Path(done["stdout"]).read_text().splitlines()
    assert lines[0] == j["argv"][0]
    assert lines[1] == str(["probe.py", "stderr", "stdout"])
    assert lines[2] == "EROFS"
    assert lines[3] == f"{j['id']} /tmp 0 ['--flag']"
    # The staged copy kept the mode.
    assert (sb.state / "jobs" / str(j["id"]) / "probe.py").stat().st_mode & 0o777 == 0o600
    assert_clean_down(sb)


def test_user_defaults_to_the_sudo_user_and_never_silently_root(box):
    sb = box
    # The program is read with the sudo user's rights: somewhere nobody can walk to (the
    # sandbox sits below root's 0700 /tmp/pytest-of-root).
    pub = Path(tempfile.mkdtemp(prefix="envctl-jobs-", dir="/var/tmp"))
    os.chmod(pub, 0o755)
    prog = str(pub / "who.py")
    Path(prog).write_text("import os\nprint(os.getuid(), os.getgid())\n")
    os.chmod(prog, 0o644)
    refused = sb.envctl("submit-job", "box", prog)
    assert refused.returncode == 2 and "--user root" in refused.stderr
    assert not (sb.state / "jobs" / "1.json").exists()  # bad input changes nothing
    j = submit(sb, prog, user=None, env={"SUDO_UID": "65534", "SUDO_GID": "65534",
                                         "SUDO_USER": "nobody"})
    rc, (done,) = wait(sb, j["id"])
    assert rc == 0 and done["user"] == "nobody" and done["uid"] == 65534
    assert Path(done["stdout"]).read_text() == "65534 65534\n"
    assert os.stat(done["stdout"]).st_uid == 65534  # the user behind sudo can read it
    shutil.rmtree(pub)
    assert_clean_down(sb)


def test_a_bare_name_runs_the_environments_program_and_a_file_here_is_staged(box):
    """`submit-job box sleep 0`, as srun and `docker run` read it: the environment's own
    /usr/bin/sleep, found in its PATH, run from the rootfs (nothing staged); python3, a
    symlink inside the rootfs, works too. A file of that name in the caller's directory, or a
    path, is this host's and is staged. Not found: exit 2 naming the PATH, no id taken."""
    sb = box
    a = submit(sb, "sleep", "0")
    py = submit(sb, "python3", "-c", "import sys; print(sys.executable)")
    code, done = wait(sb, a["id"], py["id"])
    assert code == 0 and [j["state"] for j in done] == ["COMPLETED", "COMPLETED"], done
    assert a["program"] == {"rootfs": "/usr/bin/sleep"} and a["argv"] == ["/usr/bin/sleep", "0"]
    assert py["program"] == {"rootfs": "/usr/bin/python3"}
    assert Path(done[1]["stdout"]).read_text().strip().startswith("/usr/bin/python3")
    assert sorted(os.listdir(sb.state / "jobs" / str(a["id"]))) == ["stderr", "stdout"]
    rows = {r.split()[0]: r.split() for r in sb.envctl("jobs", "--all").stdout.splitlines()}
    assert rows[str(a["id"])][-1] == "rootfs:/usr/bin/sleep"

    # A file named `sleep` where the caller stands is staged (and it is not the real sleep).
    here = sb.root / "here"
    here.mkdir()
    script(sb, "here/sleep", "#!/bin/sh\necho not the real sleep \"$@\"\n")
    res = sb.run("env", "-C", str(here), sys.executable, "-m", "envctl", "submit-job",
                 "--json", "--user", "root", "box", "sleep", "5")
    assert res.returncode == 0, res.stderr
    staged = json.loads(res.stdout)
    assert staged["program"] == {"staged": str(here / "sleep")}
    assert staged["argv"] == ["/job/sleep", "5"]
    code, (done,) = wait(sb, staged["id"])
    assert code == 0 and Path(done["stdout"]).read_text() == "not the real sleep 5\n"

    before = sorted(os.listdir(sb.state / "jobs"))
    for args, words in ((["perl", "-e", "1"], "no program of that name in environment "
                         "'box''s PATH (/usr/local/sbin:"),
                        (["--env", "PATH=/opt", "sleep", "1"], "PATH (/opt)")):
        res = sb.envctl("submit-job", "--user", "root", "box", *args)
        assert res.returncode == 2 and words in res.stderr, res.stderr
    assert sorted(os.listdir(sb.state / "jobs")) == before  # no id taken, nothing made
    shutil.rmtree(here)
    assert_clean_down(sb)


def test_bad_requests_are_refused_before_anything_changes(box):
    sb = box
    ok = script(sb, "ok.sh", "#!/bin/sh\n")
    noexec = script(sb, "noexec.sh", "#!/bin/sh\n", 0o644)
    for args, words in [
        (["--cpus", "0-99", ok], "--cpus"),
        (["--gpus", "0", ok], "--gpus"),
        (["--time-limit", "soon", ok], "--time-limit"),
        (["--env", "NOEQUALS", ok], "--env"),
        (["--output", "/nonexistent/dir/out", ok], "--output"),
        ([noexec], "not executable"),
        ([str(sb.root / "missing")], "No such file"),
        # A script whose #! interpreter the environment lacks, named, before any job id.
        ([script(sb, "needs-perl.pl", "#!/usr/bin/perl\nprint 1;\n")],
         "its interpreter /usr/bin/perl (from its #! line) is not in environment 'box'"),
        ([script(sb, "env-perl.pl", "#!/usr/bin/env perl\nprint 1;\n")],
         "its interpreter /usr/bin/env (from its #! line)"),
    ]:
        res = sb.envctl("submit-job", "--user", "root", "box", *args)
        assert res.returncode == 2 and words in res.stderr, (args, res.stderr)
    assert not (sb.state / "jobs").exists() or not list((sb.state / "jobs").glob("*.json"))
    assert_clean_down(sb)


def test_a_job_that_cannot_start_is_failed_with_why(box):
    sb = box
    # Executable, but no program the kernel can run (an ELF header and nothing behind it).
    bad = script(sb, "not-a-program", "\x7fELF\x02\x01\x01" + "\0" * 57)
    res = sb.envctl("submit-job", "--user", "root", "box", bad)
    assert res.returncode == 1 and "did not start" in res.stderr, res.stderr
    jid = int(res.stdout)
    done = record(sb, jid)
    assert (done["state"], done["exit_code"], done["start_time"]) == ("FAILED", 126, None)
    assert "cannot run it" in done["error"], done["error"]
    assert job_cgroups(sb) == []
    assert wait(sb, jid)[0] == 126
    assert_clean_down(sb)


def test_options_cpus_env_and_one_output_file(box):
    sb = box
    prog = script(sb, "aff.py", "import os, sys\nprint(sorted(os.sched_getaffinity(0)), "
                  "os.environ['GREETING'])\nprint('to stderr', file=sys.stderr)\n", 0o644)
    out = sb.root / "both.log"
    j = submit(sb, "--cpus", "0-0", "--env", "GREETING=hi there", "-o", str(out), "-e",
               str(out), prog)
    assert j["cpus"] == [0] and j["stdout"] == j["stderr"] == str(out)
    rc, _ = wait(sb, j["id"])
    assert rc == 0
    assert sorted(out.read_text().splitlines()) == ["[0] hi there", "to stderr"]
    assert_clean_down(sb)


def test_logs_follow_until_the_job_ends(box):
    sb = box
    prog = script(sb, "talk.sh", "#!/bin/sh\necho one\nsleep 0.5\necho two\n")
    j = submit(sb, prog)
    res = sb.envctl("logs", "-f", str(j["id"]), timeout=30)
    assert res.returncode == 0 and res.stdout == "one\ntwo\n", res.stderr
    assert record(sb, j["id"])["state"] == "COMPLETED"
    assert_clean_down(sb)


def test_submit_wait_exits_with_the_jobs_code(box):
    sb = box
    prog = script(sb, "seven.sh", "#!/bin/sh\nexit 7\n")
    res = sb.envctl("submit-job", "--user", "root", "--wait", "box", prog)
    assert res.returncode == 7 and res.stdout.strip().isdigit()
    assert "FAILED" in res.stderr
    assert_clean_down(sb)


# ---------------------------------------------------------------- supervisors and down


def test_kill_9_of_the_supervisor_leaves_a_lost_job_and_no_process(box):
    sb = box
    sleeper = script(sb, "sleeper.sh", "#!/bin/sh\nexec sleep 1000\n")
    held = ns_mounts(sb)
    j = submit(sb, sleeper)
    cg = next(Path(c) for c in job_cgroups(sb) if c.endswith(f"/box/job-{j['id']}"))
    assert len(ours(sb)) >= 4, "no supervisor, launcher, init and job running"
    sup = j["supervisor"]["pid"]
    os.kill(sup, signal.SIGKILL)
    assert wait_gone(sup)
    # The launch's init dies with its launcher, the PID namespace with its init: nothing of
    # the job is left, in its cgroup or anywhere, and no namespace is held by a mount.
    assert wait_until(lambda: not ours(sb)), "the job outlived its supervisor"
    # A process leaves each v1 hierarchy's cgroup.procs as its exit completes there, a moment
    # after /proc stops showing it running: waited for, not assumed.
    assert wait_until(lambda: not (cg / "cgroup.procs").read_text().strip()), \
        (cg / "cgroup.procs").read_text()
    assert ns_mounts(sb) == held
    shown = json.loads(sb.envctl("jobs", "--json").stdout)
    assert [(x["id"], x["state"]) for x in shown] == [(j["id"], "LOST")]
    assert record(sb, j["id"])["state"] == "RUNNING"  # read-only commands write nothing
    rc, (waited,) = wait(sb, j["id"])
    assert waited["state"] == "LOST" and rc == 1
    # cancel finalizes it: what is left of its cgroup goes, the record says LOST for good.
    res = sb.envctl("cancel", str(j["id"]))
    assert res.returncode == 0 and "LOST" in res.stdout, res.stderr
    final = record(sb, j["id"])
    assert final["state"] == "LOST" and final["end_time"] is not None
    assert job_cgroups(sb) == []
    assert_clean_down(sb)


def test_down_refuses_while_jobs_run_and_force_cancels_them(box):
    sb = box
    sleeper = script(sb, "sleeper.sh", "#!/bin/sh\nexec sleep 1000\n")
    j = submit(sb, sleeper)
    res = sb.envctl("down", "box")
    assert res.returncode == 3 and f"({j['id']})" in res.stderr, res.stderr  # errors.Busy
    assert record(sb, j["id"])["state"] == "RUNNING"
    assert sb.run("test", "-e", str(sb.run_dir / "mnt.d" / "box")).returncode == 0
    res = sb.envctl("down", "box", "--force", env={"ENVCTL_KILL_GRACE": "1"})
    assert res.returncode == 0, res.stderr
    assert record(sb, j["id"])["state"] == "CANCELLED"
    assert not ours(sb)
    residue = sb.residue()
    assert residue.pop("state_dir", None) == ["jobs", "lock"], residue
    assert residue == {}


def stopping_systemctl(sb) -> dict[str, str]:
    """The environment of a host that systemd is shutting down: a systemctl whose
    `is-system-running` says "stopping" (what envctl asks), as ENVCTL_SYSTEMCTL."""
    fake = script(sb, "systemctl-stopping", '#!/bin/sh\n[ "$1" = is-system-running ] && '
                  '{ echo stopping; exit 1; }\nexit 0\n')
    return {"ENVCTL_SYSTEMCTL": fake, "ENVCTL_KILL_GRACE": "1"}


def test_down_all_refuses_naming_each_environment_and_job_and_takes_nothing_down(box):
    """envctl.service's ExecStop= (`down --all`, no --force) while a job runs: exit 3, one
    line naming the environment and its job, and everything stays up."""
    sb = box
    j = submit(sb, script(sb, "sleeper.sh", "#!/bin/sh\nexec sleep 1000\n"))
    res = sb.envctl("down", "--all")
    assert res.returncode == 3, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert f"down box: 1 job(s) still running ({j['id']})" in last, res.stderr
    assert record(sb, j["id"])["state"] == "RUNNING"
    assert sb.envctl_json("status")[0]["state"] == "up"
    sb.envctl("cancel", str(j["id"]), check=True)


def test_down_while_the_host_shuts_down_cancels_the_jobs_with_that_reason(box):
    sb = box
    j = submit(sb, script(sb, "sleeper.sh", "#!/bin/sh\nexec sleep 1000\n"))
    res = sb.envctl("down", "--all", env=stopping_systemctl(sb))
    assert res.returncode == 0, res.stderr
    assert "the host is shutting down: cancelling the jobs of box" in res.stderr
    final = record(sb, j["id"])
    assert final["state"] == "CANCELLED" and final["reason"] == "host shutdown", final
    assert not ours(sb)
    residue = sb.residue()
    assert residue.pop("state_dir", None) == ["jobs", "lock"], residue
    assert residue == {}


@pytest.mark.parametrize("shutting_down", [True, False])
def test_a_sigterm_to_the_supervisor_records_host_shutdown_only_when_it_is_one(box,
                                                                               shutting_down):
    """At shutdown systemd stops the jobs' scopes itself (maybe before envctl.service's
    `down`): the supervisor's SIGTERM then records "host shutdown"; any other SIGTERM, no
    reason."""
    sb = box
    env = stopping_systemctl(sb) if shutting_down else None
    j = submit(sb, script(sb, "sleeper.sh", "#!/bin/sh\nexec sleep 1000\n"), env=env)
    assert wait_until(lambda: record(sb, j["id"])["state"] == "RUNNING")
    os.kill(j["supervisor"]["pid"], signal.SIGTERM)
    rc, (final,) = wait(sb, j["id"])
    assert final["state"] == "CANCELLED", final
    assert final["reason"] == ("host shutdown" if shutting_down else None), final


def test_a_job_that_ends_as_systemd_stops_its_supervisor_at_shutdown_is_cancelled(box):
    """At shutdown systemd signals the job's processes and its supervisor at once: the job
    may be gone before the supervisor looks at its SIGTERM. Made certain here: the supervisor
    stopped, the job's launcher killed and left a zombie, then SIGTERM and SIGCONT, so that
    both arrive in one wake-up. It is the stop that ended it: CANCELLED, "host shutdown"."""
    sb = box
    env = stopping_systemctl(sb)
    j = submit(sb, script(sb, "sleeper.sh", "#!/bin/sh\nexec sleep 1000\n"), env=env)
    assert wait_until(lambda: record(sb, j["id"])["state"] == "RUNNING")
    sup = j["supervisor"]["pid"]
    os.kill(sup, signal.SIGSTOP)
    try:
        children = Path(f"/proc/{sup}/task/{sup}/children").read_text().split()
        assert children, "the supervisor has no launcher"
        for pid in children:
            os.kill(int(pid), signal.SIGKILL)

        def zombies() -> bool:
            stats = [Path(f"/proc/{p}/stat").read_text() for p in children]
            return all(s[s.rfind(")") + 2] == "Z" for s in stats)

        assert wait_until(zombies)
        os.kill(sup, signal.SIGTERM)
    finally:
        os.kill(sup, signal.SIGCONT)
    rc, (final,) = wait(sb, j["id"])
    assert final["state"] == "CANCELLED" and final["reason"] == "host shutdown", final


def test_200_short_jobs_back_to_back_leave_nothing_behind(box):
    sb = box
    true = sb.root / "true"
    true.write_bytes(Path("/bin/true").read_bytes())
    true.chmod(0o755)
    held = ns_mounts(sb)
    before_mounts = sb.mounts_under("/")
    t0 = time.monotonic()
    res = sb.run("sh", "-c", 'for i in $(seq 200); do "$0" -m envctl submit-job --user root '
                 'box "$1" >/dev/null || exit 1; done', sys.executable, str(true), timeout=600)
    assert res.returncode == 0, res.stderr
    submitted = time.monotonic() - t0
    rc, done = wait(sb, *range(1, 201))
    total = time.monotonic() - t0
    print(f"\n200 jobs: submitted in {submitted:.1f} s, all ended after {total:.1f} s")
    assert rc == 0
    assert [j["id"] for j in done] == list(range(1, 201))
    assert {j["state"] for j in done} == {"COMPLETED"}
    for j in done:
        assert j["exit_code"] == 0 and j["signal"] is None and j["error"] is None
        assert j["submit_time"] <= j["start_time"] <= j["end_time"]
        assert j["argv"] == ["/job/true"] and j["cpu_seconds"] is not None
    # Every supervisor has exited (and PID 1, their parent since the double fork, reaped it);
    # no process of a job is left, so no PID or mount namespace of one either.
    assert wait_until(lambda: not any(alive(j["supervisor"]) for j in done))
    assert not ours(sb)
    assert job_cgroups(sb) == []
    assert ns_mounts(sb) == held
    assert sb.mounts_under("/") == before_mounts
    assert_clean_down(sb)


def test_a_time_limit_and_a_grace_of_365_days_are_waited_for_and_more_is_refused(box):
    """poll() takes milliseconds in a C int: a wait of more than ~24.8 days in one call
    overflowed it and the job ended FAILED "supervisor failed" at once."""
    sb = box
    sleeper = script(sb, "sleeper.sh", "#!/bin/sh\nexec sleep 1000\n")
    j = submit(sb, "--time-limit", "365d", sleeper)
    assert j["state"] == "RUNNING" and j["time_limit"] == 365 * 86400
    # The longest grace is accepted; sleep dies on the SIGTERM, so the grace is not waited.
    res = sb.envctl("cancel", "--json", "--grace", str(365 * 86400), str(j["id"]))
    assert res.returncode == 0, res.stderr
    (done,) = json.loads(res.stdout)
    assert (done["state"], done["signal"], done["error"]) == (
        "CANCELLED", signal.SIGTERM, None), done
    for args in (["--time-limit", "366d", sleeper], ["-t", "525601", sleeper]):
        bad = sb.envctl("submit-job", "--user", "root", "box", *args)
        assert bad.returncode == 2 and "at most 365 days" in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
    bad = sb.envctl("cancel", "--grace", str(365 * 86400 + 1), str(j["id"]))
    assert bad.returncode == 2 and "--grace" in bad.stderr, bad.stderr
    assert len(json.loads(sb.envctl("jobs", "--all", "--json").stdout)) == 1
    assert_clean_down(sb)


STUBBORN = "#!/bin/sh\ntrap '' TERM\nsleep 1000 &\nwait\nwhile :; do sleep 1000; done\n"


def stopping_of(sb, job_id: int) -> dict | None:
    return record(sb, job_id).get("stopping")


def test_a_cancel_after_the_time_limit_fired_keeps_timeout_and_its_grace(box):
    sb = box
    j = submit(sb, "--time-limit", "1s", script(sb, "stubborn.sh", STUBBORN))
    assert wait_until(lambda: stopping_of(sb, j["id"]) is not None, 20), record(sb, j["id"])
    stop = stopping_of(sb, j["id"])
    assert stop["cause"] == "timeout" and stop["kill_at"] - stop["since"] == pytest.approx(10)
    # A cancel with no grace at all neither makes it CANCELLED nor kills it sooner.
    res = sb.envctl("cancel", "--json", "--grace", "0", str(j["id"]))
    assert res.returncode == 0, res.stderr
    (done,) = json.loads(res.stdout)
    assert (done["state"], done["signal"]) == ("TIMEOUT", signal.SIGKILL), done
    assert done["stopping"] == stop
    assert stop["kill_at"] - 0.1 <= done["end_time"] < stop["kill_at"] + 5
    assert not (sb.state / "jobs" / f"{j['id']}.cancel").exists()
    assert_clean_down(sb)


def test_a_later_cancel_or_time_limit_keeps_the_first_cancel_and_its_grace(box):
    sb = box
    j = submit(sb, "--time-limit", "4s", script(sb, "stubborn.sh", STUBBORN))
    first = sb.popen(sys.executable, "-m", "envctl", "cancel", "--json", "--grace", "17",
                     str(j["id"]))
    try:
        assert wait_until(lambda: stopping_of(sb, j["id"]) is not None, 20), record(sb, j["id"])
        stop = stopping_of(sb, j["id"])
        assert stop["cause"] == "cancel" and stop["kill_at"] - stop["since"] == pytest.approx(17)
        # The time limit passes during the grace, and a second cancel asks for no grace: the
        # SIGKILL still comes 17 s after the first SIGTERM, and this cancel waits for it
        # (beyond its own 0 s and the 15 s of slack).
        res = sb.envctl("cancel", "--json", "--grace", "0", str(j["id"]), timeout=60)
        assert res.returncode == 0, res.stderr
        (done,) = json.loads(res.stdout)
        out, err = first.communicate(timeout=30)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert json.loads(out) == [done]
    assert (done["state"], done["signal"]) == ("CANCELLED", signal.SIGKILL), done
    assert done["stopping"] == stop
    assert stop["kill_at"] - 0.1 <= done["end_time"] < stop["kill_at"] + 5
    assert_clean_down(sb)


# ---------------------------------------------------------------- a failing state disk


def test_a_first_record_write_that_fails_fails_the_submit_and_leaves_nothing(box):
    sb = box
    ok = script(sb, "ok.sh", "#!/bin/sh\necho hi\n")
    res = sb.envctl("submit-job", "--user", "root", "box", ok,
                    env={"ENVCTL_FAULT": "errno=ENOSPC@record:PENDING#1"})
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert res.stdout == ""  # no id printed
    assert len(res.stderr.strip().splitlines()) == 1 and "No space left" in res.stderr
    assert [n for n in os.listdir(sb.state / "jobs") if n[0].isdigit()] == []
    assert job_cgroups(sb) == []
    assert json.loads(sb.envctl("jobs", "--all", "--json").stdout) == []
    assert_clean_down(sb)


def test_failed_record_writes_never_kill_the_job_and_the_final_one_is_retried(box):
    sb = box
    ok = script(sb, "ok.sh", "#!/bin/sh\necho hi\n")
    faults = ("errno=EIO@record:RUNNING#1,errno=ENOSPC@record:COMPLETED#1,"
              "errno=EIO@record:COMPLETED#2")
    res = sb.envctl("submit-job", "--json", "--user", "root", "--wait", "box", ok,
                    env={"ENVCTL_FAULT": faults})
    assert res.returncode == 0, res.stderr
    done = record(sb, json.loads(res.stdout)["id"])
    assert (done["state"], done["exit_code"], done["error"]) == ("COMPLETED", 0, None), done
    assert Path(done["stdout"]).read_text() == "hi\n"
    log = Path(done["stderr"]).read_text().splitlines()
    assert log[0].startswith(f"envctl: could not write the record of job {done['id']} "
                             "(RUNNING): Input/output error"), log
    assert "the job goes on" in log[0]
    assert "(COMPLETED): No space left on device" in log[1] and "retrying in 0.1 s" in log[1]
    assert "(COMPLETED): Input/output error" in log[2] and "retrying in 0.2 s" in log[2]
    assert log[3] == f"envctl: wrote the final record of job {done['id']} at attempt 3"
    assert job_cgroups(sb) == []
    assert_clean_down(sb)


def test_a_full_state_disk_refuses_a_submit_and_delays_a_final_record_until_it_has_room(
        sandbox):
    """The real kernel's ENOSPC: a small tmpfs as `<state>/jobs`, mounted before `up` (the
    environment's mount namespace is a copy of the host's from then)."""
    sb = sandbox
    jobs_dir = sb.state / "jobs"
    seen = Path(f"/proc/{sb.pid}/root{jobs_dir}")  # the tmpfs, as the sandbox sees it
    jobs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    sb.run("mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "envctl-test-jobs",
           str(jobs_dir), check=True)
    try:
        sb.write_spec("box", SPEC)
        res = sb.envctl("up", "box")
        assert res.returncode == 0, res.stderr
        def fill() -> None:
            fd = os.open(seen / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                with contextlib.suppress(OSError):  # ENOSPC: full
                    while os.write(fd, b"\0" * 4096):
                        pass
            finally:
                os.close(fd)

        fill()
        ok = script(sb, "ok.sh", "#!/bin/sh\necho hi\n")
        res = sb.envctl("submit-job", "--user", "root", "box", ok)
        assert res.returncode == 1 and res.stdout == "", (res.stdout, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and "No space left" in res.stderr
        assert sorted(n for n in os.listdir(seen) if n[0].isdigit()) == []
        (seen / "filler").unlink()
        # Room again: a job runs; the disk fills while it runs; it ends; its final record
        # waits for room instead of being lost.
        # (Its outputs elsewhere: on the full disk, its own `echo` would fail.)
        err, out = sb.root / "err.txt", sb.root / "out.txt"
        go = script(sb, "go.sh", "#!/bin/sh\nwhile [ ! -e /job/go ]; do sleep 0.05; done\n"
                    "echo done\n")
        j = submit(sb, "--error", str(err), "--output", str(out), go)
        assert j["state"] == "RUNNING"
        fill()
        (seen / str(j["id"]) / "go").touch()  # an empty file takes no block
        assert wait_until(lambda: "retrying in" in err.read_text(), 30), err.read_text()
        assert json.loads((seen / f"{j['id']}.json").read_text())["state"] == "RUNNING"
        (seen / "filler").unlink()
        rc, (done,) = wait(sb, j["id"])
        assert (rc, done["state"], done["error"]) == (0, "COMPLETED", None), done
        assert out.read_text() == "done\n"
        assert "wrote the final record" in err.read_text().splitlines()[-1]
        assert job_cgroups(sb) == []
    finally:
        sb.run("umount", str(jobs_dir))
    assert_clean_down(sb)


def _has_cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)  # CAP_SYS_RESOURCE is 24
    return False


def test_the_supervisor_is_spared_by_the_oom_killer_and_its_job_is_not(box):
    """slurmstepd's rule: the supervisor -1000, the job the default 0 back (a child inherits
    oom_score_adj), with the floor reset too, so the job cannot lower itself to -1000. Where
    this VM withholds CAP_SYS_RESOURCE from root (nobody may lower a score then), the CLI
    starts at 500: the job must still get 0 back rather than inherit it."""
    sb = box
    prog = script(sb, "adj.sh", "#!/bin/sh\ncat /proc/self/oom_score_adj\n"
                  "if echo -1000 > /proc/self/oom_score_adj; then echo lowered; "
                  "else echo refused; fi\ncat /proc/self/oom_score_adj\nexec sleep 1000\n")
    res = sb.run("sh", "-c", 'echo 500 > /proc/self/oom_score_adj && exec "$@"', "sh",
                 sys.executable, "-m", "envctl", "submit-job", "--json", "--user",
                 "65534:65534", "box", prog)
    assert res.returncode == 0, res.stderr
    j = json.loads(res.stdout)
    out = Path(j["stdout"])
    assert wait_until(lambda: len(out.read_text().splitlines()) == 3), out.read_text()
    assert out.read_text().splitlines() == ["0", "refused", "0"], Path(j["stderr"]).read_text()
    assert alive(j["supervisor"])
    sup = Path(f"/proc/{j['supervisor']['pid']}/oom_score_adj").read_text().strip()
    assert sup == ("-1000" if _has_cap_sys_resource() else "500")
    res = sb.envctl("cancel", "--grace", "0", str(j["id"]))
    assert res.returncode == 0, res.stderr
    assert_clean_down(sb)
