"""The root filesystem tree of an environment on disk: its directories, the host files it gets
(hard-linked, or copied across filesystems), the /etc files the planner writes, the empty files
that file bind mounts land on — and exactly what envctl placed there, nothing else.

Ownership is a manifest, `<state>/rootfs/<env>.json`: the root's path, the host
directories made for it (the root first, then the parents that were missing) and every path in
the tree envctl placed. It is written ahead: before `apply` places anything it lists the union
of what it listed and everything this apply may create, and only once the tree matches is it
cut down to the wanted set. A kill -9 at any moment leaves a manifest that covers every file
envctl made. A file is placed through a temporary sibling, `.NAME.envctl~`, renamed over NAME;
the manifest's entry for NAME stands for that sibling too, and `remove` takes both.

Every path in the tree is opened beneath the root, one directory descriptor at a time and never
through a symlink (host/safepath.py): a job or a user may have planted `usr/lib -> /etc`, and
envctl must never write, chmod or delete outside the tree. Files are made under their parent's
descriptor (O_EXCL|O_NOFOLLOW), unlinked and renamed with dir_fd. Hard links of host files are
safe because the mount resources bind the tree read-only onto itself in the environment's mount
namespace: a job cannot write through one into the host's file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envctl.errors import ForeignObject, HostError, InputError
from envctl.resources.base import Check, Resource, Status

if TYPE_CHECKING:
    from envctl.facts import PlacedFile
    from envctl.host.context import Host

# The top of every tree (name, mode). A name that `links` makes a symlink is not a directory.
STANDARD_TREE: tuple[tuple[str, int], ...] = (
    ("bin", 0o755), ("lib", 0o755), ("lib64", 0o755), ("usr", 0o755), ("etc", 0o755),
    ("tmp", 0o1777), ("proc", 0o755), ("sys", 0o755), ("dev", 0o755), ("home", 0o755),
    # /root 0755, not 0700: it is empty and read-only, and root inside is its user
    # namespace's root, to which the host's root-owned 0700 directory would be closed.
    ("root", 0o755), ("var", 0o755), ("opt", 0o755),
    # The mount point of a submitted job's staging directory (bound read-only per launch: the
    # tree itself is read-only inside).
    ("job", 0o755),
)
DIR_MODE = 0o755  # the root and directories made only because something lies in them
PRIVATE_MODE = 0o700  # <state>/rootfs: see _private_dir
# Set-id bits never reach a tree: a job runs with no_new_privs, so inside they grant nothing,
# and outside they would only be another path to a set-id program (see _placed_mode).
SETID = stat.S_ISUID | stat.S_ISGID
PLACEHOLDER_MODE = 0o644
TMP_SUFFIX = ".envctl~"
SHOWN = 3  # paths named per kind of difference in check()'s detail

MISSING, MODIFIED, OUTDATED, LEFTOVER, UNRECORDED = (
    "missing", "modified", "out of date", "left over", "not on record")


@dataclass(frozen=True)
class _Want:
    """One wanted path: a directory (`mode`), a symlink (`text`), a host file (`source`), or
    bytes the planner wrote (`data`, `mode`; a placeholder is empty)."""

    kind: str  # "dir" | "symlink" | "file" | "data"
    mode: int = 0
    text: str = ""
    source: str = ""
    data: bytes = b""

    def show(self) -> str:
        return {"dir": "a directory", "symlink": f"a symlink to {self.text}",
                "file": f"a copy of {self.source}", "data": "a generated file"}[self.kind]


@dataclass(frozen=True)
class RootfsTree(Resource):
    """The tree at `root` (an absolute host path) of environment `env`.

    - `links`: (name, target) top-level symlinks mirroring the host's merged /usr, e.g.
      ("bin", "usr/bin"); the target directory is made too. Paths elsewhere that go through
      one of these are placed at the path it names (/lib64/x -> /usr/lib64/x).
    - `files`: (path inside, host source, symlink text or "") — PlacedFile values. A file is
      hard-linked when its source is a regular file on the root's filesystem, else copied
      with its mode, owner and mtime; a symlink is made with the given text.
    - `generated`: (path, content, mode) — the /etc files the planner writes.
    - `dirs`: (path, mode) — mount points of the mount resources; a mode here wins over the
      standard tree's.
    - `placeholders`: empty regular files, mount points of file bind mounts.

    Example: RootfsTree("gpu-compute", "/var/lib/envctl/rootfs/gpu-compute",
    links=(("bin", "usr/bin"),), files=(("/usr/bin/bash", "/usr/bin/bash", ""),),
    generated=(("/etc/hostname", "gpu-compute\\n", 0o644),))

    `remove` takes away what the manifest lists, deepest first: files and symlinks unlinked,
    directories only when empty — what a user put in /home stays, with the directories it
    lies in — and the root itself if envctl made it and it is empty.
    """

    kind = "rootfs"
    volatile = False  # on disk: an old boot's journal still names what `down` must remove
    env: str
    root: str
    links: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, str, str], ...] = ()
    generated: tuple[tuple[str, str, int], ...] = ()
    dirs: tuple[tuple[str, int], ...] = ()
    placeholders: tuple[str, ...] = ()

    def ident(self) -> str:
        return self.env

    def describe(self) -> str:
        return f"rootfs {self.env} at {self.root}"

    # ------------------------------------------------------------------ the contract

    def check(self, host: Host) -> Check:
        """Read-only. ABSENT: no root; PRESENT: every wanted entry matches and is on record;
        DRIFTED, per kind with a count and the first paths: missing, modified (content, size,
        mtime, mode, type, target), out of date (the host's source was replaced since, or is
        gone), left over (on record, no longer wanted), not on record (the manifest lacks it)."""
        try:
            st = os.lstat(self.root)
        except FileNotFoundError:
            return Check.absent(f"{self.root} does not exist")
        if not stat.S_ISDIR(st.st_mode):
            return Check.wrong_kind(f"{self.root} exists and is not a directory")
        wanted = self._wanted()
        manifest = _Manifest.read(host, self.env)
        found: dict[str, list[str]] = {}
        differ: set[str] = set()
        with _Tree(self.env, self.root) as tree:
            for path, want in _placing_order(wanted):
                try:
                    pfd, name = tree.parent(path)
                except OSError:
                    # A directory on the way is missing or not a directory: counted there.
                    found.setdefault(MISSING, []).append(path)
                    differ.add(path)
                    continue
                have = tree.lstat(pfd, name)
                differs = _verdict(want, have, pfd, name, _source_stat(want))
                if differs:
                    what, why = differs
                    differ.add(path)
                    found.setdefault(what, []).append(f"{path} ({why})" if why else path)
            if manifest is not None and manifest.root == self.root:
                for path in _removal_order(manifest.paths - wanted.keys()):
                    if tree.left_over(path):
                        found.setdefault(LEFTOVER, []).append(path)
        if manifest is None:
            # The tree may match, but without its record `remove` would take nothing away.
            found.setdefault(UNRECORDED, []).append(str(_Manifest.where(host, self.env)))
        elif manifest.root != self.root:
            found.setdefault(LEFTOVER, []).append(f"the tree at {manifest.root}")
        else:
            # Only what is there: a missing path is reported as missing.
            unrecorded = sorted(wanted.keys() - manifest.paths - differ)
            if unrecorded:
                found.setdefault(UNRECORDED, []).extend(unrecorded)
        detail = "; ".join(_summary(what, found[what]) for what in
                           (MISSING, MODIFIED, OUTDATED, LEFTOVER, UNRECORDED) if what in found)
        return Check(Status.DRIFTED, detail=detail) if detail else Check.present()

    def snapshot(self, host: Host) -> dict[str, Any]:
        """Whether the root existed, and if so whether it was empty and on this env's record."""
        try:
            st = os.lstat(self.root)
        except FileNotFoundError:
            return {"existed": False, "root": self.root}
        memo: dict[str, Any] = {"existed": True, "root": self.root,
                                "dir": stat.S_ISDIR(st.st_mode)}
        if memo["dir"]:
            memo["empty"] = _empty(self.root)
            manifest = _Manifest.read(host, self.env)
            memo["ours"] = manifest is not None and manifest.root == self.root
        return memo

    def refuses(self, memo: dict[str, Any]) -> str:
        if not memo.get("existed"):
            return ""
        if not memo.get("dir", True):
            return f"{self.root} exists and is not a directory"
        if memo.get("empty") or memo.get("ours"):
            return ""
        return (f"{self.root} is not empty and envctl has no record of placing anything in it: "
                f"empty it, move it or choose another rootfs.path")

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        try:
            manifest = _Manifest.read(host, self.env)
        except HostError as exc:
            return str(exc)
        notes = []
        made_root = manifest.made[:1] == [manifest.root] if manifest else False
        if (manifest is not None and not made_root) or (manifest is None and memo.get("existed")):
            notes.append("kept: it existed before envctl")
        if manifest is not None:
            others = _others(self.env, manifest)
            if others:
                notes.append(f"keeps what envctl did not place, with its directories: "
                             f"{_first(others)}")
        return "; ".join(notes)

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        """Place what differs, remove what the manifest lists and is no longer wanted; a tree
        that matches is not written (nor is its manifest). HostError, naming the path, for a
        symlink where a directory belongs or a non-empty directory where a file belongs."""
        wanted = self._wanted()  # bad input fails here, before anything is written
        old = _Manifest.read(host, self.env)
        if old is not None and old.root != self.root:
            # The spec moved the tree: the old one goes first, as `remove` takes it. What stays
            # of it (directories holding others' files) is no longer envctl's.
            _, problems = _take_down(self.env, old)
            if problems:
                # Not dropped: what could not go would be in no manifest afterwards.
                raise HostError(f"rootfs {self.env}: moving the tree from {old.root}: "
                                f"{_first(problems)}")
            old = None
        try:
            st: os.stat_result | None = os.lstat(self.root)
        except FileNotFoundError:
            st = None
        old_made = old.made if old is not None else []
        if st is None:
            missing = _missing_dirs(Path(self.root))
            made = missing if len(missing) >= len(old_made) else old_made
        elif not stat.S_ISDIR(st.st_mode):
            raise HostError(f"rootfs {self.env}: {self.root} exists and is not a directory")
        elif old is not None:
            made = old_made
        elif _ours_by_memo(self.root, memo):
            # No manifest (lost with the state directory?), but the journal's memo says envctl
            # made this root or found it empty: what is wanted in it is envctl's to place.
            made = [] if memo.get("existed") else [self.root]
        elif not _empty(self.root):
            raise ForeignObject(f"rootfs {self.env}: {self.root} is not empty and envctl has "
                                f"no record of placing anything in it; refusing")
        else:
            made = []
        before = old.paths if old is not None else set()
        # Write-ahead: everything this run may create is on record before it exists.
        ahead = _Manifest(self.root, made, before | wanted.keys())
        if ahead != old:
            ahead.write(host, self.env)
        if st is None:
            for d in reversed(made):
                _make_host_dir(self.env, d)
        with _Tree(self.env, self.root) as tree:
            kept, failed = _remove_paths(tree, before - wanted.keys())
            total = len(wanted)
            for done, (path, want) in enumerate(_placing_order(wanted), 1):
                _ensure(tree, self.env, path, want)
                if host.progress is not None:
                    host.progress(f"rootfs {self.env}", done, total)
        final = _Manifest(self.root, made, wanted.keys() | kept | failed.keys())
        if final != ahead:
            final.write(host, self.env)
        if failed:
            raise HostError(f"rootfs {self.env}: cannot remove what is no longer wanted: "
                            f"{_first([f'{p} ({why})' for p, why in sorted(failed.items())])}")

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        """Take away what the manifest lists (never anything else), then the manifest; what
        stays (directories holding others' files) stays on record. Done when already gone."""
        manifest = _Manifest.read(host, self.env)
        if manifest is None:
            return  # nothing placed: the manifest is on disk before anything else is
        left, problems = _take_down(self.env, manifest)
        if left is None:
            _Manifest.delete(host, self.env)
        elif left != manifest:
            left.write(host, self.env)  # what stays stays envctl's: `down` may be run again
        if problems:
            raise HostError(f"rootfs {self.env}: {_first(problems)}")

    # ------------------------------------------------------------------ the wanted tree

    def _wanted(self) -> dict[str, _Want]:
        """Every path the tree must have ('/usr/bin/bash'), with what must be there; the
        directories that anything lies in included. InputError on a bad or doubled path."""
        env = self.env
        targets: dict[str, tuple[str, ...] | None] = {}
        out: dict[str, _Want] = {}

        def put(parts: tuple[str, ...], want: _Want) -> None:
            key = "/" + "/".join(parts)
            have = out.get(key)
            if have is not None and have != want:
                raise InputError(f"rootfs {env}: {key} is wanted as {have.show()} and as "
                                 f"{want.show()}; one path can be only one thing")
            out[key] = want

        def canonical(what: str, path: str) -> tuple[str, ...]:
            parts = _parts(env, what, path)
            target = targets.get(parts[0]) if len(parts) > 1 else None
            return target + parts[1:] if target else parts

        for name, text in self.links:
            parts = _parts(env, "link", name)
            if not text or "\0" in text:
                raise InputError(f"rootfs {env}: link {name!r}: the target must be non-empty "
                                 f"text without NUL")
            put(parts, _Want("symlink", text=text))
            if len(parts) == 1:
                targets[parts[0]] = _relative_target(text)
        for path, source, text in self.files:
            parts = canonical("file", path)
            if text:
                put(parts, _Want("symlink", text=text))
            elif not source.startswith("/") or "\0" in source:
                raise InputError(f"rootfs {env}: file {path!r}: the source must be an absolute "
                                 f"host path")
            else:
                put(parts, _Want("file", source=source))
        for path, content, mode in self.generated:
            put(canonical("generated file", path),
                _Want("data", _mode(env, path, mode), data=content.encode()))
        for path in self.placeholders:
            put(canonical("placeholder", path), _Want("data", PLACEHOLDER_MODE))
        for path, mode in self.dirs:
            put(canonical("directory", path), _Want("dir", _mode(env, path, mode)))

        # Directories nobody named a mode for: the standard tree, the links' targets and the
        # parents of everything. An explicit directory keeps its own mode.
        implied: list[tuple[tuple[str, ...], int]] = [
            ((name,), mode) for name, mode in STANDARD_TREE if name not in targets]
        implied += [(t, DIR_MODE) for t in targets.values() if t]
        for key in list(out):
            parts = tuple(key.strip("/").split("/"))
            implied += [(parts[:i], DIR_MODE) for i in range(1, len(parts))]
        for parts, mode in implied:
            for i in range(1, len(parts) + 1):
                key = "/" + "/".join(parts[:i])
                have = out.get(key)
                if have is None:
                    out[key] = _Want("dir", mode if i == len(parts) else DIR_MODE)
                elif have.kind != "dir":
                    raise InputError(f"rootfs {env}: {key} is wanted as {have.show()}, but "
                                     f"the tree needs a directory there")
        return out


