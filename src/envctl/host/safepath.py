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
import stat
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


# ---------------------------------------------------------------- operator paths


class NotRootControlled(OSError):
    """An operator's host path goes through a directory or symlink that someone other than
    root could change (owned by another uid, or writable by group or others): a symlink put
    there could send root's bind, copy or mkdir anywhere (/etc, /root)."""


MAX_LINKS = 40  # as the kernel's own limit on symlinks followed in one lookup


def _changeable(d: os.stat_result, entry: os.stat_result | None) -> str:
    """Why a non-root user could change what name `entry` of directory `d` refers to ("" when
    only root can): `d` owned by someone else, or writable by group or others. A sticky
    directory (/tmp) writable by all is fine above an entry that root owns: only root may
    rename or delete it there. A caller that is not root trusts its own uid as well: what it
    could change, it could do itself."""
    trusted = {0, os.geteuid()}
    if d.st_uid not in trusted:
        return f"is owned by uid {d.st_uid}, not root"
    if d.st_mode & 0o022:
        if d.st_mode & stat.S_ISVTX and entry is not None and entry.st_uid in trusted:
            return ""
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002))
                           if d.st_mode & bit)
        return f"is writable by {who} (mode {stat.S_IMODE(d.st_mode):04o})"
    return ""


def resolve_root_controlled(path: str) -> tuple[int, list[str]]:
    """Walk absolute `path` from `/` one component at a time through descriptors, following
    only symlinks in a root-controlled chain: every directory looked into is root's and not
    writable by group or others (sticky directories above root's own entries excepted), so
    no symlink on the way can have been put there by anyone but root. The last component may
    belong to anyone (a data directory root inside writes): it is the object itself, and the
    caller acts on its descriptor, never on the path again.

    Returns an O_PATH descriptor of the deepest component that exists and the names still
    missing below it (empty when the whole path exists). NotRootControlled when the chain
    passes through something another user could change; NotADirectoryError when a
    non-directory sits where a directory is needed; ELOOP past MAX_LINKS symlinks."""
    if not path.startswith("/") or "\0" in path:
        raise OSError(errno.EINVAL, "not an absolute path", path)
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    where = "/"
    todo = [p for p in path.split("/") if p not in ("", ".")]
    links = 0
    try:
        root_st = os.fstat(fd)
        why = _changeable(root_st, None)
        if why:
            raise NotRootControlled(errno.EPERM, f"/ {why}", path)
        while todo:
            name = todo.pop(0)
            dir_st = os.fstat(fd)
            if not stat.S_ISDIR(dir_st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, f"{where} is not a directory", path)
            try:
                nfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                why = _changeable(dir_st, None)
                if why:
                    # Whoever may write it could make the missing name a symlink first.
                    raise NotRootControlled(errno.EPERM, f"{where} {why}", path) from None
                rest = [name, *todo]
                if ".." in rest:
                    raise FileNotFoundError(errno.ENOENT, f"{where}/{name} is missing",
                                            path) from None
                return fd, rest
            st = os.fstat(nfd)
            why = _changeable(dir_st, st)
            if why:
                os.close(nfd)
                raise NotRootControlled(errno.EPERM, f"{where} {why}", path)
            nxt = where.rstrip("/") + "/" + name if name != ".." else (
                os.path.dirname(where.rstrip("/")) or "/")
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_LINKS:
                    os.close(nfd)
                    raise OSError(errno.ELOOP, "too many symlinks", path)
                text = os.readlink(name, dir_fd=fd)
                os.close(nfd)
                if text.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                    where = "/"
                todo[:0] = [p for p in text.split("/") if p not in ("", ".")]
                continue
            os.close(fd)
            fd, where = nfd, nxt
        return fd, []
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def open_root_controlled(path: str, *, directory: bool | None = None) -> int:
    """An O_PATH descriptor of operator path `path`, resolved by resolve_root_controlled
    (FileNotFoundError when it does not exist). `directory` True/False: it must be / must not
    be a directory (NotADirectoryError / IsADirectoryError)."""
    fd, missing = resolve_root_controlled(path)
    if missing:
        os.close(fd)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
    is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
    if directory is not None and is_dir != directory:
        os.close(fd)
        if directory:
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
    return fd


def root_controlled_problem(path: str) -> str:
    """Why operator path `path` cannot be used as root ("" when it can, or is missing below
    a root-controlled directory, or cannot be judged by this caller): for `plan` and
    `validate`, which must say so before anything is changed."""
    try:
        fd, _ = resolve_root_controlled(path)
    except NotRootControlled as exc:
        return (f"{path}: {exc.strerror}: a symlink there could redirect root's mount or copy "
                "elsewhere on the host; use a path whose every directory is root's and not "
                "writable by group or others (chown root, chmod go-w)")
    except OSError:
        return ""  # not judged here (no permission, not a directory): apply says why
    os.close(fd)
    return ""
