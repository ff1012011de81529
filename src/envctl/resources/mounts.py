"""An environment's persistent mount namespace and what is mounted in it: the holder at
<run>/mnt/ENV, the directory the holders live in (a private self-bind, shared by every
environment), each mount (the rootfs read-only, /tmp, /sys, data and library binds) and the
environment's own /dev.

Everything but the holders and their directory is made inside the environment's namespace
(`MountNamespaces.entered`), so the host's mount table never shows it and `down` detaching the
holder drops it all. Plan order: mntns-dir, mntns, the rootfs tree (it makes the mount points),
the rootfs's own read-only bind (target "/"), then env-dev and every other mount on top of it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envctl.errors import HostError
from envctl.resources.base import Check, Diff, Resource, Status

if TYPE_CHECKING:
    from envctl.host import mounts as m
    from envctl.host.context import Host
else:
    class _Adapter:
        """envctl.host.mounts, imported on first use: the planner makes these values without
        loading the adapter (and ctypes with it)."""

        def __getattr__(self, name: str) -> Any:
            from envctl.host import mounts

            return getattr(mounts, name)

    m = _Adapter()

# What the kernel appends to the path of a directory that was removed (d_path).
DELETED = " (deleted)"
# Subdirectories of /dev that nodes may be in (MIG capabilities: nvidia-caps/nvidia-cap1).
NODE_SUBDIRS = ("nvidia-caps",)
# Holders live in <run>/MNT_DIR/ENV.
MNT_DIR = "mnt.d"
FSTYPES = ("bind", "tmpfs", "sysfs")
OPTIONS = ("ro", "nosuid", "nodev", "noexec")  # the per-mount flags a mount may ask for

# The device nodes every environment's /dev has: (name, major, minor, mode, gid), owner root.
# With the devpts instance (DEVPTS_DEVICES: its ptmx is 5:2, its ptys 136:N) they are exactly the
# cgroup allow-list plan.limits.DEFAULT_DEVICES; tests/unit/test_mounts.py keeps the two equal.
SAFE_NODES: tuple[tuple[str, int, int, int, int], ...] = (
    ("null", 1, 3, 0o666, 0), ("zero", 1, 5, 0o666, 0), ("full", 1, 7, 0o666, 0),
    ("random", 1, 8, 0o666, 0), ("urandom", 1, 9, 0o666, 0), ("tty", 5, 0, 0o666, 0))
DEVPTS_DEVICES = ("c 5:2", "c 136:*")
DEV_LINKS = (("ptmx", "pts/ptmx"), ("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"))
# /dev holds nodes and links only: a small tmpfs. No nodev (its nodes must open), no exec.
DEV_DATA = "mode=755,size=1m,nr_inodes=4k"
DEV_FLAGS = ("nosuid", "noexec")
DEVPTS_DATA = "newinstance,ptmxmode=0666,mode=0620,gid=5"
DEVPTS_FLAGS = ("nosuid", "noexec")
SHM_FLAGS = ("nosuid", "nodev")


def dev_cgroup_rules(nodes: tuple[tuple[str, int, int, int, int], ...] = SAFE_NODES
                     ) -> tuple[str, ...]:
    """The cgroup device rules (`c MAJ:MIN rwm`) that a /dev with `nodes` needs."""
    return tuple(f"c {maj}:{mn} rwm" for _, maj, mn, _, _ in nodes) + tuple(
        f"{d} rwm" for d in DEVPTS_DEVICES)


def namespaces(host: Host) -> m.MountNamespaces:
    return m.MountNamespaces(host.run_dir / MNT_DIR)


def _run_names(host: Host) -> frozenset[str]:
    run = host.run_dir
    return frozenset(p.name for p in run.iterdir()) if run.is_dir() else frozenset()


# ---------------------------------------------------------------- the directory


@dataclass(frozen=True)
class MountNamespaceDir(Resource):
    """<run>/mnt as a mount point with private propagation (a namespace file cannot be bound
    on a shared mount): bound onto itself when it is not a mount point. Shared by every
    environment; the last one's `down` unmounts it when envctl made the mount and no holder is
    left in it, or gives back the propagation a mount that was there before had."""

    kind = "mntns-dir"
    shared = True
    volatile = True

    def ident(self) -> str:
        return "mount"

    def describe(self) -> str:
        return f"mount-namespace directory <run>/{MNT_DIR}, a private mount"

    def check(self, host: Host) -> Check:
        st = namespaces(host).dir_state()
        if not st.mounted:
            return Check.absent("not a mount point" if st.exists else "")
        return Check.compare({"propagation": "private"}, {"propagation": st.propagation})

    def snapshot(self, host: Host) -> dict[str, Any]:
        st = namespaces(host).dir_state()
        return {"existed": st.exists, "mounted": st.mounted, "propagation": st.propagation}

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        namespaces(host).make_private_dir()

    def _kept(self, host: Host, memo: dict[str, Any], *, ours: frozenset[str] = frozenset()
              ) -> str:
        """Why the mount stays ("" when it goes); holders named in `ours` are left out."""
        ns = namespaces(host)
        if memo.get("mounted"):
            was, now = memo.get("propagation") or "private", ns.dir_state().propagation
            note = "kept: it was a mount point before envctl"
            if not now or now == was:
                return note
            if was in ("shared", "unbindable"):
                return f"{note}; propagation {now} -> {was}"
            # A slave's master is not known: it cannot be made a slave of it again.
            back = "shared" if "shared" in was else now
            return f"{note}; propagation {now} -> {back} (it was {was})"
        others = [n for n in ns.held() if n not in ours]
        if others:
            return f"kept: {', '.join(others)} still mounted in it"
        return ""

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        # Said before the environments' own holders go: those of environments that are up
        # (each has its run directory) are left out.
        return self._kept(host, memo, ours=_run_names(host))

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        ns = namespaces(host)
        if memo.get("mounted"):
            # Not envctl's mount: it stays, with the propagation it had (as far as possible).
            if ns.dir_state().mounted:
                ns.set_dir_propagation(memo.get("propagation") or "private")
            return
        if self._kept(host, memo):
            return  # a holder is still in it: not envctl's to end
        ns.unmount_dir()
        if not memo.get("existed", True):
            with contextlib.suppress(OSError):  # not empty, or gone already
                ns.dir.rmdir()


# ---------------------------------------------------------------- the namespace


@dataclass(frozen=True)
class MountNamespace(Resource):
    """The environment's mount namespace, held by binding its nsfs file at <run>/mnt/ENV.

    Ownership: the path is inside envctl's run directory and named after the environment, and
    the engine journals this step (with its memo) before `apply`, so a holder left by a crashed
    run is in that environment's journal: the next `up` keeps the memo and converges, `down`
    removes it, without a fresh snapshot. A fresh snapshot that finds a namespace already held
    there therefore finds one no journal of this state directory made (another envctl with
    another state directory, a hand-made one): refused, never adopted nor detached. An empty
    plain file is taken over: it holds nothing, and it is what a crash between creating the
    mount point and binding leaves, or what a run directory on disk keeps after a reboot (whose
    journal entries are dropped as another boot's). Anything else there is refused."""

    kind = "mntns"
    volatile = True
    env: str

    def ident(self) -> str:
        return self.env

    def describe(self) -> str:
        return f"mount namespace of {self.env}"

    def check(self, host: Host) -> Check:
        ns = namespaces(host)
        state = ns.state(self.env)
        if state == m.HELD:
            return Check.present()
        if state == m.ABSENT:
            return Check.absent()
        if state == m.FILE:
            return Check.absent(f"{ns.path(self.env)} holds no namespace")
        return Check.wrong_kind(f"{ns.path(self.env)} is not a mount namespace")

    def snapshot(self, host: Host) -> dict[str, Any]:
        ns = namespaces(host)
        return {"found": ns.state(self.env), "path": str(ns.path(self.env))}

    def refuses(self, memo: dict[str, Any]) -> str:
        found, path = memo.get("found"), memo.get("path", "")
        if found == m.HELD:
            return (f"a mount namespace is already held at {path} and no journal here records "
                    f"making it (another envctl's?); `umount {path}` if it is stale")
        if found == m.OTHER:
            return f"{path} exists and is not a mount namespace envctl made"
        return ""

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        namespaces(host).create(self.env)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        ns = namespaces(host)
        if ns.state(self.env) in (m.HELD, m.FILE):
            ns.remove(self.env)
        # ABSENT: gone already. OTHER: something replaced envctl's holder; not envctl's.


# ---------------------------------------------------------------- helpers for mounts


def _clean(target: str) -> str:
    """`target` if it is absolute without '.', '..' or empty components, else ""."""
    parts = target.split("/")
    if not target.startswith("/") or any(p in (".", "..") for p in parts):
        return ""
    return target


@contextlib.contextmanager
def _inside(host: Host, env: str, netns: str = ""):  # noqa: ANN202 - a context manager
    with namespaces(host).entered(env, netns=Path(netns) if netns else None):
        yield


def _same_object(fd: int, other_fd: int) -> bool:
    a, b = os.stat(m.fd_path(fd)), os.stat(m.fd_path(other_fd))
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


# ---------------------------------------------------------------- one mount


@dataclass(frozen=True)
class Mount(Resource):
    """One mount inside the environment's namespace: a bind (`source` a host path, `file` for a
    single file such as a driver library), a tmpfs or a sysfs (`source` the name mountinfo
    shows), at `target` inside the rootfs `root`, with `options` (ro, nosuid, nodev, noexec)
    and, for a tmpfs, `data` ("mode=1777,size=1g"). A sysfs is mounted from inside `netns`
    (the environment's network namespace, by name under the host's netns directory or as an
    absolute path; "" for none: sysfs shows the network devices of the namespace it was
    mounted from). Target "/" is the rootfs's own bind (source = root), read-only, that every
    other mount sits on.

    The target is opened beneath the root: relative symlinks of the rootfs are followed; '..',
    absolute symlinks and symlinks leading out are refused, as is a mount point that is
    missing (the rootfs step makes them). The mount is made onto that descriptor, then checked
    to sit at the path it resolved to (`host.mounts.mount_on`)."""

    kind = "mount"
    volatile = True
    env: str
    root: str
    target: str
    source: str
    fstype: str = "bind"
    options: tuple[str, ...] = ()
    data: str = ""
    netns: str = ""
    file: bool = False
    # A data source inside envctl's state directory (<state>/data/ENV), which jobs can write:
    # opened beneath it through no symlink (see host.mounts.open_source).
    beneath: str = ""

    def ident(self) -> str:
        return f"{self.env}:{self.target}"

    def describe(self) -> str:
        what = f"bind of {self.source}" if self.fstype == "bind" else self.fstype
        opts = f" ({','.join(self.options)})" if self.options else ""
        return f"{what} on {self.target} in {self.env}{opts}"

    def _fail(self, why: str) -> HostError:
        return HostError(f"mount {self.target} in '{self.env}': {why}")

    def _validate(self) -> None:
        """Refuse fields the planner should never produce, before anything is touched."""
        if self.fstype not in FSTYPES:
            raise self._fail(f"type {self.fstype!r} is not one of {', '.join(FSTYPES)}")
        if not _clean(self.target):
            raise self._fail("the target must be an absolute path without '.' or '..'")
        if self.target == "/" and (self.fstype != "bind" or self.source != self.root):
            raise self._fail("target / is only the rootfs's own bind (source = root)")
        bad = [o for o in self.options if o not in OPTIONS]
        if bad:
            raise self._fail(f"options {', '.join(bad)}: allowed are {', '.join(OPTIONS)}")
        if self.file and self.fstype != "bind":
            raise self._fail("only a bind mount can be a file mount")
        if not os.path.isabs(self.root):
            raise self._fail(f"the root {self.root!r} must be an absolute path")

    def _netns(self, host: Host) -> str:
        """The network namespace to mount from: only a sysfs needs one."""
        if self.fstype != "sysfs" or not self.netns:
            return ""
        return self.netns if self.netns.startswith("/") else str(host.netns_dir / self.netns)

    def _open(self) -> m.MountPoint:
        try:
            return m.open_mountpoint(self.root, self.target, file=self.file)
        except OSError as exc:
            raise self._fail(m.why(exc)) from exc

    def _source_fd(self) -> int:
        try:
            return m.open_source(self.source, file=self.file, beneath=self.beneath)
        except OSError as exc:
            from envctl.host.safepath import NotRootControlled

            if isinstance(exc, NotRootControlled):
                raise self._fail(f"source {self.source}: {exc.strerror}, which envctl does "
                                 "not go through as root; refusing") from exc
            raise self._fail(f"source {self.source}: "
                             f"{os.strerror(exc.errno) if exc.errno else exc}") from exc

    def _have(self, mp: m.MountPoint, top: m.MountInfo) -> dict[str, object]:
        """What is mounted at the mount point, in the terms of the fields."""
        if self.fstype == "bind":
            try:
                src = m.open_source(self.source, file=self.file, beneath=self.beneath)
            except OSError:
                same = False
            else:
                try:
                    same = _same_object(mp.fd, src)
                finally:
                    os.close(src)
            what = self.source if same else f"{top.fstype} {top.source}:{top.root}"
        else:
            what = f"{top.fstype} {top.source}"
        return {"source": what, "options": sorted(top.flags)}

    def _want(self) -> dict[str, object]:
        what = self.source if self.fstype == "bind" else f"{self.fstype} {self.source}"
        return {"source": what, "options": sorted(set(self.options))}

    def check(self, host: Host) -> Check:
        self._validate()
        if namespaces(host).state(self.env) != m.HELD:
            return Check.absent("no mount namespace")
        with _inside(host, self.env):
            try:
                mp = m.open_mountpoint(self.root, self.target, file=self.file)
            except FileNotFoundError as exc:
                return Check.absent(m.why(exc))
            except OSError as exc:
                return Check.wrong_kind(m.why(exc))
            with mp:
                top = m.top_mount(mp)
                if top is None:
                    return Check.absent()
                return Check.compare(self._want(), self._have(mp, top))

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        self._validate()
        with _inside(host, self.env, self._netns(host)):
            mp = self._open()
            if mp.path.endswith(DELETED):
                # A bind whose source a job deleted (a data directory is writable inside):
                # the path now leads into that dead directory. Detached, then bound afresh.
                try:
                    m.detach(mp)
                except OSError as exc:
                    raise self._fail(f"unmount the stale mount: {m.why(exc)}") from exc
                finally:
                    mp.close()
                mp = self._open()
            try:
                top = m.top_mount(mp)
                if top is not None:
                    want, have = self._want(), self._have(mp, top)
                    if want == have:
                        return  # already so
                    if want["source"] == have["source"]:
                        # The same mount with other flags: set them.
                        try:
                            m.remount(mp, m.flag_bits(self.options),
                                      bind=self.fstype == "bind")
                        except OSError as exc:
                            raise self._fail(f"remount: {exc.strerror}") from exc
                        return
                    # Something else at the target of envctl's own namespace (what an earlier
                    # spec put there): replaced.
                    m.detach(mp)
                    mp.close()
                    mp = self._open()
                src = self._source_fd() if self.fstype == "bind" else -1
                try:
                    m.mount_on(mp, self.fstype, source=self.source, source_fd=src,
                               flags=m.flag_bits(self.options), data=self.data)
                except OSError as exc:
                    raise self._fail(m.why(exc)) from exc
                finally:
                    if src >= 0:
                        os.close(src)
            finally:
                mp.close()

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        if namespaces(host).state(self.env) != m.HELD:
            return  # the namespace is gone, and every mount in it
        with _inside(host, self.env):
            try:
                mp = m.open_mountpoint(self.root, self.target, file=self.file)
            except OSError:
                return  # no mount point (or one leading out): nothing of envctl's is there
            with mp:
                top = m.top_mount(mp)
                # Only this resource's mount (whatever its flags now) is taken away.
                if top is None or self._have(mp, top)["source"] != self._want()["source"]:
                    return
                try:
                    m.detach(mp)
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOENT):  # gone meanwhile
                        raise self._fail(f"unmount: {exc.strerror}") from exc


