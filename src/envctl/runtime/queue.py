"""The job queue: which PENDING jobs of an environment start now, with which slice, and why
the others wait (`schedule`, pure: first come first served with EASY backfill); the queue's
compact index on disk; and `kick`, which runs the schedule and starts what it says.

The rules (Slurm's, for one host; docs/runtime.md "Queue"):
- Jobs are considered in submit order (their ids). The first that does not fit now is the
  head (reason `Resources`); every later one waits behind it (`Priority`) unless it can be
  backfilled: it fits now, has a time limit, and either ends before the head's shadow time
  (the earliest time enough running jobs have reached their time limits for the head to fit)
  or uses only what the head leaves free at that time. A job without a time limit is never
  backfilled ahead, and while a running job without a time limit is needed for the head to
  fit, the shadow time is unknown and nothing is backfilled.
- `jobs.max_running` (reason `MaxRunning`) stops every job of the environment while that many
  run; `jobs.max_running_per_user` (`MaxRunningPerUser`) stops only that user's jobs: the
  others' go on past them (Slurm skips them too), and such a job is never the head.
- At most BACKFILL_DEPTH jobs behind the head are tried for backfill per pass (Slurm's
  bf_max_job_test default): the rest wait (`Priority`) without being looked at, so that a
  pass over 10,000 queued jobs stays cheap.

The queue on disk: each queued job's record (PENDING, `queued`), its request
(`<id>.req`, root's), its staged program in its directory, and one line per job in
`<state>/jobs/.queue/<env>` (what `schedule` and `envctl jobs` need, so that neither reads
10,000 records). The index is written under the jobs lock and rebuilt from the records when
it is missing or damaged; nothing depends on the daemon: submits, ending supervisors, cancels
and the daemon's timer all kick. Beside it, `.queue/.load-<env>` sums the index per owner
(queued jobs, staged bytes) up to a byte offset of it, so that a submit's check of its
user's bounds (`user_load`) reads only the lines appended since, not the whole index: a
cache, checked against the index it describes and recounted from it whenever it is not.
"""

from __future__ import annotations

from envctl.record import Record
from envctl.runtime.slices import Ask, Pool, Shortage, Slice, allocate, env_pool

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~5 ms): see record.py

# Jobs behind the head tried for backfill in one pass (Slurm's bf_max_job_test default).
BACKFILL_DEPTH = 500

RESOURCES, PRIORITY = "Resources", "Priority"
MAX_RUNNING, MAX_RUNNING_PER_USER = "MaxRunning", "MaxRunningPerUser"
REASONS = (RESOURCES, PRIORITY, MAX_RUNNING, MAX_RUNNING_PER_USER)


class Limits(Record, frozen=True):
    """The spec's jobs.max_running and jobs.max_running_per_user (0: unlimited), and the kill
    grace: a job at its time limit gets SIGTERM and holds its slice until the SIGKILL up to
    `kill_grace` seconds later (jobs.KILL_GRACE), so a backfilled job must end, grace
    included, before the head's shadow time."""

    max_running: int = 0
    max_running_per_user: int = 0
    kill_grace: float = 0.0


class Running(Record, frozen=True):
    """A job that holds its slice: its id, its user (uid), its slice and when it is expected
    to end (its start plus its time limit; None: no limit, never as far as we know)."""

    id: int
    uid: int
    slice: Slice
    end: float | None = None


class Waiting(Record, frozen=True):
    """A PENDING job: its id, user, request and time limit in seconds (None: none)."""

    id: int
    uid: int
    ask: Ask
    time_limit: int | None = None


class Decision(Record, frozen=True):
    """What one pass decides: the jobs to start now (id, slice), in order, and the reason of
    every pending job that does not start."""

    start: tuple[tuple[int, Slice], ...] = ()
    reasons: dict = {}  # id -> one of REASONS


