"""Directories envctl owns under its state and runtime bases (per-environment data, run files)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envctl.errors import HostError
from envctl.host.safepath import Escape
from envctl.resources.base import Check, Resource

if TYPE_CHECKING:
    from envctl.host.context import Host

# Directories directly in a base that only root may enter, with their mode: the data a job
# writes (see Directory._close_top).
PRIVATE_TOPS = {("state", "data"): 0o700}


@dataclass(frozen=True)
class Directory(Resource):
    """A directory at `base`/`path` ("state" or "run" base), created with `mode`."""

    kind = "dir"
    volatile = False  # on disk: an old boot's journal still names what `down` must remove
    base: str
    path: str
    mode: int = 0o755
    # A data directory: kept by `down`, empty or not, with the parents made for it (data the
    # user wrote is never deleted by teardown, unless `down --purge` sets
    # host.options["purge"]); the rollback of a failed `up` (host.options["rollback"]) takes
    # back one it made when still empty.
    keep: bool = False
    # The uid and gid that own it (-1: root, as made). An environment's data directories
    # belong to its user namespace's root (runtime.userns), so that root inside may write
    # them: a mount that says so, while every host file owned by root stays out of its reach.
    owner: int = -1

    def ident(self) -> str:
        return f"{self.base}:{self.path}"

    def describe(self) -> str:
        return f"directory <{self.base}>/{self.path}"

    def _path(self, host: Host):
        return host.base(self.base) / self.path

    def check(self, host: Host) -> Check:
        found = _directory(self._path(host))
        if isinstance(found, Check):
            return found
        if self.base == "host":
            # An operator's data path: its mode is the operator's (a shared 1777 scratch
            # directory stays 1777); envctl sets `mode` only on a directory it makes.
            return Check.present()
        want, have = {"mode": oct(self.mode)}, {"mode": oct(found)}
        if self.owner >= 0:
            st = os.stat(self._path(host), follow_symlinks=False)
            want["owner"], have["owner"] = f"{self.owner}:{self.owner}", f"{st.st_uid}:{st.st_gid}"
        top = Path(self.path).parts[0]
        private = PRIVATE_TOPS.get((self.base, top))
        if private is not None:
            # An older envctl made it 0755: drift, which apply tightens (_close_top).
            top_mode = _directory(host.base(self.base) / top)
            want[f"{top} mode"] = oct(private)
            have[f"{top} mode"] = oct(top_mode) if isinstance(top_mode, int) else "?"
        return Check.compare(want, have)

    def snapshot(self, host: Host) -> dict[str, Any]:
        p = self._path(host)
        # Remember which ancestors are missing: removal takes back only what apply made.
        made = []
        q = p
        while not q.exists():
            made.append(str(q))
            q = q.parent
        memo: dict[str, Any] = {"existed": p.is_dir(), "made": made}
        if self.base != "host" and _through_symlink(host.base(self.base), self.path):
            # In envctl's own directories a symlink is somebody's doing (a job writes into
            # its data directories): never followed, never adopted.
            return {"existed": False, "made": [], "symlink": True}
        if memo["existed"] and self.base == "host" and (made := _recorded(host, p)) is not None:
            # Made by an earlier `up` and kept by a plain `down` (a data directory): still
            # envctl's, so that `down --purge` deletes it.
            return {"existed": False, "made": made, "recorded": True}
        if memo["existed"]:
            st = p.stat()
            if self.base != "host":
                # apply may change it: given back. An operator's host directory is never
                # chmodded (its mode is theirs, also when they change it while it is up).
                memo["mode"] = stat.S_IMODE(st.st_mode)
            if self.owner >= 0:
                memo["owner"] = [st.st_uid, st.st_gid]  # so may it the owner
        return memo

    def refuses(self, memo: dict[str, Any]) -> str:
        if memo.get("symlink"):
            return (f"{self._where()} is or goes through a symlink, which envctl does not "
                    "follow in its own directories; remove the symlink")
        return ""

    def _where(self) -> str:
        return f"<{self.base}>/{self.path}"

    def _purged(self, host: Host) -> bool:
        """`down --purge` of a data directory in envctl's own state directory
        (`<state>/data/ENV/…`): deleted with its contents, whether this run or an earlier one
        made it (data directories outlive the journal that made them), then its parents up to
        `data/` as they empty. True when it applied."""
        if not (self._state_data() and host.options.get("purge")):
            return False
        p = self._path(host)
        try:
            # The job wrote in there: every name is hostile (see _remove_beneath).
            _remove_beneath(host.base(self.base), self.path)
        except FileNotFoundError:
            pass
        except Escape as exc:
            raise HostError(f"purge directory '{p}': {self._where()} goes through a symlink, "
                            "which envctl does not follow; refusing") from exc
        except OSError as exc:
            raise HostError(f"purge directory '{p}': {exc.filename or p}: "
                            f"{exc.strerror}") from exc
        for parent in list(Path(self.path).parents)[:len(Path(self.path).parents) - 1]:
            try:
                _remove_beneath(host.base(self.base), str(parent), contents=False)
            except OSError:
                break  # another environment's data, or not ours to judge
        return True

    def _mode_back(self, host: Host, memo: dict[str, Any]) -> tuple[int, int] | None:
        """(now, before) when a directory that existed has another mode than it had."""
        if not memo.get("existed") or memo.get("mode") is None:
            return None
        try:
            now = stat.S_IMODE(self._path(host).stat().st_mode)
        except FileNotFoundError:
            return None
        return None if now == memo["mode"] else (now, memo["mode"])

    def _state_data(self) -> bool:
        """A data directory in envctl's own state directory (`<state>/data/ENV/…`)."""
        return self.keep and self.base == "state" and self.path.startswith("data/")

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        if self.keep and host.options.get("purge"):
            if self._state_data() or not memo.get("existed"):
                return ""  # deleted, contents and all
        elif self.keep and (self._state_data() or not memo.get("existed")):
            # Made by envctl (in this run or an earlier one): data, empty or not.
            return "kept: a data directory (down --purge deletes it)"
        if not memo.get("existed"):
            return ""
        back = self._mode_back(host, memo)
        return "kept: it existed before envctl" + (
            f"; mode {back[0]:04o} -> {back[1]:04o}" if back else "")

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        p = self._path(host)
        if self.base != "host":
            self._apply_beneath(host)
            return
        self._apply_host(p)
        if self.keep and not memo.get("existed") and not memo.get("recorded"):
            _record(host, p, memo.get("made", []))

    def _apply_host(self, p: Path) -> None:
        """An operator's host path (an absolute data source): the part that exists resolved
        through root-controlled directories only (safepath.resolve_root_controlled), the rest
        made one component at a time under that descriptor, through no symlink: a link planted
        in a directory a user writes never makes envctl create or chmod anything elsewhere."""
        from envctl.host.safepath import (
            NotRootControlled,
            fd_path,
            makedirs_beneath,
            resolve_root_controlled,
        )

        try:
            top, missing = resolve_root_controlled(str(p))
            try:
                if missing:
                    fd, _ = makedirs_beneath(top, "/".join(missing), self.mode, symlinks=False)
                else:
                    fd = os.dup(top)
            finally:
                os.close(top)
            try:
                st = os.fstat(fd)
                if not stat.S_ISDIR(st.st_mode):
                    raise FileExistsError(errno.EEXIST, "exists", str(p))
                if missing and stat.S_IMODE(st.st_mode) != self.mode:
                    # Made now: mkdir's mode is filtered by the umask. One that was there is
                    # left as it is (an operator's 1777 scratch directory is not envctl's to
                    # tighten, even for the time it is up).
                    os.chmod(fd_path(fd), self.mode)
            finally:
                os.close(fd)
        except NotRootControlled as exc:
            raise HostError(f"create directory '{p}': {exc.strerror}, which envctl does not go "
                            "through as root; refusing") from exc
        except Escape as exc:
            raise HostError(f"create directory '{p}': a symlink appeared on the way; "
                            "refusing") from exc
        except (FileExistsError, NotADirectoryError) as exc:
            raise HostError(f"create directory '{p}': exists and is not a directory") from exc
        except OSError as exc:
            raise HostError(f"create directory '{p}': {exc.strerror}") from exc

    def _apply_beneath(self, host: Host) -> None:
        """In envctl's state or run directory: made (and its mode set) one component at a time
        beneath the base, through no symlink, so that a symlink a job put in a data directory
        never makes envctl create or chmod anything elsewhere."""
        from envctl.host.safepath import fd_path, makedirs_beneath

        base, p = host.base(self.base), self._path(host)
        try:
            base.mkdir(parents=True, exist_ok=True)
            bfd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fd, _ = makedirs_beneath(bfd, self.path, self.mode, symlinks=False)
            finally:
                os.close(bfd)
            try:
                st = os.stat(fd)
                if stat.S_IMODE(st.st_mode) != self.mode:
                    os.chmod(fd_path(fd), self.mode)
                if self.owner >= 0 and (st.st_uid, st.st_gid) != (self.owner, self.owner):
                    os.chown(fd_path(fd), self.owner, self.owner)
            finally:
                os.close(fd)
            self._close_top(base)
        except Escape as exc:
            raise HostError(f"create directory '{p}': {self._where()} is or goes through a "
                            "symlink, which envctl does not follow; refusing") from exc
        except (FileExistsError, NotADirectoryError) as exc:
            raise HostError(f"create directory '{p}': exists and is not a directory") from exc
        except OSError as exc:
            raise HostError(f"create directory '{p}': {exc.strerror}") from exc

    def _close_top(self, base: Path) -> None:
        """`<state>/data` 0700 (made so, or tightened from an older envctl's 0755): a job
        writes its data directories as any uid it likes, set-id files included, and only root
        may reach them from the host (the job reaches them through its own mounts)."""
        top = Path(self.path).parts[0]
        mode = PRIVATE_TOPS.get((self.base, top))
        if mode is None:
            return
        from envctl.host.safepath import fd_path, open_beneath, opened

        bfd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with opened(open_beneath(bfd, top, os.O_PATH | os.O_DIRECTORY,
                                     symlinks=False)) as fd:
                if stat.S_IMODE(os.stat(fd).st_mode) != mode:
                    os.chmod(fd_path(fd), mode)
        finally:
            os.close(bfd)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        p = self._path(host)
        if self._purged(host):
            return
        if memo.get("existed"):
            # It was there before envctl: leave it, with the mode it had.
            back = self._mode_back(host, memo)
            if self.base != "host" and _through_symlink(host.base(self.base), self.path):
                return  # a symlink now: never followed
            if back:
                try:
                    os.chmod(p, back[1])
                except OSError as exc:
                    raise HostError(f"restore directory '{p}': chmod: {exc.strerror}") from exc
            owner = memo.get("owner")
            if owner and self.owner >= 0:
                try:
                    st = os.stat(p, follow_symlinks=False)
                    if [st.st_uid, st.st_gid] != owner:
                        os.chown(p, owner[0], owner[1], follow_symlinks=False)
                except FileNotFoundError:
                    pass  # gone meanwhile: nothing to give back
                except OSError as exc:
                    raise HostError(f"restore directory '{p}': chown: {exc.strerror}") from exc
            return
        if self.keep and not host.options.get("purge") and not host.options.get("rollback"):
            # A data directory survives `down`, empty or not, with the parents made for it:
            # a job may count on an empty results directory being there at the next `up`.
            # Only the rollback of the `up` that made it (nothing ran there yet) takes it
            # back, when still empty; `down --purge` deletes it.
            return
        try:
            if self.base == "host":
                if memo.get("recorded") and _recorded(host, p) is None:
                    return  # replaced since the record was made: not the directory envctl made
                _remove_host(p, contents=not (self.keep and not host.options.get("purge")))
                _forget(host, p)
            else:
                # In envctl's own directories: through descriptors, never through a symlink.
                _remove_beneath(host.base(self.base), self.path,
                                contents=not (self.keep and not host.options.get("purge")))
        except FileNotFoundError:
            if self.base == "host":
                _forget(host, p)
            # already gone
        except Escape as exc:
            raise HostError(f"remove directory '{p}': {self._where()} goes through a symlink, "
                            "which envctl does not follow; refusing") from exc
        except OSError as exc:
            if not self.keep:
                raise HostError(f"remove directory '{p}': {exc.strerror}") from exc
            # keep=True and not empty: the user's data stays, so does the directory.
            return
        base = host.base(self.base)
        for parent in memo.get("made", [])[1:]:
            try:
                rel = os.path.relpath(parent, base)
                if self.base == "host" or rel == "." or rel.startswith(".."):
                    os.rmdir(parent)  # the base and above: root's alone
                else:
                    _remove_beneath(base, rel, contents=False)
            except OSError:
                break  # not empty (another environment's) or already gone


