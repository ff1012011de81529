"""What every benchmark that times envctl processes shares."""

from __future__ import annotations

import compileall
import os
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def precompile() -> None:
    """Bytecode as an installed envctl has it (pip compiles at install; an editable install
    writes it on the first run): the checkout runs from source, where PYTHONDONTWRITEBYTECODE
    (set in some shells and CI) would otherwise make every timed run compile envctl again,
    ~20-30 ms of a launch."""
    compileall.compile_dir(REPO / "src" / "envctl", quiet=1)


def let_nobody_run_python(sb: object, root: Path) -> None:
    """`nobody` runs this Python in the sandbox `sb` (made in `root`), which may live under
    root's 0700 home: in the sandbox's mount namespace only, a 0755 /root holding just that
    tree."""
    home = "/root/.pyenv"
    if os.path.realpath(sys.executable).startswith(home + "/"):
        (root / "pyenv").mkdir()
        script = (f"mount --bind {home} {root}/pyenv && mount -t tmpfs -o mode=0755 "
                  f"envctl-bench-root /root && mkdir {home} && "
                  f"mount --bind {root}/pyenv {home}")
        res = sb.run("sh", "-c", script)  # type: ignore[attr-defined]
        assert res.returncode == 0, res.stderr


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