def placed_files(files: Iterable[PlacedFile]) -> tuple[tuple[str, str, str], ...]:
    """PlacedFile values as `RootfsTree.files` holds them (JSON-simple, for the journal)."""
    return tuple((f.path, f.source, f.link) for f in files)


# ---------------------------------------------------------------------- paths


def _parts(env: str, what: str, path: Any) -> tuple[str, ...]:
    """The components of a path inside the root; InputError for '.', '..', empty parts."""
    if not isinstance(path, str) or "\0" in path:
        raise InputError(f"rootfs {env}: {what} {path!r}: a path is text without NUL")
    parts = tuple(path.strip("/").split("/")) if path.strip("/") else ()
    if not parts or any(p in ("", ".", "..") or len(os.fsencode(p)) > 255 for p in parts):
        raise InputError(f"rootfs {env}: {what} {path!r}: allowed is a path inside the root "
                         f"without '.', '..' or empty parts (the root itself is not)")
    return parts


def _relative_target(text: str) -> tuple[str, ...] | None:
    """Where a top-level symlink's text leads inside the root, or None (absolute, or `..`)."""
    if text.startswith("/"):
        return None
    norm = posixpath.normpath(text)
    if norm in (".", "") or norm.startswith(".."):
        return None
    return tuple(norm.split("/"))


