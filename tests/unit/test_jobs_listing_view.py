"""The daemon's `envctl jobs` table (server.handlers.list_jobs) with the queue's rows kept
per index: a plain user gets the whole row of their own queued jobs and the public one
(squeue's) of everyone else's, as the Jobs would give, and a changed index is shown as it is
now, never as it was."""

from __future__ import annotations

import pytest

from envctl.runtime import jobs as jb
from envctl.runtime import queue as q
from envctl.runtime.access import Caller
from envctl.server import handlers

FIELDS = ["id", "user", "state", "start", "program", "req_cpus", "mem"]


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ENVCTL_CONFIG_DIR", str(tmp_path / "configs"))  # no spec: no access
    (tmp_path / "configs").mkdir()
    jb.jobs_dir(tmp_path / "state").mkdir(parents=True, mode=0o700)
    return tmp_path / "state"


def _queue(state, owners: list[int]) -> list[jb.Job]:
    out = []
    for i, uid in enumerate(owners, 1):
        job = jb.Job(id=i, env="e", argv=["/p", "secret"], name=f"j{i}", user=f"u{uid}",
                     uid=uid, queued=True, reason=q.PRIORITY, requested={"cpus": 1},
                     program={"staged": f"/home/u{uid}/p"})
        jb.write(state, job)
        q.append(state, job)
        out.append(job)
    return out


def _expected(caller: Caller, listed: list[jb.Job]) -> list[list[str]]:
    shown = [j if j.uid == caller.uid else
             jb.Job.from_json(handlers._public(j), handlers.PUBLIC_WHERE) for j in listed]
    return jb.table(shown, fields=tuple(FIELDS))


def test_a_plain_users_rows_are_whole_for_their_jobs_public_for_the_others(state):
    listed = _queue(state, [1000, 1001, 1000, 0])
    alice, bob = Caller(1000, 1000), Caller(1001, 1001)
    for _ in range(2):  # the second time from the rows kept
        for who in (alice, bob):
            rows = handlers.list_jobs(who, {"fields": FIELDS}, [])[0]["rows"]
            assert rows == _expected(who, listed)
            mine = [r for r in rows[1:] if r[1] == f"u{who.uid}"]
            others = [r for r in rows[1:] if r[1] != f"u{who.uid}"]
            assert all(r[4] == f"staged:/home/u{who.uid}/p" for r in mine)
            assert all(r[4] == "-" and r[5] == "-" for r in others), others
    root = handlers.list_jobs(Caller(0, 0), {"fields": FIELDS}, [])[0]["rows"]
    assert [r[4] for r in root[1:]] == [f"staged:/home/u{u}/p" for u in (1000, 1001, 1000, 0)]


def test_a_changed_index_is_listed_as_it_is_now(state):
    listed = _queue(state, [1000, 1001])
    alice = Caller(1000, 1000)
    assert handlers.list_jobs(alice, {"fields": FIELDS}, [])[0]["rows"][2][3] == "(Priority)"
    # A pass's rewrite: the reasons change, the second job is gone (claimed).
    lines = q.read_env(state, "e")
    lines[0]["reason"] = q.RESOURCES
    q.write_env(state, "e", lines[:1])
    rows = handlers.list_jobs(alice, {"fields": FIELDS}, [])[0]["rows"]
    # Job 2's record is no longer queued: it is listed from its record, public to alice.
    assert [r[0] for r in rows[1:]] == ["1", "2"]
    assert rows[1][3] == "(Resources)" and rows[1][4] == "staged:/home/u1000/p"
    assert rows[2][4] == "-"
    assert listed