@dataclass(frozen=True)
class SharedDirectory(Directory):
    """A directory several environments may name (an absolute data source two specs mount):
    held in the ledger, so only the last environment to go removes it, with the memo of the
    first (whether envctl made it), and `down --purge` of one never deletes another's data."""

    kind = "shared-dir"
    shared = True


@dataclass(frozen=True)
class BaseDirectory(Resource):
    """The base directory itself (`run`: /run/envctl) that every environment's directories sit
    in. Shared: the ledger's memo, taken by the first environment, says whether envctl made it
    (and which missing parents), so it goes with the last environment whatever the order they
    go down in, and only when empty; one that existed before envctl stays."""

    kind = "base-dir"
    shared = True
    volatile = False  # on disk or not, an old boot's ledger still names what `down` removes
    base: str
    mode: int = 0o755

    def ident(self) -> str:
        return self.base

    def describe(self) -> str:
        return f"directory <{self.base}>"

    def check(self, host: Host) -> Check:
        found = _directory(host.base(self.base))
        # Its mode is whatever it had or was made with.
        return found if isinstance(found, Check) else Check.present()

    def snapshot(self, host: Host) -> dict[str, Any]:
        made, q = [], host.base(self.base)
        while not q.exists():
            made.append(str(q))
            q = q.parent
        return {"existed": host.base(self.base).is_dir(), "made": made}

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        p = host.base(self.base)
        try:
            p.mkdir(parents=True, exist_ok=True, mode=self.mode)
        except FileExistsError as exc:
            raise HostError(f"create directory '{p}': exists and is not a directory") from exc
        except OSError as exc:
            raise HostError(f"create directory '{p}': {exc.strerror}") from exc

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        # Whether it will be empty cannot be told before the environment's own directory in it
        # goes: only what is certain is said.
        return "kept: it existed before envctl" if memo.get("existed") else ""

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        if memo.get("existed"):
            return  # it was there before envctl: leave it
        for made in memo.get("made", []):
            try:
                os.rmdir(made)
            except FileNotFoundError:
                continue  # already gone
            except OSError:
                break  # not empty: somebody else's files are in it, so it stays


