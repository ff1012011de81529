"""The journal and ledger: write-ahead log records, folding, and what a crash leaves."""

from __future__ import annotations

import contextlib
import json

import pytest

from envctl.engine.journal import Entry, Journal, Ledger
from envctl.errors import HostError, StateCorrupt
from tests.unit.fakes import SharedThing, Thing


def entry(name: str, status: str = "applying") -> Entry:
    return Entry(f"fake-thing:{name}", Thing(name).to_dict(), {"old": None}, status)


def files(state) -> list[str]:
    return sorted(p.name for p in (state / "journal").iterdir()) \
        if (state / "journal").is_dir() else []


def test_each_change_is_in_the_log_before_any_fold(tmp_path):
    j = Journal.open(tmp_path, "web")
    j.put(entry("a"))
    j.put(entry("b"))
    j.drop("fake-thing:a")
    # As after kill -9 here: nothing folded, a fresh reader sees every change.
    assert files(tmp_path) == ["web.0.log"]
    again = Journal.open(tmp_path, "web")
    assert [e.key for e in again.entries] == ["fake-thing:b"]
    assert again.exists() and Journal.environments(tmp_path) == ["web"]


def test_fold_writes_the_file_and_starts_a_new_log(tmp_path):
    j = Journal.open(tmp_path, "web")
    j.put(entry("a"))
    j.entries[0].status = "applied"  # marked in memory, recorded by the fold
    j.save(durable=True)
    assert files(tmp_path) == ["web.json"]
    data = json.loads((tmp_path / "journal" / "web.json").read_text())
    assert data["log"] == 1 and data["entries"][0]["status"] == "applied"
    j.put(entry("b"))
    assert files(tmp_path) == ["web.1.log", "web.json"]
    assert [e.key for e in Journal.open(tmp_path, "web").entries] == [
        "fake-thing:a", "fake-thing:b"]


def test_a_log_left_by_a_crash_during_the_fold_is_not_replayed(tmp_path):
    j = Journal.open(tmp_path, "web")
    j.put(entry("a"))
    j.entries[0].status = "applied"
    log = tmp_path / "journal" / "web.0.log"
    kept = log.read_bytes()
    j.save()
    log.write_bytes(kept)  # as if the fold died after the rename, before the unlink
    again = Journal.open(tmp_path, "web")
    assert [(e.key, e.status) for e in again.entries] == [("fake-thing:a", "applied")]
    again.drop("fake-thing:a")
    again.save()
    assert files(tmp_path) == []  # the stale log goes with the next fold


def test_a_line_cut_short_ends_the_log(tmp_path):
    j = Journal.open(tmp_path, "web")
    j.put(entry("a"))
    with open(tmp_path / "journal" / "web.0.log", "ab") as f:
        f.write(b'{"put": {"key": "fake-thing:b", "reso')
    assert [e.key for e in Journal.open(tmp_path, "web").entries] == ["fake-thing:a"]


def test_emptied_journal_leaves_no_file(tmp_path):
    j = Journal.open(tmp_path, "web")
    j.put(entry("a"))
    j.save()
    j.drop("fake-thing:a")
    j.save(durable=True)
    assert files(tmp_path) == [] and not j.exists()
    assert Journal.environments(tmp_path) == []


def test_ledger_holds_and_forgets_through_the_log(tmp_path):
    ledger = Ledger.open(tmp_path)
    assert ledger.hold("fake-shared:s", "one", SharedThing("s"), {"old": "x"}) == {"old": "x"}
    # The second holder gets the first holder's memo, also when replayed from the log.
    assert ledger.hold("fake-shared:s", "two", SharedThing("s"), {"old": "on"}) == {"old": "x"}
    again = Ledger.open(tmp_path)
    assert again.holders("fake-shared:s") == ["one", "two"]
    assert again.get("fake-shared:s")["memo"] == {"old": "x"}
    again.forget("fake-shared:s", "one")
    again.save()
    assert Ledger.open(tmp_path).holders("fake-shared:s") == ["two"]
    last = Ledger.open(tmp_path)
    last.forget("fake-shared:s", "two")
    last.save()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ---------------------------------------------------------------- a crash inside a fold


class Crash(BaseException):
    """kill -9: nothing after it runs, no handler sees it."""


def _crash_at(monkeypatch, name: str, op: int) -> None:
    """Stop the fold after its `op`-th file operation (a rename, an unlink, an fsync), as
    kill -9 would. Counted on the system calls themselves, so the test holds for any order
    the fold may do them in."""
    import os

    from envctl.host import files as files_mod

    count = [0]

    def counted(real):
        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            count[0] += 1
            if count[0] > op:
                raise Crash()
            return result
        return call

    for mod in (os, files_mod.os):
        for fn in ("replace", "unlink", "fsync"):
            monkeypatch.setattr(mod, fn, counted(getattr(os, fn)))


