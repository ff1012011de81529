"""The job system's pure parts and its records, without root: ids, retention, the LOST view,
how a job's end maps to a state, durations, the command line's argument split, and following
an output file."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from envctl.errors import HostError, InputError, StateCorrupt, UsageError
from envctl.host.context import Host
from envctl.runtime import jobs
from envctl.runtime import supervisor as sv
from envctl.runtime.context import EnvContext
from envctl.runtime.jobs import Job, State

BOOT = "boot-a"


def me() -> dict[str, int]:
    return jobs.identity()


def job(jid: int, state: State = State.COMPLETED, **kw) -> Job:
    return Job(id=jid, env="box", argv=["/job/x"], state=state, boot_id=BOOT, **kw)


# ---------------------------------------------------------------- ids and records


def test_ids_increase_and_are_never_reused_even_after_pruning(tmp_path):
    assert [jobs.allocate_id(tmp_path) for _ in range(3)] == [1, 2, 3]
    for jid in (1, 2, 3):
        jobs.write(tmp_path, job(jid))
    with jobs.jobs_lock(tmp_path):
        assert jobs.prune(tmp_path, keep=0) == []  # below the batch threshold: nothing read
    for jid in range(4, 20):
        assert jobs.allocate_id(tmp_path) == jid
        jobs.write(tmp_path, job(jid))
    with jobs.jobs_lock(tmp_path):
        pruned = jobs.prune(tmp_path, keep=0)
    assert pruned == list(range(1, 20))
    assert jobs.allocate_id(tmp_path) == 20


def test_a_lost_counter_restarts_above_every_record_and_job_directory(tmp_path):
    jobs.write(tmp_path, job(7))
    jobs.job_dir(tmp_path, 9).mkdir(parents=True)
    assert jobs.allocate_id(tmp_path) == 10
    (jobs.jobs_dir(tmp_path) / ".next").write_text("garbage\n")
    with pytest.raises(StateCorrupt, match="job counter"):
        jobs.allocate_id(tmp_path)


def test_the_counter_appends_a_byte_per_id_and_is_compacted(tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "COUNTER_COMPACT", 4)
    counter = jobs.jobs_dir(tmp_path) / ".next"
    assert [jobs.allocate_id(tmp_path) for _ in range(3)] == [1, 2, 3]
    assert counter.read_bytes() == b"2\n++"  # no rename per id: one byte appended
    assert [jobs.allocate_id(tmp_path) for _ in range(3)] == [4, 5, 6]
    assert counter.read_bytes() == b"6\n+"  # rewritten after four appended ids
    counter.write_text("41")  # an older envctl's counter, without its newline
    assert [jobs.allocate_id(tmp_path) for _ in range(2)] == [41, 42]
    assert counter.read_bytes() == b"42\n+"
    assert oct(counter.stat().st_mode & 0o777) == "0o600"


def test_records_round_trip_and_a_damaged_one_is_named(tmp_path):
    j = job(3, State.FAILED, exit_code=3, cpus=[0, 1], gpus=["GPU-1"], supervisor=me())
    jobs.write(tmp_path, j)
    assert jobs.read(tmp_path, 3) == j
    assert jobs.get(tmp_path, "3") == j
    assert jobs.read(tmp_path, 4) is None
    with pytest.raises(UsageError, match="no job 4"):
        jobs.get(tmp_path, 4)
    with pytest.raises(UsageError, match="not a job id"):
        jobs.get(tmp_path, "x1")
    jobs.record_path(tmp_path, 5).write_text("{not json")
    with pytest.raises(StateCorrupt, match="5.json"):
        jobs.read(tmp_path, 5)
    jobs.record_path(tmp_path, 6).write_text('{"id": 6, "env": "box", "argv": [], '
                                             '"state": "WEIRD"}')
    with pytest.raises(StateCorrupt):
        jobs.read(tmp_path, 6)
    # Listing skips what it cannot read instead of failing on it.
    assert [x.id for x in jobs.all_jobs(tmp_path)] == [3]


def test_prune_keeps_the_newest_finished_and_every_active_job(tmp_path):
    for jid in range(1, 18):
        state = State.RUNNING if jid in (2, 3) else State.COMPLETED
        jobs.write(tmp_path, job(jid, state))
        jobs.job_dir(tmp_path, jid).mkdir()
        (jobs.job_dir(tmp_path, jid) / "stdout").write_text("x")
    jobs.cancel_path(tmp_path, 1).write_text("{}")
    with jobs.jobs_lock(tmp_path):
        gone = jobs.prune(tmp_path, keep=5)
    # 15 finished, keep the 5 newest; the two running ones stay whatever their age.
    assert gone == [1, *range(4, 13)]
    left = sorted(x.id for x in jobs.all_jobs(tmp_path))
    assert left == [2, 3, 13, 14, 15, 16, 17]
    assert not jobs.job_dir(tmp_path, 1).exists() and jobs.job_dir(tmp_path, 2).exists()
    assert not jobs.cancel_path(tmp_path, 1).exists()


# ---------------------------------------------------------------- LOST


def test_an_active_job_is_lost_when_its_supervisor_is_gone_or_from_another_boot(tmp_path):
    live = me()
    assert job(1, State.RUNNING, supervisor=live).shown(BOOT).state is State.RUNNING
    reused = {"pid": live["pid"], "start": live["start"] + 1}  # the pid, another process
    assert job(1, State.RUNNING, supervisor=reused).shown(BOOT).state is State.LOST
    assert job(1, State.RUNNING, supervisor=live).shown("boot-b").state is State.LOST
    assert job(1, State.PENDING, supervisor=None).shown(BOOT).state is State.LOST
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = {"pid": dead.pid, "start": 1}
    assert job(1, State.RUNNING, supervisor=gone).shown(BOOT).state is State.LOST
    # A finished record is what it is, whoever wrote it.
    assert job(1, State.COMPLETED, supervisor=gone).shown(BOOT).state is State.COMPLETED
    # Listing shows LOST ones by default (they want `cancel`), finished ones with --all;
    # nothing is written back.
    jobs.write(tmp_path, job(1, State.RUNNING, supervisor=gone))
    jobs.write(tmp_path, job(2, State.RUNNING, supervisor=live))
    jobs.write(tmp_path, job(3, State.COMPLETED))
    shown = jobs.listing(tmp_path, BOOT)
    assert [(x.id, x.state) for x in shown] == [(1, State.LOST), (2, State.RUNNING)]
    assert [x.id for x in jobs.listing(tmp_path, BOOT, finished=True)] == [1, 2, 3]
    assert jobs.listing(tmp_path, BOOT, env="other") == []
    assert jobs.read(tmp_path, 1).state is State.RUNNING
    assert [x.id for x in jobs.active_jobs(tmp_path, BOOT, "box")] == [2]


def test_a_zombie_supervisor_is_gone():
    proc = subprocess.Popen(["true"])
    try:
        # Not reaped yet: /proc still lists it, as Z, until wait().
        assert jobs.proc_start_time(proc.pid) is not None
        ident = jobs.identity(proc.pid)
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        assert jobs.proc_start_time(proc.pid)[0] == "Z"
        assert not jobs.supervisor_alive(job(1, State.RUNNING, supervisor=ident), BOOT)
    finally:
        proc.wait()


def test_wait_and_cancel_of_a_lost_job(tmp_path):
    host = Host(state_dir=tmp_path)
    host.__dict__["boot_id"] = BOOT
    dead = subprocess.Popen(["true"])
    dead.wait()
    jobs.write(tmp_path, job(1, State.RUNNING, supervisor={"pid": dead.pid, "start": 1}))
    jobs.write(tmp_path, job(2, State.COMPLETED, exit_code=0))
    got = sv.wait(host, [2, 1])
    assert [(x.id, x.state) for x in got] == [(2, State.COMPLETED), (1, State.LOST)]
    assert [x.exit_status() for x in got] == [0, 1]
    assert jobs.read(tmp_path, 1).state is State.RUNNING  # wait writes nothing
    final = sv.cancel(host, 1)
    assert final.state is State.LOST and final.end_time is not None
    assert jobs.read(tmp_path, 1) == final
    assert sv.cancel(host, 2) == jobs.read(tmp_path, 2)  # finished: left as it is


# ---------------------------------------------------------------- how a job ended


def exited(code: int) -> int:
    return code << 8


@pytest.mark.parametrize("status,kw,want", [
    (exited(0), {}, (State.COMPLETED, 0, None)),
    (exited(3), {}, (State.FAILED, 3, None)),
    (signal.SIGSEGV, {}, (State.FAILED, None, signal.SIGSEGV)),
    # SIGKILL is not OOM by itself, and exit 137 is not either: only the counter says so.
    (signal.SIGKILL, {}, (State.FAILED, None, signal.SIGKILL)),
    (exited(137), {}, (State.FAILED, 137, None)),
    (signal.SIGKILL, {"oom_kills": 1}, (State.OUT_OF_MEMORY, None, signal.SIGKILL)),
    # A job that survived the OOM kill of a child and exited 0 completed.
    (exited(0), {"oom_kills": 2}, (State.COMPLETED, 0, None)),
    (signal.SIGTERM, {"timed_out": True}, (State.TIMEOUT, None, signal.SIGTERM)),
    (signal.SIGTERM, {"cancelled": True}, (State.CANCELLED, None, signal.SIGTERM)),
    (exited(0), {"cancelled": True}, (State.CANCELLED, 0, None)),
    (signal.SIGKILL, {"cancelled": True, "oom_kills": 1},
     (State.CANCELLED, None, signal.SIGKILL)),
    (None, {"error": "exec failed"}, (State.FAILED, None, None)),
    (None, {"cancelled": True}, (State.CANCELLED, None, None)),
])
def test_final_state(status, kw, want):
    args = {"cancelled": False, "timed_out": False, "oom_kills": 0, **kw}
    assert jobs.final_state(wait_status=status, **args) == want


def test_exit_status_for_wait():
    assert job(1, State.COMPLETED, exit_code=0).exit_status() == 0
    assert job(1, State.FAILED, exit_code=3).exit_status() == 3
    assert job(1, State.FAILED, signal=11).exit_status() == 139
    assert job(1, State.CANCELLED, exit_code=0).exit_status() == 1
    assert job(1, State.LOST).exit_status() == 1


# ---------------------------------------------------------------- values and the table


@pytest.mark.parametrize("text,secs", [
    ("90", 5400), ("1", 60), ("90s", 90), ("15m", 900), ("1h30m", 5400), ("2d", 172800),
    ("1h0m5s", 3605), ("10:00", 600), ("1:30:00", 5400), ("2-01:00:00", 176400), (" 5M ", 300),
])
def test_parse_duration(text, secs):
    assert jobs.parse_duration(text) == secs


@pytest.mark.parametrize("text", ["", "0", "soon", "1x", "h", "1:2:3:4", "-5", "1.5h", "0s"])
def test_parse_duration_refuses(text):
    with pytest.raises(UsageError, match="--time-limit"):
        jobs.parse_duration(text)


def test_format_elapsed_and_exit():
    assert [jobs.format_elapsed(s) for s in (None, 0, 59.9, 61, 3600, 90061)] == [
        "-", "0:00", "0:59", "1:01", "1:00:00", "1-01:01:01"]
    assert jobs.format_exit(job(1, State.RUNNING)) == "-"
    assert jobs.format_exit(job(1, State.FAILED, exit_code=3)) == "3:0"
    assert jobs.format_exit(job(1, State.FAILED, signal=9)) == "0:9"


def test_table_rows():
    rows = jobs.table([job(4, State.RUNNING, name="bench", user="alice", start_time=100.0)],
                      now=190.0)
    assert rows[0] == ["ID", "NAME", "ENV", "USER", "STATE", "ELAPSED", "EXIT", "CPUS", "MEM",
                       "GPUS", "START", "PROGRAM"]
    assert rows[1][:7] == ["4", "bench", "box", "alice", "RUNNING", "1:30", "-"]


def test_parse_cpus():
    assert jobs.parse_cpus("0-2,5") == (0, 1, 2, 5)
    assert jobs.parse_cpus("3") == (3,)
    assert jobs.parse_cpus("1,,2") == (1, 2)  # read as a spec's list is
    for bad in ("", "a", "3-1", "1-", "99999999-"):
        with pytest.raises(UsageError):
            jobs.parse_cpus(bad, "--cpus")
    with pytest.raises(UsageError, match="runs backwards"):
        jobs.parse_cpus("3-1", "--cpus")


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize("argv,want", [
    (["submit-job", "box", "./x", "--name", "y"], ["submit-job", "box", "./x", "--", "--name",
                                                  "y"]),
    (["submit-job", "--name", "n", "box", "-t", "5", "./x", "-a"],
     ["submit-job", "--name", "n", "box", "-t", "5", "./x", "--", "-a"]),
    (["-C", "dir", "submit-job", "box", "--env=A=1", "./x", "--debug"],
     ["-C", "dir", "submit-job", "box", "--env=A=1", "./x", "--", "--debug"]),
    (["submit-job", "box", "--wait", "./x"], ["submit-job", "box", "--wait", "./x", "--"]),
    (["submit-job", "box", "--", "./x", "-a"], ["submit-job", "box", "--", "./x", "-a"]),
    (["submit-job", "box"], ["submit-job", "box"]),
    (["submit-job", "box", "./x", "--", "-a"], ["submit-job", "box", "./x", "--", "-a"]),
    (["exec", "box", "--", "x", "--name"], ["exec", "box", "--", "x", "--name"]),
])
def test_split_job_args(argv, want):
    from envctl.cli import split_job_args

    assert split_job_args(argv) == want


def test_submit_options_of_the_fast_path_match_the_command():
    """The fast parser (envctl.runtime.submit) knows exactly the typer command's options."""
    import typer

    from envctl import cli
    from envctl.runtime.submit import FLAGS, VALUE_OPTIONS

    command = typer.main.get_command(cli.app).commands["submit-job"]
    options = [p for p in command.params if p.param_type_name == "option"]
    takes_value = {o for p in options if not p.is_flag for o in p.opts}
    flags = {o for p in options if p.is_flag for o in p.opts} - {"--help"}
    assert takes_value == set(VALUE_OPTIONS)
    assert flags == set(FLAGS)



