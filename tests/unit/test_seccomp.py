"""envctl.runtime.seccomp: Docker's default profile compiled by libseccomp and installed in a
forked child, which probes syscalls and reports over a pipe; profile errors with file:line."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import textwrap
import threading

import pytest

from envctl.caps import DEFAULT, NUMBERS
from envctl.errors import InputError, SpecError
from envctl.runtime import seccomp
from envctl.spec.loader import parse_spec

CAPS = sum(1 << NUMBERS[c] for c in DEFAULT)
SYS_ADMIN = 1 << NUMBERS["SYS_ADMIN"]
CLONE_NEWUSER, CLONE_NEWUTS, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x04000000, 0x40000000, 17
PR_SET_NO_NEW_PRIVS = 38

# (label, syscall, args): every argument invalid or harmless, so that a call the filter lets
# through fails (or succeeds) in the kernel with something other than EPERM.
PROBES = [
    ("getpid", "getpid", ()),
    ("getcwd", "getcwd", (0, 0)),  # ERANGE
    ("keyctl", "keyctl", (0x7FFFFFFF,)),
    ("add_key", "add_key", (0, 0, 0, 0, 0)),
    ("io_uring_setup", "io_uring_setup", (0, 0)),
    ("perf_event_open", "perf_event_open", (0, 0, -1, -1, 0)),
    ("userfaultfd", "userfaultfd", (0xFFFFFFFF,)),
    ("fsopen", "fsopen", (0, 0)),
    ("bpf", "bpf", (9999, 0, 0)),
    ("ptrace", "ptrace", (-1, 0)),  # ESRCH: nobody traces us
    ("mount", "mount", (0, 0, 0, 0, 0)),
    ("chroot", "chroot", (0,)),
    ("clone3", "clone3", (0, 0)),
    ("unshare_uts", "unshare", (CLONE_NEWUTS,)),
    ("unshare_net", "unshare", (CLONE_NEWNET,)),
    ("unshare_uts_net", "unshare", (CLONE_NEWUTS | CLONE_NEWNET,)),
    ("clone_userns", "clone", (CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)),
    ("unshare_userns", "unshare", (CLONE_NEWUSER,)),  # last: it changes what we may do
]


def _nr(name: str) -> int:
    nr = seccomp._lib().seccomp_syscall_resolve_name(name.encode())
    assert nr >= 0, name
    return nr


def probe(prog: bytes | None) -> dict[str, object]:
    """Fork; in the child set no_new_privs, install `prog` (if any), run PROBES plus a fork, a
    thread, read and write; return {label: 0 / errno / True} from the child."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    calls = [(label, _nr(name), args) for label, name, args in PROBES]
    install = seccomp.prepare(prog) if prog is not None else None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        code = 1
        try:
            os.close(r)
            out: dict[str, object] = {}
            assert libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            if install is not None:
                install()
            with open("/proc/self/status") as f:  # read
                out["seccomp_mode"] = next(ln.split()[1] for ln in f if ln.startswith("Seccomp:"))
            child = os.fork()  # clone
            if child == 0:
                os._exit(7)
            out["fork"] = os.waitpid(child, 0)[1] >> 8 == 7
            ran: list[bool] = []
            t = threading.Thread(target=ran.append, args=(True,))  # clone3, else clone
            t.start()
            t.join()
            out["thread"] = ran == [True]
            for label, nr, args in calls:
                ctypes.set_errno(0)
                ret = libc.syscall(nr, *(ctypes.c_long(a) for a in args))
                if ret == 0 and label == "clone_userns":
                    os._exit(0)  # the clone's child
                if ret > 0 and label == "clone_userns":
                    os.waitpid(ret, 0)
                out[label] = 0 if ret >= 0 else ctypes.get_errno()
            os.write(w, json.dumps(out).encode())  # write
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    assert os.waitpid(pid, 0)[1] == 0, "the probing child failed"
    return json.loads(data)


@pytest.fixture(scope="module")
def unfiltered() -> dict[str, object]:
    got = probe(None)
    # The baseline: without a filter no probe gets EPERM (we are root), so each EPERM below
    # is the filter's.
    assert got["seccomp_mode"] == "0"
    assert [k for k, v in got.items() if v is not True and v == errno.EPERM] == [], got
    return got


def userns_allowed() -> bool:
    with open("/proc/sys/user/max_user_namespaces") as f:
        return int(f.read()) > 0


