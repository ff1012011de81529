"""The seccomp filter of a launch: which profile applies, its compiled BPF program, and
installing that program in the process about to exec the job.

Semantics are Docker's: moby's default profile (vendored as envctl/seccomp/default.json from
github.com/moby/profiles, commit cd3bed8061c7b7378b61fc6827c7885779417a75 (seccomp/v0.2.3-8),
file last changed in 3c28324314729dbade8287e868eef6338c42807a) is filtered as
moby/profiles/seccomp/seccomp_linux.go does — a group with includes.caps applies when every
listed capability is kept, excludes.caps drops it when any is, arches and minKernel likewise —
and the rules are added as runc's libcontainer/seccomp does: unknown syscall names skipped,
rules whose action is the default skipped, several comparisons of one argument split into
separate rules, the bad-arch action libseccomp's (and so runc's) default, SCMP_ACT_KILL_THREAD.
On top of the profile, unless `nested_userns`, the filter refuses creating a user or a network
namespace (unshare/clone with CLONE_NEWUSER or CLONE_NEWNET: EPERM; clone3, whose flags sit
behind a pointer: ENOSYS, so glibc falls back to clone) even when the kept capabilities
(SYS_ADMIN) would allow it: a network namespace made inside a launch's user namespace is that
namespace's, where root inside has NET_ADMIN and reaches nf_tables.

libseccomp is used through ctypes: Debian ships libseccomp.so.2 with every container runtime,
it knows every architecture's syscall table and emits the multi-arch BPF, and a ctypes binding
adds no PyPI dependency. Nothing heavy is imported until a program is compiled.

The cache: a compiled program is a pure function of the profile's bytes, the capability set,
`nested_userns`, the machine and the kernel release (minKernel), so it is stored with those
(the whole key, compared byte for byte on a hit: the file's name, a CRC of it, only spreads
them) in the caller's cache directory (0700, files 0600, written to a temporary name and
renamed), and read back on a hit without loading libseccomp, hashing or parsing anything: the
launch path pays ~0.2 ms for it. The launch's cache is the environment's run directory,
which `down` and a reboot empty, so a libseccomp upgrade takes effect at the next `up`.
"""

from __future__ import annotations

import os
from collections import namedtuple
from pathlib import Path

from envctl.errors import InputError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~4 ms): see record.py
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# The named settings of `runtime.seccomp`; anything else must be an absolute path to an
# OCI/Docker-format JSON profile.
SETTINGS = ("default", "unconfined")
DEFAULT_PROFILE = Path(__file__).resolve().parent.parent / "seccomp" / "default.json"
# Bump when the compiler below changes what it emits for the same inputs: cached programs
# from an older envctl are then never read.
_CACHE_FORMAT = b"envctl-seccomp-2"  # -2: CLONE_NEWNET guarded too

# libseccomp's seccomp.h: actions, comparison operators, filter attributes.
_ACT_KILL_THREAD = 0x00000000
_ACT_KILL_PROCESS = 0x80000000
_ACT_TRAP = 0x00030000
_ACT_ERRNO = 0x00050000
_ACT_TRACE = 0x7FF00000
_ACT_LOG = 0x7FFC0000
_ACT_ALLOW = 0x7FFF0000
ACTIONS = {
    "SCMP_ACT_KILL": _ACT_KILL_THREAD, "SCMP_ACT_KILL_THREAD": _ACT_KILL_THREAD,
    "SCMP_ACT_KILL_PROCESS": _ACT_KILL_PROCESS, "SCMP_ACT_TRAP": _ACT_TRAP,
    "SCMP_ACT_ERRNO": _ACT_ERRNO, "SCMP_ACT_TRACE": _ACT_TRACE, "SCMP_ACT_LOG": _ACT_LOG,
    "SCMP_ACT_ALLOW": _ACT_ALLOW,
}
OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4,
       "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}
_OP_EQ, _OP_MASKED_EQ = OPS["SCMP_CMP_EQ"], OPS["SCMP_CMP_MASKED_EQ"]
_ATTR_ACT_BADARCH = 2
_ATTR_CTL_OPTIMIZE = 8
_NR_SCMP_ERROR = -1
_EPERM, _ENOSYS, _EEXIST = 1, 38, 17
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
# The namespaces only `nested_userns` lets a job create.
GUARDED = CLONE_NEWUSER | CLONE_NEWNET
# moby's names for the machine (its goToNative map), which includes/excludes.arches use.
_MOBY_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "i686": "x86", "i386": "x86",
              "armv7l": "arm", "armv8l": "arm", "ppc64le": "ppc64le", "s390x": "s390x",
              "riscv64": "riscv64", "loongarch64": "loongarch64", "mips64": "mips64"}
