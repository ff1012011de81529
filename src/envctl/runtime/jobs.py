"""Job records under `<state>/jobs`: ids, states, the record file each job's supervisor writes,
listing, the LOST view of a record whose supervisor is gone, and retention of finished jobs.

Layout:

    <state>/jobs/             root's, 0700
    <state>/jobs/.lock        flock'd while an id is allocated and while records are pruned
    <state>/jobs/.next        the id counter (ids are never reused, even after pruning):
                              "N\n", then one byte per id handed out since N
    <state>/jobs/<id>.json    the record, replaced atomically by whoever owns it (root's, 0600)
    <state>/jobs/<id>.cancel  a cancel request (grace seconds), read by the supervisor (0600)
    <state>/jobs/<id>/        the staged executable (bound read-only at /job inside the
                              environment) and the default stdout / stderr files: the job's
                              user's, 0700 (outputs 0600)

Who may read what: root alone reads the records, directly or for others through the daemon
(envctl.runtime.access decides). A record stays root's, never its job user's: a file's owner
may chmod and (in a directory it can write) replace it, and root processes trust a record's
fields (the supervisor's pid, the cgroup, the output paths). The jobs directory is 0700, not
0711: nobody but root needs to walk it (a job reaches its own directory through the /job
bind, and its user through the daemon's `logs`), and 0711 would let any host user probe which
ids exist and open a job directory by its number.

One writer per record at a time: the job's supervisor from its first write to its last;
after that nobody, except that `cancel` of a LOST job (whose supervisor is gone) finalizes it.
Read-only commands (`jobs`, `wait`, `logs`) never write a record: they *show* an active
record whose supervisor is gone, or that is from another boot, as LOST (but a job claimed
from the queue whose claimer died before a supervisor took it over as PENDING in the queue,
where the next pass puts it back: see `Job.claimed`).

Kept free of the launch code (and of anything heavy) so that `envctl jobs` starts fast.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Callable, Iterator
from enum import StrEnum
from pathlib import Path

from envctl.errors import NeedsRootError, StateCorrupt, UsageError
from envctl.host.files import atomic_write, read_json, write_json
from envctl.record import Factory, Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~5 ms): see record.py
if TYPE_CHECKING:
    from typing import Any

# Finished records kept (newest ids first); older ones, their job directories and their
# cancel files are pruned when a job is submitted (see `prune`). ENVCTL_JOBS_KEEP overrides it.
KEEP_FINISHED = 1000
# Seconds between SIGTERM and SIGKILL at a time limit and at `cancel` (its --grace).
KILL_GRACE = 10.0
# The longest duration envctl accepts anywhere one enters (--time-limit, --grace, a cancel
# file's grace): 365 days. More is refused as a typo (exit 2); the waits themselves are safe
# for any accepted value, since each poll() is bounded (daemon.poll_ms) and loops.
MAX_DURATION = 365 * 86400


class State(StrEnum):
    """Slurm's job states, the subset one host needs (and LOST for a supervisor that died)."""

    PENDING = "PENDING"  # queued (runtime.queue), or its supervisor is starting it
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"  # exit 0
    FAILED = "FAILED"  # exit != 0, killed by a signal, or it could not be started
    CANCELLED = "CANCELLED"  # `envctl cancel`, or `down --force`
    TIMEOUT = "TIMEOUT"  # --time-limit reached
    OUT_OF_MEMORY = "OUT_OF_MEMORY"  # the job's cgroup counted an OOM kill
    LOST = "LOST"  # active, but its supervisor is gone (kill -9, a reboot)


ACTIVE = frozenset({State.PENDING, State.RUNNING})


