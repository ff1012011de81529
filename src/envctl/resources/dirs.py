"""Directories envctl owns under its state and runtime bases (per-environment data, run files)."""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
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
    # Keep the contents on removal (data the user wrote is never deleted by teardown).
    keep: bool = False

    def ident(self) -> str:
        return f"{self.base}:{self.path}"

    def describe(self) -> str:
        return f"directory <{self.base}>/{self.path}"

    def _path(self, host: Host):
        return host.base(self.base) / self.path

    def check(self, host: Host) -> Check:
        p = self._path(host)
        try:
            st = p.lstat()
        except FileNotFoundError:
            return Check.absent()
        if not stat.S_ISDIR(st.st_mode):
            return Check.wrong_kind(f"{p} exists and is not a directory")
        return Check.compare({"mode": oct(self.mode)}, {"mode": oct(stat.S_IMODE(st.st_mode))})

    def snapshot(self, host: Host) -> dict[str, Any]:
        p = self._path(host)
        # Remember which ancestors are missing: removal takes back only what apply made.
        made = []
        q = p
        while not q.exists():
            made.append(str(q))
            q = q.parent
        return {"existed": p.is_dir(), "made": made}

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        p = self._path(host)
        try:
            p.mkdir(parents=True, exist_ok=True, mode=self.mode)
            if stat.S_IMODE(p.stat().st_mode) != self.mode:
                os.chmod(p, self.mode)  # mkdir's mode is filtered by the umask
        except FileExistsError as exc:
            raise HostError(f"create directory '{p}': exists and is not a directory") from exc
        except OSError as exc:
            raise HostError(f"create directory '{p}': {exc.strerror}") from exc

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        if memo.get("existed"):
            return  # it was there before envctl: leave it
        p = self._path(host)
        try:
            if self.keep:
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
