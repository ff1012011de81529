"""/metrics (monitor/http.py, monitor/webconfig.py) against real clients on loopback: a client
that trickles bytes costs only its own connection (the monitor's ticks keep their period and
SIGTERM ends it), connections are bounded, TLS (python's ssl and curl) with basic auth, client
certificates, and the web config file's refusals."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest

from envctl.errors import InputError
from envctl.monitor import http as mhttp
from envctl.monitor import webconfig

REPO = Path(__file__).resolve().parents[2]
BODY = b"# HELP envctl_x A test gauge.\n# TYPE envctl_x gauge\nenvctl_x 1.0\n"



def _serve_in_thread(server: mhttp.MetricsServer, stop: threading.Event) -> threading.Thread:
    t = threading.Thread(target=mhttp.serve_until, args=(server, stop.is_set, 60), daemon=True)
    t.start()
    return t


def _get(url: str, *, ctx: ssl.SSLContext | None = None, auth: tuple[str, str] | None = None,
         timeout: float = 10) -> tuple[int, bytes]:
    req = urllib.request.Request(url)
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(
            f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# ---------------------------------------------------------------- a client that trickles


MONITOR = """
import sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.unit.test_monitor import fake_host_again
from envctl.monitor.daemon import Monitor, Options
from envctl.monitor.http import MetricsServer

fh, sampler = fake_host_again(Path({root!r}))

class Timed(Monitor):
    def tick(self):
        print(time.monotonic(), flush=True)
        return super().tick()

mon = Timed(None, Options(interval=0.2, csv_dir=None), sampler=sampler, health=False)
mon.serve(MetricsServer(("127.0.0.1", 0), deadline=1.5))
mon.run()
print("stopped", flush=True)
"""


def test_a_trickling_client_costs_only_its_connection(tmp_path):
    from tests.unit.test_monitor import fake_host

    fake_host(tmp_path, 1)
    proc = subprocess.Popen([sys.executable, "-c", MONITOR.format(repo=str(REPO),
                                                                  root=str(tmp_path))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    try:
        line = proc.stderr.readline()
        assert "serving metrics on http://127.0.0.1:" in line, line + proc.stderr.read()
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        # Three clients that send a request one byte every 0.4 s, never finishing it.
        tricklers = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        for i in range(12):
            for s in tricklers:
                with contextlib.suppress(OSError):  # closed at its deadline: EPIPE, reset
                    s.send(b"GET /metrics HTTP/1.1\r\n"[i:i + 1])
            if i == 4:  # meanwhile a real scrape is answered at once
                status, body = _get(f"http://127.0.0.1:{port}/metrics", timeout=5)
                assert status == 200 and b"envctl_monitor_ticks_total" in body
            time.sleep(0.4)
        for s in tricklers:  # 4.8 s on, each was closed at its deadline (1.5 s)
            s.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(100) == b""
            s.close()
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=10)
        assert time.monotonic() - sent < 2.0, err  # SIGTERM ends it promptly
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    ticks = [float(x) for x in out.split() if x != "stopped"]
    assert out.strip().endswith("stopped")
    assert len(ticks) >= 15, out
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    # Period 0.2 s: a client holding the loop (the old single-threaded server) made gaps of
    # seconds; a loaded 2-core VM may add some tenths, never a trickler's 1.5 s.
    assert max(gaps) < 1.0, gaps


def test_connections_are_bounded_and_the_oldest_makes_room():
    server = mhttp.MetricsServer(("127.0.0.1", 0), max_connections=4)
    server.publish(BODY)
    port = server.address[1]
    stop = threading.Event()
    t = _serve_in_thread(server, stop)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
    try:
        status, body = _get(f"http://127.0.0.1:{port}/metrics")
        assert (status, body) == (200, BODY)
        idle[0].settimeout(5)
        assert idle[0].recv(10) == b""  # the oldest was closed to make room
        assert len(server.conns) <= 4
        assert _get(f"http://127.0.0.1:{port}/nothing")[0] == 404
    finally:
        for s in idle:
            s.close()
        stop.set()
        t.join(10)
        server.close()


def test_a_request_too_large_or_not_a_get_is_refused():
    server = mhttp.MetricsServer(("127.0.0.1", 0))
    server.publish(BODY)
    stop = threading.Event()
    t = _serve_in_thread(server, stop)
    try:
        with socket.create_connection(server.address, timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 10000 + b"\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 431 ")
        with socket.create_connection(server.address, timeout=5) as s:
            s.sendall(b"POST /metrics HTTP/1.1\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 405 ")
    finally:
        stop.set()
        t.join(10)
        server.close()


# ---------------------------------------------------------------- TLS and basic auth


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all from it."""
    d = tmp_path_factory.mktemp("pki")

    def ossl(*args):
        res = subprocess.run(["openssl", *args], cwd=d, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
         "-days", "2", "-subj", "/CN=envctl test CA")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"),
                      ("client", "extendedKeyUsage=clientAuth")):
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
             f"{name}.csr", "-subj", f"/CN={name}")
        (d / f"{name}.ext").write_text(ext + "\n")
        ossl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")
    for f in d.iterdir():
        f.chmod(0o600 if f.suffix == ".key" else 0o644)
    return d


