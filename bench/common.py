"""What every benchmark that times envctl processes shares."""

from __future__ import annotations

import compileall
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def precompile() -> None:
    """Bytecode as an installed envctl has it (pip compiles at install; an editable install
    writes it on the first run): the checkout runs from source, where PYTHONDONTWRITEBYTECODE
    (set in some shells and CI) would otherwise make every timed run compile envctl again,
    ~20-30 ms of a launch."""
    compileall.compile_dir(REPO / "src" / "envctl", quiet=1)
