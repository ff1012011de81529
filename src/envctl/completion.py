"""Shell completion candidates (bash, zsh, fish through typer's `--install-completion`):
environment names from the config directory's specs and the state directory's journals, and
job ids from the job records.

A shell runs these at every Tab, as whoever types: no root is needed and nothing can fail
loudly. An unreadable directory or file gives no candidates, never an error; nothing is
written; no spec is parsed (a regex reads each spec's `name:` line: pydantic and YAML would
cost a Tab ~300 ms)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from envctl.runtime.context import config_dir  # the rule, without the workspace

# envctl.host.context's default, without its imports (a unit test keeps them in step).
DEFAULT_STATE_DIR = Path("/var/lib/envctl")
# A spec's top-level `name: X` (quoted or not, a comment after it allowed).
_NAME_LINE = re.compile(r"""^name:[ \t]*["']?([A-Za-z0-9][A-Za-z0-9_.-]*)["']?[ \t]*(?:#.*)?$""",
                        re.MULTILINE)
_JOB_RECORD = re.compile(r"([0-9]+)\.json")
# More than this many specs, journals or records are not read for their names or states.
MOST = 5000


def state_dir() -> Path:
    return Path(os.environ.get("ENVCTL_STATE_DIR") or DEFAULT_STATE_DIR)


def _entries(d: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(d) as it:
            return [e for _, e in zip(range(MOST), it, strict=False)]
    except OSError:
        return []


def spec_names(directory: Path) -> set[str]:
    """The names the specs in `directory` give themselves (the file's stem when its `name:`
    line cannot be read)."""
    names = set()
    for e in _entries(directory):
        if not e.name.endswith((".yaml", ".yml")):
            continue
        stem = e.name.rsplit(".", 1)[0]
        try:
            with open(e.path, encoding="utf-8", errors="replace") as f:
                found = _NAME_LINE.search(f.read(65536))
        except OSError:
            found = None
        names.add(found.group(1) if found else stem)
    return names


def journal_names(state: Path) -> set[str]:
    """Environments with a journal (up, or left half-down): `down` and `status` take them."""
    return {e.name[:-5] for e in _entries(state / "journal")
            if e.name.endswith(".json") and not e.name.startswith(".")}


def typed_config_dir(environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """The --config-dir/-C of the command line being completed, wherever it stands in it
    (`envctl up -C DIR <Tab>`: after the subcommand, where envctl takes it too, and where
    click does not see it): from the words the shell passes (bash's COMP_WORDS, zsh's and
    fish's _TYPER_COMPLETE_ARGS)."""
    import shlex

    text = environ.get("COMP_WORDS") or environ.get("_TYPER_COMPLETE_ARGS") or ""
    try:
        words = shlex.split(text)
    except ValueError:  # an open quote: the word being typed
        words = text.split()
    found = None
    for i, word in enumerate(words):
        if word in ("-C", "--config-dir") and i + 1 < len(words):
            found = words[i + 1]
        elif word.startswith("--config-dir="):
            found = word.split("=", 1)[1]
    return found


def environments(incomplete: str, *, explicit_config: str | None = None) -> list[str]:
    """Environment names starting with `incomplete`, sorted."""
    try:
        explicit_config = explicit_config or typed_config_dir()
        names = spec_names(config_dir(explicit_config)) | journal_names(state_dir())
    except Exception:  # noqa: BLE001 - a Tab must never print a traceback
        return []
    return sorted(n for n in names if n.startswith(incomplete))


def jobs(incomplete: str, *, active_only: bool = False) -> list[tuple[str, str]]:
    """(id, "NAME ENV STATE") of the job records whose id starts with `incomplete`, newest
    first; with `active_only`, those PENDING or RUNNING (what `cancel` and `wait` are for).
    A record that cannot be read is offered without a description (or left out when only
    active ones are asked for)."""
    import json

    try:
        ids = sorted((int(m.group(1)) for e in _entries(state_dir() / "jobs")
                      if (m := _JOB_RECORD.fullmatch(e.name))), reverse=True)
        out = []
        for jid in ids:
            if not str(jid).startswith(incomplete):
                continue
            try:
                raw = json.loads((state_dir() / "jobs" / f"{jid}.json").read_bytes())
                what = f"{raw.get('name') or '-'} {raw.get('env')} {raw.get('state')}"
                active = raw.get("state") in ("PENDING", "RUNNING")
            except (OSError, ValueError, AttributeError):
                what, active = "", False
            if active or not active_only:
                out.append((str(jid), what))
            if len(out) >= MOST:
                break
        return out
    except Exception:  # noqa: BLE001 - a Tab must never print a traceback
        return []
