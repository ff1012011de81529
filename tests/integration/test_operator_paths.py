"""Operator-named host paths (a data mount's absolute source, rootfs.files sources) reached
only through directories and symlinks root alone controls, on the real kernel: a source below
a directory a host user owns, where that user planted a symlink to a root-only directory, is
refused by `plan` and `up` (exit 2, the field named, nothing made, the target untouched); the
same path reached through a root-owned symlink (/data -> /srv/data) is bound and works; and
the resolver, the bind's source and the creation of a missing source refuse the chain on
their own, for a swap made after `plan` looked. Each CLI test ends with the residue check."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

NOBODY = 65534


@pytest.fixture
def pub():
    """A root-owned 0755 directory outside the sandbox's tmp_path (in sticky /var/tmp), in
    which the tests make a host user's directory and root's own ones."""
    d = Path(tempfile.mkdtemp(prefix="envctl-oppaths-", dir="/var/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def victim(pub: Path) -> Path:
    """A root-only directory standing in for /etc or /root, with a marker file."""
    v = pub / "victim"
    v.mkdir(mode=0o700)
    (v / "shadow").write_text("root only\n")
    return v


def users_dir(pub: Path) -> Path:
    """A directory a host user (nobody) owns: what it holds is that user's doing."""
    u = pub / "home"
    u.mkdir()
    os.chown(u, NOBODY, NOBODY)
    return u


def spec(source: str, *, create: bool = False) -> str:
    return f"""
name: opp
kind: cpu
rootfs:
  binaries: [sh, cat, echo]
mounts:
  - {{source: {source}, target: /data, create: {str(create).lower()}}}
resources:
  memory: {{max: 64M}}
"""


def test_a_source_through_a_users_directory_is_refused_before_anything_changes(sandbox, pub):
    sb = sandbox
    v = victim(pub)
    home = users_dir(pub)
    # The user's planted symlink: root's bind would give the partition the victim read-write.
    os.symlink(v, home / "data")
    os.lchown(home / "data", NOBODY, NOBODY)
    before = sorted(os.listdir(v))
    sb.write_spec("opp", spec(str(home / "data")))
    for cmd in ("plan", "up"):
        res = sb.envctl(cmd, "opp")
        assert res.returncode == 2, (cmd, res.stdout, res.stderr)
        assert "mounts" in res.stderr and "source" in res.stderr, res.stderr
        assert f"{home} is owned by uid {NOBODY}, not root" in res.stderr, res.stderr
        first = res.stderr.strip().splitlines()[0]
        assert first.startswith("error: ") and "opp.yaml:7:" in first, res.stderr
        assert "nothing was changed" in res.stderr, res.stderr
    assert sorted(os.listdir(v)) == before
    assert sb.journals() == [] and sb.netns() == []
    assert sb.residue() == {}, sb.residue()
    # create: true below the user's directory: nothing is made in it either.
    sb.write_spec("opp", spec(str(home / "made" / "here"), create=True))
    res = sb.envctl("up", "opp")
    assert res.returncode == 2, res.stderr
    assert not os.path.lexists(home / "made")
    assert sb.residue() == {}, sb.residue()


def test_a_root_owned_symlink_to_the_source_is_followed(sandbox, pub):
    sb = sandbox
    real = pub / "srv" / "data"
    real.mkdir(parents=True)
    (pub / "data").symlink_to(real)  # /data -> /srv/data, made by root
    sb.write_spec("opp", spec(str(pub / "data")))
    res = sb.envctl("up", "opp")
    assert res.returncode == 0, res.stderr
    try:
        (real / "f").write_text("through\n")
        res = sb.envctl("exec", "opp", "--user", "root", "--", "cat", "/data/f")
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "through"
    finally:
        res = sb.envctl("down", "opp")
    assert res.returncode == 0, res.stderr
    assert sb.residue() == {}, sb.residue()


