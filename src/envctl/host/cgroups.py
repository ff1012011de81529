"""Cgroups through cgroupfs: layout detection, envctl's directories in each hierarchy, limits,
attaching processes, usage stats and teardown, on v1, hybrid and v2 hosts."""

from __future__ import annotations

import errno
import os
import select
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from envctl.errors import HostError
from envctl.facts import DEFAULT_PARENT, V2_CONTROLLERS, CgroupFacts
from envctl.spec.units import format_cpu_list, parse_cpu_list

DEFAULT_ROOT = Path("/sys/fs/cgroup")
# v1 hierarchies an environment's cgroup lives in (those mounted). The freezer limits nothing:
# it lets teardown stop every process at once, so that none forks while the others are killed.
V1_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "blkio", "pids", "devices", "freezer")
# How long teardown waits for processes to go after SIGTERM (ENVCTL_KILL_GRACE overrides it),
# and after SIGKILL before it gives up.
KILL_GRACE = 5.0
KILL_DEADLINE = 10.0
# Values above this read back from a limit file mean "no limit" (v1 prints PAGE_COUNTER_MAX).
_UNLIMITED_FLOOR = 2**62
PAGE = 4096


# ---------------------------------------------------------------- layout (read-only)


@dataclass(frozen=True)
class CgroupLayout:
    """Where the hierarchies are mounted: v1 controller -> mount point, and the cgroup2 mount."""

    v1: dict[str, str] = field(default_factory=dict)
    unified: str | None = None
    v2_controllers: frozenset[str] = frozenset()

    @property
    def layout(self) -> str:
        """'v1' (no cgroup2), 'hybrid' (both), 'v2' (cgroup2 only) or 'none'."""
        if self.v1:
            return "hybrid" if self.unified else "v1"
        return "v2" if self.unified else "none"

    @property
    def version(self) -> int:
        """The version resource controllers are driven through: 1 when any of them is on v1."""
        if any(c in self.v1 for c in ("cpu", "memory", "pids", "cpuset")):
            return 1
        return 2 if self.unified else 0

    def controllers(self) -> tuple[str, ...]:
        """Resource controllers usable by the driver, in the version it uses."""
        if self.version == 1:
            return tuple(c for c in V1_CONTROLLERS if c in self.v1)
        return tuple(c for c in V2_CONTROLLERS if c in self.v2_controllers)