@pytest.mark.parametrize("op", range(8))
def test_emptying_fold_killed_anywhere_never_replays_an_old_log(tmp_path, monkeypatch, op):
    j = Journal.open(tmp_path, "web")
    j.put(entry("a"))
    j.put(entry("b"))
    j.save(durable=True)  # web.json names generation 1
    j.drop("fake-thing:a")
    j.drop("fake-thing:b")  # the drops are in web.1.log
    _crash_at(monkeypatch, "web.json", op)
    with contextlib.suppress(Crash):
        j.save(durable=True)
    monkeypatch.undo()
    assert Journal.open(tmp_path, "web").entries == []
    # The next `up` records a and b again: they must stay recorded, whatever the crash left.
    again = Journal.open(tmp_path, "web")
    again.put(entry("a"))
    again.put(entry("b"))
    again.save(durable=True)
    assert [e.key for e in Journal.open(tmp_path, "web").entries] == [
        "fake-thing:a", "fake-thing:b"]
    last = Journal.open(tmp_path, "web")
    last.drop("fake-thing:a")
    last.drop("fake-thing:b")
    last.save(durable=True)
    assert files(tmp_path) == []


@pytest.mark.parametrize("op", range(8))
def test_emptying_ledger_killed_anywhere_keeps_the_first_memo(tmp_path, monkeypatch, op):
    ledger = Ledger.open(tmp_path)
    ledger.hold("fake-shared:s", "one", SharedThing("s"), {"old": "x"})
    ledger.save(durable=True)
    ledger.forget("fake-shared:s", "one")
    _crash_at(monkeypatch, "shared.json", op)
    with contextlib.suppress(Crash):
        ledger.save(durable=True)
    monkeypatch.undo()
    assert Ledger.open(tmp_path).items == {}
    # The same environment comes up again: its holding and memo must survive the next open.
    again = Ledger.open(tmp_path)
    again.hold("fake-shared:s", "one", SharedThing("s"), {"old": "y"})
    again.save(durable=True)
    item = Ledger.open(tmp_path).get("fake-shared:s")
    assert item is not None and item["memo"] == {"old": "y"} and item["holders"] == ["one"]


# ---------------------------------------------------------------- damage


def test_a_damaged_journal_file_is_reported_by_name_and_left_alone(tmp_path):
    j = Journal.open(tmp_path, "web")
    j.put(entry("a"))
    j.save()
    path = tmp_path / "journal" / "web.json"
    path.write_text(path.read_text()[:40])  # cut short, as by a disk error or a bad edit
    before = path.read_bytes()
    with pytest.raises(StateCorrupt) as exc:
        Journal.open(tmp_path, "web")
    assert str(path) in str(exc.value) and "down --force web" in str(exc.value)
    assert path.read_bytes() == before


@pytest.mark.parametrize("damage", [
    pytest.param(lambda d: {**d, "entries": [{"key": "x"}]}, id="entry-missing-fields"),
    pytest.param(lambda d: {**d, "entries": [{**d["entries"][0], "resource": {"kind": "nope"}}]},
                 id="unknown-kind"),
    pytest.param(lambda d: {**d, "version": 99}, id="newer-format"),
    pytest.param(lambda d: [1, 2], id="not-a-mapping"),
    pytest.param(lambda d: {**d, "entries": "a"}, id="entries-not-a-list"),
])
def test_every_shape_of_damage_is_state_corrupt(tmp_path, damage):
    j = Journal.open(tmp_path, "web")
    j.put(entry("a"))
    j.save()
    path = tmp_path / "journal" / "web.json"
    path.write_text(json.dumps(damage(json.loads(path.read_text()))))
    with pytest.raises(StateCorrupt):
        Journal.open(tmp_path, "web")


def test_a_damaged_line_followed_by_records_is_corruption_not_a_torn_end(tmp_path):
    j = Journal.open(tmp_path, "web")
    j.put(entry("a"))
    j.put(entry("b"))
    log = tmp_path / "journal" / "web.0.log"
    lines = log.read_bytes().split(b"\n")
    log.write_bytes(b"\n".join([lines[0][:10], *lines[1:]]))
    with pytest.raises(StateCorrupt, match="line 1 is damaged"):
        Journal.open(tmp_path, "web")
    # down --force reads what it can: nothing before the damage here, b after it.
    assert [e.key for e in Journal.salvage(tmp_path, "web").entries] == ["fake-thing:b"]


def test_a_damaged_ledger_is_reported_by_name(tmp_path):
    (tmp_path / "shared.json").write_text('{"version": 1, "items": {"k": {"holders": 1}}}')
    with pytest.raises(StateCorrupt, match="shared.json") as exc:
        Ledger.open(tmp_path)
    assert "down --force" in str(exc.value)
    assert Ledger.open(tmp_path, salvage=True).items == {}


