"""`envctl jobs` as a table (not --json): the rows through the daemon when it answers, and
their printing; what the typer command and the fast path (envctl.entry) both run.

`envctl jobs` with 10,000 queued is a target (≤ 300 ms, whole process: issue #22,
docs/benchmarks.md), and building the typer CLI costs ~60 ms of it. The fast parser takes
`jobs [ENV] [--all|-a] [--format|-o FIELDS]` and leaves anything else (--json, --help, a
global option, a second argument) to typer, as does a root process that no daemon answers
(it lists in-process, where the CLI checks the environment's name against the specs).
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not typing's: see envctl.record
if TYPE_CHECKING:
    from envctl.server.client import Client

FLAGS = {"--all": "all_", "-a": "all_"}
VALUE_OPTIONS = {"--format": "format_", "-o": "format_"}


def fields_of(format_: str | None) -> tuple[str, ...]:
    """The table's columns: --format's (UsageError, exit 2, for an unknown one), else the
    default ones."""
    from envctl.runtime import jobs as jb

    return jb.parse_fields(format_) if format_ is not None else jb.DEFAULT_FIELDS


def show(daemon: Client, env: str | None, all_: bool, fields: tuple[str, ...]) -> int:
    """Print the table the daemon answers; the exit code."""
    from envctl.server import client

    print_rows(client.job_table(daemon, env, all_, fields))
    return 0


def print_rows(rows: list[list[str]]) -> None:
    """The rows (header first) as aligned columns, two spaces apart, without trailing blanks:
    one write (10,000 rows are ~1 MB), no rich (a table of plain cells)."""
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)  # one format per row, not a ljust per cell
    sys.stdout.write("".join(line.format(*r).rstrip() + "\n" for r in rows))


def parse_args(args: list[str]) -> dict | None:
    """`show`'s environment, --all and --format from `jobs …`, or None for anything the fast
    path leaves to typer."""
    if not args or args[0] != "jobs":
        return None
    kw: dict = {"env": None, "all_": False, "format_": None}
    i = 1
    while i < len(args):
        word = args[i]
        opt, eq, value = word.partition("=")
        if word in FLAGS:
            kw[FLAGS[word]] = True
        elif opt in VALUE_OPTIONS and (not eq or opt.startswith("--")):
            if not eq:
                if i + 1 >= len(args):
                    return None
                i += 1
                value = args[i]
            kw[VALUE_OPTIONS[opt]] = value
        elif word.startswith("-") or kw["env"] is not None:
            return None  # --json, --help, -aX, a global option, a second argument: typer's
        else:
            kw["env"] = word
        i += 1
    return kw


def fast_entry(argv: list[str] | None = None) -> None:
    """`envctl jobs …` through the daemon without the typer CLI: run and leave with its exit
    code. Returns, doing nothing, when the arguments are not plain ones or when this process
    is root and no daemon answers."""
    parsed = parse_args(list(sys.argv[1:] if argv is None else argv))
    if parsed is None:
        return
    from envctl.errors import EnvctlError
    from envctl.runtime.fastpath import run_fast
    from envctl.server import client

    try:
        fields = fields_of(parsed["format_"])  # a bad --format is exit 2 before anything
        daemon = client.route()
    except EnvctlError as exc:
        refused = exc

        def fail() -> int:
            raise refused

        run_fast(fail)
    if daemon is None:
        return  # root, and no daemon answers: in-process, by the typer command
    run_fast(lambda: show(daemon, parsed["env"], parsed["all_"], fields))