@pytest.mark.parametrize("argv", [
    ["submit-job", "box", "./x"], ["submit-job", "box", "./x", "-a", "--name", "n"],
    ["submit-job", "box", "./x", "--", "-a"], ["submit-job", "box", "./x", "--", "--"],
    ["submit-job", "box", "--", "./x", "--", "-a"], ["submit-job", "-J", "n", "box", "./x", "--"],
    ["submit-job", "box", "-t", "5m", "--env", "A=1", "--env=B=2", "-W", "./x", "$(id)", ";"],
    ["submit-job", "--json", "-u", "root", "box", "-o", "/o", "./x", "-o", "/p"],
    ["submit-job", "--cpus", "2", "--mem=1G", "--gpus", "0,", "box", "./x", "--mem", "2G"]])
def test_the_fast_path_and_the_typer_command_submit_the_same(monkeypatch, argv):
    """Both parsers on the same command line end in the same `submit` call."""
    from envctl import cli
    from envctl.runtime import submit as submit_mod

    calls = []

    def fake(env, exe, args, **kw):
        calls.append({"env": env, "exe": exe, "args": list(args), **kw})
        return 0

    monkeypatch.setattr(submit_mod, "submit", fake)
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    assert exc.value.code == 0
    fast = submit_mod.parse_args(list(argv))
    defaults = {"name": None, "time_limit": None, "cpus": None, "gpus": None, "env_vars": None,
                "workdir": "/", "output": None, "error": None, "user": None, "wait": False,
                "json_": False, "mem": None}
    assert calls == [{**defaults, **fast}]


