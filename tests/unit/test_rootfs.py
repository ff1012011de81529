"""The rootfs tree on disk: assembled incrementally from host files, checked read-only, owned
through its manifest, and never a write, chmod or delete outside it. Temporary directories
only; no root needed (as an ordinary user host files are copied where a hard link is refused)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from envctl.engine.engine import Engine
from envctl.errors import ForeignObject, HostError, InputError, StepFailed
from envctl.facts import PlacedFile
from envctl.host.context import Host
from envctl.resources import rootfs as mod
from envctl.resources.base import Resource, Status
from envctl.resources.dirs import Directory
from envctl.resources.rootfs import RootfsTree, placed_files

MERGED = (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin"))
LIBDIR = "/usr/lib/x86_64-linux-gnu"
BASH = "/usr/bin/bash"


def _libz() -> tuple[tuple[str, str, str], ...]:
    """The host's libz soname symlink and the file it names."""
    link = f"{LIBDIR}/libz.so.1"
    if not os.path.islink(link) or not os.path.isfile(BASH):
        pytest.skip(f"this host has no {link} symlink or {BASH}")
    text = os.readlink(link)
    real = os.path.join(LIBDIR, text)
    return ((link, link, text), (real, real, ""))


GENERATED = (("/etc/hostname", "demo\n", 0o644), ("/etc/passwd", "root:x:0:0::/root:/bin/sh\n",
                                                  0o644), ("/etc/environment", "A=1\n", 0o600))
DIRS = (("/var/log", 0o755), ("/opt/data/input", 0o750), ("/usr/lib/python3.11", 0o755))
PLACEHOLDERS = (f"{LIBDIR}/libcuda.so.1",)


@pytest.fixture
def host(tmp_path):
    return Host(state_dir=tmp_path / "state", run_dir=tmp_path / "run")


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "roots" / "demo"
    yield r
    # Hard links of host files must not outlive the test in /tmp.
    shutil.rmtree(tmp_path / "roots", ignore_errors=True)


def make(root: Path, *, env: str = "demo", **kw) -> RootfsTree:
    fields = {"links": MERGED, "files": ((BASH, BASH, ""),) + _libz(), "generated": GENERATED,
              "dirs": DIRS, "placeholders": PLACEHOLDERS}
    fields.update(kw)
    return RootfsTree(env, str(root), **fields)


def up(res: RootfsTree, host: Host) -> dict:
    memo = res.snapshot(host)
    assert res.refuses(memo) == ""
    res.apply(host, memo)
    return memo


def manifest(host: Host, env: str = "demo") -> dict | None:
    p = host.state_dir / "rootfs" / f"{env}.json"
    return json.loads(p.read_text()) if p.exists() else None


