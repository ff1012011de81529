#!/usr/bin/env python3
"""Print docs/security.md's table of attempts from the JSON file a run of
tests/integration/test_boundary.py wrote (ENVCTL_BOUNDARY_TABLE=FILE): one row per attempt,
one column per way of running (native, native without userns, gvisor)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("native", "native without userns", "gvisor")
# What Docker's defaults give for the same attempts (rootful Docker, no userns-remap, its
# default seccomp profile and masked paths): from Docker's documentation and moby's source,
# not run here (this machine runs no Docker daemon in the tests).
DOCKER = {
    "/dev, /tmp, /dev/shm shared across launches": "/dev a tmpfs per container, writable by "
    "root in it; /tmp and /dev/shm shared by every process of the container",
    "PID 1 with SYS_PTRACE in the spec": "PID 1 is the container's own program",
    "kernel attack surface as nobody": "the same EPERMs (the same profile)",
    "kernel attack surface as root": "the same EPERMs; with SYS_ADMIN added, unshare and "
    "user namespaces allowed",
    "keyrings (seccomp unconfined)": "a session keyring per container (runc's); root's "
    "user keyring is the host root's",
    "planted /dev/null symlink": "CVE-2025-31133 (runc < 1.2.8): the host file bound",
    "read another launch's terminal": "one devpts per container, shared by its execs",
    "root-owned host file bound read-write": "written (root is the host's root)",
    "set-uid file planted on a data mount, run by a host user": "euid 0 where a host user "
    "can reach the volume",
}


def table(results: dict[str, dict[str, str]]) -> str:
    heads = (*COLUMNS, "Docker's defaults (not run)")
    rows = ["| attempt | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for attempt, got in sorted(results.items()):
        cells = [got.get(c, "—") for c in COLUMNS] + [DOCKER.get(attempt, "—")]
        rows.append(f"| {attempt} | " + " | ".join(c.replace("|", "\\|") for c in cells)
                    + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: security_table.py FILE (written by test_boundary.py)")
    print(table(json.loads(Path(sys.argv[1]).read_text())))
