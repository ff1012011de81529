"""The credentials switch for file access (host/asuser.py): whose rights `submitter` picks,
that a switched open is refused what the user may not read, and that the process is root again
afterwards — groups, fs ids, dumpable — even when the block raises. The switch itself needs
root: those tests are marked."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from envctl.host import asuser
from envctl.host.asuser import ROOT, Creds, as_user, open_as, submitter

NOBODY = 65534


def fs_ids() -> tuple[int, int]:
    """(fsuid, fsgid) of this thread, as /proc says (the 4th field of Uid: and Gid:)."""
    fields = {}
    with open("/proc/thread-self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = rest.split()
    return int(fields["Uid"][3]), int(fields["Gid"][3])


def dumpable() -> int:
    return asuser.libc.prctl(asuser.PR_GET_DUMPABLE, 0, 0, 0, 0)


# ---------------------------------------------------------------- who


def test_submitter_is_the_sudo_user_with_the_hosts_groups(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os, "getgrouplist", lambda name, gid: [gid, 27, 100])
    name = pwd.getpwuid(NOBODY).pw_name
    got = submitter({"SUDO_UID": str(NOBODY), "SUDO_GID": "1234", "SUDO_USER": name})
    assert got == Creds(NOBODY, 1234, (27, 100))
    # No SUDO_GID: the uid's number, as sudo's own default group would be looked up.
    assert submitter({"SUDO_UID": str(NOBODY)}).gid == NOBODY


def test_submitter_is_root_without_sudo_or_behind_sudo_of_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert submitter({}) == ROOT
    assert submitter({"SUDO_UID": "0", "SUDO_GID": "0"}) == ROOT
    assert submitter({"SUDO_UID": "x"}) == ROOT


def test_an_unknown_uid_has_no_supplementary_groups():
    assert asuser.host_groups(2_000_000_123, 5) == ()


def test_no_switch_for_root_none_or_a_process_that_is_not_root(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "setgroups", lambda g: calls.append(g))
    with as_user(None), as_user(ROOT), as_user((0, 5, (6,))):
        pass
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with as_user(Creds(NOBODY, NOBODY)):
        pass
    assert calls == []  # its own rights bound a process that is not root already


# ---------------------------------------------------------------- the switch (root)


root = pytest.mark.root


@pytest.fixture
def pub():
    """A directory nobody can walk to (pytest's own tmp_path sits below a 0700 one)."""
    d = Path(tempfile.mkdtemp(prefix="envctl-asuser-", dir="/var/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@root
def test_a_switched_open_has_the_users_rights_only(pub):
    tmp_path = pub
    secret = tmp_path / "secret"
    secret.write_text("root only")
    os.chmod(secret, 0o600)
    group = tmp_path / "group"
    group.write_text("for group 4242")
    os.chown(group, 0, 4242)
    os.chmod(group, 0o640)
    with pytest.raises(PermissionError):
        open_as(Creds(NOBODY, NOBODY), secret, os.O_RDONLY)
    # Through a symlink too: followed only with the user's rights.
    (tmp_path / "link").symlink_to(secret)
    with pytest.raises(PermissionError):
        open_as(Creds(NOBODY, NOBODY), tmp_path / "link", os.O_RDONLY)
    # A supplementary group counts; the primary is one too.
    with pytest.raises(PermissionError):
        open_as(Creds(NOBODY, NOBODY), group, os.O_RDONLY)
    for creds in (Creds(NOBODY, NOBODY, (4242,)), Creds(NOBODY, 4242)):
        fd = open_as(creds, group, os.O_RDONLY)
        assert os.read(fd, 100) == b"for group 4242"
        os.close(fd)
    # A file made in the block is the user's.
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    fd = open_as(Creds(NOBODY, NOBODY), home / "new", os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    st = os.stat(home / "new")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, 0o600)
    # And root again: root's file opens.
    os.close(os.open(secret, os.O_RDONLY))


@root
def test_everything_is_given_back_even_when_the_block_raises():
    groups, ids, was = sorted(os.getgroups()), fs_ids(), dumpable()
    with pytest.raises(ZeroDivisionError), as_user(Creds(NOBODY, NOBODY, (4242, 4243))):
        assert fs_ids() == (NOBODY, NOBODY)
        assert sorted(os.getgroups()) == [4242, 4243, NOBODY]
        1 / 0  # noqa: B018
    assert (sorted(os.getgroups()), fs_ids()) == (groups, ids)
    assert dumpable() == was  # the kernel clears it when the fsuid changes: set back


@root
def test_a_switch_the_kernel_did_not_take_is_refused(monkeypatch):
    ids = fs_ids()
    real = asuser._fsuid

    def ignoring(uid: int) -> int:  # a setfsuid that changes nothing (as without CAP_SETUID)
        return real(0xFFFFFFFF)

    monkeypatch.setattr(asuser, "_fsuid", ignoring)
    with pytest.raises(asuser.SwitchFailed), as_user(Creds(NOBODY, NOBODY)):
        pytest.fail("the block ran under ids that were not taken")
    monkeypatch.undo()
    assert fs_ids() == ids
