"""The monitor's NVML across its life: a session (monitor/nvml.py) opened at start and opened
again, with backoff and a logged reason, when it could not be opened, when NVML as a whole
fails (a driver unloaded or reloaded: UNINITIALIZED, DRIVER_NOT_LOADED, LIB_RM_VERSION_MISMATCH)
or when every GPU is lost (after `nvidia-smi -r` or a reload they come back). Between attempts
no GPU is sampled and the exports say nothing of GPUs rather than stale values.

Backoff: 10 s after a failure, then 20 s, 40 s … at most 10 min between attempts; a tick that
sampled well resets it. ENVCTL_NVML=off is never retried.

Paused by the operator: while `<run>/maintenance.d/@gpus` exists (`envctl maintenance --gpus
on`) the session is shut down (nvmlShutdown: NVML closes every GPU node it opened) and no GPU is
sampled, so `nvidia-smi -r`, a MIG mode change or a driver reload finds no envctl handle. The
monitor looks for the mark at every tick and, between ticks, every PAUSE_POLL seconds
(`poll_pause`); once it is gone the next tick opens NVML again. NVML stays open otherwise, on
purpose: without the persistence daemon the driver tears a GPU's state down when its last
client closes (seconds to bring back, volatile ECC counts reset), and XID events that arrive
while no event set is registered are never seen.

While it holds a session the keeper says so in `<run>/nvml-held.d/<pid>` ({"pid", "start": the
process's start time in clock ticks since boot, as /proc/PID/stat field 22}), removed when it
lets go: `envctl maintenance --gpus on` waits until none is left. One file per process: the
monitor, `envctl top` and `monitor --once` each hold NVML and each honour the pause.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envctl.monitor.nvml import GpuSample, MigSample, NvmlSession, open_session

BASE_DELAY = 10.0
MAX_DELAY = 600.0
PAUSE_POLL = 1.0  # seconds between two looks for the pause mark between ticks
HELD = "nvml-held.d"  # in the run directory (a dot: never an environment's name)


def start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot, /proc/PID/stat field 22), None
    when it does not exist: with the pid, who it is (a pid alone may have been reused)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: split after its end
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def holders(run_dir: Path) -> list[int]:
    """The pids of the processes holding NVML through a keeper now, per `<run>/nvml-held.d/`
    (a file whose process is gone, or is another one by now, does not count)."""
    import json

    try:
        names = os.listdir(run_dir / HELD)
    except OSError:
        return []
    out = []
    for name in sorted(names):
        try:
            rec = json.loads((run_dir / HELD / name).read_text())
            pid, start = int(rec["pid"]), rec["start"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if start is not None and start_time(pid) == start:
            out.append(pid)
    return out


class NvmlKeeper:
    """What Sampler asks of an NvmlSession (`sample()`, `problems`, `close()`), kept alive."""

    def __init__(self, gpu_root: Path, *, mode: str | None = None,
                 opener: Callable[..., tuple[NvmlSession | None, str]] = open_session,
                 clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] | None = None, run_dir: Path | None = None):
        """`run_dir`: where the pause mark is looked for and nvml-held.d/<pid> written (None:
        the keeper cannot be paused; tests, benchmarks)."""
        self.gpu_root = gpu_root
        self.run_dir = run_dir
        self.paused: dict[str, Any] | None = None  # the pause mark while paused
        self.releases = 0  # sessions shut down for a pause
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
        self._held_said = False  # nvml-held.d/<pid> written for the session open now
        if not self.poll_pause():  # started paused: NVML is not opened at all
            self._open()

    @property
    def problems(self) -> list[str]:
        if self.paused is not None:
            return [_paused_line(self.paused)]
        if self.session is not None:
            return self.session.problems
        return [self.why] if self.why else []

    @property
    def pausable(self) -> bool:
        return self.run_dir is not None

    def poll_pause(self) -> bool:
        """Look for the pause mark: shut NVML down when it appeared, let the next sample open
        it again when it went. Whether sampling is paused now."""
        if self.run_dir is None:
            return False
        from envctl.monitor import maintenance

        mark = maintenance.read(self.run_dir, maintenance.GPUS)
        if mark is not None and self.paused is None:
            self.paused = mark
            if self.session is not None:
                self.close()
                self.releases += 1
            self.say(f"{_paused_line(mark)}: no GPU node is held by the monitor")
        elif mark is None and self.paused is not None:
            self.paused = None
            self.failures, self.next_at, self._said = 0, 0.0, ""  # open at the next tick
            self.say("GPU sampling resumed (envctl maintenance --gpus off): NVML opened at "
                     "the next tick")
        return self.paused is not None

    def _open(self) -> None:
        # Said before the open, which takes from 0.1 s to seconds on real GPUs: a
        # `maintenance --gpus on` meanwhile waits for it instead of finding no holder.
        self._say_held(True)
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
            self.poll_pause()  # the mark came while it opened: let go at once
            return
        self._say_held(False)
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
        if self.poll_pause():
            return []
        if self.session is not None and not self._held_said and self.run_dir is not None:
            self._say_held(True)  # the run directory was not there when NVML was opened
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
            self._say_held(False)

    def _say_held(self, held: bool) -> None:
        """`<run>/nvml-held.d/<pid>` written (held) or removed (and the directory with the last
        one). Only in a run directory that exists (the monitor makes none: with no environment
        up there may be none; `sample` writes it once one appears); one that cannot be written
        (`envctl top` as a plain user) costs only `maintenance --gpus on` its wait."""
        self._held_said = False
        if self.run_dir is None:
            return
        from envctl.host.files import write_json

        path = self.run_dir / HELD / str(os.getpid())
        with contextlib.suppress(OSError):
            if held:
                if self.run_dir.is_dir():
                    write_json(path, {"pid": os.getpid(), "start": start_time(os.getpid())},
                               durable=False)
                    self._held_said = True
            else:
                path.unlink()
                path.parent.rmdir()  # ENOTEMPTY: another process holds NVML too: kept


def _paused_line(mark: dict[str, Any]) -> str:
    since = mark.get("since")
    when = (" since " + time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(since))
            if isinstance(since, int | float) else "")
    return f"GPU sampling paused{when} (envctl maintenance --gpus on): NVML shut down"