# include/uapi/linux/prctl.h, linux/seccomp.h; BPF_MAXINSNS.
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_BPF_MAXINSNS = 4096


class Rule(namedtuple("Rule", "name action conds", defaults=((),))):
    """One libseccomp rule: the syscall (`name`), the action value (`action`), and
    (arg, op, a, b) comparisons (`conds`)."""

    __slots__ = ()


# ---------------------------------------------------------------- reading a profile


def load_profile(setting: str) -> dict[str, Any] | None:
    """The parsed, checked profile of a `runtime.seccomp` setting; None for "unconfined".

    A bad profile raises InputError naming `file:line: field: what is wrong`.
    Example: load_profile("/etc/envctl/strict.json")["defaultAction"]
    """
    if setting == "unconfined":
        return None
    name, data = _source(setting)
    return _parse(name, data, known_names_only=setting != "default")


def _source(setting: str) -> tuple[str, bytes]:
    if setting == "default":
        path = DEFAULT_PROFILE
    elif setting.startswith("/"):
        path = Path(setting)
    else:
        raise InputError(f"seccomp is one of {', '.join(SETTINGS)} or an absolute path to a "
                         f"JSON profile, not {setting!r}")
    try:
        return str(path), path.read_bytes()
    except OSError as exc:
        raise InputError(f"read seccomp profile '{path}': {exc.strerror}") from None


class _Bad(Exception):
    """A problem at a JSON path, before its line is known."""

    def __init__(self, where: tuple[str | int, ...], message: str):
        super().__init__(message)
        self.where = where


