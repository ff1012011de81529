"""An attacker's review of session 33's new code, the second one (no root needed): the
/metrics server's per-source limits. See tests/integration/test_attacks_s33b.py for the rest.

`ATTACK (open)`: xfail(strict=True), the fix still to make (its reason says what it is).
"""

from __future__ import annotations

import contextlib
import threading

import pytest

from envctl.monitor import http as mhttp
from tests.unit.test_monitor_http import BODY, _from, _raw_get, _serve_in_thread


@pytest.mark.xfail(strict=True, reason="a source is an address, and every local user holds "
                   "all of 127.0.0.0/8: one connection from each of many addresses ties "
                   "every source at one, and the tie closes the oldest, a scraper's. The fix: "
                   "a loopback peer counted per local uid (the socket's owner, sock_diag or "
                   "/proc/net/tcp's inode), not per address; and the bcrypt share alike")
def test_a_local_user_on_many_loopback_addresses_does_not_evict_a_scrape():
    """ATTACK (open): MAX_PER_SOURCE keeps one source's flood to its own connections, but a
    local user picks any of the 16 million loopback addresses as a connection's source
    (bind(127.x.y.z) before connect: no privilege). One connection each from 127.0.0.2 on,
    opened after the scraper connected and before it sent its request: the table full, each
    new one closes the oldest connection of the sources holding the most (all hold one), the
    scraper's first."""
    server = mhttp.MetricsServer(("127.0.0.1", 0), max_connections=8, max_per_source=2)
    server.publish(BODY)
    port = server.address[1]
    stop = threading.Event()
    t = _serve_in_thread(server, stop)
    scraper = _from("127.0.0.1", port)
    flood = []
    try:
        for i in range(2, 22):
            flood.append(_from(f"127.0.0.{i}", port))
        answer = b"closed by the server"
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            answer = _raw_get(scraper)
        assert answer.startswith(b"HTTP/1.1 200 OK"), answer[:200]
    finally:
        for s in [scraper, *flood]:
            s.close()
        stop.set()
        t.join(10)
        server.close()