class Job(Record):
    """One job's record, as stored in `<state>/jobs/<id>.json` (times are Unix seconds)."""

    id: int
    env: str
    argv: list[str]
    name: str = ""
    user: str = ""
    uid: int = 0
    gid: int = 0
    groups: list[int] = Factory(list)  # supplementary ones
    # [uid, gid, *groups] of who submitted it (the user behind sudo), when not root.
    submitter: list[int] | None = None
    state: State = State.PENDING
    submit_time: float = 0.0
    start_time: float | None = None
    end_time: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    cpu_seconds: float | None = None
    # sacct's UserCPU / SystemCPU: the job cgroup's CPU time split, read at the end.
    cpu_user_seconds: float | None = None
    cpu_system_seconds: float | None = None
    peak_memory_bytes: int | None = None
    oom_kills: int | None = None
    # GPU accounting (envctl.monitor.nvml.JobGpuMeter), for a job holding GPUs: elapsed x
    # GPUs held, the largest GPU memory its processes were seen using (summed over its GPUs,
    # sampled), the energy its GPUs drew meanwhile (the difference of their total-energy
    # counters: the whole board's, shared with anything else on it), and per GPU UUID
    # {"energy_mj", "peak_memory_bytes"}; None where NVML could not say, with `gpu_note`.
    gpu_seconds: float | None = None
    gpu_peak_memory_bytes: int | None = None
    gpu_energy_joules: float | None = None
    gpu_usage: dict[str, dict[str, Any]] | None = None
    gpu_note: str | None = None
    # Outputs cut at jobs.max_output ("stdout", "stderr"; one file for both: "stdout").
    output_truncated: list[str] = Factory(list)
    # {"pid": N, "start": starttime in clock ticks after boot, /proc/PID/stat field 22}: the
    # pid alone could be reused by an unrelated process once the supervisor is gone.
    supervisor: dict[str, int] | None = None
    boot_id: str = ""
    # The job's cgroup as the host.cgroups adapter names it: {"parent": P, "name": "ENV/job-N"}.
    cgroup: dict[str, str] | None = None
    stdout: str = ""
    stderr: str = ""
    workdir: str = "/"
    time_limit: int | None = None
    cpus: list[int] = Factory(list)
    gpus: list[str] = Factory(list)
    # Its slice (envctl.runtime.slices): CPUs and GPUs its own while it is active (asked for
    # by count), and its own memory.max in bytes (--mem; None: the environment's limit).
    cpus_exclusive: bool = False
    gpus_exclusive: bool = False
    mem_bytes: int | None = None
    # What submit-job asked for: {"cpus": N or "0-3", "gpus": N or [UUIDs], "mem": bytes}.
    requested: dict[str, Any] = Factory(dict)
    error: str | None = None  # why it could not be started, or what went wrong around it
    # Once it is being stopped: {"cause": "timeout" | "cancel", "since": wall time of the
    # SIGTERM, "kill_at": wall time of the SIGKILL due}. The first cause stands: a later cancel
    # changes neither the state it ends in nor when the SIGKILL comes.
    stopping: dict[str, Any] | None = None
    # Where its program came from: {"staged": host path} (copied to /job, as given) or
    # {"rootfs": path inside} (a bare name found in the environment's PATH, run from there).
    # {} in a record of an older envctl.
    program: dict[str, str] = Factory(dict)
    # In the queue (envctl.runtime.queue): PENDING with no supervisor yet, its request in
    # `<id>.req`; `reason` as squeue shows it (Resources, Priority, MaxRunning, …). Once
    # CANCELLED: why, when it was not a user's cancel ("host shutdown": `down` or systemd
    # stopped it while the host shut down).
    queued: bool = False
    reason: str | None = None
    # Taken from the queue by a pass (queue.claim), its `supervisor` the process that claimed
    # it, until its own supervisor's first write takes it over (a compare-and-swap under the
    # jobs lock). A claim whose claimer died before that never started anything: the next
    # pass puts it back in the queue (queue.requeue_orphans), never LOST.
    claimed: bool = False
    # The bytes of its program staged in its directory (what jobs.max_staged_per_user bounds).
    staged_bytes: int = 0

    # ------------------------------------------------------------------ (de)serializing
    def to_json(self, *, derived: bool = True) -> dict[str, Any]:
        """The record as JSON values; with `derived`, also `elapsed` (seconds so far, as
        sacct shows it; never stored: the record file holds the times it comes from)."""
        out = self.asdict()
        out["state"] = str(self.state)
        if derived:
            elapsed = self.elapsed()
            out["elapsed"] = None if elapsed is None else round(elapsed, 3)
        return out

    @classmethod
    def from_json(cls, raw: Any, where: Path) -> Job:
        if not isinstance(raw, dict):
            raise StateCorrupt(where, "not a job record")
        try:
            # Record.from_dict, not cls(**…): `envctl jobs` builds 10,000 of them from the
            # queue's index, and the checking constructor cost ~100 µs each here.
            job = cls.from_dict(raw)
            job.state = State(job.state)
            job.id = int(job.id)
        except (TypeError, ValueError) as exc:
            raise StateCorrupt(where, f"not a job record: {exc}") from None
        return job

    # ------------------------------------------------------------------ derived values
    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def shown(self, boot_id: str) -> Job:
        """This record as `jobs`/`wait` show it: LOST when it is active but its supervisor is
        gone or it is from another boot. Never written back here (read-only commands)."""
        if self.active and not self.queued and not supervisor_alive(self, boot_id):
            if self.claimed and self.state is State.PENDING:
                # Claimed by a process that died before its supervisor took it: nothing of it
                # started, and the next pass of the queue puts it back there.
                return self.replace(queued=True)
            return self.replace(state=State.LOST)
        return self

    def orphaned(self, boot_id: str) -> bool:
        """Claimed from the queue by a process that is gone, before any supervisor took it
        over (see `claimed`): to be requeued."""
        return (self.claimed and self.state is State.PENDING and not self.queued
                and not supervisor_alive(self, boot_id))

    def elapsed(self, now: float | None = None) -> float | None:
        if self.start_time is None:
            return None
        end = self.end_time if self.end_time is not None else (now or time.time())
        return max(0.0, end - self.start_time)

    def exit_status(self) -> int:
        """What `wait` and `submit-job --wait` exit with: 0 for COMPLETED; otherwise the job's
        own code, 128+N when a signal N ended it, and 1 when neither says it failed (a job that
        exited 0 on the SIGTERM of `cancel`, a job that never started, a LOST one)."""
        if self.state is State.COMPLETED:
            return 0
        if self.exit_code:
            return self.exit_code
        if self.signal:
            return 128 + self.signal
        return 1


