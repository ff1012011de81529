"""What a launch needs to know of an environment that is up, read from its journal: the rootfs,
the mount namespace holder, the network namespace, the cgroup, its CPUs and GPUs, and the
variables of the rootfs's /etc/environment.

Read from the journal, not the spec: `envctl exec` must not load pydantic, YAML or the planner
(start-up time), and what is up is what the journal recorded, whatever the spec says now.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from pathlib import Path

from envctl.errors import HostError, StateCorrupt, UsageError
from envctl.record import Factory, Record
from envctl.spec.naming import DEFAULT_PARENT

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~5 ms): see record.py
if TYPE_CHECKING:
    from typing import Any

    from envctl.host.context import Host

# <run>/MNT_DIR/ENV holds an environment's mount namespace (envctl.resources.mounts.MNT_DIR).
MNT_DIR = "mnt.d"
# The kinds read here whose objects die with a reboot: entries of another boot are dropped, as
# Journal.open drops them (the rootfs tree is on disk and stays).
_VOLATILE = ("mntns", "netns", "cgroup", "cgroup-slice", "env-dev")
# The journal's format and names (envctl.engine.journal: VERSION, _ENV_NAME).
JOURNAL_VERSION = 1
_ENV_NAME = re.compile(r"[a-z](?:[a-z0-9-]{0,30}[a-z0-9])?")
# Where specs are when ENVCTL_CONFIG_DIR does not say (envctl.workspace.config_dir's order).
SYSTEM_CONFIG_DIR = Path("/etc/envctl/environments")


def config_dir(explicit: str | None = None) -> Path:
    """--config-dir, else $ENVCTL_CONFIG_DIR, else /etc/envctl/environments, else ./configs:
    the one rule (the workspace, completion and a launch's error path read it, none of them
    importing the others)."""
    if explicit:
        return Path(explicit)
    if os.environ.get("ENVCTL_CONFIG_DIR"):
        return Path(os.environ["ENVCTL_CONFIG_DIR"])
    if SYSTEM_CONFIG_DIR.is_dir() or not Path("configs").is_dir():
        return SYSTEM_CONFIG_DIR
    return Path("configs")
# A spec's top-level `name:` line (the error path of a launch reads specs without YAML).
_SPEC_NAME = re.compile(r"""^name:[ \t]*["']?([a-z][a-z0-9-]*)["']?[ \t]*(?:#.*)?$""",
                        re.MULTILINE)
# What an environment without PATH in its /etc/environment gets (the rootfs planner's default).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CLONE_NEWNS = 0x00020000
NS_GET_NSTYPE = 0xB703


class EnvCgroup(Record, frozen=True):
    """The environment's cgroup as `up` made it: `driver` "cgroupfs" (a `cgroup` step: the
    directories `<root>/<parent>/<env>`) or "systemd" (a `cgroup-slice` step: a slice);
    `parent` "" means the parent of this run's adapter (ENVCTL_CGROUP_PARENT)."""

    driver: str
    parent: str
    version: int
    controllers: tuple[str, ...] = ()

    @property
    def parent_name(self) -> str:
        """The parent, "" resolved as the cgroup adapter resolves it."""
        return self.parent or os.environ.get("ENVCTL_CGROUP_PARENT", DEFAULT_PARENT)