def tree(root: Path) -> dict[str, os.stat_result]:
    """Every path under `root` ('/usr/bin/bash') with its lstat."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            out["/" + os.path.relpath(p, root)] = os.lstat(p)
    return out


def covered(root: Path, listed: set[str]) -> list[str]:
    """Paths on disk that the manifest does not cover (its entries and their temporaries)."""
    tmps = {f"{p.rpartition('/')[0]}/{mod._tmp_name(p.rpartition('/')[2])}" for p in listed}
    return sorted(p for p in tree(root) if p not in listed and p not in tmps)


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """A hard link of the source, or a copy with its size, mtime and mode."""
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) or (
        a.st_size, a.st_mtime_ns, stat.S_IMODE(a.st_mode)) == (
        b.st_size, b.st_mtime_ns, stat.S_IMODE(b.st_mode))


# ---------------------------------------------------------------- assembling


def test_assembles_host_files_generated_files_directories_and_placeholders(host, root):
    res = make(root)
    assert res.check(host).status is Status.ABSENT
    memo = up(res, host)
    assert memo == {"existed": False, "root": str(root)}
    assert res.check(host).status is Status.PRESENT

    assert same_file(os.stat(root / "usr/bin/bash"), os.stat(BASH))
    (link, _, text), (real, _, _) = _libz()
    assert os.readlink(root / link.lstrip("/")) == text
    assert same_file(os.lstat(root / real.lstrip("/")), os.stat(real))
    assert os.readlink(root / "bin") == "usr/bin" and os.readlink(root / "lib64") == "usr/lib64"
    for d in ("usr/bin", "usr/lib", "usr/lib64", "usr/sbin"):
        assert stat.S_ISDIR(os.lstat(root / d).st_mode)
    env_file = os.lstat(root / "etc/environment")
    assert (root / "etc/environment").read_text() == "A=1\n"
    assert stat.S_IMODE(env_file.st_mode) == 0o600
    modes = {p: stat.S_IMODE(os.lstat(root / p).st_mode) for p in
             ("tmp", "root", "opt/data/input", "var/log", "proc", f"{LIBDIR[1:]}")}
    assert modes == {"tmp": 0o1777, "root": 0o755, "opt/data/input": 0o750, "var/log": 0o755,
                     "proc": 0o755, LIBDIR[1:]: 0o755}
    placeholder = os.lstat(root / PLACEHOLDERS[0].lstrip("/"))
    assert stat.S_ISREG(placeholder.st_mode) and placeholder.st_size == 0

    # The manifest lists exactly the tree, and the root and its missing parent as made.
    m = manifest(host)
    assert m["root"] == str(root) and m["made"] == [str(root), str(root.parent)]
    assert set(m["paths"]) == set(tree(root))


def test_hard_links_a_source_on_the_roots_filesystem(host, root, tmp_path):
    src = tmp_path / "src" / "tool"
    src.parent.mkdir()
    src.write_text("#!/bin/sh\n")
    src.chmod(0o755)
    res = make(root, files=(("/usr/bin/tool", str(src), ""),))
    up(res, host)
    assert os.stat(root / "usr/bin/tool").st_ino == src.stat().st_ino


def test_paths_through_the_top_links_land_where_the_links_lead(host, root, tmp_path):
    src = tmp_path / "ld.so"
    src.write_text("x")
    res = make(root, files=(("/lib64/ld.so", str(src), ""),), dirs=(("/bin/x", 0o700),))
    up(res, host)
    assert (root / "usr/lib64/ld.so").is_file() and (root / "usr/bin/x").is_dir()
    assert {"/usr/lib64/ld.so", "/usr/bin/x"} <= set(manifest(host)["paths"])


def test_reapply_places_nothing(host, root, monkeypatch):
    res = make(root)
    up(res, host)
    before = {p: (s.st_ino, s.st_mtime_ns, s.st_ctime_ns, s.st_mode) for p, s in
              tree(root).items()}
    where = host.state_dir / "rootfs/demo.json"
    m_before = os.stat(where)
    calls = []

    def spy(name):
        def fail(*a, **k):
            calls.append(name)
            raise AssertionError(f"{name} called on a tree that matches")
        return fail

    for name in ("link", "mkdir", "symlink", "rename", "unlink", "rmdir", "chmod"):
        monkeypatch.setattr(os, name, spy(name))
    for name in ("_copy", "_write_new", "_commit"):
        monkeypatch.setattr(mod, name, spy(name))
    seen = []
    host.progress = lambda what, done, total: seen.append(done)
    res.apply(host, {"existed": False})
    monkeypatch.undo()
    assert calls == []
    assert seen == list(range(1, len(before) + 1))  # every entry checked, none placed
    after = {p: (s.st_ino, s.st_mtime_ns, s.st_ctime_ns, s.st_mode) for p, s in
             tree(root).items()}
    assert after == before
    m_after = os.stat(where)
    assert (m_after.st_ino, m_after.st_mtime_ns) == (m_before.st_ino, m_before.st_mtime_ns)


def test_progress_counts_up_to_every_entry(host, root):
    seen = []
    host.progress = lambda what, done, total: seen.append((what, done, total))
    up(make(root), host)
    total = len(tree(root))
    assert seen == [("rootfs demo", i, total) for i in range(1, total + 1)]


def test_a_file_dropped_from_the_spec_goes_at_the_next_apply(host, root, tmp_path):
    src = tmp_path / "tool"
    src.write_text("x")
    full = make(root, files=((BASH, BASH, ""), ("/usr/bin/tool", str(src), "")) + _libz(),
                dirs=DIRS + (("/srv/cache/a", 0o755),))
    up(full, host)
    assert (root / "usr/bin/tool").exists() and (root / "srv/cache/a").is_dir()
    less = make(root, files=((BASH, BASH, ""),) + _libz())
    check = less.check(host)
    assert check.status is Status.DRIFTED
    # /srv and /srv/cache hold left-over entries: they are not reported themselves.
    assert check.detail == "left over 2: /srv/cache/a, /usr/bin/tool"
    less.apply(host, {"existed": False})
    assert not (root / "usr/bin/tool").exists() and not (root / "srv").exists()
    paths = set(manifest(host)["paths"])
    assert "/usr/bin/tool" not in paths and "/srv" not in paths and "/usr/bin/bash" in paths
    assert paths == set(tree(root))
    assert less.check(host).status is Status.PRESENT


def tamper_content(root):
    (root / "etc/hostname").write_text("evil\n")
    return "/etc/hostname (content)"


def tamper_mode(root):
    os.chmod(root / "etc/passwd", 0o666)
    return "/etc/passwd (mode)"


def tamper_delete(root):
    os.unlink(root / "usr/bin/bash")
    return "missing 1: /usr/bin/bash"


def tamper_symlink(root):
    os.unlink(root / "lib")
    os.symlink("/etc", root / "lib")
    return "/lib (target)"


def tamper_type(root):
    os.unlink(root / PLACEHOLDERS[0].lstrip("/"))
    os.mkdir(root / PLACEHOLDERS[0].lstrip("/"))
    return f"{PLACEHOLDERS[0]} (type)"


def tamper_dir_mode(root):
    os.chmod(root / "tmp", 0o755)
    return "/tmp (mode)"


def tamper_dir_gone(root):
    shutil.rmtree(root / "var")
    return "missing 2: /var, /var/log"


@pytest.mark.parametrize("tamper", [tamper_content, tamper_mode, tamper_delete, tamper_symlink,
                                    tamper_type, tamper_dir_mode, tamper_dir_gone])
def test_a_tampered_tree_is_drifted_and_repaired(host, root, tamper):
    res = make(root)
    up(res, host)
    want = tamper(root)
    seen = {p: (st.st_ino, st.st_mtime_ns, st.st_ctime_ns) for p, st in tree(root).items()}
    listed = manifest(host)
    check = res.check(host)
    # check() is read-only: the tree and the manifest are as they were.
    assert {p: (st.st_ino, st.st_mtime_ns, st.st_ctime_ns) for p, st in
            tree(root).items()} == seen
    assert manifest(host) == listed
    assert check.status is Status.DRIFTED
    assert want in check.detail
    res.apply(host, {"existed": False})
    assert res.check(host).status is Status.PRESENT
    assert (root / "etc/hostname").read_text() == "demo\n"
    assert set(manifest(host)["paths"]) == set(tree(root))


def test_a_replaced_host_file_is_out_of_date_and_linked_again(host, root, tmp_path):
    src = tmp_path / "src" / "tool"
    src.parent.mkdir()
    src.write_text("v1\n")
    res = make(root, files=(("/usr/bin/tool", str(src), ""),))
    up(res, host)
    # A package upgrade writes the new file beside the old one and renames it over.
    new = tmp_path / "src" / "tool.new"
    new.write_text("v2, longer\n")
    old_mtime = src.stat().st_mtime_ns
    os.utime(new, ns=(old_mtime + 10**9, old_mtime + 10**9))
    os.replace(new, src)
    check = res.check(host)
    assert check.status is Status.DRIFTED
    assert "out of date 1: /usr/bin/tool" in check.detail
    res.apply(host, {"existed": False})
    assert os.stat(root / "usr/bin/tool").st_ino == src.stat().st_ino
    assert (root / "usr/bin/tool").read_text() == "v2, longer\n"


def test_a_vanished_source_is_out_of_date_and_apply_names_it(host, root, tmp_path):
    src = tmp_path / "tool"
    src.write_text("x")
    res = make(root, files=(("/usr/bin/tool", str(src), ""),))
    up(res, host)
    src.unlink()
    assert "out of date 1: /usr/bin/tool (source gone)" in res.check(host).detail
    with pytest.raises(HostError, match=f"/usr/bin/tool: the source {src} is gone"):
        res.apply(host, {"existed": False})


# ---------------------------------------------------------------- copies


@pytest.fixture
def other_fs_root():
    """A root on /dev/shm (tmpfs): another filesystem than /usr and /tmp."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat("/usr").st_dev:
        pytest.skip("no tmpfs /dev/shm on another filesystem than /usr")
    base = Path(tempfile.mkdtemp(prefix="envctl-rootfs-", dir="/dev/shm"))
    yield base / "demo"
    shutil.rmtree(base, ignore_errors=True)


