"""Signals while envctl changes the host: SIGTERM and SIGHUP interrupt like Ctrl-C, so `up`
rolls back instead of dying half-way, and no signal cuts a rollback or a journal fold short."""

from __future__ import annotations

import contextlib
import signal

from envctl.host.libc import signals_held

# What an operator, systemd (stop, shutdown) or a closed terminal sends.
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """The process was asked to stop (`signum`); raised where it was, like Ctrl-C."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def interruptible() -> None:
    """From now on SIGTERM and SIGHUP raise Interrupted like SIGINT (main thread only)."""
    for sig in STOPPING:
        signal.signal(sig, _raise)


def deferred() -> contextlib.AbstractContextManager[None]:
    """Hold signals until the block is done (a rollback, a fold): a second Ctrl-C must not
    leave the host half rolled back. They arrive when it ends."""
    return signals_held()
