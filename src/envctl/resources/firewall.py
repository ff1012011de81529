"""Firewall state envctl owns: an environment's tagged rules (NAT, port forwards, isolation;
anti-spoofing on its bridge port), and the shared table/chains that hold every environment's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.host.fwrules import PortRule, Rule, env_rules, port_rules, rule_drift
from envctl.resources.base import Check, Diff, Resource, Status

if TYPE_CHECKING:
    from envctl.host.context import Host


def route_localnet(bridge: str) -> str:
    """The sysctl that lets packets with a loopback address be routed to and from `bridge`
    (its published ports on the host's loopback; see fwrules.loopback_rules). A '.' in an
    interface name is a '/' in a dotted sysctl name."""
    return f"net.ipv4.conf.{bridge.replace('.', '/')}.route_localnet"


# What each backend's shared part is, for messages.
_WHAT = {"nftables": "table inet envctl", "nftables-bridge": "table bridge envctl",
         "iptables": "iptables chains ENVCTL-*"}


@dataclass(frozen=True)
class FirewallBase(Resource):
    """envctl's table and base chains (`nftables`: inet envctl; `nftables-bridge`: bridge
    envctl), or its chains and the jumps to them (`iptables`), that every environment's rules
    live in. Shared: planned before each environment's rules, it goes with the last holder,
    and then only what envctl made and what holds nothing of anybody else's (the ledger memo,
    taken once, says which table, chains and jumps existed before envctl)."""

    kind = "firewall-base"
    shared = True
    backend: str

    def ident(self) -> str:
        return self.backend

    def describe(self) -> str:
        return f"firewall {_WHAT.get(self.backend, self.backend)} ({self.backend})"

    def check(self, host: Host) -> Check:
        fw = host.firewall(self.backend)
        listing = fw.listing()
        if listing is None:
            return Check.absent()
        return Check.compare(fw.base(), {k: listing.base.get(k, "missing") for k in fw.base()})

    def snapshot(self, host: Host) -> dict[str, Any]:
        return host.firewall(self.backend).base_memo()

    def refuses(self, memo: dict[str, Any]) -> str:
        if self.backend == "iptables":
            return ""  # chains of envctl's names are adopted as they are: only rules are added
        from envctl.host import nft

        # A base chain of one of envctl's names in another shape (hook, priority, policy, or a
        # regular chain) would have to change: refused.
        if self.backend == "nftables-bridge":
            return nft.refusal(memo, nft.BRIDGE_CHAINS, f"{nft.BRIDGE_FAMILY} {nft.TABLE}")
        return nft.refusal(memo, nft.BASE_CHAINS, f"{nft.FAMILY} {nft.TABLE}")

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        return host.firewall(self.backend).release_note(memo)

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        # Only what is missing is added: `add` of a table or chain that exists is a no-op, and
        # an iptables chain or jump that is there is left as it is.
        host.firewall(self.backend).ensure_base()

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        host.firewall(self.backend).release_base(memo)  # success when already gone


class _TaggedRules(Resource):
    """An environment's rules, tagged `envctl:ENV`, in one of envctl's tables: checked,
    applied and removed as one set; other environments' rules, and anything untagged, are
    never touched. Subclasses say which adapter and which rules."""

    env: str

    def _backend(self) -> str:
        raise NotImplementedError

    def rules(self) -> list[Any]:
        raise NotImplementedError

    def check(self, host: Host) -> Check:
        fw = host.firewall(self._backend())
        listing = fw.listing()
        if listing is None:
            return Check.absent(f"{_WHAT.get(self._backend(), self._backend())} is missing")
        want = self.rules()
        if want and not fw.comments(listing, self.env):
            return Check.absent()
        diffs = self._diffs(fw, listing, want)
        return Check(Status.DRIFTED if diffs else Status.PRESENT, diffs)

    def _diffs(self, fw: Any, listing: Any, want: list[Any]) -> tuple[Diff, ...]:
        """Each of this environment's rules that is missing, extra, or edited (compared by
        content too). The chains and jumps all environments need are FirewallBase's."""
        drift = rule_drift(listing.rows, self.env, [(r, fw.content(r)) for r in want])
        return tuple(Diff(f, w, h) for f, w, h in drift)

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        fw = host.firewall(self._backend())
        want = self.rules()
        listing = fw.listing()
        if listing is not None and not self._diffs(fw, listing, want):
            return  # already so
        # Only what differs changes: a missing or edited rule is replaced, the rest is left.
        fw.replace(self.env, want, listing)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        host.firewall(self._backend()).remove(self.env)  # success when already gone


@dataclass(frozen=True)
class FirewallRules(_TaggedRules):
    """All of environment `env`'s rules, tagged `envctl:ENV`, through `backend` (nftables or
    iptables), in the table/chains of the FirewallBase planned before it. `ports` are
    "proto:host:env" strings."""

    kind = "firewall"
    env: str
    backend: str
    bridge: str
    address: str
    nat: bool
    isolate: bool
    ports: tuple[str, ...] = ()
    # The bridge's network: connections from it to a published port of this environment
    # come back through the host (hairpin NAT); "" (a journal of an older envctl): none.
    subnet: str = ""

    def ident(self) -> str:
        # The backend is part of the identity: when it changes (nft installed later, or the
        # spec switches), the old backend's rules are a stale step that `up` removes first.
        return f"{self.backend}:{self.env}"

    def describe(self) -> str:
        what = [w for w, on in (("nat", self.nat), ("isolation", self.isolate)) if on]
        what += [f"{p.split(':')[0]}/{p.split(':')[1]}->{p.split(':')[2]}" for p in self.ports]
        return f"firewall rules of {self.env} ({self.backend}: {', '.join(what) or 'none'})"

    def _backend(self) -> str:
        return self.backend

    def rules(self) -> list[Rule]:
        ports = tuple((p, int(h), int(e)) for p, h, e in (x.split(":") for x in self.ports))
        return env_rules(self.env, bridge=self.bridge, address=self.address, nat=self.nat,
                         isolate=self.isolate, ports=ports, subnet=self.subnet)


@dataclass(frozen=True)
class AntiSpoof(_TaggedRules):
    """Environment `env` pinned to its bridge port `port` (the host side of its veth): frames
    from the port must carry `mac` (its peer's MAC), IPv4 `address`, and ARP both, or they are
    dropped (table bridge envctl), so root in one environment cannot claim another's address
    and take its traffic. Planned before the veth, so the port never exists unpinned."""

    kind = "antispoof"
    env: str
    port: str
    mac: str
    address: str

    def ident(self) -> str:
        return self.env

    def describe(self) -> str:
        return f"anti-spoofing of {self.env} on {self.port} (its MAC and {self.address})"

    def _backend(self) -> str:
        return "nftables-bridge"

    def rules(self) -> list[PortRule]:
        return port_rules(self.env, port=self.port, mac=self.mac, address=self.address)
