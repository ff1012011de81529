"""What the monitor leaves when it stops, and how it stamps time: the textfile it wrote is
removed (node_exporter would export the last tick as current), one that something else put in
its place is kept, `--once` leaves it; CSV timestamps are UTC with their offset."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

from envctl.monitor.daemon import Monitor, Options
from tests.unit.test_monitor import fake_host


class TwoTicks(Monitor):
    """Stops itself after two ticks (as SIGTERM would, between ticks); `swap` runs after the
    second."""

    swap = None

    def tick(self):
        snap = super().tick()
        self.n = getattr(self, "n", 0) + 1
        if self.n == 2:
            if self.swap:
                self.swap()
            self.stopping = True
        return snap


def _monitor(tmp_path: Path, cls=TwoTicks) -> Monitor:
    fh = fake_host(tmp_path, 1)
    return cls(None, Options(interval=0.01, csv_dir=tmp_path / "csv",
                             textfile=tmp_path / "tf" / "envctl.prom"),
               sampler=fh.sampler(host_stats=False), health=False)


def test_the_textfile_goes_when_the_monitor_stops(tmp_path, monkeypatch):
    monkeypatch.setenv("TZ", "IST-5:30")  # local time 5.5 h off UTC: a local stamp shows
    time.tzset()
    mon = _monitor(tmp_path)
    try:
        mon.run()
    finally:
        monkeypatch.undo()
        time.tzset()
    assert mon.n == 2
    assert os.listdir(tmp_path / "tf") == []
    rows = (tmp_path / "csv" / "cpu-metrics.csv").read_text().splitlines()[1:]
    stamp = datetime.datetime.fromisoformat(rows[-1].split(",")[0])
    assert stamp.utcoffset() == datetime.timedelta(0)
    now = datetime.datetime.now(datetime.UTC)
    assert abs((now - stamp).total_seconds()) < 60  # UTC, not local time labelled UTC


def test_a_textfile_something_else_replaced_is_kept(tmp_path):
    mon = _monitor(tmp_path)
    theirs = tmp_path / "tf" / "envctl.prom"

    def replace():
        tmp = theirs.with_name("theirs")
        tmp.write_text("# someone else's\n")
        tmp.replace(theirs)

    mon.swap = replace
    mon.run()
    assert theirs.read_text() == "# someone else's\n"


def test_once_leaves_the_textfile(tmp_path):
    mon = _monitor(tmp_path, Monitor)
    mon.once()
    mon.close()
    assert "envctl_environment_tasks" in (tmp_path / "tf" / "envctl.prom").read_text()