def schedule(pool: Pool, running: list[Running], pending: list[Waiting], limits: Limits,
             now: float) -> Decision:
    """FCFS with EASY backfill (see the module's docstring). Pure."""
    held = [(r.id, r.slice) for r in running]
    ends = {r.id: r.end for r in running}
    users: dict[int, int] = {}
    for r in running:
        users[r.uid] = users.get(r.uid, 0) + 1
    start: list[tuple[int, Slice]] = []
    reasons: dict[int, str] = {}
    head: Waiting | None = None
    shadow: float | None = None  # the head's shadow time; None: unknown
    tried = 0
    # A job started now may hold its slice until its time limit plus the kill grace. The
    # running jobs' ends stay their time limits: the shadow time is when the head can start
    # if they end then, and a backfilled job must not push it later, grace included.
    grace = limits.kill_grace

    def full(uid: int) -> str | None:
        if limits.max_running and len(held) >= limits.max_running:
            return MAX_RUNNING
        if limits.max_running_per_user and users.get(uid, 0) >= limits.max_running_per_user:
            return MAX_RUNNING_PER_USER
        return None

    def take(job: Waiting, got: Slice) -> None:
        start.append((job.id, got))
        held.append((job.id, got))
        ends[job.id] = None if job.time_limit is None else now + job.time_limit + grace
        users[job.uid] = users.get(job.uid, 0) + 1

    for job in pending:
        blocked = full(job.uid)
        if blocked is not None:
            reasons[job.id] = blocked
            continue
        if head is None:
            got = allocate(pool, held, job.ask)
            if isinstance(got, Slice):
                take(job, got)
                continue
            head, reasons[job.id] = job, RESOURCES
            shadow = shadow_time(pool, held, ends, job.ask)
            continue
        # Behind the head: backfill, or wait.
        reasons[job.id] = PRIORITY
        if job.time_limit is None or shadow is None or tried >= BACKFILL_DEPTH:
            continue
        tried += 1
        got = allocate(pool, held, job.ask)
        if isinstance(got, Shortage):
            continue
        end = now + job.time_limit + grace
        if end > shadow and not _head_fits_beside(pool, held, ends, limits, head,
                                                  shadow, (job.id, got, job.uid)):
            continue
        del reasons[job.id]
        take(job, got)
    return Decision(start=tuple(start), reasons=reasons)


def shadow_time(pool: Pool, held: list[tuple[int, Slice]], ends: dict[int, float | None],
                ask: Ask) -> float | None:
    """The earliest time `ask` fits as the jobs in `held` reach their expected ends (`ends`:
    id -> end, None for never); None when it never does by known ends. Pure."""
    left = list(held)
    for end in sorted({e for e in ends.values() if e is not None}):
        left = [(i, s) for i, s in left if ends.get(i) is None or ends[i] > end]  # type: ignore[operator]
        if isinstance(allocate(pool, left, ask), Slice):
            return end
    return None


def _head_fits_beside(pool: Pool, held: list[tuple[int, Slice]], ends: dict,
                      limits: Limits, head: Waiting, shadow: float,
                      extra: tuple[int, Slice, int]) -> bool:
    """Whether the head still fits at its shadow time with `extra` (id, slice, uid: a job
    that would run past it) holding its slice too: slices and the limits' slots."""
    jid, got, uid = extra
    at_shadow = [(i, s) for i, s in held if ends.get(i) is None or ends[i] > shadow]
    at_shadow.append((jid, got))
    if not isinstance(allocate(pool, at_shadow, head.ask), Slice):
        return False
    if limits.max_running and len(at_shadow) + 1 > limits.max_running:
        return False
    # One more of the head's own user's jobs still running then could take the slot the head
    # needs under max_running_per_user: conservative, never backfilled past the shadow.
    return not (limits.max_running_per_user and head.uid == uid)


# ---------------------------------------------------------------- the index on disk

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from envctl.host.context import Host
    from envctl.runtime.context import EnvContext
    from envctl.runtime.jobs import Job

