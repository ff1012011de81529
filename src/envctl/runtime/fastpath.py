"""How a fast-path command (`exec`, `submit-job`: envctl.entry) ends: as envctl.cli.entry ends
a command (no cyclic GC, no interpreter teardown), expected errors as one line on stderr."""

from __future__ import annotations

import gc
import os
import sys

from envctl.errors import EnvctlError

TYPE_CHECKING = False  # not typing's: the fast paths import nothing they can do without
if TYPE_CHECKING:
    from collections.abc import Callable


def run_fast(call: Callable[[], int]) -> None:
    """Run `call` and leave the process with its exit code; never returns."""
    gc.disable()
    try:
        code = call()
    except EnvctlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader left: the exit code still says how it went
        pass
    os._exit(code)
