"""The rootfs tree against the real kernel: a real SIGKILL at every placement, hard links that
protected_hardlinks refuses an unprivileged user, and copies that keep their owner and setuid
bit. Temporary directories only; no namespace is needed (nothing is mounted)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from envctl.host.context import Host
from envctl.resources import rootfs as mod
from envctl.resources.base import Status
from envctl.resources.rootfs import RootfsTree
from tests.unit.test_rootfs import BASH, DIRS, GENERATED, MERGED, PLACEHOLDERS, _libz, covered

REPO = Path(__file__).resolve().parents[2]


def _resource(root: Path, **kw) -> RootfsTree:
    fields = {"links": MERGED, "files": ((BASH, BASH, ""),) + _libz(), "generated": GENERATED,
              "dirs": DIRS, "placeholders": PLACEHOLDERS}
    fields.update(kw)
    return RootfsTree("demo", str(root), **fields)


CHILD = """
import json, os, signal, sys
from pathlib import Path
from envctl.host.context import Host
from envctl.resources import rootfs as mod
from envctl.resources.base import Resource

res = Resource.from_dict(json.loads(sys.argv[1]))
point, n = sys.argv[2], int(sys.argv[3])
real, count = getattr(mod, point), [0]

def placing(*a, **k):
    if count[0] == n:
        os.kill(os.getpid(), signal.SIGKILL)
    count[0] += 1
    return real(*a, **k)

setattr(mod, point, placing)
host = Host(state_dir=Path(sys.argv[4]))
res.apply(host, res.snapshot(host))
"""


@pytest.mark.parametrize("point, n", [("_commit", n) for n in range(11)]
                         + [("_ensure", n) for n in range(0, 30, 3)])
def test_a_kill_9_anywhere_leaves_a_manifest_covering_the_tree(tmp_path, point, n):
    """apply dies at every commit of its 11 files and links (between the temporary file and
    its rename) and at every third of its 30 entries."""
    root = tmp_path / "roots" / "demo"
    host = Host(state_dir=tmp_path / "state")
    res = _resource(root)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(res.to_dict()), point, str(n),
             str(host.state_dir)], env={**os.environ, "PYTHONPATH": str(REPO / "src")},
            capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        where = host.state_dir / "rootfs/demo.json"
        listed = set(json.loads(where.read_text())["paths"])
        assert root.is_dir() and covered(root, listed) == []
        if point == "_commit":  # killed between the placed temporary and its rename
            assert any(p.endswith(mod.TMP_SUFFIX) for p in _names(root))
        # The next up finishes the tree; down takes away all of it, temporaries included.
        res.apply(host, {"existed": False, "root": str(root)})
        assert res.check(host).status is Status.PRESENT
        assert not any(p.endswith(mod.TMP_SUFFIX) for p in _names(root))
        res.remove(host, {"existed": False, "root": str(root)})
        assert not (tmp_path / "roots").exists() and not where.exists()
    finally:
        shutil.rmtree(tmp_path / "roots", ignore_errors=True)


def _names(root: Path) -> list[str]:
    return [n for _, dirs, files in os.walk(root) for n in dirs + files]


NOBODY = 65534


@pytest.mark.root
def test_an_unprivileged_user_gets_copies_where_protected_hardlinks_refuses_a_link():
    """As a user who neither owns /usr/bin/bash nor may write it, link(2) fails with EPERM
    (fs.protected_hardlinks); the tree gets a copy with the source's mode and mtime."""
    if Path("/proc/sys/fs/protected_hardlinks").read_text().strip() != "1":
        pytest.skip("fs.protected_hardlinks is off")
    base = Path(tempfile.mkdtemp(prefix="envctl-rootfs-"))
    try:
        os.chmod(base, 0o755)
        for d in ("state", "roots"):
            (base / d).mkdir()
            os.chown(base / d, NOBODY, NOBODY)
        root = base / "roots" / "demo"
        res = _resource(root)
        if os.stat(BASH).st_dev != os.stat(base).st_dev:
            pytest.skip(f"{BASH} and {base} are on different filesystems: copied anyway")
        # The adapters apply() imports lazily, loaded before the privileges go.
        import envctl.host.files  # noqa: F401
        import envctl.host.safepath  # noqa: F401

        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: drop to nobody (and with it every capability), then apply
            try:
                os.close(read)
                os.setgroups([])
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
                host = Host(state_dir=base / "state")
                res.apply(host, res.snapshot(host))
                out = {"check": res.check(host).status.name}
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                out = {"error": repr(exc)}
            os.write(write, json.dumps(out).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            out = json.loads(f.read())
        os.waitpid(pid, 0)
        assert out == {"check": "PRESENT"}
        placed, source = os.lstat(root / "usr/bin/bash"), os.stat(BASH)
        assert placed.st_ino != source.st_ino  # a copy, not the host's inode
        assert (placed.st_size, placed.st_mtime_ns, stat.S_IMODE(placed.st_mode)) == (
            source.st_size, source.st_mtime_ns, stat.S_IMODE(source.st_mode))
        assert placed.st_uid == NOBODY  # chown refused: the copy is the user's
        res.remove(Host(state_dir=base / "state"), {"existed": False})
        assert not root.exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.root
def test_a_copy_keeps_its_owner_and_drops_the_setuid_bit(tmp_path):
    """A copy keeps its owner and mode, but never a set-id bit: inside, no_new_privs makes
    them worthless, and on the host they would make the tree's copy one more set-id
    program."""
    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm is on the same filesystem as the temporary directory")
    src = tmp_path / "helper"
    src.write_bytes(b"\x7fELF helper")
    os.chown(src, 1234, 2345)
    os.chmod(src, 0o4755)
    base = Path(tempfile.mkdtemp(prefix="envctl-rootfs-", dir="/dev/shm"))
    try:
        root = base / "demo"
        host = Host(state_dir=tmp_path / "state")
        res = _resource(root, files=(("/usr/bin/helper", str(src), ""),))
        res.apply(host, res.snapshot(host))
        placed = os.lstat(root / "usr/bin/helper")
        assert (placed.st_uid, placed.st_gid, stat.S_IMODE(placed.st_mode)) == (1234, 2345,
                                                                                0o755)
        assert placed.st_ino != src.stat().st_ino
        assert res.check(host).status is Status.PRESENT
        res.remove(host, {"existed": False})
        assert not root.exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)