def parse_mountinfo(text: str) -> list[tuple[str, str, str, str]]:
    """(fstype, mount point, root, super options) of every cgroup/cgroup2 mount."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        mnt = fields[4].replace("\\040", " ")
        out.append((tail[0], mnt, fields[3], tail[2]))
    return out


def detect_layout(*, proc_root: Path = Path("/proc"), root: Path = DEFAULT_ROOT) -> CgroupLayout:
    """The cgroup mounts at or below `root`, from mountinfo; the first mount of each wins."""
    try:
        text = (proc_root / "self/mountinfo").read_text()
    except OSError:
        text = ""
    base = str(root).rstrip("/") or "/"
    v1: dict[str, str] = {}
    unified = None
    for fstype, mnt, mroot, opts in parse_mountinfo(text):
        if not (mnt == base or mnt.startswith(base.rstrip("/") + "/")) or mroot != "/":
            continue  # another tree, or a bind of a sub-cgroup (inside a container)
        if fstype == "cgroup2":
            unified = unified or mnt
            continue
        for opt in opts.split(","):
            if opt in V1_CONTROLLERS or opt in ("freezer", "hugetlb", "net_cls", "perf_event"):
                v1.setdefault(opt, mnt)
    ctrls: frozenset[str] = frozenset()
    if unified:
        try:
            ctrls = frozenset((Path(unified) / "cgroup.controllers").read_text().split())
        except OSError:
            ctrls = frozenset()
    return CgroupLayout(v1, unified, ctrls)


def read_cgroup_facts(*, proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys"),
                      root: Path | None = None) -> CgroupFacts:
    root = root or Path(os.environ.get("ENVCTL_CGROUP_ROOT", DEFAULT_ROOT))
    lay = detect_layout(proc_root=proc_root, root=root)
    schedulers = _schedulers(sys_root)
    bfq = tuple(sorted(d for d, s in schedulers.items() if "[bfq]" in s))
    bfq_known = any("bfq" in s for s in schedulers.values())
    swap, io_weight, cpus, mems = False, "", "", ""
    if lay.version == 1:
        mem = Path(lay.v1.get("memory", "/nonexistent"))
        swap = (mem / "memory.memsw.limit_in_bytes").exists()
        blk = Path(lay.v1.get("blkio", "/nonexistent"))
        if (blk / "blkio.weight").exists():
            io_weight = "blkio.weight"
        elif (blk / "blkio.bfq.io_service_bytes").exists():
            io_weight = "blkio.bfq.weight"
        cs = Path(lay.v1.get("cpuset", "/nonexistent"))
        cpus = _read_text(cs / "cpuset.cpus")
        mems = _read_text(cs / "cpuset.mems")
    elif lay.version == 2:
        u = Path(lay.unified or "/nonexistent")
        # memory.swap.max is not on the root; CONFIG_SWAP shows as memory.swap.* stats in
        # any child, and as /proc/swaps here.
        swap = (proc_root / "swaps").exists()
        if (u / "io.cost.qos").exists():
            io_weight = "io.weight"
        elif bfq_known:
            io_weight = "io.bfq.weight"
    return CgroupFacts(layout=lay.layout, version=lay.version, controllers=lay.controllers(),
                       swap=swap, io_weight=io_weight, bfq_devices=bfq,
                       systemd=_read_text(proc_root / "1/comm") == "systemd", cpus=cpus,
                       mems=mems, default_driver=_default_driver(),
                       parent=os.environ.get("ENVCTL_CGROUP_PARENT", DEFAULT_PARENT))


def _default_driver() -> str:
    value = os.environ.get("ENVCTL_CGROUP_DRIVER", "").strip()
    return "" if value == "auto" else value


def _schedulers(sys_root: Path) -> dict[str, str]:
    out = {}
    block = sys_root / "block"
    try:
        names = sorted(os.listdir(block))
    except OSError:
        return out
    for name in names:
        text = _read_text(block / name / "queue/scheduler")
        if text:
            out[name] = text
    return out


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# ---------------------------------------------------------------- values


def normalize(file: str, text: str) -> str:
    """Compare cgroup values the way the kernel means them (lists, page rounding, 'max')."""
    text = text.strip()
    if file.endswith(("cpuset.cpus", "cpuset.mems")):
        return format_cpu_list(parse_cpu_list(text)) if text else ""
    if text.startswith("default "):  # io.weight / io.bfq.weight: the default line
        text = text.split("\n")[0].split()[1]
    if text in ("-1", "max"):
        return "max"
    if text.lstrip("-").isdigit():
        n = int(text)
        if n >= _UNLIMITED_FLOOR:
            return "max"
        if file.startswith("memory.") and "limit" in file or file in (
                "memory.max", "memory.high", "memory.low", "memory.swap.max"):
            return str(n // PAGE * PAGE)
        return str(n)
    return " ".join(text.split())


@dataclass(frozen=True)
class Stats:
    """Usage of one environment's cgroup; None where this host does not count it."""

    version: int
    cpu_usage_us: int | None = None
    # The same CPU time split as sacct's UserCPU / SystemCPU (v2 cpu.stat user_usec and
    # system_usec; v1 cpuacct.usage_user / usage_sys, else cpuacct.stat's clock ticks).
    cpu_user_us: int | None = None
    cpu_system_us: int | None = None
    nr_periods: int | None = None
    nr_throttled: int | None = None
    throttled_us: int | None = None
    memory_current: int | None = None
    memory_peak: int | None = None
    oom_kills: int | None = None
    pids_current: int | None = None

    def to_json(self) -> dict[str, int | None]:
        return dict(vars(self))