REFUSED = ["keyctl", "add_key", "io_uring_setup", "perf_event_open", "userfaultfd", "fsopen",
           "bpf", "mount", "unshare_uts", "unshare_net", "clone_userns", "unshare_userns"]


def test_default_profile_with_docker_caps(unfiltered: dict[str, object]) -> None:
    got = probe(seccomp.compile("default", CAPS))
    assert got["seccomp_mode"] == "2"
    assert {k: got[k] for k in REFUSED} == dict.fromkeys(REFUSED, errno.EPERM)
    assert got["clone3"] == errno.ENOSYS  # the profile's: glibc falls back to clone
    assert got["fork"] is True and got["thread"] is True
    assert got["getpid"] == 0 and got["getcwd"] == unfiltered["getcwd"] == errno.ERANGE
    # Allowed as Docker allows them: ptrace (kernel >= 4.8), chroot (SYS_CHROOT is kept).
    assert got["ptrace"] == unfiltered["ptrace"] == errno.ESRCH
    assert got["chroot"] == unfiltered["chroot"] != errno.EPERM


def test_default_profile_without_caps_drops_the_cap_groups() -> None:
    with_caps = probe(seccomp.compile("default", CAPS))
    without = probe(seccomp.compile("default", 0))
    assert with_caps["chroot"] != errno.EPERM and without["chroot"] == errno.EPERM
    assert without["getpid"] == 0 and without["fork"] is True


@pytest.mark.skipif(not userns_allowed(), reason="the kernel allows no user namespaces")
def test_sys_admin_still_refuses_user_namespaces_unless_nested() -> None:
    guarded = probe(seccomp.compile("default", CAPS | SYS_ADMIN))
    # SYS_ADMIN's group allows unshare, clone, mount, fsopen, …: only the user namespace and
    # the network namespace (nf_tables, in a launch's user namespace) are not.
    assert guarded["unshare_userns"] == errno.EPERM and guarded["clone_userns"] == errno.EPERM
    assert guarded["unshare_net"] == errno.EPERM == guarded["unshare_uts_net"]
    assert guarded["unshare_uts"] == 0 and guarded["mount"] != errno.EPERM
    assert guarded["clone3"] == errno.ENOSYS and guarded["thread"] is True
    nested = probe(seccomp.compile("default", CAPS | SYS_ADMIN, nested_userns=True))
    assert nested["unshare_userns"] == 0 and nested["clone_userns"] == 0
    assert nested["unshare_net"] == 0 == nested["unshare_uts_net"]
    assert nested["clone3"] != errno.ENOSYS  # SYS_ADMIN's group allows clone3 as is
    # nested_userns needs no SYS_ADMIN: any user may make a user namespace (and namespaces
    # in it), which Docker's profile refuses without SYS_ADMIN; mount keeps its rule.
    for caps in (CAPS, 0):
        nested = probe(seccomp.compile("default", caps, nested_userns=True))
        assert nested["unshare_userns"] == 0 and nested["clone_userns"] == 0, caps
        assert nested["mount"] == errno.EPERM


def test_unconfined_is_no_filter() -> None:
    assert seccomp.compile("unconfined", CAPS) is None
    assert seccomp.load_profile("unconfined") is None
    assert seccomp.load_profile("default")["defaultAction"] == "SCMP_ACT_ERRNO"


def test_custom_profile_refuses_only_what_it_names(tmp_path, unfiltered) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [
        {"names": ["getcwd"], "action": "SCMP_ACT_ERRNO"}]}))
    got = probe(seccomp.compile(str(path), 0, nested_userns=True))
    assert got["getcwd"] == errno.EPERM and unfiltered["getcwd"] != errno.EPERM
    assert [k for k, v in got.items() if v is not True and v == errno.EPERM] == ["getcwd"]
    # Without nested_userns the guard applies to an allow-all profile too.
    guarded = probe(seccomp.compile(str(path), 0))
    assert guarded["unshare_userns"] == errno.EPERM and guarded["unshare_uts"] == 0
    assert guarded["clone3"] == errno.ENOSYS and guarded["thread"] is True


