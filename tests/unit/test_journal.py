"""The journal and ledger: write-ahead log records, folding, and what a crash leaves."""

from __future__ import annotations

import json

from envctl.engine.journal import Entry, Journal, Ledger
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