def test_submit_fast_parser_reads_what_typer_reads():
    import inspect

    from envctl.runtime.submit import parse_args, submit

    every = ["submit-job", "-J", "n", "--time-limit=5m", "--cpus", "0", "--gpus", "0",
             "--mem", "1G", "--env", "A=1", "--env=B=2", "-D", "/tmp", "-o", "/o", "--error",
             "/e", "-u", "root", "-W", "--json", "box", "./x", "--name", "-y", "--", "$(id)"]
    got = parse_args(every)
    assert got == {"env": "box", "exe": "./x", "args": ["--name", "-y", "--", "$(id)"],
                   "name": "n", "time_limit": "5m", "cpus": "0", "gpus": "0", "mem": "1G",
                   "env_vars": ["A=1", "B=2"], "workdir": "/tmp", "output": "/o",
                   "error": "/e", "user": "root", "wait": True, "json_": True}
    inspect.signature(submit).bind(**got)  # every keyword is one `submit` takes
    assert parse_args(["submit-job", "box", "--", "./x", "-a"])["args"] == ["-a"]
    assert parse_args(["submit-job", "box", "./x"])["args"] == []
    # Left to typer, which answers with its own messages:
    for args in (["submit-job", "--help"], ["submit-job", "box"], ["submit-job", "-Jn", "b", "x"],
                 ["submit-job", "--debug", "b", "x"],
                 ["submit-job", "--name"], ["exec", "b", "x"], ["submit-job", "-t=5", "b", "x"]):
        assert parse_args(args) is None, args