# ---------------------------------------------------------------- /dev


@dataclass(frozen=True)
class EnvDev(Resource):
    """The environment's /dev: a small tmpfs at <root>/dev holding the safe nodes (SAFE_NODES),
    the GPU nodes the planner gives (`nodes`: (name, major, minor, mode, gid)), the usual
    links, a devpts instance of its own at /dev/pts and a tmpfs at /dev/shm (`shm_size`, ""
    for the kernel's default of half the memory; its pages are charged to the memory cgroup of
    whoever writes them). The tmpfs is envctl's: `apply` makes missing nodes, fixes modes and
    owners and removes device nodes nobody asked for."""

    kind = "env-dev"
    volatile = True
    env: str
    root: str
    # A major may be a /proc/devices name ("nvidia-uvm"): dynamic, read when the step runs.
    nodes: tuple[tuple[str, int | str, int, int, int], ...] = ()
    shm_size: str = ""

    def ident(self) -> str:
        return self.env

    def describe(self) -> str:
        extra = f", {len(self.nodes)} more node(s)" if self.nodes else ""
        return f"/dev of {self.env} (tmpfs{extra})"

    def _fail(self, why: str) -> HostError:
        return HostError(f"set up /dev in '{self.env}': {why}")

    def _wanted(self, host: Host | None = None) -> dict[str, tuple[str, int, int, int, int]]:
        """The nodes by name; a named major ("nvidia-uvm", dynamic) is read from /proc/devices
        (under Host.gpu_root) when `host` is given, else left for the name check alone."""
        wanted = {n[0]: n for n in (*SAFE_NODES, *self.nodes)}
        taken = {name for name, _ in DEV_LINKS} | {"pts", "shm"}
        for name in wanted:
            sub, _, leaf = name.rpartition("/")
            if not leaf or leaf in (".", "..") or name in taken or \
                    (sub and sub not in NODE_SUBDIRS):
                raise self._fail(f"device node name {name!r} is not allowed")
        named = {n[1] for n in wanted.values() if isinstance(n[1], str)}
        if host is not None and named:
            from envctl.host.devices import char_majors

            majors = char_majors(host.gpu_root / "proc")
            missing = sorted(named - set(majors))
            if missing:
                raise self._fail(f"device '{missing[0]}' is not in "
                                 f"{host.gpu_root / 'proc'}/devices: its driver is not loaded")
            wanted = {k: (n[0], majors[n[1]] if isinstance(n[1], str) else n[1], *n[2:])
                      for k, n in wanted.items()}
        return wanted

    def _want(self, host: Host) -> dict[str, str]:
        want = {name: _node_text(stat.S_IFCHR, maj, mn, mode, 0, gid)
                for name, (_, maj, mn, mode, gid) in self._wanted(host).items()}
        want.update({name: f"-> {target}" for name, target in DEV_LINKS})
        want["pts"] = "devpts"
        want["shm"] = "tmpfs"
        return want

    def _shm_data(self) -> str:
        return "mode=1777" + (f",size={self.shm_size}" if self.shm_size else "")

    def _open(self, target: str) -> m.MountPoint:
        try:
            return m.open_mountpoint(self.root, target)
        except OSError as exc:
            raise self._fail(f"{target}: {m.why(exc)}") from exc

    def _have(self, dev: m.MountPoint) -> dict[str, str]:
        """Device nodes and links in the tmpfs (other files are a job's, not compared) and
        what is mounted at pts and shm."""
        have: dict[str, str] = {}
        for prefix, dfd in _node_dirs(dev.fd):
            try:
                for name in os.listdir(dfd):
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                        have[prefix + name] = _node_text(
                            stat.S_IFMT(st.st_mode), os.major(st.st_rdev), os.minor(st.st_rdev),
                            stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
                    elif stat.S_ISLNK(st.st_mode) and not prefix:
                        have[name] = f"-> {os.readlink(name, dir_fd=dfd)}"
            finally:
                os.close(dfd)
        for name in ("pts", "shm"):
            try:
                with m.open_mountpoint(self.root, f"/dev/{name}") as sub:
                    top = m.top_mount(sub)
                    if top is not None:
                        have[name] = top.fstype
            except OSError:
                pass
        return have

    def _diffs(self, host: Host, dev: m.MountPoint, top: m.MountInfo) -> tuple[Diff, ...]:
        want, have = self._want(host), self._have(dev)
        names = sorted(set(want) | {n for n, v in have.items() if not v.startswith("->")})
        diffs = [Diff(f"/dev/{n}", want.get(n), have.get(n)) for n in names
                 if want.get(n) != have.get(n)]
        if top.flags != set(DEV_FLAGS):
            diffs.insert(0, Diff("options", sorted(DEV_FLAGS), sorted(top.flags)))
        return tuple(diffs)

    def check(self, host: Host) -> Check:
        try:
            self._wanted(host)
        except HostError as exc:
            return Check.absent(str(exc))
        if namespaces(host).state(self.env) != m.HELD:
            return Check.absent("no mount namespace")
        with _inside(host, self.env):
            try:
                dev = m.open_mountpoint(self.root, "/dev")
            except FileNotFoundError as exc:
                return Check.absent(m.why(exc))
            except OSError as exc:
                return Check.wrong_kind(m.why(exc))
            with dev:
                top = m.top_mount(dev)
                if top is None:
                    return Check.absent()
                if top.fstype != "tmpfs":
                    return Check.wrong_kind(f"{top.fstype} is mounted at /dev, not a tmpfs")
                diffs = self._diffs(host, dev, top)
                return Check(Status.DRIFTED, diffs) if diffs else Check.present()

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        wanted = self._wanted(host)
        with _inside(host, self.env):
            dev = self._open("/dev")
            try:
                top = m.top_mount(dev)
                if top is not None and top.fstype != "tmpfs":
                    m.detach(dev)  # not the tmpfs (an earlier spec's): replaced
                    dev.close()
                    dev, top = self._open("/dev"), None
                if top is None:
                    self._mount(dev, "tmpfs", "tmpfs", DEV_FLAGS, DEV_DATA)
                    dev.close()
                    dev = self._open("/dev")
                elif top.flags != set(DEV_FLAGS):
                    m.remount(dev, m.flag_bits(DEV_FLAGS), bind=False)
                self._converge(dev, wanted)
            finally:
                dev.close()
            for name, fstype, source, flags, data in (
                    ("pts", "devpts", "devpts", DEVPTS_FLAGS, DEVPTS_DATA),
                    ("shm", "tmpfs", "shm", SHM_FLAGS, self._shm_data())):
                with self._open(f"/dev/{name}") as sub:
                    top = m.top_mount(sub)
                    if top is not None and top.fstype == fstype:
                        if top.flags != set(flags):
                            m.remount(sub, m.flag_bits(flags), bind=False)
                        continue
                    if top is not None:
                        m.detach(sub)
                with self._open(f"/dev/{name}") as sub:
                    self._mount(sub, fstype, source, flags, data)

    def _mount(self, mp: m.MountPoint, fstype: str, source: str, flags: tuple[str, ...],
               data: str) -> None:
        try:
            m.mount_on(mp, fstype, source=source, flags=m.flag_bits(flags), data=data)
        except OSError as exc:
            raise self._fail(f"{mp.target}: {m.why(exc)}") from exc

    def _converge(self, dev: m.MountPoint,
                  wanted: dict[str, tuple[str, int, int, int, int]]) -> None:
        """Inside the tmpfs: nodes made or fixed, extra device nodes removed, links and the
        pts/shm directories made. Every call is relative to the tmpfs's descriptor."""
        try:
            for sub in sorted({n.rpartition("/")[0] for n in wanted} - {""}):
                if _lstat(dev.fd, sub) is None:
                    os.mkdir(sub, 0o755, dir_fd=dev.fd)
            for prefix, sfd in _node_dirs(dev.fd):
                try:
                    for name in os.listdir(sfd):
                        st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                        if (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)) \
                                and prefix + name not in wanted:
                            os.unlink(name, dir_fd=sfd)  # a node nobody asked for
                    for full, maj, mn, mode, gid in wanted.values():
                        sub, _, name = full.rpartition("/")
                        if (sub + "/" if sub else "") == prefix:
                            _ensure_node(sfd, name, os.makedev(maj, mn), mode, gid)
                finally:
                    os.close(sfd)
        except OSError as exc:
            raise self._fail(f"{exc.filename or '/dev'}: {exc.strerror}") from exc
        dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dev.fd)
        try:
            for name, target in DEV_LINKS:
                try:
                    if os.readlink(name, dir_fd=dfd) == target:
                        continue
                    os.unlink(name, dir_fd=dfd)
                except FileNotFoundError:
                    pass
                except OSError:  # not a link: a job's file where the link goes
                    _remove_entry(dfd, name)
                os.symlink(target, name, dir_fd=dfd)
            for name in ("pts", "shm"):
                st = _lstat(dfd, name)
                if st is not None and not stat.S_ISDIR(st.st_mode):
                    _remove_entry(dfd, name)
                    st = None
                if st is None:
                    os.mkdir(name, 0o755, dir_fd=dfd)
        except OSError as exc:
            raise self._fail(f"{exc.filename or '/dev'}: {exc.strerror}") from exc
        finally:
            os.close(dfd)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        if namespaces(host).state(self.env) != m.HELD:
            return  # the namespace is gone, and /dev with it
        with _inside(host, self.env):
            try:
                dev = m.open_mountpoint(self.root, "/dev")
            except OSError:
                return
            with dev:
                top = m.top_mount(dev)
                if top is None or top.fstype != "tmpfs":
                    return  # not envctl's tmpfs
                try:
                    m.detach(dev)  # pts and shm go with it
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOENT):
                        raise self._fail(f"unmount /dev: {exc.strerror}") from exc


