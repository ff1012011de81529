"""Reading what gVisor's runsc on this host offers (its path, version, platforms, --nvproxy):
the fact `isolation: gvisor` is planned against. Read-only: it runs `runsc --version` and
`runsc flags`, which print and change nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from envctl.facts import RunscFacts

# The Debian package that ships runsc, named in plan errors.
PACKAGE = "runsc"
# `-platform string` is followed by its help: "specifies which platform to use: ptrace
# (default), kvm." (2022), "…: systrap (default), ptrace, kvm." (2023 on).
_PLATFORM_HELP = re.compile(r"^\s*-platform\b.*?\n\s*(.*?)$", re.M)
_WORD = re.compile(r"\b(ptrace|kvm|systrap)\b")


def runsc_path() -> str:
    """The runsc to run: $ENVCTL_RUNSC, else `runsc` on PATH; "" when there is none."""
    explicit = os.environ.get("ENVCTL_RUNSC", "")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else ""
    return shutil.which("runsc") or ""


def parse_platforms(flags_help: str) -> tuple[str, ...]:
    """The platforms `runsc flags` lists in --platform's help, in its order."""
    m = _PLATFORM_HELP.search(flags_help)
    if m is None:
        return ()
    return tuple(dict.fromkeys(_WORD.findall(m.group(1).split("(default \"")[0])))


def read_runsc() -> RunscFacts:
    """What the host's runsc offers; RunscFacts(path="") when it is not installed."""
    path = runsc_path()
    if not path:
        return RunscFacts()
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=10, check=False).stdout
        flags = subprocess.run([path, "flags"], capture_output=True, text=True, timeout=10,
                               check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return RunscFacts(path=path, problem=f"run {path}: {exc}")
    text = flags.stdout + flags.stderr  # Go's flag package prints its help on stderr
    platforms = parse_platforms(text)
    return RunscFacts(path=path, version=(version.splitlines() or [""])[0].strip(),
                      platforms=platforms,
                      nvproxy=re.search(r"^\s*-nvproxy\b", text, re.M) is not None,
                      problem="" if platforms else f"`{path} flags` lists no --platform")