def test_an_argument_like_an_option_reaches_the_job(monkeypatch):
    """Parsed by the real CLI up to the point it would submit: the job's argv is literal."""
    from envctl import cli
    from envctl.runtime import supervisor

    seen = {}

    class Stop(Exception):
        pass

    def fake_make_request(host, ctx, exe, args, **kw):
        seen.update(exe=exe, args=args, **kw)
        raise Stop

    monkeypatch.setattr(supervisor, "make_request", fake_make_request)
    monkeypatch.setattr("envctl.runtime.context.EnvContext.load", lambda host, env: None)
    with pytest.raises(Stop):
        cli.main(["submit-job", "-t", "1m", "box", "--name", "n", "./x", "--name",
                  "$(rm -rf /)", "-t", "a;b"])
    assert seen["exe"] == "./x" and seen["name"] == "n" and seen["time_limit"] == "1m"
    assert seen["args"] == ["--name", "$(rm -rf /)", "-t", "a;b"]


# ---------------------------------------------------------------- checking a request


def ctx_for(root: Path, **kw) -> EnvContext:
    return EnvContext(env="box", root=root, mntns=root / "ns", netns=None, hostname="box",
                      environ={"PATH": "/usr/bin:/bin"}, cpus=(0, 1), **kw)


def test_check_request(tmp_path):
    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")
    (root / "usr" / "bin" / "sh").write_text("")  # the #! interpreter of x.sh
    exe = tmp_path / "x.sh"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    py = tmp_path / "p.py"
    py.write_text("print(1)\n")
    ctx = ctx_for(root, gpus=("GPU-a",))
    with pytest.raises(HostError, match="no /job"):
        sv.check_request(ctx, sv.Request(exe=exe))
    (root / "job").mkdir()
    assert sv.check_request(ctx, sv.Request(exe=exe, args=["-a"])) == (["/job/x.sh", "-a"],
                                                                       "x.sh")
    with pytest.raises(InputError, match="no python3"):
        sv.check_request(ctx, sv.Request(exe=py))
    (root / "usr" / "bin" / "python3").write_text("")
    assert sv.check_request(ctx, sv.Request(exe=py))[0] == ["/usr/bin/python3", "/job/p.py"]
    exe.chmod(0o644)
    with pytest.raises(InputError, match="not executable"):
        sv.check_request(ctx, sv.Request(exe=exe))
    exe.chmod(0o755)
    with pytest.raises(InputError, match="CPU.*2"):
        sv.check_request(ctx, sv.Request(exe=exe, cpus=(1, 2)))
    with pytest.raises(InputError, match="GPU-b"):
        sv.check_request(ctx, sv.Request(exe=exe, gpus=("GPU-b",)))
    with pytest.raises(InputError, match="workdir"):
        sv.check_request(ctx, sv.Request(exe=exe, workdir="tmp"))
    with pytest.raises(InputError, match="does not exist"):
        sv.check_request(ctx, sv.Request(exe=exe, output=tmp_path / "no" / "out"))
    with pytest.raises(InputError, match="No such file"):
        sv.check_request(ctx, sv.Request(exe=tmp_path / "missing"))
    with pytest.raises(InputError, match="regular file"):
        sv.check_request(ctx, sv.Request(exe=tmp_path))