# The record fields an index line keeps: what `schedule` and `envctl jobs` need.
ENTRY_FIELDS = ("id", "env", "argv", "name", "user", "uid", "gid", "submitter", "state",
                "submit_time", "boot_id", "time_limit", "requested", "program", "stdout",
                "stderr", "workdir", "queued", "reason", "staged_bytes")


def queue_dir(state_dir: Path) -> Path:
    from envctl.runtime.jobs import jobs_dir

    return jobs_dir(state_dir) / ".queue"


def queue_file(state_dir: Path, env: str) -> Path:
    # `env` is an environment's name (spec.naming: [a-z0-9-], no '/' or '.'), checked when
    # its context was loaded from its journal, or by the daemon's listing before it asks
    # (context.check_env_name). Never a path, whoever forgets to check: the index is read and
    # written as root by it (`.queue / "/tmp/f"` is /tmp/f).
    if "/" in env or env.startswith(".") or not env:
        from envctl.errors import UsageError

        raise UsageError(f"'{env}' is not an environment name")
    return queue_dir(state_dir) / env


def entry(job: Job) -> dict:
    """The index line of a queued job."""
    out = job.to_json()
    return {k: out[k] for k in ENTRY_FIELDS if k in out}


def ask_of(requested: dict) -> Ask:
    """The request of a job as its record says (`requested`: submit-job's --cpus, --gpus,
    --mem as supervisor._requested writes them)."""
    from envctl.runtime.context import parse_cpus

    cpus, gpus = requested.get("cpus"), requested.get("gpus")
    return Ask(cpus=cpus if isinstance(cpus, int) else 0,
               cpu_list=parse_cpus(cpus) if isinstance(cpus, str) else None,
               gpus=gpus if isinstance(gpus, int) else 0,
               gpu_list=tuple(gpus) if isinstance(gpus, list) else None,
               mem=int(requested.get("mem") or 0))


def has_pending(state_dir: Path, env: str) -> bool:
    """Whether `env` has a queue (a non-empty index): a new job then waits its turn."""
    try:
        return queue_file(state_dir, env).stat().st_size > 0
    except FileNotFoundError:
        return False


def could_start(state_dir: Path, job: Job) -> bool:
    """Whether a pass run now could start `job`, which is about to join its environment's
    index (its reason as `submit` gave it, under the jobs lock); False only when it surely
    could not, so that its submit can skip the pass. Every other event that can start a job
    (a job's end, a cancel, the daemon's timer) runs its own pass, so a pass after a submit
    only matters for the new job itself. It surely cannot start when a limit holds it
    (MaxRunning, MaxRunningPerUser, counted just now under the lock): only a running job's
    end, which runs a pass, frees that.

    (Skipping also for a job queued behind a head was tried: the index's reasons are those of
    the last pass, and a fresh pass may find the head held by a limit instead, which lets
    later jobs by; the property test of this function found such a case.)"""
    del state_dir  # the decision needs nothing of the index
    return job.reason not in (MAX_RUNNING, MAX_RUNNING_PER_USER)


