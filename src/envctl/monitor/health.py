"""The monitor's health loop: check every environment that is up, and re-converge one that
drifted or whose service died to what its last `up` applied, with exponential backoff per
environment and a line in the events log for what it found and did.

Each tick, for each environment that is up:

1. check it, read-only: `Engine.status` of what its journal says was applied (no spec, no
   planner: a spec edited since `up` is not drift). `up` -> healthy; `down` -> not up any
   more (taken down meanwhile), nothing to do; `degraded` -> drift (`drift` event, once per
   change of what is wrong).
2. heal it when its backoff allows (and --no-heal was not given): take the global lock
   *without waiting* (a user's `up`/`down` holds it: `heal-deferred`, try again next tick, no
   backoff), check again under the lock (the user's command may have fixed it or taken it
   down), then `Engine.up` of the resources its journal records as applied (never the spec as
   edited since: that is `envctl up`'s), with its rollback. `healed` or `heal-failed` goes to
   the events log; an unfinished `down` or an unreadable journal is `heal-skipped`.

An environment in maintenance (`envctl maintenance ENV on`: monitor/maintenance.py) is checked
and its drift reported, never healed (one `heal-paused` event). A service that ended as its
restart policy says (`restart: no`; `on-failure` after exit 0) is not drift to the monitor:
it stays ended (resources/service.py, host.options["monitor"]).

While systemd shuts the host down, nothing is reported or healed: systemd stops the
environments' slices and scopes itself, and envctl.service's ExecStop= takes them down (the
monitor would otherwise log their teardown as drift and try to start them again).

Backoff: the first heal of a drift runs at once; after each attempt (whatever its result) the
next may run only `base * 2**(n-1)` seconds later (capped at `cap`); the count is forgotten
once the environment has stayed healthy for `reset_after` seconds. A service that dies a
minute after every heal is thus healed after 10 s, 20 s, 40 s … 15 min: never a restart storm.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envctl.monitor import events

BASE_DELAY = 10.0
MAX_DELAY = 900.0
RESET_AFTER = 600.0


@dataclass
class _Retry:
    attempts: int = 0
    next_at: float = 0.0
    healthy_since: float | None = None


@dataclass
class Backoff:
    """Per-environment exponential backoff between heal attempts, on an injectable clock."""

    base: float = BASE_DELAY
    cap: float = MAX_DELAY
    reset_after: float = RESET_AFTER
    clock: Callable[[], float] = time.monotonic
    state: dict[str, _Retry] = field(default_factory=dict)

    def due(self, env: str) -> bool:
        """Whether a heal of `env` may run now."""
        r = self.state.get(env)
        return r is None or self.clock() >= r.next_at

    def retry_in(self, env: str) -> float:
        r = self.state.get(env)
        return 0.0 if r is None else max(0.0, r.next_at - self.clock())

    def attempted(self, env: str) -> float:
        """Record a heal attempt now; the delay before the next one may run."""
        r = self.state.setdefault(env, _Retry())
        r.attempts += 1
        delay = min(self.cap, self.base * 2 ** (r.attempts - 1))
        r.next_at = self.clock() + delay
        r.healthy_since = None
        return delay

    def healthy(self, env: str) -> None:
        """`env` was found healthy now: after `reset_after` of that, its count is forgotten."""
        r = self.state.get(env)
        if r is None:
            return
        now = self.clock()
        if r.healthy_since is None:
            r.healthy_since = now
        elif now - r.healthy_since >= self.reset_after:
            del self.state[env]

    def unhealthy(self, env: str) -> None:
        r = self.state.get(env)
        if r is not None:
            r.healthy_since = None

    def forget(self, env: str) -> None:
        self.state.pop(env, None)


class LockBusy(Exception):
    """Another envctl holds the global lock: heal later."""


class CannotHeal(Exception):
    """This environment cannot be healed here (its `down` did not finish, or its journal
    cannot be read)."""


@dataclass
class Check:
    """What a check found: the environment's state and what is missing or drifted."""

    state: str  # "up", "degraded", "down"
    problems: list[str] = field(default_factory=list)
    # It holds MIG steps, not checked while GPU sampling is paused: not healed either (a heal
    # would check them, opening NVML, and turn MIG mode on again after the operator's change).
    paused_gpu: bool = False


# The kinds whose check asks NVML (host/mig.py): not checked, nor healed, while GPU sampling
# is paused (`envctl maintenance --gpus on`: the operator's `nvidia-smi -r` or MIG change,
# which a heal would undo by turning MIG mode on again).
NVML_KINDS = ("mig-mode", "mig-instance")


def gpus_paused(host: Any) -> bool:
    from envctl.monitor import maintenance

    run_dir = getattr(host, "run_dir", None)
    return run_dir is not None and maintenance.read(run_dir, maintenance.GPUS) is not None