def test_gpus_by_host_index_or_uuid(tmp_path):
    from envctl.engine.journal import Journal

    host = Host(state_dir=tmp_path)
    host.__dict__["boot_id"] = ""
    journal = Journal.open(tmp_path, "box")
    journal.set_meta({"claims": {"gpus": {"all": False, "indices": [2, 3],
                                          "uuids": ["GPU-c", "GPU-d"]}}})
    ctx = ctx_for(tmp_path, gpus=("GPU-c", "GPU-d"))
    assert sv.resolve_gpus(host, ctx, "3,GPU-c,3") == ("GPU-d", "GPU-c")
    with pytest.raises(InputError, match="2=GPU-c, 3=GPU-d"):
        sv.resolve_gpus(host, ctx, "0")
    with pytest.raises(InputError):
        sv.resolve_gpus(host, ctx, "GPU-x")


# ---------------------------------------------------------------- following output


def test_follow_copies_until_the_supervisor_ends(tmp_path):
    out = tmp_path / "stdout"
    out.write_bytes(b"first\n")
    fake = subprocess.Popen(["sleep", "600"])  # stands in for the job's supervisor
    try:
        running = job(1, State.RUNNING, supervisor=jobs.identity(fake.pid))
        jobs.write(tmp_path, running)
        got: list[bytes] = []
        copied = threading.Event()

        def write(chunk: bytes) -> None:
            got.append(chunk)
            if b"".join(got).endswith(b"second\n"):
                copied.set()

        t = threading.Thread(target=jobs.follow, args=(tmp_path, running, out, write),
                             kwargs={"boot_id": BOOT, "recheck": 600})
        t.start()
        with open(out, "ab") as f:
            f.write(b"second\n")
        assert copied.wait(30), "a write was not followed (no inotify wake-up)"
        with open(out, "ab") as f:
            f.write(b"last\n")
        fake.kill()
        fake.wait()
        t.join(30)
        assert not t.is_alive(), "follow did not end with the supervisor"
        assert b"".join(got) == b"first\nsecond\nlast\n"
    finally:
        fake.kill()
        fake.wait()


