"""The `envctl` command (console script and `python -m envctl`). `envctl exec …`,
`envctl submit-job …` and `envctl jobs …` (and a plain user's up/down/status/plan/list,
through the daemon) take a fast path that never builds the typer CLI (its import and parse
cost ~25 ms of a launch); everything else, and any `exec` or `submit-job` the fast parsers do
not take (--help, global options, other forms), goes to envctl.cli."""

from __future__ import annotations

import sys


def main() -> None:
    command = sys.argv[1:2]
    if command == ["exec"]:
        from envctl.runtime.exec import fast_entry

        fast_entry()  # returns only when the arguments are not plain `exec` ones
    elif command == ["submit-job"]:
        from envctl.runtime.submit import fast_entry

        fast_entry()
    elif command == ["jobs"]:
        from envctl.jobtable import fast_entry

        fast_entry()  # through the daemon, when it answers
    elif command and command[0] in ("up", "down", "status", "plan", "list"):
        from envctl.commands import fast_entry

        fast_entry()  # a plain user's, through the daemon when it runs
    from envctl.cli import entry

    entry()