# ---------------------------------------------------------------- paths


def jobs_dir(state_dir: Path) -> Path:
    return state_dir / "jobs"


def record_path(state_dir: Path, job_id: int) -> Path:
    return jobs_dir(state_dir) / f"{job_id}.json"


def job_dir(state_dir: Path, job_id: int) -> Path:
    """The job's own directory: its staged executable (at /job inside) and default outputs."""
    return jobs_dir(state_dir) / str(job_id)


def cancel_path(state_dir: Path, job_id: int) -> Path:
    # Beside the record, not in the job's directory: that one is visible inside the job.
    return jobs_dir(state_dir) / f"{job_id}.cancel"


def cgroup_name(env: str, job_id: int) -> str:
    """The job's cgroup below its environment's, as the host.cgroups adapter names it."""
    return f"{env}/job-{job_id}"


# ---------------------------------------------------------------- ids


def _private_dir(d: Path) -> None:
    """`d` made, or kept, 0700: `<state>/jobs` is root's alone. A job's uid is often one many
    host processes share (nobody, a service account): were its directory reachable, any of
    them could rewrite the job's staged program or read its outputs. The job reaches its own
    directory through /job, a bind that walks no parent; `envctl logs` opens it as root."""
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(d)
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():  # an older envctl's 0755
        os.chmod(d, 0o700)


@contextlib.contextmanager
def jobs_lock(state_dir: Path) -> Iterator[None]:
    """Hold `<state>/jobs/.lock` (its own lock, never the global one: `up`/`down` may hold that
    for minutes and a submit must not wait for them). The kernel drops it if we die."""
    d = jobs_dir(state_dir)
    _private_dir(d)
    try:
        fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except PermissionError:
        raise NeedsRootError(RECORDS_NEED_ROOT) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def allocate_id(state_dir: Path) -> int:
    """The next job id (1, 2, …), under the jobs lock. `.next` holds the counter; a lost
    counter restarts above every record and job directory still there, so an id in use or in
    history is never handed out again."""
    with jobs_lock(state_dir):
        return _allocate_locked(state_dir)


# `.next` is "N\n" (the next id when it was last rewritten) followed by one byte per id
# handed out since: an allocation is one O_APPEND write, not a file replacement (a rename
# cost ~3-8 ms of each submit under the jobs lock here, docs/benchmarks.md "The job queue").
# Rewritten as "N\n" (atomically) once COUNTER_COMPACT ids have been appended.
COUNTER_COMPACT = 4096


