"""Directories envctl owns under its state and runtime bases (per-environment data, run files)."""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envctl.errors import HostError
from envctl.resources.base import Check, Resource

if TYPE_CHECKING:
    from envctl.host.context import Host


@dataclass(frozen=True)
class Directory(Resource):
    """A directory at `base`/`path` ("state" or "run" base), created with `mode`."""

    kind = "dir"
    volatile = False  # on disk: an old boot's journal still names what `down` must remove
    base: str
    path: str
    mode: int = 0o755
    # Keep the contents on removal (data the user wrote is never deleted by teardown, unless
    # `down --purge` sets host.options["purge"]).
    keep: bool = False

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
        return Check.compare({"mode": oct(self.mode)}, {"mode": oct(found)})

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
        if memo["existed"]:
            memo["mode"] = stat.S_IMODE(p.stat().st_mode)  # apply may change it: given back
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
        if not (self.keep and host.options.get("purge") and self.base == "state"
                and self.path.startswith("data/")):
            return False
        p = self._path(host)
        try:
            if p.is_symlink():
                p.unlink()  # never followed out of the state directory
            else:
                shutil.rmtree(p)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise HostError(f"purge directory '{p}': {exc.strerror}") from exc
        for parent in list(p.parents)[:len(Path(self.path).parents) - 1]:
            try:
                parent.rmdir()
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

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        if not memo.get("existed"):
            if self.keep and not host.options.get("purge"):
                try:
                    if any(os.scandir(self._path(host))):
                        return "kept: it holds data (down --purge deletes it)"
                except OSError:
                    pass
            return ""
        back = self._mode_back(host, memo)
        return "kept: it existed before envctl" + (
            f"; mode {back[0]:04o} -> {back[1]:04o}" if back else "")

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        p = self._path(host)
        if self.base != "host":
            self._apply_beneath(host)
            return
        try:
            p.mkdir(parents=True, exist_ok=True, mode=self.mode)
            if stat.S_IMODE(p.stat().st_mode) != self.mode:
                os.chmod(p, self.mode)  # mkdir's mode is filtered by the umask
        except FileExistsError as exc:
            raise HostError(f"create directory '{p}': exists and is not a directory") from exc
        except OSError as exc:
            raise HostError(f"create directory '{p}': {exc.strerror}") from exc

    def _apply_beneath(self, host: Host) -> None:
        """In envctl's state or run directory: made (and its mode set) one component at a time
        beneath the base, through no symlink, so that a symlink a job put in a data directory
        never makes envctl create or chmod anything elsewhere."""
        from envctl.host.safepath import Escape, fd_path, makedirs_beneath

        base, p = host.base(self.base), self._path(host)
        try:
            base.mkdir(parents=True, exist_ok=True)
            bfd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fd, _ = makedirs_beneath(bfd, self.path, self.mode, symlinks=False)
            finally:
                os.close(bfd)
            try:
                if stat.S_IMODE(os.stat(fd).st_mode) != self.mode:
                    os.chmod(fd_path(fd), self.mode)
            finally:
                os.close(fd)
        except Escape as exc:
            raise HostError(f"create directory '{p}': {self._where()} is or goes through a "
                            "symlink, which envctl does not follow; refusing") from exc
        except (FileExistsError, NotADirectoryError) as exc:
            raise HostError(f"create directory '{p}': exists and is not a directory") from exc
        except OSError as exc:
            raise HostError(f"create directory '{p}': {exc.strerror}") from exc

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        p = self._path(host)
        if self._purged(host):
            return
        if memo.get("existed"):
            # It was there before envctl: leave it, with the mode it had.
            back = self._mode_back(host, memo)
            if back and not (self.base != "host"
                             and _through_symlink(host.base(self.base), self.path)):
                try:
                    os.chmod(p, back[1])
                except OSError as exc:
                    raise HostError(f"restore directory '{p}': chmod: {exc.strerror}") from exc
            return
        try:
            if self.keep and not host.options.get("purge"):
                os.rmdir(p)
            else:
                shutil.rmtree(p)
        except FileNotFoundError:
            pass  # already gone
        except OSError as exc:
            if not self.keep:
                raise HostError(f"remove directory '{p}': {exc.strerror}") from exc
            # keep=True and not empty: the user's data stays, so does the directory.
            return
        for parent in memo.get("made", [])[1:]:
            try:
                os.rmdir(parent)
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
