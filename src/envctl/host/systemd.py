"""systemd slices for environments (the systemd cgroup driver): unit names, runtime unit files
under /run/systemd/system, systemctl calls, properties read back, /dev/char links, attaching
processes, and stopping a slice with the same grace as the cgroupfs driver.

envctl never writes cgroupfs files of a slice (systemd's single-writer rule): limits go through
the unit file (and `systemctl set-property --runtime` where a drop-in shadows it), processes go
in as transient scopes, and teardown signals processes (through pidfds, once /proc says they
are in the slice) and asks systemd to stop the slice.

Why not `systemctl kill SLICE`: systemd 252 (Debian 12) does kill slices (slice_kill ->
unit_kill_common -> cg_kill_recursive; checked under systemd-nspawn: SIGTERM and SIGKILL reach
the processes of the slice's scopes), but it reads cgroup.procs and signals each pid by number,
as systemd did before its later pidfd (PidRef) rework: the very PID-reuse race pidfds close.
`systemctl stop` alone would wait each scope's TimeoutStopSec (90 s by default) rather than
envctl's grace. set-property --runtime keeps each setting in
/run/systemd/system.control/UNIT.d/50-SETTING.conf (checked on 252: 50-CPUQuota.conf,
50-DeviceAllow.conf, ...), which is how removal finds envctl's drop-ins and no others.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import re
import shlex
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from envctl.errors import HostError
from envctl.facts import DEFAULT_PARENT
from envctl.host.cgroups import (
    DEFAULT_ROOT,
    KILL_DEADLINE,
    KILL_GRACE,
    CgroupLayout,
    detect_layout,
    in_cgroup,
    kill_grace_from_env,
    read_procs,
    signal_members,
    wait_for,
    wait_unpopulated,
)
from envctl.host.scope import run as _run
from envctl.spec.naming import env_slice, escape, parent_slice, slice_cgroup  # noqa: F401
from envctl.spec.units import format_cpu_list, parse_cpu_list

UNIT_DIR = Path("/run/systemd/system")
# Where `systemctl set-property --runtime` leaves its drop-ins.
CONTROL_DIR = Path("/run/systemd/system.control")
# systemctl's exit status for "unit not loaded / unknown" (LSB "not installed").
EXIT_NOT_LOADED = 5

Runner = Callable[[list[str]], subprocess.CompletedProcess]


# ---------------------------------------------------------------- unit files and properties

# Unit-file setting -> the property `systemctl show` reports it as.
SHOW_KEY = {"CPUQuota": "CPUQuotaPerSecUSec", "CPUQuotaPeriodSec": "CPUQuotaPeriodUSec"}
_SPAN_UNITS = {"us": 1, "ms": 1000, "s": 1_000_000, "min": 60_000_000, "h": 3_600_000_000,
               "d": 86_400_000_000, "w": 604_800_000_000}


def show_key(setting: str) -> str:
    return SHOW_KEY.get(setting, setting)


def parse_timespan(text: str) -> str:
    """A time span as systemctl prints it ('500ms', '1s 500ms', 'infinity') in µs."""
    text = text.strip()
    if text in ("", "infinity"):
        return "infinity"
    total = 0
    for num, unit in re.findall(r"([0-9.]+)\s*([a-z]*)", text):
        total += round(float(num) * _SPAN_UNITS.get(unit or "us", 1))
    return str(total)


def want_value(setting: str, value: str) -> str:
    """A unit-file value as `systemctl show` will report it, normalised."""
    value = value.strip()
    if setting == "CPUQuota":
        return "infinity" if not value else str(round(float(value.rstrip("%")) * 10_000))
    if setting == "CPUQuotaPeriodSec":
        return parse_timespan(value)
    return have_value(setting, value)


def have_value(setting: str, value: str) -> str:
    """A value `systemctl show` printed, normalised for comparison with `want_value`."""
    value = value.strip()
    if setting in SHOW_KEY:
        return parse_timespan(value)
    if setting in ("AllowedCPUs", "AllowedMemoryNodes"):
        return format_cpu_list(parse_cpu_list(value)) if value else ""
    if setting in ("MemoryMax", "MemoryHigh", "MemorySwapMax", "TasksMax") and value in (
            "", "infinity", str(2**64 - 1)):
        return "infinity"
    return " ".join(value.split())


HEADER = "# Made by envctl; `envctl down` removes it. Do not edit: `envctl up` rewrites it."


def unit_text(description: str, settings: Sequence[tuple[str, str]],
              device_allow: Sequence[str] = (), *, policy: bool = True) -> str:
    """The unit file of a slice: [Unit] Description, then every setting in order."""
    lines = [HEADER,
             "[Unit]", f"Description={description}", "", "[Slice]"]
    lines += [f"{k}={v}" for k, v in settings]
    if policy:
        lines.append("DevicePolicy=closed")
        lines += [f"DeviceAllow={d}" for d in device_allow]
    return "\n".join(lines) + "\n"


def expected(settings: Sequence[tuple[str, str]], device_allow: Sequence[str] = (), *,
             policy: bool = True) -> dict[str, str]:
    """setting -> normalised value systemd should report for the unit file `unit_text` makes."""
    want = {k: want_value(k, v) for k, v in settings}
    if policy:
        want["DevicePolicy"] = "closed"
        want["DeviceAllow"] = _device_set(device_allow)
    return want


def _device_set(entries: Iterable[str]) -> str:
    # systemd keeps DeviceAllow= newest first; the order means nothing.
    return "; ".join(sorted({" ".join(e.split()) for e in entries if e.strip()}))


def read_proc_devices(proc: Path) -> dict[tuple[str, int], str]:
    """('c'|'b', major) -> driver name, from /proc/devices."""
    out: dict[tuple[str, int], str] = {}
    kind = ""
    try:
        text = (proc / "devices").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("Character"):
            kind = "c"
        elif line.startswith("Block"):
            kind = "b"
        elif kind and (parts := line.split()) and len(parts) == 2 and parts[0].isdigit():
            out.setdefault((kind, int(parts[0])), parts[1])
    return out


def device_allow(rule: str, names: dict[tuple[str, int], str]) -> str:
    """A cgroup v1 rule ('c 195:0 rwm', 'c 136:* rwm') as a DeviceAllow= value.

    A single node becomes /dev/char/MAJ:MIN, which systemd parses without stat()ing it; a
    whole major becomes char-NAME (its /proc/devices name), which is how systemd spells it."""
    kind, numbers, access = rule.split()
    major, minor = numbers.split(":")
    base = "char" if kind == "c" else "block"
    if not major.isdigit():
        # A named (dynamic) major such as nvidia-uvm: systemd spells it char-NAME, for the whole
        # major (nvidia-uvm's minors are uvm and uvm-tools, which GPU environments get both).
        return f"{base}-{major} {access}"
    if minor == "*":
        name = names.get((kind, int(major)))
        if name is None:
            raise HostError(f"map device rule '{rule}': major {major} is not in /proc/devices, "
                            "and systemd's DeviceAllow= names a whole major only by that name")
        return f"{base}-{name} {access}"
    return f"/dev/{base}/{major}:{minor} {access}"


# ---------------------------------------------------------------- the adapter


class Systemd:
    """Environments' slices through systemctl: unit files in `unit_dir`, properties read back."""

    def __init__(self, layout: CgroupLayout, parent: str = DEFAULT_PARENT, *,
                 unit_dir: Path = UNIT_DIR, control_dir: Path = CONTROL_DIR,
                 systemctl: Sequence[str] = ("systemctl",), busctl: Sequence[str] = ("busctl",),
                 proc: Path = Path("/proc"), dev: Path = Path("/dev"),
                 runner: Runner | None = None, kill_grace: float = KILL_GRACE):
        self.lay = layout
        self.parent = parent
        self.unit_dir = unit_dir
        self.control_dir = control_dir
        self.systemctl = list(systemctl)
        self.busctl = list(busctl)
        self.proc = proc
        self.dev = dev
        self.runner = runner or _run
        self.kill_grace = kill_grace

    @classmethod
    def from_env(cls, *, proc_root: Path = Path("/proc")) -> Systemd:
        """The real host; ENVCTL_SYSTEMCTL (shlex-split argv) points tests at a fake."""
        env = os.environ
        root = Path(env.get("ENVCTL_CGROUP_ROOT", DEFAULT_ROOT))
        return cls(detect_layout(proc_root=proc_root, root=root),
                   env.get("ENVCTL_CGROUP_PARENT", DEFAULT_PARENT),
                   unit_dir=Path(env.get("ENVCTL_SYSTEMD_UNIT_DIR", UNIT_DIR)),
                   systemctl=shlex.split(env.get("ENVCTL_SYSTEMCTL", "systemctl")),
                   proc=proc_root, kill_grace=kill_grace_from_env())

    def for_parent(self, parent: str) -> Systemd:
        """This adapter with another parent: the one a resource recorded ("" = this one)."""
        if not parent or parent == self.parent:
            return self
        other = copy.copy(self)
        other.parent = parent
        return other

    # -- names
    @property
    def parent_unit(self) -> str:
        return parent_slice(self.parent)

    def unit(self, env: str) -> str:
        return env_slice(env, self.parent)

    def cgroup(self, env: str) -> str:
        return slice_cgroup(env, self.parent)

    def unit_path(self, unit: str) -> Path:
        return self.unit_dir / unit

    # -- systemctl
    def stopping(self) -> bool:
        """Whether systemd is shutting the host down (`systemctl is-system-running` says
        "stopping"); False when it cannot say."""
        try:
            res = self.runner([*self.systemctl, "is-system-running"])
        except (OSError, subprocess.SubprocessError):
            return False
        return res.stdout.strip() == "stopping"

    def _ctl(self, action: str, unit: str, *args: str,
             ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess:
        argv = [*self.systemctl, *args]
        try:
            res = self.runner(argv)
        except OSError as exc:
            raise HostError(f"{action} slice '{unit}': {argv[0]}: {exc.strerror}") from exc
        if res.returncode not in ok:
            cause = (res.stderr or res.stdout or "").strip().splitlines()
            raise HostError(f"{action} slice '{unit}': systemctl {' '.join(args)}: "
                            f"{cause[-1] if cause else f'exit status {res.returncode}'}")
        return res

    def show(self, unit: str, keys: Iterable[str]) -> dict[str, list[str]]:
        """`systemctl show -p K1,K2 UNIT`: key -> its values (DeviceAllow has several)."""
        res = self._ctl("check", unit, "show", "-p", ",".join(keys), "--", unit)
        out: dict[str, list[str]] = {}
        for line in res.stdout.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                out.setdefault(key, []).append(value)
        return out

    def state(self, unit: str, settings: Iterable[str] = ()) -> dict[str, str]:
        """LoadState, ActiveState, FragmentPath and each setting, normalised (see have_value)."""
        keys = {s: show_key(s) for s in settings}
        raw = self.show(unit, ["LoadState", "ActiveState", "FragmentPath", *keys.values()])
        out = {k: (raw.get(k) or [""])[-1] for k in ("LoadState", "ActiveState", "FragmentPath")}
        for setting, key in keys.items():
            values = raw.get(key, [])
            if setting == "DeviceAllow":
                out[setting] = _device_set(values)
            else:
                out[setting] = have_value(setting, values[-1] if values else "")
        return out

    def read_unit(self, unit: str) -> str | None:
        try:
            return self.unit_path(unit).read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HostError(f"check slice '{unit}': read {self.unit_path(unit)}: "
                            f"{exc.strerror}") from exc

    def write_unit(self, unit: str, text: str) -> bool:
        """Write the unit file when its content differs (atomically); True when it changed."""
        if self.read_unit(unit) == text:
            return False  # already so
        path = self.unit_path(unit)
        tmp = path.with_name(f".{unit}.envctl-tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            tmp.replace(path)
        except OSError as exc:
            raise HostError(f"create slice '{unit}': write {path}: {exc.strerror}") from exc
        return True

    def daemon_reload(self, unit: str) -> None:
        self._ctl("load", unit, "daemon-reload")

    def start(self, unit: str) -> None:
        self._ctl("start", unit, "start", "--", unit)

    def set_property(self, unit: str, assignments: Sequence[str]) -> None:
        """`systemctl set-property --runtime`: takes effect now, gone at reboot."""
        self._ctl("set", unit, "set-property", "--runtime", "--", unit, *assignments)

    def ensure_slice(self, unit: str, text: str) -> None:
        """The unit file says `text`, systemd has loaded it and the slice is active."""
        if self.write_unit(unit, text):
            self.daemon_reload(unit)
        self.start(unit)

    def foreign(self, unit: str) -> str:
        """Why slice `unit` is not envctl's to take ("" when it is, or is not there): it has
        a unit file envctl did not write (here, or in /etc, which comes first), or it is
        running without envctl's unit file (started by somebody, `systemd-run --slice=`).
        An operator's drop-ins in /etc for an envctl slice are no reason: they are kept."""
        text = self.read_unit(unit)
        path = self.unit_path(unit)
        if text is not None and not text.startswith(HEADER):
            return f"slice {unit} has a unit file envctl did not write: {path}"
        state = self.state(unit)
        fragment = state["FragmentPath"]
        if fragment not in ("", str(path)):
            return f"slice {unit} is defined by {fragment}, a unit file envctl did not write"
        if text is None and state["ActiveState"] not in ("inactive", "failed", ""):
            return f"slice {unit} is {state['ActiveState']} and envctl did not start it"
        return ""

    def remove_slice(self, unit: str, cgroup: str | None = None, *,
                     properties: Iterable[str] = ()) -> None:
        """Stop the slice (its processes first, with the grace period), then delete its unit
        file and the runtime drop-ins of `properties` (those envctl's own `set-property
        --runtime` writes); a slice already gone counts as removed."""
        if cgroup is not None:
            self.kill(unit, cgroup)
        # EXIT_NOT_LOADED: no such unit any more, nothing to stop.
        self._ctl("remove", unit, "stop", "--", unit, ok=(0, EXIT_NOT_LOADED))
        changed = self._unlink(unit, self.unit_path(unit))
        # Not `systemctl revert`: it deletes every drop-in, an operator's in /etc included.
        # set-property --runtime keeps each property in its own 50-NAME.conf here.
        dropins = self.control_dir / f"{unit}.d"
        for name in properties:
            changed |= self._unlink(unit, dropins / f"50-{name}.conf")
        try:
            dropins.rmdir()
        except FileNotFoundError:
            pass  # ENOENT: there were none
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:  # somebody else's drop-ins stay, and the dir
                raise HostError(f"remove slice '{unit}': rmdir {dropins}: "
                                f"{exc.strerror}") from exc
        if changed:
            self.daemon_reload(unit)

    def _unlink(self, unit: str, path: Path) -> bool:
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False  # ENOENT: already gone
        except OSError as exc:
            raise HostError(f"remove slice '{unit}': unlink {path}: {exc.strerror}") from exc

    def remove_unit_file(self, unit: str) -> None:
        """Delete the unit file envctl wrote for a slice it does not own (one that was active
        before), leaving the slice running; reload so that systemd forgets the file. A file
        envctl did not write (no header) is left alone; already gone is success."""
        text = self.read_unit(unit)
        if text is None or not text.startswith(HEADER):
            return
        path = self.unit_path(unit)
        try:
            path.unlink()
        except FileNotFoundError:
            return  # ENOENT: gone meanwhile
        except OSError as exc:
            raise HostError(f"remove slice '{unit}': unlink {path}: {exc.strerror}") from exc
        self.daemon_reload(unit)

    # -- processes
    def _dirs(self, cgroup: str) -> list[Path]:
        mounts = [self.lay.unified] if self.lay.unified else []
        mounts += sorted(set(self.lay.v1.values()))
        return [Path(m) / cgroup for m in mounts if m]

    def procs(self, cgroup: str) -> set[int]:
        """Every process in the slice's cgroup or below (its scopes and services)."""
        pids: set[int] = set()
        for top in self._dirs(cgroup):
            if not top.is_dir():
                continue
            # os.walk, not rglob: scopes vanish while we look (their last process exits and
            # systemd removes them), and os.walk skips a directory that is gone.
            for dirpath, _, _ in os.walk(top):
                pids |= read_procs(Path(dirpath))
        return pids

    def kill(self, unit: str, cgroup: str, *, grace: float | None = None) -> None:
        """SIGTERM everything in the slice, wait up to the grace period, then SIGKILL until it
        is empty (KILL_DEADLINE) — the cgroupfs driver's semantics, by signals, not cgroupfs.
        Each process is signalled through a pidfd once /proc says it is in the slice, so no
        signal reaches a process that took over a pid read from cgroup.procs."""
        grace = self.kill_grace if grace is None else grace
        if not self.procs(cgroup):
            return
        self._signal(cgroup, (signal.SIGTERM, signal.SIGCONT))
        if self._wait_empty(cgroup, grace):
            return
        deadline = time.monotonic() + KILL_DEADLINE
        while True:
            self._signal(cgroup, (signal.SIGKILL,))
            if self._wait_empty(cgroup, min(1.0, deadline - time.monotonic())):
                return
            if time.monotonic() > deadline:
                raise HostError(f"remove slice '{unit}': kill processes: "
                                f"{sorted(self.procs(cgroup))} still running "
                                f"{KILL_DEADLINE:g} s after SIGKILL")

    def _signal(self, cgroup: str, sigs: tuple[int, ...]) -> None:
        signal_members(self.procs(cgroup), sigs,
                       lambda pid: in_cgroup(pid, f"/{cgroup}"))

    def _wait_empty(self, cgroup: str, timeout: float) -> bool:
        # On a v2 host the slice's cgroup.events says when its subtree is empty.
        events = Path(self.lay.unified or "/nonexistent") / cgroup / "cgroup.events"
        if not self.lay.v1 and events.exists():
            return wait_unpopulated(events, timeout)
        return wait_for(lambda: not self.procs(cgroup), timeout)

    def run_argv(self, env: str, argv: Sequence[str], *, unit: str | None = None) -> list[str]:
        """The argv that runs `argv` inside the environment's slice, in a transient scope
        (`systemd-run --scope` execs it in the foreground: its exit status is the command's)."""
        extra = [f"--unit={unit}"] if unit else []
        return ["systemd-run", "--quiet", "--scope", "--collect", f"--slice={self.unit(env)}",
                *extra, "--", *argv]

    def attach(self, env: str, pid: int, *, timeout: float = 10.0) -> str:
        """Move running process `pid` into the environment's slice as a transient scope
        (envctl.host.scope); returns the scope's name."""
        from envctl.host.scope import ScopeError, attach_scope

        unit = self.unit(env)
        try:
            return attach_scope(unit, self.cgroup(env), pid, busctl=self.busctl,
                                proc=str(self.proc), v1_mounts=self.lay.v1,
                                runner=self.runner, timeout=timeout)
        except ScopeError as exc:
            raise HostError(f"attach to slice '{unit}': {exc}") from None

    # -- /dev/char links
    def char_link(self, major: int, minor: int) -> Path:
        return self.dev / "char" / f"{major}:{minor}"

    def char_node(self, major: int, minor: int) -> str | None:
        """Where /dev/char/MAJ:MIN should point ("../nvidia0"): the first character device
        with those numbers under /dev; None when there is none."""
        skip = {"char", "block", "fd", "pts", "shm", "mqueue", "hugepages", "disk"}
        for dirpath, dirnames, filenames in os.walk(self.dev):
            rel = os.path.relpath(dirpath, self.dev)
            if rel == ".":
                dirnames[:] = [d for d in dirnames if d not in skip]
            dirnames.sort()
            for name in sorted(filenames):
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue  # gone meanwhile
                if stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev),
                                                 os.minor(st.st_rdev)) == (major, minor):
                    return os.path.normpath(os.path.join("..", rel, name))
        return None

    def read_char_link(self, major: int, minor: int) -> CharLinkFact:
        """What is at /dev/char/MAJ:MIN (see CharLinkFact)."""
        path = self.char_link(major, minor)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return CharLinkFact("missing")
        except OSError as exc:
            raise HostError(f"check device link '{path}': lstat: {exc.strerror}") from exc
        try:
            target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
        except FileNotFoundError:
            return CharLinkFact("missing")  # ENOENT: removed since the lstat
        try:
            st = os.stat(path)
            right = stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev),
                                                  os.minor(st.st_rdev)) == (major, minor)
        except OSError:
            right = False  # ENOENT / ELOOP: a dangling link
        if right:
            return CharLinkFact("ok", target)
        if target is not None:
            return CharLinkFact("wrong", target)
        what = {stat.S_IFDIR: "a directory", stat.S_IFREG: "a regular file",
                stat.S_IFCHR: "another character device", stat.S_IFBLK: "a block device"}
        return CharLinkFact("foreign", detail=f"{path} is "
                            f"{what.get(stat.S_IFMT(st.st_mode), 'not a link')}")

    def set_char_link(self, major: int, minor: int, target: str) -> None:
        """Point /dev/char/MAJ:MIN at `target`, replacing a link that is there (renamed over
        it, so the path never goes missing meanwhile)."""
        path = self.char_link(major, minor)
        tmp = path.with_name(f".{path.name}.envctl-tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()  # ENOENT: no leftover of an interrupted run
            tmp.symlink_to(target)
            tmp.replace(path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()  # best effort: the error below is the one to report
            raise HostError(f"create device link '{path}': symlink to {target}: "
                            f"{exc.strerror}") from exc

    def remove_char_link(self, major: int, minor: int, *, expect: str) -> None:
        """Remove /dev/char/MAJ:MIN if it is a link to `expect`; already gone is success."""
        path = self.char_link(major, minor)
        try:
            if os.readlink(path) != expect:
                return  # repointed since: somebody else's now
            path.unlink()
        except FileNotFoundError:
            pass  # ENOENT: already gone
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return  # EINVAL from readlink: not a link (any more): not envctl's
            raise HostError(f"remove device link '{path}': unlink: {exc.strerror}") from exc

    # -- /dev/char links of journals from before the cgroup-char-link steps, which kept the
    # links a slice made in the slice's memo ("char_links": link -> target)
    def char_links_to_remove(self, made: dict[str, str], *, unit: str) -> list[str]:
        """Of the links envctl made (`made`), those it may remove as slice `unit` goes: still
        pointing where envctl set them, and allowed by no other slice of envctl's."""
        out = []
        for link, target in made.items():
            try:
                if os.readlink(link) != target:
                    continue  # repointed since: somebody else's now
            except OSError:
                continue  # ENOENT / EINVAL: gone, or no longer a link
            if not self._allowed_elsewhere(Path(link).name, unit):
                out.append(link)
        return out

    def _allowed_elsewhere(self, numbers: str, unit: str) -> bool:
        """Whether another unit file of envctl's still allows /dev/char/`numbers` (systemd
        resolves DeviceAllow= paths again at every daemon-reload)."""
        try:
            others = [p for p in self.unit_dir.iterdir() if p.name != unit]
        except FileNotFoundError:
            return False
        for path in others:
            try:
                text = path.read_text()
            except OSError:
                continue  # gone meanwhile, or not a file
            if text.startswith(HEADER) and f"DeviceAllow=/dev/char/{numbers} " in text:
                return True
        return False

    def remove_char_links(self, made: dict[str, str], *, unit: str) -> None:
        """Remove the /dev/char links envctl made for slice `unit` (see char_links_to_remove);
        already gone is success."""
        for link in self.char_links_to_remove(made, unit=unit):
            try:
                os.unlink(link)
            except FileNotFoundError:
                pass  # ENOENT: already gone
            except OSError as exc:
                raise HostError(f"remove device link '{link}': unlink: {exc.strerror}") from exc


@dataclass(frozen=True)
class CharLinkFact:
    """What is at /dev/char/MAJ:MIN: "missing"; "ok" (it resolves to the character device
    with those numbers: a link, `target`, or the node itself, target None); "wrong" (a link
    to `target` that does not: dangling, or another device); "foreign" (something else that
    is not a link, `detail` says what)."""

    state: str
    target: str | None = None
    detail: str = ""


