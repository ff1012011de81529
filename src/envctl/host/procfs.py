"""Sysctl values under /proc/sys: read and write, errors translated to HostError."""

from __future__ import annotations

from pathlib import Path

from envctl.errors import HostError
from envctl.spec.sysctls import proc_path


def sysctl_path(proc_root: Path, name: str) -> Path:
    """The file of sysctl `name` (either of sysctl(8)'s spellings, or a known alias)."""
    return proc_root / "sys" / proc_path(name)


def normalize(value: str) -> str:
    """Compare sysctl values the way the kernel prints them: whitespace runs become one tab."""
    return "\t".join(value.split())


class Sysctls:
    def __init__(self, proc: Path):
        self.proc = proc

    def path(self, name: str) -> Path:
        return sysctl_path(self.proc, name)

    def read(self, name: str) -> str | None:
        """The current value, or None when this kernel has no such sysctl."""
        try:
            return normalize(self.path(name).read_text())
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HostError(f"read sysctl '{name}': {exc.strerror}") from exc

    def write(self, name: str, value: str) -> None:
        try:
            with open(self.path(name), "w") as f:
                f.write(value)
        except OSError as exc:
            raise HostError(f"set sysctl '{name}' to '{value}': {exc.strerror}") from exc
