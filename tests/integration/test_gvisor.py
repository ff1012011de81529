"""`runtime.isolation: gvisor` end to end through the CLI, on the real kernel with the host's
runsc (ptrace platform): a job sees gVisor's kernel and nothing of the host, reaches its own
network only, and ends in the right state for an exit, a signal, a time limit, a cancel and
an OOM kill; kill -9 of the supervisor mid-start and `down` leave no runsc state, sandbox
process, cgroup or mount. Skipped when runsc is not installed (CI installs it:
scripts/install-deps)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from tests.integration.test_exec import gateway_and_peer
from tests.integration.test_jobs import (
    assert_clean_down,
    job_cgroups,
    ours,
    script,
    submit,
    wait,
    wait_gone,
    wait_until,
)

pytestmark = [pytest.mark.root, pytest.mark.skipif(
    shutil.which("runsc") is None, reason="gVisor's runsc is not installed (apt-get install "
    "runsc; scripts/install-deps installs it)")]

SPEC = """
name: box
kind: cpu
network:
  bridge: gvbr0
  bridge_address: 10.231.0.1/24
  address: 10.231.0.2
rootfs:
  binaries: [sh, cat, sleep, "true", python3, dmesg, uname, ps]
  python: true
resources:
  memory: {max: 96M}
runtime:
  isolation: gvisor
  gvisor: {platform: ptrace}
