"""Cgroups made through systemd (the systemd driver): envctl's parent slice, each
environment's slice (a runtime unit file with its limits and device allow-list) and the
/dev/char links its DeviceAllow= paths need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from envctl.errors import HostError
from envctl.host import systemd as sd
from envctl.resources.base import Check, Diff, Resource, Status
from envctl.resources.cgroup import parent_ident, stops_note

if TYPE_CHECKING:
    from envctl.host.context import Host

Property = tuple[str, str]  # (unit-file setting, value), written in this order


def _version_mismatch(host: Host, version: int) -> Check | None:
    have = host.cgroups.version
    if have != version:
        return Check.wrong_kind(f"planned for cgroup v{version}, the host now drives v{have}")
    return None


def _systemd(host: Host, parent: str) -> sd.Systemd:
    # The parent recorded in the resource (so in the journal), not ENVCTL_CGROUP_PARENT now:
    # `down` removes what `up` made. "" (journals from before it was recorded): the current.
    return host.systemd.for_parent(parent)


def _slice_check(s: sd.Systemd, unit: str, text: str, want: dict[str, str]) -> Check:
    """Absent, or present with one Diff per property systemd reports differently, the unit
    file's content and whether the slice is active."""
    have_text = s.read_unit(unit)
    state = s.state(unit, want)
    if have_text is None and state["ActiveState"] in ("inactive", ""):
        return Check.absent()  # not loaded, or loaded but stopped: nothing of ours
    ours = str(s.unit_path(unit))
    if have_text is None and state["FragmentPath"] not in ("", ours):
        return Check.wrong_kind(f"slice {unit} is defined by {state['FragmentPath']}, "
                                f"not by envctl's {ours}")
    diffs = [Diff(k, v, state.get(k)) for k, v in want.items() if state.get(k) != v]
    if have_text != text:
        diffs.insert(0, Diff("unit file", ours, "missing" if have_text is None else "differs"))
    if state["ActiveState"] != "active":
        diffs.insert(0, Diff("ActiveState", "active", state["ActiveState"] or "unknown"))
    return Check(Status.DRIFTED, tuple(diffs)) if diffs else Check.present()


@dataclass(frozen=True)
class SystemdParentSlice(Resource):
    """`envctl.slice`, which every environment's slice sits in; shared by all environments.
    A parent slice that was active before envctl wrote its unit file is never stopped; the
    unit file envctl wrote for it is deleted at removal all the same."""

    kind = "cgroup-parent-slice"
    shared = True
    version: int
    parent: str = ""  # the parent's name (ENVCTL_CGROUP_PARENT at plan time)

    def ident(self) -> str:
        return parent_ident(self.parent)

    def _unit(self, host: Host) -> str:
        return _systemd(host, self.parent).parent_unit

    def _text(self, host: Host) -> str:
        return sd.unit_text("envctl environments", (), policy=False)

    def describe(self) -> str:
        return f"parent slice (systemd, cgroup v{self.version})"

    def check(self, host: Host) -> Check:
        if (bad := _version_mismatch(host, self.version)) is not None:
            return bad
        return _slice_check(_systemd(host, self.parent), self._unit(host), self._text(host),
                            {})

    def snapshot(self, host: Host) -> dict[str, Any]:
        # "existed": active with no unit file of envctl's, so any unit file of envctl's found
        # at removal was written by envctl (apply) after this.
        s, unit = _systemd(host, self.parent), self._unit(host)
        active = s.state(unit)["ActiveState"] == "active"
        return {"existed": active and s.read_unit(unit) is None}

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        return "kept: it was active before envctl" if memo.get("existed") else ""

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        _systemd(host, self.parent).ensure_slice(self._unit(host), self._text(host))

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        s = _systemd(host, self.parent)
        if memo.get("existed"):
            # Somebody else's slice: used, never stopped; only the unit file envctl wrote goes
            # (whatever defined the slice before, /etc or nothing, is in force again).
            s.remove_unit_file(self._unit(host))
            return
        s.remove_slice(self._unit(host))


