"""The engine's bookkeeping with a fake resource kind: order, rollback, adoption, sharing."""

from __future__ import annotations

import pytest

from envctl.engine.engine import Engine
from envctl.engine.journal import Journal, Ledger
from envctl.errors import StepFailed
from envctl.host.context import Host
from tests.unit import fakes
from tests.unit.fakes import SharedThing, Thing


@pytest.fixture
def engine(tmp_path):
    fakes.reset()
    yield Engine(Host(state_dir=tmp_path / "state", run_dir=tmp_path / "run"))
    fakes.reset()


PLAN = [Thing("a"), Thing("b"), Thing("c")]


def test_up_applies_in_order_and_down_reverses(engine):
    out = engine.up("env", PLAN)
    assert [s.op for s in out.steps] == ["+", "+", "+"]
    assert fakes.LOG == ["apply a", "apply b", "apply c"]
    assert [e.key for e in Journal.open(engine.host.state_dir, "env").entries] == [
        "fake-thing:a", "fake-thing:b", "fake-thing:c"]
    engine.down("env")
    assert fakes.LOG[3:] == ["remove c", "remove b", "remove a"]
    assert fakes.WORLD == {}
    assert not Journal.open(engine.host.state_dir, "env").exists()


def test_second_up_keeps_everything(engine):
    engine.up("env", PLAN)
    out = engine.up("env", PLAN)
    assert [s.op for s in out.steps] == ["=", "=", "="]
    assert fakes.LOG == ["apply a", "apply b", "apply c"]


def test_failure_rolls_back_this_run_in_reverse_and_names_the_step(engine):
    fakes.FAIL_ON.add("c")
    with pytest.raises(StepFailed) as exc:
        engine.up("env", PLAN)
    assert "fake-thing c" in str(exc.value) and "injected" in str(exc.value)
    assert exc.value.rolled_back == ["fake-thing c", "fake-thing b", "fake-thing a"]
    assert fakes.LOG == ["apply a", "apply b", "remove c", "remove b", "remove a"]
    assert fakes.WORLD == {}
    assert not Journal.open(engine.host.state_dir, "env").exists()


def test_rollback_spares_what_earlier_runs_made(engine):
    engine.up("env", PLAN[:2])
    fakes.FAIL_ON.add("c")
    with pytest.raises(StepFailed):
        engine.up("env", PLAN)
    assert fakes.WORLD == {"a": "on", "b": "on"}
    assert [e.key for e in Journal.open(engine.host.state_dir, "env").entries] == [
        "fake-thing:a", "fake-thing:b"]


def test_preexisting_object_is_adopted_and_restored_not_deleted(engine):
    fakes.WORLD["a"] = "off"
    engine.up("env", PLAN)
    assert fakes.WORLD["a"] == "on"
    engine.down("env")
    assert fakes.WORLD == {"a": "off"}


def test_drift_is_repaired_with_the_original_memo(engine):
    fakes.WORLD["b"] = "orig"
    engine.up("env", PLAN)
    fakes.WORLD["b"] = "tampered"
    steps = engine.diff("env", PLAN)
    assert [s.op for s in steps] == ["=", "~", "="]
    assert str(steps[1].check.diffs[0]) == "value: tampered -> on"
    engine.up("env", PLAN)
    assert fakes.WORLD["b"] == "on"
    engine.down("env")
    assert fakes.WORLD == {"b": "orig"}


def test_removed_from_spec_goes_on_next_up(engine):
    engine.up("env", PLAN)
    out = engine.up("env", PLAN[:2])
    assert out.steps[0].op == "-" and out.steps[0].resource == Thing("c")
    assert "c" not in fakes.WORLD


def test_shared_resource_restored_by_the_last_holder_with_the_first_memo(engine):
    fakes.WORLD["s"] = "orig"
    engine.up("one", [SharedThing("s")])
    engine.up("two", [SharedThing("s")])
    assert Ledger.open(engine.host.state_dir).holders("fake-shared:s") == ["one", "two"]
    assert [s.op for s in engine.diff_down("one")] == ["="]
    engine.down("one")
    assert fakes.WORLD["s"] == "on"
    engine.down("two")
    assert fakes.WORLD == {"s": "orig"}
    assert not (engine.host.state_dir / "shared.json").exists()


def test_ledger_holding_without_journal_entry_is_released_by_down(engine):
    # As after a crash between the ledger write and the journal write.
    fakes.WORLD["s"] = "orig"
    ledger = Ledger.open(engine.host.state_dir)
    ledger.hold("fake-shared:s", "one", SharedThing("s"), {"old": "orig"})
    fakes.WORLD["s"] = "on"
    engine.down("one")
    assert fakes.WORLD == {"s": "orig"}


