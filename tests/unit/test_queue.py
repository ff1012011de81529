"""The queue's schedule (runtime.queue.schedule), pure: FCFS, EASY backfill, the limits and
their reasons; and properties over random pools, running jobs and queues (hypothesis): no two
running jobs share an exclusive CPU or GPU nor exceed the memory, the head is never delayed by
a backfilled job, a job without a time limit never passes an earlier one, the limits hold."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from envctl.runtime import queue as q
from envctl.runtime.slices import Ask, Pool, Slice, allocate

POOL = Pool(cpus=(0, 1, 2, 3), gpus=("g0", "g1"), mem=1000)
NOW = 1000.0


def run(jid: int, cpus: tuple[int, ...], end: float | None, uid: int = 1, mem: int = 0
        ) -> q.Running:
    return q.Running(id=jid, uid=uid, slice=Slice(cpus=cpus, cpus_exclusive=True, mem=mem),
                     end=end)


def wait(jid: int, cpus: int, limit: int | None = None, uid: int = 1) -> q.Waiting:
    return q.Waiting(id=jid, uid=uid, ask=Ask(cpus=cpus), time_limit=limit)


def test_fcfs_starts_what_fits_in_order():
    d = q.schedule(POOL, [], [wait(1, 2), wait(2, 2), wait(3, 1)], q.Limits(), NOW)
    assert [(i, s.cpus) for i, s in d.start] == [(1, (0, 1)), (2, (2, 3))]
    assert d.reasons == {3: q.RESOURCES}


def test_the_head_waits_for_resources_and_the_rest_for_priority():
    running = [run(10, (0, 1, 2), end=NOW + 100)]
    d = q.schedule(POOL, running, [wait(1, 2), wait(2, 4), wait(3, 1)], q.Limits(), NOW)
    assert d.start == ()
    assert d.reasons == {1: q.RESOURCES, 2: q.PRIORITY, 3: q.PRIORITY}  # 3: no time limit


def test_backfill_of_a_job_that_ends_before_the_shadow_time():
    running = [run(10, (0, 1, 2), end=NOW + 100)]
    pending = [wait(1, 4, limit=50), wait(2, 1, limit=100), wait(3, 1, limit=101)]
    d = q.schedule(POOL, running, pending, q.Limits(), NOW)
    # The head (4 CPUs) can start at NOW+100; job 2 ends by then; job 3 would not, and it
    # uses the CPU the head needs.
    assert [i for i, _ in d.start] == [2]
    assert d.reasons == {1: q.RESOURCES, 3: q.PRIORITY}


def test_backfill_of_a_job_that_uses_only_what_the_head_leaves_free():
    running = [run(10, (0, 1), end=NOW + 100)]
    pending = [wait(1, 3, limit=50), wait(2, 1, limit=10_000)]
    d = q.schedule(POOL, running, pending, q.Limits(), NOW)
    # At NOW+100 the head takes 3 of 4 CPUs: job 2's one may run on past it.
    assert [i for i, _ in d.start] == [2]


def test_an_unknown_shadow_time_backfills_nothing():
    running = [run(10, (0, 1, 2), end=None)]  # no time limit: the head's start is unknown
    d = q.schedule(POOL, running, [wait(1, 2, limit=5), wait(2, 1, limit=1)], q.Limits(), NOW)
    assert d.start == () and d.reasons == {1: q.RESOURCES, 2: q.PRIORITY}


def test_max_running_and_per_user():
    running = [run(10, (0,), end=None, uid=1)]
    pending = [wait(1, 1, uid=1), wait(2, 1, uid=2), wait(3, 1, uid=2)]
    d = q.schedule(POOL, running, pending, q.Limits(max_running_per_user=1), NOW)
    # User 1 is at its limit: its job waits, and user 2's go on past it (one of theirs).
    assert [i for i, _ in d.start] == [2]
    assert d.reasons == {1: q.MAX_RUNNING_PER_USER, 3: q.MAX_RUNNING_PER_USER}
    d = q.schedule(POOL, running, pending, q.Limits(max_running=2), NOW)
    assert [i for i, _ in d.start] == [1]
    assert d.reasons == {2: q.MAX_RUNNING, 3: q.MAX_RUNNING}


def test_backfill_depth_bounds_a_pass():
    running = [run(10, (0, 1, 2, 3), end=NOW + 100)]
    pending = [wait(1, 4)] + [wait(i, 1, limit=1000) for i in range(2, 2000)]
    d = q.schedule(POOL, running, pending, q.Limits(), NOW)
    assert d.start == () and len(d.reasons) == 1999


# ---------------------------------------------------------------- properties

asks = st.builds(Ask, cpus=st.integers(0, 4), gpus=st.integers(0, 2),
                 mem=st.sampled_from([0, 0, 100, 300, 600]))
limits = st.one_of(st.none(), st.integers(1, 500))


@st.composite
def situations(draw):
    """A pool, running jobs (valid: allocated one by one), a queue, limits."""
    running: list[q.Running] = []
    for jid in range(100, 100 + draw(st.integers(0, 5))):
        got = allocate(POOL, [(r.id, r.slice) for r in running], draw(asks))
        if isinstance(got, Slice):
            end = draw(st.one_of(st.none(), st.floats(NOW + 1, NOW + 500)))
            running.append(q.Running(id=jid, uid=draw(st.integers(1, 3)), slice=got, end=end))
    pending = [q.Waiting(id=i, uid=draw(st.integers(1, 3)), ask=draw(asks),
                         time_limit=draw(limits)) for i in range(1, draw(st.integers(1, 12)))]
    lim = q.Limits(max_running=draw(st.integers(0, 6)),
                   max_running_per_user=draw(st.integers(0, 3)))
    return running, pending, lim


def _valid(held: list[Slice]) -> None:
    cpus = [c for s in held if s.cpus_exclusive for c in s.cpus]
    gpus = [g for s in held if s.gpus_exclusive for g in s.gpus]
    assert len(cpus) == len(set(cpus)) and len(gpus) == len(set(gpus))
    assert sum(s.mem for s in held) <= POOL.mem


def _shadow(running: list[q.Running], started: list[tuple[int, Slice, float | None]],
            ask: Ask) -> float | None:
    """The head's earliest start by known ends, computed apart from the module's own."""
    jobs = [(r.id, r.slice, r.end) for r in running] + started
    times = sorted({e for _, _, e in jobs if e is not None})
    for t in [NOW, *times]:
        left = [(i, s) for i, s, e in jobs if e is None or e > t]
        if isinstance(allocate(POOL, left, ask), Slice):
            return t
    return None


@settings(max_examples=400, deadline=None)
@given(situations())
def test_schedule_keeps_slices_apart_and_limits(case):
    running, pending, lim = case
    d = q.schedule(POOL, running, pending, lim, NOW)
    started = dict(d.start)
    _valid([r.slice for r in running] + list(started.values()))
    assert set(started) | set(d.reasons) == {w.id for w in pending}
    assert not set(started) & set(d.reasons)
    assert set(d.reasons.values()) <= set(q.REASONS)
    total = len(running) + len(started)
    if lim.max_running:
        assert len(started) == 0 or total <= lim.max_running
    if lim.max_running_per_user:
        for uid in {w.uid for w in pending}:
            mine = sum(1 for r in running if r.uid == uid)
            new = sum(1 for w in pending if w.uid == uid and w.id in started)
            assert new == 0 or mine + new <= lim.max_running_per_user


@settings(max_examples=400, deadline=None)
@given(situations())
def test_the_head_is_never_delayed_and_no_limit_jobs_never_pass(case):
    running, pending, lim = case
    d = q.schedule(POOL, running, pending, lim, NOW)
    started = dict(d.start)
    heads = [w for w in pending if d.reasons.get(w.id) == q.RESOURCES]
    assert len(heads) <= 1
    if not heads:
        return
    head = heads[0]
    limit_of = {w.id: w.time_limit for w in pending}
    # Who started before the head in submit order (FCFS) and who passed it (backfill).
    fcfs = [(i, s) for i, s in d.start if i < head.id]
    passed = [(i, s) for i, s in d.start if i > head.id]
    for i, _ in passed:
        assert limit_of[i] is not None  # a job without a time limit never passes the head
    ends = {i: None if limit_of[i] is None else NOW + limit_of[i] for i, _ in d.start}
    without = _shadow(running, [(i, s, ends[i]) for i, s in fcfs], head.ask)
    with_ = _shadow(running, [(i, s, ends[i]) for i, s in fcfs + passed], head.ask)
    if passed:
        assert without is not None  # an unknown start time backfills nothing
        assert with_ is not None and with_ <= without
    assert started.keys() >= {i for i, _ in fcfs}


def test_a_job_whose_grace_would_run_past_the_shadow_is_not_backfilled():
    running = [run(10, (0, 1, 2), end=NOW + 100)]
    pending = [wait(1, 4, limit=50), wait(2, 1, limit=95)]
    # Ends by its time limit at NOW+95, but may hold the CPU the head needs until its SIGKILL
    # at NOW+105.
    assert [i for i, _ in q.schedule(POOL, running, pending, q.Limits(), NOW).start] == [2]
    d = q.schedule(POOL, running, pending, q.Limits(kill_grace=10), NOW)
    assert d.start == () and d.reasons == {1: q.RESOURCES, 2: q.PRIORITY}
    pending[1] = wait(2, 1, limit=90)
    assert [i for i, _ in q.schedule(POOL, running, pending, q.Limits(kill_grace=10),
                                     NOW).start] == [2]


@settings(max_examples=400, deadline=None)
@given(situations(), st.sampled_from([0.0, 1.0, 10.0, 37.5, 400.0]))
def test_the_head_is_never_delayed_by_a_backfilled_job_killed_at_the_end_of_its_grace(
        case, grace):
    running, pending, lim = case
    lim = lim.replace(kill_grace=grace)
    d = q.schedule(POOL, running, pending, lim, NOW)
    heads = [w for w in pending if d.reasons.get(w.id) == q.RESOURCES]
    if not heads:
        return
    head = heads[0]
    limit_of = {w.id: w.time_limit for w in pending}
    fcfs = [(i, s) for i, s in d.start if i < head.id]
    passed = [(i, s) for i, s in d.start if i > head.id]
    # Each started job holds its slice until its SIGKILL: its time limit plus the grace.
    ends = {i: None if limit_of[i] is None else NOW + limit_of[i] + grace for i, _ in d.start}
    without = _shadow(running, [(i, s, ends[i]) for i, s in fcfs], head.ask)
    with_ = _shadow(running, [(i, s, ends[i]) for i, s in fcfs + passed], head.ask)
    if passed:
        assert without is not None
        assert with_ is not None and with_ <= without


# ---------------------------------------------------------------- a submit's pass skipped


def _index(tmp, lines: list[dict]) -> None:
    q.queue_dir(tmp).parent.mkdir(exist_ok=True)
    q.write_env(tmp, "e", lines)


def _line(jid: int, limit: int | None, reason: str | None, name: str = "x") -> dict:
    # An index line as `entry` orders it (id first), with only what could_start reads.
    return {"id": jid, "env": "e", "name": name, "time_limit": limit, "reason": reason}


def _new(jid: int, limit: int | None, reason: str):
    from types import SimpleNamespace

    return SimpleNamespace(id=jid, env="e", time_limit=limit, reason=reason)


def test_a_submit_behind_a_deep_queue_still_runs_a_pass(tmp_path):
    """The index's reasons are the last pass's: a fresh pass may find its head held by a limit
    and let later jobs by (the property test below found one), so only a limit holding the
    new job itself skips the pass."""
    lines = [_line(1, 60, q.RESOURCES)] + [_line(i, 60, q.PRIORITY)
                                           for i in range(2, q.BACKFILL_DEPTH + 2)]
    _index(tmp_path, lines)
    assert q.could_start(tmp_path, _new(10_000, 60, q.PRIORITY))
    assert q.could_start(tmp_path, _new(10_000, None, q.PRIORITY))
    assert not q.could_start(tmp_path, _new(10_000, None, q.MAX_RUNNING))


def test_a_submit_needs_a_pass_without_a_head_or_past_a_limit(tmp_path):
    assert q.could_start(tmp_path, _new(5, None, q.RESOURCES))  # an empty queue
    assert not q.could_start(tmp_path, _new(5, None, q.MAX_RUNNING))
    assert not q.could_start(tmp_path, _new(5, 60, q.MAX_RUNNING_PER_USER))
    # No head (its line not yet passed): a pass decides.
    _index(tmp_path, [_line(1, None, q.PRIORITY)])
    assert q.could_start(tmp_path, _new(5, None, q.PRIORITY))
    # Jobs a per-user limit holds: the new one of another user may be the head.
    _index(tmp_path, [_line(1, None, q.MAX_RUNNING_PER_USER), _line(2, None, q.RESOURCES)])
    assert q.could_start(tmp_path, _new(5, None, q.PRIORITY))
    # The head is behind it (a lower id appended late): it may start first.
    _index(tmp_path, [_line(7, None, q.RESOURCES)])
    assert q.could_start(tmp_path, _new(5, None, q.PRIORITY))
    # A name a user chose cannot forge a head (json.dumps escapes its quotes).
    _index(tmp_path, [_line(1, None, q.PRIORITY, name='"reason":"Resources"')])
    assert q.could_start(tmp_path, _new(5, None, q.PRIORITY))
    # A damaged index: a pass rebuilds it.
    (q.queue_file(tmp_path, "e")).write_bytes(b'{"id":1,"reason":"Resources"}\ngarbage\n')
    assert q.could_start(tmp_path, _new(5, None, q.PRIORITY))


@settings(max_examples=400, deadline=None)
@given(situations(), asks, limits, st.integers(1, 3), st.integers(0, 4))
def test_a_skipped_pass_would_not_have_started_the_new_job(case, ask, limit, uid, depth):
    """Whenever could_start says no, a pass over the queue with the new job would not have
    started it (the queue as the last pass left it, its reasons in the index)."""

    running, pending, lim = case
    old_depth, q.BACKFILL_DEPTH = q.BACKFILL_DEPTH, depth
    try:
        first = q.schedule(POOL, running, pending, lim, NOW)
        started = dict(first.start)
        limit_of = {w.id: w.time_limit for w in pending}
        running = running + [q.Running(id=i, uid=w.uid, slice=started[i],
                                       end=None if limit_of[i] is None else NOW + limit_of[i])
                             for w in pending if (i := w.id) in started]
        left = [w for w in pending if w.id not in started]
        if not left:
            return  # an empty queue: its submit always passes
        # Its reason as supervisor._take_slice gives it.
        if lim.max_running and len(running) >= lim.max_running:
            reason = q.MAX_RUNNING
        elif lim.max_running_per_user and sum(
                1 for r in running if r.uid == uid) >= lim.max_running_per_user:
            reason = q.MAX_RUNNING_PER_USER
        else:
            reason = q.PRIORITY
        new = q.Waiting(id=1000, uid=uid, ask=ask, time_limit=limit)
        with tempfile.TemporaryDirectory() as tmp:
            _index(Path(tmp), [_line(w.id, w.time_limit, first.reasons[w.id]) for w in left])
            could = q.could_start(Path(tmp), _new(new.id, limit, reason))
        if not could:
            again = q.schedule(POOL, running, left + [new], lim, NOW)
            assert new.id not in dict(again.start)
    finally:
        q.BACKFILL_DEPTH = old_depth


# ---------------------------------------------------------------- a user's load, summarized


def _brute_load(tmp: Path, uid: int) -> tuple[int, int]:
    """user_load as the whole index says it (what the summary must always agree with)."""
    n = staged = 0
    for e in q.read_env(tmp, "e"):
        if int((e.get("submitter") or [e["uid"]])[0]) == uid:
            n, staged = n + 1, staged + int(e.get("staged_bytes") or 0)
    return n, staged


STEPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(0, 2), st.booleans(), st.integers(0, 5000)),
    st.tuples(st.just("rewrite"), st.integers(0, 7)),  # keep every k-th line (a pass, a cancel)
    st.tuples(st.just("damage"), st.sampled_from([b"", b"{", b'{"ino": 1}'])),
    st.tuples(st.just("look"), st.integers(0, 2))), max_size=40)


@settings(max_examples=60, deadline=None)
@given(STEPS)
def test_a_users_load_from_the_summary_is_the_whole_indexs(steps):
    """Appends, rewrites (new inodes), a damaged or missing summary and looks at any point:
    user_load (the summary plus the lines after it) always says what the whole index says."""
    from envctl.runtime.jobs import Job

    old_tail, q.LOAD_TAIL = q.LOAD_TAIL, 700  # a summary written every few lines
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root, jid = Path(tmp), 0
            q.queue_dir(root).mkdir(parents=True)
            for step in steps:
                if step[0] == "append":
                    _, uid, via_submitter, staged = step
                    jid += 1
                    q.append(root, Job(id=jid, env="e", argv=["x"], uid=7 if via_submitter
                                       else uid, submitter=[uid, uid] if via_submitter
                                       else None, staged_bytes=staged))
                elif step[0] == "rewrite":
                    lines = q.read_env(root, "e")
                    q.write_env(root, "e", [e for i, e in enumerate(lines)
                                            if step[1] and i % (step[1] + 1)])
                elif step[0] == "damage":
                    (q.queue_dir(root) / ".load-e").write_bytes(step[1])
                for uid in (0, 1, 2, 7):
                    assert q.user_load(root, "e", uid) == _brute_load(root, uid), step
    finally:
        q.LOAD_TAIL = old_tail


def test_the_listing_reads_a_whole_index_without_the_jobs_lock_and_keeps_it_parsed(tmp_path):
    """`envctl jobs` does not wait for a pass holding the jobs lock (docs/benchmarks.md): a
    whole index is read without it; a torn last line (an append seen half-way) is read again
    under it; the parsed jobs are kept until the index's bytes change."""
    import threading

    from envctl.runtime import jobs as jb

    jb.jobs_dir(tmp_path).mkdir(mode=0o700)
    for jid in (1, 2):
        q.append(tmp_path, jb.Job(id=jid, env="e", argv=["x"], queued=True, reason=q.PRIORITY))
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with jb.jobs_lock(tmp_path):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        first = q.queued_jobs(tmp_path)  # returns at once: the lock is not taken
        assert [(j.id, j.reason) for j in first] == [(1, q.PRIORITY), (2, q.PRIORITY)]
        assert q.queued_jobs(tmp_path, "e")[0] is first[0]  # the same bytes: kept parsed
        index = q.queue_file(tmp_path, "e")
        whole = index.read_bytes()
        index.write_bytes(whole + b'{"id":3,"env":"e","ar')  # an append, half-way
        got: list = []
        reader = threading.Thread(target=lambda: got.append(q.queued_jobs(tmp_path)))
        reader.start()
        reader.join(0.5)
        assert reader.is_alive()  # torn: it waits for the lock, as a rebuild needs it
        index.write_bytes(whole)  # the writer's state once it is done (here: undone)
    finally:
        release.set()
        holder.join()
    reader.join(10)
    assert [j.id for j in got[0]] == [1, 2]