@dataclass(frozen=True)
class SystemdSlice(Resource):
    """One environment's slice: `properties` (CPUQuota, MemoryMax, …) and DevicePolicy=closed
    with one DeviceAllow= per rule of `devices` ("c 195:0 rwm", as the cgroupfs driver's).

    A slice envctl did not make (active without envctl's unit file, or defined by a unit file
    envctl did not write) is refused, never stopped or changed.

    Applying writes the unit file under /run/systemd/system, reloads systemd when it changed
    and starts the slice; a property a drop-in shadows is set with `set-property --runtime`.
    (The /dev/char links of its DeviceAllow= paths are steps of their own, SystemdCharLink,
    planned before it.) Removal stops the processes inside (SIGTERM, grace, SIGKILL), stops
    the slice, deletes the unit file and envctl's runtime drop-ins (never an operator's in
    /etc); a slice already gone counts as removed. A memo journalled before the links were
    steps of their own lists the links made for this slice ("char_links"): those go with it
    as they did then, when they still point where envctl set them and no other slice of
    envctl's allows them."""

    kind = "cgroup-slice"
    driver: ClassVar[str] = "systemd"  # what `envctl status` reports
    env: str
    version: int
    properties: tuple[Property, ...] = ()
    devices: tuple[str, ...] = ()
    parent: str = ""  # the parent's name (ENVCTL_CGROUP_PARENT at plan time)

    def ident(self) -> str:
        return self.env

    def describe(self) -> str:
        return f"slice of {self.env} (systemd, cgroup v{self.version}, " \
               f"{len(self.devices)} device rules)"

    def _want(self, host: Host) -> tuple[str, str, dict[str, str]]:
        s = _systemd(host, self.parent)
        names = sd.read_proc_devices(s.proc)
        allow = [sd.device_allow(r, names) for r in self.devices]
        text = sd.unit_text(f"envctl environment {self.env}", self.properties, allow)
        return s.unit(self.env), text, sd.expected(self.properties, allow)

    def check(self, host: Host) -> Check:
        if (bad := _version_mismatch(host, self.version)) is not None:
            return bad
        s = _systemd(host, self.parent)
        unit, text, want = self._want(host)
        return _slice_check(s, unit, text, want)

    def snapshot(self, host: Host) -> dict[str, Any]:
        s = _systemd(host, self.parent)
        return {"foreign": s.foreign(s.unit(self.env))}

    def refuses(self, memo: dict[str, Any]) -> str:
        why = memo.get("foreign") or ""
        if not why:
            return ""
        return (f"{why}; envctl leaves it and its processes alone. Stop it and remove that "
                "unit file, or give envctl another parent with ENVCTL_CGROUP_PARENT")

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        s = _systemd(host, self.parent)
        unit = s.unit(self.env)
        notes = [stops_note(len(s.procs(s.cgroup(self.env))))]
        links = s.char_links_to_remove(dict(memo.get("char_links") or {}), unit=unit)
        if links:
            notes.append(f"removes {', '.join(links)}")
        return "; ".join(n for n in notes if n)

    def _dropins(self) -> list[str]:
        # The properties envctl's own `set-property --runtime` may have written (see apply).
        return [k for k, _ in self.properties] + ["DevicePolicy", "DeviceAllow"]

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        s = _systemd(host, self.parent)
        unit, text, want = self._want(host)
        s.ensure_slice(unit, text)
        state = s.state(unit, want)
        drifted = [k for k, v in want.items() if state.get(k) != v]
        if not drifted:
            return  # the unit file holds
        # A drop-in (an operator's set-property) shadows the unit file: override it at
        # runtime, the way systemd wants properties of a running unit changed.
        assignments = []
        for key in drifted:
            if key == "DeviceAllow":
                assignments += ["DeviceAllow=", *(f"DeviceAllow={d}" for d in
                                                  _allow_lines(text))]
            elif key == "DevicePolicy":
                assignments.append("DevicePolicy=closed")
            else:
                assignments.append(f"{key}={dict(self.properties)[key]}")
        s.set_property(unit, assignments)
        state = s.state(unit, want)
        still = [f"{k}: {state.get(k)} (want {v})" for k, v in want.items() if state.get(k) != v]
        if still:
            raise HostError(f"set slice '{unit}': systemd reports {'; '.join(still)}")

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        s = _systemd(host, self.parent)
        unit = s.unit(self.env)
        s.remove_slice(unit, s.cgroup(self.env), properties=self._dropins())
        # A memo from before the cgroup-char-link steps: the links envctl made for this slice
        # (after it: systemd no longer resolves its DeviceAllow= paths).
        s.remove_char_links(dict(memo.get("char_links") or {}), unit=unit)


