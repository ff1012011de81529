"""The cgroup v2 device program's bpf(2) calls: the verifier log only when a load fails, and the
syscall number only on architectures envctl knows (a wrong number is another syscall)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import struct
from pathlib import Path

import pytest

from envctl.errors import HostError
from envctl.host import bpf

RULES = ("c 1:3 rwm", "c 136:* rw")
VERIFIER = b"0: (95) exit\nR0 !read_ok\nprocessed 1 insns\n"


def _log_fields(attr: bytes) -> tuple[int, int, int]:
    """log_level, log_size, log_buf of a BPF_PROG_LOAD attr."""
    return struct.unpack_from("<IIQ", attr, 24)


class FakeLibc:
    """syscall(2) for bpf.py: records (number, command, attr bytes) and lets `answer(cmd, attr)`
    reply: a result, or -1 after ctypes.set_errno."""

    def __init__(self, answer):
        self.answer = answer
        self.calls: list[tuple[int, int, bytes]] = []

    def syscall(self, nr, cmd, ref, size):
        attr = ref._obj  # the buffer behind ctypes.byref
        self.calls.append((nr, cmd, bytes(attr.raw)))
        return self.answer(cmd, attr)


def _none_attached(attr) -> int:
    struct.pack_into("<I", attr, 12, 0)  # attach_flags
    struct.pack_into("<I", attr, 24, 0)  # prog_cnt
    return 0


def _fail(code: int) -> int:
    ctypes.set_errno(code)
    return -1


def _write_log(attr, text: bytes) -> None:
    _, size, buf = _log_fields(attr.raw)
    ctypes.memmove(buf, text, min(len(text), size - 1))


@pytest.fixture
def x86_64(monkeypatch):
    monkeypatch.setattr(bpf.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(bpf, "_WORD_BITS", 64)


def test_load_asks_for_no_verifier_log(monkeypatch, x86_64):
    fake = FakeLibc(lambda cmd, attr: 42)
    monkeypatch.setattr(bpf, "_libc", fake)
    assert bpf.load(RULES) == 42
    ((nr, cmd, attr),) = fake.calls
    assert (nr, cmd) == (321, bpf.BPF_PROG_LOAD)
    assert _log_fields(attr) == (0, 0, 0)


def test_failed_load_is_retried_once_with_the_log(monkeypatch, x86_64):
    def answer(cmd, attr):
        if _log_fields(attr.raw)[0]:
            _write_log(attr, VERIFIER)
        return _fail(errno.EACCES)

    fake = FakeLibc(answer)
    monkeypatch.setattr(bpf, "_libc", fake)
    with pytest.raises(OSError) as excinfo:
        bpf.load(RULES)
    assert excinfo.value.errno == errno.EACCES
    assert "R0 !read_ok" in str(excinfo.value)
    first, second = (_log_fields(attr) for _, _, attr in fake.calls)
    assert first == (0, 0, 0)
    assert second[0] == 1 and second[1] >= 4096 and second[2] != 0


def test_retry_keeps_the_first_errno(monkeypatch, x86_64):
    # A log buffer too small for the verifier's output fails the load with ENOSPC: the cause
    # is still the first attempt's, the log is what fitted.
    def answer(cmd, attr):
        if _log_fields(attr.raw)[0]:
            _write_log(attr, VERIFIER)
            return _fail(errno.ENOSPC)
        return _fail(errno.EINVAL)

    monkeypatch.setattr(bpf, "_libc", FakeLibc(answer))
    with pytest.raises(OSError) as excinfo:
        bpf.load(RULES)
    assert excinfo.value.errno == errno.EINVAL and "R0 !read_ok" in str(excinfo.value)


def test_attach_failure_names_the_cgroup_and_carries_the_log(tmp_path, monkeypatch, x86_64):
    def answer(cmd, attr):
        if cmd == bpf.BPF_PROG_QUERY:
            return _none_attached(attr)
        if _log_fields(attr.raw)[0]:
            _write_log(attr, VERIFIER)
        return _fail(errno.EACCES)

    monkeypatch.setattr(bpf, "_libc", FakeLibc(answer))
    with pytest.raises(HostError, match=r"^set device rules of cgroup 'gpu': load bpf program: "
                                        r".*R0 !read_ok"):
        bpf.attach_device_program(tmp_path, RULES, name="gpu")


@pytest.mark.parametrize(("machine", "bits", "nr"), [
    ("x86_64", 64, 321), ("aarch64", 64, 280), ("ppc64le", 64, 361), ("s390x", 64, 351),
    ("riscv64", 64, 280), ("armv7l", 32, 386)])
def test_syscall_number_per_architecture(monkeypatch, machine, bits, nr):
    monkeypatch.setattr(bpf.platform, "machine", lambda: machine)
    monkeypatch.setattr(bpf, "_WORD_BITS", bits)
    fake = FakeLibc(lambda cmd, attr: 7)
    monkeypatch.setattr(bpf, "_libc", fake)
    assert bpf.load(RULES) == 7
    assert fake.calls[0][0] == nr


def _no_syscall(cmd, attr):
    raise AssertionError("bpf(2) called with a guessed syscall number")


@pytest.mark.parametrize(("machine", "bits", "shown"), [
    ("sparc64", 64, "sparc64"), ("mips64", 64, "mips64"),
    ("x86_64", 32, "x86_64 (a 32-bit process)"), ("armv7l", 64, "armv7l (a 64-bit process)")])
def test_unknown_architecture_is_refused_by_name(tmp_path, monkeypatch, machine, bits, shown):
    monkeypatch.setattr(bpf.platform, "machine", lambda: machine)
    monkeypatch.setattr(bpf, "_WORD_BITS", bits)
    monkeypatch.setattr(bpf, "_libc", FakeLibc(_no_syscall))
    why = (r"cgroup v2 device allow-lists need bpf\(2\); envctl does not know its syscall "
           rf"number on {shown.replace('(', '[(]').replace(')', '[)]')}$")
    with pytest.raises(HostError, match=rf"^set device rules of cgroup 'gpu': .*{why}"):
        bpf.attach_device_program(tmp_path, RULES, name="gpu")
    with pytest.raises(HostError, match=rf"^remove device rules of cgroup 'gpu': .*{why}"):
        bpf.detach_device_programs(tmp_path, name="gpu")
    with pytest.raises(HostError, match=rf"^check device rules of cgroup '{tmp_path.name}': "
                                        rf".*{why}"):
        bpf.attached_device_programs(tmp_path)
    with pytest.raises(OSError) as excinfo:
        bpf.load(RULES)
    assert excinfo.value.errno == errno.ENOSYS


def test_a_cgroup_already_gone_needs_no_syscall(tmp_path, monkeypatch):
    monkeypatch.setattr(bpf.platform, "machine", lambda: "sparc64")
    monkeypatch.setattr(bpf, "_libc", FakeLibc(_no_syscall))
    bpf.detach_device_programs(tmp_path / "gone", name="gpu")
    assert bpf.attached_device_programs(tmp_path / "gone") == []


# ---------------------------------------------------------------- the real kernel


class Recording:
    """The real libc's syscall(2), recording each bpf(2) load's log fields."""

    def __init__(self, real):
        self.real = real
        self.loads: list[tuple[int, int, int]] = []

    def syscall(self, nr, cmd, ref, size):
        if cmd == bpf.BPF_PROG_LOAD:
            self.loads.append(_log_fields(ref._obj.raw))
        return self.real.syscall(nr, cmd, ref, size)


@pytest.mark.root
def test_the_kernel_loads_without_a_log_and_explains_a_refusal(monkeypatch):
    rec = Recording(bpf._libc)
    monkeypatch.setattr(bpf, "_libc", rec)
    try:
        fd = bpf.load(RULES)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.ENOSYS):
            pytest.skip(f"bpf(2) not allowed here: {exc}")
        raise
    os.close(fd)  # loaded, never attached: gone with its last fd
    assert rec.loads == [(0, 0, 0)]
    # A program the verifier refuses: "r0 = 0" missing before exit.
    monkeypatch.setattr(bpf, "assemble", lambda rules: bpf._insn(bpf.EXIT))
    rec.loads.clear()
    with pytest.raises(OSError) as excinfo:
        bpf.load(RULES)
    assert excinfo.value.errno == errno.EACCES and "R0 !read_ok" in str(excinfo.value)
    assert [level for level, _, _ in rec.loads] == [0, 1]


# ---------------------------------------------------------------- attach flags, against a model
# of the kernel's cgroup-bpf rules (kernel/bpf/cgroup.c): one cgroup's programs share their
# flags; without BPF_F_ALLOW_MULTI a cgroup holds one program, which a new attach replaces;
# BPF_F_REPLACE needs BPF_F_ALLOW_MULTI; a multi detach names the program by descriptor.


class FakeKernel:
    def __init__(self, cgroup: Path):
        self.cgroup = cgroup
        self.flags = 0
        self.attached: list[int] = []  # program ids, in order
        self.fds: dict[int, int] = {}  # our descriptor -> program id
        self.names: dict[int, str] = {}
        self.log: list[tuple[str, int, str]] = []  # (op, flags or id, cgroup.freeze then)
        self.next_id = 100

    def _fd_for(self, prog_id: int) -> int:
        fd = os.open("/dev/null", os.O_RDONLY)
        self.fds[fd] = prog_id
        return fd

    def program(self, name: str) -> int:
        self.next_id += 1
        self.names[self.next_id] = name
        return self.next_id

    def syscall(self, nr, cmd, ref, size):
        attr = ref._obj
        u32 = lambda off: struct.unpack_from("<I", attr, off)[0]  # noqa: E731
        freeze = (self.cgroup / "cgroup.freeze").read_text().strip()
        if cmd == bpf.BPF_PROG_LOAD:
            name = attr.raw[48:64].split(b"\0")[0].decode()
            return self._fd_for(self.program(name))
        if cmd == bpf.BPF_PROG_QUERY:
            struct.pack_into("<I", attr, 12, self.flags if self.attached else 0)
            buf = struct.unpack_from("<Q", attr, 16)[0]
            ids = struct.pack(f"<{len(self.attached)}I", *self.attached)
            ctypes.memmove(buf, ids, len(ids))
            struct.pack_into("<I", attr, 24, len(self.attached))
            return 0
        if cmd == bpf.BPF_PROG_GET_FD_BY_ID:
            prog_id = u32(0)
            return self._fd_for(prog_id) if prog_id in self.names else _fail(errno.ENOENT)
        if cmd == bpf.BPF_OBJ_GET_INFO_BY_FD:
            buf = struct.unpack_from("<Q", attr, 8)[0]
            name = self.names[self.fds[u32(0)]].encode()
            ctypes.memmove(buf + 64, name + b"\0", len(name) + 1)
            return 0
        if cmd == bpf.BPF_PROG_ATTACH:
            prog, flags, replace = self.fds[u32(4)], u32(12), u32(16)
            multi = flags & bpf.BPF_F_ALLOW_MULTI
            if flags & bpf.BPF_F_REPLACE and not multi:
                return _fail(errno.EINVAL)
            if self.attached and flags & ~bpf.BPF_F_REPLACE != self.flags:
                return _fail(errno.EPERM)  # "attach flags has to match"
            self.log.append(("attach", flags, freeze))
            self.flags = flags & ~bpf.BPF_F_REPLACE
            if not multi:
                self.attached = [prog]
            elif flags & bpf.BPF_F_REPLACE:
                self.attached[self.attached.index(self.fds[replace])] = prog
            else:
                self.attached.append(prog)
            return 0
        if cmd == bpf.BPF_PROG_DETACH:
            prog = self.fds.get(u32(4))
            if not self.attached:
                return _fail(errno.ENOENT)
            if self.flags & bpf.BPF_F_ALLOW_MULTI and prog is None:
                return _fail(errno.EINVAL)
            self.log.append(("detach", prog or 0, freeze))
            self.attached.remove(prog if prog in self.attached else self.attached[0])
            return 0
        raise AssertionError(f"bpf command {cmd}")

    def close_all(self):
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


@pytest.fixture
def kernel(tmp_path, monkeypatch, x86_64):
    (tmp_path / "cgroup.freeze").write_text("0\n")
    (tmp_path / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    fake = FakeKernel(tmp_path)
    monkeypatch.setattr(bpf, "_libc", fake)
    xattrs: dict[str, bytes] = {}

    def getxattr(path, key):
        if key not in xattrs:
            raise OSError(errno.ENODATA, "No data available")
        return xattrs[key]

    # The frozen state follows cgroup.freeze at once, as for a cgroup of idle tasks.
    real_write = bpf._write_at

    def write_at(dir_fd, file, value):
        real_write(dir_fd, file, value)
        if file == "cgroup.freeze":
            (tmp_path / "cgroup.events").write_text(f"populated 1\nfrozen {value}\n")

    monkeypatch.setattr(bpf, "_write_at", write_at)
    monkeypatch.setattr(os, "setxattr", lambda path, key, value: xattrs.__setitem__(key, value))
    monkeypatch.setattr(os, "getxattr", getxattr)
    monkeypatch.setattr(os, "removexattr", lambda path, key: xattrs.pop(key))
    fake.xattrs = xattrs
    yield fake
    fake.close_all()


OTHER = ("c 1:3 rwm",)


def test_a_first_attach_allows_programs_below(kernel, tmp_path):
    bpf.attach_device_program(tmp_path, RULES, name="gpu")
    assert kernel.flags == bpf.BPF_F_ALLOW_MULTI
    assert bpf.device_programs(tmp_path) == (bpf.BPF_F_ALLOW_MULTI, [bpf.program_name(RULES)])
    assert bpf.allows_children(tmp_path)


def test_the_same_rules_again_change_nothing(kernel, tmp_path):
    bpf.attach_device_program(tmp_path, RULES, name="gpu")
    before = list(kernel.attached)
    bpf.attach_device_program(tmp_path, RULES, name="gpu")
    assert kernel.attached == before and len(kernel.log) == 1


def test_new_rules_replace_the_program_in_place(kernel, tmp_path):
    bpf.attach_device_program(tmp_path, RULES, name="gpu")
    bpf.attach_device_program(tmp_path, OTHER, name="gpu")
    # One attach with BPF_F_REPLACE: never a moment with both programs, nor with none.
    assert kernel.log[1] == ("attach", bpf.BPF_F_ALLOW_MULTI | bpf.BPF_F_REPLACE, "0")
    assert bpf.attached_device_programs(tmp_path) == [bpf.program_name(OTHER)]


def test_a_program_of_someone_else_is_kept(kernel, tmp_path):
    kernel.flags = bpf.BPF_F_ALLOW_MULTI
    kernel.attached = [kernel.program("theirs")]
    bpf.attach_device_program(tmp_path, RULES, name="gpu")
    assert bpf.attached_device_programs(tmp_path) == ["theirs", bpf.program_name(RULES)]
    bpf.detach_device_programs(tmp_path, name="gpu")
    assert bpf.attached_device_programs(tmp_path) == ["theirs"]


def test_a_legacy_program_is_swapped_while_the_cgroup_is_frozen(kernel, tmp_path):
    old = kernel.program(bpf.program_name(RULES))
    kernel.attached = [old]  # flags 0: an older envctl's
    assert not bpf.allows_children(tmp_path)
    bpf.attach_device_program(tmp_path, RULES, name="gpu")
    assert kernel.log == [("detach", old, "1"), ("attach", bpf.BPF_F_ALLOW_MULTI, "1")]
    assert kernel.flags == bpf.BPF_F_ALLOW_MULTI and bpf.allows_children(tmp_path)
    assert (tmp_path / "cgroup.freeze").read_text().strip() == "0"
    assert kernel.xattrs == {} and not bpf.left_frozen(tmp_path)


def test_a_failed_swap_puts_the_old_program_back_before_thawing(kernel, tmp_path, monkeypatch):
    old = kernel.program(bpf.program_name(RULES))
    kernel.attached = [old]
    real = kernel.syscall

    def refuse_multi(nr, cmd, ref, size):
        if cmd == bpf.BPF_PROG_ATTACH and struct.unpack_from("<I", ref._obj, 12)[0]:
            return _fail(errno.ENOMEM)
        return real(nr, cmd, ref, size)

    monkeypatch.setattr(kernel, "syscall", refuse_multi)
    with pytest.raises(HostError, match=r"^set device rules of cgroup 'gpu': attach bpf program"):
        bpf.attach_device_program(tmp_path, OTHER, name="gpu")
    assert kernel.attached == [old] and kernel.flags == 0
    assert kernel.log[-1] == ("attach", 0, "1")  # put back while still frozen
    assert (tmp_path / "cgroup.freeze").read_text().strip() == "0" and kernel.xattrs == {}


def test_a_cgroup_frozen_by_its_operator_stays_frozen(kernel, tmp_path):
    (tmp_path / "cgroup.freeze").write_text("1\n")
    (tmp_path / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    kernel.attached = [kernel.program(bpf.program_name(RULES))]
    bpf.attach_device_program(tmp_path, OTHER, name="gpu")
    assert kernel.flags == bpf.BPF_F_ALLOW_MULTI
    assert (tmp_path / "cgroup.freeze").read_text().strip() == "1"


def test_a_swap_cut_short_is_thawed_by_the_next_attach(kernel, tmp_path):
    bpf.attach_device_program(tmp_path, RULES, name="gpu")
    kernel.xattrs[bpf.THAW_XATTR] = b"1"  # a run killed between its attach and its thaw
    (tmp_path / "cgroup.freeze").write_text("1\n")
    assert bpf.left_frozen(tmp_path)
    bpf.attach_device_program(tmp_path, RULES, name="gpu")
    assert (tmp_path / "cgroup.freeze").read_text().strip() == "0" and kernel.xattrs == {}


def test_a_legacy_program_envctl_did_not_attach_is_left(kernel, tmp_path):
    kernel.attached = [kernel.program("theirs")]
    with pytest.raises(HostError, match="a device program envctl did not attach .theirs."):
        bpf.attach_device_program(tmp_path, RULES, name="gpu")
    assert kernel.log == []


def test_a_cgroup_that_will_not_freeze_keeps_its_program(kernel, tmp_path, monkeypatch):
    kernel.attached = [kernel.program(bpf.program_name(RULES))]
    monkeypatch.setattr(bpf, "_write_at", lambda fd, file, value: None)  # never frozen
    with pytest.raises(HostError, match=r"not all frozen after 0.05 s; the device program is "
                                        "unchanged"):
        bpf.attach_device_program(tmp_path, OTHER, name="gpu", freeze_timeout=0.05)
    assert kernel.log == [] and kernel.xattrs == {}