def _allocate_locked(state_dir: Path) -> int:
    counter = jobs_dir(state_dir) / ".next"
    try:
        fd = os.open(counter, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        nxt = 1 + max(_ids_on_disk(state_dir), default=0)
        _rewrite_counter(counter, nxt + 1)
        return nxt
    try:
        head = os.pread(fd, 64, 0)
        line, nl, _ = head.partition(b"\n")
        if not line.strip().isdigit():
            text = head[:40].decode(errors="replace")
            raise StateCorrupt(counter, f"not a job counter: {text!r}")
        base = int(line)
        if not nl:  # an older envctl's (or a hand-written) counter: no newline to count from
            _rewrite_counter(counter, base + 1)
            return base
        # One byte per id: the write either happened (the id is used, even if we die before
        # its record is written: never handed out again) or did not (nobody saw the id). No
        # fsync, as before: a machine crash also kills every job.
        os.write(fd, b"+")
        used = os.fstat(fd).st_size - len(line) - 1
    finally:
        os.close(fd)
    jid = base + used - 1
    if used >= COUNTER_COMPACT:
        _rewrite_counter(counter, jid + 1)
    return jid


def _rewrite_counter(counter: Path, nxt: int) -> None:
    # The rename makes a crash leave the old or the new value.
    atomic_write(counter, f"{nxt}\n".encode(), mode=RECORD_MODE, durable=False)


def _ids_on_disk(state_dir: Path) -> list[int]:
    out = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(jobs_dir(state_dir)):
            stem = name.split(".", 1)[0]
            if stem.isdigit():
                out.append(int(stem))
    return out


# ---------------------------------------------------------------- records

# Records, cancel requests and the id counter: root's alone (see the module's docstring).
RECORD_MODE = 0o600


def write(state_dir: Path, job: Job, *, durable: bool = False) -> None:
    """Replace the record atomically: readers see the old or the new one, never half.

    `durable` (fsync) is for the final record only: it is history that must outlive a power
    cut; the earlier ones describe processes that would not survive one either."""
    write_json(record_path(state_dir, job.id), job.to_json(derived=False), durable=durable,
               mode=RECORD_MODE)


def write_cancel(state_dir: Path, job_id: int, request: dict[str, Any]) -> None:
    """Write the cancel request of `job_id` (root's, 0600, as its record)."""
    write_json(cancel_path(state_dir, job_id), request, durable=False, mode=RECORD_MODE)


def read(state_dir: Path, job_id: int) -> Job | None:
    """The record, or None when there is none (never submitted, or pruned)."""
    path = record_path(state_dir, job_id)
    try:
        raw = read_json(path)
    except ValueError as exc:
        raise StateCorrupt(path, f"not JSON: {exc}") from None
    except PermissionError:
        raise NeedsRootError(RECORDS_NEED_ROOT) from None
    except OSError as exc:
        raise StateCorrupt(path, exc.strerror or str(exc)) from None
    return None if raw is None else Job.from_json(raw, path)


def get(state_dir: Path, job_id: int | str) -> Job:
    """The record of `job_id`; UsageError (exit 2) when there is no such job."""
    jid = parse_id(job_id)
    job = read(state_dir, jid)
    if job is None:
        raise UsageError(f"no job {jid}: never submitted here, or pruned (envctl keeps the "
                         f"newest {keep_finished()} finished jobs)")
    return job


def parse_id(text: int | str) -> int:
    s = str(text).strip()
    from envctl.text import ascii_digits

    if not ascii_digits(s) or int(s) < 1:
        raise UsageError(f"'{text}' is not a job id (a positive integer, as submit-job prints)")
    return int(s)


def all_jobs(state_dir: Path, *, skip: set[int] | frozenset[int] = frozenset()) -> list[Job]:
    """Every record (but those in `skip`), oldest id first. A record that cannot be read is
    skipped (listing must not fail on one damaged file; `envctl logs N` of that id names
    it)."""
    out = []
    for jid in sorted(set(_record_ids(state_dir)) - skip):
        with contextlib.suppress(StateCorrupt):
            job = read(state_dir, jid)
            if job is not None:
                out.append(job)
    return out


RECORDS_NEED_ROOT = ("the job records (<state>/jobs) are root's alone: run it with sudo "
                     "(docs/security.md)")


def _record_ids(state_dir: Path) -> list[int]:
    try:
        names = os.listdir(jobs_dir(state_dir))
    except FileNotFoundError:
        return []
    except PermissionError:
        raise NeedsRootError(RECORDS_NEED_ROOT) from None
    return [int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()]


def listing(state_dir: Path, boot_id: str, *, env: str | None = None,
            finished: bool = False, skip: set[int] | frozenset[int] = frozenset()
            ) -> list[Job]:
    """The jobs `envctl jobs` shows, as shown (LOST where the supervisor is gone): active and
    LOST ones (those want attention: `cancel` cleans up after them), and with `finished` the
    finished ones too; of one environment when `env` is given."""
    out = []
    for job in all_jobs(state_dir, skip=skip):
        if env is not None and job.env != env:
            continue
        shown = job.shown(boot_id)
        if finished or shown.active or (job.active and shown.state is State.LOST):
            out.append(shown)
    return out


def active_jobs(state_dir: Path, boot_id: str, env: str) -> list[Job]:
    """The jobs of `env` whose supervisor is alive (what `down` must not pull the floor from
    under)."""
    return [j for j in all_jobs(state_dir)
            if j.env == env and j.active and supervisor_alive(j, boot_id)]


# ---------------------------------------------------------------- retention


def keep_finished() -> int:
    try:
        return max(0, int(os.environ.get("ENVCTL_JOBS_KEEP", KEEP_FINISHED)))
    except ValueError:
        return KEEP_FINISHED


# A submit prunes when its id is a multiple of this (supervisor.submit): between two checks
# at most this many records more than prune's batch threshold gather.
PRUNE_EVERY = 16


def prune(state_dir: Path, *, keep: int | None = None, queued: int = 0) -> list[int]:
    """Delete the finished records beyond the newest `keep` (by id), with their job
    directories (staged file, default outputs) and cancel files; the ids pruned. Outputs
    written elsewhere (--output/--error paths) are the user's and stay. Active records (LOST
    ones too, until `cancel` finalizes them) are never pruned. Call under `jobs_lock`.

    In batches: nothing is read until a tenth more than `keep` records (at least 10) have
    gathered, then they go back down to `keep`; reading 1000 records at every submit would
    cost more than starting the job. `queued`: how many of the records are queued jobs
    (runtime.queue's count, from its index), which are never pruned."""
    keep = keep_finished() if keep is None else keep
    if len(_record_ids(state_dir)) - queued <= keep + max(10, keep // 10):
        return []
    finished = [j.id for j in all_jobs(state_dir) if not j.active]
    gone = sorted(finished)[: max(0, len(finished) - keep)]
    import shutil  # here: shutil imports bz2 and lzma, ~3 ms of every submit-job

    for jid in gone:
        with contextlib.suppress(FileNotFoundError):
            record_path(state_dir, jid).unlink()
        with contextlib.suppress(FileNotFoundError):
            cancel_path(state_dir, jid).unlink()
        shutil.rmtree(job_dir(state_dir, jid), ignore_errors=True)
    return gone


# ---------------------------------------------------------------- supervisors


def proc_start_time(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks after boot) of process `pid` from
    /proc/PID/stat (fields 3 and 22), or None when there is no such process. Always the real
    /proc: the pid is one of this host's."""
    try:
        text = Path("/proc", str(pid), "stat").read_bytes().decode(errors="replace")
    except OSError:
        return None  # ENOENT / ESRCH: gone
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = text[text.rfind(")") + 2:].split()
    try:
        return rest[0], int(rest[19])
    except (IndexError, ValueError):
        return None


def supervisor_alive(job: Job, boot_id: str) -> bool:
    """Whether the process that supervises `job` still runs: same boot, the recorded pid
    exists, is not a zombie, and started when the recorded one did."""
    if boot_id and job.boot_id and job.boot_id != boot_id:
        return False
    sup = job.supervisor or {}
    pid, start = sup.get("pid"), sup.get("start")
    if not pid:
        return False
    seen = proc_start_time(int(pid))
    return seen is not None and seen[0] not in ("Z", "X") and seen[1] == start


def identity(pid: int | None = None) -> dict[str, int]:
    """{"pid", "start"} of process `pid` (default: this one), as records store supervisors."""
    pid = os.getpid() if pid is None else pid
    seen = proc_start_time(pid)
    return {"pid": pid, "start": seen[1] if seen else 0}


# ---------------------------------------------------------------- how a job ended


def final_state(*, wait_status: int | None, cancelled: bool, timed_out: bool,
                oom_kills: int | None, error: str | None = None
                ) -> tuple[State, int | None, int | None]:
    """(state, exit code, signal) of a job that ended, from its raw wait status (None when
    it never ran or its status was lost) and what its supervisor knows.

    Precedence: the stop's cause (a cancel, or the time limit: whichever came first, the
    supervisor passes only that one; Slurm does the same), then an OOM kill counted in the
    job's own cgroup for a job that did not exit 0 (the counter, not exit 137: a job may die
    of SIGKILL for other reasons, and may survive the kill of one of its children), then the
    exit itself."""
    code = sig = None
    if wait_status is not None:
        if os.WIFSIGNALED(wait_status):
            sig = os.WTERMSIG(wait_status)
        elif os.WIFEXITED(wait_status):
            code = os.WEXITSTATUS(wait_status)
    if cancelled:
        return State.CANCELLED, code, sig
    if timed_out:
        return State.TIMEOUT, code, sig
    if oom_kills and code != 0:
        return State.OUT_OF_MEMORY, code, sig
    if error is not None or wait_status is None:
        return State.FAILED, code, sig
    return (State.COMPLETED if code == 0 else State.FAILED), code, sig


# ---------------------------------------------------------------- durations


_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


def parse_duration(text: str) -> int:
    """Seconds from `90` (minutes, as Slurm's -t reads a bare number), `90s`, `15m`, `1h30m`,
    `2d` or `[D-]HH:MM:SS` / `MM:SS` (Slurm's forms); UsageError otherwise. Zero is refused:
    a limit of nothing is a typo."""
    s = text.strip().lower()
    secs: int | None = None
    if not s.isascii() or len(s) > 32:
        # Not a duration: str.isdigit takes '²' and other digits int() refuses, and int()
        # refuses more than 4300 digits (ValueError, not the one-line exit 2 below).
        pass
    elif s.isdigit():
        secs = int(s) * 60
    elif ":" in s:
        days, _, clock = s.rpartition("-")
        parts = clock.split(":")
        if (len(parts) in (2, 3) and all(p.isdigit() for p in parts)
                and (not days or days.isdigit())):
            nums = [int(p) for p in parts]
            h, m, sec = ([0] + nums) if len(nums) == 2 else nums
            secs = int(days or 0) * 86400 + h * 3600 + m * 60 + sec
    else:
        m = _DURATION.fullmatch(s)
        if m and any(m.groups()):
            d, h, mi, sec = (int(g or 0) for g in m.groups())
            secs = d * 86400 + h * 3600 + mi * 60 + sec
    if not secs:
        raise UsageError(f"--time-limit '{text}': give minutes (90, as Slurm), units (90s, "
                         "15m, 1h30m, 2d) or [D-]HH:MM:SS, more than zero")
    if secs > MAX_DURATION:
        raise UsageError(f"--time-limit '{text}': at most 365 days ({MAX_DURATION} s), not "
                         f"{secs} s")
    return secs


def check_grace(seconds: float, what: str = "--grace") -> float:
    """`seconds` when it is a grace envctl accepts (finite, 0 to 365 days); UsageError."""
    import math

    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_DURATION):
        raise UsageError(f"{what} {seconds:g}: give seconds from 0 to {MAX_DURATION} "
                         "(365 days)")
    return seconds


def format_elapsed(seconds: float | None) -> str:
    """squeue's TIME column: M:SS, H:MM:SS, D-HH:MM:SS; '-' when it never started."""
    if seconds is None:
        return "-"
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}-{h:02d}:{m:02d}:{s:02d}"
    if h:
        return f"{h}:{m:02d}:{s:02d}"
    return f"{m}:{s:02d}"