def _node_text(kind: int, major: int, minor: int, mode: int, uid: int, gid: int) -> str:
    letter = "b" if kind == stat.S_IFBLK else "c"
    owner = f" uid {uid}" if uid else ""
    return f"{letter} {major}:{minor} {mode:04o}{owner} gid {gid}"


def _lstat(dfd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _remove_entry(dfd: int, name: str) -> None:
    st = _lstat(dfd, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        os.rmdir(name, dir_fd=dfd)  # a job's directory that is not empty stays: an error
    else:
        os.unlink(name, dir_fd=dfd)


def _node_dirs(dev_fd: int) -> list[tuple[str, int]]:
    """("", fd of /dev) and ("nvidia-caps/", its fd) for each node subdirectory there (opened
    without following a symlink); the caller closes the descriptors."""
    out = [("", os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dev_fd))]
    for sub in NODE_SUBDIRS:
        try:
            fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=dev_fd)
        except OSError:
            continue  # absent (or not a directory: a job's file, never followed)
        out.append((sub + "/", fd))
    return out


def _ensure_node(dfd: int, name: str, rdev: int, mode: int, gid: int) -> None:
    """A char device `name` with `rdev`, `mode`, owner 0:`gid`, in the directory `dfd`."""
    st = _lstat(dfd, name)
    if st is not None and not (stat.S_ISCHR(st.st_mode) and st.st_rdev == rdev):
        _remove_entry(dfd, name)  # another node or file under the name: replaced
        st = None
    if st is None:
        os.mknod(name, stat.S_IFCHR | mode, rdev, dir_fd=dfd)
    # Owner and mode are set through a descriptor of the node itself (mknod's mode passed the
    # umask), so a swap in between cannot redirect them.
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not (stat.S_ISCHR(st.st_mode) and st.st_rdev == rdev):
            raise OSError(errno.EEXIST, "replaced while it was being made", name)
        if (st.st_uid, st.st_gid) != (0, gid):
            os.chown(m.fd_path(fd), 0, gid)
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(m.fd_path(fd), mode)
    finally:
        os.close(fd)