def _kv(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


# ---------------------------------------------------------------- the adapter


class Cgroups:
    """envctl's cgroups: `<root>/<parent>/<env>` in each hierarchy the driver uses."""

    def __init__(self, layout: CgroupLayout, parent: str = DEFAULT_PARENT, *,
                 kill_grace: float = KILL_GRACE):
        self.lay = layout
        self.parent = parent
        self.kill_grace = kill_grace

    @classmethod
    def from_env(cls, *, proc_root: Path = Path("/proc")) -> Cgroups:
        root = Path(os.environ.get("ENVCTL_CGROUP_ROOT", DEFAULT_ROOT))
        return cls(detect_layout(proc_root=proc_root, root=root),
                   os.environ.get("ENVCTL_CGROUP_PARENT", DEFAULT_PARENT),
                   kill_grace=kill_grace_from_env())

    def for_parent(self, parent: str) -> Cgroups:
        """This adapter with another parent: the one a resource recorded ("" = this one)."""
        if not parent or parent == self.parent:
            return self
        return Cgroups(self.lay, parent, kill_grace=self.kill_grace)

    @property
    def version(self) -> int:
        return self.lay.version

    # -- paths
    def _mounts(self, controllers: tuple[str, ...] | None = None) -> dict[str, Path]:
        """controller -> mount point for the hierarchies used (v2: one, keyed by '')."""
        if self.version == 2:
            return {"": Path(self.lay.unified or "")}
        wanted = controllers if controllers is not None else self.lay.controllers()
        return {c: Path(self.lay.v1[c]) for c in wanted if c in self.lay.v1}

    def dirs(self, env: str | None = None, controllers: tuple[str, ...] | None = None
             ) -> list[Path]:
        """The directories of the parent (env None) or an environment, one per hierarchy."""
        seen: list[Path] = []
        for mnt in self._mounts(controllers).values():
            p = mnt / self.parent if env is None else mnt / self.parent / env
            if p not in seen:
                seen.append(p)
        return seen

    def path(self, env: str, controller: str, file: str = "") -> Path:
        mnt = self._mounts()[""] if self.version == 2 else Path(self.lay.v1[controller])
        p = mnt / self.parent / env
        return p / file if file else p

    def present(self, env: str | None, controllers: tuple[str, ...] | None = None) -> list[bool]:
        return [d.is_dir() for d in self.dirs(env, controllers)]

    # -- reading and writing files
    def read(self, env: str, controller: str, file: str) -> str | None:
        """A file's content, or None when this cgroup or file does not exist."""
        try:
            return self.path(env, controller, file).read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HostError(f"read cgroup '{env}': {file}: {exc.strerror}") from exc

    def write(self, env: str, controller: str, file: str, value: str) -> None:
        p = self.path(env, controller, file)
        try:
            _write(p, value)
        except OSError as exc:
            raise HostError(f"set cgroup '{env}': write {value!r} to {p}: "
                            f"{exc.strerror}") from exc

    # -- the parent
    def ensure_parent(self) -> None:
        """Make the parent in every hierarchy; v1 cpusets get the root's CPUs and nodes (an
        empty cpuset takes no task), v2 parents delegate the controllers to their children."""
        for d in self.dirs():
            try:
                d.mkdir(exist_ok=True)
            except OSError as exc:
                raise HostError(f"create cgroup '{self.parent}': mkdir {d}: "
                                f"{exc.strerror}") from exc
        if self.version == 1 and "cpuset" in self.lay.v1:
            mnt = Path(self.lay.v1["cpuset"])
            for f in ("cpuset.cpus", "cpuset.mems"):
                if not (mnt / self.parent / f).read_text().strip():
                    self._parent_write(mnt / self.parent / f, (mnt / f).read_text().strip())
        if self.version == 2:
            want = self._v2_wanted()
            for _, d in self._delegating():
                have = set((d / "cgroup.subtree_control").read_text().split())
                missing = [c for c in want if c not in have]
                if missing:
                    self._parent_write(d / "cgroup.subtree_control",
                                       " ".join(f"+{c}" for c in missing))

    def _v2_wanted(self) -> list[str]:
        return [c for c in V2_CONTROLLERS if c in self.lay.v2_controllers]

    def _delegating(self) -> list[tuple[str, Path]]:
        """v2: the cgroups whose subtree_control ensure_parent writes, root first."""
        root = Path(self.lay.unified or "")
        return [("root", root), ("parent", root / self.parent)]

    def delegation(self) -> dict[str, list[str]]:
        """v2: the controllers already enabled in the root's and the parent's
        cgroup.subtree_control (none for a parent not there yet), as `ensure_parent` finds
        them, for `restore_delegation`; v1: {}."""
        if self.version != 2:
            return {}
        out: dict[str, list[str]] = {}
        for name, d in self._delegating():
            try:
                out[name] = sorted((d / "cgroup.subtree_control").read_text().split())
            except FileNotFoundError:
                out[name] = []
            except OSError as exc:
                raise HostError(f"check cgroup '{self.parent}': read {d}/cgroup.subtree_control"
                                f": {exc.strerror}") from exc
        return out

    def restore_delegation(self, before: dict[str, list[str]]) -> None:
        """Disable, in each subtree_control `before` names, the controllers ensure_parent
        enables that were not enabled before (never one somebody else had enabled); the
        parent first, then the root; a cgroup that is gone is skipped."""
        if self.version != 2:
            return
        for name, d in reversed(self._delegating()):
            if name not in before:
                continue
            f = d / "cgroup.subtree_control"
            try:
                have = set(f.read_text().split())
            except FileNotFoundError:
                continue  # the parent went with rmdir, and its subtree_control with it
            except OSError as exc:
                raise HostError(f"remove cgroup '{self.parent}': read {f}: "
                                f"{exc.strerror}") from exc
            # One controller per write: the kernel refuses a whole write when any of it is busy.
            for c in reversed([c for c in self._v2_wanted() if c in have
                               and c not in before[name]]):
                try:
                    _write(f, f"-{c}")
                except OSError as exc:
                    if exc.errno == errno.EBUSY:
                        # Another user's cgroup below this one enabled the controller in its
                        # own subtree_control since: it relies on it, so it stays enabled.
                        # (Leaf cgroups do not show up this way: they lose the controller.)
                        continue
                    raise HostError(f"remove cgroup '{self.parent}': write '-{c}' to {f}: "
                                    f"{exc.strerror}") from exc

    def parent_ready(self) -> bool:
        """v1: the parent's cpuset has CPUs and nodes; v2: it delegates the controllers."""
        try:
            if self.version == 1 and "cpuset" in self.lay.v1:
                d = Path(self.lay.v1["cpuset"]) / self.parent
                return all((d / f).read_text().strip() for f in ("cpuset.cpus", "cpuset.mems"))
            if self.version == 2:
                d = Path(self.lay.unified or "") / self.parent
                have = set((d / "cgroup.subtree_control").read_text().split())
                return {c for c in V2_CONTROLLERS if c in self.lay.v2_controllers} <= have
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise HostError(f"check cgroup '{self.parent}': {exc.strerror}") from exc
        return True

    def _parent_write(self, p: Path, value: str) -> None:
        try:
            _write(p, value)
        except OSError as exc:
            raise HostError(f"create cgroup '{self.parent}': write {value!r} to {p}: "
                            f"{exc.strerror}") from exc

    def remove_parent(self, *, keep: Iterable[str] = ()) -> None:
        """Remove the parent in every hierarchy but those in `keep` (paths of directories that
        were there before envctl); gone already is success."""
        keep = set(keep)
        for d in self.dirs():
            if str(d) in keep:
                continue
            try:
                _rmdir(d)
            except FileNotFoundError:
                pass  # already gone
            except OSError as exc:
                raise HostError(f"remove cgroup '{self.parent}': rmdir {d}: "
                                f"{exc.strerror}") from exc

    def parent_cpuset(self) -> dict[str, str] | None:
        """v1: the parent's cpuset.cpus and cpuset.mems as they are (None: no v1 cpuset
        hierarchy, or no parent in it)."""
        if self.version != 1 or "cpuset" not in self.lay.v1:
            return None
        d = Path(self.lay.v1["cpuset"]) / self.parent
        try:
            return {f: (d / f).read_text().strip() for f in ("cpuset.cpus", "cpuset.mems")}
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HostError(f"check cgroup '{self.parent}': read {d}: {exc.strerror}") from exc

    def restore_parent_cpuset(self, before: dict[str, str]) -> None:
        """Empty again the cpuset files ensure_parent filled in a parent that was there
        before envctl (it writes only empty ones); a value someone set since is left alone."""
        now = self.parent_cpuset()
        if now is None:
            return  # the parent is gone
        d = Path(self.lay.v1["cpuset"]) / self.parent
        for f in ("cpuset.cpus", "cpuset.mems"):
            if before.get(f) != "" or not now[f]:
                continue  # not filled by envctl, or empty already
            try:
                _write(d / f, "\n")  # a write of nothing changes nothing: an empty line does
            except OSError as exc:
                if exc.errno in (errno.EBUSY, errno.ENOSPC):
                    # A child cgroup (EBUSY) or a task (ENOSPC) of somebody else's uses these
                    # CPUs or nodes now: they stay, as for controller delegation.
                    continue
                raise HostError(f"remove cgroup '{self.parent}': write '' to {d / f}: "
                                f"{exc.strerror}") from exc

    # -- an environment
    def create(self, env: str, controllers: tuple[str, ...]) -> None:
        for d in self.dirs(env, controllers):
            try:
                d.mkdir(exist_ok=True)
            except OSError as exc:
                raise HostError(f"create cgroup '{env}': mkdir {d}: {exc.strerror}") from exc

    def subtree(self, env: str, controllers: tuple[str, ...] | None = None) -> list[Path]:
        """The environment's cgroup and every cgroup below it (made by its processes: podman,
        `systemd --user`, a job that moved itself), in each hierarchy, deepest first."""
        out: list[Path] = []
        for top in self.dirs(env, controllers):
            # os.walk, not rglob: sub-cgroups vanish while we look, and os.walk skips those.
            out += [Path(d) for d, _, _ in os.walk(top, topdown=False)]
        return out

    def procs(self, env: str, controllers: tuple[str, ...] | None = None) -> set[int]:
        """Every process in the environment's cgroup or below it, in any of its hierarchies."""
        pids: set[int] = set()
        for d in self.subtree(env, controllers):
            pids |= read_procs(d)
        return pids

    def attach(self, env: str, pid: int, controllers: tuple[str, ...] | None = None) -> None:
        """Move `pid` (all its threads) into the environment's cgroup in every hierarchy."""
        freezer = self.lay.v1.get("freezer") if self.version == 1 else None
        for d in self.dirs(env, controllers):
            try:
                _write(d / "cgroup.procs", str(pid))
            except FileNotFoundError as exc:
                if freezer and d.is_relative_to(freezer):
                    # The freezer limits nothing: an environment made before envctl used it
                    # has no cgroup there, and teardown signals its processes one by one.
                    continue
                raise HostError(f"attach to cgroup '{env}': process {pid} into {d}: "
                                f"{exc.strerror}") from exc
            except OSError as exc:
                raise HostError(f"attach to cgroup '{env}': process {pid} into {d}: "
                                f"{exc.strerror}") from exc

    def kill(self, env: str, controllers: tuple[str, ...] | None = None, *,
             grace: float | None = None) -> None:
        """Stop every process in the environment's subtree: SIGTERM, up to `grace` seconds
        for them to go, then SIGKILL until none is left (an error after KILL_DEADLINE).

        No signal ever reaches a process outside the subtree: v2 kills with cgroup.kill (the
        kernel, atomically; forks cannot escape); otherwise each process is signalled through
        a pidfd once /proc says it is inside (`signal_members`), on v1 with the environment's
        freezer cgroup frozen meanwhile, so that nothing forks or exits while it happens."""
        grace = self.kill_grace if grace is None else grace
        if not self.procs(env, controllers):
            return
        self._signal(env, controllers, (signal.SIGTERM, signal.SIGCONT))
        if self._wait_empty(env, controllers, grace):
            return
        kill_file = self.path(env, "", "cgroup.kill") if self.version == 2 else None
        deadline = time.monotonic() + KILL_DEADLINE
        while True:
            if kill_file is not None and kill_file.exists():
                try:
                    _write(kill_file, "1")  # the whole subtree (Linux >= 5.14)
                except FileNotFoundError:
                    return  # ENOENT: the cgroup went away meanwhile
            else:
                self._signal(env, controllers, (signal.SIGKILL,))
            if self._wait_empty(env, controllers, min(1.0, deadline - time.monotonic())):
                return
            if time.monotonic() > deadline:
                left = sorted(self.procs(env, controllers))
                raise HostError(f"remove cgroup '{env}': kill processes: {left} still running "
                                f"{KILL_DEADLINE:g} s after SIGKILL")

    def _signal(self, env: str, controllers: tuple[str, ...] | None,
                sigs: tuple[int, ...]) -> None:
        rel = f"/{self.parent}/{env}"
        frozen = self._freeze(env, controllers)
        try:
            signal_members(self.procs(env, controllers), sigs,
                           lambda pid: in_cgroup(pid, rel))
        finally:
            if frozen is not None:
                self._thaw(env, frozen)

    def _freeze(self, env: str, controllers: tuple[str, ...] | None) -> Path | None:
        """v1: freeze the environment's freezer cgroup (and everything below it) and wait
        until it is frozen (a task in uninterruptible sleep may hold that up: then go on after
        a while, signals are queued all the same); its freezer.state, or None when there is
        none to freeze."""
        if self.version != 1 or "freezer" not in (controllers or self.lay.controllers()) \
                or "freezer" not in self.lay.v1:
            return None
        state = self.path(env, "freezer", "freezer.state")
        try:
            _write(state, "FROZEN")
        except FileNotFoundError:
            return None  # ENOENT: no freezer cgroup (made before envctl used it), or gone
        except OSError as exc:
            raise HostError(f"remove cgroup '{env}': freeze {state}: {exc.strerror}") from exc
        wait_for(lambda: _read_text(state) in ("FROZEN", ""), 5.0)
        return state

    def _thaw(self, env: str, state: Path) -> None:
        try:
            _write(state, "THAWED")
        except FileNotFoundError:
            pass  # ENOENT: the cgroup went away meanwhile
        except OSError as exc:
            raise HostError(f"remove cgroup '{env}': thaw {state}: {exc.strerror}") from exc

    def _wait_empty(self, env: str, controllers: tuple[str, ...] | None,
                    timeout: float) -> bool:
        """Wait up to `timeout` seconds until no process is left in the subtree: on v2 until
        cgroup.events says `populated 0` (woken by the kernel's notification on that file),
        elsewhere by reading the subtree's cgroup.procs. True when empty."""
        if self.version == 2:
            events = self.path(env, "", "cgroup.events")
            if events.exists():
                return wait_unpopulated(events, timeout)
        return wait_for(lambda: not self.procs(env, controllers), timeout)

    def remove(self, env: str, controllers: tuple[str, ...] | None = None) -> None:
        """Kill what is left inside, then remove the environment's cgroup and every cgroup
        below it, deepest first, in every hierarchy; already gone is success. Its device rules
        (v1 devices.list, a v2 BPF program) go with it, never widened before."""
        self.kill(env, controllers)
        for d in self.subtree(env, controllers):
            try:
                _rmdir(d)
            except FileNotFoundError:
                pass  # ENOENT: already gone
            except OSError as exc:
                raise HostError(f"remove cgroup '{env}': rmdir {d}: {exc.strerror}") from exc

    # -- v1 device rules
    def devices_v1(self, env: str) -> set[str] | None:
        text = self.read(env, "devices", "devices.list")
        if text is None:
            return None
        return {" ".join(line.split()) for line in text.splitlines() if line.strip()}

    def set_devices_v1(self, env: str, rules: tuple[str, ...]) -> None:
        # Deny all first, then allow: at no point does the cgroup allow more than both lists.
        self.write(env, "devices", "devices.deny", "a")
        for rule in rules:
            self.write(env, "devices", "devices.allow", rule)

    # -- stats
    def stats(self, env: str, *, driver: str | None = None) -> Stats:
        """CPU usage, throttling, memory current/peak, OOM kills and pids of one environment.

        `driver` "systemd" reads the environment's slice (`<parent>.slice/<parent>-<env>.slice`,
        see envctl.host.systemd); None reads whichever of the two exists, cgroupfs first."""
        if driver == "systemd" or (driver is None and not any(self.present(env))):
            from envctl.spec.naming import env_slice, parent_slice

            sliced = Cgroups(self.lay, parent_slice(self.parent))
            if driver == "systemd" or any(sliced.present(env_slice(env, self.parent))):
                return sliced.stats(env_slice(env, self.parent), driver="cgroupfs")
        rd = self.read
        if self.version == 2:
            cpu = _kv(rd(env, "cpu", "cpu.stat") or "")
            ev = _kv(rd(env, "memory", "memory.events") or "")
            return Stats(2, cpu_usage_us=cpu.get("usage_usec"), cpu_user_us=cpu.get("user_usec"),
                         cpu_system_us=cpu.get("system_usec"), nr_periods=cpu.get("nr_periods"),
                         nr_throttled=cpu.get("nr_throttled"),
                         throttled_us=cpu.get("throttled_usec"),
                         memory_current=_int(rd(env, "memory", "memory.current")),
                         memory_peak=_int(rd(env, "memory", "memory.peak")),
                         oom_kills=ev.get("oom_kill"),
                         pids_current=_int(rd(env, "pids", "pids.current")))
        has = self.lay.v1
        cpu = _kv(rd(env, "cpu", "cpu.stat") or "") if "cpu" in has else {}
        usage = _int(rd(env, "cpuacct", "cpuacct.usage")) if "cpuacct" in has else None
        user_us, system_us = _v1_cpu_split(rd, env) if "cpuacct" in has else (None, None)
        oom = _kv(rd(env, "memory", "memory.oom_control") or "") if "memory" in has else {}
        throttled = cpu.get("throttled_time")
        return Stats(1, cpu_usage_us=None if usage is None else usage // 1000,
                     cpu_user_us=user_us, cpu_system_us=system_us,
                     nr_periods=cpu.get("nr_periods"), nr_throttled=cpu.get("nr_throttled"),
                     throttled_us=None if throttled is None else throttled // 1000,
                     memory_current=_int(rd(env, "memory", "memory.usage_in_bytes"))
                     if "memory" in has else None,
                     memory_peak=_int(rd(env, "memory", "memory.max_usage_in_bytes"))
                     if "memory" in has else None,
                     oom_kills=oom.get("oom_kill"),
                     pids_current=_int(rd(env, "pids", "pids.current")) if "pids" in has else None)


def _v1_cpu_split(rd: Callable[..., str | None], env: str) -> tuple[int | None, int | None]:
    """(user, system) CPU microseconds of a v1 cpuacct group: cpuacct.usage_user/usage_sys
    (nanoseconds, kernel >= 4.7), else cpuacct.stat (USER_HZ clock ticks, coarser)."""
    user, system = _int(rd(env, "cpuacct", "cpuacct.usage_user")), _int(
        rd(env, "cpuacct", "cpuacct.usage_sys"))
    if user is not None and system is not None:
        return user // 1000, system // 1000
    ticks = _kv(rd(env, "cpuacct", "cpuacct.stat") or "")
    if "user" not in ticks or "system" not in ticks:
        return None, None
    hz = os.sysconf("SC_CLK_TCK")
    return ticks["user"] * 1_000_000 // hz, ticks["system"] * 1_000_000 // hz


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None



def kill_grace_from_env() -> float:
    """ENVCTL_KILL_GRACE (seconds between SIGTERM and SIGKILL at teardown), or the default."""
    try:
        grace = float(os.environ.get("ENVCTL_KILL_GRACE", KILL_GRACE))
    except ValueError:
        return KILL_GRACE
    # At most 365 days, as every duration envctl takes (runtime.jobs.MAX_DURATION); nan: none.
    return min(max(0.0, grace), 365 * 86400.0) if grace == grace else KILL_GRACE


def in_cgroup(pid: int, rel: str) -> bool:
    """Whether process `pid` is in cgroup `rel` ("/envctl/x", as /proc/PID/cgroup names it,
    in any hierarchy) or below it. False when it has gone. Always the real /proc: the pid is
    a real one, read from cgroupfs, whatever proc root the host facts come from."""
    try:
        text = Path("/proc", str(pid), "cgroup").read_text()
    except OSError:
        return False  # ENOENT / ESRCH: exited
    return lists_cgroup(text, rel)


def lists_cgroup(text: str, rel: str) -> bool:
    """Whether /proc/PID/cgroup `text` puts the process in `rel` or below, in any hierarchy
    ("/envctl/lim2" is not below "/envctl/lim")."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        if path == rel or path.startswith(rel.rstrip("/") + "/"):
            return True
    return False


def signal_members(pids: Iterable[int], sigs: tuple[int, ...],
                   inside: Callable[[int], bool]) -> int:
    """Send `sigs` to each of `pids` that `inside(pid)` says is in the environment; how many
    were signalled. PIDs are reused: a pid read from cgroup.procs may name another process by
    the time it is signalled. So each is pinned first with a pidfd, then checked, then
    signalled through the pidfd: had the process exited and its pid been reused between the
    pin and the check, the signal would find the pinned process gone (ESRCH), and nobody else
    gets it."""
    sent = 0
    for pid in sorted(pids):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # ESRCH: exited since the list was read
        try:
            if not inside(pid):
                continue  # not (or no longer) ours: the pid was reused, or it moved out
            for sig in sigs:
                signal.pidfd_send_signal(fd, sig)
            sent += 1
        except ProcessLookupError:
            pass  # ESRCH: the pinned process exited meanwhile
        finally:
            os.close(fd)
    return sent


def wait_for(done: Callable[[], bool], timeout: float, *, step: float = 0.02) -> bool:
    """Poll `done` until it holds or `timeout` seconds have passed; whether it holds."""
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        if done():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(step, left))


def wait_unpopulated(events: Path, timeout: float) -> bool:
    """Wait until cgroup.events says `populated 0` (or the cgroup is gone). The kernel
    signals a change of the file as POLLPRI; the re-read every 0.1 s only guards against a
    missed wake-up."""
    deadline = time.monotonic() + max(0.0, timeout)
    try:
        fd = os.open(events, os.O_RDONLY)
    except FileNotFoundError:
        return True  # ENOENT: the cgroup is gone, and its processes with it
    try:
        poller = select.poll()
        poller.register(fd, select.POLLPRI | select.POLLERR)
        while True:
            try:
                text = os.pread(fd, 4096, 0).decode()
            except OSError as exc:
                if exc.errno == errno.ENODEV:
                    return True  # removed while we waited
                raise
            if "populated 0" in text:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller.poll(min(left, 0.1) * 1000)
    finally:
        os.close(fd)


def read_procs(cgroup_dir: Path) -> set[int]:
    """The pids in one cgroup directory; empty when it is not there (ENOENT) or was removed
    while we read it (ENODEV)."""
    try:
        text = (cgroup_dir / "cgroup.procs").read_text()
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENODEV):
            return set()
        raise
    return {int(x) for x in text.split()}


def _write(path: Path, value: str) -> None:
    # One write() per value: cgroupfs parses each write as one command.
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _rmdir(path: Path) -> None:
    # EBUSY right after the last process exited: the kernel still tears the task down.
    deadline = time.monotonic() + 5.0
    while True:
        try:
            os.rmdir(path)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def stats(env: str, *, driver: str | None = None) -> Stats:
    """Usage of environment `env` on this host (for `envctl monitor` and the job system), from
    its cgroupfs cgroup or its systemd slice (`driver`; None: whichever exists)."""
    return Cgroups.from_env().stats(env, driver=driver)