"""


@pytest.fixture
def box(sandbox):
    """The sandbox with environment `box` up under gVisor."""
    sandbox.write_spec("box", SPEC)
    res = sandbox.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    yield sandbox
    if sandbox.proc.poll() is None:
        sandbox.envctl("down", "box", "--force")


def runsc_left(sb) -> list[str]:
    """runsc processes of this sandbox (their command line names its run directory)."""
    out = []
    for pid in ours(sb):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"runsc" in cmd:
            out.append(f"{pid} {cmd[:80]!r}")
    return out


def runsc_cgroups() -> list[str]:
    """Cgroups runsc makes when left to itself (named after a container: box-<hex>)."""
    return sorted(str(p) for p in Path("/sys/fs/cgroup").glob("*/box-*"))


def test_a_job_sees_gvisors_kernel_and_nothing_of_the_host(box):
    sb = box
    probe = script(sb, "probe.py", (
        "import os, socket\n"
        "print('kernel', os.uname().release)\n"
        "print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "s = socket.socket(); s.settimeout(3)\n"
        "print('bridge', s.connect_ex(('10.231.0.1', 9)))\n"))
    j = submit(sb, probe)
    rc, (done,) = wait(sb, j["id"])
    out = Path(done["stdout"]).read_text()
    assert rc == 0 and done["state"] == "COMPLETED", (done, out,
                                                      Path(done["stderr"]).read_text())
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    # gVisor's kernel, not the host's.
    assert lines["kernel"] != os.uname().release and lines["kernel"].startswith("4.4")
    # Its own PID namespace: a handful of processes, none of the host's.
    pids = json.loads(lines["pids"])
    assert pids and max(pids) < 50, pids
    # The environment's network: its bridge answers (refused, 111: a host is there).
    assert lines["bridge"] == "111", lines
    dmesg = sb.envctl("exec", "box", "--user", "root", "--", "dmesg")
    assert dmesg.returncode == 0, dmesg.stderr
    assert "Starting gVisor" in dmesg.stdout
    uname = sb.envctl("exec", "box", "--user", "root", "--", "uname", "-r")
    assert uname.stdout.strip() != os.uname().release
    # status names the isolation level.
    (env,) = sb.envctl_json("status", "box")
    assert env["isolation"] == {"level": "gvisor", "platform": "ptrace"}
    assert "isolation    gvisor (ptrace)" in sb.envctl("status", "box").stdout
    assert_clean_down(sb)


def test_only_its_own_network_is_reachable(box):
    """A sandboxed job reaches its gateway but not a second, isolated environment on the same
    bridge, even at a port that listens (the host side reaches it)."""
    sb = box
    sb.write_spec("peer", "name: peer\nkind: cpu\nnetwork: {bridge: gvbr0, bridge_address: "
                  "10.231.0.1/24, address: 10.231.0.3}\n")
    res = sb.envctl("up", "peer")
    assert res.returncode == 0, res.stderr
    port = 9000 + os.getpid() % 1000
    connect = ("import socket, sys\ns = socket.socket(); s.settimeout(5)\n"
               "print(s.connect_ex((sys.argv[1], int(sys.argv[2]))))\n")

    def inside(address: str) -> str:
        res = sb.envctl("exec", "box", "--user", "root", "--", "python3", "-c", connect,
                        address, str(port))
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    with gateway_and_peer(sb, port) as (gateway, peer):
        assert inside("10.231.0.1") == "0"
        assert gateway.stdout.readline().startswith("hit 10.231.0.2")
        assert inside("10.231.0.3") != "0"
        peer.kill()
        assert "hit" not in peer.stdout.read()  # the sandbox's attempt never arrived
    assert sb.envctl("down", "peer").returncode == 0
    assert_clean_down(sb)


def test_host_files_and_processes_stay_out_of_sight(box):
    sb = box
    marker = sb.root / "host-only-marker"
    marker.write_text("secret")
    res = sb.envctl("exec", "box", "--user", "root", "--", "python3", "-c", (
        "import os, sys\n"
        f"print(os.path.exists({str(marker)!r}))\n"
        "print(len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
        "print(open('/proc/1/cmdline').read().split(chr(0))[0])\n"))
    assert res.returncode == 0, res.stderr
    exists, count, init = res.stdout.splitlines()
    assert exists == "False"
    assert int(count) < 10  # gVisor's PID namespace: the job and little else
    assert "python3" in init  # PID 1 is the job itself, inside the sandbox
    assert_clean_down(sb)


def test_exit_codes_signals_and_outputs_land_in_the_record(box):
    sb = box
    ok = script(sb, "ok.sh", "#!/bin/sh\necho out \"$@\"\necho err >&2\n")
    three = script(sb, "three.sh", "#!/bin/sh\necho before\nexit 3\n")
    killed = script(sb, "killed.sh", "#!/bin/sh\nkill -TERM $$\n")
    a = submit(sb, ok, "a b")
    b = submit(sb, three)
    c = submit(sb, killed)
    rc, (first, second, third) = wait(sb, a["id"], b["id"], c["id"])
    assert (first["state"], first["exit_code"]) == ("COMPLETED", 0), first
    assert Path(first["stdout"]).read_text() == "out a b\n"
    assert Path(first["stderr"]).read_text() == "err\n"
    assert (second["state"], second["exit_code"]) == ("FAILED", 3)
    assert Path(second["stdout"]).read_text() == "before\n"
    assert (third["state"], third["signal"], third["oom_kills"]) == ("FAILED", 15, 0)
    assert rc == 3
    # One file for both streams: the Sentry writes each at its own offset; O_APPEND keeps
    # both.
    both = sb.root / "both.log"
    d = submit(sb, "--output", str(both), "--error", str(both), ok)
    wait(sb, d["id"])
    assert sorted(both.read_text().splitlines()) == ["err", "out"]
    # A missing working directory is refused, as natively (runsc alone would make it).
    res = sb.envctl("submit-job", "--json", "--user", "root", "--workdir", "/tmp/nope", "box",
                    ok)
    assert res.returncode == 1 and "chdir /tmp/nope" in res.stderr, res.stderr
    assert "No such file" in res.stderr
    listed = sb.envctl("exec", "box", "--user", "root", "--", "python3", "-c",
                       "import os; print(os.listdir('/tmp'))")
    assert listed.stdout == "[]\n", listed.stderr
    assert job_cgroups(sb) == [] and runsc_left(sb) == []
    assert not list((sb.run_dir / "box" / "gvisor").iterdir())
    assert_clean_down(sb)


def test_time_limit_cancel_and_oom(box):
    sb = box
    sleeper = script(sb, "sleeper.sh", "#!/bin/sh\nexec sleep 1000\n")
    t = submit(sb, "--time-limit", "2s", sleeper)
    stubborn = script(sb, "stubborn.sh", "#!/bin/sh\ntrap '' TERM\nwhile :; do sleep 1; done\n")
    c = submit(sb, stubborn)
    res = sb.envctl("cancel", "--json", "--grace", "0.5", str(c["id"]))
    assert res.returncode == 0, res.stderr
    (cancelled,) = json.loads(res.stdout)
    assert cancelled["state"] == "CANCELLED" and cancelled["signal"] == signal.SIGKILL
    _, (timed,) = wait(sb, t["id"])
    assert (timed["state"], timed["signal"]) == ("TIMEOUT", signal.SIGTERM)
    # The hog only once the others have ended: the jobs share the environment's memory limit,
    # and its OOM killer may pick any of their Sentries (it once took the sleeper's).
    hog = script(sb, "hog.py", "x = b'a' * (400 << 20)\nprint('survived')\n")
    h = submit(sb, hog)
    _, (hogged,) = wait(sb, h["id"])
    # The Sentry's memory is the job cgroup's: the OOM killer counts there.
    assert hogged["state"] == "OUT_OF_MEMORY" and hogged["oom_kills"] >= 1, hogged
    assert "survived" not in Path(hogged["stdout"]).read_text()
    assert job_cgroups(sb) == [] and runsc_left(sb) == [] and runsc_cgroups() == []
    assert_clean_down(sb)


def test_kill_9_of_the_supervisor_mid_start_then_down_leaves_nothing(box):
    sb = box
    sleeper = script(sb, "sleeper.sh", "#!/bin/sh\nexec sleep 1000\n")
    proc = sb.popen(sys_python(), "-m", "envctl", "submit-job", "--json", "--user", "root",
                    "box", sleeper)
    # Mid-start: the launch's bundle exists (runsc create runs, or the sandbox boots).
    gdir = sb.run_dir / "box" / "gvisor"
    assert wait_until(lambda: gdir.is_dir() and any(p.is_dir() for p in gdir.iterdir()), 30)
    sups = [p for p in ours(sb) if b"submit-job" in Path(f"/proc/{p}/cmdline").read_bytes()
            and p != proc.pid]
    for pid in sups:
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    for pid in sups:
        assert wait_gone(pid)
    # Every runsc process dies with the launch's PID namespace.
    assert wait_until(lambda: runsc_left(sb) == [], 15), runsc_left(sb)
    assert runsc_cgroups() == []
    # A bundle may be left (the launcher died before its init removed it): down removes it.
    assert_clean_down(sb)
    assert not (sb.run_dir / "box").exists()
    assert sb.mounts_under(str(sb.run_dir), str(sb.state)) == []


def test_a_missing_program_is_127_and_a_gpu_spec_is_a_plan_error(box):
    sb = box
    res = sb.envctl("exec", "box", "--user", "root", "--", "no-such-program")
    assert res.returncode == 127, res.stderr
    assert "command not found in environment 'box'" in res.stderr
    sb.write_spec("gbox", SPEC.replace("name: box", "name: gbox").replace(
        "kind: cpu", "kind: gpu\ngpus: {count: 1}").replace("10.231.0.2", "10.231.0.3"))
    res = sb.envctl("plan", "gbox")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "nvproxy" in res.stderr
    (sb.config_dir / "gbox.yaml").unlink()
    assert_clean_down(sb)


def sys_python() -> str:

    return sys.executable



def test_exec_on_a_terminal_gets_a_terminal_of_the_sandboxs_and_ends(box):
    """Both stdin and stdout a terminal: the job's own pseudo-terminal (runsc's console),
    what is typed reaches it, and exec ends with it (the stdio relay of file and terminal
    descriptors is for launches without one)."""
    from tests.integration.test_exec import _on_a_terminal

    out, code = _on_a_terminal(box, "[ -t 0 ] && echo TTY; echo $TERM; read line; "
                               "echo got $line; exit 4", typed=b"typed\r")
    assert code == 4, out
    text = out.replace(b"\r\n", b"\n")
    assert b"TTY\n" in text and b"got typed\n" in text, out
    assert runsc_left(box) == []