class EnvContext(Record, frozen=True):
    """An environment that is up, as a launch enters it."""

    env: str
    root: Path  # the rootfs tree, as the host (and the environment's mount namespace) see it
    mntns: Path  # the holder of its persistent mount namespace: <run>/mnt.d/<env>
    netns: Path | None  # its network namespace (<netns_dir>/<name>), None without a network
    hostname: str
    environ: dict[str, str] = Factory(dict)  # the rootfs's /etc/environment
    cgroup: EnvCgroup | None = None
    cpus: tuple[int, ...] = ()  # its cpuset (dedicated CPUs), or every online CPU
    gpus: tuple[str, ...] = ()  # UUIDs of the GPUs it holds
    # GPU UUID -> the CPUs local to it, as `up` found them (the journal's gpu_cpus).
    gpu_cpus: dict[str, tuple[int, ...]] = Factory(dict)
    # Groups owning the device nodes of its /dev beyond the safe set (its GPUs: mode 0660,
    # group `gpus.group`): every job is a member, so that its GPUs are its jobs' to use.
    device_gids: tuple[int, ...] = ()
    # The capabilities its root jobs keep (the spec's runtime.capabilities); None: the default.
    caps: tuple[str, ...] | None = None
    # How its programs run (the spec's runtime.isolation): "native", or "gvisor" through
    # runsc on `platform` (envctl.runtime.gvisor).
    isolation: str = "native"
    platform: str = ""
    # Its seccomp profile (the spec's runtime.seccomp): "default", "unconfined" or a path;
    # and whether its jobs may create user namespaces (runtime.nested_userns).
    seccomp: str = "default"
    nested_userns: bool = False
    # Its memory limit in bytes (0: none): per-launch tmpfs sizes are a share of it.
    memory_max: int = 0
    # The host uid and gid its root is (the first of its block of user namespace ids, the
    # journal's claims); 0: no user namespace (runtime.userns: false, or isolation: gvisor).
    userns: int = 0
    # Its cgroup's device allow-list as `up` wrote it (the cgroup-devices step's rules, majors
    # possibly named: envctl.host.devices.resolve_rules); (): none recorded.
    device_rules: tuple[str, ...] = ()
    # How many host ids from `userns` on are the environment's (its block, the journal's
    # claims): none of them may be a job's own user or group.
    userns_size: int = 0
    # The spec's jobs.max_output (bytes; 0: unbounded), recorded in the journal's claims when
    # it is not the default (spec.models.DEFAULT_MAX_OUTPUT, repeated here: no pydantic).
    max_output: int = 1 << 30
    # The spec's jobs.max_running and jobs.max_running_per_user (0: unlimited): the queue's.
    max_running: int = 0
    max_running_per_user: int = 0
    # The spec's jobs.max_queued_per_user and jobs.max_staged_per_user (bytes; 0: unbounded),
    # recorded when not the defaults (spec.models.DEFAULT_MAX_QUEUED_PER_USER and
    # DEFAULT_MAX_STAGED_PER_USER, repeated here: no pydantic).
    max_queued_per_user: int = 1000
    max_staged_per_user: int = 10 << 30

    @classmethod
    def load(cls, host: Host, env: str) -> EnvContext:
        """The environment `env` from its journal. UsageError (exit 2) when it is not up or has
        no root filesystem to enter; HostError when its mount namespace is gone (a holder
        unmounted by hand): `envctl up` repairs that."""
        found, claims = read_journal(host.state_dir, env, host.boot_id)
        if "mntns" not in found:
            # No journal, an empty one, or one whose namespaces were of another boot.
            raise _not_up(host, env)
        if "rootfs" not in found:
            raise UsageError(f"environment '{env}' has no root filesystem to run programs in: "
                             "give its spec a rootfs section and run `envctl up` again")
        mntns = host.run_dir / MNT_DIR / env
        _check_holder(env, mntns)
        root = Path(found["rootfs"]["root"])
        netns = found.get("netns")
        gpus = (claims.get("gpus") or {}).get("uuids") or ()
        cgroup, cpus, memory_max = _cgroup(found)
        nodes = (found.get("env-dev") or {}).get("nodes") or ()
        gids = tuple(sorted({int(n[4]) for n in nodes if int(n[4]) != 0}))
        caps = claims.get("capabilities")
        sandbox = claims.get("isolation") or {}
        return cls(env=env, root=root, mntns=mntns,
                   netns=host.netns_dir / netns["name"] if netns else None, hostname=env,
                   environ=read_environment(root), cgroup=cgroup,
                   cpus=cpus or online_cpus(host.sys), gpus=tuple(gpus), device_gids=gids,
                   gpu_cpus={u: tuple(c) for u, c in (claims.get("gpu_cpus") or {}).items()},
                   caps=tuple(caps) if isinstance(caps, list) else None,
                   isolation=sandbox.get("level", "native"),
                   platform=sandbox.get("platform", ""),
                   seccomp=str(claims.get("seccomp") or "default"),
                   nested_userns=bool(claims.get("nested_userns")), memory_max=memory_max,
                   userns=int((claims.get("userns") or {}).get("base") or 0),
                   device_rules=tuple((found.get("cgroup-devices") or {}).get("rules") or ()),
                   userns_size=int((claims.get("userns") or {}).get("size") or 1),
                   max_output=int(claims.get("max_output", 1 << 30)),
                   max_running=int((claims.get("jobs") or {}).get("max_running") or 0),
                   max_running_per_user=int(
                       (claims.get("jobs") or {}).get("max_running_per_user") or 0),
                   max_queued_per_user=int(
                       (claims.get("jobs") or {}).get("max_queued_per_user", 1000)),
                   max_staged_per_user=int(
                       (claims.get("jobs") or {}).get("max_staged_per_user", 10 << 30)))


