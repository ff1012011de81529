"""The cgroup v2 device program's bpf(2) calls: the verifier log only when a load fails, and the
syscall number only on architectures envctl knows (a wrong number is another syscall)."""

from __future__ import annotations

import ctypes
import errno
import os
import struct

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
