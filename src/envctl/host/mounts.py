"""Each environment's persistent mount namespace, held at <run>/mnt/ENV like a named netns (the
nsfs file bind-mounted there), the mounts made inside it, and the syscalls and mountinfo reading
they rest on.

The host's mount table only gets the holders and the private self-bind of <run>/mnt; the
environment's mounts (its rootfs read-only, /dev, /tmp, data, /sys) are made inside its own
namespace, entered by one thread with setns (`MountNamespaces.entered`), so `down` detaching the
holder drops them all at once. Paths inside a rootfs are opened beneath it (`safepath`), and
every mount is made onto a descriptor (`/proc/self/fd/N`), never by path, then checked to sit
where it was meant to (`mount_on`).

Shared propagation, checked on this kernel (6.18): binding a mount namespace's nsfs file onto a
mount that has a peer or a slave in another namespace fails with EINVAL (propagation would copy
a mount-namespace file into another namespace, which copy_tree refuses; into the new namespace
itself, a slave of the host, it would be a loop). Onto a shared mount with no peer elsewhere it
succeeds, so on a shared directory `create` would work or not depending on which other
namespaces happen to exist. Hence <run>/mnt is bound onto itself and made private, as `unshare
--mount=FILE` requires of FILE's mount. On a shared parent (a systemd host's /run) that
self-bind still propagates to the parent's peers, as an empty directory; a holder bound in it
never does (tests/integration/test_mounts.py watches a peer).

Also seen on 6.18: mount namespace ids are no longer ordered by creation across CPUs, which the
bind's loop check relies on; see `_new_namespace`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import stat
import sys
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path

from envctl.errors import HostError
from envctl.host.libc import libc, signals_held
from envctl.host.safepath import Escape, fd_path, open_beneath
from envctl.record import Record

CLONE_FS = 0x00000200
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_UNBINDABLE = 1 << 17
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8
NS_GET_NSTYPE = 0xB703

# The per-mount flags a mount resource may ask for, as mountinfo spells them.
FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
SELF_MOUNTINFO = "/proc/self/mountinfo"
# What this thread sees: inside `entered`, this thread alone is in the environment's namespace
# (/proc/self is the thread-group leader, which stayed on the host).
THREAD_MOUNTINFO = "/proc/thread-self/mountinfo"

# Holder states.
ABSENT, HELD, FILE, OTHER = "absent", "held", "file", "other"


# ---------------------------------------------------------------- syscalls


def _raise(path: str | None) -> None:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err), path)


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    """mount(2); OSError with errno and `target` as its filename."""
    if libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)) != 0:
        _raise(target)


def umount2(target: str, flags: int = 0) -> None:
    if libc.umount2(_b(target), flags) != 0:
        _raise(target)


def setns(fd: int, nstype: int, path: str | None = None) -> None:
    if libc.setns(fd, nstype) != 0:
        _raise(path)


def unshare(flags: int) -> None:
    if libc.unshare(flags) != 0:
        _raise(None)


def mount_id(fd: int) -> int:
    """The id (as mountinfo numbers mounts) of the mount `fd` is on."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOTSUP, "no mnt_id in fdinfo", f"/proc/self/fdinfo/{fd}")


# ---------------------------------------------------------------- mountinfo


class MountInfo(Record, frozen=True):
    """One line of /proc/PID/mountinfo (proc(5)), paths unescaped."""

    mount_id: int
    parent_id: int
    dev: str  # major:minor
    root: str  # the path inside the filesystem that is mounted here (a bind's source)
    mount_point: str
    options: tuple[str, ...]  # per-mount: rw/ro, nosuid, nodev, noexec, relatime …
    optional: tuple[str, ...]  # propagation: shared:N, master:N, propagate_from:N, unbindable
    fstype: str
    source: str
    super_options: tuple[str, ...]

    @property
    def propagation(self) -> str:
        """'shared', 'slave', 'shared,slave', 'unbindable' or 'private'."""
        kinds = [k for k, tag in (("shared", "shared:"), ("slave", "master:"))
                 if any(o.startswith(tag) for o in self.optional)]
        if "unbindable" in self.optional:
            kinds.append("unbindable")
        return ",".join(kinds) or "private"

    @property
    def flags(self) -> frozenset[str]:
        """Which of ro, nosuid, nodev, noexec this mount has."""
        return frozenset(o for o in self.options if o in FLAGS)


def unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in paths as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountInfo]:
    """Parse mountinfo text; malformed lines are skipped (none are expected)."""
    out = []
    for line in text.splitlines():
        parts = line.split(" ")
        try:
            sep = parts.index("-", 6)
            out.append(MountInfo(
                mount_id=int(parts[0]), parent_id=int(parts[1]), dev=parts[2],
                root=unescape(parts[3]), mount_point=unescape(parts[4]),
                options=tuple(parts[5].split(",")), optional=tuple(p for p in parts[6:sep] if p),
                fstype=parts[sep + 1], source=unescape(parts[sep + 2]),
                super_options=tuple(parts[sep + 3].split(",")) if len(parts) > sep + 3 else ()))
        except (ValueError, IndexError):
            continue
    return out


def mountinfo(path: str = SELF_MOUNTINFO) -> list[MountInfo]:
    """Every mount `path` lists, in mount order (a stacked mount after the one below it)."""
    with open(path) as f:
        return parse_mountinfo(f.read())


# ---------------------------------------------------------------- the namespaces


class DirState(namedtuple("DirState", "exists mounted propagation")):
    """Whether a directory exists, is a mount point, and the propagation of its top mount
    ("" when it is not a mount point)."""

    __slots__ = ()


class NoMountNamespace(HostError):
    """The environment's mount namespace is not held (any more)."""


def _back_or_die(what: str, fn, *args) -> None:  # noqa: ANN001 - a syscall wrapper and its args
    """Return to where the thread came from, or end the process: going on in the wrong
    namespace would change (or roll back) the wrong host."""
    try:
        fn(*args)
    except OSError as exc:  # pragma: no cover - the kernel refuses to take us home
        sys.stderr.write(f"envctl: cannot return to the host's {what}: {exc.strerror}\n")
        os._exit(70)


