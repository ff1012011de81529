"""Cgroups made through cgroupfs: envctl's parent, each environment's cgroup with its limits,
and its device allow-list (v1 devices.deny/allow, v2 a BPF_PROG_TYPE_CGROUP_DEVICE program)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from envctl.errors import HostError
from envctl.facts import DEFAULT_PARENT
from envctl.host.cgroups import normalize
from envctl.resources.base import Check, Diff, Resource, Status

if TYPE_CHECKING:
    from envctl.host.cgroups import Cgroups
    from envctl.host.context import Host

Setting = tuple[str, str, str]  # (controller, file, value), written in this order


def _version_mismatch(host: Host, version: int) -> Check | None:
    have = host.cgroups.version
    if have != version:
        return Check.wrong_kind(f"planned for cgroup v{version}, the host now drives v{have}")
    return None


def _cgroups(host: Host, parent: str) -> Cgroups:
    # The parent recorded in the resource (so in the journal), not ENVCTL_CGROUP_PARENT now:
    # `down` removes what `up` made. "" (journals from before it was recorded): the current.
    return host.cgroups.for_parent(parent)


def parent_ident(parent: str) -> str:
    """`parent` for the default parent (the key journals have always had), `parent:NAME` for
    another: parents of different names are different shared resources in the ledger."""
    return "parent" if parent in ("", DEFAULT_PARENT) else f"parent:{parent}"


@dataclass(frozen=True)
class CgroupParent(Resource):
    """The `envctl` parent cgroup in every hierarchy; shared by all environments.

    v1: its cpuset gets the root's CPUs and memory nodes (children of an empty cpuset can
    hold no task). v2: the root and the parent delegate the resource controllers."""

    kind = "cgroup-parent"
    shared = True
    version: int
    controllers: tuple[str, ...]
    parent: str = ""  # the parent's name (ENVCTL_CGROUP_PARENT at plan time)

    def ident(self) -> str:
        return parent_ident(self.parent)

    def describe(self) -> str:
        name = f" {self.parent}" if self.parent else ""
        return f"cgroup parent{name} (cgroupfs, v{self.version}: {', '.join(self.controllers)})"

    def check(self, host: Host) -> Check:
        if (bad := _version_mismatch(host, self.version)) is not None:
            return bad
        cg = _cgroups(host, self.parent)
        present = cg.present(None)
        if not any(present):
            return Check.absent()
        if not all(present):
            return Check(Status.DRIFTED, detail="missing in some hierarchies")
        if not cg.parent_ready():
            return Check(Status.DRIFTED, detail="cpuset or controller delegation not set up")
        return Check.present()

    def snapshot(self, host: Host) -> dict[str, Any]:
        # A parent that existed before envctl (made by hand), in any hierarchy, is used there
        # and never removed ("had": those directories). v1: the cpuset such a parent had, which
        # ensure_parent fills when empty. v2: the controllers the root's and the parent's
        # subtree_control already had, so that `remove` disables only those envctl enabled.
        cg = _cgroups(host, self.parent)
        dirs = cg.dirs()
        had = [str(d) for d in dirs if d.is_dir()]
        memo: dict[str, Any] = {"existed": bool(dirs) and len(had) == len(dirs), "had": had}
        cpuset = cg.parent_cpuset()
        if cpuset is not None:
            memo["cpuset"] = cpuset
        if self.version == 2:
            memo["subtree_control"] = cg.delegation()
        return memo

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        if memo.get("existed"):
            return "kept: it existed before envctl"
        if memo.get("had"):
            return f"kept where it existed before envctl: {', '.join(memo['had'])}"
        return ""

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        _cgroups(host, self.parent).ensure_parent()

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        cg = _cgroups(host, self.parent)
        if "had" in memo:
            cg.remove_parent(keep=memo["had"])
        elif not memo.get("existed"):  # journalled before envctl recorded "had"
            cg.remove_parent()
        if isinstance(memo.get("cpuset"), dict):
            cg.restore_parent_cpuset(memo["cpuset"])
        # A memo without it (journalled before envctl recorded it): leave delegation as is.
        if isinstance(memo.get("subtree_control"), dict):
            cg.restore_delegation(memo["subtree_control"])


@dataclass(frozen=True)
class Cgroup(Resource):
    """One environment's cgroup in each hierarchy of `controllers`, with `settings` written.

    A cgroup already at the environment's path that envctl did not make is refused (it holds
    somebody else's processes); it is never written, killed or removed. Removal stops every
    process in the cgroup and below it (SIGTERM, grace, SIGKILL / cgroup.kill) before the
    cgroups go, deepest first; a cgroup already gone counts as removed."""

    kind = "cgroup"
    driver: ClassVar[str] = "cgroupfs"  # what `envctl status` reports
    env: str
    version: int
    controllers: tuple[str, ...]
    settings: tuple[Setting, ...] = ()
    parent: str = ""  # the parent's name (ENVCTL_CGROUP_PARENT at plan time)

    def ident(self) -> str:
        return self.env

    def describe(self) -> str:
        return f"cgroup {self.env} (cgroupfs, v{self.version})"

    def check(self, host: Host) -> Check:
        if (bad := _version_mismatch(host, self.version)) is not None:
            return bad
        cg = _cgroups(host, self.parent)
        present = cg.present(self.env, self.controllers)
        if not any(present):
            return Check.absent()
        missing = [d.parent.parent.name for d, ok in
                   zip(cg.dirs(self.env, self.controllers), present, strict=True) if not ok]
        diffs = [Diff(file, normalize(file, value), None if have is None else
                      normalize(file, have))
                 for (ctrl, file, value), have in zip(self.settings, self._read(host),
                                                      strict=True)
                 if have is None or normalize(file, have) != normalize(file, value)]
        detail = f"missing in hierarchies {', '.join(missing)}" if missing else ""
        if diffs or missing:
            return Check(Status.DRIFTED, tuple(diffs), detail)
        return Check.present()

    def _read(self, host: Host) -> list[str | None]:
        cg = _cgroups(host, self.parent)
        return [cg.read(self.env, ctrl, file) for ctrl, file, _ in self.settings]

    def snapshot(self, host: Host) -> dict[str, Any]:
        # The engine snapshots only a step no journal knows: a directory there now is not
        # envctl's (or not this state directory's).
        cg = _cgroups(host, self.parent)
        return {"existed": [str(d) for d in cg.dirs(self.env, self.controllers) if d.is_dir()]}

    def refuses(self, memo: dict[str, Any]) -> str:
        found = memo.get("existed") or []
        if not found:
            return ""
        return (f"{found[0]} already exists and envctl did not make it (no journal records it); "
                "envctl leaves it and its processes alone. Move its processes out and remove "
                "it (rmdir), or give envctl another parent with ENVCTL_CGROUP_PARENT")

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        return stops_note(len(_cgroups(host, self.parent).procs(self.env, self.controllers)))

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        cg = _cgroups(host, self.parent)
        cg.create(self.env, self.controllers)
        todo = [(s, have) for s, have in zip(self.settings, self._read(host), strict=True)
                if have is None or normalize(s[1], have) != normalize(s[1], s[2])]
        if not todo:
            return  # already so
        for ctrl, file, value in _order(todo):
            cg.write(self.env, ctrl, file, value)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        _cgroups(host, self.parent).remove(self.env, self.controllers)


def _order(todo: list[tuple[Setting, str | None]]) -> list[Setting]:
    """Writes in plan order, except v1's memory+swap limit: memsw must never drop below the
    memory limit, so when the new memory limit is above the current memsw, memsw goes first."""
    settings = [s for s, _ in todo]
    files = [s[1] for s in settings]
    if "memory.limit_in_bytes" in files and "memory.memsw.limit_in_bytes" in files:
        i, j = files.index("memory.limit_in_bytes"), files.index("memory.memsw.limit_in_bytes")
        cur_sw = normalize("memory.memsw.limit_in_bytes", todo[j][1] or "max")
        new_mem = normalize("memory.limit_in_bytes", settings[i][2])
        if new_mem == "max" or (cur_sw != "max" and int(new_mem) > int(cur_sw)):
            settings.insert(i, settings.pop(j))
    return settings


@dataclass(frozen=True)
class CgroupDevices(Resource):
    """The devices an environment may open, `rules` as v1 writes them ("c 1:3 rwm").

    v1: `devices.deny a` then one `devices.allow` per rule. v2: a BPF device program built from
    the rules and attached to the environment's cgroup (the cgroup holds it; no pinning).
    Removal never widens them: they go with the cgroup, once its processes are dead."""

    kind = "cgroup-devices"
    env: str
    version: int
    rules: tuple[str, ...]
    parent: str = ""  # the parent's name (ENVCTL_CGROUP_PARENT at plan time)

    def ident(self) -> str:
        return self.env

    def describe(self) -> str:
        how = "devices.allow" if self.version == 1 else "bpf program"
        return f"device allow-list of cgroup {self.env} ({how}, {len(self.rules)} rules)"

    def _rules(self, host: Host) -> tuple[str, ...]:
        # GPU rules name dynamic majors (nvidia-uvm); the number is this boot's.
        from envctl.host.devices import resolve_rules

        return resolve_rules(self.rules, host.gpu_root / "proc")

    def check(self, host: Host) -> Check:
        if (bad := _version_mismatch(host, self.version)) is not None:
            return bad
        cg = _cgroups(host, self.parent)
        try:
            rules = self._rules(host)
        except HostError as exc:
            return Check.absent(str(exc))
        if self.version == 1:
            have = cg.devices_v1(self.env)
            if have is None or have == {"a *:* rwm"}:
                # No cgroup, or one that allows every device (what a new cgroup inherits):
                # no allow-list, as on v2 without a program. `plan` (before the cgroup
                # exists) and `up` (just after) then count this step the same way.
                return Check.absent("no allow-list: every device is allowed" if have else "")
            return Check.compare({"rules": sorted(rules)}, {"rules": sorted(have)})
        from envctl.host import bpf

        path = cg.path(self.env, "")
        if not path.is_dir():
            return Check.absent()
        found = bpf.device_programs(path)
        flags, names = found if found is not None else (0, [])
        want = bpf.program_name(rules)
        if not names:
            return Check.absent(f"no device program on {path}")
        # Attached without BPF_F_ALLOW_MULTI (by an envctl before per-job device lists), the
        # program lets no job's cgroup attach its own: `up` swaps it (bpf.attach_device_program).
        # A swap cut short leaves the cgroup frozen by envctl: `up` thaws it.
        return Check.compare(
            {"program": want, "multi": True, "frozen by envctl": False},
            {"program": ",".join(n for n in names if n.startswith(bpf.PREFIX)) or ",".join(names),
             "multi": bool(flags & bpf.BPF_F_ALLOW_MULTI),
             "frozen by envctl": bpf.left_frozen(path)})

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        cg = _cgroups(host, self.parent)
        rules = self._rules(host)
        if self.version == 1:
            cg.set_devices_v1(self.env, rules)
            return
        from envctl.host import bpf

        bpf.attach_device_program(cg.path(self.env, ""), rules, name=self.env)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        # Nothing to do: the rules go with the cgroup (the `cgroup` step, after this one in
        # teardown, kills every process, then removes it). Lifting them here would give a
        # process that ignores SIGTERM every host device until it is killed; and a cgroup
        # that outlives this step (a rollback that keeps it, a failed `down`) keeps the
        # narrower rules, which the next `up` checks and rewrites.
        return


def stops_note(n: int) -> str:
    return "" if n == 0 else f"stops {n} process" + ("" if n == 1 else "es")