def _mode(env: str, path: str, mode: Any) -> int:
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise InputError(f"rootfs {env}: {path}: mode {mode!r}: allowed is 0 to 0o7777")
    return mode


def _depth(path: str) -> int:
    return path.count("/")


def _placing_order(wanted: dict[str, _Want]) -> list[tuple[str, _Want]]:
    """Parents before what lies in them."""
    return sorted(wanted.items(), key=lambda kv: kv[0].split("/"))


def _removal_order(paths: Iterable[str]) -> list[str]:
    """Deepest first: what lies in a directory before the directory."""
    return sorted(paths, key=lambda p: (-_depth(p), p))


def _tmp_name(name: str) -> str:
    """The temporary sibling through which `name` is placed (a hash when too long)."""
    tmp = f".{name}{TMP_SUFFIX}"
    if len(os.fsencode(tmp)) > 255:
        import hashlib  # rarely needed: not on every start-up

        tmp = f".{hashlib.sha256(os.fsencode(name)).hexdigest()[:32]}{TMP_SUFFIX}"
    return tmp


def _summary(what: str, paths: list[str]) -> str:
    return f"{what} {len(paths)}: {_first(paths)}"


def _first(items: list[str]) -> str:
    return ", ".join(items[:SHOWN]) + (", …" if len(items) > SHOWN else "")


