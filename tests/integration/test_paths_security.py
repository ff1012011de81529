"""Paths a host user or a job controls, attacked through the CLI on the real kernel: envctl
(root, "via sudo" by nobody: SUDO_UID/SUDO_GID/SUDO_USER in its environment) must never open
or delete such a path with root's rights. A program symlinked to a root-only file is refused
and nothing is staged; `--output` at a root-only file, a symlink, a device or a FIFO is
refused and the file is untouched; `logs` after the job's owner swapped its output for a
symlink (or a FIFO) refuses instead of printing root's file; `down --purge` of a data
directory with symlinks planted by a job deletes the links, never what they point at; the
data and rootfs directories are root's alone and the tree holds no set-id file. Each test
ends with the residue check."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from tests.integration.test_jobs import assert_clean_down, script, wait

pytestmark = pytest.mark.root

NOBODY = 65534
AS_NOBODY = {"SUDO_UID": str(NOBODY), "SUDO_GID": str(NOBODY), "SUDO_USER": "nobody"}
SECRET = "TOP-SECRET root only\n"

SPEC = """
name: box
kind: cpu
rootfs:
  binaries: [sh, cat, echo, mount]
mounts:
  - {source: scratch, target: /scratch}
resources:
  memory: {max: 64M}
"""


@pytest.fixture
def box(sandbox):
    """The sandbox with environment `box` up, with a data directory at /scratch."""
    sandbox.write_spec("box", SPEC)
    res = sandbox.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    yield sandbox
    if sandbox.proc.poll() is None:
        sandbox.envctl("down", "box", "--force", "--purge")


@pytest.fixture
def pub():
    """A directory every host user can walk (the sandbox's own sits below root's 0700
    /tmp/pytest-of-root): the host user's files, and root's secret among them."""
    d = Path(tempfile.mkdtemp(prefix="envctl-paths-", dir="/var/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def secret(d: Path, name: str = "secret") -> Path:
    """A root-owned 0600 file, as /etc/shadow is."""
    p = d / name
    p.write_text(SECRET)
    os.chown(p, 0, 0)
    os.chmod(p, 0o600)
    return p


def nobodys(d: Path, name: str) -> Path:
    """A directory of nobody's (0755) in `d`."""
    p = d / name
    p.mkdir()
    os.chown(p, NOBODY, NOBODY)
    return p


