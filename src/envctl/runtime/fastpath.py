"""How a fast-path command (`exec`, `submit-job`: envctl.entry) ends: as envctl.cli.entry ends
a command (no cyclic GC, no interpreter teardown), expected errors as one line on stderr."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable

from envctl.errors import EnvctlError


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
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
