"""Whether an environment name is known here (a spec of the config directory, or up with a
journal): the one check behind exit 2 for a typo, shared by the CLI's in-process commands and
the daemon's handlers. Light: the specs are loaded only for a name no journal knows."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def require_known(names: list[str], host: Any, ws: Any = None,
                  config_dir: str | None = None) -> None:
    """UsageError (exit 2) naming the names that are neither a spec nor an environment with a
    journal: `status --check typo` must not report healthy, `down typo` must not report
    success, `jobs typo` must not print an empty table. `ws` is a workspace already open;
    else the specs of `config_dir` (the one rule: envctl.runtime.context.config_dir)."""
    from envctl.engine.journal import Journal, journal_path
    from envctl.errors import EnvctlError, UsageError

    for n in names:
        journal_path(host.state_dir, n)  # a name no environment can have: say so first
    up = set(Journal.environments(host.state_dir))
    unknown = [n for n in names if n not in up]
    if not unknown:
        return
    if ws is None:  # `down`, `jobs` load specs only now, for names no journal knows
        from envctl.workspace import Workspace
        from envctl.workspace import config_dir as default_dir

        try:
            ws = Workspace.open(default_dir(config_dir), pure=True)
        except EnvctlError:
            ws = None
    specs = set(ws.names()) if ws is not None else set()
    unknown = [n for n in unknown if n not in specs]
    if unknown:
        known = ", ".join(sorted(up | specs)) or "none"
        raise UsageError(f"no environment {', '.join(repr(n) for n in unknown)}: not in the "
                         f"config directory and not up on this host (known: {known})")