def _web(pki: Path, text: str) -> Path:
    path = pki / "web.yml"
    path.write_text(text)
    path.chmod(0o600)
    return path


def _tls_server(cfg: webconfig.WebConfig) -> mhttp.MetricsServer:
    server = mhttp.MetricsServer(("127.0.0.1", 0), tls=cfg.tls,
                                 auth=mhttp.Auth(cfg.users) if cfg.users else None)
    server.publish(BODY)
    return server


def test_tls_and_basic_auth_with_python_and_curl(pki):
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode().replace("$2b$", "$2y$", 1)
    cfg = webconfig.load(_web(pki, f"""tls_server_config:
  cert_file: server.crt
  key_file: server.key
basic_auth_users:
  prometheus: {hashed}
"""))
    server = _tls_server(cfg)
    url = f"https://127.0.0.1:{server.address[1]}/metrics"
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    stop = threading.Event()
    t = _serve_in_thread(server, stop)
    # A client stalled in its handshake (one byte of a ClientHello) holds nothing but itself.
    stalled = socket.create_connection(server.address)
    stalled.send(b"\x16")
    try:
        status, body = _get(url, ctx=ctx, auth=("prometheus", "s3cret"))
        assert (status, body) == (200, BODY)
        deadline = time.monotonic() + 10  # the answered one is closed by the server's thread
        while len(server.conns) != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(server.conns) == 1  # the stalled one, still waiting for its deadline
        from prometheus_client.parser import text_string_to_metric_families

        assert [f.name for f in text_string_to_metric_families(body.decode())] == ["envctl_x"]
        assert _get(url, ctx=ctx, auth=("prometheus", "wrong"))[0] == 401
        assert _get(url, ctx=ctx, auth=("nobody", "s3cret"))[0] == 401
        assert _get(url, ctx=ctx)[0] == 401
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP: no answer
            _get(url.replace("https", "http"), timeout=5)
        if shutil.which("curl"):
            base = ["curl", "-sS", "--max-time", "10", "--cacert", str(pki / "ca.crt"),
                    "-o", "/dev/null", "-w", "%{http_code}", url]
            for user, want in (("prometheus:s3cret", "200"), ("prometheus:nope", "401")):
                res = subprocess.run([*base, "-u", user], capture_output=True, text=True)
                assert res.stdout == want, res.stderr
    finally:
        stalled.close()
        stop.set()
        t.join(10)
        server.close()


def test_client_certificates_are_verified(pki):
    cfg = webconfig.load(_web(pki, """tls_server_config:
  cert_file: server.crt
  key_file: server.key
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: ca.crt
"""))
    server = _tls_server(cfg)
    url = f"https://127.0.0.1:{server.address[1]}/metrics"
    stop = threading.Event()
    t = _serve_in_thread(server, stop)
    try:
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _get(url, ctx=ctx)  # no client certificate: the handshake fails
        ctx.load_cert_chain(pki / "client.crt", pki / "client.key")
        assert _get(url, ctx=ctx) == (200, BODY)
    finally:
        stop.set()
        t.join(10)
        server.close()


def test_bcrypt_time_is_budgeted_and_a_good_password_remembered():
    clock = iter(x * 0.15 for x in range(1000))
    auth = mhttp.Auth({"p": bcrypt.hashpw(b"pw", bcrypt.gensalt(4))}, clock=lambda: next(clock),
                      per_source=1.0)  # the budget of all sources together
    header = "Basic " + base64.b64encode(b"p:bad").decode()
    assert [auth.check(header) for _ in range(3)] == [401, 401, 429]  # 0.3 s spent > 0.2
    for _ in range(10):  # a new second: the budget is back
        next(clock)
    good = "Basic " + base64.b64encode(b"p:pw").decode()
    assert auth.check(good) == 200
    assert auth.check(good) == 200 and auth.spent < 0.2 + 0.15  # remembered: no bcrypt again
    assert auth.check("Bearer x") == 401 and auth.check("Basic !!") == 401


