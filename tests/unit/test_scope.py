"""envctl.host.scope: when a process counts as moved into its transient scope, and a process
that ended before systemd moved it (a zombie's pid is accepted and never moved)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from envctl.host.scope import ScopeError, attach_scope, attached, begin_scope

WANT = "/envctl.slice/envctl-box.slice/envctl-box-42.scope"


def test_moved_means_every_hierarchy_the_scope_has_a_cgroup_in(tmp_path):
    memory, pids = tmp_path / "memory", tmp_path / "pids"
    (memory / WANT.lstrip("/")).mkdir(parents=True)  # systemd made the scope's cgroup there
    pids.mkdir()  # … and none in pids: the process stays where it was
    v1 = {"memory": str(memory), "pids": str(pids)}
    half = f"12:pids:/user.slice\n4:memory:/user.slice\n1:name=systemd:{WANT}\n0::{WANT}\n"
    assert not attached(half, WANT, v1)  # seen between systemd's two moves
    done = f"12:pids:/user.slice\n4:memory:{WANT}\n1:name=systemd:{WANT}\n0::{WANT}\n"
    assert attached(done, WANT, v1)
    assert attached(f"0::{WANT}\n", WANT, {})  # cgroup v2 alone
    assert not attached("0::/user.slice\n", WANT, {})


def _zombie() -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while True:  # until it has exited and is not reaped: a zombie
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            stat = f.read()
        if stat[stat.rfind(b")") + 2:][:1] == b"Z":
            return child
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)


def test_a_process_that_ended_is_reported_at_once_not_after_the_timeout():
    child = _zombie()
    try:
        t0 = time.monotonic()
        with pytest.raises(ScopeError, match=f"process {child.pid} exited"):
            attach_scope("envctl-box.slice", "envctl.slice/envctl-box.slice", child.pid,
                         runner=lambda argv: subprocess.CompletedProcess(argv, 0, "", ""),
                         timeout=60)
        assert time.monotonic() - t0 < 30  # not the 60 s timeout
    finally:
        child.wait()


def _fake_proc(tmp_path, pid: int, cgroup: str):
    (tmp_path / str(pid)).mkdir()
    (tmp_path / str(pid) / "cgroup").write_text(f"0::{cgroup}\n")
    (tmp_path / str(pid) / "stat").write_text(f"{pid} (python3) S 1 2 3\n")
    return tmp_path


def _busctl(tmp_path, code: int, message: str = "") -> list[str]:
    """A stand-in for busctl that logs its arguments and answers with `code` (its message on
    stderr)."""
    script = (f"import sys; open({str(tmp_path / 'argv')!r}, 'w').write(repr(sys.argv[1:])); "
              f"sys.stderr.write({message!r}); sys.exit({code})")
    return [sys.executable, "-c", script]


def test_begin_scope_asks_systemd_for_the_named_scope_and_finish_waits_for_the_move(tmp_path):
    scope = "envctl-box-job7-supervisor-42.scope"
    (tmp_path / "proc").mkdir()
    proc = _fake_proc(tmp_path / "proc", 42, f"/envctl.slice/envctl-box.slice/{scope}")
    call = begin_scope("envctl-box.slice", "envctl.slice/envctl-box.slice", 42, scope,
                       busctl=_busctl(tmp_path, 0), proc=str(proc))
    assert call.finish(timeout=60) == scope
    argv = eval((tmp_path / "argv").read_text())  # noqa: S307 - what the fake wrote
    assert argv[:5] == ["call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                        "org.freedesktop.systemd1.Manager", "StartTransientUnit"]
    assert argv[6:8] == [scope, "fail"]
    assert argv[9:13] == ["PIDs", "au", "1", "42"]
    assert argv[13:16] == ["Slice", "s", "envctl-box.slice"]


def test_a_scope_systemd_refuses_is_an_error_naming_why(tmp_path):
    (tmp_path / "proc").mkdir()
    proc = _fake_proc(tmp_path / "proc", 42, "/user.slice/session-1.scope")
    call = begin_scope("envctl-box.slice", "envctl.slice/envctl-box.slice", 42, "x.scope",
                       busctl=_busctl(tmp_path, 1, "Unit x.scope already exists."),
                       proc=str(proc))
    with pytest.raises(ScopeError, match="process 42: Unit x.scope already exists"):
        call.finish(timeout=60)


def test_a_missing_busctl_is_an_error_at_once(tmp_path):
    with pytest.raises(ScopeError, match="no-such-busctl"):
        begin_scope("envctl-box.slice", "envctl.slice/envctl-box.slice", 42, "x.scope",
                    busctl=[str(tmp_path / "no-such-busctl")])


def test_scope_properties_are_added_to_the_call():
    """A job's --mem reaches its scope as MemoryMax= (the systemd driver), counted in the
    property array's length."""
    from envctl.host.scope import _call

    plain = _call(("busctl",), "envctl-box.slice", "envctl-box-42.scope", 42)
    assert plain[plain.index("fail") + 1] == "3" and plain[-1] == "0"
    argv = _call(("busctl",), "envctl-box.slice", "envctl-box-42.scope", 42,
                 (("MemoryMax", "t", "1073741824"),))
    assert argv[argv.index("fail") + 1] == "4"
    assert argv[-5:] == ["inactive-or-failed", "MemoryMax", "t", "1073741824", "0"]
