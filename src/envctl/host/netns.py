"""Named network namespaces under /run/netns, made as iproute2 makes them (bind-mounted nsfs),
and that directory as a shared mount point."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import sys
from pathlib import Path

from envctl.errors import HostError
from envctl.host.libc import libc as _libc

CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_SHARED = 1 << 20
MNT_DETACH = 2
NS_GET_NSTYPE = 0xB703



def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str, dst: str, flags: int) -> None:
    _check(_libc.mount(src.encode(), dst.encode(), b"none", flags, None), f"mount {dst}")


def _bind_new_namespace(target: str) -> None:
    """unshare(CLONE_NEWNET) in this thread, bind the new namespace onto `target`, return.
    Signals are held from before unshare until the thread is back (see signals_held)."""
    from envctl.host.libc import signals_held

    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        with signals_held():
            _check(_libc.unshare(CLONE_NEWNET), "unshare")
            try:
                _mount("/proc/thread-self/ns/net", target, MS_BIND)
            finally:
                if _libc.setns(home, CLONE_NEWNET) != 0:  # pragma: no cover - back to our own
                    # Going on in the new namespace would change the wrong host: stop here.
                    err = ctypes.get_errno()
                    sys.stderr.write(f"envctl: cannot return to the host netns: "
                                     f"{os.strerror(err)}\n")
                    os._exit(70)
    finally:
        os.close(home)


class NetNamespaces:
    """Create, inspect and remove named network namespaces in `netns_dir` (iproute2 compatible)."""

    def __init__(self, netns_dir: Path):
        self.dir = netns_dir

    def path(self, name: str) -> Path:
        return self.dir / name

    def state(self, name: str) -> str:
        """'absent', 'present' (a bound net namespace), or 'stale' (a file that is not one)."""
        p = self.path(name)
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            return "absent"
        try:
            ns_type = fcntl.ioctl(fd, NS_GET_NSTYPE)
        except OSError:
            return "stale"  # a plain file: the bind mount never happened or was undone
        finally:
            os.close(fd)
        return "present" if ns_type == CLONE_NEWNET else "stale"

    def create(self, name: str) -> None:
        """Make the namespace; a stale mount point left by a crash is replaced."""
        if self.state(name) == "stale":
            self.remove(name)
        self.share_dir()
        p = self.path(name)
        try:
            os.close(os.open(p, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
        except FileExistsError:
            if self.state(name) == "present":
                return  # made by someone else in the meantime: verified, not assumed
            raise HostError(f"create netns '{name}': {p} exists and is not a namespace") from None
        # As `ip netns add`: unshare() a new namespace and bind it onto the mount point. Done
        # in this thread, which then goes straight back to the namespace it came from (a
        # forked child, which needs no way back, cost ~6 ms per namespace in fork + wait).
        try:
            _bind_new_namespace(str(p))
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            raise HostError(f"create netns '{name}': bind namespace: "
                            f"{os.strerror(exc.errno or 1)}") from exc

    def remove(self, name: str) -> None:
        """Unmount and delete; success when it is already gone."""
        p = self.path(name)
        if _libc.umount2(str(p).encode(), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            # EINVAL: not a mount point (stale file); ENOENT: already gone.
            if err not in (errno.EINVAL, errno.ENOENT):
                raise HostError(f"remove netns '{name}': umount: {os.strerror(err)}")
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise HostError(f"remove netns '{name}': unlink: {exc.strerror}") from exc

    # ------------------------------------------------------------------ the directory

    def share_dir(self) -> None:
        """As iproute2: make the directory a shared mount (binding it onto itself first if it
        is not a mount point) so namespaces bound in it propagate to every mount namespace."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            d = str(self.dir)
            if _libc.mount(b"", d.encode(), b"none", MS_SHARED | MS_REC, None) == 0:
                return
            # EINVAL: not a mount point yet.
            _mount(d, d, MS_BIND | MS_REC)
            _mount("", d, MS_SHARED | MS_REC)
        except OSError as exc:
            raise HostError(f"mount netns directory '{self.dir}': "
                            f"{os.strerror(exc.errno or 1)}") from exc

    def dir_state(self) -> tuple[bool, bool, bool]:
        """Whether the directory exists, is a mount point, and that mount is shared."""
        if not self.dir.is_dir():
            return False, False, False
        top = [fields for point, fields in _mountinfo() if point == str(self.dir)]
        if not top:
            return True, False, False
        return True, True, any(f.startswith("shared:") for f in top[-1])

    def mounted_in_dir(self) -> list[str]:
        """What is mounted below the directory (namespaces bound in it), by name."""
        prefix = f"{self.dir}/"
        return sorted({point[len(prefix):] for point, _ in _mountinfo()
                       if point.startswith(prefix)})

    def unmount_dir(self) -> None:
        """Undo `share_dir`'s bind mount; success when it is not mounted (any more). A mount
        that is busy (something was mounted in it meanwhile) stays: left alone, not an error."""
        if _libc.umount2(str(self.dir).encode(), 0) != 0:
            err = ctypes.get_errno()
            # EINVAL: not a mount point; ENOENT: no directory; EBUSY: in use, so not ours to end.
            if err not in (errno.EINVAL, errno.ENOENT, errno.EBUSY):
                raise HostError(f"unmount netns directory '{self.dir}': umount: "
                                f"{os.strerror(err)}")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mountinfo() -> list[tuple[str, list[str]]]:
    """(mount point, optional fields) of every mount of this process, in mount order."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 6:
                out.append((_unescape(parts[4]), parts[6:parts.index("-")] if "-" in parts
                            else parts[6:]))
    return out