def as_nobody(fn, dir_fd: int | None = None) -> None:
    """Run `fn(dir_fd)` in a child that is nobody, with no capability: what the job's owner
    can do on the host. The sandbox's state sits below root's 0700 directories, so the
    child gets a descriptor of the directory it acts in, as nobody could reach it by a
    path of its own on a real host (/var/lib/envctl/jobs is 0755)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            fn(dir_fd)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the attacker's step failed"


def unchanged(p: Path, before: os.stat_result) -> bool:
    now = os.stat(p)
    return (p.read_text() == SECRET and now.st_size == before.st_size
            and now.st_mtime_ns == before.st_mtime_ns and now.st_uid == 0
            and stat.S_IMODE(now.st_mode) == 0o600)


def job_dirs(sb) -> list[str]:
    d = sb.state / "jobs"
    return sorted(n for n in os.listdir(d) if not n.startswith(".")) if d.is_dir() else []


def leaked(sb) -> list[str]:
    """Files under the state directory that hold the secret."""
    out = []
    for p in sb.state.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file() and not p.is_symlink() and SECRET.encode() in p.read_bytes():
                out.append(str(p))
    return out


# ---------------------------------------------------------------- the program


def test_a_program_symlinked_to_a_root_only_file_is_refused_and_not_staged(box, pub):
    sb = box
    shadow = secret(pub)
    (pub / "x.py").symlink_to(shadow)
    (pub / "shadow.sh").symlink_to("/etc/shadow")
    hidden = pub / "hidden"
    hidden.mkdir(mode=0o700)
    inner = script(sb, "inner.sh", "#!/bin/sh\necho inner\n")
    shutil.copy(inner, hidden / "inner.sh")
    for prog in (pub / "x.py", pub / "shadow.sh", hidden / "inner.sh"):
        res = sb.envctl("submit-job", "box", str(prog), env=AS_NOBODY)
        assert res.returncode == 2, (prog, res.stdout, res.stderr)
        assert "Permission denied" in res.stderr and "uid 65534" in res.stderr, res.stderr
        assert "TOP-SECRET" not in res.stdout + res.stderr
    assert job_dirs(sb) == []  # no id taken, nothing staged
    assert leaked(sb) == []

    # A symlink to a file nobody can read is followed as nobody would: staged, and run.
    mine = pub / "mine.sh"
    mine.write_text("#!/bin/sh\necho mine\n")
    os.chmod(mine, 0o755)
    (pub / "link.sh").symlink_to(mine)
    res = sb.envctl("submit-job", "--json", "box", str(pub / "link.sh"), env=AS_NOBODY)
    assert res.returncode == 0, res.stderr
    job = json.loads(res.stdout)
    rc, (done,) = wait(sb, job["id"])
    assert rc == 0 and done["uid"] == NOBODY
    jdir = sb.state / "jobs" / str(job["id"])
    st = os.stat(jdir)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0o700)
    for name in ("stdout", "stderr"):
        st = os.stat(jdir / name)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0o600)
    assert os.stat(jdir / "link.sh").st_uid == NOBODY
    assert sb.envctl("logs", str(job["id"]), env=AS_NOBODY).stdout == "mine\n"
    assert_clean_down(sb, data=("scratch",))


# ---------------------------------------------------------------- --output / --error


def test_outputs_at_a_root_file_a_symlink_a_device_or_a_fifo_are_refused(box, pub):
    sb = box
    prog = pub / "talk.sh"
    prog.write_text("#!/bin/sh\necho written\n")
    os.chmod(prog, 0o755)
    shadow = secret(pub)
    before = os.stat(shadow)
    home = nobodys(pub, "home")
    (home / "link").symlink_to(shadow)
    os.lchown(home / "link", NOBODY, NOBODY)  # even the user's own symlink is not followed
    dev = pub / "null"
    os.mknod(dev, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    fifo = home / "fifo"
    os.mkfifo(fifo, 0o666)
    os.chown(fifo, NOBODY, NOBODY)
    for opt, path, words in [
        ("--output", shadow, "Permission denied"),
        ("--error", shadow, "Permission denied"),
        ("--output", home / "link", "symlink"),
        ("--output", dev, "not a regular file"),
        ("--error", fifo, "not a regular file"),
    ]:
        res = sb.envctl("submit-job", opt, str(path), "box", str(prog), env=AS_NOBODY,
                        timeout=30)
        assert res.returncode == 2 and words in res.stderr, (opt, path, res.stderr)
    # The root job too: a device or a FIFO is no output, whoever runs the job.
    for path in (dev, fifo):
        res = sb.envctl("submit-job", "--user", "root", "-o", str(path), "box", str(prog),
                        timeout=30)
        assert res.returncode == 2 and "not a regular file" in res.stderr, res.stderr
    # A root job asked for through sudo: its outputs are opened with the sudo user's rights.
    res = sb.envctl("submit-job", "--user", "root", "-o", str(shadow), "box", str(prog),
                    env=AS_NOBODY)
    assert res.returncode == 2 and "Permission denied" in res.stderr, res.stderr
    assert unchanged(shadow, before)
    assert os.stat(dev).st_rdev == os.makedev(1, 3) and os.path.islink(home / "link")
    assert job_dirs(sb) == []  # refused before an id was taken

    # An output where nobody may write: made there, nobody's.
    out = home / "out.log"
    res = sb.envctl("submit-job", "--json", "-o", str(out), "box", str(prog), env=AS_NOBODY)
    assert res.returncode == 0, res.stderr
    rc, _ = wait(sb, json.loads(res.stdout)["id"])
    assert rc == 0 and out.read_text() == "written\n" and os.stat(out).st_uid == NOBODY
    assert_clean_down(sb, data=("scratch",))


# ---------------------------------------------------------------- logs


def test_logs_refuse_an_output_the_jobs_owner_swapped_for_a_symlink_or_fifo(box, pub):
    sb = box
    shadow = secret(pub)
    prog = pub / "hello.sh"
    prog.write_text("#!/bin/sh\necho hello\necho oops >&2\n")
    os.chmod(prog, 0o755)
    home = nobodys(pub, "home")
    res = sb.envctl("submit-job", "--json", "box", str(prog), env=AS_NOBODY)
    assert res.returncode == 0, res.stderr
    in_dir = json.loads(res.stdout)
    res = sb.envctl("submit-job", "--json", "-o", str(home / "out"), "box", str(prog),
                    env=AS_NOBODY)
    assert res.returncode == 0, res.stderr
    elsewhere = json.loads(res.stdout)
    rc, _ = wait(sb, in_dir["id"], elsewhere["id"])
    assert rc == 0
    assert sb.envctl("logs", str(in_dir["id"])).stdout == "hello\n"
    assert sb.envctl("logs", str(elsewhere["id"])).stdout == "hello\n"

    # The job's owner (not the job: /job is read-only inside) swaps its outputs.
    jdir = os.open(sb.state / "jobs" / str(in_dir["id"]), os.O_RDONLY | os.O_DIRECTORY)
    try:
        def swap(fd: int) -> None:
            os.unlink("stdout", dir_fd=fd)
            os.symlink(str(shadow), "stdout", dir_fd=fd)
            os.unlink("stderr", dir_fd=fd)
            os.mkfifo("stderr", 0o600, dir_fd=fd)
            os.unlink(str(home / "out"))
            os.symlink(str(shadow), str(home / "out"))
        as_nobody(swap, jdir)
    finally:
        os.close(jdir)
    for args in ([str(in_dir["id"])], ["-f", str(in_dir["id"])], [str(elsewhere["id"])],
                 ["-f", str(elsewhere["id"])]):
        res = sb.envctl("logs", *args, env=AS_NOBODY, timeout=30)
        assert res.returncode == 1 and "symlink" in res.stderr, (args, res.stderr)
        assert "TOP-SECRET" not in res.stdout
    res = sb.envctl("logs", "--stderr", str(in_dir["id"]), timeout=30)
    assert res.returncode == 1 and "not a regular file" in res.stderr, res.stderr
    assert unchanged(shadow, os.stat(shadow))
    assert_clean_down(sb, data=("scratch",))


# ---------------------------------------------------------------- down --purge, modes


def test_purge_deletes_planted_symlinks_never_their_targets(box, pub):
    sb = box
    victim = pub / "victim"
    (victim / "deep").mkdir(parents=True)
    (victim / "marker").write_text("keep me\n")
    (victim / "deep" / "marker").write_text("keep me too\n")
    data = sb.state / "data" / "box" / "scratch"
    # What a job writes into its data directory (planted from the host, as the job's owner
    # or the job could: which uid root inside is depends on the environment's user namespace).
    (data / "a" / "b").mkdir(parents=True)
    (data / "a" / "b" / "f").write_text("data")
    (data / "a" / "link").symlink_to(victim)
    (data / "top").symlink_to(victim / "deep")
    (data / "a" / "b" / "root").symlink_to("/")
    assert os.path.islink(data / "a" / "link") and os.path.islink(data / "top")
    # The data and rootfs directories: root's alone on the host.
    for d in (sb.state / "data", sb.state / "rootfs"):
        st = os.stat(d)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700), d
    # No set-id file in the tree (mount is setuid root on the host).
    for p in (sb.state / "rootfs" / "box").rglob("*"):
        st = os.lstat(p)
        assert not (stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID)), p
    assert any(p.name == "mount" for p in (sb.state / "rootfs" / "box").rglob("mount"))
    res = sb.envctl("down", "box", "--purge")
    assert res.returncode == 0, res.stderr
    assert (victim / "marker").read_text() == "keep me\n"
    assert (victim / "deep" / "marker").read_text() == "keep me too\n"
    assert not (sb.state / "data").exists()
    residue = sb.residue()
    assert residue.pop("state_dir", None) in (["jobs", "lock"], None), residue
    assert residue == {}, residue


def test_removal_beneath_never_goes_through_a_symlinked_component(tmp_path):
    """The chain `<state>/data/ENV/NAME`: a symlink for any directory on the way is refused
    (nothing deleted); the last one, a symlink itself, is unlinked, never followed."""
    from envctl.host.safepath import Escape
    from envctl.resources.dirs import _remove_beneath

    state, victim = tmp_path / "state", tmp_path / "victim"
    (victim / "NAME").mkdir(parents=True)
    (victim / "NAME" / "marker").write_text("x")
    (state / "data").mkdir(parents=True)
    (state / "data" / "ENV").symlink_to(victim)
    with pytest.raises(Escape):
        _remove_beneath(state, "data/ENV/NAME")
    assert (victim / "NAME" / "marker").exists()
    (state / "data" / "ENV").unlink()
    (state / "data" / "ENV").mkdir()
    (state / "data" / "ENV" / "NAME").symlink_to(victim / "NAME")
    _remove_beneath(state, "data/ENV/NAME")
    assert not os.path.lexists(state / "data" / "ENV" / "NAME")
    assert (victim / "NAME" / "marker").exists()
    tree = state / "data" / "ENV" / "NAME"
    (tree / "x" / "y").mkdir(parents=True)
    (tree / "x" / "y" / "out").symlink_to(victim)
    (tree / "x" / "f").write_text("data")
    _remove_beneath(state, "data/ENV/NAME")
    assert not tree.exists() and (victim / "NAME" / "marker").exists()
    with pytest.raises(FileNotFoundError):
        _remove_beneath(state, "data/ENV/NAME")
