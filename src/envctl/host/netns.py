"""Named network namespaces under /run/netns, made as iproute2 makes them (bind-mounted nsfs)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
from pathlib import Path

from envctl.errors import HostError

CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_SHARED = 1 << 20
MNT_DETACH = 2
NS_GET_NSTYPE = 0xB703

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str, dst: str, flags: int) -> None:
    _check(_libc.mount(src.encode(), dst.encode(), b"none", flags, None), f"mount {dst}")


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
        self._share_dir()
        p = self.path(name)
        try:
            os.close(os.open(p, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
        except FileExistsError:
            if self.state(name) == "present":
                return  # made by someone else in the meantime: verified, not assumed
            raise HostError(f"create netns '{name}': {p} exists and is not a namespace") from None
        # unshare() in a forked child so this process stays in its own namespace; the child
        # binds its new namespace onto the mount point and exits.
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 0
            try:
                _check(_libc.unshare(CLONE_NEWNET), "unshare")
                _mount(f"/proc/{os.getpid()}/ns/net", str(p), MS_BIND)
            except OSError as exc:
                code = exc.errno or 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            raise HostError(f"create netns '{name}': bind namespace: {os.strerror(abs(code))}")

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

    def _share_dir(self) -> None:
        # As iproute2: make the directory a shared mount (binding it onto itself first if it is
        # not a mount point) so namespaces bound in it propagate to every mount namespace.
        self.dir.mkdir(parents=True, exist_ok=True)
        d = str(self.dir)
        if _libc.mount(b"", d.encode(), b"none", MS_SHARED | MS_REC, None) == 0:
            return
        _mount(d, d, MS_BIND | MS_REC)
        _mount("", d, MS_SHARED | MS_REC)