# ---------------------------------------------------------------- a full disk


def _short_writes(monkeypatch, *, after: int) -> None:
    """os.write writes half of what it is asked, then fails with ENOSPC, from the
    `after`-th call on (as a filling disk does)."""
    import errno

    from envctl.host import files as files_mod

    real = files_mod.os.write
    calls = [0]

    def write(fd, data):
        calls[0] += 1
        if calls[0] <= after:
            return real(fd, data)
        if len(data) > 1 and calls[0] == after + 1:
            return real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files_mod.os, "write", write)


def test_a_short_append_is_cut_off_and_reported(tmp_path, monkeypatch):
    j = Journal.open(tmp_path, "web")
    j.put(entry("a"))
    log = tmp_path / "journal" / "web.0.log"
    size = log.stat().st_size
    _short_writes(monkeypatch, after=0)
    with pytest.raises(HostError, match="No space left on device"):
        j.put(entry("b"))
    assert log.stat().st_size == size  # no torn line for later records to follow
    assert [e.key for e in j.entries] == ["fake-thing:a"]  # memory agrees with the disk
    monkeypatch.undo()
    j.put(entry("c"))
    assert [e.key for e in Journal.open(tmp_path, "web").entries] == [
        "fake-thing:a", "fake-thing:c"]


def test_a_short_fold_never_replaces_the_good_file(tmp_path, monkeypatch):
    j = Journal.open(tmp_path, "web")
    j.put(entry("a"))
    j.save()
    good = (tmp_path / "journal" / "web.json").read_bytes()
    j.put(entry("b"))
    _short_writes(monkeypatch, after=0)
    with pytest.raises(HostError, match="last one written whole"):
        j.save()
    monkeypatch.undo()
    assert (tmp_path / "journal" / "web.json").read_bytes() == good
    assert not [p for p in (tmp_path / "journal").iterdir() if p.name.endswith(".tmp")]
    # b is still in the log the file names: nothing was lost.
    assert [e.key for e in Journal.open(tmp_path, "web").entries] == [
        "fake-thing:a", "fake-thing:b"]


# ---------------------------------------------------------------- reboots


def test_entries_of_another_boot_are_dropped_unless_they_survive_a_reboot(tmp_path):
    from tests.unit.fakes import DiskThing

    j = Journal.open(tmp_path, "web", boot="boot-1")
    j.put(Entry("fake-thing:a", Thing("a").to_dict(), {"old": "x"}, "applied", boot="boot-1"))
    j.put(Entry("fake-disk:d", DiskThing("d").to_dict(), {}, "applied", boot="boot-1"))
    j.save()
    assert len(Journal.open(tmp_path, "web", boot="boot-1").entries) == 2
    after = Journal.open(tmp_path, "web", boot="boot-2")
    assert [e.key for e in after.entries] == ["fake-disk:d"]
    assert [e.key for e in after.dropped] == ["fake-thing:a"]
    # A journal from before boots were recorded keeps everything (it cannot tell).
    assert len(Journal.open(tmp_path, "web", boot="").entries) == 2


def test_ledger_memos_of_another_boot_are_never_restored(tmp_path):
    ledger = Ledger.open(tmp_path, boot="boot-1")
    ledger.hold("fake-shared:s", "one", SharedThing("s"), {"old": "x"}, boot="boot-1")
    ledger.save()
    after = Ledger.open(tmp_path, boot="boot-2")
    assert after.items == {} and list(after.dropped) == ["fake-shared:s"]


def test_an_entry_whose_resource_cannot_be_rebuilt_is_damage_found_at_open(tmp_path):
    """A journal of another version (a field renamed): reported by name when it is opened,
    never a traceback half-way through `down`."""
    j = Journal.open(tmp_path, "web")
    j.put(entry("a"))
    j.save()
    path = tmp_path / "journal" / "web.json"
    data = json.loads(path.read_text())
    data["entries"][0]["resource"] = {"kind": "fake-thing", "nom": "a"}  # no `name`
    path.write_text(json.dumps(data))
    with pytest.raises(StateCorrupt, match="bad entry"):
        Journal.open(tmp_path, "web")


def test_a_ledger_item_whose_resource_cannot_be_rebuilt_is_damage(tmp_path):
    ledger = Ledger.open(tmp_path)
    ledger.hold("fake-shared:s", "one", SharedThing("s"), {"old": "x"})
    ledger.save()
    data = json.loads((tmp_path / "shared.json").read_text())
    data["items"]["fake-shared:s"]["resource"] = {"kind": "fake-shared", "nom": "s"}
    (tmp_path / "shared.json").write_text(json.dumps(data))
    with pytest.raises(StateCorrupt, match="bad item 'fake-shared:s'"):
        Ledger.open(tmp_path)
    assert Ledger.open(tmp_path, salvage=True).items == {}