def format_exit(job: Job) -> str:
    """sacct's ExitCode column: `code:signal`; '-' while it runs or when nothing is known."""
    if job.exit_code is None and job.signal is None:
        return "-"
    return f"{job.exit_code or 0}:{job.signal or 0}"


def _clock(t: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) if t is not None else "-"


def format_cpu_time(seconds: float | None) -> str:
    """sacct's UserCPU / SystemCPU: the elapsed form with milliseconds (1:02.345); '-'."""
    if seconds is None:
        return "-"
    whole = int(seconds)
    return f"{format_elapsed(whole)}.{int(round((seconds - whole) * 1000)) % 1000:03d}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _requested_of(key: str) -> Callable[[Job, float], str]:
    def shown(j: Job, now: float) -> str:
        value = (j.requested or {}).get(key)
        if value is None:
            return "-"
        if key == "mem":
            return format_mem(int(value))
        return str(len(value)) if isinstance(value, list) else str(value)
    return shown


# The columns `envctl jobs --format` may pick (sacct --format / squeue -o in spirit), in the
# order `--format help` lists them: name -> (header, what the cell shows). Times are local.
FIELDS: dict[str, tuple[str, Callable[[Job, float], str]]] = {
    "id": ("ID", lambda j, now: str(j.id)),
    "name": ("NAME", lambda j, now: j.name or "-"),
    "env": ("ENV", lambda j, now: j.env),
    "user": ("USER", lambda j, now: j.user or str(j.uid)),
    "uid": ("UID", lambda j, now: str(j.uid)),
    "state": ("STATE", lambda j, now: str(j.state)),
    "submit": ("SUBMIT", lambda j, now: _clock(j.submit_time or None)),
    # A queued job's reason where its start will be, as squeue's NODELIST(REASON).
    "start": ("START", lambda j, now: _clock(j.start_time) if j.start_time is not None
              else f"({j.reason})" if j.queued and j.reason else "-"),
    "reason": ("REASON", lambda j, now: j.reason if j.queued and j.reason else "-"),
    "end": ("END", lambda j, now: _clock(j.end_time)),
    "elapsed": ("ELAPSED", lambda j, now: format_elapsed(j.elapsed(now))),
    "time_limit": ("TIMELIMIT", lambda j, now: format_elapsed(j.time_limit)
                   if j.time_limit else "-"),
    "exit": ("EXIT", lambda j, now: format_exit(j)),
    "cpus": ("CPUS", lambda j, now: format_cpu_list(j.cpus)),
    "ncpus": ("NCPUS", lambda j, now: str(len(j.cpus)) if j.cpus else "-"),
    "mem": ("MEM", lambda j, now: format_mem(j.mem_bytes)),
    "gpus": ("GPUS", lambda j, now: str(len(j.gpus)) if j.gpus else "-"),
    "gpu_ids": ("GPU_IDS", lambda j, now: ",".join(j.gpus) or "-"),
    "req_cpus": ("REQ_CPUS", _requested_of("cpus")),
    "req_mem": ("REQ_MEM", _requested_of("mem")),
    "req_gpus": ("REQ_GPUS", _requested_of("gpus")),
    "cpu_time": ("CPUTIME", lambda j, now: format_cpu_time(j.cpu_seconds)),
    "cpu_user": ("USERCPU", lambda j, now: format_cpu_time(j.cpu_user_seconds)),
    "cpu_sys": ("SYSCPU", lambda j, now: format_cpu_time(j.cpu_system_seconds)),
    "maxrss": ("MAXRSS", lambda j, now: format_mem(j.peak_memory_bytes)),
    "oom_kills": ("OOM", lambda j, now: "-" if j.oom_kills is None else str(j.oom_kills)),
    "gpu_seconds": ("GPU_SEC", lambda j, now: _num(j.gpu_seconds)),
    "gpu_mem": ("GPU_MAXMEM", lambda j, now: format_mem(j.gpu_peak_memory_bytes)),
    "energy_j": ("ENERGY_J", lambda j, now: _num(j.gpu_energy_joules)),
    "truncated": ("TRUNCATED", lambda j, now: ",".join(j.output_truncated) or "-"),
    "program": ("PROGRAM", lambda j, now: format_program(j)),
    "error": ("ERROR", lambda j, now: (j.error or "-").replace("\n", " ")),
}
# What `envctl jobs` shows without --format.
DEFAULT_FIELDS = ("id", "name", "env", "user", "state", "elapsed", "exit", "cpus", "mem",
                  "gpus", "start", "program")


