"""The environment's named network namespace (/run/netns/NAME, usable by `ip netns exec`), and
the directory such namespaces are bound in, as a shared mount point."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.errors import HostError, NamespaceGone
from envctl.resources.base import Check, Resource

if TYPE_CHECKING:
    from envctl.host.context import Host


@dataclass(frozen=True)
class NetnsDir(Resource):
    """The namespace directory (/run/netns) as a shared mount point, made as iproute2 makes it:
    bound onto itself when it is not a mount point, then made shared, so that namespaces bound
    in it appear in every mount namespace. Shared by every environment with a network: the last
    one's `down` unmounts it when envctl made the mount and nothing else is mounted in it (an
    operator's `ip netns add` namespace keeps it)."""

    kind = "netns-dir"
    shared = True

    def ident(self) -> str:
        return "mount"

    def describe(self) -> str:
        return "namespace directory /run/netns, a shared mount"

    def check(self, host: Host) -> Check:
        exists, mounted, shared = host.netns.dir_state()
        if not mounted:
            return Check.absent("not a mount point" if exists else "")
        return Check.compare({"propagation": "shared"},
                             {"propagation": "shared" if shared else "private"})

    def snapshot(self, host: Host) -> dict[str, Any]:
        exists, mounted, _ = host.netns.dir_state()
        return {"existed": exists, "mounted": mounted}

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        host.netns.share_dir()

    def _kept(self, host: Host, memo: dict[str, Any], *, ours: frozenset[str] = frozenset()
              ) -> str:
        """Why the mount stays ("" when it goes); mounts named in `ours` are left out."""
        if memo.get("mounted"):
            return "kept: it was a mount point before envctl"
        others = [n for n in host.netns.mounted_in_dir() if n not in ours]
        if others:
            return f"kept: {', '.join(others)} still mounted in it"
        return ""

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        # Said before the environment's own namespace goes (`plan --down`, `status`): the
        # namespaces of environments that are up (each has its run directory) go first.
        run = host.run_dir
        ours = frozenset(p.name for p in run.iterdir()) if run.is_dir() else frozenset()
        return self._kept(host, memo, ours=ours)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        if self._kept(host, memo):
            return  # something is mounted in it: not envctl's to end
        host.netns.unmount_dir()
        if not memo.get("existed", True):
            # Made by envctl: gone too, when empty (OSError: not empty, or gone already).
            with contextlib.suppress(OSError):
                host.netns.dir.rmdir()


@dataclass(frozen=True)
class NetNamespace(Resource):
    """A namespace that existed before envctl is adopted: never deleted, and given back the
    `lo` state and default route it had (IpConfig brings `lo` up and sets the route)."""

    kind = "netns"
    name: str

    def ident(self) -> str:
        return self.name

    def describe(self) -> str:
        return f"network namespace {self.name}"

    def check(self, host: Host) -> Check:
        state = host.netns.state(self.name)
        if state == "absent":
            return Check.absent()
        if state == "stale":
            return Check.wrong_kind(f"{host.netns.path(self.name)} is not a bound namespace")
        return Check.present()

    def snapshot(self, host: Host) -> dict[str, Any]:
        if host.netns.state(self.name) != "present":
            return {"existed": False}
        lo = host.netlink.link("lo", netns=self.name)
        return {"existed": True, "lo_up": bool(lo and lo.up),
                "gateway": host.netlink.default_gateway(netns=self.name)}

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        if host.netns.state(self.name) == "present":
            return  # already so
        host.netns.create(self.name)

    def _restore(self, host: Host, memo: dict[str, Any], *, act: bool) -> list[str]:
        """What differs in an adopted namespace from what its memo found, given back when
        `act`: `lo` down again, the previous default route (envctl's went with its veth)."""
        nl, done = host.netlink, []
        try:
            lo = nl.link("lo", netns=self.name)
            if memo.get("lo_up") is False and lo is not None and lo.up:
                if act:
                    nl.set_link("lo", netns=self.name, up=False)
                done.append("lo set down again")
            gateway = memo.get("gateway")
            if gateway and nl.default_gateway(netns=self.name) != gateway:
                if act:
                    # HostError: the gateway is unreachable now (its device went since `up`):
                    # the namespace's network changed under envctl and the old route cannot
                    # come back. Failing here would fail every `down` the same way.
                    with contextlib.suppress(HostError):
                        nl.set_default_route(gateway, netns=self.name)
                done.append(f"default route via {gateway} restored if still reachable")
        except NamespaceGone:
            return []  # deleted by someone else meanwhile: nothing to give back
        return done

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        if not memo.get("existed"):
            return ""
        return "; ".join(["kept: it existed before envctl",
                          *self._restore(host, memo, act=False)])

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        if memo.get("existed"):
            self._restore(host, memo, act=True)
            return
        host.netns.remove(self.name)