def _empty(path: str) -> bool:
    with os.scandir(path) as it:
        return next(it, None) is None


def _ours_by_memo(root: str, memo: dict[str, Any]) -> bool:
    """Whether the memo journalled for this step says the root was made or found empty by
    envctl (a memo of another root, taken before the spec moved it, says nothing)."""
    if memo.get("root", root) != root:
        return False
    return not memo.get("existed", True) or bool(memo.get("empty") or memo.get("ours"))


def _missing_dirs(root: Path) -> list[str]:
    """The root and its missing parents, innermost first: what envctl makes for it."""
    made, p = [], root
    while not os.path.lexists(p):
        made.append(str(p))
        p = p.parent
    return made


def _private_dir(path: Path) -> None:
    """`<state>/rootfs` (the manifests, and the trees by default) made 0700, or tightened to
    it: only root may reach a tree from the host. The trees hold hard links of host files and
    whatever a job wrote into its mount points' parents; a host user who could walk in would
    get another path to them (the host's set-id files among them, pinned at the version the
    tree linked even after the host upgraded its own)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, PRIVATE_MODE)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, "exists and is not a directory", str(path))
    if stat.S_IMODE(st.st_mode) != PRIVATE_MODE:
        os.chmod(path, PRIVATE_MODE)  # a directory of root's, as just lstat'ed


def _make_host_dir(env: str, path: str) -> None:
    """mkdir a host directory of the root's own path (the operator's config, not the tree)."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path) or os.path.islink(path):
            raise HostError(f"rootfs {env}: {path} exists and is not a directory") from None
    except OSError as exc:
        raise HostError(f"rootfs {env}: create {path}: {exc.strerror}") from exc