def test_across_filesystems_files_are_copied_with_mode_and_mtime(host, other_fs_root, tmp_path):
    root = other_fs_root
    src = tmp_path / "tool"
    src.write_bytes(b"\x7fELF" + b"x" * 100_000)
    os.chmod(src, 0o751)
    os.utime(src, ns=(1_600_000_000_123_456_789, 1_600_000_000_987_654_321))
    res = make(root, files=((BASH, BASH, ""), ("/usr/bin/tool", str(src), "")) + _libz())
    up(res, host)
    for placed, source in ((root / "usr/bin/tool", src), (root / "usr/bin/bash", Path(BASH))):
        a, b = os.lstat(placed), os.stat(source)
        assert a.st_dev != b.st_dev
        assert (a.st_size, a.st_mtime_ns, stat.S_IMODE(a.st_mode)) == (
            b.st_size, b.st_mtime_ns, stat.S_IMODE(b.st_mode))
        assert placed.read_bytes() == source.read_bytes()
    assert res.check(host).status is Status.PRESENT

    # A copy edited in place is modified (a hard link could not be: it is the source).
    with open(root / "usr/bin/tool", "ab") as f:
        f.write(b"!")
    check = res.check(host)
    assert "modified 1: /usr/bin/tool (size, mtime)" in check.detail
    res.apply(host, {"existed": False})
    assert (root / "usr/bin/tool").read_bytes() == src.read_bytes()
    assert res.check(host).status is Status.PRESENT