def check_env(host: Any, env: str) -> Check:
    """Read-only: the engine's check of every step `env`'s journal records as applied (but
    those that ask NVML while GPU sampling is paused: `paused_gpu` says it had some)."""
    from envctl.engine.engine import KEEP, NOT_APPLIED, Engine, env_state

    host.options["monitor"] = "1"  # a service its restart policy ended is not drift
    unchecked = NVML_KINDS if gpus_paused(host) else ()
    steps = Engine(host).status(env, None, unchecked=unchecked)
    problems = [f"{s.resource.describe()}: {s.check.detail or s.check.status.value}"
                for s in steps if s.op != KEEP and s.note != NOT_APPLIED]
    return Check(env_state(steps), problems,
                 paused_gpu=any(s.resource.kind in unchecked for s in steps))


def host_stopping(host: Any) -> bool:
    """Whether systemd is shutting this host down; False where systemd is not PID 1."""
    if not os.path.isdir("/run/systemd/system"):  # sd_booted(3)
        return False
    return host.systemd.stopping()


def heal_env(host: Any, env: str) -> list[str] | None:
    """Re-converge what `env`'s journal records as applied, under the global lock taken
    without waiting: the resources the last `envctl up` applied, never its spec as edited
    since (applying an edit is `envctl up`'s, which the operator runs), and nothing removed.
    The steps it changed; None when the check under the lock found nothing to do. LockBusy
    when the lock is held; CannotHeal when the journal cannot be read; the engine's errors
    (StepFailed: rolled back) otherwise."""
    from envctl.engine.engine import KEEP, Engine, env_state
    from envctl.errors import LockTimeout, StateCorrupt

    host.options["monitor"] = "1"  # a service its restart policy ended stays ended
    engine = Engine(host, lock_timeout=0)
    try:
        with engine.locked():
            if env_state(engine.status(env, None)) != "degraded":
                return None  # a user's up fixed it, or a down took it away, meanwhile
            try:
                journal = engine.journal(env)
                if journal.meta.get("down"):
                    raise CannotHeal("a `envctl down` of it did not finish: run it again")
                resources = [e.load() for e in journal.entries]
            except StateCorrupt as exc:
                raise CannotHeal(f"its journal cannot be read: {exc}") from exc
            outcome = engine.up(env, resources, locked=True)  # meta as recorded
    except LockTimeout as exc:
        raise LockBusy(str(exc)) from exc
    return [f"{s.op} {s.resource.describe()}" for s in outcome.steps if s.op != KEEP]


