"""Job records and outputs are their owners' alone, on the real kernel: a job submitted by
nobody (through sudo) leaves a root-owned 0600 record in root's 0700 jobs directory, a
0700 job directory and 0600 outputs owned by nobody; another host user (daemon) can open
neither the record nor the output even holding a descriptor that skips every directory on
the way; the owner reads its output but not the record; and `envctl jobs`, `logs`, `wait` run
by a plain user without root end with one line, exit 1, never a traceback."""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path

import pytest

from tests.integration.test_jobs import script, wait
from tests.integration.test_paths_security import box, pub  # noqa: F401,F811 - fixtures

pytestmark = pytest.mark.root

NOBODY, DAEMON = 65534, 1
AS_NOBODY = {"SUDO_UID": str(NOBODY), "SUDO_GID": str(NOBODY), "SUDO_USER": "nobody"}

def as_user(uid: int, fn) -> int:
    """Run `fn()` in a child that is `uid` (its gid the same, no supplementary group, no
    capability); its exit status (fn's return value, 99 if it raised)."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            code = fn()
        except BaseException as exc:  # noqa: BLE001 - told through the status and stderr
            print(f"as uid {uid}: {exc!r}", file=sys.stderr)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def reopen_errno(path_fd: int) -> int:
    """0 when this process can open the inode `path_fd` (O_PATH) names for reading, else the
    errno. Through /proc/self/fd: no directory on the way is searched, only the file's own
    mode and owner decide."""
    try:
        os.close(os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY))
        return 0
    except OSError as exc:
        return exc.errno or 1


def test_records_and_outputs_are_their_owners_alone(box, pub):  # noqa: F811
    prog = pub / "hello.sh"  # where nobody can read it: the program is read as its submitter
    prog.write_text("#!/bin/sh\necho out-of-nobody\n")
    prog.chmod(0o755)
    res = box.envctl("submit-job", "box", str(prog), env=AS_NOBODY)
    assert res.returncode == 0, res.stderr
    jid = int(res.stdout.strip())
    code, (job,) = wait(box, jid)
    assert code == 0 and job["state"] == "COMPLETED", job
    jobs = box.state / "jobs"
    rec, jdir = jobs / f"{jid}.json", jobs / str(jid)
    out = jdir / job["stdout"].rsplit("/", 1)[-1]
    assert job["stdout"] == str(out)  # the default output, in the job's directory
    for path, uid, mode in ((jobs, 0, 0o700), (rec, 0, 0o600), (jobs / ".next", 0, 0o600),
                            (jdir, NOBODY, 0o700), (out, NOBODY, 0o600)):
        st = os.lstat(path)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, mode), path
    assert out.read_text() == "out-of-nobody\n"
    fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in (rec, out)]
    try:
        rec_fd, out_fd = fds
        # Another host user: neither the record nor the output, by its inode alone.
        assert as_user(DAEMON, lambda: reopen_errno(rec_fd)) == errno.EACCES
        assert as_user(DAEMON, lambda: reopen_errno(out_fd)) == errno.EACCES
        # The owner: its output, not the record (root's, which root processes trust).
        assert as_user(NOBODY, lambda: reopen_errno(out_fd)) == 0
        assert as_user(NOBODY, lambda: reopen_errno(rec_fd)) == errno.EACCES
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("argv", [["jobs"], ["jobs", "--all", "--json"], ["logs", "1"],
                                  ["wait", "1"]])
def test_a_plain_user_reading_records_gets_one_line(box, argv, tmp_path):  # noqa: F811
    """As nobody without the daemon: exit 1 and one line saying the daemon is not running;
    below the CLI, the records themselves refuse nobody with one line saying they are
    root's (whether the jobs directory or a record refuses), never a traceback."""
    prog = script(box, "hello.sh", "#!/bin/sh\necho hi\n")
    res = box.envctl("submit-job", "--user", "root", "box", prog)
    assert res.returncode == 0, res.stderr
    code, _ = wait(box, int(res.stdout.strip()))
    assert code == 0
    err_path = tmp_path / "err"
    err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # root's, inherited
    env = box.env()

    def run() -> int:
        from envctl.cli import main

        os.environ.update({k: v for k, v in env.items() if k.startswith("ENVCTL_")})
        os.dup2(err_fd, 2)
        sys.stderr = os.fdopen(2, "w", closefd=False)
        try:
            main(argv)
        except SystemExit as exc:
            sys.stderr.flush()
            return int(exc.code or 0)
        return 0

    code = as_user(NOBODY, run)
    os.close(err_fd)
    err = err_path.read_text()
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "daemon is not running" in lines[0], err

    def read_directly() -> int:
        from envctl.errors import NeedsRootError
        from envctl.runtime import jobs as jb

        state = Path(env["ENVCTL_STATE_DIR"])
        try:
            jb.get(state, 1) if argv[0] != "jobs" else jb.listing(state, "", finished=True)
        except NeedsRootError as exc:
            return 3 if "root's alone" in str(exc) else 4
        return 0

    assert as_user(NOBODY, read_directly) == 3