# Host directories envctl made for data mounts (absolute sources) and a plain `down` kept:
# path -> the device and inode it made, and the parents made with it. Kept in the state
# directory, which outlives the journals, so that the next `up` knows them as envctl's.
HOST_DIRS = "host-dirs.json"


def _records(host: Host) -> dict[str, Any]:
    import json

    try:
        data = json.loads((host.state_dir / HOST_DIRS).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_records(host: Host, data: dict[str, Any]) -> None:
    import json

    from envctl.host.files import atomic_write

    path = host.state_dir / HOST_DIRS
    if not data:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    host.state_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(data, indent=1, sort_keys=True).encode(), mode=0o600)


def _recorded(host: Host, p: Path) -> list[str] | None:
    """The parents made with host directory `p` when envctl made it and it is still that
    directory (same device and inode, not a symlink); None otherwise."""
    rec = _records(host).get(str(p))
    if not isinstance(rec, dict):
        return None
    try:
        st = os.lstat(p)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or [st.st_dev, st.st_ino] != rec.get("inode"):
        return None
    made = rec.get("made")
    return [str(m) for m in made] if isinstance(made, list) else [str(p)]


def _record(host: Host, p: Path, made: list[str]) -> None:
    st = os.lstat(p)
    data = _records(host)
    data[str(p)] = {"inode": [st.st_dev, st.st_ino], "made": made or [str(p)]}
    _write_records(host, data)


