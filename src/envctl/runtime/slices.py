"""Per-job slices of an environment: which of its CPUs, GPUs and how much of its memory a job
holds, chosen among what its other active jobs do not hold (`allocate`, pure), the job's own
device rules (`job_device_rules`, pure), and the holders' index under `<state>/jobs/.held`.

What a job holds:
- `--cpus N` (a count): N of the environment's CPUs, exclusive: no other job gets them while
  it is active. A list (`--cpus 2-3`) is those CPUs, shared, as before; it may not name a CPU
  another job holds exclusively. Without `--cpus`: every CPU of the environment that no job
  holds exclusively (all of them when none does).
- `--gpus N` (a count): N of the environment's GPUs, exclusive, among those no active job
  can open (a running job's device list is never narrowed, so a GPU another job has by a
  list or by asking nothing is not given out by count until it ends); a list: those, shared;
  without: every GPU no job holds exclusively. A job whose GPUs are not all of the
  environment's gets a device allow-list of its own with only its GPUs' nodes.
- `--cpus N` with `--gpus`: the N CPUs come from those local to the job's GPUs first (the
  pool's `near`, from where `up` found each GPU), one from each GPU's node in turn.
- `--mem SIZE`: its own memory.max; the environment's memory limit (when it has one) is
  shared out: the active jobs' requests add up to no more than it.

`allocate` returns a Slice or a Shortage whose `reason` says what is missing and who holds
it, so that a queue can keep the job PENDING with it; `submit-job` refuses (exit 1) today.

The index keeps submits cheap: it lists only the jobs that hold something (an exclusive CPU
or GPU, or memory), so a plain submit reads one small file instead of every record. It is
read and written under the jobs lock (`jobs.jobs_lock`), and an entry whose job is no longer
active (or whose supervisor is gone: LOST) is dropped when it is next read.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from envctl.errors import InputError
from envctl.record import Factory, Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~5 ms): see record.py
if TYPE_CHECKING:
    from envctl.runtime.jobs import Job

# /dev/nvidiaN is char 195:N (envctl.plan.gpus.NVIDIA_MAJOR; not imported: the planner's
# modules are not on the submit path).
NVIDIA_MAJOR = 195
_CONTROL_MINORS = (254, 255)  # nvidia-modeset, nvidiactl: every job keeps them


class Ask(Record, frozen=True):
    """What a job asks for: each of CPUs and GPUs a count (exclusive) or a list (shared), or
    neither (what nobody holds); memory in bytes (0: none of its own)."""

    cpus: int = 0
    cpu_list: tuple[int, ...] | None = None
    gpus: int = 0
    gpu_list: tuple[str, ...] | None = None
    mem: int = 0


class Slice(Record, frozen=True):
    """What a job got: its CPUs and GPUs (exclusive when asked for by count) and its memory
    limit in bytes (0: the environment's, none of its own)."""

    cpus: tuple[int, ...] = ()
    cpus_exclusive: bool = False
    gpus: tuple[str, ...] = ()
    gpus_exclusive: bool = False
    mem: int = 0

    @property
    def holds(self) -> bool:
        """Whether it keeps anything from other jobs (and so belongs in the index)."""
        return self.cpus_exclusive or self.gpus_exclusive or self.mem > 0


class Pool(Record, frozen=True):
    """An environment's resources: its CPUs, its GPUs (UUIDs, in index order), its memory
    limit in bytes (0: none, memory is not shared out)."""

    cpus: tuple[int, ...]
    gpus: tuple[str, ...] = ()
    mem: int = 0
    # GPU UUID -> the CPUs local to it (its NUMA node's): a job's CPUs by count come from
    # those of its GPUs first.
    near: dict[str, tuple[int, ...]] = Factory(dict)


def env_pool(ctx: object) -> Pool:
    """The pool of an environment that is up (an envctl.runtime.context.EnvContext)."""
    return Pool(cpus=tuple(ctx.cpus), gpus=tuple(ctx.gpus),  # type: ignore[attr-defined]
                mem=ctx.memory_max, near=dict(ctx.gpu_cpus))  # type: ignore[attr-defined]


class Shortage(Record, frozen=True):
    """Why a request does not fit now (Slurm's reason `Resources`): one line."""

    reason: str


def check_ask(pool: Pool, ask: Ask, env: str) -> None:
    """InputError (exit 2) for a request that could never fit the environment, whatever the
    other jobs hold: more CPUs, GPUs or memory than it has."""
    if ask.cpus > len(pool.cpus):
        raise InputError(f"submit-job --cpus {ask.cpus}: environment '{env}' has "
                         f"{len(pool.cpus)} CPU(s) ({_cpulist(pool.cpus)})")
    if ask.gpus > len(pool.gpus):
        raise InputError(f"submit-job --gpus {ask.gpus}: environment '{env}' has "
                         f"{len(pool.gpus)} GPU(s)")
    if ask.mem and pool.mem and ask.mem > pool.mem:
        raise InputError(f"submit-job --mem {ask.mem}: more than environment '{env}''s memory "
                         f"limit ({pool.mem} bytes)")


def allocate(pool: Pool, held: list[tuple[int, Slice]], ask: Ask) -> Slice | Shortage:
    """The slice `ask` gets in `pool` while the jobs in `held` (id, slice) hold theirs, or
    what is missing. Counts take the lowest free CPUs and the first free GPUs. Pure."""
    cpu_owner = {c: jid for jid, s in held if s.cpus_exclusive for c in s.cpus}
    gpu_owner = {g: jid for jid, s in held if s.gpus_exclusive for g in s.gpus}
    # A GPU given by count is the job's alone: not one whose node another active job can open
    # already (a list's, or every GPU of a job without --gpus), since a running job's device
    # list is never narrowed. The count waits until they end.
    gpu_busy = gpu_owner | {g: jid for jid, s in held if not s.gpus_exclusive for g in s.gpus}
    got_gpus = _pick(ask.gpus, ask.gpu_list, pool.gpus, gpu_owner, "GPU", _gpulist,
                     none_ok=True, busy=gpu_busy)  # no GPU at all is fine: a CPU job
    cpus = pool.cpus
    asks_gpus = bool(ask.gpus or ask.gpu_list)
    if ask.cpus and asks_gpus and pool.near and not isinstance(got_gpus, Shortage):
        cpus = near_first(pool.cpus, [pool.near.get(g, ()) for g in got_gpus[0]])
    got_cpus = _pick(ask.cpus, ask.cpu_list, cpus, cpu_owner, "CPU", _cpulist)
    if isinstance(got_cpus, Shortage):
        return got_cpus
    got_cpus = (tuple(sorted(got_cpus[0])), got_cpus[1])
    if isinstance(got_gpus, Shortage):
        return got_gpus
    if ask.mem and pool.mem:
        used = {jid: s.mem for jid, s in held if s.mem}
        left = pool.mem - sum(used.values())
        if ask.mem > left:
            jobs_ = ", ".join(f"{jid} ({m})" for jid, m in sorted(used.items()))
            return Shortage(f"{ask.mem} bytes of memory asked, {max(left, 0)} of {pool.mem} "
                            f"free (held by job(s) {jobs_})")
    return Slice(cpus=got_cpus[0], cpus_exclusive=got_cpus[1], gpus=got_gpus[0],
                 gpus_exclusive=got_gpus[1], mem=ask.mem)


def near_first(cpus: tuple[int, ...], local: list[tuple[int, ...]]) -> tuple[int, ...]:
    """`cpus` reordered so that a count takes CPUs local to the job's GPUs first: one from
    each GPU's local set in turn (a job on two sockets gets CPUs on both), then the rest."""
    return _near_first(cpus, tuple(dict.fromkeys(g for g in local if g)))


_NEAR: dict[tuple, tuple[int, ...]] = {}  # a pass asks the same (pool, GPUs) for every job


def _near_first(cpus: tuple[int, ...], groups: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    key = (cpus, groups)
    if (hit := _NEAR.get(key)) is not None:
        return hit
    sets = [frozenset(g) for g in groups]
    ranked = [[c for c in cpus if c in g] for g in sets]
    seen: dict[int, None] = {}
    for row in range(max((len(r) for r in ranked), default=0)):
        for r in ranked:
            if row < len(r):
                seen.setdefault(r[row])
    for c in cpus:
        seen.setdefault(c)
    out = tuple(seen)
    if len(_NEAR) > 4096:  # bounded: pools and GPU sets are few
        _NEAR.clear()
    _NEAR[key] = out
    return out


def _pick(count: int, listed: tuple | None, pool: tuple, owner: dict, what: str, fmt: object,
          *, none_ok: bool = False, busy: dict | None = None) -> tuple[tuple, bool] | Shortage:
    """(the CPUs or GPUs a job gets, exclusive) for a count, a list or neither, or what is
    missing; `owner`: what other jobs hold exclusively -> the holder's id; `busy` (default
    `owner`): what a count may not take -> a job that holds it."""
    free = [x for x in pool if x not in owner]
    if count:
        busy = owner if busy is None else busy
        idle = [x for x in pool if x not in busy]
        if count > len(idle):
            held = (_held_by(owner, fmt) if busy is owner else
                    _held_by(busy, fmt, how="in use by"))
            return Shortage(f"{count} {what}(s) asked, {len(idle)} free{held}")
        return tuple(idle[:count]), True
    if listed is not None:
        if taken := [x for x in listed if x in owner]:
            return Shortage(f"{what}(s) {fmt(taken)} asked"  # type: ignore[operator]
                            f"{_held_by({x: owner[x] for x in taken}, fmt)}")
        return tuple(sorted(listed) if what == "CPU" else listed), False
    if not free and not none_ok:
        return Shortage(f"no {what} free{_held_by(owner, fmt)}")
    return tuple(free), False


def _cpulist(cpus: object) -> str:
    return ",".join(str(c) for c in sorted(cpus))  # type: ignore[call-overload]


def _gpulist(gpus: object) -> str:
    return ", ".join(gpus)  # type: ignore[call-overload]


def _held_by(owner: dict, fmt: object, *, how: str = "held exclusively by") -> str:
    """"; held exclusively by job 4: 0-1; job 7: 2": which jobs hold the rest, each with
    what it holds."""
    if not owner:
        return ""
    by_job: dict[int, list] = {}
    for thing, jid in owner.items():
        by_job.setdefault(jid, []).append(thing)
    parts = [f"job {jid}: {fmt(things)}" for jid, things in sorted(by_job.items())]  # type: ignore[operator]
    return f"; {how} {'; '.join(parts)}"


def job_device_rules(env_rules: tuple[str, ...], env_minors: dict[str, int],
                     gpus: tuple[str, ...]) -> tuple[str, ...] | None:
    """The device allow-list of a job holding `gpus` in an environment whose allow-list is
    `env_rules` (numbered majors) and whose GPUs have the /dev/nvidiaN minors `env_minors`
    (UUID -> minor): the environment's rules without the other GPUs' nodes (the control
    nodes, nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset and nvidia-caps, stay).
    None when the job holds every GPU of the environment: nothing to narrow, the
    environment's own list applies. ValueError when a rule of the environment's allows the
    others' nodes by a wildcard (`a`, `c *:*`, `c 195:*`): subtracting cannot narrow that."""
    others = {m for u, m in env_minors.items() if u not in gpus}
    if not others:
        return None
    out = []
    for rule in env_rules:
        parts = rule.split()
        if parts[0] == "a":
            raise ValueError(f"the environment's device rule '{rule}' allows every device")
        major, _, minor = parts[1].partition(":")
        if parts[0] == "c" and major in ("*", str(NVIDIA_MAJOR)) and minor == "*":
            raise ValueError(f"the environment's device rule '{rule}' allows every GPU node")
        if (parts[0] == "c" and major == str(NVIDIA_MAJOR) and minor.isdigit()
                and int(minor) in others and int(minor) not in _CONTROL_MINORS):
            continue  # another GPU's /dev/nvidiaN
        out.append(rule)
    return tuple(out)


# ---------------------------------------------------------------- the holders' index


def index_path(state_dir: Path) -> Path:
    return state_dir / "jobs" / ".held"


def slice_of(job: Job) -> Slice:
    """The slice a job's record says it holds."""
    return Slice(cpus=tuple(job.cpus), cpus_exclusive=job.cpus_exclusive,
                 gpus=tuple(job.gpus), gpus_exclusive=job.gpus_exclusive,
                 mem=job.mem_bytes or 0)


def holders(state_dir: Path, boot_id: str) -> tuple[list[Job], list[int]]:
    """The active jobs in the index (whose supervisor, or submitter, is alive), and the ids
    the index held (to know whether it must be rewritten). Call under the jobs lock."""
    from envctl.runtime import jobs

    try:
        ids = [int(i) for i in json.loads(index_path(state_dir).read_bytes())]
    except FileNotFoundError:
        return [], []
    except (OSError, ValueError, TypeError):
        # A torn or damaged index: rebuilt from every record (slow, once).
        ids = [j.id for j in jobs.all_jobs(state_dir) if j.active]
    out = []
    for jid in ids:
        job = jobs.read(state_dir, jid)
        if job is None:
            continue
        shown = job.shown(boot_id)
        # Not a queued one: a pass lists the jobs it claims here before it writes their
        # records (queue.claim), and an orphaned claim is shown back in the queue.
        if shown.active and not shown.queued:
            out.append(job)
    return out, ids


def write_index(state_dir: Path, ids: list[int]) -> None:
    from envctl.host.files import atomic_write

    if not ids:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(index_path(state_dir))
        return
    atomic_write(index_path(state_dir), json.dumps(sorted(ids)).encode(), durable=False)
