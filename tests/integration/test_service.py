"""The environment's service end to end through the CLI, on the real kernel: `up` starts it in
the environment (its own cgroup `service`, inside a PID namespace of its own), `status` shows
it; `on-failure` restarts a failing command with a growing backoff; `restart: no` leaves it
dead and `up` starts it again; `down` stops it first and leaves nothing, also while it backs
off; kill -9 of its supervisor takes the service with it, and `up`, `down` and `down --force`
deal with what is left."""

from __future__ import annotations

import json
import os
import select
import signal
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

SPEC = """
name: box
kind: cpu
rootfs:
  binaries: [sh, cat, sleep, "true", python3]
  python: true
mounts:
  - {{source: {data}, target: /data, create: false}}
service:
  command: {command}
  restart: {restart}
  restart_sec: {restart_sec}
"""
SLEEPER = json.dumps(["/bin/sh", "-c", "echo run >> /data/runs; exec sleep 100000"])
# Appends a timestamp, then fails.
FAILING = json.dumps(["python3", "-c", "import time\nwith open('/data/runs', 'a') as f:\n"
                      "    f.write(f'{time.time()}\\n')\nraise SystemExit(1)"])


@pytest.fixture
def box(sandbox, tmp_path):
    """The sandbox and a function that writes box's spec and brings it up; `down --force`
    afterwards if the test left it up, and no supervisor left in any case."""
    data = tmp_path / "data"
    data.mkdir()
    # The service runs as root inside, which is not the host's root (its user namespace): the
    # operator's directory lets it write (and `create: false`: envctl leaves its mode alone).
    data.chmod(0o777)

    def up(command: str = SLEEPER, restart: str = "on-failure", restart_sec: float = 1,
           env: dict[str, str] | None = None) -> None:
        sandbox.write_spec("box", SPEC.format(data=data, command=command, restart=restart,
                                              restart_sec=restart_sec))
        res = sandbox.envctl("up", "box", env=env)
        assert res.returncode == 0, res.stderr

    sandbox.data = data
    sandbox.up = up
    yield sandbox
    left = service_state(sandbox)
    if sandbox.proc.poll() is None and sandbox.journals():
        sandbox.envctl("down", "box", "--force")
    if left and alive(left["supervisor"]):
        os.kill(left["supervisor"]["pid"], signal.SIGKILL)


def service_state(sb) -> dict | None:
    try:
        return json.loads((sb.run_dir / "box" / "service.json").read_text())
    except (OSError, ValueError):
        return None


def runs(sb) -> list[str]:
    try:
        return (sb.data / "runs").read_text().splitlines()
    except FileNotFoundError:
        return []


def status_step(sb) -> dict:
    (env,) = sb.envctl_json("status", "box")
    (step,) = [s for s in env["steps"] if s["kind"] == "service"]
    return step


