"""sd_notify(3) for the monitor under `Type=notify`: READY=1 once the first tick is done,
WATCHDOG=1 while its loop turns (`WatchdogSec=`: a tick, a heal, that hangs stops the pings
and systemd restarts the monitor), STOPPING=1 on the way out. A few lines of datagram socket,
no dependency; nothing at all where $NOTIFY_SOCKET is not set.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import MutableMapping


class Notifier:
    """The service manager's notification socket, taken out of the environment at start (as
    sd_notify's unset_environment does) so that no service supervisor the monitor forks, nor
    its service, can speak for the monitor."""

    def __init__(self, environ: MutableMapping[str, str] = os.environ):
        addr = environ.pop("NOTIFY_SOCKET", "")
        usec = environ.pop("WATCHDOG_USEC", "")
        pid = environ.pop("WATCHDOG_PID", "")
        # "@name" is an abstract socket; anything else a path.
        self.addr = ("\0" + addr[1:] if addr.startswith("@") else addr) or None
        self.watchdog: float | None = None  # seconds; ping at least every half of it
        if self.addr and usec.isdigit() and int(usec) > 0 and (
                not pid or pid == str(os.getpid())):
            self.watchdog = int(usec) / 1e6

    def send(self, text: str) -> None:
        """Tell the service manager `text` ("READY=1"); a manager that went away is no
        reason to stop monitoring."""
        if self.addr is None:
            return
        with contextlib.suppress(OSError), \
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(text.encode(), self.addr)
