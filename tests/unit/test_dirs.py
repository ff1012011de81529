"""Data directories (mount sources): `down` keeps them, empty or not, with the parents made for
them; `down --purge` deletes them; the rollback of the failed `up` that made one takes it back
when still empty. Temporary directories only; no root needed."""

from __future__ import annotations

import pytest

from envctl.engine.engine import Engine
from envctl.errors import StepFailed
from envctl.host.context import Host
from envctl.resources.dirs import Directory, SharedDirectory
from tests.unit import fakes


@pytest.fixture
def host(tmp_path):
    fakes.reset()
    yield Host(state_dir=tmp_path / "state", run_dir=tmp_path / "run")
    fakes.reset()


def data(path: str = "data/demo/results") -> Directory:
    return Directory("state", path, 0o755, keep=True)


def purge(host: Host) -> None:
    host.options["purge"] = "1"


def test_down_keeps_an_empty_data_directory_and_the_parents_made_for_it(host):
    engine = Engine(host)
    engine.up("demo", [Directory("state", "envs/demo"), data()])
    results = host.state_dir / "data" / "demo" / "results"
    assert results.is_dir() and not any(results.iterdir())
    out = engine.down("demo")
    assert out.errors == []
    assert results.is_dir(), "an empty data directory was deleted by a plain down"
    notes = {s.resource.describe(): s.note for s in out.steps}
    assert notes["directory <state>/data/demo/results"] == \
        "kept: a data directory (down --purge deletes it)"
    # What was not data goes.
    assert not (host.state_dir / "envs" / "demo").exists()


def test_a_second_up_and_a_purge_delete_it_with_its_parents(host):
    engine = Engine(host)
    engine.up("demo", [data()])
    (host.state_dir / "data" / "demo" / "results" / "r.txt").write_text("1\n")
    engine.down("demo")
    # The next `up` finds it there (memo: existed); --purge deletes it all the same.
    engine.up("demo", [data()])
    purge(host)
    out = engine.down("demo")
    assert out.errors == [] and [s.note for s in out.steps] == [""]
    assert not (host.state_dir / "data").exists()


def test_the_rollback_of_the_up_that_made_it_takes_it_back_when_empty(host):
    engine = Engine(host)
    fakes.FAIL_ON.add("boom")
    with pytest.raises(StepFailed, match="injected"):
        engine.up("demo", [data(), fakes.Thing("boom")])
    assert not (host.state_dir / "data").exists()
    assert "rollback" not in host.options


def test_the_rollback_keeps_one_that_was_there_before(host):
    results = host.state_dir / "data" / "demo" / "results"
    results.mkdir(parents=True)
    fakes.FAIL_ON.add("boom")
    with pytest.raises(StepFailed):
        Engine(host).up("demo", [data(), fakes.Thing("boom")])
    assert results.is_dir()


def test_a_host_data_directory_envctl_made_survives_down(host, tmp_path):
    engine = Engine(host)
    made = tmp_path / "srv" / "in"
    src = SharedDirectory("host", str(made).lstrip("/"), 0o755, keep=True)
    engine.up("demo", [src])
    assert made.is_dir()
    engine.down("demo")
    assert made.is_dir()
    # The next `up` knows it as envctl's (recorded in the state directory, with its inode):
    # `down --purge` deletes it, contents and the parents made for it included.
    (made / "result").write_text("1\n")
    engine.up("demo", [src])
    out = engine.down("demo")
    notes = [s.note for s in out.steps]
    assert out.errors == [] and made.is_dir()
    assert notes == ["kept: a data directory (down --purge deletes it)"], notes
    engine.up("demo", [src])
    purge(host)
    out = engine.down("demo")
    assert out.errors == [] and not (tmp_path / "srv").exists()
    assert not (host.state_dir / "host-dirs.json").exists()


def test_a_host_directory_that_was_there_first_is_kept_by_purge(host, tmp_path):
    engine = Engine(host)
    there = tmp_path / "srv" / "in"
    there.mkdir(parents=True)
    (there / "theirs").write_text("1\n")
    src = SharedDirectory("host", str(there).lstrip("/"), 0o755, keep=True)
    for _ in range(2):
        engine.up("demo", [src])
        purge(host)
        out = engine.down("demo")
        host.options.pop("purge")
        assert out.errors == [] and (there / "theirs").read_text() == "1\n"
    # One envctl made, then replaced by another directory at the same path: not envctl's.
    made = tmp_path / "made"
    src = SharedDirectory("host", str(made).lstrip("/"), 0o755, keep=True)
    engine.up("demo", [src])
    engine.down("demo")
    made.rename(tmp_path / "moved")
    made.mkdir()
    (made / "theirs").write_text("2\n")
    engine.up("demo", [src])
    purge(host)
    out = engine.down("demo")
    assert out.errors == [] and (made / "theirs").read_text() == "2\n"


def test_down_purge_of_an_environment_that_is_not_up_deletes_its_data(host):
    """A plain `down` kept the data (and the journal went): `down --purge` then still deletes
    `<state>/data/ENV/`, and nothing of another environment's."""
    from envctl import app

    engine = Engine(host)
    engine.up("demo", [data()])
    engine.up("other", [data("data/other/results")])
    (host.state_dir / "data" / "demo" / "results" / "r.txt").write_text("1\n")
    app.down(engine, ["demo"])
    assert (host.state_dir / "data" / "demo" / "results" / "r.txt").is_file()
    assert [o.steps for o in app.down(engine, ["demo"])] == [[]]  # not up, no purge: nothing
    purge(host)
    (out,) = app.down(engine, ["demo"])
    assert out.errors == [] and [(s.op, s.resource.describe(), s.note) for s in out.steps] == [
        ("-", "directory <state>/data/demo", "it was not up: its data directories deleted "
                                             "(--purge)")]
    assert not (host.state_dir / "data" / "demo").exists()
    assert (host.state_dir / "data" / "other" / "results").is_dir()
    # Again: nothing left to delete, nothing said.
    assert [o.steps for o in app.down(engine, ["demo"])] == [[]]


def test_a_host_directory_that_was_there_first_keeps_its_mode(host, tmp_path):
    """An operator's shared 1777 scratch directory named as a data source: `up` neither
    tightens it to 0755 nor reports it as drifted; one envctl makes gets `mode`."""
    import os
    import stat

    engine = Engine(host)
    there = tmp_path / "scratch"
    there.mkdir()
    os.chmod(there, 0o1777)
    src = SharedDirectory("host", str(there).lstrip("/"), 0o755, keep=True)
    engine.up("demo", [src])
    assert stat.S_IMODE(there.stat().st_mode) == 0o1777
    assert src.check(host).ok
    engine.down("demo")
    assert stat.S_IMODE(there.stat().st_mode) == 0o1777
    # The operator changes it while it is up: `down` keeps their change.
    engine.up("demo", [src])
    os.chmod(there, 0o2775)
    out = engine.down("demo")
    assert stat.S_IMODE(there.stat().st_mode) == 0o2775
    assert "mode" not in out.steps[0].note, out.steps[0].note
    made = tmp_path / "made"
    old = os.umask(0o077)
    try:
        engine.up("demo", [SharedDirectory("host", str(made).lstrip("/"), 0o755, keep=True)])
    finally:
        os.umask(old)
    assert stat.S_IMODE(made.stat().st_mode) == 0o755