def _parse(name: str, data: bytes, *, known_names_only: bool) -> dict[str, Any]:
    import json

    try:
        text = data.decode()
        profile = json.loads(text)
    except UnicodeDecodeError as exc:
        raise InputError(f"{name}: not UTF-8 text: {exc.reason}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{name}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from None
    try:
        _check(profile, known_names_only=known_names_only)
    except _Bad as bad:
        # Only now pay for the pure-Python parse that records where each value starts.
        line = _line_of(text, bad.where)
        field = _dotted(bad.where)
        raise InputError(f"{name}:{line}: {field}: {bad}" if line else
                         f"{name}: {field}: {bad}") from None
    return profile


def _dotted(where: tuple[str | int, ...]) -> str:
    out = ""
    for part in where:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "(top)"


def _line_of(text: str, where: tuple[str | int, ...]) -> int | None:
    """The line of the value at `where`, or of the nearest enclosing object or list."""
    import json
    import json.decoder
    import json.scanner

    class Str(str):
        pos = 0

    class Dict(dict):  # type: ignore[type-arg]
        pos = 0

    class List(list):  # type: ignore[type-arg]
        pos = 0

    def parse_string(s: str, end: int, strict: bool) -> tuple[str, int]:
        value, new_end = json.decoder.scanstring(s, end, strict)
        out = Str(value)
        out.pos = end - 1
        return out, new_end

    def parse_object(s_and_end: tuple[str, int], *args: Any) -> tuple[dict[str, Any], int]:
        value, end = json.decoder.JSONObject(s_and_end, *args)
        out = Dict(value)
        out.pos = s_and_end[1] - 1
        return out, end

    def parse_array(s_and_end: tuple[str, int], scan_once: Any) -> tuple[list[Any], int]:
        value, end = json.decoder.JSONArray(s_and_end, scan_once)
        out = List(value)
        out.pos = s_and_end[1] - 1
        return out, end

    decoder = json.JSONDecoder()
    decoder.parse_string = parse_string  # type: ignore[attr-defined]
    decoder.parse_object = parse_object  # type: ignore[attr-defined]
    decoder.parse_array = parse_array  # type: ignore[attr-defined]
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    node: Any = decoder.decode(text)
    pos = getattr(node, "pos", None)
    for part in where:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            break
        pos = getattr(node, "pos", pos)
    return None if pos is None else text.count("\n", 0, pos) + 1


def _check(p: Any, *, known_names_only: bool) -> None:
    """Raise _Bad for the first thing in profile `p` that Docker or runc would refuse."""
    if not isinstance(p, dict):
        raise _Bad((), "a seccomp profile is a JSON object with defaultAction and syscalls")
    _action(p, (), "defaultAction", "defaultErrnoRet", required=True)
    if p.get("architectures") and p.get("archMap"):
        raise _Bad(("archMap",), "give either 'architectures' or 'archMap', not both")
    for i, arch in enumerate(_list(p, (), "architectures")):
        _arch(arch, ("architectures", i))
    for i, entry in enumerate(_list(p, (), "archMap")):
        where: tuple[str | int, ...] = ("archMap", i)
        if not isinstance(entry, dict):
            raise _Bad(where, "an archMap entry is {architecture, subArchitectures}")
        _arch(entry.get("architecture"), (*where, "architecture"))
        for j, sub in enumerate(_list(entry, where, "subArchitectures")):
            _arch(sub, (*where, "subArchitectures", j))
    unknown: list[tuple[tuple[str | int, ...], str]] = []
    for i, call in enumerate(_list(p, (), "syscalls")):
        where = ("syscalls", i)
        if not isinstance(call, dict):
            raise _Bad(where, "a syscalls entry is an object with names and action")
        if call.get("name") and call.get("names"):
            raise _Bad((*where, "name"), "give either 'name' or 'names', not both")
        names = [call["name"]] if call.get("name") else _list(call, where, "names")
        key = "name" if call.get("name") else "names"
        if not names:
            raise _Bad(where, "a syscalls entry needs names")
        for j, sc in enumerate(names):
            at = (*where, key) if key == "name" else (*where, key, j)
            if not isinstance(sc, str) or not sc:
                raise _Bad(at, "a syscall name is a non-empty string")
            unknown.append((at, sc))
        _action(call, where, "action", "errnoRet", required=True)
        for j, arg in enumerate(_list(call, where, "args")):
            _arg(arg, (*where, "args", j))
        for part in ("includes", "excludes"):
            _filter(call.get(part), (*where, part))
    if known_names_only:
        _check_names(unknown)


def _list(obj: dict[str, Any], where: tuple[str | int, ...], key: str) -> list[Any]:
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _Bad((*where, key), f"{key} is a list")
    return value


def _action(obj: dict[str, Any], where: tuple[str | int, ...], key: str, errno_key: str,
            *, required: bool) -> None:
    act = obj.get(key)
    if act is None and not required:
        return
    if act == "SCMP_ACT_NOTIFY":
        raise _Bad((*where, key), "SCMP_ACT_NOTIFY needs a seccomp agent (listenerPath), "
                   "which envctl does not run")
    if act not in ACTIONS:
        raise _Bad((*where, key), f"unknown action {act!r}; allowed: {', '.join(ACTIONS)}")
    ret = obj.get(errno_key)
    if ret is not None and (isinstance(ret, bool) or not isinstance(ret, int)
                            or not 0 <= ret <= 4095):
        raise _Bad((*where, errno_key), f"{errno_key} is an errno from 0 to 4095, not {ret!r}")


def _arch(name: Any, where: tuple[str | int, ...]) -> None:
    if not isinstance(name, str) or not name.startswith("SCMP_ARCH_"):
        raise _Bad(where, f"an architecture is SCMP_ARCH_<name>, not {name!r}")


def _arg(arg: Any, where: tuple[str | int, ...]) -> None:
    if not isinstance(arg, dict):
        raise _Bad(where, "an args entry is {index, value, valueTwo, op}")
    index = arg.get("index")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= 5:
        raise _Bad((*where, "index"), f"a syscall argument index is 0 to 5, not {index!r}")
    for key in ("value", "valueTwo"):
        v = arg.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 64:
            raise _Bad((*where, key), f"{key} is a 64-bit unsigned number, not {v!r}")
    if arg.get("op") not in OPS:
        raise _Bad((*where, "op"), f"unknown op {arg.get('op')!r}; allowed: {', '.join(OPS)}")


def _filter(f: Any, where: tuple[str | int, ...]) -> None:
    from envctl.caps import NUMBERS

    if f is None:
        return
    if not isinstance(f, dict):
        raise _Bad(where, "includes/excludes is an object with caps, arches, minKernel")
    for j, cap in enumerate(_list(f, where, "caps")):
        if not isinstance(cap, str) or cap.removeprefix("CAP_") not in NUMBERS:
            raise _Bad((*where, "caps", j), f"unknown capability {cap!r}")
    for j, arch in enumerate(_list(f, where, "arches")):
        if not isinstance(arch, str):
            raise _Bad((*where, "arches", j), f"an arch is a name like amd64, not {arch!r}")
    kernel = f.get("minKernel")
    if kernel is not None and _kernel_version(kernel) is None:
        raise _Bad((*where, "minKernel"), f"minKernel is like \"4.8\", not {kernel!r}")


def _check_names(names: list[tuple[tuple[str | int, ...], str]]) -> None:
    # A name libseccomp resolves on no architecture is a typo — unless moby's default
    # profile lists it too: then it is a syscall newer than this libseccomp, skipped as runc
    # skips it, so a copy of Docker's profile loads here.
    lib = _lib()
    bad = [(at, n) for at, n in names
           if lib.seccomp_syscall_resolve_name(n.encode()) == _NR_SCMP_ERROR]
    if not bad:
        return
    known = _default_names()
    for at, n in bad:
        if n not in known:
            raise _Bad(at, f"unknown syscall {n!r} (libseccomp knows no such name)")


def _default_names() -> set[str]:
    import json

    profile = json.loads(DEFAULT_PROFILE.read_bytes())
    return {n for call in profile["syscalls"] for n in call.get("names") or [call.get("name")]}


def _kernel_version(text: Any) -> tuple[int, int] | None:
    # moby's parseRelease: "%d.%d" at the start; "6.18.0-1-amd64" is (6, 18).
    import re

    m = re.match(r"(\d+)\.(\d+)", text) if isinstance(text, str) else None
    return (int(m[1]), int(m[2])) if m else None


# ---------------------------------------------------------------- choosing the rules


def _act(name: str, errno_ret: int | None) -> int:
    base = ACTIONS[name]
    if base in (_ACT_ERRNO, _ACT_TRACE):
        return base | (_EPERM if errno_ret is None else errno_ret)
    return base


def _permits(action: int) -> bool:
    # ALLOW, LOG and TRACE (a tracer decides) let the call through; KILL, TRAP, ERRNO do not.
    return action in (_ACT_ALLOW, _ACT_LOG) or action & 0xFFFF0000 == _ACT_TRACE


def _applies(call: dict[str, Any], caps: int, arch: str, kernel: tuple[int, int]) -> bool:
    """moby's setupSeccomp filter: whether one syscalls group is in the filter."""
    from envctl.caps import NUMBERS

    def kept(cap: str) -> bool:
        return bool(caps >> NUMBERS[cap.removeprefix("CAP_")] & 1)

    def new_enough(f: dict[str, Any]) -> bool | None:
        least = _kernel_version(f.get("minKernel"))
        return None if least is None else kernel >= least

    exc = call.get("excludes") or {}
    if arch in (exc.get("arches") or ()):
        return False
    if any(kept(c) for c in exc.get("caps") or ()):
        return False
    if new_enough(exc) is True:
        return False
    inc = call.get("includes") or {}
    if inc.get("arches") and arch not in inc["arches"]:
        return False
    if not all(kept(c) for c in inc.get("caps") or ()):
        return False
    return new_enough(inc) is not False


def select_rules(profile: dict[str, Any], caps: int, *, arch: str,
                 kernel: tuple[int, int]) -> list[Rule]:
    """The rules of `profile` for capability bitmask `caps` on moby arch `arch`, as runc adds
    them: rules with the default action dropped, one rule per comparison of a repeated arg."""
    default = _act(profile["defaultAction"], profile.get("defaultErrnoRet"))
    rules = []
    for call in profile.get("syscalls") or ():
        if not _applies(call, caps, arch, kernel):
            continue
        action = _act(call["action"], call.get("errnoRet"))
        if action == default:
            continue  # runc: redundant, and libseccomp refuses it
        conds = tuple((a["index"], OPS[a["op"]], a.get("value", 0), a.get("valueTwo", 0))
                      for a in call.get("args") or ())
        indices = [c[0] for c in conds]
        groups = ([(c,) for c in conds] if len(set(indices)) < len(indices) else [conds])
        names = [call["name"]] if call.get("name") else call["names"]
        rules += [Rule(n, action, g) for n in names for g in groups]
    return rules


def guard_userns(rules: list[Rule], default: int, *, clone_flags_arg: int = 0) -> list[Rule]:
    """`rules` changed so that no rule lets unshare/clone create a user or a network namespace
    (GUARDED), those calls get EPERM, and clone3 gets ENOSYS. Permitting rules gain a
    `flags & GUARDED == 0` comparison, so a refusing rule never overlaps one: libseccomp does
    not promise which of two overlapping rules of different actions wins (the refusing rules
    overlap each other, with one action)."""
    out = []
    for rule in rules:
        if rule.name == "clone3":
            continue  # replaced below, whatever the profile says
        if rule.name in ("unshare", "clone") and _permits(rule.action):
            index = 0 if rule.name == "unshare" else clone_flags_arg
            guarded = _flag_clear(rule, index)
            if guarded is not None:
                out.append(guarded)
            continue
        out.append(rule)
    refuse = _ACT_ERRNO | _EPERM
    for name, index in (("unshare", 0), ("clone", clone_flags_arg)):
        refused_anyway = any(r.name == name and not r.conds and not _permits(r.action)
                             for r in out)
        if default != refuse and not refused_anyway:
            for flag in (CLONE_NEWUSER, CLONE_NEWNET):
                out.append(Rule(name, refuse, ((index, _OP_MASKED_EQ, flag, flag),)))
    if default != _ACT_ERRNO | _ENOSYS:
        out.append(Rule("clone3", _ACT_ERRNO | _ENOSYS))
    return out


def allow_namespaces(rules: list[Rule]) -> list[Rule]:
    """`rules` changed so that unshare and clone are allowed with any flags, for every user
    (runtime.nested_userns: true): creating a user namespace needs no capability, and inside
    it the new namespaces (mount, PID, network) are made with unshare and clone again, which
    Docker's profile allows only with SYS_ADMIN. What those namespaces then need (mount,
    pivot_root, setns) keeps the profile's rule."""
    out = [r for r in rules if r.name not in ("unshare", "clone")]
    return out + [Rule("unshare", _ACT_ALLOW), Rule("clone", _ACT_ALLOW)]


def _flag_clear(rule: Rule, index: int) -> Rule | None:
    """`rule` narrowed to calls without a GUARDED flag in argument `index`; None if it only
    ever matches calls with one."""
    others = tuple(c for c in rule.conds if c[0] != index)
    mine = [c for c in rule.conds if c[0] == index]
    if not mine:
        return rule._replace(conds=(*others, (index, _OP_MASKED_EQ, GUARDED, 0)))
    _, op, a, b = mine[0]
    if op == _OP_MASKED_EQ:
        if b & GUARDED:
            return None
        return rule._replace(conds=(*others, (index, op, a | GUARDED, b)))
    if op == _OP_EQ:
        return None if a & GUARDED else rule
    raise InputError(f"seccomp profile: {rule.name}'s flags are compared with an operator "
                     "other than SCMP_CMP_EQ or SCMP_CMP_MASKED_EQ, which cannot be combined "
                     "with refusing CLONE_NEWUSER and CLONE_NEWNET; set runtime.nested_userns: "
                     "true or rewrite the rule")


# ---------------------------------------------------------------- compiling


def compile(setting: str, caps: int, *, nested_userns: bool = False,
            cache_dir: Path | None = None) -> bytes | None:
    """The classic-BPF program (struct sock_filter[], 8 bytes each) of `setting` for the
    capability bitmask `caps` (bit N: capability N); None for "unconfined".

    Example: prog = compile("default", caps_mask, cache_dir=Path("/var/cache/envctl"))
    """
    if setting == "unconfined":
        return None
    name, data = _source(setting)
    path = None
    key = _cache_key(data, caps, nested_userns)
    if cache_dir is not None:
        path = _cache_path(cache_dir, key)
        cached = _cache_read(path, key) if path is not None else None
        if cached is not None:
            return cached
    profile = _parse(name, data, known_names_only=setting != "default")
    prog = _build(name, profile, caps, nested_userns=nested_userns)
    if path is not None:
        _cache_write(path, key, prog)
    return prog


def _machine() -> tuple[str, str]:
    uname = os.uname()
    return uname.machine, uname.release


def _build(name: str, profile: dict[str, Any], caps: int, *, nested_userns: bool) -> bytes:
    """Compile `profile` with libseccomp and export its BPF."""
    import ctypes

    machine, release = _machine()
    arch = _MOBY_ARCH.get(machine, machine)
    default = _act(profile["defaultAction"], profile.get("defaultErrnoRet"))
    rules = select_rules(profile, caps, arch=arch, kernel=_kernel_version(release) or (0, 0))
    if nested_userns:
        if default != _ACT_ALLOW:  # an allow-all profile allows them already
            rules = allow_namespaces(rules)
    else:
        flags_arg = 1 if arch in ("s390", "s390x") else 0
        rules = guard_userns(rules, default, clone_flags_arg=flags_arg)
    lib = _lib()
    ctx = lib.seccomp_init(default)
    if not ctx:
        raise InputError(f"{name}: libseccomp refused default action {default:#x}")
    try:
        _check_rc(lib.seccomp_attr_set(ctx, _ATTR_ACT_BADARCH, _ACT_KILL_THREAD),
                  name, "set the bad-arch action")
        if len(rules) > 32:
            # runc: a binary tree of syscalls for long lists (libseccomp >= 2.5).
            lib.seccomp_attr_set(ctx, _ATTR_CTL_OPTIMIZE, 2)
        for arch_name in _arches(profile, lib):
            token = lib.seccomp_arch_resolve_name(arch_name.encode())
            if token == 0:
                raise InputError(f"{name}: libseccomp knows no architecture {arch_name!r}")
            rc = lib.seccomp_arch_add(ctx, token)
            if rc != -_EEXIST:  # the native arch is in a new filter already
                _check_rc(rc, name, f"add architecture {arch_name}")
        for rule in rules:
            nr = lib.seccomp_syscall_resolve_name(rule.name.encode())
            if nr == _NR_SCMP_ERROR:
                continue  # runc: a syscall this libseccomp does not know is skipped
            conds = (_ArgCmp * max(1, len(rule.conds)))(*(_ArgCmp(*c) for c in rule.conds))
            rc = lib.seccomp_rule_add_array(ctx, rule.action, nr, len(rule.conds), conds)
            if rc != -_EEXIST:
                _check_rc(rc, name, f"add rule {rule.action:#x} for {rule.name} {rule.conds}")
        return _export(lib, ctx, name)
    finally:
        lib.seccomp_release(ctypes.c_void_p(ctx))


def _arches(profile: dict[str, Any], lib: Any) -> list[str]:
    """libseccomp names of the architectures the filter also covers (moby: the archMap entry
    of the native arch and its sub-architectures; or the plain 'architectures' list)."""
    names = list(profile.get("architectures") or ())
    native = lib.seccomp_arch_native()
    for entry in profile.get("archMap") or ():
        main = entry["architecture"]
        if lib.seccomp_arch_resolve_name(_scmp_arch(main).encode()) == native:
            names = [main, *(entry.get("subArchitectures") or ())]
            break
    return [_scmp_arch(n) for n in names]


def _scmp_arch(name: str) -> str:
    return name.removeprefix("SCMP_ARCH_").lower()


def _check_rc(rc: int, name: str, what: str) -> None:
    if rc < 0:
        raise InputError(f"compile seccomp profile '{name}': {what}: {os.strerror(-rc)}")


def _export(lib: Any, ctx: int, name: str) -> bytes:
    fd = os.memfd_create("envctl-seccomp", os.MFD_CLOEXEC)
    try:
        _check_rc(lib.seccomp_export_bpf(ctx, fd), name, "export BPF")
        size = os.lseek(fd, 0, os.SEEK_END)
        prog = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    if not prog or len(prog) % 8 or len(prog) // 8 > _BPF_MAXINSNS:
        raise InputError(f"compile seccomp profile '{name}': {len(prog) // 8} BPF "
                         f"instructions; the kernel takes 1 to {_BPF_MAXINSNS}")
    return prog


_LIB: Any = None


def _lib() -> Any:
    """libseccomp.so.2, loaded once, with the prototypes this module calls."""
    global _LIB, _ArgCmp
    if _LIB is not None:
        return _LIB
    import ctypes

    class ArgCmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                    ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]

    class Version(ctypes.Structure):
        _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint),
                    ("micro", ctypes.c_uint)]

    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as exc:
        raise InputError(f"load libseccomp.so.2 (Debian: libseccomp2): {exc}") from None
    u32, ptr = ctypes.c_uint32, ctypes.c_void_p
    protos = {
        "seccomp_init": (ptr, [u32]),
        "seccomp_release": (None, [ptr]),
        "seccomp_attr_set": (ctypes.c_int, [ptr, ctypes.c_int, u32]),
        "seccomp_arch_add": (ctypes.c_int, [ptr, u32]),
        "seccomp_arch_native": (u32, []),
        "seccomp_arch_resolve_name": (u32, [ctypes.c_char_p]),
        "seccomp_syscall_resolve_name": (ctypes.c_int, [ctypes.c_char_p]),
        "seccomp_rule_add_array": (ctypes.c_int, [ptr, u32, ctypes.c_int, ctypes.c_uint,
                                                  ctypes.POINTER(ArgCmp)]),
        "seccomp_export_bpf": (ctypes.c_int, [ptr, ctypes.c_int]),
        "seccomp_version": (ctypes.POINTER(Version), []),
    }
    for fn, (restype, argtypes) in protos.items():
        getattr(lib, fn).restype = restype
        getattr(lib, fn).argtypes = argtypes
    _ArgCmp = ArgCmp
    _LIB = lib
    return lib


