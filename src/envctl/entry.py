"""The `envctl` command (console script and `python -m envctl`). `envctl exec …` takes a fast
path that never builds the typer CLI (~50 ms of the ~120 ms a launch would otherwise cost);
everything else, and any `exec` the fast parser does not take (--help, other options), goes to
envctl.cli."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["exec"]:
        from envctl.runtime.exec import fast_entry

        fast_entry()  # returns only when the arguments are not plain `exec` ones
    from envctl.cli import entry

    entry()