# ---------------------------------------------------------------------- the manifest


@dataclass
class _Manifest:
    """What envctl placed: the root, the host directories made for it (root first), and the
    paths in the tree ('/usr/bin/bash'), each standing for its temporary sibling too."""

    root: str
    made: list[str]
    paths: set[str]

    @staticmethod
    def where(host: Host, env: str) -> Path:
        # Beside the default tree, not in envs/ENV (which `down` deletes whole): when user
        # files keep part of a tree, its record stays with it for the next `up`.
        return host.state_dir / "rootfs" / f"{env}.json"

    @classmethod
    def read(cls, host: Host, env: str) -> _Manifest | None:
        from envctl.host.files import read_json

        where = cls.where(host, env)
        try:
            data = read_json(where)
        except (OSError, ValueError) as exc:
            raise HostError(f"rootfs {env}: read {where}: {exc}") from exc
        if data is None:
            return None
        try:
            root, made, paths = data["root"], data["made"], data["paths"]
            ok = (isinstance(root, str) and root.startswith("/") and isinstance(made, list)
                  and isinstance(paths, list) and all(isinstance(p, str) for p in made + paths))
            # `made` is a chain from the root upward: nothing else on the host is ever rmdir'ed.
            ok = ok and all(p == (Path(root) if i == 0 else Path(made[i - 1]).parent)
                            for i, p in enumerate(map(Path, made)))
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise HostError(f"rootfs {env}: {where} is damaged; move it aside and remove the "
                            f"tree by hand")
        try:
            for p in paths:
                _parts(env, "path", p)
        except InputError as exc:
            raise HostError(f"rootfs {env}: {where} is damaged ({exc}); move it aside and "
                            f"remove the tree by hand") from exc
        return cls(root, made, set(paths))

    def write(self, host: Host, env: str) -> None:
        from envctl.host.files import write_json

        where = self.where(host, env)
        try:
            _private_dir(where.parent)
            write_json(where, {"env": env, "root": self.root, "made": self.made,
                               "paths": sorted(self.paths)})
        except OSError as exc:
            raise HostError(f"rootfs {env}: write {where}: {exc.strerror}") from exc

    @classmethod
    def delete(cls, host: Host, env: str) -> None:
        from envctl.host.files import sync_dir

        where = cls.where(host, env)
        try:
            where.unlink()
            sync_dir(where.parent)
        except FileNotFoundError:
            pass  # already gone
        except OSError as exc:
            raise HostError(f"rootfs {env}: remove {where}: {exc.strerror}") from exc


# ---------------------------------------------------------------------- the tree on disk