def _same_crc(data: bytes, at: int, span: int) -> bytes:
    """`data` with the lowest bit of its byte `at` flipped and some of the next `span` bytes'
    lowest bits flipped too, so that its length and CRC32 are those of `data`: CRC32 is
    affine over GF(2), so a collision is a linear system (what anyone can do to a listing
    cache keyed by a CRC of bytes users choose)."""
    import zlib

    base = zlib.crc32(data)

    def diff(flips: list[int]) -> int:
        b = bytearray(data)
        for i in flips:
            b[i] ^= 1
        return zlib.crc32(bytes(b)) ^ base

    target = diff([at])
    basis: list[tuple[int, set[int]]] = []  # (pivot vector, the flips that make it)
    for i in range(at + 1, at + 1 + span):
        v, used = diff([i]), {i}
        for bv, bused in basis:
            if v ^ bv < v:
                v, used = v ^ bv, used ^ bused
        if v:
            basis.append((v, used))
            basis.sort(reverse=True)
    chosen: set[int] = set()
    for bv, bused in basis:
        if target ^ bv < target:
            target, chosen = target ^ bv, chosen ^ bused
    assert target == 0, "no collision in this span"
    out = bytearray(data)
    for i in {at} | chosen:
        out[i] ^= 1
    return bytes(out)