def _raw_get(sock: socket.socket, auth: bytes | None = None) -> bytes:
    """Send a GET /metrics on `sock` (Authorization: Basic `auth`) and read the answer whole."""
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
    if auth is not None:
        head += b"Authorization: Basic " + base64.b64encode(auth) + b"\r\n"
    sock.sendall(head + b"\r\n")
    sock.settimeout(10)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _from(addr: str, port: int) -> socket.socket:
    """A connection to 127.0.0.1:`port` from source address `addr` (all of 127/8 is loopback)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((addr, 0))
    s.connect(("127.0.0.1", port))
    return s


def test_a_flood_from_one_source_never_evicts_another_sources_scrape():
    """One peer opening connections as fast as it can closes only its own (MAX_PER_SOURCE);
    a scraper on another address, connected before the flood and sending its request after
    it, is answered. (Before: the oldest connection of all made room, the scraper's.)"""
    server = mhttp.MetricsServer(("127.0.0.1", 0), max_connections=8, max_per_source=2)
    server.publish(BODY)
    port = server.address[1]
    stop = threading.Event()
    t = _serve_in_thread(server, stop)
    scraper = _from("127.0.0.1", port)
    flood = []
    try:
        for _ in range(20):
            flood.append(_from("127.0.0.2", port))
        for s in flood[:18]:  # all but its newest two were closed, by the server
            s.settimeout(10)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(10) == b""
        answer = _raw_get(scraper)
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(BODY), answer[:200]
    finally:
        for s in [scraper, *flood]:
            s.close()
        stop.set()
        t.join(10)
        server.close()


def test_a_full_table_closes_the_biggest_sources_oldest():
    server = mhttp.MetricsServer(("127.0.0.1", 0), max_connections=4, max_per_source=3)
    server.publish(BODY)
    port = server.address[1]
    stop = threading.Event()
    t = _serve_in_thread(server, stop)
    first = _from("127.0.0.1", port)
    hog = [_from("127.0.0.2", port) for _ in range(3)]
    late = _from("127.0.0.3", port)  # the table is full: 127.0.0.2's oldest goes, not `first`
    try:
        hog[0].settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            assert hog[0].recv(10) == b""
        assert _raw_get(first).endswith(BODY) and _raw_get(late).endswith(BODY)
    finally:
        for s in [first, *hog, late]:
            s.close()
        stop.set()
        t.join(10)
        server.close()


def test_one_source_spending_the_bcrypt_budget_leaves_the_others_theirs():
    """Wrong passwords from 127.0.0.2 are refused (429) once that source has spent its share
    of this second's bcrypt; the scraper on 127.0.0.1 still gets its password checked. Each
    check costs 0.1 s of a fake clock. (Before: one budget for all, spent by the flood.)"""
    ticks = iter(x * 0.1 for x in range(1000))
    auth = mhttp.Auth({"prom": bcrypt.hashpw(b"pw", bcrypt.gensalt(4))},
                      clock=lambda: next(ticks))
    server = mhttp.MetricsServer(("127.0.0.1", 0), auth=auth)
    server.publish(BODY)
    port = server.address[1]
    stop = threading.Event()
    t = _serve_in_thread(server, stop)
    try:
        codes = []
        for _ in range(5):
            with _from("127.0.0.2", port) as s:
                codes.append(_raw_get(s, b"prom:wrong").split(b" ", 2)[1])
        assert codes == [b"401", b"429", b"429", b"429", b"429"]
        with _from("127.0.0.1", port) as s:
            assert _raw_get(s, b"prom:pw").startswith(b"HTTP/1.1 200 OK")
    finally:
        stop.set()
        t.join(10)
        server.close()


def test_a_flood_at_a_real_bcrypt_cost_leaves_another_source_its_first_check(monkeypatch):
    """At bcrypt's default cost one check (~0.25 s) is over the whole second's budget (0.2 s)
    alone: the flood's first check of each second refused every other source until the
    next. A source's first check of the second goes through while the whole stays under
    twice the budget. (A fake clock that each bcrypt check moves on by 0.25 s.)"""
    now = {"t": 0.0}
    real = bcrypt.checkpw

    def slow(password: bytes, hashed: bytes) -> bool:
        now["t"] += 0.25
        return real(password, hashed)

    auth = mhttp.Auth({"prom": bcrypt.hashpw(b"pw", bcrypt.gensalt(4))},
                      clock=lambda: now["t"])
    monkeypatch.setattr(bcrypt, "checkpw", slow)
    bad = "Basic " + base64.b64encode(b"prom:wrong").decode()
    good = "Basic " + base64.b64encode(b"prom:pw").decode()
    assert auth.check(bad, "flood") == 401
    assert auth.check(bad, "flood") == 429
    assert auth.check(good, "scraper") == 200
    assert auth.check(bad, "third") == 429  # twice the budget spent: the rest wait
    now["t"] += 1.0  # the next second: each source again
    assert auth.check(bad, "third") == 401


def test_an_unknown_user_costs_a_bcrypt_check_of_the_same_cost(monkeypatch):
    """A 401 for a user that does not exist takes a bcrypt check, against a dummy hash of the
    users' cost, so the time of a 401 does not tell which user names exist."""
    auth = mhttp.Auth({"prom": bcrypt.hashpw(b"pw", bcrypt.gensalt(5))}, per_source=10.0)
    assert auth.dummy.startswith(b"$2b$05$") and not bcrypt.checkpw(b"", auth.dummy)
    checked = []
    real = bcrypt.checkpw
    monkeypatch.setattr(bcrypt, "checkpw", lambda pw, h: checked.append(h) or real(pw, h))
    for user in (b"prom", b"nobody"):
        assert auth.check("Basic " + base64.b64encode(user + b":guess").decode()) == 401
    assert len(checked) == 2 and checked[1] == auth.dummy
    assert auth.check("Basic " + base64.b64encode(b"nobody:pw").decode()) == 401


@pytest.mark.parametrize("addr, want", [
    (("127.0.0.1", 5), "127.0.0.1"), (("::ffff:10.0.0.9", 5, 0, 0), "10.0.0.9"),
    (("2001:db8::1:2:3:4", 5, 0, 0), "2001:db8::/64"), (("fe80::1%eth0", 5, 0, 2), "fe80::/64")])
def test_source_of(addr, want):
    assert mhttp.source_of(addr) == want


@pytest.mark.parametrize("text, where", [
    ("tls_server_config:\n  cert_file: a\n", "web.yml:1: tls_server_config.key_file: missing"),
    ("basic_auth_users:\n  u: plain\n", "web.yml:2: basic_auth_users.u: must be a bcrypt"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
     "  client_auth_type: RequireAnyClientCert\n", "web.yml:4: tls_server_config."
     "client_auth_type: RequireAnyClientCert is not supported"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
     "  client_auth_type: VerifyClientCertIfGiven\n", "client_ca_file: missing"),
    ("\nhttp_server_config:\n  http2: true\n", "web.yml:2: http_server_config: unknown key"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: nothere.key\n",
     "web.yml:3: tls_server_config.key_file: cannot open TLS key file"),
    ("tls_server_config: [\n", "web.yml:2: YAML syntax error"),
])
def test_web_config_refusals_name_file_line_and_field(pki, text, where):
    with pytest.raises(InputError) as exc:
        webconfig.load(_web(pki, text))
    assert where in str(exc.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="the check applies to a monitor run as root")
def test_a_web_config_another_user_may_write_is_refused(pki):
    path = _web(pki, "")
    path.chmod(0o622)
    with pytest.raises(InputError, match="writable by a user other than root"):
        webconfig.load(path)
    path.chmod(0o600)
    assert webconfig.load(path).tls is None


@pytest.mark.skipif(os.geteuid() != 0, reason="the check applies to a monitor run as root")
@pytest.mark.parametrize("name, mode, why", [
    ("ca.crt", 0o664, "client CA file .* writable by a user other than root"),
    ("server.crt", 0o646, "TLS certificate file .* writable by a user other than root"),
    ("server.key", 0o604, "TLS key file .* readable by every user"),
])
def test_every_tls_file_is_root_s_alone(pki, name, mode, why):
    """ATTACK (attacker review, fixed before it shipped): only the key file was checked. Who
    can write the client CA file makes a client certificate that passes; the certificate and
    the key are loaded from the descriptors that were checked; a world-readable key is
    refused."""
    text = ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n")
    assert webconfig.load(_web(pki, text)).tls is not None
    before = (pki / name).stat().st_mode
    (pki / name).chmod(mode)
    try:
        with pytest.raises(InputError, match=why):
            webconfig.load(_web(pki, text))
    finally:
        (pki / name).chmod(before)


@pytest.mark.skipif(os.geteuid() != 0, reason="the check applies to a monitor run as root")
def test_a_tls_file_in_a_directory_a_user_may_write_is_refused(pki, tmp_path):
    """A root-owned 0644 certificate in a directory someone else may write can be replaced by
    them between two loads: refused, naming the directory."""
    import shutil

    d = tmp_path / "certs"
    d.mkdir()
    for f in ("server.crt", "server.key"):
        shutil.copy2(pki / f, d / f)
    d.chmod(0o777)
    text = f"tls_server_config:\n  cert_file: {d}/server.crt\n  key_file: {d}/server.key\n"
    with pytest.raises(InputError, match=f"reached through {d}, which is writable by"):
        webconfig.load(_web(pki, text))
    d.chmod(0o755)
    assert webconfig.load(_web(pki, text)).tls is not None