# The most columns one table has: the daemon makes the table in its own loop (a request of
# 64 KiB naming "id" 10,000 times would be 10,000 cells a job).
MAX_FIELDS = 64


def parse_fields(text: str) -> tuple[str, ...]:
    """`--format id,user,state` as field names (case and spaces ignored); UsageError (exit 2)
    naming an unknown one and listing those allowed."""
    names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in FIELDS]
    if unknown or not names or len(names) > MAX_FIELDS:
        what = (f"unknown field(s) {', '.join(unknown)}" if unknown else "no field given"
                if not names else f"{len(names)} fields (at most {MAX_FIELDS})")
        raise UsageError(f"--format '{text}': {what}; allowed: {', '.join(FIELDS)}")
    return names


def table(jobs: list[Job], *, now: float | None = None,
          fields: tuple[str, ...] = DEFAULT_FIELDS) -> list[list[str]]:
    """Rows of the `envctl jobs` table, header first, with the columns `fields` names, each
    cell printable (see printable): a job's name, program and arguments are whatever its
    submitter sent, and the table is printed to everyone's terminal."""
    # One test per row, not per cell: nearly every row is printable as it is (10,000 rows of
    # 12 cells cost ~25 ms more cell by cell).
    return [row if "".join(row).isprintable() else [printable(cell) for cell in row]
            for row in _table(jobs, now=now, fields=fields)]


