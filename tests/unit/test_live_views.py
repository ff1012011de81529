"""`top` and `status --watch` fit the terminal and quit on `q` (Ctrl-C too); keys are read only
from a terminal; the interval is `-n` everywhere (`monitor -i` still works)."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import sys
import termios
import time
from pathlib import Path

import pytest

from envctl.monitor.collect import EnvSample, Snapshot
from envctl.monitor.top import Keys, fit, view

REPO = Path(__file__).resolve().parents[2]


def test_fit_keeps_whole_blocks_and_says_what_it_left_out():
    head = ["h1", "h2"]
    blocks = [("a", ["a1", "a2"]), ("b", ["b1", "b2", "b3"]), ("c", ["c1"])]
    assert fit(head, blocks, 100, more="{n} more: {names}") == [
        "h1", "h2", "a1", "a2", "b1", "b2", "b3", "c1"]
    assert fit(head, blocks, 6, more="{n} more: {names}") == [
        "h1", "h2", "a1", "a2", "2 more: b, c"]
    assert fit(head, blocks, 3, more="{n} more: {names}") == ["h1", "h2", "3 more: a, b, c"]


def _text(renderable, height: int = 200) -> list[str]:
    from rich.console import Console

    console = Console(width=160, height=height, record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def test_top_fits_its_height_rows_first_then_as_many_jobs_as_fit():
    snap = Snapshot(time=0.0, envs=[EnvSample(f"env{i}", cpus=2) for i in range(3)], gpus=[],
                    problems=["p1", "p2"])
    jobs = [["ID", "NAME"]] + [[str(i), f"job{i}"] for i in range(50)]
    def job_lines(lines: list[str]) -> list[str]:
        return [x.split()[1] for x in lines if x.split()[1:2] and x.split()[1][:3] == "job"]

    whole = _text(view(snap, jobs))
    assert len(job_lines(whole)) == 50 and "! p2" in whole[-1]
    lines = _text(view(snap, jobs, height=15))
    assert len(lines) <= 15
    assert [x.split()[0] for x in lines if x.split()[:1] in (["env0"], ["env1"], ["env2"])
            ] == ["env0", "env1", "env2"]
    assert job_lines(lines)[0] == "job0" and len(job_lines(lines)) < 50
    assert any("more active jobs (envctl jobs)" in x for x in lines)
    assert not any("p1" in x for x in lines)  # no room left: the jobs' line said so
    lines = _text(view(snap, jobs[:3], height=11))
    assert len(lines) == 11 and lines[-1] == "… 2 more problems", lines
    tiny = _text(view(snap, jobs, height=5))
    assert len(tiny) == 5 and tiny[3].split()[0] == "env0", tiny
    assert any("… 2 more environments (envctl list)" in x for x in tiny), tiny


def test_keys_are_read_only_from_a_terminal_and_the_terminal_is_restored():
    with open(os.devnull) as devnull:
        slept = []
        keys = Keys(devnull, sleep=slept.append)
        with keys:
            assert keys.fd is None and keys.wait(0.5) is False  # sleeps, reads nothing
        assert slept == [0.5]
    master, slave = pty.openpty()
    try:
        before = termios.tcgetattr(slave)
        with os.fdopen(os.dup(slave)) as stream, Keys(stream) as keys:
            assert termios.tcgetattr(slave)[3] & termios.ICANON == 0  # cbreak
            assert termios.tcgetattr(slave)[3] & termios.ISIG  # Ctrl-C still interrupts
            os.write(master, b"x")
            assert keys.wait(0.05) is False  # another key: keeps waiting, then times out
            os.write(master, b"q")
            assert keys.wait(30) is True
        assert termios.tcgetattr(slave) == before
    finally:
        os.close(master)
        os.close(slave)


def _on_a_terminal(tmp_path, argv: list[str], key: bytes) -> tuple[int, str]:
    """Run `envctl ARGV` on a pseudo-terminal, press `key` once it has drawn, and return its
    exit code and what it drew."""
    env = {**os.environ, "ENVCTL_STATE_DIR": str(tmp_path / "state"),
           "ENVCTL_RUN_DIR": str(tmp_path / "run"), "ENVCTL_CONFIG_DIR": str(REPO / "configs"),
           "PYTHONPATH": str(REPO / "src"), "COLUMNS": "150", "LINES": "20", "TERM": "xterm"}
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        # As a terminal's shell starts it: SIGINT delivered and handled by default. (In the
        # whole suite on CI the two Ctrl-C cases saw no SIGINT for 60 s: an ignored or blocked
        # SIGINT survives exec, and something earlier in the run left one; not found yet.)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execve(sys.executable, [sys.executable, "-m", "envctl", *argv], env)
    out = b""
    try:
        deadline = time.monotonic() + 60
        while b"cpu-compute" not in out:  # drawn once: its keys are being read
            assert time.monotonic() < deadline, out.decode(errors="replace")
            if select.select([fd], [], [], 1)[0]:
                out += os.read(fd, 65536)
        os.write(fd, key)
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status), out.decode(errors="replace")
            assert time.monotonic() < deadline, f"still running after {key!r}: {out!r}"
            if select.select([fd], [], [], 0.2)[0]:
                with contextlib.suppress(OSError):  # EIO once the child has closed it
                    out += os.read(fd, 65536)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


@pytest.mark.parametrize("argv", [["status", "--watch", "-n", "0.2"], ["top", "-n", "0.2"]])
@pytest.mark.parametrize("key", [b"q", b"\x03"])
def test_q_and_ctrl_c_end_the_live_views(tmp_path, argv, key):
    if argv[0] == "top":  # top lists environments that are up: give it one to draw
        _up_journal(tmp_path / "state", "cpu-compute")
    code, out = _on_a_terminal(tmp_path, argv, key)
    assert code == 0, out
    if argv[0] == "top":  # its state as `list` says it: its namespace is not there
        assert "degraded" in out, out


def _up_journal(state: Path, env: str) -> None:
    import json

    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    (state / "journal").mkdir(parents=True)
    res = {"kind": "netns", "name": env}
    (state / "journal" / f"{env}.json").write_text(json.dumps({
        "version": 1, "log": 0, "meta": {}, "entries": [{
            "key": f"netns:{env}", "resource": res, "memo": {}, "status": "applied",
            "shared": False, "boot": boot}]}))


def test_status_watch_fits_the_terminal(tmp_path):
    code, out = _on_a_terminal(tmp_path, ["status", "--watch", "-n", "0.2"], b"q")
    assert code == 0
    # The table first; the shipped specs' details (dozens of lines each) do not fit 20 lines.
    assert "NAME" in out and "more not shown (cpu-compute, gpu-compute)" in out


def test_the_interval_is_n_everywhere_and_monitor_i_still_works(capsys, monkeypatch, tmp_path):
    from envctl.cli import main

    monkeypatch.setenv("ENVCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("COLUMNS", "200")
    for argv in (["monitor", "--once", "-n", "0"], ["monitor", "--once", "-i", "0"],
                 ["top", "-n", "0"], ["status", "--watch", "-n", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and "--interval 0" in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        main(["monitor", "--help"])
    out = capsys.readouterr().out
    assert "-n" in out and " -i " not in out  # the old spelling is hidden
