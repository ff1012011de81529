"""An attacker's review, session 33: what needs no root (see
tests/integration/test_attacks_s33.py for the rest)."""

from __future__ import annotations

import contextlib
import os

import pytest

from envctl.errors import UsageError
from envctl.runtime import jobs as jb


@pytest.mark.parametrize("text", ["²", "１２", "٣"])
def test_a_job_id_is_ascii_digits_or_bad_input(text):
    """`envctl logs ²` (or the same in a daemon request's `ids`) is bad input, exit 2 with
    the one line: not a traceback, and not another job's id spelt in other digits."""
    with pytest.raises(UsageError):
        jb.parse_id(text)


@pytest.mark.parametrize("text", ["²", "１２", "٣"])
def test_a_cpu_or_gpu_count_in_other_digits_is_not_a_count(text):
    """`submit-job --cpus ²` (a daemon request's `cpus` too) raised ValueError in int(): a
    traceback, exit 1; '１２' was a count of 12. Now neither is a count (the CPU or GPU list
    parser then refuses it, exit 2)."""
    from envctl.runtime import supervisor as sv

    assert sv._count(text, "--cpus", "0-0") == 0
    with pytest.raises(UsageError):
        jb.parse_cpus(text, "--cpus")


def test_the_daemon_raises_its_descriptor_limit_and_its_children_do_not_keep_it():
    """At EMFILE the kernel drops a client's passed descriptors inside the daemon, whose last
    close can block its loop (a lingering socket): the daemon runs at its hard limit, and
    what it forks (workers, a request's child, a pass: the jobs' ancestors) at the limit it
    was started with. In a forked child, so that this test process keeps its own."""
    import resource

    from envctl.server import server

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
            server._raise_nofile()
            raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            server._leave_the_daemon({0, 1, 2})
            back = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            code = 0 if raised > 256 and back == 256 else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("user", ["²", "nobody:²"])
def test_a_user_option_in_other_digits_is_refused_not_a_traceback(user):
    """`submit-job --user ²` from a plain user: int('²') raised ValueError (a traceback in
    the daemon's child); now it is a name the host does not know, refused in one line."""
    from envctl.errors import AccessDenied
    from envctl.runtime import access

    with pytest.raises(AccessDenied):
        access.check_user_option(access.Caller(uid=65534, gid=65534), user)


def test_a_spec_name_is_never_read_from_a_device_it_opens(tmp_path, monkeypatch):
    """A spec linked into a directory a user owns, swapped for a link to a device: the
    daemon's loop and the monitor opened it for reading before they looked at it (O_NONBLOCK
    stops a FIFO's hang, not the open's own effect: /dev/watchdog armed, a tape rewound).
    Now it is found with O_PATH, and only a regular file is opened for reading."""
    from envctl.runtime import context

    link = tmp_path / "a.yaml"
    link.symlink_to("/dev/null")
    opened = []
    real = os.open

    def spy(path, flags, *args, **kw):
        opened.append((str(path), flags))
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", spy)
    assert context.spec_name_of(link) is None
    assert opened and all(flags & os.O_PATH for _, flags in opened), opened
    regular = tmp_path / "b.yaml"
    regular.write_text("name: box\nkind: cpu\n")
    assert context.spec_name_of(regular) == "box"


def test_a_passed_socket_lingering_again_does_not_block_the_loops_close():
    """The client keeps a copy of the TCP socket it passed, sets SO_LINGER {1, 1000 s} again
    after the daemon received it (recv_fds cleared it), and closes its copy: the daemon's
    close of it (a request given up, an inline handler done) was the last one and waited
    there for its unread data to be taken. close_passed clears it again right before."""
    import socket
    import struct
    import threading

    from envctl.server import protocol as proto

    lst = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(lst.getsockname())
    peer, _ = lst.accept()  # never reads
    try:
        cli.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                cli.send(b"x" * 65536)  # the peer's window and our buffer full
        cli.setblocking(True)
        passed = os.dup(cli.fileno())  # as the daemon holds it
        cli.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 1000))
        cli.close()  # the client's copy gone: the daemon's close is the last
        done = threading.Event()
        t = threading.Thread(target=lambda: (proto.close_passed([passed]), done.set()),
                             daemon=True)
        t.start()
        t.join(20)
        assert done.is_set(), "the daemon's close waited for a lingering socket"
    finally:
        peer.close()
        lst.close()


@pytest.mark.parametrize("bad", ["²", "１２"])
def test_every_number_a_user_types_is_ascii_digits(bad):
    """One predicate (spec.units.ascii_digits) where numbers are typed: `--gpus ²,` was a
    traceback in the daemon's child and `--gpus １,` GPU 1; `gpus --clear ²`, `--listen :²`
    and `--user 0:²` the same."""
    from envctl.errors import EnvctlError
    from envctl.monitor.http import parse_listen
    from envctl.text import ascii_digits

    assert not ascii_digits(bad) and ascii_digits("12")
    with pytest.raises(EnvctlError):
        parse_listen(f"127.0.0.1:{bad}")
