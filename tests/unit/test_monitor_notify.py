"""sd_notify of the monitor against a fake $NOTIFY_SOCKET (a datagram socket this test binds):
READY=1 after the first tick, WATCHDOG=1 at half the watchdog period, between ticks too,
STOPPING=1 at SIGTERM; the variables are taken out of the environment (nothing the monitor
forks can speak for it); an abstract address works; no socket, nothing sent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from envctl.monitor.notify import Notifier

REPO = Path(__file__).resolve().parents[2]

MONITOR = """
import os, sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.unit.test_monitor import fake_host_again
from envctl.monitor.daemon import Monitor, Options

fh, sampler = fake_host_again(Path({root!r}))

class Timed(Monitor):
    def tick(self):
        print("tick", time.monotonic(), flush=True)
        return super().tick()

mon = Timed(None, Options(interval=2.0, csv_dir=None), sampler=sampler, health=False)
mon.run()
print("env", "NOTIFY_SOCKET" in os.environ or "WATCHDOG_USEC" in os.environ, flush=True)
"""


def test_ready_after_the_first_tick_watchdog_between_ticks_stopping_at_the_end(tmp_path):
    from tests.unit.test_monitor import fake_host

    fake_host(tmp_path, 1)
    addr = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(addr)
    sock.settimeout(10)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "NOTIFY_SOCKET": addr,
           "WATCHDOG_USEC": "400000"}
    proc = subprocess.Popen([sys.executable, "-c", MONITOR.format(repo=str(REPO),
                                                                  root=str(tmp_path))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    got: list[tuple[float, str]] = []
    try:
        while len([m for _, m in got if m == "WATCHDOG=1"]) < 8:
            got.append((time.monotonic(), sock.recv(100).decode()))
        proc.send_signal(signal.SIGTERM)
        got.append((time.monotonic(), sock.recv(100).decode()))
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()
    assert proc.returncode == 0, err
    msgs = [m for _, m in got]
    assert msgs[0] == "READY=1" and msgs[-1] == "STOPPING=1", msgs
    assert out.count("tick") >= 1 and "READY=1" not in msgs[1:]
    # Interval 2 s, watchdog 0.4 s: 8 pings came within a few ticks, so between ticks too.
    pings = [t for t, m in got if m == "WATCHDOG=1"]
    assert pings[-1] - pings[0] < 3 * 2.0, pings
    assert out.strip().endswith("env False")  # taken out of the environment


def test_abstract_address_and_no_socket(tmp_path):
    name = f"envctl-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        environ = {"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "3000000",
                   "WATCHDOG_PID": str(os.getpid())}
        n = Notifier(environ)
        assert environ == {} and n.watchdog == 3.0
        n.send("WATCHDOG=1")
        assert sock.recv(100) == b"WATCHDOG=1"
    finally:
        sock.close()
    other = Notifier({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "5", "WATCHDOG_PID": "1"})
    assert other.watchdog is None  # the watchdog is another process's
    quiet = Notifier({})
    assert quiet.addr is None and quiet.watchdog is None
    quiet.send("READY=1")  # nothing to send to: nothing happens