class MountNamespaces:
    """Create, inspect, enter and remove the mount namespaces held in `dir` (<run>/mnt)."""

    def __init__(self, dir: Path):
        self.dir = dir

    def path(self, env: str) -> Path:
        return self.dir / env

    def state(self, env: str) -> str:
        """ABSENT, HELD (a mount namespace is bound there), FILE (a plain regular file that
        holds nothing: the mount point before the bind, or after a reboot) or OTHER (anything
        else: a directory, a symlink, another namespace, some other mount). Read-only."""
        p = self.path(env)
        try:
            st = p.lstat()
        except FileNotFoundError:
            return ABSENT
        if not stat.S_ISREG(st.st_mode):
            return OTHER
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return OTHER
        try:
            return HELD if fcntl.ioctl(fd, NS_GET_NSTYPE) == CLONE_NEWNS else OTHER
        except OSError:
            pass  # ENOTTY: not an nsfs file
        finally:
            os.close(fd)
        if str(p) in {m.mount_point for m in mountinfo(THREAD_MOUNTINFO)}:
            return OTHER  # something else is mounted on it
        return FILE if st.st_size == 0 else OTHER

    def held(self) -> list[str]:
        """The names of everything mounted directly in the directory, sorted."""
        prefix = f"{self.dir}/"
        return sorted({m.mount_point[len(prefix):] for m in mountinfo(THREAD_MOUNTINFO)
                       if m.mount_point.startswith(prefix)
                       and "/" not in m.mount_point[len(prefix):]})

    def create(self, env: str) -> None:
        """Make the namespace and bind it at the holder; a FILE left there is reused, a held
        namespace is kept (verified, not assumed), anything else is refused."""
        p = self.path(env)
        state = self.state(env)
        if state == HELD:
            return
        if state == OTHER:
            raise HostError(f"create mount namespace '{env}': {p} exists and is not a "
                            "mount namespace")
        self.make_private_dir()
        try:
            os.close(os.open(p, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0))
        except OSError as exc:
            raise HostError(f"create mount namespace '{env}': create {p}: "
                            f"{exc.strerror}") from exc
        try:
            fd = _new_namespace()
            try:
                mount(fd_path(fd), str(p), None, MS_BIND)
            finally:
                os.close(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                if self.state(env) == FILE:
                    p.unlink()
            raise HostError(f"create mount namespace '{env}': bind {p}: "
                            f"{os.strerror(exc.errno or 1)}") from exc

    def remove(self, env: str) -> None:
        """Detach the holder (every mount of the namespace goes with it, once nothing else is
        in it) and unlink it; success when it is already gone."""
        p = self.path(env)
        try:
            umount2(str(p), MNT_DETACH | UMOUNT_NOFOLLOW)
        except OSError as exc:
            # EINVAL: not a mount point (a plain file); ENOENT: already gone.
            if exc.errno not in (errno.EINVAL, errno.ENOENT):
                raise HostError(f"remove mount namespace '{env}': umount {p}: "
                                f"{exc.strerror}") from exc
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise HostError(f"remove mount namespace '{env}': unlink {p}: "
                            f"{exc.strerror}") from exc

    @contextlib.contextmanager
    def entered(self, env: str, *, netns: Path | None = None) -> Iterator[None]:
        """Run the block with this thread in `env`'s mount namespace (and in network namespace
        `netns` when given: sysfs shows the network namespace of the process that mounts it).
        Signals are held for the block; the thread then goes back to the namespaces and the
        working directory it had, or the process ends (exit 70).

        The thread first gets a filesystem context of its own (unshare CLONE_FS): setns into a
        mount namespace refuses a thread that shares it with others, and a Python process has
        threads. Only this thread's working directory is then its own."""
        p = self.path(env)
        fds: list[int] = []
        try:
            try:
                ns = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                raise NoMountNamespace(f"mount namespace '{env}': {p} does not exist") from None
            except OSError as exc:
                raise NoMountNamespace(f"mount namespace '{env}': {p}: {exc.strerror}") from exc
            fds.append(ns)
            try:
                is_mnt = fcntl.ioctl(ns, NS_GET_NSTYPE) == CLONE_NEWNS
            except OSError:
                is_mnt = False
            if not is_mnt:
                raise NoMountNamespace(f"mount namespace '{env}': {p} holds no mount namespace")
            net = -1
            if netns is not None:
                try:
                    net = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as exc:
                    raise HostError(f"enter network namespace {netns}: "
                                    f"{exc.strerror}") from exc
                fds.append(net)
            home_mnt = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            fds.append(home_mnt)
            home_net = -1
            if net >= 0:
                home_net = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                fds.append(home_net)
            # setns into a mount namespace sets the thread's root and cwd to the namespace's
            # root: the cwd is restored from this descriptor. (envctl is never chrooted.)
            cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            fds.append(cwd)
            with signals_held():
                try:
                    unshare(CLONE_FS)
                    setns(ns, CLONE_NEWNS, str(p))
                except OSError as exc:
                    raise HostError(f"enter mount namespace '{env}': {exc.strerror}") from exc
                try:
                    if net >= 0:
                        try:
                            setns(net, CLONE_NEWNET, str(netns))
                        except OSError as exc:
                            raise HostError(f"enter network namespace {netns}: "
                                            f"{exc.strerror}") from exc
                    yield
                finally:
                    if home_net >= 0:
                        _back_or_die("network namespace", setns, home_net, CLONE_NEWNET)
                    _back_or_die("mount namespace", setns, home_mnt, CLONE_NEWNS)
                    _back_or_die("working directory", os.fchdir, cwd)
        finally:
            for fd in fds:
                os.close(fd)

    # ------------------------------------------------------------------ the directory

    def dir_state(self) -> DirState:
        """Whether the directory exists, is a mount point, and the top mount's propagation."""
        if not self.dir.is_dir():
            return DirState(False, False, "")
        top = [m for m in mountinfo(THREAD_MOUNTINFO) if m.mount_point == str(self.dir)]
        if not top:
            return DirState(True, False, "")
        return DirState(True, True, top[-1].propagation)

    def make_private_dir(self) -> None:
        """Make the directory a mount point (bound onto itself when it is not one) with private
        propagation: a namespace file cannot be bound on a shared mount (module docstring)."""
        d = str(self.dir)
        try:
            self.dir.mkdir(mode=0o755, parents=True, exist_ok=True)
            try:
                mount(None, d, None, MS_PRIVATE)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: not a mount point yet
                    raise
            mount(d, d, None, MS_BIND)
            mount(None, d, None, MS_PRIVATE)
        except OSError as exc:
            raise HostError(f"mount mount-namespace directory '{d}': "
                            f"{os.strerror(exc.errno or 1)}") from exc

    def set_dir_propagation(self, propagation: str) -> None:
        """Give the directory's mount `propagation` back as far as it can be: a shared mount
        becomes shared again (in a new peer group: the old one cannot be rejoined), an
        unbindable one unbindable; a slave stays private (its master is not known)."""
        flag = (MS_SHARED if "shared" in propagation else
                MS_UNBINDABLE if propagation == "unbindable" else 0)
        if not flag:
            return
        try:
            mount(None, str(self.dir), None, flag)
        except OSError as exc:
            raise HostError(f"restore mount-namespace directory '{self.dir}': "
                            f"{os.strerror(exc.errno or 1)}") from exc

    def unmount_dir(self) -> None:
        """Undo the self-bind; success when it is not mounted (any more). Busy (something is
        still mounted in it): left alone, not an error."""
        try:
            umount2(str(self.dir), UMOUNT_NOFOLLOW)
        except OSError as exc:
            # EINVAL: not a mount point; ENOENT: no directory; EBUSY: in use, not ours to end.
            if exc.errno not in (errno.EINVAL, errno.ENOENT, errno.EBUSY):
                raise HostError(f"unmount mount-namespace directory '{self.dir}': "
                                f"{exc.strerror}") from exc


def _new_namespace() -> int:
    """A descriptor of a new mount namespace, a copy of this thread's whose mounts are slaves
    (the host's mount events propagate in, none of its own propagate out), that this thread's
    namespace may bind.

    The kernel refuses (EINVAL) to bind a mount namespace's file into a namespace whose id is
    not lower (mnt_ns_loop: the guard against a namespace holding itself). Before 6.18 ids came
    from one global counter, so a new namespace always had the highest. On 6.18 they come from
    per-CPU batches (ns_tree_gen_id): one made on another CPU than the current namespace was
    can get a lower id (seen here: ids near 14400 on CPU 0, 17100 on CPU 1). The CPU that made
    the current namespace still gives higher ones, so a namespace whose id is too low is made
    again pinned to each CPU in turn."""
    fd = _unshare_namespace()
    home = _mntns_id_of("/proc/thread-self/ns/mnt")
    if home is None or (_mntns_id(fd) or 0) > home:
        return fd
    allowed = os.sched_getaffinity(0)
    try:
        for cpu in sorted(allowed):
            os.sched_setaffinity(0, {cpu})  # this thread only
            os.close(fd)
            fd = _unshare_namespace()
            if (_mntns_id(fd) or 0) > home:
                break
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.sched_setaffinity(0, allowed)
    return fd  # when none was higher, the bind says why (EINVAL)


NS_GET_MNTNS_ID = 0x8008B705  # _IOR(0xb7, 5, __u64), since 6.8


def _mntns_id(fd: int) -> int | None:
    """The id the kernel orders mount namespaces by; None where it does not say (before 6.8,
    when ids still came from one global counter)."""
    try:
        return int.from_bytes(fcntl.ioctl(fd, NS_GET_MNTNS_ID, bytes(8)), sys.byteorder)
    except OSError:
        return None


def _mntns_id_of(path: str) -> int | None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _mntns_id(fd)
    finally:
        os.close(fd)


def _unshare_namespace() -> int:
    """Made without a fork: this thread unshares, takes the descriptor and goes straight back,
    with signals held."""
    home = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with signals_held():
            unshare(CLONE_NEWNS)  # implies CLONE_FS: this thread's root and cwd become its own
            try:
                mount(None, "/", None, MS_REC | MS_SLAVE)
                return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            finally:
                _back_or_die("mount namespace", setns, home, CLONE_NEWNS)
                _back_or_die("working directory", os.fchdir, cwd)
    finally:
        os.close(home)
        os.close(cwd)


# ---------------------------------------------------------------- mounts inside a rootfs
# Called inside `MountNamespaces.entered`: descriptors are opened in the environment's namespace
# (mount(2) binds only from and onto mounts of the caller's namespace).


class Moved(OSError):
    """The mount point was swapped while it was being mounted on; the mount was undone."""


class MountPoint(Record):
    """A mount point inside a root filesystem, opened beneath the root (O_PATH): `path` is
    where it is in this namespace, the rootfs's own symlinks resolved."""

    root: str
    target: str
    file: bool
    fd: int
    path: str

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> MountPoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_mountpoint(root: str, target: str, *, file: bool = False) -> MountPoint:
    """Open `target` beneath `root`: relative symlinks inside the rootfs are followed; `..`
    above the root, absolute symlinks and symlinks leading out raise `Escape`. The mount point
    must exist (FileNotFoundError) and be a directory, or a non-directory when `file`."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_beneath(root_fd, target, os.O_PATH if file else os.O_PATH | os.O_DIRECTORY)
    finally:
        os.close(root_fd)
    try:
        if file and stat.S_ISDIR(os.stat(fd_path(fd)).st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", target)
        return MountPoint(root, target, file, fd, os.readlink(fd_path(fd)))
    except BaseException:
        os.close(fd)
        raise


def open_source(path: str, *, file: bool = False, beneath: str = "") -> int:
    """An O_PATH descriptor of a bind's source, in this namespace; the kind must match the
    mount point's. An operator's source (an absolute path of the spec) is followed through
    symlinks only where every directory on the way is root's and not writable by others
    (safepath.open_root_controlled; NotRootControlled otherwise). A data directory under
    envctl's state directory (`beneath`: <state>/data/ENV) is bound read-write into the
    environment, so a job may have put a symlink anywhere in it: it is opened beneath that
    directory through no symlink at all (safepath.Escape otherwise), and the bind is made
    from this descriptor."""
    if beneath:
        from envctl.host.safepath import open_beneath

        rel = os.path.relpath(path, beneath)
        if rel == ".." or rel.startswith("../"):
            raise OSError(errno.EXDEV, f"{path} is not under {beneath}", path)
        base = os.open(beneath, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = open_beneath(base, rel, os.O_PATH | (0 if file else os.O_DIRECTORY),
                              symlinks=False)
        finally:
            os.close(base)
    else:
        from envctl.host.safepath import open_root_controlled

        # Followed only through symlinks root alone could have made (safepath): one in a
        # directory a user or a partition writes would send the bind anywhere on the host.
        fd = open_root_controlled(path, directory=None if file else True)
    if file and stat.S_ISDIR(os.stat(fd_path(fd)).st_mode):
        os.close(fd)
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    return fd


def top_mount(mp: MountPoint) -> MountInfo | None:
    """The mount sitting at the mount point (the top one when several are stacked: opening the
    path crossed into it), or None when nothing is mounted there."""
    mid = mount_id(mp.fd)
    for m in mountinfo(THREAD_MOUNTINFO):
        if m.mount_id == mid:
            return m if m.mount_point == mp.path else None
    return None


def flag_bits(options: tuple[str, ...] | frozenset[str]) -> int:
    bits = 0
    for o in options:
        bits |= FLAGS[o]
    return bits


def mount_on(mp: MountPoint, fstype: str, *, source: str = "", source_fd: int = -1,
             flags: int = 0, data: str = "") -> MountInfo:
    """Mount onto the mount point's descriptor, then check the mount sits at `mp.path`: the
    target opened beneath the root again must be the new mount. If it is not (the directory was
    swapped for a symlink after it was opened), the mount is detached again and `Moved` is
    raised. `fstype` "bind" binds `source_fd` and then remounts it with `flags` (a bind takes
    its flags only from a remount); any other type is mounted with `flags` and `data`."""
    before = {m.mount_id for m in mountinfo(THREAD_MOUNTINFO)}
    if fstype == "bind":
        mount(fd_path(source_fd), fd_path(mp.fd), None, MS_BIND)
    else:
        mount(source or fstype, fd_path(mp.fd), fstype, flags, data or None)
    try:
        again = open_mountpoint(mp.root, mp.target, file=mp.file)
    except OSError as exc:
        _undo(mp)
        raise Moved(errno.EXDEV, f"mount point changed while mounting ({exc.strerror}); "
                    "unmounted again", mp.target) from exc
    with again:
        top = top_mount(again)
        if top is None or top.mount_id in before or again.path != mp.path:
            _undo(mp)
            raise Moved(errno.EXDEV, f"mount point changed while mounting (now {again.path}, "
                        f"expected {mp.path}); unmounted again", mp.target)
        if fstype == "bind" and flags:
            try:
                mount(None, fd_path(again.fd), None, MS_REMOUNT | MS_BIND | flags)
            except OSError:
                _undo(mp)
                raise
            top = top_mount(again) or top
        return top


def remount(mp: MountPoint, flags: int, *, bind: bool) -> None:
    """Set the flags of the mount at the mount point (the other per-mount flags are kept)."""
    mount(None, fd_path(mp.fd), None, MS_REMOUNT | flags | (MS_BIND if bind else 0))


def detach(mp: MountPoint) -> None:
    """Detach the top mount at the mount point, and everything mounted below it."""
    umount2(fd_path(mp.fd), MNT_DETACH)


def _undo(mp: MountPoint) -> None:
    # mp.fd is the directory mounted on: the mount just made is the one on top of it, wherever
    # that directory is now. umount(2) follows the magic link to the topmost mount there.
    with contextlib.suppress(OSError):
        detach(mp)


def why(exc: OSError) -> str:
    """A resolving or mounting failure as an operator reads it."""
    if isinstance(exc, Escape):
        return ("the path leaves the root filesystem ('..', an absolute symlink or a symlink "
                "pointing outside it)")
    if isinstance(exc, Moved):
        return exc.strerror or "the mount point changed while mounting"
    if isinstance(exc, FileNotFoundError):
        return "the mount point does not exist in the root filesystem (the rootfs step makes it)"
    if isinstance(exc, NotADirectoryError):
        return "the mount point is not a directory"
    if isinstance(exc, IsADirectoryError):
        return "the mount point is a directory, not a file"
    return os.strerror(exc.errno) if exc.errno else str(exc)