class _Tree:
    """The root's descriptor and those of the directories in it opened so far, each opened
    beneath the root and through no symlink."""

    def __init__(self, env: str, root: str):
        self.env = env
        try:
            self.fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise HostError(f"rootfs {env}: open {root}: {exc.strerror}") from exc
        self.dev = os.fstat(self.fd).st_dev
        self._dirs: dict[str, int] = {"": self.fd}

    def __enter__(self) -> _Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()

    def dir(self, rel: str) -> int:
        """The descriptor of directory `rel` ('usr/lib'); OSError (safepath.Escape for a
        symlink on the way) when it cannot be reached inside the tree."""
        from envctl.host.safepath import open_beneath

        fd = self._dirs.get(rel)
        if fd is None:
            fd = self._dirs[rel] = open_beneath(self.fd, rel, symlinks=False)
        return fd

    def parent(self, path: str) -> tuple[int, str]:
        rel = path.strip("/")
        d, _, name = rel.rpartition("/")
        return self.dir(d), name

    def forget(self, path: str) -> None:
        """Drop the descriptors of `path` and below (it was removed or replaced)."""
        rel = path.strip("/")
        for key in [k for k in self._dirs if k == rel or k.startswith(rel + "/")]:
            os.close(self._dirs.pop(key))

    @staticmethod
    def lstat(pfd: int, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def left_over(self, path: str) -> bool:
        """Whether a path no longer wanted is still there for `remove` to take (a directory
        only when empty: one that holds others' files stays by design)."""
        try:
            pfd, name = self.parent(path)
        except OSError:
            return False
        st = self.lstat(pfd, name)
        if st is None:
            return False
        if not stat.S_ISDIR(st.st_mode):
            return True
        try:
            return not self.listdir(path)
        except OSError:
            return False

    def listdir(self, path: str) -> list[str]:
        from envctl.host.safepath import open_beneath, opened

        rel = path.strip("/")
        with opened(open_beneath(self.fd, rel or ".", os.O_RDONLY | os.O_DIRECTORY,
                                 symlinks=False)) as fd:
            return os.listdir(fd)


def _source_stat(want: _Want) -> os.stat_result | None:
    """The host file a `file` entry is made from, as it is now (None: gone, not regular)."""
    if want.kind != "file":
        return None
    from envctl.host.safepath import open_root_controlled, opened

    try:
        with opened(open_root_controlled(want.source, directory=False)) as fd:
            st = os.fstat(fd)
    except OSError:
        return None  # gone, or reached only through what another user controls
    return st if stat.S_ISREG(st.st_mode) else None


def _verdict(want: _Want, have: os.stat_result | None, pfd: int, name: str,
             src: os.stat_result | None) -> tuple[str, str] | None:
    """None when what is at `name` is what is wanted; else (kind of difference, what)."""
    if have is None:
        return MISSING, ""
    kind = stat.S_IFMT(have.st_mode)
    mode = stat.S_IMODE(have.st_mode)
    if want.kind == "dir":
        if kind != stat.S_IFDIR:
            return MODIFIED, "type"
        return None if mode == want.mode else (MODIFIED, "mode")
    if want.kind == "symlink":
        if kind != stat.S_IFLNK:
            return MODIFIED, "type"
        return None if os.readlink(name, dir_fd=pfd) == want.text else (MODIFIED, "target")
    if kind != stat.S_IFREG:
        return MODIFIED, "type"
    if want.kind == "data":
        diffs = []
        if have.st_size != len(want.data) or _read(pfd, name, len(want.data)) != want.data:
            diffs.append("content")
        if mode != want.mode:
            diffs.append("mode")
        return (MODIFIED, ", ".join(diffs)) if diffs else None
    if src is None:
        return OUTDATED, "source gone"
    if (have.st_dev, have.st_ino) == (src.st_dev, src.st_ino):
        # The hard link: the source itself. An older envctl linked set-id sources and files
        # of other users (or group/world-writable ones): each is replaced by a copy.
        if src.st_mode & SETID:
            return MODIFIED, "set-id"
        return None if _linkable(src) else (MODIFIED, "linked, not root's alone")
    diffs = [what for what, a, b in (
        ("size", have.st_size, src.st_size), ("mtime", have.st_mtime_ns, src.st_mtime_ns),
        ("mode", mode, _placed_mode(src))) if a != b]
    if not diffs:
        return None  # a copy (another filesystem) of the source as it is
    if have.st_mtime_ns < src.st_mtime_ns:
        # An older file than the source: the host's file was replaced since (a package
        # upgrade renames a new /usr/bin/bash over the inode the tree still links).
        return OUTDATED, ""
    return MODIFIED, ", ".join(diffs)


def _read(pfd: int, name: str, size: int) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=pfd)
    try:
        chunks, left = [], size + 1  # one byte more tells a longer file
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _ensure(tree: _Tree, env: str, path: str, want: _Want) -> None:
    """Make `path` what `want` says; nothing when it already is."""
    from envctl.host.safepath import Escape

    try:
        pfd, name = tree.parent(path)
    except Escape as exc:
        parent = path.rsplit("/", 1)[0]
        raise HostError(f"rootfs {env}: {parent} is a symlink where a directory belongs; "
                        f"refusing") from exc
    except OSError as exc:
        raise HostError(f"rootfs {env}: {path}: open its directory: {exc.strerror}") from exc
    src = None
    if want.kind == "file":
        src = _source_stat(want)
        from envctl.host.safepath import root_controlled_problem

        problem = root_controlled_problem(want.source) if src is None else ""
        if problem:
            raise HostError(f"rootfs {env}: {path}: the source {problem}")
        if src is None:
            raise HostError(f"rootfs {env}: {path}: the source {want.source} is gone or not a "
                            f"regular file")
    try:
        have = tree.lstat(pfd, name)
        if _verdict(want, have, pfd, name, src) is None:
            return  # already so
        if want.kind == "dir":
            _ensure_dir(tree, env, path, want.mode, pfd, name, have)
        else:
            _ensure_file(tree, env, path, want, pfd, name, have, src)
    except HostError:
        raise
    except OSError as exc:
        raise HostError(f"rootfs {env}: {path}: {exc.strerror}") from exc


