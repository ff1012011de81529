"""cgroup v2 device allow-lists: a BPF_PROG_TYPE_CGROUP_DEVICE program assembled here from raw
eBPF instructions, loaded with bpf(2) through ctypes and attached to a cgroup (no compiler)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import platform
import struct
import time
from pathlib import Path

from envctl.errors import HostError
from envctl.host.libc import libc as _libc

# bpf(2)'s number by `uname -m`, with the word size of the ABI it is for, as the kernel's
# syscall tables have them (arch/*/syscall*.tbl; asm-generic/unistd.h for aarch64, riscv64 and
# loongarch64). A 32-bit process on a 64-bit kernel (or x32) calls through another table: not
# known either. A guessed number would be some other syscall with a pointer in its arguments.
SYS_BPF = {
    "x86_64": (321, 64), "i686": (357, 32), "i386": (357, 32),
    "aarch64": (280, 64), "armv7l": (386, 32), "armv8l": (386, 32),
    "ppc64le": (361, 64), "ppc64": (361, 64), "s390x": (351, 64),
    "riscv64": (280, 64), "loongarch64": (280, 64),
}
_WORD_BITS = struct.calcsize("P") * 8
# bpf(2) commands
BPF_PROG_LOAD, BPF_PROG_ATTACH, BPF_PROG_DETACH = 5, 8, 9
BPF_PROG_GET_FD_BY_ID, BPF_OBJ_GET_INFO_BY_FD, BPF_PROG_QUERY = 13, 15, 16
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6  # attach type
# struct bpf_cgroup_dev_ctx { u32 access_type /* access << 16 | type */; u32 major; u32 minor; }
DEV_BLOCK, DEV_CHAR = 1, 2
ACC_MKNOD, ACC_READ, ACC_WRITE = 1, 2, 4
ATTR_SIZE = 128  # zero-filled union bpf_attr; the kernel accepts trailing zeros
_LOG_SIZE = 1 << 18  # for a failed load's verifier log (ours are a few KiB)
_LOG_LINES = 6  # of it, in the error: the refusal and the lines that lead to it


# ---------------------------------------------------------------- assembling the program


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


LDX_W = 0x61       # dst = *(u32 *)(src + off)
AND32_K = 0x54     # dst &= imm (32-bit)
RSH32_K = 0x74     # dst >>= imm (32-bit)
MOV64_X = 0xBF     # dst = src
MOV64_K = 0xB7     # dst = imm
JNE_K = 0x55       # if dst != imm: pc += off
EXIT = 0x95


def parse_rule(rule: str) -> tuple[str, int, int, int]:
    """("c"|"b"|"a", major or -1, minor or -1, access bits) from "c 195:* rwm" or "a"."""
    parts = rule.split()
    if parts[0] == "a":
        return ("a", -1, -1, ACC_MKNOD | ACC_READ | ACC_WRITE)
    if len(parts) != 3 or parts[0] not in ("c", "b"):
        raise ValueError(f"bad device rule '{rule}'")
    major_s, _, minor_s = parts[1].partition(":")
    major = -1 if major_s == "*" else int(major_s)
    minor = -1 if minor_s == "*" else int(minor_s)
    access = sum({"m": ACC_MKNOD, "r": ACC_READ, "w": ACC_WRITE}[c] for c in parts[2])
    return (parts[0], major, minor, access)


def assemble(rules: tuple[str, ...]) -> bytes:
    """The program: load type, access, major, minor; one block per rule that returns 1 (allow)
    when everything matches, else falls through to the next; 0 (deny) at the end."""
    prog = [
        _insn(LDX_W, 2, 1, 0),       # r2 = access_type
        _insn(AND32_K, 2, 0, 0, 0xFFFF),  # r2 = type
        _insn(LDX_W, 3, 1, 0),       # r3 = access_type
        _insn(RSH32_K, 3, 0, 0, 16),  # r3 = access
        _insn(LDX_W, 4, 1, 4),       # r4 = major
        _insn(LDX_W, 5, 1, 8),       # r5 = minor
    ]
    for rule in rules:
        kind, major, minor, access = parse_rule(rule)
        block: list[tuple[int, int, int, int]] = []  # (code, dst, src, imm); jumps to "next"
        if kind != "a":
            block.append((JNE_K, 2, 0, DEV_CHAR if kind == "c" else DEV_BLOCK))
        if access != ACC_MKNOD | ACC_READ | ACC_WRITE:
            # Any requested access bit outside the rule's bits: not this rule.
            block.append((MOV64_X, 1, 3, 0))
            block.append((AND32_K, 1, 0, ~access))
            block.append((JNE_K, 1, 0, 0))
        if major >= 0:
            block.append((JNE_K, 4, 0, major))
        if minor >= 0:
            block.append((JNE_K, 5, 0, minor))
        n = len(block) + 2  # the block plus "r0 = 1; exit"
        for i, (code, dst, src, imm) in enumerate(block):
            off = n - i - 1 if code == JNE_K else 0
            prog.append(_insn(code, dst, src, off, imm))
        prog += [_insn(MOV64_K, 0, 0, 0, 1), _insn(EXIT)]
    prog += [_insn(MOV64_K, 0, 0, 0, 0), _insn(EXIT)]
    return b"".join(prog)


def program_name(rules: tuple[str, ...]) -> str:
    """A name that identifies the rule set (BPF names hold 15 characters)."""
    digest = hashlib.sha256("\n".join(rules).encode()).hexdigest()[:8]
    return f"envdev_{digest}"


# ---------------------------------------------------------------- the syscall


def syscall_number() -> int:
    """bpf(2)'s number for this process; OSError(ENOSYS) naming the architecture where envctl
    does not know it."""
    machine = platform.machine()
    nr, bits = SYS_BPF.get(machine, (None, _WORD_BITS))
    if nr is None or bits != _WORD_BITS:
        arch = machine if nr is None else f"{machine} (a {_WORD_BITS}-bit process)"
        raise OSError(errno.ENOSYS, "cgroup v2 device allow-lists need bpf(2); envctl does not "
                                    f"know its syscall number on {arch}")
    return nr


def _bpf(cmd: int, attr: ctypes.Array) -> int:
    ret = _libc.syscall(syscall_number(), cmd, ctypes.byref(attr), ATTR_SIZE)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def _attr(*fields: tuple[int, str, int]) -> ctypes.Array:
    buf = ctypes.create_string_buffer(ATTR_SIZE)
    for offset, fmt, value in fields:
        struct.pack_into("<" + fmt, buf, offset, value)
    return buf


def load(rules: tuple[str, ...]) -> int:
    """Load the program for `rules`; returns its fd. The verifier's last words are in the
    error.

    Without a log first: a log costs the verifier time, and one that outgrows its buffer fails
    a load that would pass (ENOSPC). Only a refused load is tried again, once, with a log to
    say why; the error keeps the first attempt's errno."""
    syscall_number()  # an unknown architecture fails here, not twice below
    insns = assemble(rules)
    code = ctypes.create_string_buffer(insns, len(insns))
    license_ = ctypes.create_string_buffer(b"GPL")
    name = program_name(rules).encode()

    def attempt(log: ctypes.Array | None) -> int:
        attr = _attr((0, "I", BPF_PROG_TYPE_CGROUP_DEVICE), (4, "I", len(insns) // 8),
                     (8, "Q", ctypes.addressof(code)), (16, "Q", ctypes.addressof(license_)),
                     (68, "I", BPF_CGROUP_DEVICE))
        if log is not None:  # log_level 1, log_size, log_buf
            struct.pack_into("<IIQ", attr, 24, 1, len(log), ctypes.addressof(log))
        attr[48:48 + len(name)] = name
        return _bpf(BPF_PROG_LOAD, attr)

    try:
        return attempt(None)
    except OSError as exc:
        first = exc
    log = ctypes.create_string_buffer(_LOG_SIZE)
    try:
        return attempt(log)
    except OSError:
        pass
    lines = log.value.decode(errors="replace").strip().splitlines()
    text = "; ".join(lines[-_LOG_LINES:])
    raise OSError(first.errno, f"{first.strerror}{': verifier: ' + text if text else ''}") \
        from None


def _open_dir(path: Path, action: str, name: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise HostError(f"{action} cgroup '{name}': open {path}: {exc.strerror}") from exc


# Attach flags (uapi bpf.h). One cgroup's programs all have the same flags; a cgroup whose
# program is attached without ALLOW_MULTI (or OVERRIDE) lets no cgroup below it attach one.
BPF_F_ALLOW_MULTI, BPF_F_REPLACE = 2, 4
PREFIX = "envdev_"  # every program envctl loads (program_name); others' are left alone
THAW_XATTR = "trusted.envctl.thaw"  # on a cgroup envctl froze to swap its program (see below)
FREEZE_TIMEOUT = 10.0


def attach_device_program(cgroup: Path, rules: tuple[str, ...], *, name: str,
                          freeze_timeout: float = FREEZE_TIMEOUT) -> None:
    """Make `rules` the cgroup's envctl device program, attached with BPF_F_ALLOW_MULTI so that
    a cgroup below (a job's, an exec's) can attach its own: the kernel runs every program on
    the path and allows an access only when all do, so a child's list can only narrow.

    - none attached: attach it;
    - envctl's already (multi): replaced in place with BPF_F_REPLACE, never a moment without;
    - one attached without BPF_F_ALLOW_MULTI (an environment an earlier envctl brought up):
      the kernel refuses to mix flags on one cgroup, so there is no atomic swap. The cgroup
      is frozen (no task of it runs, so none opens a device), the old program detached, the
      new one attached, then thawed; a failed attach puts the old one back first. A marker
      xattr on the cgroup says envctl froze it, so a run killed in between is finished by
      the next (`finish_swap`)."""
    cg = _open_dir(cgroup, "set device rules of", name)
    try:
        flags, progs = _query(cg, name)
        want = program_name(rules)
        ours = [(i, n) for i, n in progs if n.startswith(PREFIX)]
        if progs and flags & BPF_F_ALLOW_MULTI and [n for _, n in ours] == [want]:
            _finish_swap(cg, cgroup, name)
            return  # already so
        try:
            prog = load(rules)
        except OSError as exc:
            raise HostError(f"set device rules of cgroup '{name}': load bpf program: "
                            f"{exc.strerror}") from exc
        try:
            if progs and not flags & BPF_F_ALLOW_MULTI:
                if not ours:
                    raise HostError(f"set device rules of cgroup '{name}': a device program "
                                    f"envctl did not attach ({progs[0][1]}) holds it without "
                                    "BPF_F_ALLOW_MULTI; envctl leaves it alone")
                _swap_frozen(cg, cgroup, prog, progs[0][0], name, freeze_timeout)
            elif ours:
                old = _prog_fd(ours[0][0], name)
                try:
                    _attach(cg, prog, BPF_F_ALLOW_MULTI | BPF_F_REPLACE, name, replace=old)
                finally:
                    os.close(old)
                for prog_id, _ in ours[1:]:
                    _detach_id(cg, prog_id, name)
            else:
                _attach(cg, prog, BPF_F_ALLOW_MULTI, name)
        finally:
            os.close(prog)  # the cgroup holds its own reference
        _finish_swap(cg, cgroup, name)
    finally:
        os.close(cg)


def _attach(cg: int, prog: int, flags: int, name: str, *, replace: int = 0) -> None:
    try:
        _bpf(BPF_PROG_ATTACH, _attr((0, "I", cg), (4, "I", prog), (8, "I", BPF_CGROUP_DEVICE),
                                    (12, "I", flags), (16, "I", replace)))
    except OSError as exc:
        raise HostError(f"set device rules of cgroup '{name}': attach bpf program: "
                        f"{exc.strerror}") from exc


def _detach_fd(cg: int, prog: int) -> None:
    _bpf(BPF_PROG_DETACH, _attr((0, "I", cg), (4, "I", prog), (8, "I", BPF_CGROUP_DEVICE)))


def _detach_id(cg: int, prog_id: int, name: str) -> None:
    """Detach program `prog_id` (a multi cgroup's detach names the program by descriptor); one
    detached meanwhile is success (ENOENT)."""
    try:
        fd = _bpf(BPF_PROG_GET_FD_BY_ID, _attr((0, "I", prog_id)))
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return
        raise HostError(f"remove device rules of cgroup '{name}': program {prog_id}: "
                        f"{exc.strerror}") from exc
    try:
        _detach_fd(cg, fd)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise HostError(f"remove device rules of cgroup '{name}': detach: "
                            f"{exc.strerror}") from exc
    finally:
        os.close(fd)


def _prog_fd(prog_id: int, name: str) -> int:
    try:
        return _bpf(BPF_PROG_GET_FD_BY_ID, _attr((0, "I", prog_id)))
    except OSError as exc:
        raise HostError(f"set device rules of cgroup '{name}': program {prog_id}: "
                        f"{exc.strerror}") from exc


def _swap_frozen(cg: int, path: Path, prog: int, old_id: int, name: str,
                 timeout: float) -> None:
    """Replace the cgroup's one non-multi program `old_id` by `prog` (multi) while no task of
    the cgroup runs: frozen, swapped, thawed."""
    old = _prog_fd(old_id, name)
    try:
        _freeze(cg, path, name, timeout)
        try:
            _detach_fd(cg, old)
        except OSError as exc:
            _thaw(cg, path, name)
            raise HostError(f"set device rules of cgroup '{name}': detach the program attached "
                            f"without BPF_F_ALLOW_MULTI: {exc.strerror}") from exc
        try:
            _attach(cg, prog, BPF_F_ALLOW_MULTI, name)
        except HostError:
            try:
                _bpf(BPF_PROG_ATTACH, _attr((0, "I", cg), (4, "I", old),
                                            (8, "I", BPF_CGROUP_DEVICE), (12, "I", 0)))
            except OSError as exc:
                # Thawed now, its tasks would open any device: it stays frozen.
                raise HostError(f"set device rules of cgroup '{name}': attach failed and the "
                                f"old program could not be put back ({exc.strerror}): the "
                                f"cgroup stays frozen; `envctl up` tries again") from exc
            _thaw(cg, path, name)
            raise
    finally:
        os.close(old)


def _freeze(cg: int, path: Path, name: str, timeout: float) -> None:
    """Freeze the cgroup (marking it as envctl's to thaw) and wait until every task is frozen.
    A cgroup frozen already (by its operator) is left frozen afterwards: no marker."""
    if _read_at(cg, "cgroup.freeze").strip() != "1":
        os.setxattr(path, THAW_XATTR, b"1")
        _write_at(cg, "cgroup.freeze", "1")
    deadline = time.monotonic() + timeout
    pause = 0.001
    while "frozen 1" not in _read_at(cg, "cgroup.events").splitlines():
        if time.monotonic() > deadline:
            _thaw(cg, path, name)
            raise HostError(f"set device rules of cgroup '{name}': its tasks were not all "
                            f"frozen after {timeout:g} s; the device program is unchanged")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _thaw(cg: int, path: Path, name: str) -> None:
    """Thaw the cgroup if envctl froze it (the marker), then drop the marker."""
    try:
        os.getxattr(path, THAW_XATTR)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOENT):
            return  # not frozen by envctl (or the cgroup is gone)
        raise HostError(f"set device rules of cgroup '{name}': read {THAW_XATTR}: "
                        f"{exc.strerror}") from exc
    _write_at(cg, "cgroup.freeze", "0")
    os.removexattr(path, THAW_XATTR)


def _finish_swap(cg: int, path: Path, name: str) -> None:
    # A run killed while the cgroup was frozen: its new program is there (checked by the
    # caller), so it is safe to thaw.
    _thaw(cg, path, name)


def left_frozen(cgroup: Path) -> bool:
    """Whether an interrupted swap left the cgroup frozen by envctl (the marker is there)."""
    try:
        os.getxattr(cgroup, THAW_XATTR)
    except OSError:
        return False
    return True


def _read_at(dir_fd: int, file: str) -> str:
    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        return os.read(fd, 4096).decode()
    finally:
        os.close(fd)


def _write_at(dir_fd: int, file: str, value: str) -> None:
    fd = os.open(file, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def detach_device_programs(cgroup: Path, *, name: str) -> None:
    """Detach envctl's device programs from the cgroup (others' are left); a cgroup or program
    already gone is success."""
    try:
        cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return  # the cgroup is gone, and its program with it
    except OSError as exc:
        raise HostError(f"remove device rules of cgroup '{name}': open {cgroup}: "
                        f"{exc.strerror}") from exc
    try:
        _, progs = _query(cg, name, action="remove")
        for prog_id, prog_name in progs:
            if prog_name.startswith(PREFIX):
                _detach_id(cg, prog_id, name)
    finally:
        os.close(cg)


def _query(cg: int, name: str, *, action: str = "set") -> tuple[int, list[tuple[int, str]]]:
    """The cgroup's attach flags and its (id, name) device programs, attached directly."""
    ids = (ctypes.c_uint32 * 16)()
    attr = _attr((0, "I", cg), (4, "I", BPF_CGROUP_DEVICE), (16, "Q", ctypes.addressof(ids)),
                 (24, "I", 16))
    try:
        _bpf(BPF_PROG_QUERY, attr)
    except OSError as exc:
        raise HostError(f"{action} device rules of cgroup '{name}': query: "
                        f"{exc.strerror}") from exc
    flags, = struct.unpack_from("<I", attr, 12)
    count = struct.unpack_from("<I", attr, 24)[0]
    return flags, [(ids[i], _prog_name(ids[i])) for i in range(min(count, 16))]


def device_programs(cgroup: Path) -> tuple[int, list[str]] | None:
    """(attach flags, names) of the device programs attached directly to `cgroup`; None when
    the cgroup is gone."""
    try:
        cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    try:
        flags, progs = _query(cg, cgroup.name, action="check")
        return flags, [n for _, n in progs]
    finally:
        os.close(cg)


def attached_device_programs(cgroup: Path) -> list[str]:
    """Names of the device programs attached directly to `cgroup` (empty when none)."""
    found = device_programs(cgroup)
    return [] if found is None else found[1]


def allows_children(cgroup: Path) -> bool:
    """Whether a cgroup below `cgroup` may attach a device program of its own: no program on
    `cgroup`, or its programs were attached with BPF_F_ALLOW_MULTI. (Only `cgroup` itself is
    asked: envctl's parents carry no program.)"""
    found = device_programs(cgroup)
    return found is None or not found[1] or bool(found[0] & BPF_F_ALLOW_MULTI)


def _prog_name(prog_id: int) -> str:
    try:
        fd = _bpf(BPF_PROG_GET_FD_BY_ID, _attr((0, "I", prog_id)))
    except OSError:
        return f"id{prog_id}"  # detached meanwhile
    try:
        info = ctypes.create_string_buffer(256)
        _bpf(BPF_OBJ_GET_INFO_BY_FD, _attr((0, "I", fd), (4, "I", len(info)),
                                           (8, "Q", ctypes.addressof(info))))
        return info.raw[64:80].split(b"\0")[0].decode(errors="replace")
    finally:
        os.close(fd)
