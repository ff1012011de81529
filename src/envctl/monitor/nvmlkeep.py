"""The monitor's NVML across its life: a session (monitor/nvml.py) opened at start and opened
again, with backoff and a logged reason, when it could not be opened, when NVML as a whole
fails (a driver unloaded or reloaded: UNINITIALIZED, DRIVER_NOT_LOADED, LIB_RM_VERSION_MISMATCH)
or when every GPU is lost (after `nvidia-smi -r` or a reload they come back). Between attempts
no GPU is sampled and the exports say nothing of GPUs rather than stale values.

Backoff: 10 s after a failure, then 20 s, 40 s … at most 10 min between attempts; a tick that
sampled well resets it. ENVCTL_NVML=off is never retried.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from envctl.monitor.nvml import GpuSample, MigSample, NvmlSession, open_session

BASE_DELAY = 10.0
MAX_DELAY = 600.0


class NvmlKeeper:
    """What Sampler asks of an NvmlSession (`sample()`, `problems`, `close()`), kept alive."""

    def __init__(self, gpu_root: Path, *, mode: str | None = None,
                 opener: Callable[..., tuple[NvmlSession | None, str]] = open_session,
                 clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] | None = None):
        self.gpu_root = gpu_root
        self.mode = mode
        self.opener = opener
        self.clock = clock
        self.say = say or (lambda line: None)
        self.session: NvmlSession | None = None
        self.why = ""  # why there is no session now ("" : no driver, nothing to say)
        self.failures = 0
        self.next_at = 0.0
        self.opened = 0  # sessions opened so far
        self._said = ""  # the last failure said (each once while it repeats)
        self._open()

    @property
    def problems(self) -> list[str]:
        if self.session is not None:
            return self.session.problems
        return [self.why] if self.why else []

    def _open(self) -> None:
        try:
            session, why = self.opener(self.gpu_root, mode=self.mode)
        except Exception as exc:  # noqa: BLE001 - a broken binding must not end the monitor
            session, why = None, f"GPUs not sampled: NVML: bug: {exc!r}"
        if session is not None:
            if self.failures:  # after a failure said: say that it is over
                again = " again" if self.opened else ""
                self.say(f"NVML initialised{again} (driver {session.driver}, "
                         f"{len(session.gpus)} GPU(s))")
            self.session, self.why, self._said = session, "", ""
            self.opened += 1
            return
        self.why = why
        self._backoff(why)

    def _backoff(self, why: str) -> None:
        delay = min(MAX_DELAY, BASE_DELAY * 2 ** self.failures)
        self.failures += 1
        self.next_at = self.clock() + delay
        if why and why != self._said and "ENVCTL_NVML=off" not in why:
            self.say(f"{why}; NVML tried again in {delay:.0f} s, then less and less often")
        self._said = why

    @property
    def migs(self) -> list[MigSample]:
        return self.session.migs if self.session is not None else []

    def sample(self, held: frozenset[str] | set[str] = frozenset()) -> list[GpuSample]:
        if self.session is None:
            if "ENVCTL_NVML=off" in self.why or self.clock() < self.next_at:
                return []
            self._open()
            if self.session is None:
                return []
        try:
            gpus = self.session.sample(held)
            broken = self.session.broken
        except Exception as exc:  # noqa: BLE001 - a binding's surprise costs GPUs, not the tick
            gpus, broken = [], f"bug: {exc!r}"
        lost = bool(gpus) and all(g.lost for g in gpus)
        if not broken and not lost:
            self.failures = 0  # it works: a later failure starts the backoff afresh
            return gpus
        self.close()
        self.why = (f"GPUs not sampled: NVML: {broken or 'every GPU is lost'}: shut down, to "
                    "be initialised again")
        self._backoff(self.why)
        # Every GPU lost: this tick's samples say so (the quarantine reads them); a broken
        # NVML said nothing true of any GPU.
        return gpus if lost and not broken else []

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