def printable(text: str) -> str:
    """`text` with each character that is not printable (C0 and C1 controls, escape, DEL, line
    and paragraph separators, bidi overrides) written as its Python escape (\\x1b, \\n,
    \\u202e): an escape sequence in another user's job name must not act on the terminal
    that shows it (OSC 52 writes the clipboard), nor a newline draw a forged row."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _table(jobs: list[Job], *, now: float | None,
           fields: tuple[str, ...]) -> list[list[str]]:
    now = time.time() if now is None else now
    cells = [FIELDS[f] for f in fields]
    rows = [[header for header, _ in cells]]
    for j in jobs:
        rows.append([show(j, now) for _, show in cells])
    return rows


def format_cpu_list(cpus: list[int]) -> str:
    """The kernel's list syntax ("0-3,8"), '-' for none: the table's CPUS column."""
    if not cpus:  # every queued job: without the import below, 10,000 cost ~1 ms, not ~30
        return "-"
    from envctl.runtime.context import format_cpus  # light: no launch code behind it

    return format_cpus(cpus)


def format_mem(size: int | None) -> str:
    """A job's own memory limit in binary units (64M, 1.5G), '-' for none: the MEM column."""
    if not size:
        return "-"
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if size >= 1 << shift:
            value = size / (1 << shift)
            return f"{value:.0f}{unit}" if value.is_integer() else f"{value:.1f}{unit}"
    return str(size)


def format_program(job: Job) -> str:
    """`rootfs:/usr/bin/sleep` (the environment's own) or `staged:/home/a/bench` (copied)."""
    for how in ("rootfs", "staged"):
        if isinstance(job.program, dict) and job.program.get(how):
            return f"{how}:{job.program[how]}"
    return "-"


def parse_cpus(text: str, what: str = "CPUs") -> tuple[int, ...]:
    """A CPU list as the kernel writes one (`0-3,6`), read as a spec's is; UsageError
    otherwise. (Not on `exec`'s path, so the spec's parser and its import are affordable.)"""
    from envctl.spec.units import parse_cpu_list

    try:
        cpus = parse_cpu_list(text, most=65_535)  # spec.models.CPU_MAX, without pydantic
    except ValueError as exc:
        raise UsageError(f"{what} '{text}': {exc}; a CPU list such as 0-3,6") from None
    if not cpus:
        raise UsageError(f"{what} '{text}': a CPU list such as 0-3,6")
    return cpus