def _forget(host: Host, p: Path) -> None:
    data = _records(host)
    if data.pop(str(p), None) is not None:
        _write_records(host, data)


def _remove_host(p: Path, *, contents: bool) -> None:
    """Delete host directory `p` (with what is in it when `contents`, else only when
    empty): its parent resolved through root-controlled directories only, every entry below
    through descriptors, never following a symlink (a job wrote in there). A symlink or file
    where the directory was is somebody else's: left alone."""
    from envctl.host.safepath import opened, resolve_root_controlled

    pfd, missing = resolve_root_controlled(str(p.parent))
    with opened(pfd):
        if missing:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(p))
        st = os.stat(p.name, dir_fd=pfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            return
        if contents:
            _empty_at(pfd, p.name, st)
        os.rmdir(p.name, dir_fd=pfd)


def _remove_beneath(base: Path, path: str, *, contents: bool = True) -> None:
    """Delete directory `path` below `base` (with everything in it when `contents`, else only
    when empty), through descriptors alone: its parent is opened beneath `base` with no
    symlink on the way (Escape otherwise), each directory below is opened O_NOFOLLOW relative
    to its parent's descriptor, and every entry is unlinked by name in its parent. A symlink is
    unlinked itself, never followed, so one a job planted anywhere in its data directory (or
    as the directory itself) cannot make envctl delete anything outside it. FileNotFoundError
    when `path` is not there."""
    from envctl.host.safepath import open_beneath, opened

    parent, _, name = path.strip("/").rpartition("/")
    bfd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        pfd = open_beneath(bfd, parent or ".", os.O_PATH | os.O_DIRECTORY, symlinks=False)
    finally:
        os.close(bfd)
    with opened(pfd):
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=pfd)  # a symlink (or file) where the directory was
            return
        if contents:
            _empty_at(pfd, name, st)
        os.rmdir(name, dir_fd=pfd)


