"""envctl.retry: the list of environments this boot's `up` left down (what `up NAME`, `down`
and another `up --all` do to it) and the backoff loop of `up --retry`, with a fake clock."""

from __future__ import annotations

import json
import os
import stat

from envctl import retry as rt


class Clock:
    """time.monotonic and time.sleep of a clock that only moves when slept on."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, d: float) -> None:
        self.slept.append(d)
        self.now += d


def test_delays_double_from_one_second_up_to_the_cap():
    d = rt.delays()
    assert [next(d) for _ in range(9)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]


def test_retry_stops_as_soon_as_everything_is_up():
    clock = Clock()
    tries = []

    def attempt(names):
        tries.append(list(names))
        return [] if len(tries) == 3 else names  # fixed before the third try

    assert rt.retry(attempt, ["web"], window=600, sleep=clock.sleep, clock=clock) == []
    assert tries == [["web"]] * 3 and clock.slept == [1, 2, 4]


def test_retry_gives_up_at_the_window_with_a_last_try_at_its_end():
    clock = Clock()
    tries = []

    def attempt(names):
        tries.append(clock.now)
        return names

    waits = []
    left = rt.retry(attempt, ["a", "b"], window=600, sleep=clock.sleep, clock=clock,
                    on_wait=lambda d, names: waits.append((d, names)))
    assert left == ["a", "b"]
    # 1+2+4+8+16+32 = 63 s, then every 60 s, the last wait cut to end at 600 s.
    assert clock.slept[:7] == [1, 2, 4, 8, 16, 32, 60]
    assert sum(clock.slept) == 600 and tries[-1] == 700.0
    assert max(clock.slept) == 60 and len(tries) == len(clock.slept) == 15
    assert waits[0] == (1, ["a", "b"])


def test_what_each_try_returns_is_what_the_next_one_tries():
    clock = Clock()
    tries = []

    def attempt(names):
        tries.append(list(names))
        return {2: ["b"], 3: []}.get(len(tries) + 1, names)

    assert rt.retry(attempt, ["a", "b"], window=60, sleep=clock.sleep, clock=clock) == []
    assert tries == [["a", "b"], ["b"]]


def test_nothing_pending_or_no_window_tries_nothing():
    clock = Clock()
    assert rt.retry(lambda n: 1 / 0, [], window=600, sleep=clock.sleep, clock=clock) == []
    assert rt.retry(lambda n: 1 / 0, ["a"], window=0, sleep=clock.sleep, clock=clock) == ["a"]
    assert clock.slept == []


def test_the_list_follows_up_all_up_name_and_down(tmp_path):
    run = tmp_path / "run"
    assert rt.read_not_up(run, "boot1") == []
    # `up --all` of a, b, c: b skipped, c failed.
    rt.record_attempt(run, "boot1", ["a", "b", "c"], ["b", "c"])
    assert rt.read_not_up(run, "boot1") == ["b", "c"]
    rec = json.loads((run / "not-up.json").read_text())
    assert rec["boot_id"] == "boot1" and rec["envs"] == ["b", "c"]
    # Another boot's list is nobody's.
    assert rt.read_not_up(run, "boot2") == []
    # `up b` brought it up; `down c` took it off on purpose: never brought back by a retry.
    rt.record_attempt(run, "boot1", ["b"], [])
    assert rt.read_not_up(run, "boot1") == ["c"]
    rt.record_attempt(run, "boot1", ["c"], [])
    assert not (run / "not-up.json").exists()
    # A damaged file is an empty list, not a failure.
    run.joinpath("not-up.json").write_text("{")
    assert rt.read_not_up(run, "boot1") == []


def test_a_round_never_brings_up_what_was_taken_down_during_its_wait(tmp_path, monkeypatch):
    """`down b` while `up --retry` waits takes b off the list: the next round tries a alone
    (attacker review: the round used to try what the previous one left)."""
    from types import SimpleNamespace

    from envctl import commands

    host = SimpleNamespace(run_dir=tmp_path / "run", boot_id="boot1")
    rt.record_attempt(host.run_dir, "boot1", ["a", "b"], ["a", "b"])
    tried: list[list[str]] = []

    def up(names, opts, *, each):
        tried.append(list(names))  # nothing comes up
        return 1

    clock = Clock()
    sleep = clock.sleep

    def down_b_while_waiting(d):
        sleep(d)
        if len(clock.slept) == 1:
            rt.record_attempt(host.run_dir, "boot1", ["b"], [])

    clock.sleep = down_b_while_waiting
    monkeypatch.setattr(commands, "up", up)
    monkeypatch.setattr(rt, "retry", lambda attempt, pending, **kw: _retry(attempt, pending,
                                                                           clock, **kw))
    assert commands._retry_rounds(host, None, 3.0, rt) == 1
    assert tried and all(t == ["a"] for t in tried), tried  # (the first try follows a wait)


_RETRY = rt.retry


def _retry(attempt, pending, clock, **kw):
    return _RETRY(attempt, pending, sleep=clock.sleep, clock=clock, **kw)



def test_an_up_and_a_down_that_end_together_both_count(tmp_path, monkeypatch):
    """record_attempt is a read-modify-write: the `down a` below has read the list and is
    about to write it when an `up c` records its failure. Under the lock the `up` waits for
    the `down`'s write and adds to it; without it the `down` writes over the `up`'s entry."""
    import threading

    run = tmp_path / "run"
    rt.record_attempt(run, "b1", ["a", "b"], ["a", "b"])  # boot: a and b not up
    down_in, up_done = threading.Event(), threading.Event()
    real_write = rt.write_json

    def slow_write(path, obj, **kw):
        if threading.current_thread().name == "down":
            down_in.set()
            up_done.wait(2.0)  # the up's turn: unlocked, it finishes first
        real_write(path, obj, **kw)

    monkeypatch.setattr(rt, "write_json", slow_write)

    def up():
        rt.record_attempt(run, "b1", ["c"], ["c"])  # `up c` failed: c waits for a retry
        up_done.set()

    down = threading.Thread(target=rt.record_attempt, args=(run, "b1", ["a"], []), name="down")
    down.start()
    assert down_in.wait(10)
    t_up = threading.Thread(target=up, name="up")
    t_up.start()
    down.join(10)
    t_up.join(10)
    assert rt.read_not_up(run, "b1") == ["b", "c"]
    # The lock file (root's, 0600: no user may hold it) lives as long as the list.
    assert sorted(os.listdir(run)) == [".not-up.lock", "not-up.json"]
    assert stat.S_IMODE(os.stat(run / ".not-up.lock").st_mode) == 0o600
    monkeypatch.setattr(rt, "write_json", real_write)
    rt.record_attempt(run, "b1", ["b", "c"], [])
    assert os.listdir(run) == []  # the list gone, its lock too


def test_a_user_holding_the_run_directory_does_not_stop_the_list(tmp_path):
    """The run directory is 0755 (the daemon's socket is in it): any user may open it and
    hold an flock of it for ever. The list's lock is a 0600 file, which only root opens; an
    flock of the directory (the lock before) changes nothing."""
    import fcntl
    import threading

    run = tmp_path / "run"
    run.mkdir()
    fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a user's, held
        done = threading.Event()
        t = threading.Thread(target=lambda: (rt.record_attempt(run, "b1", ["a"], ["a"]),
                                             done.set()))
        t.start()
        t.join(20)
        assert done.is_set(), "record_attempt waited for the user's flock of the directory"
        assert rt.read_not_up(run, "b1") == ["a"]
    finally:
        os.close(fd)