def test_cache_hit_returns_the_same_program_without_compiling(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    first = seccomp.compile("default", CAPS, cache_dir=cache)
    files = list(cache.iterdir())
    # The file holds the whole key (format, caps, nested_userns, machine, kernel, profile),
    # then the program.
    assert len(files) == 1 and files[0].read_bytes().endswith(first)
    key = files[0].read_bytes()[:-len(first)]
    assert key.startswith(b"envctl-seccomp-") and key.endswith(seccomp.DEFAULT_PROFILE.read_bytes())
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600

    def no_build(*args: object, **kw: object) -> bytes:
        raise AssertionError("libseccomp was asked to compile")

    monkeypatch.setattr(seccomp, "_build", no_build)
    monkeypatch.setattr(seccomp, "_lib", no_build)  # a hit does not even load libseccomp
    assert seccomp.compile("default", CAPS, cache_dir=cache) == first
    # A file of the same name holding another key (a CRC collision) is a miss, not a hit.
    files[0].write_bytes(key.replace(b"envctl-seccomp-", b"envctl-seccomq-", 1) + first)
    with pytest.raises(AssertionError):
        seccomp.compile("default", CAPS, cache_dir=cache)
    files[0].write_bytes(key + first)
    # Other inputs miss: the key holds the caps and nested_userns.
    with pytest.raises(AssertionError):
        seccomp.compile("default", CAPS | SYS_ADMIN, cache_dir=cache)
    with pytest.raises(AssertionError):
        seccomp.compile("default", CAPS, nested_userns=True, cache_dir=cache)
    # A cached program others could have written is not trusted.
    files[0].chmod(0o620)
    with pytest.raises(AssertionError):
        seccomp.compile("default", CAPS, cache_dir=cache)


# ---------------------------------------------------------------- choosing rules (pure)


def _names(rules: list[seccomp.Rule]) -> set[str]:
    return {r.name for r in rules}


def test_groups_follow_caps_arches_and_min_kernel() -> None:
    profile = seccomp.load_profile("default")
    base = seccomp.select_rules(profile, CAPS, arch="amd64", kernel=(6, 18))
    assert "chroot" in _names(base) and "reboot" not in _names(base)
    assert "ptrace" in _names(base) and "arch_prctl" in _names(base)
    old = seccomp.select_rules(profile, CAPS, arch="amd64", kernel=(4, 7))
    assert "ptrace" not in _names(old)
    arm = seccomp.select_rules(profile, CAPS, arch="arm64", kernel=(6, 18))
    assert "arch_prctl" not in _names(arm) and "set_tls" in _names(arm)
    # excludes.caps: without SYS_ADMIN clone is allowed only without namespace flags and
    # clone3 is ENOSYS; with it, both unconditionally.
    clone = [r for r in base if r.name in ("clone", "clone3")]
    assert clone == [seccomp.Rule("clone", 0x7FFF0000, ((0, 7, 0x7E020000, 0),)),
                     seccomp.Rule("clone3", 0x50000 | errno.ENOSYS)]
    admin = seccomp.select_rules(profile, CAPS | SYS_ADMIN, arch="amd64", kernel=(6, 18))
    assert [r for r in admin if r.name in ("clone", "clone3")] == [
        seccomp.Rule("clone", 0x7FFF0000), seccomp.Rule("clone3", 0x7FFF0000)]


def test_guard_narrows_allows_and_never_overlaps() -> None:
    allow, eperm = 0x7FFF0000, 0x50000 | errno.EPERM
    rules = [seccomp.Rule("unshare", allow), seccomp.Rule("clone", allow, ((0, 7, 0x7E020000, 0),)),
             seccomp.Rule("clone3", allow)]
    guarded = CLONE_NEWUSER | CLONE_NEWNET
    assert seccomp.guard_userns(rules, eperm) == [
        seccomp.Rule("unshare", allow, ((0, 7, guarded, 0),)),
        seccomp.Rule("clone", allow, ((0, 7, 0x7E020000 | guarded, 0),)),
        seccomp.Rule("clone3", 0x50000 | errno.ENOSYS)]
    # An allow-all default needs the refusing rules spelled out, one per flag.
    assert seccomp.guard_userns([], allow) == [
        seccomp.Rule("unshare", eperm, ((0, 7, CLONE_NEWUSER, CLONE_NEWUSER),)),
        seccomp.Rule("unshare", eperm, ((0, 7, CLONE_NEWNET, CLONE_NEWNET),)),
        seccomp.Rule("clone", eperm, ((0, 7, CLONE_NEWUSER, CLONE_NEWUSER),)),
        seccomp.Rule("clone", eperm, ((0, 7, CLONE_NEWNET, CLONE_NEWNET),)),
        seccomp.Rule("clone3", 0x50000 | errno.ENOSYS)]


# ---------------------------------------------------------------- bad profiles


def _profile(tmp_path, text: str):
    path = tmp_path / "bad.json"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_unknown_syscall_names_its_line(tmp_path) -> None:
    path = _profile(tmp_path, """\
        {
          "defaultAction": "SCMP_ACT_ERRNO",
          "syscalls": [
            {"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"},
            {"names": [
               "getpid",
               "getpidd"
             ], "action": "SCMP_ACT_ALLOW"}
          ]
        }
        """)
    with pytest.raises(InputError) as exc:
        seccomp.load_profile(path)
    assert str(exc.value) == (f"{path}:7: syscalls[1].names[1]: unknown syscall 'getpidd' "
                              "(libseccomp knows no such name)")
    assert exc.value.exit_code == 2


@pytest.mark.parametrize(("fragment", "line", "message"), [
    ('"action": "SCMP_ACT_MAYBE"', 4, "syscalls[0].action: unknown action 'SCMP_ACT_MAYBE'"),
    ('"action": "SCMP_ACT_ALLOW", "args": [\n{"index": 0, "value": 1, "op": "SCMP_CMP_ABOUT"}]',
     5, "syscalls[0].args[0].op: unknown op 'SCMP_CMP_ABOUT'"),
    ('"action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_FLY"]}', 4,
     "syscalls[0].includes.caps[0]: unknown capability 'CAP_FLY'"),
])
def test_bad_fields_name_file_line_and_field(tmp_path, fragment, line, message) -> None:
    path = _profile(tmp_path, '{"defaultAction": "SCMP_ACT_ERRNO",\n"syscalls": [\n'
                    '{"names": ["read"],\n' + fragment + "}]}\n")
    with pytest.raises(InputError) as exc:
        seccomp.load_profile(path)
    assert str(exc.value).startswith(f"{path}:{line}: {message}")


def test_bad_json_names_line_and_column(tmp_path) -> None:
    path = _profile(tmp_path, '{"defaultAction": "SCMP_ACT_ERRNO",\n  "syscalls": [,]}\n')
    with pytest.raises(InputError, match=rf"^{path}:2:16: not valid JSON"):
        seccomp.load_profile(path)


def test_a_copy_of_dockers_profile_loads(tmp_path) -> None:
    # It names syscalls newer than this libseccomp (skipped, as runc does); they are no typos.
    path = tmp_path / "docker.json"
    path.write_bytes(seccomp.DEFAULT_PROFILE.read_bytes())
    assert seccomp.load_profile(str(path)) == seccomp.load_profile("default")
    assert seccomp.compile(str(path), CAPS) == seccomp.compile("default", CAPS)


# ---------------------------------------------------------------- the spec field


def _spec(runtime: str):
    return parse_spec(f"name: a\nkind: cpu\nruntime:\n{runtime}", "a.yaml")


def test_spec_defaults_and_accepts_a_good_path(tmp_path) -> None:
    rt = _spec("  isolation: native\n").spec.runtime
    assert rt.seccomp == "default" and rt.nested_userns is False
    path = tmp_path / "ok.json"
    path.write_text('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}')
    rt = _spec(f"  seccomp: {path}\n  nested_userns: true\n").spec.runtime
    assert rt.seccomp == str(path) and rt.nested_userns is True


def test_spec_unknown_syscall_in_profile_is_a_spec_error(tmp_path) -> None:
    path = _profile(tmp_path, '{"defaultAction": "SCMP_ACT_ERRNO",\n"syscalls": [\n'
                    '{"names": ["nosuchcall"], "action": "SCMP_ACT_ALLOW"}]}\n')
    with pytest.raises(SpecError) as exc:
        _spec(f"  seccomp: {path}\n")
    [problem] = exc.value.problems
    assert (problem.file, problem.line, problem.field) == ("a.yaml", 4, "runtime.seccomp")
    assert f"{path}:3: syscalls[0].names[0]: unknown syscall 'nosuchcall'" in problem.message


@pytest.mark.parametrize("value", ["strict", "profiles/x.json", "''"])
def test_spec_bad_seccomp_value_lists_what_is_allowed(value) -> None:
    with pytest.raises(SpecError) as exc:
        _spec(f"  seccomp: {value}\n")
    [problem] = exc.value.problems
    assert problem.field == "runtime.seccomp"
    assert "default, unconfined or an absolute path" in problem.message


def test_spec_nested_userns_is_a_flag() -> None:
    with pytest.raises(SpecError, match="must be true or false"):
        _spec("  nested_userns: 1\n")
