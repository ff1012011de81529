"""Crash-safe file writes for state: whole writes, and a temporary file renamed over the target.

Renaming makes a write atomic against a crash of *this process* (kill -9, an exception): a
reader sees the old file or the new one. Surviving a crash of the *machine* also needs fsync,
which costs a millisecond or more per call; the engine asks for it once per run rather than
per step, because the kernel objects its journal describes (namespaces, links, sysctls, nft
rules, cgroups) do not survive a machine crash either.

A full disk makes write(2) write less than asked (then fail with ENOSPC): every write here goes
on until all of it is written or raises, and a temporary file that could not be written whole
is deleted, never renamed over the good one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: see envctl/record.py
if TYPE_CHECKING:
    from typing import Any


def write_all(fd: int, data: bytes) -> None:
    """write(2) until every byte of `data` is written; OSError (ENOSPC, EIO, …) otherwise."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # a regular file never does this; a broken device might
            raise OSError(errno.EIO, "write wrote nothing")
        view = view[n:]


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Replace `path` with `data`: readers see the old or the new file, never half of one.

    `durable` also fsyncs the file and its directory, so the new content survives power loss.

    The temporary file is made anew (O_EXCL, a name nobody can guess): the directory may be
    another user's (node_exporter's textfile directory is its service user's), who could
    otherwise plant the name as a symlink to a root file for root to truncate and write.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, mode)
            break
        except FileExistsError:
            continue  # a name taken (or planted): draw another
    try:
        try:
            write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        sync_dir(path.parent)


def sync_dir(path: Path) -> None:
    """fsync a directory, making renames and unlinks in it durable."""
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_json(path: Path, obj: Any, *, durable: bool = True, mode: int = 0o644) -> None:
    atomic_write(path, (json.dumps(obj, separators=(",", ":"), sort_keys=True) + "\n").encode(),
                 mode=mode, durable=durable)


def read_json(path: Path) -> Any | None:
    """The parsed file, or None when it does not exist; ValueError when it is not JSON."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