# The most of a spec file its `name:` line is looked for in (a spec is a few KiB).
SPEC_HEAD_MAX = 1 << 20


def spec_name_of(p: Path) -> str | None:
    """The `name:` of spec file `p` (read without YAML), None when it has none or is not a
    regular file. Found with O_PATH and opened for reading only once it is a regular file
    (through the descriptor, so the same inode), at most SPEC_HEAD_MAX bytes: an operator's
    link may lead to a directory another user owns, who can swap the file for a FIFO (root,
    the daemon's own loop even, would block in open() for ever), a device whose open alone
    acts (/dev/watchdog arms the host's watchdog) or a huge file. OSError when it cannot be
    opened."""
    import stat

    if os.path.islink(p) and not _no_users_fuse_on_the_way(p):
        return None  # (not looked into: its server may never answer)
    found = os.open(p, os.O_PATH | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(found).st_mode):
            return None
        fd = os.open(f"/proc/self/fd/{found}",
                     os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(found)
    try:
        chunks, left = [], SPEC_HEAD_MAX
        while left > 0 and (chunk := os.read(fd, min(left, 65536))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    m = _SPEC_NAME.search(b"".join(chunks).decode(errors="replace"))
    return m.group(1) if m else None


def _users_fuse_mounts() -> set[int]:
    """The mount ids of the FUSE file systems a user other than root mounted (fusermount3:
    `user_id=` in their options), from /proc/self/mountinfo."""
    out = set()
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) > 1 and len(rest) > 2 and rest[0].startswith("fuse") and \
                "user_id=0," not in f"{rest[2]},":
            with contextlib.suppress(ValueError):
                out.add(int(fields[0]))
    return out


def _mount_id(fd: int) -> int | None:
    """The mount id of O_PATH descriptor `fd`, by statx(AT_STATX_DONT_SYNC): a FUSE file
    system answers that from what it has, never asking its server."""
    import ctypes

    buf = ctypes.create_string_buffer(256)
    libc = ctypes.CDLL(None, use_errno=True)
    at_empty_path, dont_sync, mnt_id = 0x1000, 0x4000, 0x1000
    if libc.statx(fd, b"", at_empty_path | dont_sync, mnt_id, buf) != 0:
        return None
    return int.from_bytes(buf.raw[144:152], "little")


def _no_users_fuse_on_the_way(p: Path) -> bool:
    """Whether following link `p` (in the config directory) reaches nothing on a FUSE file
    system a user mounted: its server, that user, may never answer, and an open, even an
    lstat there waits for it (the daemon's own loop looks specs up by name). Walked a
    component at a time through O_PATH descriptors, each one's mount looked at before
    anything asks its file system (attacker review, s33)."""
    import stat

    fuse = _users_fuse_mounts()
    if not fuse:
        return True  # none on this host: nothing to walk
    fd = os.open(p.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    todo, links = [p.name], 0
    try:
        while todo:
            name = todo.pop(0)
            try:
                nfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError:
                return True  # missing (or not a directory): the open says so, at once
            if _mount_id(nfd) in fuse:
                os.close(nfd)
                return False
            if stat.S_ISLNK(os.fstat(nfd).st_mode):
                os.close(nfd)
                links += 1
                if links > 40:
                    return True  # ELOOP: the open says so
                text = os.readlink(name, dir_fd=fd)
                if text.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                todo[:0] = [c for c in text.split("/") if c not in ("", ".")]
                continue
            os.close(fd)
            fd = nfd
        return True
    finally:
        os.close(fd)


def spec_names(where: Path) -> set[str]:
    """The environments the spec files in `where` name (their `name:` line, read without
    YAML); empty when there is no such directory."""
    specs = set()
    try:
        for p in where.iterdir():
            if p.suffix in (".yaml", ".yml"):
                with contextlib.suppress(OSError):  # (vanished meanwhile: not one of them)
                    name = spec_name_of(p)
                    if name:
                        specs.add(name)
    except OSError:
        pass  # no config directory here: none
    return specs


def _not_up(host: Host, env: str) -> UsageError:
    """What to say of an environment a launch cannot enter: `envctl up` it, when a spec of
    that name exists (or it has a journal); a typo otherwise, with the names that exist. Only
    on this error path are the spec files read (by their `name:` line, without YAML: the
    launch path never imports it)."""
    where = config_dir()
    specs = spec_names(where)
    journals = {p.name.split(".", 1)[0] for p in (host.state_dir / "journal").glob("*.json")}
    if env in specs | journals:
        return UsageError(f"environment '{env}' is not up: bring it up with `envctl up {env}`")
    known = ", ".join(sorted(specs | journals)) or "none"
    return UsageError(f"no environment '{env}': no spec of that name in {where} and not up on "
                      f"this host (known: {known})")


def check_env_name(env: str) -> str:
    """`env` when it is an environment's name (never a path: `.queue / "/tmp/f"` is /tmp/f);
    UsageError (exit 2) otherwise. Whatever a request names is checked so before any path is
    made of it."""
    if not _ENV_NAME.fullmatch(env):
        raise UsageError(f"'{env}' is not an environment name (lowercase letters, digits and "
                         "'-', at most 32)")
    return env


def read_journal(state_dir: Path, env: str, boot: str
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """kind -> the first resource (dict form) of that kind in `env`'s journal, and its claims
    (read_journal_meta's, with only the claims of its meta)."""
    found, meta = read_journal_meta(state_dir, env, boot)
    return found, dict(meta.get("claims") or {})


def read_journal_meta(state_dir: Path, env: str, boot: str
                      ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """kind -> the first resource (dict form) of that kind in `env`'s journal, and its meta.

    Read as envctl.engine.journal reads it (the folded file, then the write-ahead log it names;
    a damaged last line is a torn end, damage before a good record is StateCorrupt), without
    rebuilding every resource as Journal.open does: that imports every kind's module and the
    engine's (~20 ms of dataclasses), and a launch needs five plain fields.
    tests/unit/test_runtime_launch.py checks this against journals the engine wrote."""
    check_env_name(env)
    path = state_dir / "journal" / f"{env}.json"
    data = _read_state(path)
    log = path.with_name(f"{env}.{data.get('log', 0) if data else 0}.log")
    entries: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    try:
        for e in (data or {}).get("entries", []):
            entries[e["key"]] = e
        meta = dict((data or {}).get("meta") or {})
        for rec in _read_log(log):
            if "put" in rec:
                entries[rec["put"]["key"]] = rec["put"]
            elif "drop" in rec:
                entries.pop(rec["drop"], None)
            elif "meta" in rec:
                meta = dict(rec["meta"])
        found: dict[str, dict[str, Any]] = {}
        for e in entries.values():
            res = e["resource"]
            made_in = e.get("boot", "")
            if res["kind"] in _VOLATILE and boot and made_in and made_in != boot:
                continue  # another boot's: what it describes is gone
            found.setdefault(res["kind"], res)
    except (TypeError, KeyError, AttributeError) as exc:
        raise StateCorrupt(path, f"bad entry: {exc!r}") from None
    return found, meta


def journal_names(state_dir: Path) -> list[str]:
    """Every environment with a journal file or a log (envctl.engine.journal's
    Journal.environments, without importing the engine)."""
    d = state_dir / "journal"
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted({n.split(".", 1)[0] for n in names
                   if n.endswith((".json", ".log")) and not n.startswith(".")})


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise StateCorrupt(path, getattr(exc, "strerror", None)
                           or f"not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("log", 0), int):
        raise StateCorrupt(path, "not an envctl state file")
    if data.get("version", JOURNAL_VERSION) > JOURNAL_VERSION:
        raise StateCorrupt(path, f"written by a newer envctl (format {data['version']}, this "
                                 f"one reads {JOURNAL_VERSION})")
    return data


def _read_log(log: Path) -> list[dict[str, Any]]:
    try:
        lines = log.read_bytes().split(b"\n")
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StateCorrupt(log, exc.strerror or str(exc)) from None
    records = []
    for i, line in enumerate(lines):
        if not line.strip(b"\0 \t\r"):
            continue
        rec = _parsed(line)
        if rec is None:
            if any(_parsed(rest) is not None for rest in lines[i + 1:]):
                raise StateCorrupt(log, f"line {i + 1} is damaged and records follow it")
            break  # a torn end: a crash while appending
        records.append(rec)
    return records


def _parsed(line: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _check_holder(env: str, path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise HostError(f"enter environment '{env}': mount namespace {path}: {exc.strerror}; "
                        f"`envctl up {env}` makes it again") from exc
    try:
        kind = fcntl.ioctl(fd, NS_GET_NSTYPE)
    except OSError:
        kind = 0  # ENOTTY: a plain file, not an nsfs one
    finally:
        os.close(fd)
    if kind != CLONE_NEWNS:
        raise HostError(f"enter environment '{env}': {path} holds no mount namespace; "
                        f"`envctl up {env}` makes it again")


def _cgroup(found: dict[str, dict[str, Any]]
            ) -> tuple[EnvCgroup | None, tuple[int, ...], int]:
    """The cgroup step's driver and placement, the CPUs its cpuset names (() for all) and its
    memory limit in bytes (0: none)."""
    if (cg := found.get("cgroup")) is not None:
        settings = {f: v for _, f, v in cg.get("settings", ())}
        limit = settings.get("memory.max") or settings.get("memory.limit_in_bytes") or ""
        return (EnvCgroup("cgroupfs", cg.get("parent", ""), int(cg["version"]),
                          tuple(cg.get("controllers", ()))),
                parse_cpus(settings.get("cpuset.cpus", "")), _bytes(limit))
    if (sl := found.get("cgroup-slice")) is not None:
        props = dict(sl.get("properties", ()))
        return (EnvCgroup("systemd", sl.get("parent", ""), int(sl["version"])),
                parse_cpus(props.get("AllowedCPUs", "")), _bytes(props.get("MemoryMax", "")))
    return None, (), 0


def _bytes(limit: str) -> int:
    """A memory limit as the planner wrote it (bytes; "max", "-1", "infinity": none) -> 0."""
    return int(limit) if limit.isdigit() else 0


def parse_cpus(text: str) -> tuple[int, ...]:
    """CPU numbers of the kernel's list syntax ("0-3,8"), sorted; () for an empty list. (What
    envctl.spec.units.parse_cpu_list reads, without its validation: the text is the kernel's
    or the planner's, and that module costs ~3 ms to import.)"""
    out: set[int] = set()
    for part in text.replace(" ", "").strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(out))


def format_cpus(cpus: tuple[int, ...] | list[int]) -> str:
    """The kernel's list syntax for `cpus` ("0-3,8")."""
    out: list[str] = []
    nums = sorted(set(cpus))
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out)


def read_environment(root: Path) -> dict[str, str]:
    """KEY=VALUE lines of `root`/etc/environment, as envctl writes them (values literal, one
    line each, no quoting); PATH defaults to DEFAULT_PATH."""
    out: dict[str, str] = {}
    path = root / "etc" / "environment"
    try:
        text = path.read_text()
    except FileNotFoundError:
        text = ""
    except OSError as exc:
        raise HostError(f"read {path}: {exc.strerror}") from exc
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        if eq and key and not key.lstrip().startswith("#"):
            out[key.strip()] = value
    out.setdefault("PATH", DEFAULT_PATH)
    return out


def online_cpus(sys_root: Path = Path("/sys")) -> tuple[int, ...]:
    """Every online CPU (sysfs), or those this process may run on when sysfs does not say."""
    try:
        return parse_cpus((sys_root / "devices/system/cpu/online").read_text()) or tuple(
            sorted(os.sched_getaffinity(0)))
    except (OSError, ValueError):
        return tuple(sorted(os.sched_getaffinity(0)))