def test_down_continues_past_a_failing_step_and_keeps_it(engine, monkeypatch):
    engine.up("env", PLAN)

    def boom(self, host, memo):
        raise fakes.HostError("remove thing 'b': refused")

    monkeypatch.setattr(Thing, "remove", lambda self, h, m: boom(self, h, m)
                        if self.name == "b" else fakes.WORLD.pop(self.name, None))
    out = engine.down("env")
    assert out.errors and "refused" in out.errors[0]
    assert fakes.WORLD == {"b": "on"}
    assert [e.key for e in Journal.open(engine.host.state_dir, "env").entries] == [
        "fake-thing:b"]


def test_status_marks_interrupted_steps(engine):
    journal = Journal.open(engine.host.state_dir, "env")
    from envctl.engine.journal import Entry

    journal.put(Entry("fake-thing:a", Thing("a").to_dict(), {"old": None}, "applying"))
    rows = engine.status("env", PLAN)
    assert rows[0].note == "interrupted while applying" and rows[0].op == "+"
    assert [r.note for r in rows[1:]] == ["not applied", "not applied"]


def test_a_bug_in_a_resource_still_rolls_back_and_keeps_its_traceback(engine, monkeypatch):
    def broken(self, host, memo):
        if self.name == "b":
            raise TypeError("a bug")
        fakes.WORLD[self.name] = self.value

    monkeypatch.setattr(Thing, "apply", broken)
    with pytest.raises(TypeError, match="a bug"):
        engine.up("env", PLAN)
    assert fakes.WORLD == {}
    assert not Journal.open(engine.host.state_dir, "env").exists()


def test_an_unchanged_resource_with_tuple_fields_is_kept_without_rewriting(engine, monkeypatch):
    from tests.unit.fakes import TupleThing

    engine.up("env", [TupleThing("t")])
    writes = []
    monkeypatch.setattr(Journal, "put", lambda self, e: writes.append(e))
    out = engine.up("env", [TupleThing("t")])
    assert [(s.op, s.note) for s in out.steps] == [("=", "")]
    assert writes == []


def test_every_resource_kind_is_found_through_the_module_table():
    """A journal loads only the modules of the kinds it names: the table must know them all."""
    import importlib
    import pkgutil

    import envctl.resources as pkg
    from envctl.resources import MODULES
    from envctl.resources.base import REGISTRY, Resource

    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"envctl.resources.{mod.name}")
    ours = {kind: cls.__module__.rsplit(".", 1)[1] for kind, cls in REGISTRY.items()
            if cls.__module__.startswith("envctl.resources.")}
    assert ours == MODULES
    with pytest.raises(ValueError, match="unknown resource kind 'nope'"):
        Resource.from_dict({"kind": "nope"})


