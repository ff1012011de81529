"""What every benchmark that times envctl processes shares."""

from __future__ import annotations

import compileall
import os
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