def _ensure_dir(tree: _Tree, env: str, path: str, mode: int, pfd: int, name: str,
                have: os.stat_result | None) -> None:
    from envctl.host.safepath import fd_path, open_beneath, opened

    if have is not None and stat.S_ISLNK(have.st_mode):
        # Somebody replaced the directory: following it could lead anywhere on the host.
        raise HostError(f"rootfs {env}: {path} is a symlink where a directory belongs; refusing")
    if have is not None and not stat.S_ISDIR(have.st_mode):
        os.unlink(name, dir_fd=pfd)  # a file where a directory belongs (the path is ours)
        have = None
    if have is None:
        os.mkdir(name, mode, dir_fd=pfd)
    # The mode, through a descriptor of the directory itself (mkdir's passed the umask).
    with opened(open_beneath(pfd, name, os.O_PATH | os.O_DIRECTORY, symlinks=False)) as fd:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.chmod(fd_path(fd), mode)


def _ensure_file(tree: _Tree, env: str, path: str, want: _Want, pfd: int, name: str,
                 have: os.stat_result | None, src: os.stat_result | None) -> None:
    if have is not None and stat.S_ISDIR(have.st_mode):
        try:
            os.rmdir(name, dir_fd=pfd)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise HostError(f"rootfs {env}: {path} is a directory that is not empty where "
                            f"{want.show()} belongs; refusing") from exc
        tree.forget(path)
    tmp = _tmp_name(name)
    _clear_tmp(env, path, pfd, tmp)
    try:
        if want.kind == "symlink":
            os.symlink(want.text, tmp, dir_fd=pfd)
        elif want.kind == "data":
            _write_new(pfd, tmp, want.data, want.mode)
        else:
            assert src is not None
            _place_host_file(pfd, tmp, want.source, src, tree.dev)
        _commit(pfd, tmp, name)
    except BaseException:
        with contextlib.suppress(OSError):  # never made, or already renamed
            os.unlink(tmp, dir_fd=pfd)
        raise


def _clear_tmp(env: str, path: str, pfd: int, tmp: str) -> None:
    """Remove a temporary sibling a killed apply left (unlink never follows a symlink)."""
    try:
        os.unlink(tmp, dir_fd=pfd)
    except FileNotFoundError:
        pass
    except IsADirectoryError as exc:
        raise HostError(f"rootfs {env}: {path}: a directory is where its temporary file goes; "
                        f"refusing") from exc


def _place_host_file(pfd: int, tmp: str, source: str, src: os.stat_result, dev: int) -> None:
    """Hard-link `source` as `tmp` when it is on the tree's filesystem, else copy it. A link is
    the host's inode itself, so only a file that root alone may change is linked: one owned by
    another user, or writable by its group or others (a maintainer's /opt tree, a conda or
    pyenv install, /usr/local of group staff), is copied, or its owner would rewrite what every
    job of every partition runs; and a set-id source is copied, or the link would be the
    host's set-id program at a path of envctl's. The source is opened once and both the
    verdict and the link or copy are of that descriptor: a file swapped in at the path since
    `src` was read is judged as itself. (`src`, the stat the check made, is not used.)"""
    del src
    from envctl.host.safepath import open_root_controlled

    # Through no symlink a user could have planted on the way (a file of rootfs.files named
    # below a user's directory could otherwise be swapped for a link to /etc/shadow).
    sfd = open_root_controlled(source, directory=False)
    try:
        st = os.fstat(sfd)
        if st.st_dev == dev and not st.st_mode & SETID and _linkable(st):
            try:
                os.link(f"/proc/self/fd/{sfd}", tmp, dst_dir_fd=pfd, follow_symlinks=True)
                return
            except OSError as exc:
                # EXDEV: the same filesystem through another mount; EPERM: protected_hardlinks
                # refuses a non-owner; EMLINK: the inode has all the links it can. A copy does.
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                    raise
        _copy(f"/proc/self/fd/{sfd}", pfd, tmp)
    finally:
        os.close(sfd)


def _linkable(src: os.stat_result) -> bool:
    """Whether a host file may be the tree's own inode: root's, and writable by root alone."""
    return src.st_uid == 0 and not src.st_mode & 0o022