_ArgCmp: Any = None


def libseccomp_version() -> str:
    v = _lib().seccomp_version().contents
    return f"{v.major}.{v.minor}.{v.micro}"


# ---------------------------------------------------------------- the cache


def _cache_key(data: bytes, caps: int, nested_userns: bool) -> bytes:
    machine, release = _machine()
    head = f"{caps:x}\n{int(bool(nested_userns))}\n{machine}\n{release}\n{len(data)}\n"
    return _CACHE_FORMAT + b"\n" + head.encode() + data


def _cache_path(cache_dir: Path, key: bytes) -> Path | None:
    """Where the program for `key` is cached; None if `cache_dir` cannot be trusted (not a
    directory of ours that only we can write: a program read from it is the filter)."""
    import stat
    import zlib

    try:
        cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(cache_dir)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return None
    return cache_dir / f"seccomp-{zlib.crc32(key):08x}-{len(key)}.bpf"


def _cache_read(path: Path, key: bytes) -> bytes | None:
    """The program cached for `key` (the file holds the key, then the program), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # ENOENT: a miss; ELOOP (a symlink) or anything else: compile afresh
    try:
        st = os.fstat(fd)
        size = st.st_size - len(key)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022 or size % 8 \
                or not 0 < size <= 8 * _BPF_MAXINSNS:
            return None
        data = os.pread(fd, st.st_size, 0)
    finally:
        os.close(fd)
    if len(data) != st.st_size or not data.startswith(key):
        return None  # another key with the same name (a CRC collision), or torn
    return data[len(key):]


def _cache_write(path: Path, key: bytes, prog: bytes) -> None:
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".seccomp-")  # mode 0600
    except OSError:
        return  # a cache that cannot be written is only slower
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key + prog)
        os.rename(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


# ---------------------------------------------------------------- installing


def prepare(prog: bytes) -> Callable[[], None]:
    """A function that installs `prog` as the calling process's seccomp filter, with everything
    it needs allocated now: call this before fork, the result in the child after
    PR_SET_NO_NEW_PRIVS, right before execve. It raises OSError(errno) if the kernel refuses.
    """
    import ctypes

    if not prog or len(prog) % 8 or len(prog) // 8 > _BPF_MAXINSNS:
        raise ValueError(f"a BPF program is 1 to {_BPF_MAXINSNS} 8-byte instructions, "
                         f"not {len(prog)} bytes")

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)  # own instance: argtypes set here stay ours
    prctl = libc.prctl
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                      ctypes.c_ulong]
    address = ctypes.addressof(fprog)
    get_errno = ctypes.get_errno

    def install_now(_keep: tuple[Any, ...] = (buf, fprog)) -> None:
        if prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, address, 0, 0) != 0:
            err = get_errno()
            raise OSError(err, os.strerror(err))

    return install_now


def install(prog: bytes) -> None:
    """Install `prog` as the calling process's seccomp filter (needs PR_SET_NO_NEW_PRIVS or
    CAP_SYS_ADMIN); raises OSError(errno) if the kernel refuses."""
    prepare(prog)()