def test_follow_of_a_finished_job_prints_the_file_and_returns(tmp_path):
    out = tmp_path / "stdout"
    out.write_bytes(b"all of it\n")
    got: list[bytes] = []
    jobs.follow(tmp_path, job(1, State.COMPLETED), out, got.append, boot_id=BOOT)
    assert b"".join(got) == b"all of it\n"


def test_a_scripts_interpreter_must_be_in_the_environment(tmp_path):
    """`#!` names its interpreter; `#!/usr/bin/env NAME` the program env runs: each must be
    in the rootfs (resolved beneath it), or submit-job refuses, naming it."""
    from envctl.errors import InputError
    from envctl.runtime.context import EnvContext
    from envctl.runtime.supervisor import _check_interpreter

    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "bin").symlink_to("usr/bin")
    for name in ("sh", "env"):
        (tmp_path / "usr" / "bin" / name).write_text("")
    # An absolute link, resolved inside the rootfs as the environment resolves it.
    (tmp_path / "usr" / "bin" / "dash").symlink_to("/usr/bin/sh")
    (tmp_path / "usr" / "bin" / "gone").symlink_to("/nonexistent")
    ctx = EnvContext(env="box", root=tmp_path, mntns=tmp_path / "m", netns=None,
                     hostname="box", environ={"PATH": "/usr/bin:/bin"})
    exe = Path("/x/job")
    for ok in (b"#!/bin/sh -e\n", b"#!/usr/bin/env sh\n", b"\x7fELF", b"", b"#!\n",
               b"#!/usr/bin/env -S sh -e\n", b"#!/bin/dash\n", b"#!/../../usr/bin/sh\n"):
        _check_interpreter(ctx, exe, ok)
    for bad, named in ((b"#!/usr/bin/perl\n", "/usr/bin/perl"),
                       (b"#! /bin/bash -x\n", "/bin/bash"),
                       (b"#!/usr/bin/env python3\n", "python3"),
                       (b"#!perl\n", "perl"),
                       (b"#!/usr/bin/gone\n", "/usr/bin/gone")):
        with pytest.raises(InputError) as exc:
            _check_interpreter(ctx, exe, bad)
        assert f"interpreter {named}" in str(exc.value) and "'box'" in str(exc.value)


# ---------------------------------------------------------------- a program of the environment


def rootfs_with_programs(root: Path) -> None:
    """usr/bin/sleep, python3 -> python3.11 (relative) and an absolute link, a file with no
    execute bit, and links that leave the tree."""
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")
    (root / "job").mkdir()
    for name in ("sleep", "python3.11"):
        (root / "usr" / "bin" / name).write_text("")
        (root / "usr" / "bin" / name).chmod(0o755)
    (root / "usr" / "bin" / "python3").symlink_to("python3.11")
    (root / "usr" / "bin" / "py").symlink_to("/usr/bin/python3.11")  # absolute, inside
    (root / "usr" / "bin" / "noexec").write_text("")
    (root / "usr" / "bin" / "noexec").chmod(0o644)