def _copy(source: str, pfd: int, tmp: str) -> None:
    """Copy `source` to `tmp` with its owner (when allowed), mode and times."""
    sfd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(sfd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", source)
        dfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=pfd)
        try:
            while os.sendfile(dfd, sfd, None, 1 << 30) > 0:
                pass
            with contextlib.suppress(PermissionError):  # not root: the copy stays the caller's
                os.fchown(dfd, st.st_uid, st.st_gid)
            os.fchmod(dfd, _placed_mode(st))  # after chown (which clears set-id bits anyway)
            os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def _placed_mode(src: os.stat_result) -> int:
    """The mode a host file gets in the tree: its own, without set-id bits. Inside, the job
    runs with no_new_privs, so the bits would grant nothing; on the host they would make the
    copy one more set-id program, at a path and version the host's package manager does not
    know about."""
    return stat.S_IMODE(src.st_mode) & ~SETID


def _write_new(pfd: int, tmp: str, data: bytes, mode: int) -> None:
    from envctl.host.files import write_all

    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=pfd)
    try:
        write_all(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _commit(pfd: int, tmp: str, name: str) -> None:
    """Rename the placed temporary over `name`: readers see the old file or the new one.
    Not fsynced: a file a machine crash tears is found by check() and placed again."""
    os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)


# ---------------------------------------------------------------------- taking it away


def _remove_paths(tree: _Tree, paths: Iterable[str]) -> tuple[set[str], dict[str, str]]:
    """Remove `paths` (and their temporary siblings), deepest first, never following a
    symlink. Returns the directories kept because others' files are in them, and the paths
    that could not be removed, with why."""
    from envctl.host.safepath import Escape

    kept: set[str] = set()
    failed: dict[str, str] = {}
    for path in _removal_order(paths):
        try:
            pfd, name = tree.parent(path)
        except (Escape, FileNotFoundError, NotADirectoryError):
            # Its directory is gone, or a symlink now: what it names is not in the tree, so
            # nothing is touched (the symlink itself goes with its own entry).
            continue
        except OSError as exc:
            failed[path] = exc.strerror or str(exc)
            continue
        for n in (_tmp_name(name), name):
            have = tree.lstat(pfd, n)
            if have is None:
                continue
            try:
                if not stat.S_ISDIR(have.st_mode):
                    os.unlink(n, dir_fd=pfd)
                elif n == name:
                    os.rmdir(n, dir_fd=pfd)
                    tree.forget(path)
                # A directory at the temporary name is not envctl's: left alone.
            except FileNotFoundError:
                pass  # gone meanwhile
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    kept.add(path)  # others' files in it: it stays, and so does its entry
                else:
                    failed[path] = exc.strerror or str(exc)
    return kept, failed


def _take_down(env: str, manifest: _Manifest) -> tuple[_Manifest | None, list[str]]:
    """Remove what `manifest` lists, then the root and its parents if envctl made them and
    they are empty. Returns what stays on record (None: nothing) and the problems."""
    problems: list[str] = []
    try:
        st = os.lstat(manifest.root)
    except FileNotFoundError:
        st = None
    kept: set[str] = set()
    failed: dict[str, str] = {}
    if st is not None and not stat.S_ISDIR(st.st_mode):
        # The root itself was replaced (by a symlink, perhaps): nothing is followed.
        problems.append(f"{manifest.root} is no longer a directory; left alone")
        return manifest, problems
    if st is not None:
        with _Tree(env, manifest.root) as tree:
            kept, failed = _remove_paths(tree, manifest.paths)
    problems += [f"{p}: {why}" for p, why in sorted(failed.items())]
    made = list(manifest.made)
    if not kept and not failed:
        while made:
            try:
                os.rmdir(made[0])
            except FileNotFoundError:
                pass  # already gone
            except OSError:
                break  # not empty: somebody else's files are in it, so it stays
            made.pop(0)
        if made[:1] != [manifest.root]:
            # The root went; a parent made for it that still holds something (another
            # environment's root) is no longer this tree's to take.
            made = []
    if not made and not kept and not failed:
        return None, problems
    return _Manifest(manifest.root, made, kept | failed.keys()), problems


def _others(env: str, manifest: _Manifest) -> list[str]:
    """Paths in the tree's directories that envctl did not place (read-only)."""
    ours = manifest.paths
    tmps = set()
    for p in ours:
        d, _, name = p.rpartition("/")
        tmps.add(f"{d}/{_tmp_name(name)}")
    out: list[str] = []
    try:
        tree = _Tree(env, manifest.root)
    except HostError:
        return out
    with tree:
        for d in [""] + sorted(ours):
            try:
                names = tree.listdir(d)
            except OSError:
                continue  # not a directory, gone, or behind a symlink
            out += [f"{d}/{n}" for n in sorted(names)
                    if f"{d}/{n}" not in ours and f"{d}/{n}" not in tmps]
    return out