class Health:
    """The health loop's state across ticks: last findings, backoff, heal counts."""

    def __init__(self, host: Any, *, heal: bool = True, log: bool = True,
                 backoff: Backoff | None = None,
                 checker: Callable[[str], Check] | None = None,
                 healer: Callable[[str], list[str] | None] | None = None,
                 say: Callable[[str], None] | None = None,
                 wall: Callable[[], float] = time.time,
                 stopping: Callable[[], bool] | None = None):
        self.host = host
        self.heal = heal
        self.log = log  # append what it finds to the events log (not: a probe, monitor --once)
        self.backoff = backoff or Backoff()
        self.checker = checker or (lambda env: check_env(host, env))
        self.healer = healer or (lambda env: heal_env(host, env))
        self.stopping = stopping or (lambda: host_stopping(host))
        self.shutdown_said = False
        self.muted: set[str] = set()  # drift found while the host was shutting down
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.wall = wall
        self.last: dict[str, Check] = {}
        self.last_event: dict[str, str] = {}
        self.heals: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.healed: set[str] = set()  # those the last round re-converged
        self.paused: set[str] = set()  # those in maintenance (`envctl maintenance ENV on`)

    def _event(self, env: str, kind: str, detail: str = "") -> None:
        self.last_event[env] = kind
        self.say(f"{env}: {kind}" + (f": {detail}" if detail else ""))
        if not self.log:
            return
        try:
            events.append(self.host.state_dir, env, kind, detail, now=self.wall())
        except OSError as exc:
            self.say(f"warning: events log not written: {exc}")

    def run(self, envs: list[str]) -> dict[str, dict[str, Any]]:
        """One round over `envs` (those that are up); the view the exporters show."""
        from envctl.errors import EnvctlError

        self.healed = set()
        self.paused = self._paused(envs)
        stopping: bool | None = None  # asked once a round, and only when something is wrong
        for gone in [e for e in self.last if e not in envs]:
            del self.last[gone]
            self.backoff.forget(gone)
        for env in envs:
            try:
                found = self.checker(env)
            except EnvctlError as exc:  # a damaged journal: `status` says the same
                found = Check("degraded", [f"cannot check: {exc}"])
            except Exception as exc:  # noqa: BLE001 - one environment must not end the daemon
                found = Check("degraded", [f"cannot check: bug: {exc!r}"])
            before = self.last.get(env)
            self.last[env] = found
            if found.state == "up":
                self.backoff.healthy(env)
                continue
            if found.state == "down":
                self.backoff.forget(env)
                continue
            if stopping is None:
                stopping = self._host_stopping()
            if stopping:
                self.muted.add(env)  # systemd's teardown: shown as it is, not logged or healed
                continue
            self.backoff.unhealthy(env)
            if before is None or before.problems != found.problems or env in self.muted:
                self.muted.discard(env)
                self._event(env, "drift", "; ".join(found.problems))
            if self.heal and env in self.paused:
                if self.last_event.get(env) != "heal-paused":  # once, not every tick
                    self._event(env, "heal-paused", "maintenance is on (`envctl maintenance "
                                f"{env} off` resumes healing)")
            elif self.heal and found.paused_gpu:
                if self.last_event.get(env) != "heal-paused":
                    self._event(env, "heal-paused", "GPU sampling is paused (`envctl "
                                "maintenance --gpus off` resumes healing)")
            elif self.heal and self.backoff.due(env):
                self._heal(env)
        return self.view()

    def _paused(self, envs: list[str]) -> set[str]:
        from envctl.monitor import maintenance

        run_dir = getattr(self.host, "run_dir", None)
        return set(maintenance.paused(run_dir, envs)) if run_dir is not None else set()

    def _host_stopping(self) -> bool:
        try:
            stopping = self.stopping()
        except Exception:  # noqa: BLE001 - cannot tell: go on as on any other tick
            return False
        if stopping and not self.shutdown_said:
            self.say("the host is shutting down: no drift reported or healed from now on")
        self.shutdown_said = stopping  # a shutdown cancelled and started again: said again
        return stopping

    def _heal(self, env: str) -> None:
        from envctl.errors import EnvctlError

        try:
            changed = self.healer(env)
        except LockBusy as exc:
            if self.last_event.get(env) != "heal-deferred":
                self._event(env, "heal-deferred", f"{exc}; trying again next tick")
            return
        except CannotHeal as exc:
            delay = self.backoff.attempted(env)
            self._event(env, "heal-skipped", f"{exc}; next attempt in {delay:.0f} s")
            return
        except Exception as exc:  # noqa: BLE001 - the loop must outlive one bad heal
            delay = self.backoff.attempted(env)
            self.failures[env] = self.failures.get(env, 0) + 1
            why = str(exc) if isinstance(exc, EnvctlError | OSError) else f"bug: {exc!r}"
            self._event(env, "heal-failed", f"{why}; next attempt in {delay:.0f} s")
            return
        self.backoff.attempted(env)
        if changed is None:
            self.last.pop(env, None)  # fixed meanwhile: the next check says so
            return
        self.heals[env] = self.heals.get(env, 0) + 1
        self.healed.add(env)
        self.last[env] = Check("up")
        self._event(env, "healed", "; ".join(changed) or "nothing needed changing")

    def view(self) -> dict[str, dict[str, Any]]:
        return {env: {"state": c.state, "drift": len(c.problems),
                      "heals": self.heals.get(env, 0), "heal_failures": self.failures.get(env, 0),
                      "retry_in": self.backoff.retry_in(env),
                      **({"maintenance": True} if env in self.paused else {})}
                for env, c in self.last.items()}


def quarantine_gpus(host: Any, gpus: list[Any], gpu_env: dict[str, str], *, log: bool = True,
                    say: Callable[[str], None] | None = None) -> dict[str, str]:
    """What this tick's GPU samples say against each GPU (a fatal XID event, lost, volatile
    uncorrectable ECC errors) recorded in the quarantine ledger when `log`, with a
    `gpu-quarantined` event under the environment holding it ("host" when none); the ledger's
    GPU UUID -> reason afterwards (for the snapshot and the metric)."""
    from envctl.engine import quarantine
    from envctl.errors import StateCorrupt
    from envctl.host.gpuhealth import Finding

    findings = []
    for g in gpus:
        for xid in g.fatal_xids:
            findings.append(Finding(g.uuid, g.index, "xid", f"XID {xid} (NVML event)"))
        g.fatal_xids.clear()
        if g.lost:
            findings.append(Finding(g.uuid, g.index, "lost", "NVML: GPU is lost (fallen off "
                                    "the bus or its driver state is broken)"))
        if g.ecc.get("dbe_vol"):
            findings.append(Finding(g.uuid, g.index, "ecc", f"{g.ecc['dbe_vol']} volatile "
                                    "uncorrectable ECC error(s) since the last reset"))
    try:
        if log and findings:
            changed = quarantine.record(host.state_dir, findings, boot=host.boot_id)
            for uuid, why in changed.items():
                index = next(f.index for f in findings if f.uuid == uuid)
                detail = f"GPU {index} ({uuid}): {why}"
                if say is not None:
                    say(f"{gpu_env.get(uuid, 'host')}: gpu-quarantined: {detail}")
                events.append(host.state_dir, gpu_env.get(uuid, "host"), "gpu-quarantined",
                              detail)
        return quarantine.load(host.state_dir).reasons()
    except (OSError, StateCorrupt) as exc:
        if say is not None:
            say(f"warning: GPU quarantine ledger: {exc}")
        return {}