def test_a_bare_name_is_found_in_the_environments_path_and_never_leaves_the_rootfs(tmp_path):
    root = tmp_path / "root"
    rootfs_with_programs(root)
    outside = tmp_path / "host-only"
    outside.write_text("")
    outside.chmod(0o755)
    (root / "usr" / "bin" / "escape").symlink_to(outside)          # absolute: a host file
    (root / "usr" / "bin" / "climb").symlink_to("../../../host-only")  # relative, climbs
    ctx = ctx_for(root)
    find = sv.find_in_rootfs
    assert find(ctx, "sleep", executable=True) == "/usr/bin/sleep"
    assert find(ctx, "python3", executable=True) == "/usr/bin/python3"
    assert find(ctx, "py", executable=True) == "/usr/bin/py"
    assert find(ctx, "sleep", "/bin", executable=True) == "/bin/sleep"
    # A later PATH entry when the first has no such program; relative entries are skipped.
    assert find(ctx, "sleep", "relative:/opt/none:/usr/bin", executable=True) == \
        "/usr/bin/sleep"
    for name in ("noexec", "escape", "climb", "nothing", "", ".", "..", "bin/sleep"):
        assert find(ctx, name, executable=True) is None, name
    # A symlink out of the tree resolves inside it, as the environment sees it: /host-only
    # there is nothing, whatever the host has at that path.
    (root / "host-only").write_text("")
    (root / "host-only").chmod(0o755)
    assert find(ctx, "climb", executable=True) == "/usr/bin/climb"


def test_make_request_runs_a_bare_name_from_the_rootfs_and_stages_a_path(tmp_path,
                                                                         monkeypatch):
    root = tmp_path / "root"
    rootfs_with_programs(root)
    ctx = ctx_for(root)
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    host = Host(state_dir=tmp_path / "state")
    environ = {"SUDO_UID": "0", "SUDO_GID": "0", "SUDO_USER": "root"}

    def request(exe: str, **kw) -> sv.Request:
        return sv.make_request(host, ctx, exe, ["1"], user="root", environ=environ, **kw)

    req = request("sleep")
    assert req.program == "/usr/bin/sleep"
    assert sv.check_request(ctx, req) == (["/usr/bin/sleep", "1"], "")
    # --env PATH is the job's PATH: the search follows it.
    assert request("sleep", env=["PATH=/bin"]).program == "/bin/sleep"
    with pytest.raises(InputError) as exc:
        request("sleep", env=["PATH=/opt/none"])
    assert "PATH (/opt/none)" in str(exc.value) and "'box'" in str(exc.value)
    with pytest.raises(InputError) as exc:
        request("perl")
    assert "no program of that name in environment 'box''s PATH (/usr/bin:/bin)" in \
        str(exc.value) and "./perl" in str(exc.value)
    # A file of that name here, or anything with a '/', is this host's: staged.
    (here / "sleep").write_text("#!/bin/sh\n")
    (here / "sleep").chmod(0o755)
    (root / "usr" / "bin" / "sh").write_text("")
    for exe in ("sleep", "./sleep", str(here / "sleep")):
        req = request(exe)
        assert req.program == "", exe
        assert sv.check_request(ctx, req) == (["/job/sleep", "1"], "sleep"), exe
    with pytest.raises(InputError, match="No such file"):
        sv.check_request(ctx, request("./perl"))
    # A script of the rootfs whose #! interpreter is not there: refused, naming it.
    tool = root / "usr" / "bin" / "tool"
    tool.write_text("#!/usr/bin/perl\nprint 1;\n")
    tool.chmod(0o755)
    with pytest.raises(InputError, match="its interpreter /usr/bin/perl"):
        sv.check_request(ctx, request("tool"))
    tool.write_text("#!/bin/sh\necho\n")
    assert sv.check_request(ctx, request("tool"))[0] == ["/usr/bin/tool", "1"]


def test_the_record_says_where_the_program_came_from():
    staged = job(1, State.COMPLETED, program={"staged": "/home/a/bench"})
    ran = job(2, State.RUNNING, program={"rootfs": "/usr/bin/sleep"})
    old = job(3, State.COMPLETED)  # a record of an older envctl
    assert [jobs.format_program(j) for j in (staged, ran, old)] == [
        "staged:/home/a/bench", "rootfs:/usr/bin/sleep", "-"]
    assert [r[-1] for r in jobs.table([staged, ran, old], now=0)[1:]] == [
        "staged:/home/a/bench", "rootfs:/usr/bin/sleep", "-"]
    assert ran.to_json()["program"] == {"rootfs": "/usr/bin/sleep"}


def test_table_shows_the_slice():
    rows = jobs.table([job(4, State.RUNNING, cpus=[0, 1, 2, 5], mem_bytes=3 << 29,
                           gpus=["GPU-a"]), job(5, State.RUNNING)], now=190.0)
    assert rows[1][7:10] == ["0-2,5", "1.5G", "1"]
    assert rows[2][7:10] == ["-", "-", "-"]
    assert jobs.format_mem(64 << 20) == "64M" and jobs.format_mem(None) == "-"