def test_a_refused_hard_link_falls_back_to_a_copy(host, root, tmp_path, monkeypatch):
    src = tmp_path / "tool"
    src.write_text("x" * 1000)
    linked = []

    def no_link(*a, **k):
        linked.append(a)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    res = make(root, files=(("/usr/bin/tool", str(src), ""),))
    up(res, host)
    monkeypatch.undo()
    assert linked  # a hard link was tried: same filesystem
    placed = os.lstat(root / "usr/bin/tool")
    assert placed.st_ino != src.stat().st_ino
    assert placed.st_mtime_ns == src.stat().st_mtime_ns
    assert res.check(host).status is Status.PRESENT


# ---------------------------------------------------------------- crashes and removal


class Killed(BaseException):
    """Stands for SIGKILL: not an Exception, so nothing on the way handles it."""


@pytest.mark.parametrize("n", [0, 1, 5, 10])  # 11 files and links, 30 entries in all
@pytest.mark.parametrize("point", ["_commit", "_ensure"])
def test_apply_stopped_after_n_placements_is_covered_and_removed(host, root, monkeypatch, n,
                                                                point):
    res = make(root)
    real = getattr(mod, point)
    count = [0]

    def placing(*a, **k):
        if count[0] == n:
            raise Killed
        count[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(mod, point, placing)
    memo = res.snapshot(host)
    with pytest.raises(Killed):
        res.apply(host, memo)
    monkeypatch.undo()
    listed = set(manifest(host)["paths"])
    assert covered(root, listed) == []
    res.remove(host, memo)
    assert not root.exists() and not root.parent.exists()
    assert manifest(host) is None
    assert res.check(host).status is Status.ABSENT


def test_a_temporary_left_by_a_kill_is_covered_and_removed(host, root):
    res = make(root)
    memo = up(res, host)
    # A kill between the hard link to the temporary name and the rename.
    tmp = root / "usr/bin" / mod._tmp_name("bash")
    os.link(BASH, tmp)
    assert covered(root, set(manifest(host)["paths"])) == []
    res.remove(host, memo)
    assert not root.exists()


def test_remove_of_a_root_that_existed_empty_keeps_it(host, root):
    root.mkdir(parents=True)
    res = make(root)
    memo = up(res, host)
    assert memo == {"existed": True, "root": str(root), "dir": True, "empty": True,
                    "ours": False}
    assert res.undo_note(host, memo) == "kept: it existed before envctl"
    res.remove(host, memo)
    assert root.is_dir() and os.listdir(root) == []
    assert manifest(host) is None
    res.remove(host, memo)  # again: already gone
    assert root.is_dir()


def test_a_parent_made_for_one_root_and_shared_with_another_stays_with_it(host, tmp_path):
    a, b = tmp_path / "roots" / "a", tmp_path / "roots" / "b"
    ra, rb = make(a, env="a"), make(b, env="b")
    memo_a, memo_b = up(ra, host), up(rb, host)
    assert manifest(host, "a")["made"] == [str(a), str(a.parent)]
    assert manifest(host, "b")["made"] == [str(b)]
    ra.remove(host, memo_a)
    assert not a.exists() and b.is_dir() and manifest(host, "a") is None
    assert rb.check(host).status is Status.PRESENT
    rb.remove(host, memo_b)
    assert not b.exists() and manifest(host, "b") is None
    assert a.parent.is_dir()  # made for a, left when b was in it: nobody's now


def test_a_foreign_directory_is_refused_and_left_alone(host, root):
    root.mkdir(parents=True)
    (root / "notes.txt").write_text("mine")
    res = make(root)
    memo = res.snapshot(host)
    why = res.refuses(memo)
    assert why.startswith(f"{root} is not empty and envctl has no record")
    assert "\n" not in why
    with pytest.raises(ForeignObject):
        res.apply(host, memo)
    assert os.listdir(root) == ["notes.txt"] and manifest(host) is None
    (root.parent / "file").write_text("")
    assert RootfsTree("x", str(root.parent / "file")).refuses(
        RootfsTree("x", str(root.parent / "file")).snapshot(host)).endswith("is not a directory")


def test_what_a_user_put_in_home_survives_remove(host, root):
    res = make(root)
    memo = up(res, host)
    (root / "home/alice/work").mkdir(parents=True)
    (root / "home/alice/work/results.csv").write_text("1,2\n")
    assert res.undo_note(host, memo) == (
        "keeps what envctl did not place, with its directories: /home/alice")
    res.remove(host, memo)
    assert (root / "home/alice/work/results.csv").read_text() == "1,2\n"
    assert sorted(tree(root)) == ["/home", "/home/alice", "/home/alice/work",
                                  "/home/alice/work/results.csv"]
    # What stays stays on record: the next `up` takes the tree over again, `down` retries.
    m = manifest(host)
    assert m["paths"] == ["/home"] and m["made"][0] == str(root)
    memo2 = res.snapshot(host)
    assert res.refuses(memo2) == ""
    res.apply(host, memo2)
    assert res.check(host).status is Status.PRESENT
    shutil.rmtree(root / "home/alice")
    res.remove(host, memo2)
    assert not root.exists() and manifest(host) is None


def _victim(where: Path) -> dict[str, tuple[str, int]]:
    """A directory that is not envctl's, holding the names envctl placed under /usr/lib."""
    (link, _, _), (real, _, _) = _libz()
    for p in (link, real, PLACEHOLDERS[0]):
        f = where / os.path.relpath(p, "/usr/lib")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("not envctl's")
    (where / "python3.11").mkdir()
    os.chmod(where, 0o700)
    return _listing(where)


def _listing(where: Path) -> dict[str, tuple[str, int]]:
    return {p: ("" if s.st_mode & stat.S_IFDIR else (where / p.lstrip("/")).read_text(),
                stat.S_IMODE(s.st_mode)) for p, s in tree(where).items()} | {
        ".": ("", stat.S_IMODE(os.stat(where).st_mode))}


@pytest.mark.parametrize("inside", [False, True], ids=["to-the-host", "to-a-users-dir"])
def test_a_planted_symlink_is_never_followed(host, root, tmp_path, inside):
    """/usr/lib replaced by a symlink to a host directory (absolute) or to a user's directory
    in the tree (relative): apply refuses, and neither apply nor remove touches what it
    names, though it holds the very names envctl placed under /usr/lib."""
    res = make(root)
    memo = up(res, host)
    victim = root / "home/victim" if inside else tmp_path / "outside"
    shutil.rmtree(root / "usr/lib")
    victim.mkdir()
    before = _victim(victim)
    os.symlink("../home/victim" if inside else str(victim), root / "usr/lib")
    etc_before = sorted(os.listdir(root / "etc"))
    check = res.check(host)
    assert check.status is Status.DRIFTED and "/usr/lib (type)" in check.detail
    with pytest.raises(HostError, match="rootfs demo: /usr/lib is a symlink where a directory "
                                        "belongs; refusing"):
        res.apply(host, memo)
    assert _listing(victim) == before
    assert sorted(os.listdir(root / "etc")) == etc_before
    res.remove(host, memo)
    assert _listing(victim) == before
    assert manifest(host) is None if not inside else manifest(host)["paths"] == ["/home"]
    assert root.exists() is inside  # the user's directory keeps the root, /home and itself


def test_a_symlink_planted_above_a_file_no_longer_wanted_is_not_followed(host, root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "tool").write_text("host tool")
    src = tmp_path / "tool"
    src.write_text("x")
    res = make(root, files=(("/usr/local/bin/tool", str(src), ""),))
    up(res, host)
    shutil.rmtree(root / "usr/local")
    os.symlink(str(outside), root / "usr/local")
    less = make(root, files=())
    less.apply(host, {"existed": False})  # /usr/local/bin/tool is no longer wanted
    assert (outside / "tool").read_text() == "host tool"
    assert not os.path.lexists(root / "usr/local")  # the planted symlink itself went


def test_a_non_empty_directory_where_a_file_belongs_is_refused(host, root, tmp_path):
    res = make(root)
    up(res, host)
    os.unlink(root / "etc/hostname")
    (root / "etc/hostname").mkdir()
    (root / "etc/hostname/x").write_text("")
    with pytest.raises(HostError, match="/etc/hostname is a directory that is not empty"):
        res.apply(host, {"existed": False})
    assert (root / "etc/hostname/x").exists()


def test_a_moved_root_takes_the_old_tree_away(host, root, tmp_path):
    up(make(root), host)
    other = tmp_path / "roots" / "elsewhere"
    moved = make(other)
    check = moved.check(host)
    assert check.status is Status.ABSENT
    moved.apply(host, {"existed": False})
    assert not root.exists() and moved.check(host).status is Status.PRESENT
    assert manifest(host)["root"] == str(other)


def test_a_lost_manifest_is_drift_and_apply_takes_over_what_the_memo_says_is_ours(host, root):
    res = make(root)
    memo = up(res, host)
    (host.state_dir / "rootfs/demo.json").unlink()
    check = res.check(host)
    assert check.status is Status.DRIFTED and "not on record 1:" in check.detail
    # A memo of another root (the spec moved it since) proves nothing: refused.
    with pytest.raises(ForeignObject):
        res.apply(host, {"existed": False, "root": "/elsewhere"})
    res.apply(host, memo)
    assert res.check(host).status is Status.PRESENT
    assert manifest(host)["made"] == [str(root)]


def test_a_damaged_manifest_is_reported_not_trusted(host, root):
    res = make(root)
    memo = up(res, host)
    where = host.state_dir / "rootfs/demo.json"
    for bad in ("{not json", json.dumps({"root": str(root), "made": ["/etc"], "paths": []}),
                json.dumps({"root": str(root), "made": [], "paths": ["/../etc"]})):
        where.write_text(bad)
        for call in (lambda: res.check(host), lambda: res.remove(host, memo),
                     lambda: res.apply(host, memo)):
            with pytest.raises(HostError, match=str(where)):
                call()
    assert os.path.isdir("/etc") and (root / "usr/bin/bash").exists()


# ---------------------------------------------------------------- input and the journal


@pytest.mark.parametrize("kw, match", [
    ({"files": (("/usr/../etc/x", "/etc/hostname", ""),)}, "without '.', '..'"),
    ({"dirs": (("/", 0o755),)}, "the root itself is not"),
    ({"generated": (("/etc/x", "a", 0o17777),)}, "mode 8191"),
    ({"files": (("/usr/bin/x", "relative", ""),)}, "absolute host path"),
    ({"generated": (("/etc/hosts", "a", 0o644),), "placeholders": ("/etc/hosts",)},
     "/etc/hosts is wanted as a generated file and as a generated file"),
    ({"placeholders": ("/etc/hosts/x",), "generated": (("/etc/hosts", "", 0o644),)},
     "the tree needs a directory there"),
    ({"placeholders": ("/tmp",)}, "/tmp is wanted as a generated file, but the tree needs"),
])
def test_bad_fields_fail_before_anything_is_written(host, root, kw, match):
    res = make(root, **kw)
    with pytest.raises(InputError, match=match):
        res.apply(host, {"existed": False})
    assert not root.exists() and manifest(host) is None


def test_a_name_too_long_for_its_temporary_gets_a_hashed_one(host, root, tmp_path):
    name = "l" * 250
    assert len(mod._tmp_name(name)) <= 255 and mod._tmp_name(name).endswith(mod.TMP_SUFFIX)
    res = make(root, generated=((f"/etc/{name}", "x", 0o644),))
    up(res, host)
    assert (root / "etc" / name).read_text() == "x"
    assert res.check(host).status is Status.PRESENT


def test_an_explicit_directory_mode_wins_over_the_standard_tree(host, root):
    res = make(root, dirs=(("/tmp", 0o1770),))
    up(res, host)
    assert stat.S_IMODE(os.lstat(root / "tmp").st_mode) == 0o1770


def test_the_resource_survives_the_journal(host, root):
    res = make(root, files=placed_files([PlacedFile(BASH, BASH)]) + _libz())
    again = Resource.from_dict(json.loads(json.dumps(res.to_dict())))
    assert again == res and again.key == "rootfs:demo" and not RootfsTree.volatile


def test_engine_up_and_down_with_a_rootfs(host, root, tmp_path):
    engine = Engine(host)
    plan = [Directory("state", "envs/demo"), make(root)]
    engine.up("demo", plan)
    assert make(root).check(host).status is Status.PRESENT
    assert [s.op for s in engine.up("demo", plan).steps] == ["=", "="]
    engine.down("demo")
    assert not root.exists() and not (host.state_dir / "envs/demo").exists()


def test_engine_rolls_a_failed_assembly_back(host, root, tmp_path):
    engine = Engine(host)
    src = tmp_path / "gone"
    with pytest.raises(StepFailed, match="the source .* is gone"):
        engine.up("demo", [Directory("state", "envs/demo"),
                           make(root, files=(("/usr/bin/x", str(src), ""),))])
    assert not root.exists() and not root.parent.exists()
