"""envctl.host.scope: when a process counts as moved into its transient scope, and a process
that ended before systemd moved it (a zombie's pid is accepted and never moved)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from envctl.host.scope import ScopeError, attach_scope, attached

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
