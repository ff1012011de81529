"""The monitor's health loop with an injected clock, checker and healer: heal at once, back off
exponentially on a failure that recurs (no restart storm), defer while a user's command holds
the global lock, leave environments that were taken down alone, and log what it did."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from envctl.engine.lock import global_lock
from envctl.errors import HostError
from envctl.host.context import Host
from envctl.monitor import events
from envctl.monitor.health import (
    Backoff,
    CannotHeal,
    Check,
    Health,
    LockBusy,
    check_env,
    heal_env,
)

DRIFT = Check("degraded", ["service box (sleep): not running: its supervisor is gone"])


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def health(tmp_path, checker, healer, *, heal=True, clock=None):
    clock = clock or Clock()
    said: list[str] = []
    h = Health(Host(state_dir=tmp_path), heal=heal, backoff=Backoff(clock=clock),
               checker=checker, healer=healer, say=said.append, wall=lambda: 1000 + clock.t)
    return h, clock, said


def logged(tmp_path) -> list[tuple[str, str]]:
    return [(r["env"], r["event"]) for r in events.recent(tmp_path, per_env=100).get("box", [])]


def test_backoff_doubles_caps_and_resets_after_a_healthy_while():
    clock = Clock()
    b = Backoff(base=10, cap=60, reset_after=100, clock=clock)
    assert b.due("x")
    delays = [b.attempted("x") for _ in range(5)]
    assert delays == [10, 20, 40, 60, 60]
    assert not b.due("x") and b.retry_in("x") == 60
    clock.t = 59.9
    assert not b.due("x")
    clock.t = 60
    assert b.due("x")
    b.healthy("x")  # healthy from now on …
    clock.t = 150
    b.healthy("x")
    assert b.attempted("x") == 120 / 2  # … but not for 100 s yet: still backing off (60)
    b.healthy("x")
    clock.t = 260
    b.healthy("x")  # 110 s healthy: forgotten
    assert b.due("x") and b.attempted("x") == 10


def test_drift_is_healed_at_once_and_logged(tmp_path):
    state = {"check": DRIFT}
    healed = []

    def healer(env):
        healed.append(env)
        state["check"] = Check("up")
        return ["+ service box (sleep)"]

    h, clock, said = health(tmp_path, lambda env: state["check"], healer)
    view = h.run(["box"])
    assert healed == ["box"]
    assert view["box"] == {"state": "up", "drift": 0, "heals": 1, "heal_failures": 0,
                           "retry_in": 10.0}
    assert logged(tmp_path) == [("box", "drift"), ("box", "healed")]
    rec = events.recent(tmp_path)["box"][-1]
    assert rec["detail"] == "+ service box (sleep)" and rec["time"] == 1000.0
    assert said[-1] == "box: healed: + service box (sleep)"
    h.run(["box"])
    assert healed == ["box"]  # healthy now: nothing more


def test_a_recurring_failure_backs_off_instead_of_storming(tmp_path):
    calls: list[float] = []

    def healer(env):
        calls.append(clock.t)
        raise HostError("start the service of 'box': its supervisor died")

    clock = Clock()
    h, _, _ = health(tmp_path, lambda env: DRIFT, healer, clock=clock)
    for _ in range(240):  # two hours of 30 s ticks
        h.run(["box"])
        clock.t += 30
    # 10 s, 20 s, 40 s … after each attempt (the first tick at or after it), then every
    # 15 min: 14 attempts in two hours, where a heal per tick would make 240.
    assert calls == [0, 30, 60, 120, 210, 390, 720, 1380, 2280, 3180, 4080, 4980, 5880, 6780]
    assert h.view()["box"]["heal_failures"] == len(calls)
    kinds = [e for _, e in logged(tmp_path)]
    assert kinds.count("heal-failed") == len(calls) and kinds.count("drift") == 1
    assert "next attempt in" in events.recent(tmp_path)["box"][-1]["detail"]


def test_a_service_that_dies_after_every_heal_is_healed_less_and_less_often(tmp_path):
    calls: list[float] = []
    clock = Clock()

    def checker(env):
        # Up for one tick after each heal, then dead again.
        return Check("up") if calls and clock.t - calls[-1] <= 30 else DRIFT

    def healer(env):
        calls.append(clock.t)
        return ["+ service box"]

    h, _, _ = health(tmp_path, checker, healer, clock=clock)
    for _ in range(240):
        h.run(["box"])
        clock.t += 30
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert len(calls) <= 15 and gaps[-1] >= 900, calls  # a restart a minute otherwise


def test_a_held_lock_defers_without_backing_off(tmp_path):
    busy = {"on": True}
    calls = []

    def healer(env):
        calls.append(env)
        if busy["on"]:
            raise LockBusy("lock state/lock is still held by pid 4242")
        return ["+ service box"]

    h, clock, _ = health(tmp_path, lambda env: DRIFT, healer)
    for _ in range(3):
        h.run(["box"])
        clock.t += 1
    assert len(calls) == 3  # tried every tick: no backoff for a lock held by somebody else
    assert logged(tmp_path) == [("box", "drift"), ("box", "heal-deferred")]  # logged once
    busy["on"] = False
    h.run(["box"])
    assert logged(tmp_path)[-1] == ("box", "healed")


def test_no_heal_reports_drift_only_once_per_change(tmp_path):
    checks = [DRIFT, DRIFT, Check("degraded", ["cgroup box: missing"]), Check("up")]

    def healer(env):
        raise AssertionError("--no-heal must not heal")

    h, _, _ = health(tmp_path, lambda env: checks.pop(0), healer, heal=False)
    for _ in range(4):
        view = h.run(["box"])
    assert logged(tmp_path) == [("box", "drift"), ("box", "drift")]
    assert view["box"]["state"] == "up"


def test_environments_taken_down_are_left_alone(tmp_path):
    def healer(env):
        raise AssertionError("a down environment is not healed")

    h, _, _ = health(tmp_path, lambda env: Check("down"), healer)
    h.run(["box"])
    h.run([])  # its journal is gone: not up any more
    assert h.view() == {} and logged(tmp_path) == []


def test_an_environment_without_a_spec_is_skipped_and_backs_off(tmp_path):
    calls = []

    def healer(env):
        calls.append(env)
        raise CannotHeal("its spec cannot be planned: no environment 'box'")

    h, clock, _ = health(tmp_path, lambda env: DRIFT, healer)
    h.run(["box"])
    h.run(["box"])
    assert calls == ["box"] and logged(tmp_path)[-1] == ("box", "heal-skipped")


# ---------------------------------------------------------------- against the engine


def test_check_env_of_an_environment_with_no_journal_is_down(tmp_path):
    assert check_env(Host(state_dir=tmp_path), "box").state == "down"


SPEC = "name: box\nkind: cpu\n"


def test_heal_never_waits_for_the_global_lock(tmp_path):
    host = Host(state_dir=tmp_path / "state", run_dir=tmp_path / "run")
    held, done = threading.Event(), threading.Event()

    def users_up() -> None:  # a user's `up` in progress (another thread: not this one's hold)
        with global_lock(host.state_dir, timeout=1):
            held.set()
            done.wait(30)

    t = threading.Thread(target=users_up)
    t.start()
    try:
        assert held.wait(30)
        began = time.monotonic()
        with pytest.raises(LockBusy, match="held by pid"):
            heal_env(host, "box")
        assert time.monotonic() - began < 1.0
    finally:
        done.set()
        t.join()
    # Not up (no journal): the check under the lock finds nothing to heal, and changes nothing.
    assert heal_env(host, "box") is None
    assert not Path(host.state_dir / "journal").exists()



def test_nothing_is_logged_or_healed_while_the_host_shuts_down(tmp_path):
    """systemd stops the environments' slices and scopes at shutdown, before envctl.service's
    ExecStop= takes them down: that is not drift, and a heal would start them again."""
    asked: list[int] = []
    shutting_down = {"now": False}

    def stopping():
        asked.append(1)
        return shutting_down["now"]

    healed: list[str] = []
    state = {"check": Check("up")}
    h, clock, said = health(tmp_path, lambda env: state["check"],
                            lambda env: healed.append(env) or ["+ x"])
    h.stopping = stopping
    h.run(["box"])
    assert asked == []  # nothing wrong: never asked
    shutting_down["now"] = True
    state["check"] = DRIFT
    for _ in range(3):
        view = h.run(["box"])
        clock.t += 30
    assert healed == [] and logged(tmp_path) == []
    assert view["box"]["state"] == "degraded"  # shown as it is
    assert said == ["the host is shutting down: no drift reported or healed from now on"]
    assert len(asked) == 3  # once a round
    shutting_down["now"] = False  # (a shutdown cancelled: back to normal)
    h.run(["box"])
    assert healed == ["box"] and logged(tmp_path) == [("box", "drift"), ("box", "healed")]


def test_a_failing_shutdown_probe_does_not_stop_the_loop(tmp_path):
    def stopping():
        raise RuntimeError("no bus")

    healed: list[str] = []
    h, _, _ = health(tmp_path, lambda env: DRIFT, lambda env: healed.append(env) or ["+ x"])
    h.stopping = stopping
    h.run(["box"])
    assert healed == ["box"]


def test_maintenance_pauses_healing_but_not_reporting(tmp_path):
    from envctl.monitor import maintenance

    run = tmp_path / "run"
    healed = []
    h = Health(Host(state_dir=tmp_path, run_dir=run), backoff=Backoff(clock=Clock()),
               checker=lambda env: DRIFT, healer=lambda env: healed.append(env) or ["+ x"],
               say=lambda line: None, wall=lambda: 1000.0)
    assert maintenance.set_mode(run, "box", True, now=5.0)
    assert not maintenance.set_mode(run, "box", True)  # already on: the first since stays
    assert maintenance.read(run, "box")["since"] == 5.0
    for _ in range(3):
        view = h.run(["box", "other"])
    assert healed == ["other"]  # `other` is healed; `box` only checked
    assert view["box"]["maintenance"] and view["box"]["state"] == "degraded"
    assert logged(tmp_path) == [("box", "drift"), ("box", "heal-paused")]  # once each
    assert maintenance.set_mode(run, "box", False)
    assert not (run / maintenance.DIR).exists()  # the last mark off: its directory goes too
    h.run(["box"])
    assert healed == ["other", "box"]
    assert not maintenance.set_mode(run, "box", False)


def test_while_gpu_sampling_is_paused_mig_steps_are_neither_checked_nor_healed(tmp_path,
                                                                               monkeypatch):
    """`maintenance --gpus on` releases NVML for the operator's `nvidia-smi -r` or MIG change:
    the health loop's check of an environment's MIG steps opened NVML again (host/mig.py),
    and a heal of the drift the operator's change made turned MIG mode back on."""
    from envctl.engine.engine import KEEP, Engine
    from envctl.monitor import health as hl
    from envctl.monitor import maintenance
    from tests.unit import fakes

    # The engine: steps of an unchecked kind are shown kept, their check never called.
    fakes.reset()
    host = Host(state_dir=tmp_path / "state", run_dir=tmp_path / "run")
    Engine(host).up("box", [fakes.Thing("a")])
    fakes.WORLD.pop("a")  # gone: a check would find it missing
    checked = Engine(host).status("box", None)
    assert [s.op for s in checked] != [KEEP]
    steps = Engine(host).status("box", None, unchecked=("fake-thing",))
    assert [(s.op, s.note) for s in steps] == [(KEEP, "not checked")]
    fakes.reset()

    # check_env asks for the NVML kinds unchecked only while the pause mark is there.
    asked = []
    monkeypatch.setattr(Engine, "status",
                        lambda self, env, res, unchecked=(): asked.append(unchecked) or [])
    assert hl.check_env(host, "box").paused_gpu is False
    maintenance.set_mode(host.run_dir, maintenance.GPUS, True)
    hl.check_env(host, "box")
    assert asked == [(), hl.NVML_KINDS]

    # The loop: an environment whose MIG steps went unchecked is not healed while paused.
    healed = []
    h, _, _ = health(tmp_path, lambda env: Check("degraded", ["service box: not running"],
                                                 paused_gpu=True),
                     lambda env: healed.append(env) or [])
    h.run(["box"])
    h.run(["box"])
    assert healed == []
    assert logged(tmp_path) == [("box", "drift"), ("box", "heal-paused")]