def test_the_kept_listing_is_never_one_of_other_bytes_of_the_same_length_and_crc(tmp_path):
    """The parsed index is kept by its bytes: a rewrite of the same length and CRC32 (here a
    job's name, which its submitter chooses) is parsed again, never served stale."""
    import zlib

    from envctl.runtime import jobs as jb

    jb.jobs_dir(tmp_path).mkdir(mode=0o700)
    q.append(tmp_path, jb.Job(id=1, env="e", argv=["x"], name="a" * 64, queued=True))
    index = q.queue_file(tmp_path, "e")
    data = index.read_bytes()
    assert [j.name for j in q.queued_jobs(tmp_path)] == ["a" * 64]
    at = data.index(b"a" * 64)
    forged = _same_crc(data, at, 64)
    assert forged != data and len(forged) == len(data)
    assert zlib.crc32(forged) == zlib.crc32(data)
    index.write_bytes(forged)
    name = json.loads(forged)["name"]
    assert name != "a" * 64
    assert [j.name for j in q.queued_jobs(tmp_path)] == [name]


def test_only_a_claim_whose_claimer_died_goes_back_to_the_queue_once(tmp_path):
    """requeue_orphans: a claimed PENDING record whose claimer is gone is queued again (its
    id, no slice, one index line even when its line is still there); a claim whose claimer
    lives, and a RUNNING job whose supervisor died (LOST: it ran), stay as they are."""
    from envctl.runtime import jobs as jb

    jb.jobs_dir(tmp_path).mkdir(mode=0o700)
    dead = {"pid": 2**22 + 1, "start": 1}  # above pid_max's default range: no such process
    records = {
        1: jb.Job(id=1, env="e", argv=["x"], claimed=True, supervisor=dead, cpus=[0],
                  cpus_exclusive=True),
        2: jb.Job(id=2, env="e", argv=["x"], claimed=True, supervisor=jb.identity()),
        3: jb.Job(id=3, env="e", argv=["x"], state=jb.State.RUNNING, supervisor=dead),
        4: jb.Job(id=4, env="e", argv=["x"], claimed=True, supervisor=dead),
    }
    for job in records.values():
        jb.write(tmp_path, job)
    q.append(tmp_path, records[4].replace(queued=True, claimed=False))  # its line still there
    assert records[1].shown("").state is jb.State.PENDING and records[1].shown("").queued
    assert records[3].shown("").state is jb.State.LOST
    for _ in range(2):
        with jb.jobs_lock(tmp_path):
            q.requeue_orphans(tmp_path, "", [1, 2, 3, 4])
    back = {i: jb.read(tmp_path, i) for i in records}
    assert (back[1].queued, back[1].claimed, back[1].cpus, back[1].supervisor) == (
        True, False, [], None)
    assert back[4].queued and not back[4].claimed
    assert back[2] == records[2] and back[3] == records[3]
    assert [e["id"] for e in q.read_env(tmp_path, "e")] == [1, 4]


def test_a_job_queued_before_a_reboot_is_claimed_with_this_boots_id(tmp_path):
    """A queued record keeps the boot id of its submit; claimed after a reboot without this
    boot's id, its live claimer and then its running supervisor counted as dead (another
    boot's pid): a live claim requeued, the running job LOST and its slice given out."""
    from envctl.host.context import Host
    from envctl.runtime import jobs as jb
    from envctl.runtime.slices import Slice

    jb.jobs_dir(tmp_path).mkdir(mode=0o700)
    jb.write(tmp_path, jb.Job(id=1, env="e", argv=["x"], queued=True, boot_id="old-boot"))
    host = Host(state_dir=tmp_path, run_dir=tmp_path / "run")
    host.__dict__["boot_id"] = "this-boot"  # cached_property: as read from /proc
    job = q._claim_one(host, 1, Slice(cpus=(0,)))
    assert job is not None and job.boot_id == "this-boot"
    assert jb.read(tmp_path, 1).boot_id == "this-boot"
    assert not job.orphaned("this-boot")  # its claimer (this process) lives
