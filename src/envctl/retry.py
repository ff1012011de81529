"""Which environments this boot's `up` could not bring up (`<run>/not-up.json`) and the
backoff loop of `envctl up --retry` (envctl-retry.service) that tries them again.

The list is what `up --all` (boot, `systemctl reload envctl`) left down, skipped (a module
missing, a data source not mounted yet) or failed; `up NAME` and `down NAME` take NAME off
it (it came up, or the operator decided), so a retry never brings back an environment an
operator took down. It records the boot id: a list from another boot is nobody's.

Each change is a read-modify-write under an flock of `<run>/.not-up.lock` (root's, 0600; gone
with the list), so an `up` and a `down` that end together both count.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from envctl.host.files import read_json, write_json

NOT_UP = "not-up.json"
FIRST_DELAY = 1.0  # seconds before the first retry, doubled after each
MAX_DELAY = 60.0  # the longest wait between two tries
WINDOW = 600.0  # how long `up --retry` keeps trying by default (10 min)


def not_up_path(run_dir: Path) -> Path:
    return run_dir / NOT_UP


def read_not_up(run_dir: Path, boot_id: str) -> list[str]:
    """The environments waiting for a retry ([] when none, the list is from another boot, or
    it cannot be read: a retry is a convenience, never a reason to fail)."""
    try:
        rec = read_json(not_up_path(run_dir))
    except (OSError, ValueError):
        return []
    if not isinstance(rec, dict) or rec.get("boot_id") != boot_id:
        return []
    names = rec.get("envs")
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


LOCK = ".not-up.lock"  # in the run directory, root's alone (0600): see _locked


@contextlib.contextmanager
def _locked(run_dir: Path, *, make: bool) -> Iterator[bool]:
    """Hold an exclusive flock of `<run>/.not-up.lock` (the run directory made first when
    `make`); yields whether the run directory exists. Not the global lock: `up` and `down`
    record after releasing it, and a retry list must not wait behind another environment's
    long `up`. Not an flock of the run directory itself: /run/envctl is 0755, any user may
    open it and hold its flock for ever (root's `up` and `down` then hung there). The lock
    file is root's, 0600, which no other user can open; it goes with the list (the holder
    that empties it unlinks it, and a waiter that then finds the name leads to another file
    takes the new one)."""
    try:
        dfd = os.open(run_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not make:
            yield False
            return
        run_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        dfd = os.open(run_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        while True:
            fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                now = os.stat(LOCK, dir_fd=dfd, follow_symlinks=False)
                mine = os.fstat(fd)
            except FileNotFoundError:  # unlinked by the holder before us: take the next
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                break
            os.close(fd)
        try:
            yield True
        finally:
            try:
                os.stat(NOT_UP, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:  # no list left: nor its lock (nothing left in /run)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(LOCK, dir_fd=dfd)
            finally:
                os.close(fd)
    finally:
        os.close(dfd)


def record_attempt(run_dir: Path, boot_id: str, tried: list[str], not_up: list[str]) -> None:
    """After `up` (or `down`) of `tried`: those of them in `not_up` wait for a retry, the
    others no longer do; the rest of the list is kept. The file goes when the list is empty."""
    with _locked(run_dir, make=bool(not_up)) as exists:
        if not exists:
            return  # no run directory: no list to take anything off
        keep = [n for n in read_not_up(run_dir, boot_id) if n not in tried]
        names = list(dict.fromkeys([*keep, *not_up]))
        path = not_up_path(run_dir)
        if not names:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return
        write_json(path, {"boot_id": boot_id, "envs": names, "time": time.time()},
                   durable=False)


def delays(first: float = FIRST_DELAY, cap: float = MAX_DELAY) -> Iterator[float]:
    """1 s, 2 s, 4 s, … then `cap` seconds for ever."""
    d = first
    while True:
        yield min(d, cap)
        d = min(d * 2, cap)


def retry(attempt: Callable[[list[str]], list[str]], pending: list[str], *,
          window: float = WINDOW, cap: float = MAX_DELAY,
          on_wait: Callable[[float, list[str]], None] = lambda d, names: None,
          sleep: Callable[[float], None] = time.sleep,
          clock: Callable[[], float] = time.monotonic) -> list[str]:
    """Call `attempt(pending)` (which tries them and returns those still not up) after each
    delay of `delays()`, until nothing is pending or `window` seconds have passed; the last
    wait is cut so that the last try comes at the window's end. What is still pending."""
    deadline = clock() + window
    for d in delays(cap=cap):
        if not pending:
            break
        left = deadline - clock()
        if left <= 0:
            break
        d = min(d, left)
        on_wait(d, pending)
        sleep(d)
        pending = attempt(pending)
    return pending