@dataclass(frozen=True)
class SystemdCharLink(Resource):
    """/dev/char/MAJ:MIN -> the character device with those numbers under /dev ("../nvidia0"),
    for a single node a slice's DeviceAllow= names: systemd turns those paths into device
    numbers whenever it loads the unit (every daemon-reload), older versions by stat(), and
    nodes made by nvidia-modprobe have no udev link. No such node under /dev: nothing to link
    (a later `up` links it once the node is there).

    Shared by every environment whose slice allows the node; the memo is the first holder's
    snapshot, and only the last holder's `down` removes. A link that already resolved to the
    node before envctl (udev's) is kept. A wrong one (dangling, or another device) is replaced
    and given back as found; something that is not a link is refused. Removal deletes only the
    link envctl made, and only while it still points where envctl set it."""

    kind = "cgroup-char-link"
    shared = True
    major: int
    minor: int

    def ident(self) -> str:
        return f"{self.major}:{self.minor}"

    def describe(self) -> str:
        return f"/dev/char/{self.ident()} link"

    def check(self, host: Host) -> Check:
        s = host.systemd
        have = s.read_char_link(self.major, self.minor)
        if have.state == "ok":
            return Check.present()
        if have.state == "foreign":
            return Check.wrong_kind(f"{have.detail}, not a link envctl may replace")
        target = s.char_node(self.major, self.minor)
        if target is None:
            return Check.present(f"no character device {self.ident()} in {s.dev}: nothing to "
                                 "link")
        if have.state == "missing":
            return Check.absent()
        return Check(Status.DRIFTED, (Diff("target", target, have.target),))

    def snapshot(self, host: Host) -> dict[str, Any]:
        # "was": where a link pointed before envctl (right or wrong); "target": where envctl
        # would point it now (None: no node yet, or no need).
        s = host.systemd
        have = s.read_char_link(self.major, self.minor)
        if have.state == "foreign":
            return {"existed": True, "foreign": have.detail}
        if have.state == "ok":
            return {"existed": True, "was": have.target}
        return {"existed": False, "was": have.target,
                "target": s.char_node(self.major, self.minor)}

    def refuses(self, memo: dict[str, Any]) -> str:
        why = memo.get("foreign") or ""
        if not why:
            return ""
        return (f"{why}, not a link: envctl leaves it alone. Remove it (udev makes /dev/char "
                "links; envctl makes the ones it lacks)")

    def _undo(self, host: Host, memo: dict[str, Any]) -> tuple[str, str | None]:
        """What removal finds: ("kept", None) there before envctl; ("gone", None) no link (or
        not a link any more); ("as found", target) never changed by envctl; ("theirs",
        target) repointed since; ("ours", target) made or replaced by envctl and still
        pointing where envctl set it."""
        if memo.get("existed"):
            return "kept", None
        s = host.systemd
        have = s.read_char_link(self.major, self.minor).target
        if have is None:
            return "gone", None
        if have == memo.get("was"):
            return "as found", have  # a wrong link envctl had no node to replace it with
        # Where envctl set it: the node found at the snapshot, or found now (a node that
        # appeared later, linked by a later `up`).
        if have in (memo.get("target"), s.char_node(self.major, self.minor)):
            return "ours", have
        return "theirs", have

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        state, have = self._undo(host, memo)
        if state == "kept":
            return "kept: it existed before envctl"
        if state == "theirs":
            return f"kept: it points to {have} now, not where envctl set it"
        if state != "ours":
            return ""
        path = host.systemd.char_link(self.major, self.minor)
        return f"restores {path} -> {memo['was']}" if memo.get("was") else f"removes {path}"

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        s = host.systemd
        have = s.read_char_link(self.major, self.minor)
        if have.state == "ok":
            return  # already so
        if have.state == "foreign":
            raise HostError(f"create device link '{s.char_link(self.major, self.minor)}': "
                            f"{have.detail}, not a link envctl may replace")
        target = s.char_node(self.major, self.minor)
        if target is None:
            return  # no node to point at
        s.set_char_link(self.major, self.minor, target)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        state, have = self._undo(host, memo)
        if state != "ours" or have is None:
            return  # there before envctl, gone already, never changed, or somebody else's now
        s = host.systemd
        if memo.get("was"):
            s.set_char_link(self.major, self.minor, memo["was"])  # given back as found
        else:
            s.remove_char_link(self.major, self.minor, expect=have)


def _allow_lines(text: str) -> list[str]:
    return [line.split("=", 1)[1] for line in text.splitlines()
            if line.startswith("DeviceAllow=")]
