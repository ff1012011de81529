"""An environment's firewall rules (NAT, port forwards, isolation) in envctl's own table/chains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.host.firewall import Rule, env_rules
from envctl.resources.base import Check, Diff, Resource, Status

if TYPE_CHECKING:
    from envctl.host.context import Host


@dataclass(frozen=True)
class FirewallRules(Resource):
    """All of environment `env`'s rules, tagged `envctl:ENV`, through `backend` (nftables or
    iptables). Applied and removed as one set: other environments' rules, and every table or
    chain envctl did not make, are never touched. `ports` are "proto:host:env" strings."""

    kind = "firewall"
    env: str
    backend: str
    bridge: str
    address: str
    nat: bool
    isolate: bool
    ports: tuple[str, ...] = ()

    def ident(self) -> str:
        # The backend is part of the identity: when it changes (nft installed later, or the
        # spec switches), the old backend's rules are a stale step that `up` removes first.
        return f"{self.backend}:{self.env}"

    def describe(self) -> str:
        what = [w for w, on in (("nat", self.nat), ("isolation", self.isolate)) if on]
        what += [f"{p.split(':')[0]}/{p.split(':')[1]}->{p.split(':')[2]}" for p in self.ports]
        return f"firewall rules of {self.env} ({self.backend}: {', '.join(what) or 'none'})"

    def rules(self) -> list[Rule]:
        ports = tuple((p, int(h), int(e)) for p, h, e in (x.split(":") for x in self.ports))
        return env_rules(self.env, bridge=self.bridge, address=self.address, nat=self.nat,
                         isolate=self.isolate, ports=ports)

    def check(self, host: Host) -> Check:
        fw = host.firewall(self.backend)
        listing = fw.listing()
        want = [r.comment for r in self.rules()]
        if listing is None:
            return Check.absent(f"{self.backend}: envctl's table/chains are missing")
        have = fw.comments(listing, self.env)
        if not have and want:
            return Check.absent()
        diffs = [Diff("rule", r, "missing") for r in want if r not in have]
        diffs += [Diff("rule", "absent", r) for r in have if r not in want]
        return Check(Status.DRIFTED if diffs else Status.PRESENT, tuple(diffs))

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        fw = host.firewall(self.backend)
        want = self.rules()
        listing = fw.listing()
        if listing is not None and sorted(fw.comments(listing, self.env)) == sorted(
                r.comment for r in want):
            return  # already so
        fw.replace(self.env, want, listing)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        host.firewall(self.backend).remove(self.env)  # success when already gone
