#!/usr/bin/env python3
"""Print docs/security.md's table of attempts from the JSON file a run of
tests/integration/test_boundary.py wrote (ENVCTL_BOUNDARY_TABLE=FILE): one row per attempt,
one column per way of running (native, native without userns, gvisor)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("native", "native without userns", "gvisor")


def table(results: dict[str, dict[str, str]]) -> str:
    rows = ["| attempt | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for attempt, got in sorted(results.items()):
        cells = [got.get(c, "—").replace("|", "\\|") for c in COLUMNS]
        rows.append(f"| {attempt} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: security_table.py FILE (written by test_boundary.py)")
    print(table(json.loads(Path(sys.argv[1]).read_text())))
