"""What a minimal root filesystem needs from this host: programs found on PATH, the ELF
interpreters and shared libraries they load (resolved as glibc's ld.so resolves them, without
executing anything), the Python runtime and the NVIDIA driver libraries.

Paths: every path this module takes or returns is a path inside `root` (absolute), which is also
the path inside the environment; only PlacedFile.source is prefixed with `root` (the file on this
host). Symlinks are resolved as the kernel would after chroot(root): an absolute link target
never leaves root. With root = / the two kinds of path are the same.

What ld.so does that this does not follow, on purpose: LD_LIBRARY_PATH and LD_PRELOAD (the
environment's, not the host's), /etc/ld.so.preload, glibc-hwcaps and legacy hwcap
subdirectories of the search directories (CPU-dependent; the baseline library is taken, which
runs everywhere), relative RPATH/RUNPATH entries (relative to the process's working directory)
and $PLATFORM (CPU-dependent; reported in `missing`).
"""

from __future__ import annotations

import os
import re
import stat
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import BinaryIO

from envctl.facts import PlacedFile, RootfsFacts
from envctl.host.ldcache import LdCache, host_machine, machine_of

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Top-level directories a merged-/usr host makes symlinks; the rootfs mirrors those links
# (RootfsFacts.links), so files are placed below their targets and these are never PlacedFiles.
TOP_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_MAXSYMLINKS = 40  # the kernel's limit on links followed in one lookup (ELOOP beyond)
_DF_1_NODEFLIB = 0x800  # DT_FLAGS_1: no ld.so.cache, no default directories
_HEAD = 256  # the kernel reads this much of a file for a #! line (BINPRM_BUF_SIZE)

# Debian's multiarch triplet per ABI: its ld.so expands $LIB to lib/<triplet> and searches
# /lib/<triplet>, /usr/lib/<triplet>, /lib, /usr/lib (checked: LD_DEBUG=libs on Debian 12).
_MULTIARCH = {
    "x86_64": "x86_64-linux-gnu", "i386": "i386-linux-gnu", "x32": "x86_64-linux-gnux32",
    "aarch64": "aarch64-linux-gnu", "armhf": "arm-linux-gnueabihf",
    "armel": "arm-linux-gnueabi", "ppc64le": "powerpc64le-linux-gnu",
    "ppc64": "powerpc64-linux-gnu", "s390x": "s390x-linux-gnu", "riscv64": "riscv64-linux-gnu",
}
# Upstream glibc (Fedora, Arch …): $LIB and the default directories use the plain libdir.
_LIBDIR = {"x86_64": "lib64", "x32": "libx32", "aarch64": "lib64", "ppc64le": "lib64",
           "ppc64": "lib64", "s390x": "lib64", "riscv64": "lib64/lp64d",
           "loongarch64": "lib64"}

# libnvidia-container's utility, compute and video libraries (src/nvc_info.c), which it takes
# from ld.so.cache by name prefix when the real file's name ends with the driver's version.
# Graphics (GL/EGL/Vulkan) libraries are left out: envctl's environments run compute jobs.
DRIVER_LIBRARIES = (
    "libnvidia-ml.so", "libnvidia-cfg.so", "libnvidia-nscq.so",
    "libcuda.so", "libcudadebugger.so", "libnvidia-opencl.so", "libnvidia-gpucomp.so",
    "libnvidia-ptxjitcompiler.so", "libnvidia-fatbinaryloader.so", "libnvidia-allocator.so",
    "libnvidia-compiler.so", "libnvidia-pkcs11.so", "libnvidia-pkcs11-openssl3.so",
    "libnvidia-nvvm.so", "libnvidia-tileiras.so",
    "libvdpau_nvidia.so", "libnvidia-encode.so", "libnvidia-opticalflow.so", "libnvcuvid.so",
)

# A dynamic string token as ld.so recognises it: $NAME followed by '/' or the end, or ${NAME}.
_DST = re.compile(r"\$(?:\{(ORIGIN|LIB|PLATFORM)\}|(ORIGIN|LIB|PLATFORM)(?=/|$))")


@dataclass(frozen=True)
class ElfInfo:
    """What ld.so reads from an ELF file's program headers and dynamic section."""

    machine: str  # ldcache.machine_of: objects load together only when these are equal
    interp: str = ""  # PT_INTERP
    needed: tuple[str, ...] = ()  # DT_NEEDED, in order
    rpath: str | None = None  # DT_RPATH; None when absent or when there is a DT_RUNPATH
    runpath: str | None = None  # DT_RUNPATH; None when absent
    soname: str = ""
    nodeflib: bool = False  # DF_1_NODEFLIB


