"""Applying a plan to the host in order, with a journal, rollback, teardown and drift checks."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from envctl.engine.faults import maybe_fault
from envctl.engine.journal import Entry, Journal, Ledger
from envctl.engine.lock import global_lock
from envctl.engine.signals import deferred
from envctl.errors import EnvctlError, ForeignObject, HostError, StepFailed, StepInterrupted
from envctl.host.context import Host
from envctl.resources.base import Check, Resource, Status, show

# One-character operations, as in `terraform plan`: create, change, keep, remove, already gone,
# and refuse (an object envctl did not make is in the way; `up` stops there).
CREATE, CHANGE, KEEP, REMOVE, GONE, REFUSE = "+", "~", "=", "-", ".", "!"
NOT_APPLIED = "not applied"  # the note on a step of `status` that `up` never applied
OP_FOR_STATUS = {Status.ABSENT: CREATE, Status.DRIFTED: CHANGE, Status.PRESENT: KEEP,
                 Status.WRONG_KIND: CHANGE}


@dataclass
class Step:
    """One line of a plan or a status: what happens (or happened) to one resource."""

    op: str
    resource: Resource
    check: Check
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        # A step `up` never applied is "not-applied" whatever the host shows (it is not envctl's
        # object drifting); its diffs still say what `up` would change.
        status = "not-applied" if self.note == NOT_APPLIED else self.check.status.value
        return {"op": self.op, "key": self.resource.key, "kind": self.resource.kind,
                "describe": self.resource.describe(), "status": status,
                "diffs": [{"field": d.field, "want": show(d.want), "have": show(d.have)}
                          for d in self.check.diffs],
                "detail": self.check.detail, "note": self.note}


def env_state(steps: Sequence[Step]) -> str:
    """"up" (every step envctl applied is there and nothing is missing), "down" (none of its
    kernel objects: never up, taken down, or gone with a reboot; directories on disk may
    remain) or "degraded" (anything between)."""
    applied = [s for s in steps if s.note != NOT_APPLIED]
    if not any(s.resource.volatile for s in applied):
        return "down"
    if len(applied) == len(steps) and all(s.op == KEEP for s in applied):
        return "up"
    return "degraded"


@dataclass
class Outcome:
    """What `up` or `down` did to one environment."""

    env: str
    steps: list[Step] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def count(self, op: str) -> int:
        return sum(1 for s in self.steps if s.op == op)

    def to_json(self) -> dict[str, Any]:
        return {"env": self.env, "steps": [s.to_json() for s in self.steps],
                "errors": self.errors}


Progress = Callable[[str, Step], None]


class Engine:
    """Drives resources against one Host. Every host-changing method takes the global lock."""

    def __init__(self, host: Host, *, lock_timeout: float = 120.0,
                 on_wait: Callable[[str], None] | None = None,
                 progress: Progress | None = None):
        self.host = host
        self.lock_timeout = lock_timeout
        self.on_wait = on_wait
        self.progress = progress or (lambda event, step: None)

    def locked(self) -> AbstractContextManager[None]:
        return global_lock(self.host.state_dir, timeout=self.lock_timeout, on_wait=self.on_wait)

    # ------------------------------------------------------------------ read-only

    def diff(self, env: str, resources: Sequence[Resource]) -> list[Step]:
        """What `up` would do: one step per planned resource, then removals of stale ones."""
        journal = self.journal(env)
        ledger = self.ledger()
        steps = [self._planned_step(r, journal, ledger) for r in resources]
        wanted = {r.key for r in resources}
        for entry in reversed(journal.entries):
            if entry.key not in wanted:
                steps.append(Step(REMOVE, entry.load(), Check.present(),
                                  "no longer in the spec"))
        return steps

    def _planned_step(self, res: Resource, journal: Journal, ledger: Ledger) -> Step:
        check = _safe_check(res, self.host)
        known = ledger.get(res.key) if res.shared else journal.get(res.key)
        if known is None:
            # A step no journal or ledger knows: would `up` refuse what it finds there (some
            # object envctl did not make, perhaps next to where this one goes)?
            try:
                why = res.refuses(res.snapshot(self.host))
            except HostError as exc:
                why = ""
                check = Check(Status.DRIFTED, detail=f"cannot check: {exc}")
            if why:
                return Step(REFUSE, res, check, why)
        return Step(OP_FOR_STATUS[check.status], res, check)

    def diff_down(self, env: str) -> list[Step]:
        """What `down` would do: the journal in reverse, shared resources other envs keep noted."""
        journal = self.journal(env)
        ledger = self.ledger()
        steps = []
        for key, res in self._teardown_order(env, journal, ledger):
            check = _safe_check(res, self.host)
            others = [h for h in ledger.holders(key) if h != env]
            if others:
                steps.append(Step(KEEP, res, check, f"still used by {', '.join(others)}"))
            elif check.status is Status.ABSENT:
                steps.append(Step(GONE, res, check, "already gone"))
            else:
                steps.append(Step(REMOVE, res, check,
                                  self._undo_note(res, _memo(key, res, journal, ledger))))
        return steps

    def status(self, env: str, resources: Sequence[Resource] | None, *,
               unchecked: tuple[str, ...] = ()) -> list[Step]:
        """Each resource envctl made (journal) or would make (plan): ok, missing or drifted.
        Steps of the `unchecked` kinds are not checked (shown kept, with a note): the
        monitor's health loop while GPU sampling is paused, whose MIG checks would open
        NVML."""
        journal = self.journal(env)
        steps: list[Step] = []
        seen = set()
        ledger = self.ledger()
        for entry in journal.entries:
            res = entry.load()
            if res.kind in unchecked:
                steps.append(Step(KEEP, res, Check.present("not checked"), "not checked"))
                seen.add(entry.key)
                continue
            notes = [] if entry.status == "applied" else ["interrupted while applying"]
            check = _safe_check(res, self.host)
            undo = self._undo_note(res, _memo(entry.key, res, journal, ledger))
            if undo:
                others = [h for h in ledger.holders(entry.key) if h != env]
                notes.append(f"at down: {undo}" + (
                    f" (held with {', '.join(others)}: when the last of them goes)"
                    if others else ""))
            steps.append(Step(OP_FOR_STATUS[check.status], res, check, "; ".join(notes)))
            seen.add(entry.key)
        for res in resources or ():
            if res.key not in seen:
                steps.append(Step(CREATE, res, _safe_check(res, self.host), NOT_APPLIED))
        return steps

    # ------------------------------------------------------------------ up

    def up(self, env: str, resources: Sequence[Resource], *, locked: bool = False,
           meta: dict[str, Any] | None = None) -> Outcome:
        """Make the host match `resources`; on failure undo what this run applied and raise.
        `meta` is recorded in the journal first (Journal.meta: the environment's claims, so
        that no other spec can take them while it is up, and the plan's warnings)."""
        with nullcontext() if locked else self.locked():
            return self._up(env, resources, meta, self.ledger(), fold_ledger=True)

    def up_many(self, items: Sequence[tuple[str, Sequence[Resource], dict[str, Any] | None]], *,
                locked: bool = False, prune: tuple[str, ...] | None = None
                ) -> tuple[list[Outcome], dict[str, EnvctlError]]:
        """`up` of each (env, resources, meta) in turn, under one lock hold, with one ledger:
        folded once, at the end (its records are in its log as they happen, as `down_many`
        does), not once per environment. One that fails is rolled back and the others still
        come up: its error is returned by name. A signal stops everything (after rollback).

        `prune` (kinds) applies a part of each plan (the MIG instances `up` makes before it
        plans the rest: app.make_mig): of the journal's entries the part does not name, only
        those of these kinds are removed (None: all of them, as for a whole plan)."""
        outcomes: list[Outcome] = []
        failed: dict[str, EnvctlError] = {}
        with nullcontext() if locked else self.locked():
            ledger = self.ledger()
            try:
                for env, resources, meta in items:
                    try:
                        outcomes.append(self._up(env, resources, meta, ledger,
                                                 fold_ledger=False, prune=prune))
                    except StepInterrupted:
                        raise
                    except EnvctlError as exc:
                        failed[env] = exc
            finally:
                with deferred():
                    problems = _save(ledger)
            if problems:
                raise HostError("; ".join(msg for _, msg in problems))
        return outcomes, failed

    def _up(self, env: str, resources: Sequence[Resource], meta: dict[str, Any] | None,
            ledger: Ledger, *, fold_ledger: bool, prune: tuple[str, ...] | None = None
            ) -> Outcome:
        journal = self.journal(env)
        folded = (journal, ledger) if fold_ledger else (journal,)
        outcome = Outcome(env)
        wanted = {r.key for r in resources}
        applied: list[tuple[str, Resource]] = []  # new this run: what rollback takes back
        step_name = "record the environment's claims"
        try:
            if meta is not None:
                journal.set_meta(meta)
            # Resources the spec no longer asks for go first, newest first.
            for entry in reversed(list(journal.entries)):
                if entry.key not in wanted and (prune is None
                                                or entry.key.split(":", 1)[0] in prune):
                    res = entry.load()
                    step_name = f"remove {res.describe()} (no longer in the spec)"
                    self._release(env, entry.key, res, journal, ledger, index=-1)
                    outcome.steps.append(Step(REMOVE, res, Check.absent(),
                                              "no longer in the spec"))
            for index, res in enumerate(resources):
                step_name = res.describe()
                step = self._converge(env, index, res, journal, ledger, applied)
                outcome.steps.append(step)
                self.progress("done", step)
        except BaseException as exc:
            # Roll back on any error, a bug in a resource and Ctrl-C / SIGTERM included, with
            # further signals held until the journal is saved. Only expected errors become a
            # one-line StepFailed; a bug keeps its traceback.
            with deferred():
                rolled, errors = self._rollback(env, applied, journal, ledger)
                errors += [msg for _, msg in _save(*folded)]
            if isinstance(exc, KeyboardInterrupt):
                raise StepInterrupted(step_name, exc, rolled_back=rolled,
                                      rollback_errors=errors) from None
            if not isinstance(exc, EnvctlError | OSError):
                raise
            raise StepFailed(step_name, exc, rolled_back=rolled,
                             rollback_errors=errors) from exc

        # Keep the journal in plan order so teardown is the plan reversed.
        order = {r.key: i for i, r in enumerate(resources)}
        journal.entries.sort(key=lambda e: order.get(e.key, -1))
        with deferred():
            problems = _save(*folded)
        if problems:
            raise HostError("; ".join(msg for _, msg in problems))
        return outcome

    def journal(self, env: str) -> Journal:
        """`env`'s journal as of this boot (entries from before a reboot dropped)."""
        return Journal.open(self.host.state_dir, env, boot=self.host.boot_id)

    def ledger(self) -> Ledger:
        return Ledger.open(self.host.state_dir, boot=self.host.boot_id)

    def _converge(self, env: str, index: int, res: Resource, journal: Journal, ledger: Ledger,
                  applied: list[tuple[str, Resource]]) -> Step:
        maybe_fault("before", res.key, index)
        check = res.check(self.host)
        entry = journal.get(res.key)
        wanted = _journal_form(res)
        if check.ok and entry is not None and entry.resource == wanted \
                and entry.status == "applied":
            return Step(KEEP, res, check)
        if entry is None:
            memo = self._take_memo(env, res, ledger)
            entry = Entry(res.key, wanted, memo, "applying", res.shared, self.host.boot_id)
            journal.put(entry)
            applied.append((res.key, res))
        else:
            # Known from an earlier run: keep its memo (the host as it was before envctl).
            # Only new parameters need to be on record before the host changes.
            changed = entry.resource != wanted or entry.boot != self.host.boot_id
            entry.resource, entry.status, entry.boot = wanted, "applying", self.host.boot_id
            if changed:
                journal.put(entry)
        maybe_fault("apply", res.key, index)
        if not check.ok:
            self.progress("apply", Step(OP_FOR_STATUS[check.status], res, check))
            res.apply(self.host, entry.memo)
        maybe_fault("after", res.key, index)
        # Not written now: the next step's journal write or the run's final save records it.
        # A crash before then leaves "applying", which `up` and `down` treat like "applied"
        # (check, then converge or remove), so the write would buy nothing but time.
        entry.status = "applied"
        op = OP_FOR_STATUS[check.status]
        return Step(op, res, check, "adopted" if check.ok else "")

    def _take_memo(self, env: str, res: Resource, ledger: Ledger) -> dict[str, Any]:
        item = ledger.get(res.key) if res.shared else None
        if item is not None:
            memo = item["memo"]
        else:
            memo = res.snapshot(self.host)
            why = res.refuses(memo)
            if why:
                # Before anything is journalled: this step owns nothing, so nothing of it is
                # ever removed; the steps before it roll back as for any failure.
                raise ForeignObject(f"{res.describe()}: {why}")
        if not res.shared:
            return memo
        # Ledger first, journal second: a crash in between leaves a holding that `down`
        # still finds (it releases every ledger holding of the environment).
        return ledger.hold(res.key, env, res, memo, boot=self.host.boot_id)

    def _rollback(self, env: str, applied: list[tuple[str, Resource]], journal: Journal,
                  ledger: Ledger) -> tuple[list[str], list[str]]:
        rolled, errors = [], []
        # A removal may tell a rollback from a `down` (an empty data directory this run made
        # goes back; one `down` meets stays: resources.dirs).
        self.host.options["rollback"] = "1"
        try:
            for key, res in reversed(applied):
                try:
                    self._release(env, key, res, journal, ledger, index=-1, faults=False)
                    rolled.append(res.describe())
                except (EnvctlError, OSError) as exc:
                    errors.append(f"{res.describe()}: {exc}")
        finally:
            del self.host.options["rollback"]
        return rolled, errors

    # ------------------------------------------------------------------ down

    def down(self, env: str, *, locked: bool = False) -> Outcome:
        return self.down_many([env], locked=locked)[0]

    def down_many(self, envs: Sequence[str], *, locked: bool = False) -> list[Outcome]:
        """Remove everything each journal says may exist, newest first; restore what was changed.

        Every step is attempted even when one fails; failed ones stay in the journal so that
        running `down` again retries them.

        Environments go down side by side. Each runs its own steps, in its own order, until it
        reaches a kind that removes many objects at once (`Resource.batch_remove`: a veth,
        whose deletion costs the kernel an RCU wait per request); the ones all environments
        reached are removed in one batch, then each goes on. Order within an environment is
        kept; environments share nothing but ledger-counted resources.

        Each removal is logged as it happens; the journals and the ledger are folded once, at
        the end (see engine.journal)."""
        with nullcontext() if locked else self.locked():
            ledger = self.ledger()
            runs = []
            for env in dict.fromkeys(envs):
                journal = self.journal(env)
                if journal.entries:
                    # Until the journal is gone: a `down` that did not finish is not drift
                    # for the monitor to repair (envctl.monitor.health); `up` clears it.
                    journal.set_meta({**journal.meta, "down": True})
                runs.append(_Teardown(env, journal, Outcome(env),
                                      self._teardown_order(env, journal, ledger)))
            try:
                while any(r.pending for r in runs):
                    for run in runs:
                        while run.pending and not _batched(run.head[1]):
                            self._down_step(run, ledger)
                    waiting: dict[type, list[_Teardown]] = {}
                    for run in runs:
                        if run.pending:
                            waiting.setdefault(type(run.head[1]), []).append(run)
                    for kind, group in waiting.items():
                        self._down_batch(kind, group)
            finally:
                with deferred():
                    problems = _save(*(run.journal for run in runs), ledger)
                for store, problem in problems:
                    for run in runs:  # the ledger's concerns them all
                        if store in (run.journal, ledger):
                            run.outcome.errors.append(problem)
            return [run.outcome for run in runs]

    def _down_step(self, run: _Teardown, ledger: Ledger) -> None:
        index, (key, res) = run.pos, run.head
        run.pos += 1
        others = [h for h in ledger.holders(key) if h != run.env]
        memo = _memo(key, res, run.journal, ledger)
        if others:
            op, note = KEEP, f"still used by {', '.join(others)}"
        elif memo is None:
            # A shared setting the ledger lost (down --force of a damaged ledger): what it was
            # before envctl is unknown, so it is left as it is, never set to a guess.
            op, note = KEEP, "left as found: its memo was lost"
        else:
            op, note = REMOVE, self._undo_note(res, memo)
        try:
            self._release(run.env, key, res, run.journal, ledger, index=index)
        except (EnvctlError, OSError) as exc:
            run.outcome.errors.append(f"remove {res.describe()}: {exc}")
            return
        self._removed(run, Step(op, res, Check.absent(), note))

    def _down_batch(self, kind: type[Resource], group: list[_Teardown]) -> None:
        """The head step of every run in `group` (one kind, never shared), removed at once."""
        todo: list[tuple[_Teardown, str, Resource, dict[str, Any]]] = []
        for run in group:
            index, (key, res) = run.pos, run.head
            run.pos += 1
            try:
                maybe_fault("remove", key, index)
            except (EnvctlError, OSError) as exc:
                run.outcome.errors.append(f"remove {res.describe()}: {exc}")
                continue
            entry = run.journal.get(key)
            if entry is None:
                self._removed(run, Step(REMOVE, res, Check.absent()))
                continue
            todo.append((run, key, res, entry.memo))
        if not todo:
            return
        try:
            errors = kind.remove_many(self.host, [(res, memo) for _, _, res, memo in todo])
        except (EnvctlError, OSError) as exc:  # the batch as a whole: every item keeps its step
            errors = [exc] * len(todo)
        for (run, key, res, _), exc in zip(todo, errors, strict=True):
            if exc is not None:
                run.outcome.errors.append(f"remove {res.describe()}: {exc}")
                continue
            run.journal.drop(key)
            self._removed(run, Step(REMOVE, res, Check.absent()))

    def _removed(self, run: _Teardown, step: Step) -> None:
        run.outcome.steps.append(step)
        self.progress("done", step)

    def _undo_note(self, res: Resource, memo: dict[str, Any] | None) -> str:
        """What removing `res` will do (Resource.undo_note); "" when unknown."""
        if memo is None:
            return ""
        try:
            return res.undo_note(self.host, memo)
        except (EnvctlError, OSError):
            return ""

    def _teardown_order(self, env: str, journal: Journal,
                        ledger: Ledger) -> list[tuple[str, Resource]]:
        items = [(e.key, e.load()) for e in reversed(journal.entries)]
        known = {k for k, _ in items}
        # Holdings the journal never recorded (a crash between ledger and journal writes).
        for key in ledger.held_by(env):
            if key not in known:
                items.append((key, Resource.from_dict(ledger.items[key]["resource"])))
        return items

    def _release(self, env: str, key: str, res: Resource, journal: Journal, ledger: Ledger,
                 *, index: int, faults: bool = True) -> None:
        """Remove one step (a shared resource only when `env` is its last holder)."""
        if faults:
            maybe_fault("remove", key, index)
        entry = journal.get(key)
        if res.shared:
            item = ledger.get(key)
            if item is not None and item["holders"] in ([env], []):
                res.remove(self.host, item["memo"])  # the last holder restores the host
            ledger.forget(key, env)
        elif entry is not None:
            res.remove(self.host, entry.memo)
        journal.drop(key)


@dataclass
class _Teardown:
    """One environment's `down` in progress: its steps in teardown order and how far it got."""

    env: str
    journal: Journal
    outcome: Outcome
    items: list[tuple[str, Resource]]
    pos: int = 0

    @property
    def pending(self) -> bool:
        return self.pos < len(self.items)

    @property
    def head(self) -> tuple[str, Resource]:
        return self.items[self.pos]


def _save(*stores: Journal | Ledger) -> list[tuple[Journal | Ledger, str]]:
    """Fold each journal and the ledger; what could not be saved (a full disk), one line each.
    Every store is tried: the records of one that fails stay in its log, which the next run
    reads, so the state on disk still covers everything on the host."""
    problems = []
    for store in stores:
        try:
            store.save(durable=True)
        except HostError as exc:
            problems.append((store, str(exc)))
    return problems


def _memo(key: str, res: Resource, journal: Journal, ledger: Ledger) -> dict[str, Any] | None:
    """The memo `remove` gets for step `key`: the ledger's for a shared resource."""
    if res.shared:
        item = ledger.get(key)
        return None if item is None else item["memo"]
    entry = journal.get(key)
    return None if entry is None else entry.memo


def _batched(res: Resource) -> bool:
    return res.batch_remove and not res.shared


def _journal_form(res: Resource) -> dict[str, Any]:
    """The resource as the journal holds it after a JSON round trip (tuples become lists), so
    an unchanged resource compares equal to its journal entry."""
    return json.loads(json.dumps(res.to_dict()))


def _safe_check(res: Resource, host: Host) -> Check:
    try:
        return res.check(host)
    except HostError as exc:
        return Check(Status.DRIFTED, detail=f"cannot check: {exc}")