# ---------------------------------------------------------------- long durations


def test_durations_up_to_365_days_are_accepted_and_more_refused():
    assert jobs.parse_duration("365d") == jobs.MAX_DURATION == 365 * 86400
    assert jobs.parse_duration("365-00:00:00") == jobs.MAX_DURATION
    for text in ("366d", "365-00:00:01", str(365 * 1440 + 1), "8760h1s"):
        with pytest.raises(UsageError, match="at most 365 days"):
            jobs.parse_duration(text)
    assert jobs.check_grace(0) == 0 and jobs.check_grace(jobs.MAX_DURATION) == jobs.MAX_DURATION
    for bad in (-1, jobs.MAX_DURATION + 1, float("inf"), float("nan")):
        with pytest.raises(UsageError, match="--grace"):
            jobs.check_grace(bad)


def test_each_poll_is_bounded_so_any_accepted_wait_fits_a_c_int():
    from envctl.runtime.daemon import POLL_MAX, poll_ms, wait_fd

    assert poll_ms(None) is None and poll_ms(-5) == 0 and poll_ms(0.0001) == 1
    assert poll_ms(jobs.MAX_DURATION) == poll_ms(float("inf")) == POLL_MAX * 1000 < 2**31
    r, w = os.pipe()
    try:
        # Before: poll(365 days in ms) raised OverflowError, which killed the supervisor.
        assert wait_fd(r, 0.01) is False
        os.write(w, b"x")
        assert wait_fd(r, jobs.MAX_DURATION) is True
    finally:
        os.close(r)
        os.close(w)


def test_a_grace_from_the_environment_is_bounded(monkeypatch):
    from envctl.host.cgroups import kill_grace_from_env
    from envctl.runtime import service

    for value, want in (("inf", 365 * 86400.0), ("nan", None), ("-3", 0.0), ("2.5", 2.5)):
        monkeypatch.setenv("ENVCTL_KILL_GRACE", value)
        assert kill_grace_from_env() == (5.0 if want is None else want)
        assert service._grace() == (service.DEFAULT_GRACE if want is None else want)


def test_accounting_columns_and_the_stored_record(tmp_path):
    j = job(5, State.COMPLETED, start_time=10.0, end_time=3730.25, cpu_seconds=61.5,
            cpu_user_seconds=60.0, cpu_system_seconds=1.5, peak_memory_bytes=1 << 30,
            requested={"cpus": 2, "mem": 1 << 29, "gpus": ["GPU-x"]}, time_limit=7200)
    rows = jobs.table([j], now=0, fields=("elapsed", "cpu_time", "cpu_user", "cpu_sys",
                                          "maxrss", "req_cpus", "req_mem", "req_gpus",
                                          "time_limit", "gpu_seconds", "energy_j"))
    assert rows[1] == ["1:02:00", "1:01.500", "1:00.000", "0:01.500", "1G", "2", "512M", "1",
                       "2:00:00", "-", "-"]
    assert jobs.table([j], now=0)[0] == [jobs.FIELDS[f][0] for f in jobs.DEFAULT_FIELDS]
    # `elapsed` is derived for readers, never stored: the record holds the times.
    assert j.to_json()["elapsed"] == 3720.25
    jobs.write(tmp_path, j)
    import json

    stored = json.loads(jobs.record_path(tmp_path, 5).read_text())
    assert "elapsed" not in stored and stored["cpu_user_seconds"] == 60.0
    assert jobs.read(tmp_path, 5) == j


def test_parse_fields():
    assert jobs.parse_fields(" ID,cpu_user , energy_j") == ("id", "cpu_user", "energy_j")
    for bad in ("", ",", "id,rss"):
        with pytest.raises(UsageError, match="allowed: id, name"):
            jobs.parse_fields(bad)


def test_table_cells_are_printable():
    # A job's name and argv are its submitter's: the table shows them escaped, one row each.
    assert jobs.printable("train-1 ok") == "train-1 ok"
    assert jobs.printable("a\x1b]52;c;eA==\x07b\nc\u202e") == "a\\x1b]52;c;eA==\\x07b\\nc\\u202e"


def test_a_duration_that_is_no_number_of_ours_is_the_usage_error():
    for text in ("²", "1²m", "٣:00", "9" * 5000, "1" * 33 + "s"):
        with pytest.raises(UsageError, match="--time-limit"):
            jobs.parse_duration(text)
