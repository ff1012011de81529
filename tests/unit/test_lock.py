"""The global lock: exclusion, waiting, and tidying an empty state directory safely."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from envctl.engine.lock import global_lock
from envctl.errors import LockTimeout


def test_empty_state_dir_is_removed_on_release(tmp_path):
    state = tmp_path / "state"
    with global_lock(state):
        (state / "journal").mkdir()
    assert not state.exists()


def test_state_with_content_is_kept(tmp_path):
    state = tmp_path / "state"
    with global_lock(state):
        (state / "journal").mkdir()
        (state / "journal" / "a.json").write_text("{}")
    assert (state / "journal" / "a.json").exists() and (state / "lock").exists()


def test_timeout_names_the_holder(tmp_path):
    state = tmp_path / "state"
    with global_lock(state):
        (state / "keep").write_text("x")
        waited, raised = [], []

        def other() -> None:  # another thread: this one's own hold would be re-entered
            with pytest.raises(LockTimeout, match="held by pid") as exc, global_lock(
                    state, timeout=0.2, on_wait=waited.append):
                pass
            raised.append(exc.value)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert raised, "the second holder did not time out"
        assert waited and "waiting for another envctl" in waited[0]


def test_a_waiter_does_not_keep_a_lock_on_a_removed_file(tmp_path):
    """A holds the lock and tidies the directory away; B (waiting on the old file) must
    take a fresh lock file, so that C starting afterwards is still excluded by B."""
    state = tmp_path / "state"
    events: list[str] = []
    b_waiting = threading.Event()
    b_has_lock = threading.Event()
    release_b = threading.Event()

    def b() -> None:
        with global_lock(state, timeout=60, on_wait=lambda msg: b_waiting.set()):
            events.append("B in")
            b_has_lock.set()
            (state / "keep").write_text("x")  # so B's release does not tidy
            release_b.wait(60)
            events.append("B out")

    with global_lock(state):
        t = threading.Thread(target=b)
        t.start()
        assert b_waiting.wait(60)  # B is blocked on A's lock file, which A now removes
    assert b_has_lock.wait(60)
    with pytest.raises(LockTimeout), global_lock(state, timeout=0.3):
        pass  # C: excluded, because B holds the lock file that now exists
    release_b.set()
    t.join(60)
    assert events == ["B in", "B out"]



def test_empty_state_dir_is_removed_after_an_error_too(tmp_path):
    state = tmp_path / "state"
    with pytest.raises(RuntimeError), global_lock(state):
        raise RuntimeError("step failed, everything rolled back")
    assert not state.exists()


def test_a_state_directory_tidied_away_under_a_starting_envctl_is_made_again(tmp_path,
                                                                             monkeypatch):
    """The holder before us removes the empty state directory between our mkdir and our open
    of the lock file: retry, never crash with ENOENT."""
    import os

    from envctl.engine import lock

    state = tmp_path / "state"
    real_open = os.open
    raced = []

    def racing_open(path, flags, mode=0o777):
        if not raced and str(path).endswith("/lock"):
            raced.append(path)
            os.rmdir(state)  # empty: as the previous holder's _tidy leaves it
        return real_open(path, flags, mode)

    monkeypatch.setattr(lock.os, "open", racing_open)
    with global_lock(state):
        assert (state / "lock").exists()
    assert raced


def test_a_hold_inside_a_hold_of_the_same_thread_is_the_same_hold(tmp_path):
    """`up` of environments with MIG instances holds the lock across both halves, each of
    which takes it again: no deadlock, one release (the inner exit tidies nothing), and
    another thread or a forked child still waits for the outer hold."""
    import os

    state = tmp_path / "state"
    with global_lock(state):
        with global_lock(state, timeout=0.2):
            pass
        assert (state / "lock").exists()  # still held: the inner exit did not tidy it away
        failed = []

        def other() -> None:
            try:
                with global_lock(state, timeout=0.2):
                    pass
            except LockTimeout:
                failed.append("thread")

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert failed == ["thread"]
        pid = os.fork()
        if pid == 0:
            try:
                with global_lock(state, timeout=0.2):
                    os._exit(0)
            except LockTimeout:
                os._exit(7)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 7
    assert not state.exists()
    with global_lock(state, timeout=0.2):  # released: free for anyone
        pass


@pytest.mark.skipif(os.geteuid() != 0, reason="opening the lock as another user needs root")
def test_no_other_user_can_open_and_hold_the_lock():
    """flock needs only a descriptor: with the lock file 0644 (before), `nobody` opened it
    read-only and held it for ever, so every up, down and boot's up --all waited, then
    failed. It is 0600; an older envctl's 0644 one is replaced by the first holder. (In a
    directory nobody may enter, as /var/lib is: pytest's tmp_path is 0700.)"""
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    top = Path(tempfile.mkdtemp(prefix="lockmode."))
    try:
        os.chmod(top, 0o755)
        state = top / "state"
        state.mkdir(mode=0o755)
        (state / "lock").write_text("")
        os.chmod(state / "lock", 0o644)  # as an older envctl left it

        def nobody_opens() -> subprocess.CompletedProcess:
            return subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-c",
                                   f"import os; os.open({str(state / 'lock')!r}, os.O_RDONLY)"],
                                  capture_output=True, text=True, timeout=60)

        assert nobody_opens().returncode == 0  # the attack's first step, before
        with global_lock(state):
            (state / "keep").write_text("x")
        assert stat.S_IMODE(os.stat(state / "lock").st_mode) == 0o600
        res = nobody_opens()
        assert res.returncode != 0 and "Permission denied" in res.stderr, res.stderr
        assert sorted(os.listdir(state)) == ["keep", "lock"]
    finally:
        shutil.rmtree(top)