def test_down_imports_neither_specs_nor_unused_resource_kinds(tmp_path):
    """`down` starts from the journal: no pydantic, YAML or planner, and only the kinds named."""
    import subprocess
    import sys

    code = ("import sys, json\n"
            "from pathlib import Path\n"
            "from envctl.engine.journal import Journal\n"
            "import envctl.app, envctl.cli\n"
            f"j = Journal.open(Path({str(tmp_path)!r}), 'web')\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('pydantic', 'yaml', 'pyroute2') or m.startswith(('envctl.spec', 'envctl.plan', "
            "'envctl.resources.', 'envctl.workspace')))))\n")
    journal = tmp_path / "journal"
    journal.mkdir()
    (journal / "web.json").write_text(
        '{"version": 1, "env": "web", "entries": [{"key": "netns:web", "resource": '
        '{"kind": "netns", "name": "web"}, "memo": {}, "status": "applied"}]}')
    code += ("j.entries[0].load()\n"
             "print(sorted(m for m in sys.modules if m.startswith('envctl.resources.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    # Opening the journal checks every kind it names (a kind this envctl does not know is a
    # damaged journal), which imports those modules and no other.
    assert out[0] == '["envctl.resources.base", "envctl.resources.netns"]'
    assert out[1] == "['envctl.resources.base', 'envctl.resources.netns']"


# ---------------------------------------------------------------- several environments at once


def _two_up(engine):
    from tests.unit.fakes import BatchThing

    engine.up("one", [Thing("a1"), BatchThing("v1"), Thing("c1")])
    engine.up("two", [Thing("a2"), BatchThing("v2"), Thing("c2"), Thing("d2")])
    fakes.LOG.clear()


def test_down_many_keeps_each_order_and_removes_batched_kinds_together(engine):
    _two_up(engine)
    outs = engine.down_many(["one", "two"])
    assert fakes.LOG == ["remove c1", "remove d2", "remove c2", "remove together v1 v2",
                         "remove a1", "remove a2"]
    assert [[s.resource.ident() for s in o.steps] for o in outs] == [
        ["c1", "v1", "a1"], ["d2", "c2", "v2", "a2"]]
    assert fakes.WORLD == {} and not any(o.errors for o in outs)
    assert Journal.environments(engine.host.state_dir) == []


def test_down_many_keeps_a_batched_step_that_failed_and_goes_on(engine):
    _two_up(engine)
    fakes.FAIL_ON.add("v2")
    one, two = engine.down_many(["one", "two"])
    assert not one.errors and two.errors == ["remove fake-batch v2: remove thing 'v2': refused"]
    assert fakes.WORLD == {"v2": "on"}
    assert [e.key for e in Journal.open(engine.host.state_dir, "two").entries] == [
        "fake-batch:v2"]
    fakes.FAIL_ON.clear()
    assert not engine.down("two").errors and fakes.WORLD == {}


def test_down_many_injected_fault_in_a_batch_spares_the_others(engine, monkeypatch):
    _two_up(engine)
    monkeypatch.setenv("ENVCTL_FAULT", "fail@remove:fake-batch:v1")
    one, two = engine.down_many(["one", "two"])
    assert one.errors == ["remove fake-batch v1: injected fault fail@remove at 'fake-batch:v1'"]
    assert not two.errors and fakes.WORLD == {"v1": "on"}
    assert "remove together v2" in fakes.LOG


def test_down_folds_journals_once_and_still_does_when_a_bug_stops_it(engine, monkeypatch):
    _two_up(engine)
    writes = []
    real_save = Journal.save
    monkeypatch.setattr(Journal, "save", lambda self, **kw: (writes.append(self.env),
                                                              real_save(self, **kw)))

    def bug(self, host, memo):
        raise RuntimeError("a bug in remove")

    monkeypatch.setattr(Thing, "remove", lambda self, h, m: bug(self, h, m)
                        if self.name == "a1" else fakes.WORLD.pop(self.name, None))
    with pytest.raises(RuntimeError):
        engine.down_many(["one", "two"])
    assert writes == ["one", "two"]  # folded once each, at the end, despite the bug
    assert [e.key for e in Journal.open(engine.host.state_dir, "one").entries] == [
        "fake-thing:a1"]
    assert [e.key for e in Journal.open(engine.host.state_dir, "two").entries] == [
        "fake-thing:a2"]


def test_down_many_a_batch_that_fails_whole_keeps_every_item(engine, monkeypatch):
    from tests.unit.fakes import BatchThing

    _two_up(engine)

    def refuse(cls, host, items):
        raise fakes.HostError("remove 2 things: del group: refused")

    monkeypatch.setattr(BatchThing, "remove_many", classmethod(refuse))
    one, two = engine.down_many(["one", "two"])
    assert one.errors == ["remove fake-batch v1: remove 2 things: del group: refused"]
    assert two.errors == ["remove fake-batch v2: remove 2 things: del group: refused"]
    assert fakes.WORLD == {"v1": "on", "v2": "on"}
    assert [e.key for e in Journal.open(engine.host.state_dir, "one").entries] == [
        "fake-batch:v1"]


# ---------------------------------------------------------------- what envctl did not make


def test_a_kind_that_does_not_adopt_refuses_before_journalling(engine):
    from envctl.engine.engine import REFUSE
    from tests.unit.fakes import OwnThing

    fakes.WORLD["o"] = "somebody's"
    plan = [Thing("a"), OwnThing("o"), Thing("c")]
    steps = engine.diff("env", plan)
    assert [s.op for s in steps] == ["+", REFUSE, "+"]
    assert steps[1].note == "exists and was not made by envctl"
    with pytest.raises(StepFailed, match="fake-own o: exists and was not made by envctl"):
        engine.up("env", plan)
    # The step before it rolled back; the foreign object was never touched.
    assert fakes.WORLD == {"o": "somebody's"}
    assert fakes.LOG == ["apply a", "remove a"]
    assert not Journal.open(engine.host.state_dir, "env").exists()


def test_down_says_what_each_removal_restores(engine):
    from tests.unit.fakes import OwnThing

    res = OwnThing("x")
    engine.up("env", [res])
    # As if envctl had found "orig" there and changed it (a kind that adopts would record so).
    journal = Journal.open(engine.host.state_dir, "env")
    journal.entries[0].memo["old"] = "orig"
    journal.save()
    fakes.WORLD["x"] = "changed"
    assert [s.note for s in engine.diff_down("env")] == ["restored changed -> orig"]
    assert "at down: restored changed -> orig" in engine.status("env", [res])[0].note
    out = engine.down("env")
    assert [(s.op, s.note) for s in out.steps] == [("-", "restored changed -> orig")]


def test_up_many_goes_on_past_a_failed_environment_and_folds_the_ledger_once(engine,
                                                                             monkeypatch):
    fakes.FAIL_ON.add("b1")
    folds = []
    real = Ledger.save
    monkeypatch.setattr(Ledger, "save", lambda self, **kw: (folds.append(1), real(self, **kw)))
    outcomes, failed = engine.up_many([
        ("one", [SharedThing("s"), Thing("a1"), Thing("b1")], None),
        ("two", [SharedThing("s"), Thing("a2")], None)])
    assert [o.env for o in outcomes] == ["two"] and list(failed) == ["one"]
    assert "fake-thing b1" in str(failed["one"]) and "rolled back" in str(failed["one"])
    assert fakes.WORLD == {"s": "on", "a2": "on"}  # one rolled back, its share released
    assert Ledger.open(engine.host.state_dir).holders("fake-shared:s") == ["two"]
    assert len(folds) == 1
