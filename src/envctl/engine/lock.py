"""The global lock that serializes envctl invocations changing the host (flock on a state file)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from envctl.errors import LockTimeout


def _acquire(path: Path, deadline: float, on_wait: Callable[[str], None] | None) -> int:
    warned = False
    while True:
        try:
            # 0600: flock needs only an open descriptor, so a lock file others may open is
            # one any user may hold for ever (every up, down and boot waiting, then failing).
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            # The holder before us removed the (empty) state directory while we got here:
            # make it again and retry.
            path.parent.mkdir(parents=True, exist_ok=True)
            if time.monotonic() >= deadline:
                raise LockTimeout(f"lock {path}: its directory keeps disappearing") from None
            continue
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
                    os.close(fd)
                    raise LockTimeout(f"lock {path} is still held by pid {holder}") from None
                time.sleep(0.05)
        # The holder before us may have removed the lock file while tidying an empty state
        # directory: a lock on an unlinked file excludes nobody, so take the new one instead.
        st = os.fstat(fd)
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and (current.st_dev, current.st_ino) == (st.st_dev, st.st_ino):
            if stat.S_IMODE(st.st_mode) != 0o600:
                return _replace(path, fd)
            return fd
        os.close(fd)
        path.parent.mkdir(parents=True, exist_ok=True)


def _replace(path: Path, old: int) -> int:
    """An older envctl's lock file others could open (0644), held by us: a new 0600 one put
    in its place, locked before the old one is let go (a user who opened the old one holds
    a lock on an unlinked file, which excludes nobody: waiters take the new one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a stale one of a killed run with our pid
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else has it
    os.rename(tmp, path)
    os.close(old)
    return fd


@contextmanager
def global_lock(state_dir: Path, *, timeout: float = 120.0,
                on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold `state_dir/lock` exclusively; the kernel drops it if we die, so no stale locks.

    When the body leaves no state behind (every environment is down), the state directory is
    removed before the lock is released, so `down` leaves the host as it found it.
    """
    key = os.path.abspath(state_dir)
    me = (os.getpid(), threading.get_ident())
    if _HELD.get(key) == me:
        # This process holds it already (an outer hold spanning several steps, as `up` of
        # environments with MIG instances to make: both halves under one hold). The pid makes
        # a forked child, which inherits the dict, and the thread another thread, take the
        # lock for itself.
        yield
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "lock"
    fd = _acquire(path, time.monotonic() + timeout, on_wait)
    _HELD[key] = me
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        del _HELD[key]
        try:
            _tidy(state_dir, path)  # also after a failed, fully rolled back `up`
        finally:
            os.close(fd)


# state directory -> the (pid, thread) holding its lock through global_lock (see there).
_HELD: dict[str, tuple[int, int]] = {}


def _tidy(state_dir: Path, lock: Path) -> None:
    """Remove the state directory if nothing but the lock and empty subdirectories remain."""
    try:
        entries = {p.name: p for p in state_dir.iterdir()}
    except FileNotFoundError:
        return
    # envctl's own subdirectories, emptied by the last environment in them (several share
    # `rootfs` and `data`, and none of them knows it is the last).
    for name in ("journal", "envs", "rootfs", "data"):
        p = entries.get(name)
        if p is not None and p.is_dir() and not p.is_symlink() and not any(p.iterdir()):
            with contextlib.suppress(OSError):
                p.rmdir()
                del entries[name]
    if set(entries) != {"lock"}:
        return
    lock.unlink()
    with contextlib.suppress(OSError):  # somebody else's file appeared meanwhile: keep it
        state_dir.rmdir()
