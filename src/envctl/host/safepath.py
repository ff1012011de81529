"""Paths inside a root filesystem opened without ever leaving it: openat2(2) with
RESOLVE_BENEATH, one directory fd at a time, so that a symlink a job planted in its rootfs
(`/var/log -> /etc`) can never make envctl write, mount or delete on the host.

Every function takes an O_PATH descriptor of the root and a path relative to it (a leading '/'
is the root itself). `..` that would climb above the root and absolute symlinks fail with
EXDEV, magic links (/proc/self/fd/…) with ELOOP; with `symlinks=False` every symlink fails with
ELOOP. Callers act on the returned descriptor (`/proc/self/fd/N` for mount(2), `dir_fd=` for
the os module), never on the path again, so a swap after the check changes nothing."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

from envctl.host.libc import libc

SYS_OPENAT2 = 437  # x86-64 and every architecture on the generic syscall table
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


class Escape(OSError):
    """The path leaves the root (`..`, an absolute symlink, a symlink pointing outside) or
    goes through a symlink where none is allowed."""


def _rel(path: str) -> str:
    rel = path.strip("/")
    return rel or "."


def openat2(dirfd: int, path: str, flags: int, *, resolve: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = libc.syscall(SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how),
                      ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        if err in (errno.EXDEV, errno.ELOOP):
            raise Escape(err, f"{path}: leaves the root or goes through a symlink "
                              f"({os.strerror(err)})", path)
        raise OSError(err, os.strerror(err), path)
    return fd


def _resolve(symlinks: bool) -> int:
    return RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | (0 if symlinks else RESOLVE_NO_SYMLINKS)


def open_beneath(root_fd: int, path: str, flags: int = os.O_PATH | os.O_DIRECTORY, *,
                 symlinks: bool = True, mode: int = 0) -> int:
    """Open `path` inside the root. With `symlinks`, relative symlinks that stay inside are
    followed (the rootfs's own `lib -> usr/lib`); without, any symlink on the way is refused."""
    return openat2(root_fd, _rel(path), flags, resolve=_resolve(symlinks), mode=mode)


def makedirs_beneath(root_fd: int, path: str, mode: int = 0o755, *,
                     symlinks: bool = True) -> tuple[int, list[str]]:
    """Open directory `path` inside the root, creating what is missing one component at a
    time (each made under the descriptor of its parent, never by path). Returns the O_PATH
    descriptor and the directories made, outermost first, as '/'-rooted paths."""
    made: list[str] = []
    fd = os.dup(root_fd)
    done = ""
    try:
        for part in [p for p in path.strip("/").split("/") if p]:
            if part in (".", ".."):
                raise Escape(errno.EXDEV, f"{path}: '.' and '..' are not allowed", path)
            done = f"{done}/{part}"
            try:
                nxt = openat2(fd, part, os.O_PATH | os.O_DIRECTORY, resolve=_resolve(symlinks))
            except FileNotFoundError:
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                    made.append(done)
                except FileExistsError:
                    pass  # made meanwhile: opened below like any other
                nxt = openat2(fd, part, os.O_PATH | os.O_DIRECTORY, resolve=_resolve(symlinks))
                if done in made and os.stat(nxt).st_mode & 0o7777 != mode:
                    os.chmod(f"/proc/self/fd/{nxt}", mode)  # mkdir's mode passed the umask
            os.close(fd)
            fd = nxt
        return fd, made
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def opened(fd: int) -> Iterator[int]:
    """Close `fd` when the block ends."""
    try:
        yield fd
    finally:
        os.close(fd)


def fd_path(fd: int) -> str:
    """The path through which mount(2) and friends act on the object `fd` refers to."""
    return f"/proc/self/fd/{fd}"
