"""The dynamic loader's cache: which file glibc's ld.so maps for a soname, read from
<root>/etc/ld.so.cache as ld.so reads it (no ldconfig, nothing executed)."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# glibc sysdeps/generic/dl-cache.h. The old format (libc5 era) may precede the new one in the
# same file; glibc >= 2.32's ldconfig writes the new one alone.
MAGIC_OLD = b"ld.so-1.7.0"
MAGIC_NEW = b"glibc-ld.so.cache1.1"
_OLD_HEADER = struct.Struct("=11sxI")  # magic, (pad to 4), nlibs
_OLD_ENTRY = struct.Struct("=iII")  # flags, key, value
# magic+version, nlibs, len_strings, flags (endianness), 3 pad, extension_offset, 3 unused.
_NEW_HEADER = "20sIIB3xI12x"
_NEW_ENTRY = "iIIIQ"  # flags, key, value, osversion, hwcap

# Entry flags: the low byte is the kind of library, the next the ABI it was built for.
FLAG_ELF = 0x0001
FLAG_ELF_LIBC6 = 0x0003
FLAG_X8664_LIB64 = 0x0300
FLAG_X8664_LIBX32 = 0x0800

# Which entry flags the loader of each ABI accepts (glibc sysdeps/*/dl-cache.h,
# _dl_cache_check_flags): x86-64's takes 0x0303 only, so an i386 library (flags 1 or 3) of the
# same soname is never given to an x86-64 program. Only x86 is checked here against a real
# cache; the others follow glibc's definitions.
_ACCEPTED = {
    "x86_64": (FLAG_X8664_LIB64 | FLAG_ELF_LIBC6,),
    "x32": (FLAG_X8664_LIBX32 | FLAG_ELF_LIBC6,),
    "aarch64": (0x0A00 | FLAG_ELF_LIBC6,),
    "armhf": (0x0900 | FLAG_ELF_LIBC6,),
    "armel": (0x0B00 | FLAG_ELF_LIBC6, FLAG_ELF_LIBC6),
    "ppc64": (0x0500 | FLAG_ELF_LIBC6,),
    "ppc64le": (0x0500 | FLAG_ELF_LIBC6,),
    "s390x": (0x0400 | FLAG_ELF_LIBC6,),
    "riscv64": (0x1000 | FLAG_ELF_LIBC6,),  # lp64d (double-float ABI)
    "riscv64-soft": (0x0F00 | FLAG_ELF_LIBC6,),
    "loongarch64": (0x1200 | FLAG_ELF_LIBC6,),
}
_GENERIC = (FLAG_ELF, FLAG_ELF_LIBC6)  # 32-bit ABIs without an ABI byte (i386, ppc, s390)

# uname's machine -> the ABI name used here (see machine_of).
_UNAME = {
    "x86_64": "x86_64", "i386": "i386", "i486": "i386", "i586": "i386", "i686": "i386",
    "aarch64": "aarch64", "armv7l": "armhf", "armv8l": "armhf", "ppc64le": "ppc64le",
    "ppc64": "ppc64", "s390x": "s390x", "riscv64": "riscv64", "loongarch64": "loongarch64",
}


def machine_of(elfclass: int, little_endian: bool, e_machine: str | int, e_flags: int) -> str:
    """The ABI an ELF object is built for, as ld.so tells them apart: 'x86_64', 'x32',
    'i386', 'aarch64', 'armhf' …; e_machine is pyelftools' name ('EM_X86_64'). Two objects
    can be loaded together only when these are equal."""
    if e_machine == "EM_X86_64":
        return "x86_64" if elfclass == 64 else "x32"
    if e_machine == "EM_386":
        return "i386"
    if e_machine == "EM_AARCH64" and little_endian:
        return "aarch64"
    if e_machine == "EM_ARM":
        return "armhf" if e_flags & 0x400 else "armel"  # EF_ARM_ABI_FLOAT_HARD
    if e_machine == "EM_PPC64":
        return "ppc64le" if little_endian else "ppc64"
    if e_machine == "EM_S390" and elfclass == 64:
        return "s390x"
    if e_machine == "EM_RISCV" and elfclass == 64:
        return "riscv64" if e_flags & 0x6 == 0x4 else "riscv64-soft"  # EF_RISCV_FLOAT_ABI
    if e_machine == "EM_LOONGARCH" and elfclass == 64:
        return "loongarch64"
    return f"{e_machine}-{elfclass}{'le' if little_endian else 'be'}"


def host_machine() -> str:
    """The ABI of this host's native programs (from uname, so nothing is read)."""
    name = os.uname().machine
    return _UNAME.get(name, name)


def accepted_flags(machine: str) -> tuple[int, ...]:
    """The cache entry flags the loader for `machine` (see machine_of) accepts."""
    return _ACCEPTED.get(machine, _GENERIC)