def alive(identity: dict) -> bool:
    """Whether the process a record names still exists (a zombie included)."""
    try:
        stat = Path(f"/proc/{identity['pid']}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[19] == str(identity["start"])


def gone(identity: dict) -> bool:
    """Whether the process has ended and been reaped (by PID 1, its parent: a moment later)."""
    return wait_until(lambda: not alive(identity), 5)


def wait_gone(pid: int, timeout: float = 20.0) -> bool:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        p = select.poll()
        p.register(fd, select.POLLIN)
        return bool(p.poll(timeout * 1000))
    finally:
        os.close(fd)


def wait_until(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def service_cgroups(sb) -> list[str]:
    return [c for c in sb.cgroups() if c.endswith("/box/service")]


def assert_clean_down(sb, *args: str) -> None:
    state = service_state(sb)
    res = sb.envctl("down", "box", *args)
    assert res.returncode == 0, res.stderr
    if state:
        assert gone(state["supervisor"])
    assert sb.residue() == {}, sb.residue()


# ---------------------------------------------------------------- running


def test_up_runs_the_service_in_the_environment_and_down_stops_it_first(box):
    sb = box
    box.up()
    state = service_state(sb)
    assert state["state"] == "running" and state["restarts"] == 0
    assert alive(state["supervisor"])
    pid = state["pid"]
    assert runs(sb) == ["run"]
    # The command itself (not the launcher or the init) in the environment's `service` cgroup,
    # in a PID namespace of its own (PID 2 there: the launch's init is 1), with the rootfs as /.
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == b"sleep"
    cgroups = Path(f"/proc/{pid}/cgroup").read_text()
    assert f"/{sb.cgroup_parent}/box/service\n" in cgroups
    assert service_cgroups(sb)
    nspid = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                 if line.startswith("NSpid:")).split()[1:]
    assert len(nspid) == 2 and nspid[-1] == "2"
    assert os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
    assert os.path.samefile(f"/proc/{pid}/root/etc/hostname", sb.state / "rootfs" / "box"
                            / "etc" / "hostname")
    assert (sb.run_dir / "box" / "service.log").exists()
    step = status_step(sb)
    assert step["status"] == "ok" and step["detail"].startswith(f"running (pid {pid}")
    # `up` again changes nothing: the same supervisor, the same process.
    box.up()
    assert service_state(sb)["supervisor"] == state["supervisor"] and runs(sb) == ["run"]
    # The plan's last step: `down` removes it first.
    res = sb.envctl("down", "box", "--json")
    assert res.returncode == 0, res.stderr
    (outcome,) = json.loads(res.stdout)
    assert outcome["steps"][0]["kind"] == "service"
    assert wait_gone(pid, 1) and gone(state["supervisor"])
    assert sb.residue() == {}, sb.residue()


def test_a_changed_command_replaces_the_running_service(box):
    sb = box
    box.up()
    old = service_state(sb)
    box.up(command=json.dumps(["/bin/sh", "-c", "echo new >> /data/runs; exec sleep 99999"]))
    new = service_state(sb)
    assert new["supervisor"] != old["supervisor"] and gone(old["supervisor"])
    assert wait_gone(old["pid"], 1)
    assert runs(sb) == ["run", "new"] and new["command"][-1].endswith("sleep 99999")
    assert status_step(sb)["status"] == "ok"
    assert_clean_down(sb)


def test_a_command_not_in_the_rootfs_fails_up_and_rolls_back(box):
    sb = box
    sb.write_spec("box", SPEC.format(data=sb.data, command='["no-such-program"]',
                                     restart="always", restart_sec=1))
    res = sb.envctl("up", "box")
    assert res.returncode == 1
    assert "no-such-program: command not found in environment 'box'" in res.stderr
    assert service_state(sb) is None
    assert sb.residue() == {}, sb.residue()


# ---------------------------------------------------------------- restarting


def test_on_failure_restarts_with_a_growing_backoff_and_down_stops_it_while_it_waits(box):
    sb = box
    box.up(command=FAILING, restart_sec=0.2)
    assert wait_until(lambda: len(runs(sb)) >= 5), runs(sb)
    stamps = [float(t) for t in runs(sb)[:5]]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    # Each gap holds at least its backoff (0.2 s doubling) and the gaps grow.
    for i, gap in enumerate(gaps):
        assert gap >= 0.2 * 2 ** i - 0.01, gaps
    assert gaps == sorted(gaps) and gaps[-1] > 3 * gaps[0], gaps
    # Backing off it is still up, and says so.
    assert wait_until(lambda: (service_state(sb) or {}).get("state") == "backoff")
    step = status_step(sb)
    assert step["status"] == "ok", step
    assert "restarting (" in step["detail"] and "last exit exit 1" in step["detail"]
    state = service_state(sb)
    assert state["restarts"] >= 4 and state["last_exit"]["code"] == 1
    # `down` in the middle of a backoff (the next start is 3.2 s away or more).
    assert wait_until(lambda: (service_state(sb) or {}).get("state") == "backoff"
                      and service_state(sb)["restarts"] >= 5)
    started = time.monotonic()
    assert_clean_down(sb)
    assert time.monotonic() - started < 10  # it did not wait for the backoff to run out
    count = len(runs(sb))
    assert not wait_until(lambda: len(runs(sb)) > count, timeout=0.5)


def test_restart_no_stays_dead_status_shows_it_missing_and_up_starts_it_again(box):
    sb = box
    once = json.dumps(["/bin/sh", "-c", "echo ran >> /data/runs; exit 3"])
    box.up(command=once, restart="no")
    assert wait_until(lambda: (service_state(sb) or {}).get("state") == "failed")
    state = service_state(sb)
    assert state["last_exit"]["code"] == 3 and state["restarts"] == 0
    assert wait_gone(state["supervisor"]["pid"], 5)
    assert service_cgroups(sb) == []
    step = status_step(sb)
    assert step["status"] == "missing" and "failed: last exit exit 3" in step["detail"]
    assert sb.envctl("status", "box", "--check").returncode == 1
    assert runs(sb) == ["ran"]  # never restarted
    box.up(command=once, restart="no")
    assert wait_until(lambda: runs(sb) == ["ran", "ran"])
    assert_clean_down(sb)


def test_on_failure_does_not_restart_a_clean_exit(box):
    sb = box
    box.up(command=json.dumps(["/bin/sh", "-c", "echo ran >> /data/runs"]), restart_sec=0)
    assert wait_until(lambda: (service_state(sb) or {}).get("state") == "stopped")
    assert service_state(sb)["last_exit"]["code"] == 0
    assert runs(sb) == ["ran"]
    assert status_step(sb)["status"] == "missing"
    assert_clean_down(sb)


# ---------------------------------------------------------------- a killed supervisor


def test_kill_9_of_the_supervisor_kills_the_service_and_up_starts_it_again(box):
    sb = box
    box.up()
    state = service_state(sb)
    os.kill(state["supervisor"]["pid"], signal.SIGKILL)
    assert wait_gone(state["pid"]), "the service outlived its supervisor"
    step = status_step(sb)
    assert step["status"] == "missing" and "is gone" in step["detail"]
    box.up()
    again = service_state(sb)
    assert again["supervisor"] != state["supervisor"] and alive(again["supervisor"])
    assert runs(sb) == ["run", "run"]
    assert status_step(sb)["status"] == "ok"
    assert_clean_down(sb)


@pytest.mark.parametrize("force", [False, True])
def test_down_after_the_supervisor_died(box, force):
    sb = box
    box.up()
    state = service_state(sb)
    os.kill(state["supervisor"]["pid"], signal.SIGKILL)
    assert wait_gone(state["pid"])
    assert service_cgroups(sb)  # left behind, empty
    assert_clean_down(sb, *(["--force"] if force else []))


def test_down_stops_a_service_that_ignores_sigterm_after_the_grace(box):
    sb = box
    stubborn = json.dumps(["/bin/sh", "-c", "trap '' TERM; echo run >> /data/runs; "
                           "while :; do sleep 1; done"])
    box.up(command=stubborn, env={"ENVCTL_KILL_GRACE": "0.5"})
    state = service_state(sb)
    assert state["grace"] == 0.5
    assert_clean_down(sb)
    assert wait_gone(state["pid"], 1)


def test_service_log_is_rotated_while_the_service_runs(box):
    """The supervisor writes service.log (the service writes to a pipe) and rotates it at
    ENVCTL_SERVICE_LOG_MAX bytes, keeping ENVCTL_SERVICE_LOG_KEEP old files, without
    restarting the service."""
    sb = box
    lines = [f"line-{i:05d} " + "x" * 88 + "\n" for i in range(3000)]  # 100 bytes each
    talker = json.dumps(["python3", "-c", "import sys, time\nfor i in range(3000):\n"
                         "    print(f'line-{i:05d} ' + 'x' * 88, flush=True)\n"
                         "time.sleep(100000)"])
    box.up(talker, env={"ENVCTL_SERVICE_LOG_MAX": "20000", "ENVCTL_SERVICE_LOG_KEEP": "2"})
    first = service_state(sb)
    log = sb.run_dir / "box" / "service.log"
    assert wait_until(lambda: log.read_text().endswith(lines[-1])), log.read_text()[-300:]
    old = [log.with_name(f"service.log.{n}") for n in (1, 2, 3)]
    assert old[0].exists() and old[1].exists() and not old[2].exists()
    parts = [old[1].read_text(), old[0].read_text(), log.read_text()]
    for text in parts:
        assert 0 < len(text) <= 20000 + 65536
    tail = "".join(parts)
    # The newest files are a contiguous tail of what it wrote: nothing lost or doubled.
    assert "".join(lines).endswith(tail) and len(tail) > 20000
    now = service_state(sb)
    assert (now["pid"], now["restarts"], now["state"]) == (first["pid"], 0, "running")
    assert alive(now["supervisor"])
    assert_clean_down(sb)