# ---------------------------------------------------------------- following output


IN_MODIFY, IN_CLOSE_WRITE, IN_ATTRIB = 0x2, 0x8, 0x4


def output_creds(uid: int, gid: int, groups: Any, submitter: Any) -> tuple | None:
    """Whose rights an output outside the job's directory is opened with: the submitting
    user's, who named the path, whoever the job runs as (`sudo envctl submit-job --user root
    -o /etc/passwd` must not make root truncate it, nor `--user alice -o ~alice/.bashrc`
    hand bob's job alice's file); when root ran envctl itself, the job's user's; None: root's
    own (a root job of root)."""
    if submitter:
        return (submitter[0], submitter[1], tuple(submitter[2:]))
    if uid != 0:
        return (uid, gid, tuple(groups))
    return None


def open_output(state_dir: Path, job: Job, path: Path) -> int:
    """A read-only descriptor of one of the job's outputs, for `logs`, opened so that the
    job's user cannot make root read anything else. The job's directory is that user's: a
    default output in it is opened beneath `<state>/jobs` with no symlink anywhere on the way
    (openat2 RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS); an output elsewhere is opened with the
    job user's rights and O_NOFOLLOW. Either must be a regular file (checked on the
    descriptor; O_NONBLOCK until then, so a FIFO cannot hang it). OSError naming `path`."""
    import errno
    import stat

    from envctl.host.asuser import open_as
    from envctl.host.safepath import Escape, open_beneath

    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
    in_dir = path.parent == job_dir(state_dir, job.id)
    owner = -1
    try:
        if in_dir:
            top = os.open(jobs_dir(state_dir), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                jfd = open_beneath(top, str(job.id), os.O_PATH | os.O_DIRECTORY,
                                   symlinks=False)
            finally:
                os.close(top)
            try:
                owner = os.fstat(jfd).st_uid  # chowned by submit: the job's host uid
                fd = open_beneath(jfd, path.name, flags | os.O_CLOEXEC, symlinks=False)
            finally:
                os.close(jfd)
        else:
            fd = open_as(output_creds(job.uid, job.gid, job.groups, job.submitter), path,
                         flags | os.O_NOFOLLOW)
    except Escape:
        raise OSError(errno.ELOOP, "is or goes through a symlink, which envctl does not "
                      "follow", str(path)) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "is a symlink, which envctl does not follow",
                          str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if in_dir and st.st_uid != owner:
            # A hard link the user made there to somebody else's file (protected_hardlinks
            # off): the outputs envctl made there are the job user's.
            raise OSError(errno.EPERM, "not the job user's file", str(path))
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def follow(state_dir: Path, job: Job, path: Path, write: Callable[[bytes], None], *,
           boot_id: str, recheck: float = 1.0, fd: int = -1) -> None:
    """Copy `path` (one of the job's outputs) to `write` from its start, then as it grows,
    until the job has ended: woken by inotify when the file changes and by the supervisor's
    pidfd when it exits, so nothing polls while nothing happens. `recheck` seconds bound a
    sleep in case a wake-up is missed (an output on a file system without inotify events,
    such as one written over NFS). `fd`: `path` opened already (by open_output), closed here."""
    import select

    from envctl.host.libc import libc

    if fd < 0:
        fd = open_output(state_dir, job, path)
    ino = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    pidfd = -1
    try:
        poller = select.poll()
        watched = os.fsencode(f"/proc/self/fd/{fd}")  # the file opened, not the name again
        if ino >= 0 and libc.inotify_add_watch(
                ino, watched, IN_MODIFY | IN_CLOSE_WRITE | IN_ATTRIB) >= 0:
            poller.register(ino, select.POLLIN)
        if job.active and supervisor_alive(job, boot_id):
            with contextlib.suppress(ProcessLookupError):
                pidfd = os.pidfd_open(int((job.supervisor or {})["pid"]))
                if supervisor_alive(job, boot_id):  # pinned: still the recorded process
                    poller.register(pidfd, select.POLLIN)
                else:
                    os.close(pidfd)
                    pidfd = -1
        ended = pidfd < 0
        while True:
            while chunk := os.read(fd, 65536):
                write(chunk)
            if ended:
                return
            for got, _ in poller.poll(recheck * 1000):
                if got == ino:
                    with contextlib.suppress(BlockingIOError):
                        os.read(ino, 4096)
                elif got == pidfd:
                    ended = True  # one more read above: what it wrote last
            if not ended:
                now = read(state_dir, job.id)
                ended = now is None or not now.shown(boot_id).active
    finally:
        os.close(fd)
        if ino >= 0:
            os.close(ino)
        if pidfd >= 0:
            os.close(pidfd)