@dataclass(frozen=True)
class CacheEntry:
    """One ld.so.cache entry: `key` is the soname, `path` the file ldconfig found for it.
    `hwcap` non-zero: only for CPUs with those capabilities (a glibc-hwcaps subdirectory)."""

    key: str
    path: str
    flags: int
    hwcap: int = 0


class LdCache:
    """The entries of one ld.so.cache, in file order (ld.so takes the first that fits)."""

    def __init__(self, entries: Sequence[CacheEntry] = (), path: str = "", problem: str = ""):
        self.entries = tuple(entries)
        self.path = path
        # Why the file could not be read ("" when it could, or when there is none): ld.so then
        # ignores it, and so does this (an empty cache); missing libraries mention it.
        self.problem = problem
        self._by_key: dict[str, list[CacheEntry]] = {}
        for entry in self.entries:
            self._by_key.setdefault(entry.key, []).append(entry)

    @classmethod
    def load(cls, root: Path = Path("/")) -> LdCache:
        """`<root>/etc/ld.so.cache`; a missing file is an empty cache, as for ld.so."""
        path = os.path.join(os.fspath(root), "etc/ld.so.cache")
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return cls(path=path)
        except OSError as exc:
            return cls(path=path, problem=f"{path}: {exc.strerror}")
        try:
            return cls(parse(data), path=path)
        except ValueError as exc:
            return cls(path=path, problem=f"{path}: {exc}")

    def lookup(self, soname: str, machine: str) -> str | None:
        """The path ld.so takes from the cache for `soname` in a program for `machine`
        (see machine_of): the first entry with flags that ABI accepts. Entries for a
        glibc-hwcaps subdirectory are taken only when there is no baseline one (which one ld.so
        prefers depends on the CPU; the baseline runs everywhere)."""
        accepted = accepted_flags(machine)
        fallback = None
        for entry in self._by_key.get(soname, ()):
            if entry.flags not in accepted:
                continue
            if not entry.hwcap:
                return entry.path
            fallback = fallback or entry.path
        return fallback

    def names(self, machine: str | None = None) -> Iterator[tuple[str, str]]:
        """(soname, path) of every entry, or of those `machine`'s loader accepts."""
        accepted = accepted_flags(machine) if machine is not None else None
        for entry in self.entries:
            if accepted is None or entry.flags in accepted:
                yield entry.key, entry.path


def parse(data: bytes) -> list[CacheEntry]:
    """The entries of an ld.so.cache file; ValueError names what is wrong with it."""
    start = 0
    if data.startswith(MAGIC_OLD):
        if len(data) < _OLD_HEADER.size:
            raise ValueError("truncated header")
        (_, nlibs) = _OLD_HEADER.unpack_from(data)
        end = _OLD_HEADER.size + nlibs * _OLD_ENTRY.size
        # The new format follows the old entries, aligned as struct cache_file_new (8).
        start = (end + 7) & ~7
        if not data.startswith(MAGIC_NEW, start):
            return _parse_old(data, nlibs, end)
    if not data.startswith(MAGIC_NEW, start):
        raise ValueError("not an ld.so.cache (no 'glibc-ld.so.cache1.1' or 'ld.so-1.7.0')")
    # The header's flags byte says the byte order: 2 little, 3 big endian; 0 means native.
    order = {2: "<", 3: ">"}.get(data[start + 28] if len(data) > start + 28 else 0, "=")
    header = struct.Struct(order + _NEW_HEADER)
    entry = struct.Struct(order + _NEW_ENTRY)
    if len(data) < start + header.size:
        raise ValueError("truncated header")
    _, nlibs, _, _, _ = header.unpack_from(data, start)
    if start + header.size + nlibs * entry.size > len(data):
        raise ValueError(f"{nlibs} entries do not fit in {len(data)} bytes")
    out = []
    # String offsets of the new format count from the start of its header.
    for i in range(nlibs):
        flags, key, value, _, hwcap = entry.unpack_from(data, start + header.size + i * entry.size)
        out.append(CacheEntry(_string(data, start + key), _string(data, start + value), flags,
                              hwcap))
    return out


def _parse_old(data: bytes, nlibs: int, strings: int) -> list[CacheEntry]:
    """An old-format-only cache: string offsets count from the end of the entries."""
    if strings > len(data):
        raise ValueError(f"{nlibs} entries do not fit in {len(data)} bytes")
    out = []
    for i in range(nlibs):
        flags, key, value = _OLD_ENTRY.unpack_from(data, _OLD_HEADER.size + i * _OLD_ENTRY.size)
        out.append(CacheEntry(_string(data, strings + key), _string(data, strings + value),
                              flags))
    return out


def _string(data: bytes, offset: int) -> str:
    end = data.find(b"\0", offset)
    if offset >= len(data) or end < 0:
        raise ValueError(f"string offset {offset} outside the file")
    return os.fsdecode(data[offset:end])
