"""What every benchmark that times envctl processes shares."""

from __future__ import annotations

import compileall
import signal
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def precompile() -> None:
    """Bytecode as an installed envctl has it (pip compiles at install; an editable install
    writes it on the first run): the checkout runs from source, where PYTHONDONTWRITEBYTECODE
    (set in some shells and CI) would otherwise make every timed run compile envctl again,
    ~20-30 ms of a launch."""
    compileall.compile_dir(REPO / "src" / "envctl", quiet=1)


def exit_on_signals() -> None:
    """SIGTERM and SIGINT (a time-out's kill, Ctrl-C) end the benchmark as an exception would:
    through its `finally` blocks, so that its sandbox is torn down and its temporary directory
    removed; the exit status is 128 + the signal's number, as a shell reports a killed process.
    Both are ignored from then on, so that a second one cannot cut the teardown short."""

    def handler(signo: int, _frame) -> None:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        raise SystemExit(128 + signo)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, handler)