def user_load(state_dir: Path, env: str, uid: int) -> tuple[int, int]:
    """How many of `env`'s queued jobs are `uid`'s (`owner`: who submitted it, else its user)
    and the bytes their staged programs hold: the index's summary (`.load-<env>`) plus the
    lines appended after it (all of them when there is no summary of this index); the
    summary written again once LOAD_TAIL bytes were read past it. Each submit calls it twice:
    parsing a whole index of one user's 2,000 jobs was 75 % of a submit (docs/benchmarks.md).
    Call under the jobs lock."""
    import os

    try:
        fd = os.open(queue_file(state_dir, env), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0, 0
    try:
        st = os.fstat(fd)
        head = os.pread(fd, LOAD_HEAD, 0)
        offset, owners = _read_load(state_dir, env, st.st_ino, st.st_size, head)
        tail = _pread_all(fd, st.st_size - offset, offset) if st.st_size > offset else b""
    finally:
        os.close(fd)
    end = tail.rfind(b"\n") + 1  # whole lines only: a torn last one is not summed
    if end:
        _add_lines(owners, tail[:end])
        if end >= LOAD_TAIL:
            _write_load(state_dir, env, st.st_ino, head, offset + end, owners)
    n, staged = owners.get(uid, (0, 0))
    return n, staged


LOAD_HEAD = 64  # bytes of the index's start kept in its summary (with its inode): its identity
LOAD_TAIL = 8192  # bytes read past the summary before it is written again (~16 lines)


def _load_file(state_dir: Path, env: str) -> Path:
    return queue_dir(state_dir) / f".load-{env}"


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    import os

    parts = []
    while size > 0:
        got = os.pread(fd, size, offset)
        if not got:
            break
        parts.append(got)
        size -= len(got)
        offset += len(got)
    return b"".join(parts)


def _add_lines(owners: dict[int, tuple[int, int]], data: bytes) -> None:
    """Add each index line of `data` to its owner's (count, staged bytes)."""
    import json

    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a torn line: its record is the truth, and the next pass rebuilds it
        _add_entry(owners, e)


def _add_entry(owners: dict[int, tuple[int, int]], e: object) -> None:
    try:
        who = int((e.get("submitter") or [e["uid"]])[0])  # type: ignore[union-attr,index]
        staged = int(e.get("staged_bytes") or 0)  # type: ignore[union-attr]
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        return  # not a job's line: skipped, as a torn one
    n, total = owners.get(who, (0, 0))
    owners[who] = (n + 1, total + staged)


def _read_load(state_dir: Path, env: str, ino: int, size: int, head: bytes
               ) -> tuple[int, dict[int, tuple[int, int]]]:
    """(the index offset the summary counts up to, owner -> (jobs, staged bytes)); (0, {})
    unless it is the summary of this very index (its inode and its first bytes: write_env
    removes the summary before it replaces the index, so a reused inode number is a new
    file with no summary)."""
    import json

    try:
        raw = json.loads(_load_file(state_dir, env).read_bytes())
        if raw["ino"] != ino or bytes.fromhex(raw["head"]) != head[:len(raw["head"]) // 2]:
            return 0, {}
        owners = {int(k): (int(v[0]), int(v[1])) for k, v in raw["owners"].items()}
        offset = int(raw["offset"])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return 0, {}  # none, or damaged: counted from the index itself
    return (offset, owners) if 0 <= offset <= size else (0, {})


def _write_load(state_dir: Path, env: str, ino: int, head: bytes, offset: int,
                owners: dict[int, tuple[int, int]]) -> None:
    import json

    from envctl.host.files import atomic_write

    body = {"ino": ino, "head": head[:min(LOAD_HEAD, offset)].hex(), "offset": offset,
            "owners": {str(k): list(v) for k, v in owners.items()}}
    atomic_write(_load_file(state_dir, env), json.dumps(body).encode(), mode=0o600,
                 durable=False)


def current_reason(state_dir: Path, job: Job) -> str | None:
    """A queued job's reason as the last pass set it (its index line; its record keeps the
    one of its submit), else the record's."""
    import json

    try:
        data = queue_file(state_dir, job.env).read_bytes()
    except FileNotFoundError:
        return job.reason
    key = b'{"id":%d,' % job.id
    for line in data.split(b"\n"):
        if line.startswith(key):
            try:
                return json.loads(line).get("reason")
            except ValueError:
                break
    return job.reason


def no_output_yet(state_dir: Path, job: Job) -> str | None:
    """What `envctl logs` says of a job that has not started yet (a queued one), or None."""
    from envctl.runtime.jobs import State

    if not job.queued or job.state is not State.PENDING:
        return None
    return f"job {job.id} is PENDING ({current_reason(state_dir, job) or 'queued'}): no output yet"


START_POLL = 0.5  # seconds between looks at a queued job's record (supervisor.QUEUE_POLL's)


def open_when_started(state_dir: Path, job: Job, path: Path, *, boot_id: str,
                      gone: Callable[[], bool] | None = None,
                      poll: float = START_POLL) -> tuple[int, Job] | None:
    """For `logs -f` of a job still in the queue: once a pass has started it, its output
    `path` opened as jobs.open_output opens it, and its record then. A queued job has no
    supervisor to wait on, so its record is looked at every `poll` seconds (as
    supervisor.wait does); a claimed one opens its outputs just after its claim, so a missing
    output is waited for while the job is active. HostError (exit 1) when it ended without
    starting (cancelled in the queue, or its start failed: why); None when `gone()` says
    the one asking left."""
    import time

    from envctl.errors import HostError
    from envctl.runtime import jobs

    while True:
        if no_output_yet(state_dir, job) is None:
            try:
                return jobs.open_output(state_dir, job, path), job
            except FileNotFoundError:
                if not job.shown(boot_id).active:
                    if job.start_time is None:
                        why = f": {job.error}" if job.error else ""
                        raise HostError(f"job {job.id} ended {job.state} without starting"
                                        f"{why}") from None
                    raise
        if gone is not None and gone():
            return None
        time.sleep(poll)
        job = jobs.get(state_dir, job.id)


def append(state_dir: Path, job: Job) -> None:
    """Add a queued job to its environment's index (one line, O_APPEND). Under the jobs lock,
    after its record is written (the record is the truth: a torn line is rebuilt from it)."""
    import json
    import os

    d = queue_dir(state_dir)
    d.mkdir(mode=0o700, exist_ok=True)
    line = json.dumps(entry(job), separators=(",", ":")).encode() + b"\n"
    fd = os.open(queue_file(state_dir, job.env), os.O_WRONLY | os.O_APPEND | os.O_CREAT
                 | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_env(state_dir: Path, env: str) -> list[dict]:
    """The index lines of `env`, oldest id first; rebuilt from the records (and rewritten)
    when the file is damaged (a torn line after a crash). Call under the jobs lock."""
    try:
        data = queue_file(state_dir, env).read_bytes()
    except FileNotFoundError:
        return []
    return _entries(state_dir, env, data)


def _entries(state_dir: Path, env: str, data: bytes) -> list[dict]:
    """read_env's lines from the index's bytes `data`."""
    try:
        return _lines(data)
    except ValueError:
        out = rebuild(state_dir).get(env, [])
    out.sort(key=lambda e: e["id"])
    return out


def _lines(data: bytes) -> list[dict]:
    """The index lines in `data`, oldest id first; ValueError when it is not whole lines."""
    import json

    body = data.rstrip(b"\n")
    if not body:
        return []
    # json.dumps never writes a raw newline inside a value: the lines are one array.
    out = json.loads(b"[" + body.replace(b"\n", b",") + b"]")
    if not all(isinstance(e, dict) and isinstance(e.get("id"), int) for e in out):
        raise ValueError("not index lines")
    out.sort(key=lambda e: e["id"])
    return out


def write_env(state_dir: Path, env: str, entries: list[dict]) -> None:
    """Replace `env`'s index (atomically), and its summary. Call under the jobs lock."""
    import contextlib
    import json
    import os

    from envctl.host.files import atomic_write

    path = queue_file(state_dir, env)
    # Its summary (user_load's) first: none is ever left describing a replaced index.
    with contextlib.suppress(FileNotFoundError):
        _load_file(state_dir, env).unlink()
    if not entries:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    queue_dir(state_dir).mkdir(mode=0o700, exist_ok=True)
    body = b"".join(json.dumps(e, separators=(",", ":")).encode() + b"\n" for e in entries)
    atomic_write(path, body, mode=0o600, durable=False)
    owners: dict[int, tuple[int, int]] = {}
    for e in entries:
        _add_entry(owners, e)
    _write_load(state_dir, env, os.stat(path).st_ino, body[:LOAD_HEAD], len(body), owners)


def count(state_dir: Path) -> int:
    """How many jobs the indexes hold (their lines), without parsing them."""
    import contextlib

    n = 0
    for env in envs(state_dir):
        with contextlib.suppress(FileNotFoundError):
            n += queue_file(state_dir, env).read_bytes().count(b"\n")
    return n


def envs(state_dir: Path) -> list[str]:
    import os

    try:
        return sorted(n for n in os.listdir(queue_dir(state_dir)) if not n.startswith("."))
    except FileNotFoundError:
        return []


def rebuild(state_dir: Path) -> dict[str, list[dict]]:
    """Every environment's index made again from the records (queued PENDING ones) and
    written; env -> its lines. Slow (every record), for a damaged index and a daemon's
    start. Call under the jobs lock."""
    from envctl.runtime import jobs

    by_env: dict[str, list[dict]] = {}
    for job in jobs.all_jobs(state_dir):
        if job.queued and job.state is jobs.State.PENDING:
            by_env.setdefault(job.env, []).append(entry(job))
    for env in set(envs(state_dir)) | set(by_env):
        write_env(state_dir, env, by_env.get(env, []))
    return by_env


def queued_jobs(state_dir: Path, env: str | None = None) -> list[Job]:
    """The queued jobs as their index lines show them (reasons as the last pass set them),
    without reading their records: `envctl jobs` with 10,000 queued."""
    out: list[Job] = []
    for _, got in queued_groups(state_dir, env):
        out += got
    return out


def queued_groups(state_dir: Path, env: str | None = None) -> list[tuple[str, list[Job]]]:
    """queued_jobs, per environment (name, its queued jobs oldest first): each list is the
    one kept parsed (see _PARSED) for as long as its index's bytes are the same, so that the
    daemon can keep what it derives from it (the table's rows) by the list itself. Shared:
    read them, never change them."""
    import time

    from envctl.runtime.jobs import jobs_lock

    out: list[tuple[str, list[Job]]] = []
    for e in sorted([env] if env else envs(state_dir)):
        # First without the jobs lock, which a pass over 10,000 queued holds for a while (a
        # listing waited seconds for it under load): the index is replaced by a rename or
        # grown by one O_APPEND write, so a read sees a whole index, or one whose last line
        # is torn and does not parse. That one (and a damaged one, which read_env rebuilds)
        # is read again under the lock.
        got = None
        for _ in range(5):  # a torn line is an append in flight: whole a moment later
            got = _parsed(state_dir, e, locked=False)
            if got is not None:
                break
            time.sleep(0.002)
        if got is None:  # damaged (a crash's torn line): read_env rebuilds it, under the lock
            with jobs_lock(state_dir):
                got = _parsed(state_dir, e, locked=True)
        if got:
            out.append((e, got))
    return out


# The daemon answers `envctl jobs` in its own process (server.handlers.list_jobs): each
# index's jobs are kept parsed, with the index's bytes they were parsed from, until those
# change (an append, a pass's rewrite). Parsing 10,000 lines (~4 MB of JSON, then 10,000
# Jobs) cost ~150 ms of a listing; reading the file and comparing it with the bytes kept
# (memcmp) ~3 ms. The bytes themselves, not a checksum of them, are the key: the lines hold
# what users chose (names, argv), and a CRC32 of them can be made to collide on purpose, which
# would show a stale queue; equal bytes parse to equal jobs. (~4 MB kept per 10,000 queued.)
# The Jobs are shared by every caller: read them, never change them.
_PARSED: dict[str, tuple[bytes, list[Job]]] = {}


def _parsed(state_dir: Path, env: str, *, locked: bool) -> list[Job] | None:
    """`env`'s queued jobs as its index says; None, when not `locked` (under the jobs lock),
    for an index that does not parse."""
    from envctl.runtime.jobs import Job

    path = queue_file(state_dir, env)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        _PARSED.pop(str(path), None)
        return []
    hit = _PARSED.get(str(path))
    if hit is not None and hit[0] == data:
        return hit[1]
    if locked:
        lines = _entries(state_dir, env, data)
    else:
        try:
            lines = _lines(data)
        except ValueError:
            return None
    where = queue_dir(state_dir)
    out = [Job.from_json(x, where) for x in lines]
    _PARSED[str(path)] = (data, out)
    return out


def listing(state_dir: Path, boot_id: str, *, env: str | None = None,
            finished: bool = False) -> list[Job]:
    """jobs.listing, with the queued jobs from the index instead of their records."""
    from envctl.runtime import jobs

    queued = queued_jobs(state_dir, env) if queue_dir(state_dir).is_dir() else []
    skip = {j.id for j in queued}
    out = jobs.listing(state_dir, boot_id, env=env, finished=finished, skip=skip) + queued
    out.sort(key=lambda j: j.id)
    return out


# ---------------------------------------------------------------- one pass


def owner(job: Job) -> int:
    """Whose job it is for max_running_per_user: who submitted it (else its uid)."""
    return int(job.submitter[0]) if job.submitter else job.uid


def claim(host: Host, load: object, *, now: float | None = None) -> list[tuple[EnvContext, Job]]:
    """One pass over every environment's queue under the jobs lock: the jobs that start now,
    each claimed (its record no longer queued, `claimed`, with its slice and this process as
    its supervisor until the supervisor's own first write, and in the holders' index), and
    every other queued job's reason written to the index. Claims whose claimer died before
    a supervisor took them are put back in the queue first (requeue_orphans). `load(env)`:
    the environment's context, or None when it is not up (its queue then waits as it is).

    The order of the writes makes a kill -9 at any point recoverable by the next pass: the
    holders' index lists a job before its record is claimed (so a pass finds every claimed
    record there), and the queue's index loses its line only after."""
    import time

    from envctl.runtime import jobs, slices

    now = time.time() if now is None else now
    out: list[tuple[EnvContext, Job]] = []
    with jobs.jobs_lock(host.state_dir):
        held, listed = slices.holders(host.state_dir, host.boot_id)
        keep = [j.id for j in held]
        holding = set(keep)
        requeue_orphans(host.state_dir, host.boot_id, [i for i in listed if i not in holding])
        for env in envs(host.state_dir):
            lines = read_env(host.state_dir, env)
            if not lines:
                write_env(host.state_dir, env, [])
                continue
            ctx = load(env)  # type: ignore[operator]
            if ctx is None:
                continue
            pool = env_pool(ctx)
            running = [Running(id=j.id, uid=owner(j), slice=slices.slice_of(j),
                               end=_expected_end(j, now)) for j in held if j.env == env]
            waiting = [Waiting(id=e["id"], uid=int((e.get("submitter") or [e["uid"]])[0]),
                               ask=ask_of(e.get("requested") or {}),
                               time_limit=e.get("time_limit")) for e in lines]
            limits = Limits(max_running=ctx.max_running,
                            max_running_per_user=ctx.max_running_per_user,
                            kill_grace=jobs.KILL_GRACE)
            decision = schedule(pool, running, waiting, limits, now)
            started = dict(decision.start)
            if started:
                # Listed as holders before their records say claimed (see above); an id whose
                # claim then fails (cancelled meanwhile) is dropped at the end.
                listed = sorted({*keep, *started})
                slices.write_index(host.state_dir, listed)
                _fault("listed", min(started))
            left = []
            changed = bool(started)
            for e in lines:
                jid = e["id"]
                if jid in started:
                    job = _claim_one(host, jid, started[jid])
                    if job is not None:
                        out.append((ctx, job))
                        keep.append(jid)
                        _fault("record", jid)
                    continue
                reason = decision.reasons.get(jid)
                if e.get("reason") != reason:
                    e["reason"], changed = reason, True
                left.append(e)
            if changed:
                write_env(host.state_dir, env, left)
                if started:
                    _fault("index", min(started))
        if sorted(keep) != sorted(listed):
            slices.write_index(host.state_dir, keep)
    return out


def _fault(step: str, jid: int) -> None:
    """Test hooks (ENVCTL_FAULT=ACTION@claim:STEP#ID, engine.faults): a pass's claim of job
    ID at `step` (listed, record, index; start in supervisor._start_queued; own, in the
    job's new supervisor before it takes the claim over)."""
    import os

    if "ENVCTL_FAULT" in os.environ:
        from envctl.engine.faults import maybe_fault

        maybe_fault("claim", step, jid)


def requeue_orphans(state_dir: Path, boot_id: str, ids: list[int]) -> list[Job]:
    """Put back in the queue each of the jobs `ids` (the holders' index lists them, and their
    records are no longer active holders) whose claim a process took that died before the
    job's supervisor took it over (Job.orphaned): nothing of it started (its supervisor's
    first write would have taken it: a compare-and-swap under this same lock, which a
    requeued record now fails). It keeps its id, so its place in the queue; its index line
    is written first, then its record (a kill between the two: the holders' index still
    lists it, and the next pass finishes it). The default outputs its claimer made (empty:
    nothing ran) are removed, so that its start can make them anew. Call under the jobs
    lock; the jobs put back."""
    from envctl.errors import StateCorrupt
    from envctl.runtime import jobs

    back: list[Job] = []
    for jid in ids:
        try:
            job = jobs.read(state_dir, jid)
        except StateCorrupt:
            continue
        if job is None or not job.orphaned(boot_id):
            continue
        back.append(job.replace(queued=True, claimed=False, reason=None, supervisor=None,
                                cpus=[], gpus=[], cpus_exclusive=False, gpus_exclusive=False,
                                mem_bytes=None))
    for job in back:
        lines = read_env(state_dir, job.env)
        if all(e["id"] != job.id for e in lines):
            queue_dir(state_dir).mkdir(mode=0o700, exist_ok=True)
            write_env(state_dir, job.env, sorted([*lines, entry(job)], key=lambda e: e["id"]))
        _drop_default_outputs(state_dir, job)
        jobs.write(state_dir, job, durable=True)
    return back


def _drop_default_outputs(state_dir: Path, job: Job) -> None:
    """Unlink the default stdout/stderr in the job's directory (a start makes them with
    O_EXCL), through the directory's descriptor: only root reaches the jobs directory, and a
    job that never ran wrote nothing to them."""
    import contextlib
    import os

    from envctl.runtime import jobs

    top = os.open(jobs.jobs_dir(state_dir), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            jfd = os.open(str(job.id), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW
                          | os.O_CLOEXEC, dir_fd=top)
        except FileNotFoundError:
            return
    finally:
        os.close(top)
    try:
        jdir = jobs.job_dir(state_dir, job.id)
        for path in {job.stdout, job.stderr}:
            if os.path.dirname(path) == str(jdir):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.basename(path), dir_fd=jfd)
    finally:
        os.close(jfd)


def _expected_end(job: Job, now: float) -> float | None:
    if job.time_limit is None:
        return None
    return (job.start_time if job.start_time is not None else now) + job.time_limit


def _claim_one(host: Host, jid: int, got: Slice) -> Job | None:
    """Mark queued job `jid` started with slice `got`; None when its record is no longer a
    queued PENDING one (cancelled meanwhile, pruned)."""
    from envctl.errors import StateCorrupt
    from envctl.runtime import jobs

    try:
        job = jobs.read(host.state_dir, jid)
    except StateCorrupt:
        return None
    if job is None or not job.queued or job.state is not jobs.State.PENDING:
        return None
    job = job.replace(queued=False, reason=None, cpus=list(got.cpus), gpus=list(got.gpus),
                      cpus_exclusive=got.cpus_exclusive, gpus_exclusive=got.gpus_exclusive,
                      mem_bytes=got.mem or None, supervisor=jobs.identity(), claimed=True,
                      boot_id=host.boot_id)  # queued in an earlier boot: claimed in this one
    jobs.write(host.state_dir, job)
    return job
