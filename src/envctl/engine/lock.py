"""The global lock that serializes envctl invocations changing the host (flock on a state file)."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from envctl.errors import LockTimeout


@contextmanager
def global_lock(state_dir: Path, *, timeout: float = 120.0,
                on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold `state_dir/lock` exclusively; the kernel drops it if we die, so no stale locks."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout
        warned = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                if not warned and on_wait is not None:
                    on_wait(f"waiting for another envctl (pid {holder}) to finish")
                    warned = True
                if time.monotonic() >= deadline:
                    raise LockTimeout(f"lock {path} is still held by pid {holder} after "
                                      f"{timeout:g}s") from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
