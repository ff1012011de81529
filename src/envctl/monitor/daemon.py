"""`envctl monitor`'s loop: every interval, one tick (sample, health, CSV, textfile, the
/metrics snapshot); between ticks it steps the /metrics connections (monitor/http.py: non-blocking,
each with a deadline). One thread: a selector on the HTTP sockets and a signal wake-up pipe, so a
heal that forks a service supervisor never forks beside another thread, no client can hold the
loop, and SIGTERM ends it between ticks (a heal in progress finishes first).

Kept free of typer and rich; prometheus_client is imported when the monitor starts.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import selectors
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envctl.monitor.collect import Sampler, Snapshot
from envctl.monitor.csvout import CsvWriter
from envctl.monitor.health import Health
from envctl.monitor.notify import Notifier
from envctl.monitor.prom import (
    SnapshotCollector,
    exposition,
    registry_for,
    write_textfile,
)

if TYPE_CHECKING:
    from envctl.monitor.http import MetricsServer

DEFAULT_INTERVAL = 30.0
DEFAULT_CSV_DIR = Path("/var/log/envctl")
# `--once` samples CPU counters, waits this long, then samples again, so that it can say
# percentages (as `top -bn1` needs two reads too).
ONCE_WINDOW = 1.0


@dataclass
class Options:
    """What `envctl monitor` was asked to do."""

    interval: float = DEFAULT_INTERVAL
    once: bool = False
    listen: tuple[str, int] | None = None
    textfile: Path | None = None
    csv_dir: Path | None = DEFAULT_CSV_DIR
    heal: bool = True
    compat: frozenset[str] = frozenset()  # dcgm / cadvisor names besides envctl's own


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Monitor:
    """The sampler, the health loop and the exporters, driven one tick at a time."""

    def __init__(self, host: Any, options: Options, *, sampler: Sampler | None = None,
                 health: Health | bool | None = None,
                 say: Callable[[str], None] | None = None):
        """`health`: None makes the health loop `options` asks for; False runs none (a
        sampling-only monitor: benchmarks, tests)."""
        self.host = host
        self.opts = options
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.sampler = sampler or Sampler.for_host(host, say=self.say)
        if health is None:
            # `monitor --once` without --heal is a probe: drift is said, not logged.
            health = Health(host, heal=options.heal, log=options.heal or not options.once,
                            say=self.say)
        self.health: Health | None = health or None
        self.csv = CsvWriter(options.csv_dir) if options.csv_dir is not None else None
        self.collector = SnapshotCollector(compat=options.compat)
        self.registry = registry_for(self.collector)
        self.server: MetricsServer | None = None
        self.told: set[str] = set()
        self.notifier: Notifier | None = None  # None: the one $NOTIFY_SOCKET names, at run
        self.textfile_id: tuple[int, int] | None = None  # (dev, inode) of the last written
        self.stopping = False

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self.sampler.close()

    def tick(self) -> Snapshot:
        """Sample, check and heal, export. Exporter failures (a full disk) are warnings: the
        next tick tries again."""
        from envctl.errors import EnvctlError

        cpu0 = time.process_time()
        snap = self.sampler.tick()
        cpu_sample = time.process_time() - cpu0
        if self.health is not None:
            snap.health = self.health.run([s.env for s in snap.envs])
            if self.health.healed:
                self.sampler.resample(snap, self.health.healed)
        if snap.gpus and getattr(self.host, "state_dir", None) is not None:
            from envctl.monitor.health import quarantine_gpus

            log = self.health is not None and self.health.log
            snap.quarantined = quarantine_gpus(self.host, snap.gpus, snap.gpu_env, log=log,
                                               say=self.say)
        cpu1 = time.process_time()
        for line in snap.problems:
            if line not in self.told:  # each once, not every 30 s
                self.told.add(line)
                self.say(f"warning: {line}")
        if self.csv is not None:
            try:
                self.csv.write(snap)
            except OSError as exc:
                self.say(f"warning: CSV not written in {self.csv.dir}: {exc.strerror}")
        self.collector.update(snap, tick_cpu_seconds=cpu_sample + time.process_time() - cpu1)
        if self.server is not None:
            self.server.publish(exposition(self.registry))
        if self.opts.textfile is not None:
            try:
                write_textfile(self.opts.textfile, self.registry)
                st = os.stat(self.opts.textfile)
                self.textfile_id = (st.st_dev, st.st_ino)
            except EnvctlError as exc:
                self.say(f"warning: {exc}")
            except OSError:  # gone again at once: nothing of ours to remove at the end
                self.textfile_id = None
        return snap

    def once(self) -> bytes:
        """`--once`: one tick (after a short window for CPU percentages); the exposition."""
        self.sampler.prime()
        time.sleep(ONCE_WINDOW)
        self.tick()
        return exposition(self.registry)

    def serve(self, server: MetricsServer) -> None:
        """Serve /metrics from `server` while `run` loops (the caller made it: a bad address
        or web config is refused before anything starts)."""
        self.server = server
        host, port = server.address
        shown = f"[{host}]" if ":" in host else host
        self.say(f"serving metrics on {server.scheme}://{shown}:{port}/metrics")
        if not _loopback(host):
            # envctl's firewall filters nothing addressed to the host itself (docs/monitoring.md)
            self.say(f"warning: /metrics on {shown}:{port}: every environment reaches it "
                     "through its gateway; bind 127.0.0.1, or use --web-config-file for TLS "
                     "and basic auth")

    def run(self) -> None:
        """Tick every interval until SIGTERM or SIGINT; serve /metrics in between."""
        if self.opts.listen is not None and self.server is None:
            from envctl.monitor.http import MetricsServer

            self.serve(MetricsServer(self.opts.listen))
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_fd = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        old = {s: signal.signal(s, self._on_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        # A daemon allocates every tick: the cyclic collector must run (`envctl` turns it off
        # for its short commands); what the CLI made before is frozen out of its way.
        gc.freeze()
        gc.enable()
        sel = selectors.DefaultSelector()
        sel.register(wake_r, selectors.EVENT_READ, None)
        if self.server is not None:
            self.server.attach(sel)
        notifier = self.notifier or Notifier()
        ready = False
        pinged = 0.0
        polled = time.monotonic()
        # GPU sampling paused by the operator (`envctl maintenance --gpus on`) lets NVML go
        # within PAUSE_POLL between ticks, not only at the next tick (30 s by default).
        from envctl.monitor.nvmlkeep import PAUSE_POLL

        pausable = self.sampler.pausable
        try:
            next_at = time.monotonic()
            while not self.stopping:
                now = time.monotonic()
                if now >= next_at:
                    try:
                        self.tick()
                    except Exception as exc:  # noqa: BLE001 - the daemon outlives one bad tick
                        self.say(f"monitor: tick failed: bug: {exc!r}")
                    if not ready:
                        notifier.send("READY=1")
                        ready = True
                    # Fixed rate; a tick that overran starts the next one at once, no burst.
                    next_at = max(next_at + self.opts.interval, time.monotonic())
                    continue
                wake_at = next_at
                if notifier.watchdog is not None:
                    # The loop turning is the proof of life: a tick (a heal) that hangs stops
                    # it. Pinged at half the watchdog, between ticks too (an interval longer
                    # than WatchdogSec= is no hang).
                    if now - pinged >= notifier.watchdog / 2:
                        notifier.send("WATCHDOG=1")
                        pinged = now
                    wake_at = min(wake_at, pinged + notifier.watchdog / 2)
                if pausable:
                    if now - polled >= PAUSE_POLL:
                        try:
                            self.sampler.poll_pause()
                        except Exception as exc:  # noqa: BLE001 - as a tick's: the loop goes on
                            self.say(f"monitor: GPU pause check failed: bug: {exc!r}")
                        polled = now
                    wake_at = min(wake_at, polled + PAUSE_POLL)
                if self.server is not None:
                    wake_at = min(wake_at, self.server.next_deadline() or wake_at)
                for key, events in sel.select(max(0.0, wake_at - now)):
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError):
                            os.read(wake_r, 512)
                    else:
                        key.data(events)
                if self.server is not None:
                    self.server.expire()
        finally:
            notifier.send("STOPPING=1")
            self._remove_textfile()
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                signal.signal(s, h)
            sel.close()
            os.close(wake_r)
            os.close(wake_w)
            self.close()

    def _remove_textfile(self) -> None:
        """A stopped monitor's textfile would be exported as current by node_exporter for as
        long as it stays: removed, when it is still the file the last tick wrote (something
        that replaced it since is not ours)."""
        path = self.opts.textfile
        if path is None or self.textfile_id is None:
            return
        try:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) == self.textfile_id:
                os.unlink(path)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                self.say(f"warning: metrics textfile {path} not removed: {exc.strerror}")
        self.textfile_id = None

    def _on_stop(self, signum: int, frame: Any) -> None:
        self.stopping = True