def read_elf(path: str) -> ElfInfo:
    """The dynamic-loading facts of the ELF file at host path `path`; ValueError says why
    the file is not a usable ELF file."""
    # Lazy: pyelftools costs ~45 ms to import, paid only when a rootfs is resolved.
    from elftools.common.exceptions import ELFError
    from elftools.construct import ConstructError

    try:
        with open(path, "rb") as f:
            return _read_elf(f)
    except OSError as exc:
        raise ValueError(exc.strerror) from exc
    except (ELFError, ConstructError, IndexError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from exc


def _read_elf(f: BinaryIO) -> ElfInfo:
    from elftools.common.utils import struct_parse
    from elftools.elf.elffile import ELFFile

    elf = ELFFile(f)
    header = elf.header
    machine = machine_of(elf.elfclass, elf.little_endian, header["e_machine"], header["e_flags"])
    # Program headers through pyelftools' structs, not its Segment objects: a DynamicSegment
    # walks every section header to find its string table (~2 ms a file); ld.so uses
    # DT_STRTAB through the PT_LOAD mappings, and so does this.
    loads, interp, dynamic = [], "", None
    for i in range(elf.num_segments()):
        ph = struct_parse(elf.structs.Elf_Phdr, f,
                          stream_pos=header["e_phoff"] + i * header["e_phentsize"])
        if ph["p_type"] == "PT_LOAD":
            loads.append(ph)
        elif ph["p_type"] == "PT_INTERP":
            f.seek(ph["p_offset"])
            interp = os.fsdecode(f.read(ph["p_filesz"]).split(b"\0", 1)[0])
        elif ph["p_type"] == "PT_DYNAMIC":
            dynamic = ph
    if dynamic is None:
        return ElfInfo(machine, interp)
    dyn = elf.structs.Elf_Dyn
    tags: list[tuple[str, int]] = []
    for i in range(dynamic["p_filesz"] // dyn.sizeof()):
        entry = struct_parse(dyn, f, stream_pos=dynamic["p_offset"] + i * dyn.sizeof())
        if entry["d_tag"] == "DT_NULL":
            break
        tags.append((entry["d_tag"], entry["d_val"]))
    values = dict(tags)
    strtab = b""
    if "DT_STRTAB" in values:
        addr = values["DT_STRTAB"]
        for ph in loads:
            if ph["p_vaddr"] <= addr < ph["p_vaddr"] + ph["p_filesz"]:
                f.seek(addr - ph["p_vaddr"] + ph["p_offset"])
                strtab = f.read(values.get("DT_STRSZ", 0))
                break

    def string(offset: int) -> str:
        end = strtab.find(b"\0", offset)
        if end < 0:
            raise ValueError(f"dynamic string at {offset} outside DT_STRTAB")
        return os.fsdecode(strtab[offset:end])

    needed = tuple(string(v) for t, v in tags if t == "DT_NEEDED")
    runpath = string(values["DT_RUNPATH"]) if "DT_RUNPATH" in values else None
    # glibc ignores DT_RPATH in an object that has DT_RUNPATH (get-dynamic-info.h).
    rpath = string(values["DT_RPATH"]) if "DT_RPATH" in values and runpath is None else None
    return ElfInfo(
        machine=machine, interp=interp, needed=needed, rpath=rpath, runpath=runpath,
        soname=string(values["DT_SONAME"]) if "DT_SONAME" in values else "",
        nodeflib=bool(values.get("DT_FLAGS_1", 0) & _DF_1_NODEFLIB))


class _Tree:
    """Files inside `root`, looked up as the kernel would after chroot(root); every answer is
    cached, since one closure asks about the same directories many times."""

    def __init__(self, root: Path):
        self.prefix = os.fspath(root).rstrip("/")
        self._links: dict[str, str | None] = {}
        self._elf: dict[str, ElfInfo | str] = {}
        self._heads: dict[str, bytes] = {}
        self._lib_dirs: dict[str, tuple[str, tuple[str, ...]]] = {}

    def host(self, path: str) -> str:
        return self.prefix + path

    def readlink(self, path: str) -> str | None:
        if path not in self._links:
            try:
                self._links[path] = os.readlink(self.host(path))
            except OSError:  # EINVAL: not a link; ENOENT/ENOTDIR: nothing there
                self._links[path] = None
        return self._links[path]

    def walk(self, path: str) -> tuple[str, list[tuple[str, str]]] | None:
        """The canonical path of absolute `path` (no symlinks in it), and every symlink met
        on the way as (its own canonical path, its target text); None on a symlink loop."""
        parts = deque(p for p in path.split("/") if p)
        current, links, hops = "", [], 0
        while parts:
            name = parts.popleft()
            if name == ".":
                continue
            if name == "..":  # `current` holds no links, so its parent is the lexical one
                current = current.rsplit("/", 1)[0]
                continue
            candidate = f"{current}/{name}"
            target = self.readlink(candidate)
            if target is None:
                current = candidate
                continue
            hops += 1
            if hops > _MAXSYMLINKS:
                return None
            links.append((candidate, target))
            if target.startswith("/"):
                current = ""
            parts.extendleft(reversed([p for p in target.split("/") if p]))
        return current or "/", links

    def mode(self, real: str) -> int:
        try:
            return os.stat(self.host(real)).st_mode
        except OSError:
            return 0

    def regular(self, real: str) -> bool:
        return stat.S_ISREG(self.mode(real))

    def head(self, real: str) -> bytes:
        if real not in self._heads:
            try:
                with open(self.host(real), "rb") as f:
                    self._heads[real] = f.read(_HEAD)
            except OSError:
                self._heads[real] = b""
        return self._heads[real]

    def elf(self, real: str) -> ElfInfo:
        """read_elf of the file at canonical `real`, once; ValueError when it is not ELF."""
        if real not in self._elf:
            if not self.head(real).startswith(b"\x7fELF"):
                self._elf[real] = "invalid ELF header"
            else:
                try:
                    self._elf[real] = read_elf(self.host(real))
                except ValueError as exc:
                    self._elf[real] = str(exc)
        found = self._elf[real]
        if isinstance(found, str):
            raise ValueError(found)
        return found

    def place(self, path: str, placed: dict[str, PlacedFile]) -> str | None:
        """Add the regular file `path` names to `placed` at its canonical path, with every
        symlink on the way to it (a versioned library's soname link, /usr/lib64/ld-linux…,
        a directory link deeper than TOP_DIRS) as a link PlacedFile, so that `path` itself
        resolves the same way inside the environment. Its canonical path; None when `path`
        names no regular file."""
        walked = self.walk(path)
        if walked is None or not self.regular(walked[0]):
            return None
        real, links = walked
        for where, target in links:
            if where.count("/") == 1 and where[1:] in TOP_DIRS:
                continue  # mirrored by top_links
            placed.setdefault(where, PlacedFile(where, self.host(where), target))
        placed.setdefault(real, PlacedFile(real, self.host(real)))
        return real

    def lib_dirs(self, machine: str) -> tuple[str, tuple[str, ...]]:
        """$LIB and the default search directories of `machine`'s ld.so on this tree: Debian's
        multiarch layout when <root>/usr/lib/<triplet> exists, upstream's otherwise (which
        layout a loader was built for is not recorded anywhere ld.so-independent)."""
        if machine not in self._lib_dirs:
            triplet = _MULTIARCH.get(machine, "")
            walked = self.walk(f"/usr/lib/{triplet}") if triplet else None
            if walked is not None and stat.S_ISDIR(self.mode(walked[0])):
                self._lib_dirs[machine] = f"lib/{triplet}", (
                    f"/lib/{triplet}", f"/usr/lib/{triplet}", "/lib", "/usr/lib")
            else:
                libdir = _LIBDIR.get(machine, "lib")
                self._lib_dirs[machine] = libdir, (f"/{libdir}", f"/usr/{libdir}")
        return self._lib_dirs[machine]


@dataclass(eq=False)
class _Object:
    """One object in a simulated process: `path` as ld.so found it (its l_name)."""

    path: str
    real: str
    origin: str  # what $ORIGIN expands to in this object's tags
    info: ElfInfo
    loader: _Object | None  # the object whose DT_NEEDED brought it in (l_loader)


class _Unsupported(Exception):
    """A dynamic string token envctl cannot expand without running on the target CPU."""


class _Closure:
    """The files a set of programs, scripts and libraries need, gathered into `placed`."""

    def __init__(self, tree: _Tree, cache: LdCache):
        self.tree = tree
        self.cache = cache
        self.placed: dict[str, PlacedFile] = {}
        self.missing: dict[tuple[str, str], None] = {}  # ordered, each once
        self._done: set[str] = set()

    def result(self) -> tuple[list[PlacedFile], list[tuple[str, str]]]:
        return sorted(self.placed.values(), key=lambda f: f.path), list(self.missing)

    def miss(self, item: str, why: str) -> None:
        self.missing.setdefault((item, why), None)

    def add(self, path: str) -> None:
        """`path` and what it needs: an ELF file's interpreter and libraries, a script's
        interpreter; other files are placed as they are."""
        # Each path with what brought it in, for the message when it is not there.
        queue: deque[tuple[str, str]] = deque([(path, "")])
        while queue:
            path, by = queue.popleft()
            if path in self._done:
                continue
            self._done.add(path)
            if not path.startswith("/"):
                self.miss(path, f"not an absolute path{by}")
                continue
            real = self.tree.place(path, self.placed)
            if real is None:
                self.miss(path, f"no such file (or not a regular file){by}")
                continue
            head = self.tree.head(real)
            if head.startswith(b"\x7fELF"):
                self._load(path, real)
            elif head.startswith(b"#!"):
                queue.extend((found, f"; named on the #! line of {path}")
                             for found in self._shebang(path, head))

    def _shebang(self, path: str, head: bytes) -> list[str]:
        """The interpreter of a script, as binfmt_script reads the #! line (the interpreter,
        then at most one argument), and the program `env` would start."""
        line = os.fsdecode(head[2:].split(b"\n", 1)[0]).strip(" \t")
        interp, _, arg = line.replace("\t", " ").partition(" ")
        if not interp:
            self.miss(path, "its #! line names no interpreter")
            return []
        if not interp.startswith("/"):
            self.miss(interp, f"named on the #! line of {path}: not an absolute path")
            return []
        out = [interp]
        if os.path.basename(interp) == "env":
            words = [w for w in arg.split() if not w.startswith("-") and "=" not in w]
            if words:
                program = _find_program(self.tree, words[0], DEFAULT_PATH)
                if program is None:
                    self.miss(words[0], f"named on the #! line of {path}: not found in "
                                        f"{_dirs(DEFAULT_PATH)}")
                else:
                    out.append(program)
        return out

    def _load(self, path: str, real: str) -> None:
        try:
            info = self.tree.elf(real)
        except ValueError as exc:
            self.miss(path, f"not a usable ELF file: {exc}")
            return
        # $ORIGIN of a program is the directory of /proc/self/exe, which the kernel gives as
        # the canonical path (symlinks resolved), so a symlink to a program elsewhere still
        # finds $ORIGIN/../lib next to the real file; a library (no PT_INTERP: dlopen'ed by
        # path) gets the directory of the path it was opened by, unresolved, as for every
        # library ld.so finds (glibc _dl_new_object keeps the name as given).
        program = bool(info.interp)
        first = _Object(path, real, os.path.dirname(real if program else path), info, None)
        _Process(self, first, program).run()


class _Process:
    """ld.so's loading of one program (or one dlopen'ed library): breadth-first over
    DT_NEEDED, each name looked up as _dl_map_object does (glibc 2.36, elf/dl-load.c)."""

    def __init__(self, closure: _Closure, first: _Object, program: bool):
        self.closure = closure
        self.tree = closure.tree
        self.first = first
        self.main = first if program else None  # the main map, whose RPATH every lookup sees
        self.by_name: dict[str, _Object] = {}
        self.by_real: dict[str, _Object] = {first.real: first}
        self.machine = first.info.machine

    def run(self) -> None:
        if self.main is not None and self.main.info.interp:
            self._interpreter(self.main)
        queue = deque([self.first])
        while queue:
            obj = queue.popleft()
            for name in obj.info.needed:
                if name in self.by_name:  # already loaded under this name or soname
                    continue
                before = len(self.by_real)
                dep = self._map(name, obj)
                if dep is not None:
                    self._register(name, dep)
                    if len(self.by_real) > before:
                        queue.append(dep)

    def _register(self, name: str, obj: _Object) -> None:
        self.by_name.setdefault(name, obj)
        if obj.info.soname:
            self.by_name.setdefault(obj.info.soname, obj)

    def _interpreter(self, main: _Object) -> None:
        # The interpreter must be found at exactly PT_INTERP inside the environment: place
        # puts it at its canonical path and adds the links on the way (TOP_DIRS aside).
        interp = main.info.interp
        real = self.tree.place(interp, self.closure.placed)
        if real is None:
            self.closure.miss(interp, f"the ELF interpreter of {main.path}: no such file")
            return
        try:
            info = self.tree.elf(real)
        except ValueError as exc:
            self.closure.miss(interp, f"the ELF interpreter of {main.path}: {exc}")
            return
        obj = _Object(interp, real, os.path.dirname(interp), info, None)
        self.by_real[real] = obj
        # ld.so is loaded under its PT_INTERP name and its soname, so libc's DT_NEEDED on
        # ld-linux-x86-64.so.2 is this object and no lookup happens.
        self._register(interp, obj)

    def _map(self, name: str, requester: _Object) -> _Object | None:
        """The object DT_NEEDED `name` of `requester` resolves to; None (and a `missing`
        item) when ld.so would fail."""
        if "$" in name:
            try:
                name = self._expand(name, requester)
            except _Unsupported as exc:
                self.closure.miss(name, f"needed by {requester.path}: {exc}")
                return None
        if "/" in name:  # a path: opened as is, no search
            if not name.startswith("/"):
                self.closure.miss(name, f"needed by {requester.path}: a path relative to the "
                                        "working directory")
                return None
            skipped: list[str] = []
            found, why = self._try(name, requester, skipped)
            if found is None:
                why = why or (f"built for another machine: {skipped[0]}" if skipped
                              else "no such file")
                self.closure.miss(name, f"needed by {requester.path}: {why}")
            return found
        searched: list[str] = []
        skipped = []
        # DT_RPATH of the requester and of each object that loaded it, up to the program,
        # then the program's own; none of it when the requester has DT_RUNPATH.
        if requester.info.runpath is None:
            seen_main = False
            owner: _Object | None = requester
            while owner is not None:
                if owner.info.rpath:
                    found = self._search(name, owner.info.rpath, owner, requester, skipped)
                    if found is not None:
                        return found
                    searched.append(f"the RPATH of {owner.path}")
                    seen_main |= owner is self.main
                owner = owner.loader
            if self.main is not None and not seen_main and self.main.info.rpath:
                found = self._search(name, self.main.info.rpath, self.main, requester, skipped)
                if found is not None:
                    return found
                searched.append(f"the RPATH of {self.main.path}")
        elif requester.info.runpath:  # DT_RUNPATH serves the object's own needs only
            found = self._search(name, requester.info.runpath, requester, requester, skipped)
            if found is not None:
                return found
            searched.append(f"the RUNPATH of {requester.path}")
        if not requester.info.nodeflib:
            cached = self.closure.cache.lookup(name, self.machine)
            if cached is not None:
                found, why = self._try(cached, requester, skipped)
                if found is not None or why:
                    return self._found_or_fail(found, why, name, requester)
            searched.append("ld.so.cache")
            _, defaults = self.tree.lib_dirs(self.machine)
            for directory in defaults:
                found, why = self._try(f"{directory}/{name}", requester, skipped)
                if found is not None or why:
                    return self._found_or_fail(found, why, name, requester)
            searched.append(f"the default directories ({', '.join(defaults)})")
        why = f"needed by {requester.path}; not in {_either(searched)}"
        if skipped:
            why += f"; skipped for another machine: {', '.join(skipped)}"
        if self.closure.cache.problem:
            why += f"; ld.so.cache ignored: {self.closure.cache.problem}"
        self.closure.miss(name, why)
        return None

    def _found_or_fail(self, found: _Object | None, why: str, name: str,
                       requester: _Object) -> _Object | None:
        if found is None:
            self.closure.miss(name, f"needed by {requester.path}: {why}")
        return found

    def _search(self, name: str, dirs: str, owner: _Object, requester: _Object,
                skipped: list[str]) -> _Object | None:
        """Look for `name` in the RPATH/RUNPATH `dirs` of `owner` (whose $ORIGIN applies)."""
        for entry in dirs.split(":"):
            if not entry:
                continue
            try:
                directory = self._expand(entry, owner)
            except _Unsupported as exc:
                self.closure.miss(entry, f"in the RPATH/RUNPATH of {owner.path}: {exc}")
                continue
            if not directory.startswith("/"):
                continue  # relative to the process's working directory: unknowable here
            directory = directory.rstrip("/")
            found, why = self._try(f"{directory}/{name}", requester, skipped)
            if why:  # ld.so stops at a file it cannot load
                self.closure.miss(name, f"needed by {requester.path}: {why}")
                return None
            if found is not None:
                return found
        return None

    def _try(self, path: str, requester: _Object,
             skipped: list[str] | None = None) -> tuple[_Object | None, str]:
        """Open `path` as ld.so's open_verify does: (the object, "") when it loads; (None, "")
        when there is no such file or it is built for another machine (ld.so goes on
        searching); (None, why) when ld.so would stop with an error (not ELF)."""
        walked = self.tree.walk(path)
        if walked is None or not self.tree.regular(walked[0]):
            return None, ""
        real = walked[0]
        try:
            info = self.tree.elf(real)
        except ValueError as exc:
            return None, f"{path}: {exc}"
        if info.machine != self.machine:
            if skipped is not None:
                skipped.append(f"{path} ({info.machine})")
            return None, ""
        if real in self.by_real:  # the same file under another name: ld.so reuses it
            return self.by_real[real], ""
        self.tree.place(path, self.closure.placed)
        obj = _Object(path, real, os.path.dirname(path), info, requester)
        self.by_real[real] = obj
        return obj, ""

    def _expand(self, text: str, owner: _Object) -> str:
        def token(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            if name == "ORIGIN":
                return owner.origin
            if name == "LIB":
                return self.tree.lib_dirs(owner.info.machine)[0]
            raise _Unsupported("$PLATFORM is not supported (its value depends on the CPU)")

        return _DST.sub(token, text)


def _either(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items) or "any searched directory"
    return f"{', '.join(items[:-1])} or {items[-1]}"


def _dirs(path: str) -> str:
    return ", ".join(d for d in path.split(":") if d)


def _under(path: str, dirs: Iterable[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def closure(paths: Iterable[str], root: Path = Path("/"),
            cache: LdCache | None = None) -> tuple[list[PlacedFile], list[tuple[str, str]]]:
    """Every file `paths` need in a root filesystem, placed at its canonical path, and what
    cannot be found as (item, why).

    ELF files bring their PT_INTERP interpreter and their DT_NEEDED libraries, recursively,
    resolved as glibc's ld.so would (RPATH, RUNPATH, $ORIGIN/$LIB, ld.so.cache, the default
    directories; libraries for another machine are skipped); scripts bring the interpreter on
    their #! line; other files come as they are.

        closure(["/usr/bin/bash"]) -> ([PlacedFile("/usr/bin/bash", "/usr/bin/bash"),
            PlacedFile("/usr/lib/x86_64-linux-gnu/libc.so.6", …), …], [])
    """
    clo = _Closure(_Tree(root), cache if cache is not None else LdCache.load(root))
    for path in paths:
        clo.add(path)
    return clo.result()


def _find_program(tree: _Tree, name: str, path: str) -> str | None:
    if "/" in name:
        candidates = [name] if name.startswith("/") else []
    else:
        # Relative PATH entries (and the empty one, meaning '.') depend on the working
        # directory inside the environment: not searched.
        candidates = [f"{d.rstrip('/')}/{name}" for d in path.split(":") if d.startswith("/")]
    for candidate in candidates:
        walked = tree.walk(candidate)
        if walked is None:
            continue
        mode = tree.mode(walked[0])
        if stat.S_ISREG(mode) and mode & 0o111:
            return candidate
    return None


def find_program(name: str, root: Path = Path("/"), path: str = DEFAULT_PATH) -> str | None:
    """Where `name` is: a bare name in `path` order, an absolute path as it is; it must be a
    regular file (symlinks followed) with an execute bit. The path as found, not resolved.

        find_program("python3") -> "/usr/bin/python3"
    """
    return _find_program(_Tree(root), name, path)


def glob_libraries(patterns: Iterable[str], cache: LdCache, root: Path = Path("/"), *,
                   machine: str | None = None) -> tuple[list[str], list[tuple[str, str]]]:
    """The libraries shell-style `patterns` name: one without '/' is matched against the
    sonames (and file names) in ld.so.cache for this host's machine, as ld.so would pick them;
    one with '/' is a file glob. Sorted paths, and (pattern, why) for each that matched no
    file.

        glob_libraries(["libz.so*"], LdCache.load())
            -> (["/lib/x86_64-linux-gnu/libz.so", "/lib/x86_64-linux-gnu/libz.so.1"], [])
    """
    import glob

    tree = _Tree(root)
    machine = machine or host_machine()
    found: set[str] = set()
    missing = []
    for pattern in patterns:
        if "/" in pattern and not pattern.startswith("/"):
            missing.append((pattern, "not an absolute path"))
            continue
        if "/" in pattern:
            hits = {h[len(tree.prefix):] for h in glob.glob(tree.host(pattern))}
            where = "no file matches"
        else:
            hits = set()
            for key, path in cache.names(machine):
                if fnmatchcase(key, pattern):
                    hits.add(cache.lookup(key, machine) or path)
                elif fnmatchcase(os.path.basename(path), pattern):
                    hits.add(path)
            where = "no library in ld.so.cache matches"
            if hits:
                where = f"ld.so.cache names {', '.join(sorted(hits))}, but no such file"
        hits = {h for h in hits if (w := tree.walk(h)) is not None and tree.regular(w[0])}
        if hits:
            found |= hits
        else:
            missing.append((pattern, where))
    return sorted(found), missing


def top_links(root: Path = Path("/")) -> tuple[tuple[str, str], ...]:
    """(name, link text) of the host's /bin, /sbin, /lib, /lib32, /lib64 and /libx32 that are
    symlinks: a merged-/usr host gives (("bin", "usr/bin"), ("lib", "usr/lib"), …)."""
    tree = _Tree(root)
    return tuple((name, target) for name in TOP_DIRS
                 if (target := tree.readlink(f"/{name}")) is not None)


def _python_runtime(tree: _Tree) -> tuple[str, list[str], list[str]] | None:
    exe = _find_program(tree, "python3", DEFAULT_PATH)
    if exe is None:
        return None
    real = tree.walk(exe)[0]  # _find_program walked it: never a loop here
    bindir = os.path.dirname(real)
    prefix = os.path.dirname(bindir) if os.path.basename(bindir) == "bin" else bindir
    # The standard library is <prefix>/lib/pythonX.Y (lib64 on Fedora's platlibdir), named
    # after the interpreter's real file (python3.11, python3.13t); a bare `python3` file
    # means: whichever single pythonX.Y has an os.py.
    match = re.fullmatch(r"python(3\.\d+[a-z]*)", os.path.basename(real))
    versions = [match.group(1)] if match else _python_versions(tree, prefix)
    stdlib: list[str] = []
    dynload: list[str] = []
    for version in versions:
        for libdir in ("lib", "lib64"):
            walked = tree.walk(f"{prefix.rstrip('/')}/{libdir}/python{version}")
            if walked is None:
                continue
            directory = walked[0]
            if tree.regular(f"{directory}/os.py") and directory not in stdlib:
                stdlib.append(directory)
            if stat.S_ISDIR(tree.mode(f"{directory}/lib-dynload")) and \
                    f"{directory}/lib-dynload" not in dynload:
                dynload.append(f"{directory}/lib-dynload")
    modules = []
    for directory in dynload:
        try:
            names = os.listdir(tree.host(directory))
        except OSError:
            continue
        for name in names:
            path = f"{directory}/{name}"
            if name.endswith(".so") and tree.regular(path) and \
                    tree.head(path).startswith(b"\x7fELF"):
                modules.append(path)
    binds = stdlib + [d for d in dynload if not _under(d, stdlib)]
    return exe, sorted(binds), sorted(modules)


def _python_versions(tree: _Tree, prefix: str) -> list[str]:
    found = set()
    for libdir in ("lib", "lib64"):
        try:
            names = os.listdir(tree.host(f"{prefix.rstrip('/')}/{libdir}"))
        except OSError:
            continue
        for name in names:
            if re.fullmatch(r"python3\.\d+[a-z]*", name) and \
                    tree.regular(f"{prefix.rstrip('/')}/{libdir}/{name}/os.py"):
                found.add(name[len("python"):])
    return sorted(found) if len(found) == 1 else []


def python_runtime(root: Path = Path("/")) -> tuple[str, list[str], list[str]] | None:
    """The host's python3 (the one on DEFAULT_PATH, not this process's interpreter, which may
    be a virtual environment's), found without running it: (its path as found, the standard
    library directories to bind read-only, the ELF extension modules of lib-dynload). The
    directory list is empty when no os.py was found; None when there is no python3.

        python_runtime() -> ("/usr/bin/python3", ["/usr/lib/python3.11"],
                             ["/usr/lib/python3.11/lib-dynload/_bz2.cpython-311-….so", …])
    """
    return _python_runtime(_Tree(root))


def _outside_links(tree: _Tree, binds: list[str], clo: _Closure) -> None:
    """Files the bound directories link to from their top level but do not hold (Debian's
    /usr/lib/python3.11/sitecustomize.py -> /etc/python3.11/sitecustomize.py): placed, so
    the links are not left dangling inside the environment."""
    for directory in binds:
        try:
            entries = list(os.scandir(tree.host(directory)))
        except OSError:
            continue
        for entry in sorted(entries, key=lambda e: e.name):
            if not entry.is_symlink():
                continue
            path = f"{directory}/{entry.name}"
            walked = tree.walk(path)
            if walked is not None and not _under(walked[0], binds) and tree.regular(walked[0]):
                clo.add(path)


def resolve_rootfs(binaries: Iterable[str], libraries: Iterable[str], python: bool,
                   root: Path = Path("/")) -> RootfsFacts:
    """What a rootfs with `binaries` (names looked up on DEFAULT_PATH, or absolute paths),
    `libraries` (glob_libraries patterns) and, when `python`, the host's python3 needs from
    this host: the files with their closures (and the host's ld.so.cache), the top-level
    links, the Python standard library to bind, and what cannot be had. Files under a bound
    directory are left to the bind.

        resolve_rootfs(["bash"], [], python=True) -> RootfsFacts(files=(…), binds=(
            "/usr/lib/python3.11",), python="/usr/bin/python3", links=(("bin", "usr/bin"), …))
    """
    tree = _Tree(root)
    cache = LdCache.load(root)
    clo = _Closure(tree, cache)
    missing: dict[tuple[str, str], None] = {}
    for name in binaries:
        program = _find_program(tree, name, DEFAULT_PATH)
        if program is None:
            where = name if name.startswith("/") else f"PATH dirs {_dirs(DEFAULT_PATH)}"
            missing.setdefault((f"binary {name}", f"not found in {where} (an executable "
                                                  "regular file)"), None)
        else:
            clo.add(program)
    libs, lib_missing = glob_libraries(libraries, cache, root)
    for pattern, why in lib_missing:
        missing.setdefault((f"library {pattern}", why), None)
    for lib in libs:
        clo.add(lib)
    interpreter, binds = "", []
    if python:
        runtime = _python_runtime(tree)
        if runtime is None:
            missing.setdefault(("python", f"no python3 in {_dirs(DEFAULT_PATH)}"), None)
        else:
            interpreter, binds, modules = runtime
            if not binds:
                missing.setdefault(("python", f"no standard library (os.py) found for "
                                              f"{interpreter}"), None)
            clo.add(interpreter)
            for module in modules:
                clo.add(module)
            _outside_links(tree, binds, clo)
    if cache.entries and clo.placed:
        # The loader inside the environment reads the same cache: without it, a library that
        # ldconfig found outside the default directories (an ld.so.conf.d entry such as
        # /usr/local/cuda/lib64, or the driver's libcuda.so.1 that CUDA dlopens) is not found
        # there. Its paths are the host's, which the placed files and top links keep.
        clo.add("/etc/ld.so.cache")
    files, closure_missing = clo.result()
    for item in closure_missing:
        missing.setdefault(item, None)
    return RootfsFacts(
        files=tuple(f for f in files if not _under(f.path, binds)),
        links=top_links(root),
        binds=tuple(binds),
        python=interpreter,
        missing=tuple(missing),
    )


def driver_libraries(version: str, root: Path = Path("/"),
                     cache: LdCache | None = None) -> list[PlacedFile]:
    """The NVIDIA driver libraries for driver `version`, as libnvidia-container selects them:
    ld.so.cache entries of this machine named after DRIVER_LIBRARIES whose real file ends in
    `.so.<version>` (another installed version is skipped), each with its soname link
    (libcuda.so.1 -> libcuda.so.550.54.15) as ldconfig made it. Sorted by path.

        driver_libraries("550.54.15") -> [PlacedFile("/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            …, link="libcuda.so.550.54.15"), PlacedFile("…/libcuda.so.550.54.15", …), …]
    """
    if not version:
        return []
    tree = _Tree(root)
    cache = cache if cache is not None else LdCache.load(root)
    placed: dict[str, PlacedFile] = {}
    for key, path in cache.names(host_machine()):
        if not key.startswith(DRIVER_LIBRARIES):
            continue
        walked = tree.walk(path)
        if walked is None or not walked[0].endswith(f".so.{version}"):
            continue
        # A versioned key (libcuda.so.1) is the soname link ldconfig made: placed with the
        # file. An unversioned one (libcuda.so, a development link) brings the file only, as
        # libnvidia-container mounts files and leaves links to ldconfig.
        tree.place(path if ".so." in key else walked[0], placed)
    return sorted(placed.values(), key=lambda f: f.path)