def test_the_resolver_follows_only_root_controlled_chains(pub):
    from envctl.host.safepath import (
        NotRootControlled,
        open_root_controlled,
        resolve_root_controlled,
    )

    v = victim(pub)
    home = users_dir(pub)
    os.symlink(v, home / "link")
    # Through a user's directory: refused, whatever the symlink's owner.
    with pytest.raises(NotRootControlled, match="owned by uid 65534"):
        open_root_controlled(str(home / "link"))
    # A user's directory as the source itself is fine: it is bound as the object it is.
    fd = open_root_controlled(str(home), directory=True)
    assert os.path.samestat(os.fstat(fd), os.stat(home))
    os.close(fd)
    # A group-writable root directory on the way: refused.
    gw = pub / "gw"
    gw.mkdir()
    os.chmod(gw, 0o775)
    (gw / "sub").mkdir()
    with pytest.raises(NotRootControlled, match="writable by group"):
        open_root_controlled(str(gw / "sub"))
    # A sticky world-writable directory: root's entry is fine, a user's symlink is not, and
    # a missing name is refused (the user could make it a symlink first).
    sticky = pub / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    (sticky / "roots").mkdir()
    os.symlink(v, sticky / "users")
    os.lchown(sticky / "users", NOBODY, NOBODY)
    os.close(open_root_controlled(str(sticky / "roots")))
    with pytest.raises(NotRootControlled):
        open_root_controlled(str(sticky / "users"))
    with pytest.raises(NotRootControlled):
        resolve_root_controlled(str(sticky / "missing"))
    # A root symlink chain, relative and absolute, ends at the real directory; a missing tail
    # is reported below the deepest root-controlled directory.
    (pub / "a").symlink_to("srv2/../srv2/real")
    (pub / "srv2" / "real").mkdir(parents=True)
    (pub / "b").symlink_to(pub / "a")
    fd, missing = resolve_root_controlled(str(pub / "b" / "x" / "y"))
    assert os.path.samestat(os.fstat(fd), os.stat(pub / "srv2" / "real"))
    assert missing == ["x", "y"]
    os.close(fd)
    # A symlink loop ends with ELOOP, not a hang.
    (pub / "loop").symlink_to("loop")
    with pytest.raises(OSError, match="too many symlinks"):
        resolve_root_controlled(str(pub / "loop"))


def test_the_bind_source_and_a_missing_source_refuse_a_chain_swapped_after_plan(tmp_path, pub):
    """What `up` does after `plan` looked: the bind opens its source through the resolver, and
    a missing source is made under the resolver's descriptor, never by path."""
    from envctl.errors import HostError
    from envctl.host import mounts as m
    from envctl.host.context import Host
    from envctl.resources.dirs import SharedDirectory

    v = victim(pub)
    home = users_dir(pub)
    os.symlink(v, home / "data")
    with pytest.raises(OSError, match="owned by uid 65534"):
        m.open_source(str(home / "data"))
    host = Host(state_dir=tmp_path / "state", run_dir=tmp_path / "run")
    res = SharedDirectory("host", str(home / "data" / "new").lstrip("/"), 0o755, keep=True)
    with pytest.raises(HostError, match="does not go through as root"):
        res.apply(host, res.snapshot(host))
    assert not (v / "new").exists()
    ok = SharedDirectory("host", str(pub / "made" / "deep").lstrip("/"), 0o755, keep=True)
    ok.apply(host, ok.snapshot(host))
    assert (pub / "made" / "deep").is_dir()


def test_a_host_data_directory_envctl_made_is_purged_after_a_second_up(sandbox, pub):
    """up (makes /srv/data/new), down (keeps it), up (finds it: envctl's, by its record),
    down --purge: deleted with what the job wrote and the parents made for it. One that was
    there before envctl survives the same sequence."""
    sb = sandbox
    made = pub / "srv" / "new"
    theirs = pub / "theirs"
    theirs.mkdir()
    (theirs / "keep").write_text("theirs\n")
    for source in (made, theirs):
        sb.write_spec("opp", spec(str(source), create=True))
        res = sb.envctl("up", "opp")
        assert res.returncode == 0, res.stderr
        assert source.is_dir()
        res = sb.envctl("exec", "opp", "--user", "root", "--", "sh", "-c", "echo ok")
        assert res.returncode == 0, res.stderr
        res = sb.envctl("down", "opp")
        assert res.returncode == 0, res.stderr
        assert source.is_dir()
        (source / "written").write_text("by a job\n")
        res = sb.envctl("up", "opp")
        assert res.returncode == 0, res.stderr
        res = sb.envctl("down", "opp", "--purge")
        assert res.returncode == 0, res.stderr
        assert sb.residue() == {}, sb.residue()
    assert not (pub / "srv").exists(), "the data directory envctl made was kept by --purge"
    assert (theirs / "keep").read_text() == "theirs\n" and (theirs / "written").exists()
