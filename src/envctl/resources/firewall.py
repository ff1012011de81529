"""An environment's firewall rules (NAT, port forwards, isolation) in envctl's own table/chains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.host.fwrules import Rule, env_rules, rule_drift
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
        if listing is None:
            return Check.absent(f"{self.backend}: envctl's table/chains are missing")
        want = self.rules()
        if want and not fw.comments(listing, self.env):
            return Check.absent()
        diffs = self._diffs(fw, listing, want)
        return Check(Status.DRIFTED if diffs else Status.PRESENT, diffs)

    def _diffs(self, fw: Any, listing: Any, want: list[Rule]) -> tuple[Diff, ...]:
        """What differs: each base chain or jump (shared by every environment, and needed
        by them all), then each of this environment's rules, compared by content too."""
        diffs = [Diff(k, v, listing.base.get(k, "missing")) for k, v in fw.base().items()
                 if listing.base.get(k, "missing") != v]
        drift = rule_drift(listing.rows, self.env, [(r, fw.content(r)) for r in want])
        return tuple(diffs + [Diff(f, w, h) for f, w, h in drift])

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        fw = host.firewall(self.backend)
        want = self.rules()
        listing = fw.listing()
        if listing is not None and not self._diffs(fw, listing, want):
            return  # already so
        # Only what differs changes: a missing chain or jump is added, a missing or edited
        # rule replaced; the rest is left as it is.
        fw.replace(self.env, want, listing)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        host.firewall(self.backend).remove(self.env)  # success when already gone
