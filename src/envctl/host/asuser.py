"""File access with a host user's credentials: the user behind sudo (who submits a job) or a
job's user, so that root never opens a path such a user names with root's rights.

How: a credentials switch for file access only, in this thread, around the open itself —
supplementary groups (setgroups), then the file-system gid and uid (setfsgid(2), setfsuid(2)
through libc), then the open, then back to root, checked by a second setfsuid/setfsgid call
(their return value is the id in force: the only way they report), even when the open raises.

Why this and not a forked child that drops to the user and passes the descriptor back over a
socketpair (SCM_RIGHTS): both give the kernel's own permission checks, with the user's rights,
at every component of the path (a symlink is followed only as far as the user could follow
it); the switch costs two syscalls instead of a fork of a ~40 MB interpreter (`submit-job`
has a latency target), and errors come back as the open's own OSError. What the switch does
not change is the real and effective uid: signals and ptrace still see root (setfsuid exists
for exactly this: NFS servers acting for a client), and the capabilities that override file
permissions (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_CHOWN…) leave the
effective set while the fsuid is not 0 and come back with it (capabilities(7), "Effect of user
ID changes on capabilities"). The kernel marks the process non-dumpable when its fsuid
changes; it is made dumpable again afterwards when it was (a non-dumpable process's /proc
files are root's, which would trip a later user namespace of the launch).

setgroups is process-wide in glibc (it signals every thread to follow): callers are the CLI and
the supervisor, single-threaded while they open these files. A process that is not root acts
with its own credentials, which already bound what it can open: no switch there.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from typing import NamedTuple

from envctl.host.libc import libc

PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4
_QUERY = 0xFFFFFFFF  # (uid_t)-1: no such id, so setfsuid changes nothing and says what is in force


class Creds(NamedTuple):
    """Whose rights a file is opened with: uid, primary gid, supplementary gids."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


ROOT = Creds(0, 0, ())


class SwitchFailed(OSError):
    """The kernel did not take (or give back) the file-system ids asked for."""


def submitter(environ: dict[str, str] | os._Environ[str] = os.environ) -> Creds:
    """The user who runs this envctl: the one behind sudo ($SUDO_UID, $SUDO_GID, and that
    user's groups from the host's group database), or root when root ran it directly."""
    uid, gid = environ.get("SUDO_UID", ""), environ.get("SUDO_GID", "")
    if os.geteuid() != 0 or not uid.isdigit() or int(uid) == 0:
        return Creds(os.geteuid(), os.getegid(), ()) if os.geteuid() != 0 else ROOT
    primary = int(gid) if gid.isdigit() else int(uid)
    return Creds(int(uid), primary, host_groups(int(uid), primary, environ.get("SUDO_USER")))


def host_groups(uid: int, gid: int, name: str | None = None) -> tuple[int, ...]:
    """The supplementary groups of host user `uid` (by its passwd name, else `name`), as login
    would set them; none when the host does not know the user."""
    import pwd

    try:
        login = pwd.getpwuid(uid).pw_name
    except KeyError:
        login = name or ""
    if not login:
        return ()
    try:
        return tuple(sorted(set(os.getgrouplist(login, gid)) - {gid}))
    except OSError:
        return ()


def _fsuid(uid: int) -> int:
    return libc.setfsuid(ctypes.c_uint32(uid & 0xFFFFFFFF))


def _fsgid(gid: int) -> int:
    return libc.setfsgid(ctypes.c_uint32(gid & 0xFFFFFFFF))


def fs_ids() -> tuple[int, int]:
    """The file-system uid and gid in force (a query: changes nothing)."""
    return _fsuid(_QUERY), _fsgid(_QUERY)


@contextlib.contextmanager
def as_user(creds: Creds | tuple | None) -> Iterator[None]:
    """File access in the block with `creds`' rights (uid, gid, groups). No switch for None,
    for root, and in a process that is not root. SwitchFailed when the kernel refuses; back to
    the ids it found (checked) whatever the block raises."""
    if creds is None or os.geteuid() != 0 or int(creds[0]) == 0:
        yield
        return
    uid, gid = int(creds[0]), int(creds[1])
    groups = [int(g) for g in (creds[2] if len(creds) > 2 else ())]
    saved_groups = os.getgroups()
    dumpable = libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
    old_gid = old_uid = None
    try:
        os.setgroups([g for g in dict.fromkeys([gid, *groups])])
        old_gid = _fsgid(gid)
        if _fsgid(_QUERY) != gid:
            raise SwitchFailed(f"setfsgid({gid}) was not taken")
        old_uid = _fsuid(uid)
        if _fsuid(_QUERY) != uid:
            raise SwitchFailed(f"setfsuid({uid}) was not taken")
        yield
    finally:
        if old_uid is not None:
            _fsuid(old_uid)
        if old_gid is not None:
            _fsgid(old_gid)
        os.setgroups(saved_groups)
        if dumpable == 1:
            libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        back = (_fsuid(_QUERY), _fsgid(_QUERY))
        want = (old_uid if old_uid is not None else back[0],
                old_gid if old_gid is not None else back[1])
        if back != want:  # cannot happen with CAP_SETUID/CAP_SETGID; never go on half-switched
            raise SwitchFailed(f"file-system ids stay {back}, not {want}")


def open_as(creds: Creds | tuple | None, path: str | os.PathLike[str], flags: int,
            mode: int = 0o600) -> int:
    """os.open(path, flags, mode) with `creds`' rights (see as_user); O_CLOEXEC added."""
    with as_user(creds):
        return os.open(path, flags | os.O_CLOEXEC, mode)
