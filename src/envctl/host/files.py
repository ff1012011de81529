"""Crash-safe file writes for state: write a temporary file, rename it over the target.

Renaming makes a write atomic against a crash of *this process* (kill -9, an exception): a
reader sees the old file or the new one. Surviving a crash of the *machine* also needs fsync,
which costs a millisecond or more per call; the engine asks for it once per run rather than
per step, because the kernel objects its journal describes (namespaces, links, sysctls, nft
rules, cgroups) do not survive a machine crash either.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Replace `path` with `data`: readers see the old or the new file, never half of one.

    `durable` also fsyncs the file and its directory, so the new content survives power loss.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        sync_dir(path.parent)


def sync_dir(path: Path) -> None:
    """fsync a directory, making renames and unlinks in it durable."""
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_json(path: Path, obj: Any, *, durable: bool = True) -> None:
    atomic_write(path, (json.dumps(obj, separators=(",", ":"), sort_keys=True) + "\n").encode(),
                 durable=durable)


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