def _empty_at(pfd: int, name: str, st: os.stat_result) -> None:
    """Delete what is in directory `name` of `pfd` (lstat'ed as `st`), depth first."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                 dir_fd=pfd)
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            # Swapped between the lstat and the open: a directory, but not the one looked at.
            raise OSError(errno.EBUSY, "replaced while being deleted", name)
        with os.scandir(fd) as entries:
            names = [e.name for e in entries]
        for entry in names:
            try:
                est = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(est.st_mode):
                _empty_at(fd, entry, est)
                os.rmdir(entry, dir_fd=fd)
            else:
                os.unlink(entry, dir_fd=fd)  # files, symlinks (never followed), nodes
    finally:
        os.close(fd)


def _through_symlink(base: Path, path: str) -> bool:
    """Whether `path` below `base`, or a directory on the way to it, is a symlink."""
    q = base
    for part in Path(path).parts:
        q = q / part
        try:
            if stat.S_ISLNK(q.lstat().st_mode):
                return True
        except FileNotFoundError:
            return False
        except OSError:
            return False
    return False


def _directory(p: Path) -> Check | int:
    """The mode bits of directory `p`, or the Check saying it is absent or not a directory."""
    try:
        st = p.lstat()
    except FileNotFoundError:
        return Check.absent()
    if not stat.S_ISDIR(st.st_mode):
        return Check.wrong_kind(f"{p} exists and is not a directory")
    return stat.S_IMODE(st.st_mode)
