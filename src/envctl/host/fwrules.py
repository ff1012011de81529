"""The backend-neutral firewall rule model: the rules of one environment (and the
anti-spoofing rules on its bridge port), what a backend found in envctl's chains, and what
differs. Pure: no backend, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envctl.spec.naming import env_of_comment, rule_tag

# The chains envctl hooks, one per netfilter hook it needs (nat prerouting/output/postrouting,
# filter forward, and prerouting at raw priority, before conntrack and NAT: the loopback guard).
# Each backend maps them onto its own table/chains.
CHAINS = ("prerouting", "output", "postrouting", "forward", "raw-prerouting")

LOOPBACK = "127.0.0.0/8"


@dataclass(frozen=True)
class Rule:
    """One firewall rule for one environment, in terms both backends can express.

    `name` identifies the rule within its environment and says everything it does, so the
    comment (`envctl:ENV NAME`) both tags the rule and changes whenever the rule would."""

    env: str
    name: str
    chain: str
    action: str  # masquerade | dnat | drop
    saddr: str | None = None
    daddr: str | None = None
    iif: str | None = None
    oif: str | None = None
    not_oif: str | None = None
    proto: str | None = None  # tcp | udp
    dport: int | None = None
    local_daddr: bool = False  # the destination is an address of this host
    not_dnat: bool = False  # the connection was not DNATed (so port forwards stay reachable)
    dnat: bool = False  # the connection was DNATed (a published port)
    to_addr: str | None = None
    to_port: int | None = None

    @property
    def comment(self) -> str:
        return f"{rule_tag(self.env)} {self.name}"


def env_rules(env: str, *, bridge: str, address: str, nat: bool, isolate: bool,
              ports: tuple[tuple[str, int, int], ...], subnet: str = "") -> list[Rule]:
    """Every rule environment `env` needs, in order. `ports` are (protocol, host, env) ports;
    `subnet` the bridge's network (its hairpin rule)."""
    rules = []
    if nat:
        # Traffic from the environment leaving by any interface but its own bridge takes the
        # host's address; traffic between environments on the bridge keeps its source.
        rules.append(Rule(env, f"masquerade {address} out of !{bridge}", "postrouting",
                          "masquerade", saddr=address, not_oif=bridge))
    for proto, host_port, env_port in ports:
        to = f"{address}:{env_port}"
        # From outside: anything addressed to one of this host's addresses on the port.
        rules.append(Rule(env, f"dnat {proto}/{host_port} -> {to}", "prerouting", "dnat",
                          proto=proto, dport=host_port, local_daddr=True, to_addr=address,
                          to_port=env_port))
        # From the host itself, to any of its addresses, loopback included (`curl
        # 127.0.0.1:PORT`, as with Docker): see the loopback rules below.
        rules.append(Rule(env, f"dnat local+lo {proto}/{host_port} -> {to}", "output", "dnat",
                          proto=proto, dport=host_port, local_daddr=True, to_addr=address,
                          to_port=env_port))
    if ports and subnet:
        # Hairpin: another environment on the bridge reaching this one's published port
        # through a host address is DNATed back onto the bridge, and would get the answer
        # straight from this environment's address (on-link, and refused by port isolation),
        # not from the address it called. Masqueraded, the answer comes back through the host.
        rules.append(Rule(env, f"hairpin {subnet} -> {address} on {bridge}", "postrouting",
                          "masquerade", saddr=subnet, daddr=address, oif=bridge, dnat=True))
    if ports:
        rules += loopback_rules(env, bridge=bridge, address=address)
    if isolate:
        # Bridge-port isolation stops frames between isolated ports; these stop the detour
        # through the host's routing (an environment routing to another via its gateway).
        rules.append(Rule(env, f"isolate from {address} on {bridge}", "forward", "drop",
                          iif=bridge, oif=bridge, saddr=address, not_dnat=True))
        rules.append(Rule(env, f"isolate to {address} on {bridge}", "forward", "drop",
                          iif=bridge, oif=bridge, daddr=address, not_dnat=True))
    return rules


def loopback_rules(env: str, *, bridge: str, address: str) -> list[Rule]:
    """What a published port reached on the host's loopback needs, besides the output DNAT and
    `route_localnet` on the bridge (the sysctl the planner sets after these rules and restores
    before they go).

    A connection from 127.0.0.1 DNATed to the environment leaves by the bridge with a loopback
    source, which only route_localnet lets the kernel route; it is masqueraded to the bridge's
    address, since the environment could not answer 127.0.0.1. The answers come back addressed
    to the bridge and conntrack turns them into 127.0.0.1 after the raw hook.

    route_localnet also stops the kernel treating packets that *arrive* on the bridge with a
    loopback address as martians: an environment could then reach services bound to the
    host's 127.0.0.1 (CVE-2020-8558, Kubernetes' and Docker's fix: drop them). So everything
    coming in on the bridge that is addressed to, or claims to come from, 127.0.0.0/8 is
    dropped at raw priority, before conntrack and NAT see it: nothing legitimate arrives so.
    Not tied to the environment's address: every port of the bridge is covered (without
    nft there is no anti-spoofing, and another environment may share the bridge)."""
    return [
        Rule(env, f"loopback masquerade {LOOPBACK} -> {address} on {bridge}", "postrouting",
             "masquerade", saddr=LOOPBACK, daddr=address, oif=bridge, dnat=True),
        Rule(env, f"loopback guard to {LOOPBACK} in on {bridge}", "raw-prerouting", "drop",
             iif=bridge, daddr=LOOPBACK),
        Rule(env, f"loopback guard from {LOOPBACK} in on {bridge}", "raw-prerouting", "drop",
             iif=bridge, saddr=LOOPBACK),
    ]


@dataclass(frozen=True)
class PortRule:
    """One anti-spoofing rule on environment `env`'s bridge port `port`: a frame coming in
    from the port whose `field` ("ether saddr", "ip saddr", "arp saddr ip", "arp saddr
    ether") is not `value`, the environment's own (for "ether type": not one of the
    comma-separated `value`), is dropped."""

    env: str
    name: str
    chain: str
    port: str
    field: str
    value: str

    @property
    def comment(self) -> str:
        return f"{rule_tag(self.env)} {self.name}"


# The only protocols an environment's port carries: anything else (a VLAN tag, which would
# carry IPv4 and ARP past the checks below) is dropped. IPv6 is let through, pinned by MAC only:
# envctl gives environments no IPv6 address, and no host traffic goes to one.
PORT_ETHER_TYPES = "ip,arp,ip6"


def port_rules(env: str, *, port: str, mac: str, address: str) -> list[PortRule]:
    """Pin environment `env` to its bridge port: frames from it must carry its MAC and one of
    PORT_ETHER_TYPES, IPv4 from it its address, ARP from it both (so it cannot answer for, or
    announce, another's address and take its traffic). The comment names the values, so it
    changes with them."""
    return [PortRule(env, f"antispoof {field} {value} on {port}", "prerouting", port, field,
                     value)
            for field, value in (("ether saddr", mac), ("ether type", PORT_ETHER_TYPES),
                                 ("arp saddr ether", mac), ("ip saddr", address),
                                 ("arp saddr ip", address))]


@dataclass(frozen=True)
class Row:
    """One rule found in envctl's chains: where, its comment, and its content as the backend
    reads it back, normalised (a tuple of parts, each one match or the statement), so that
    it equals the content of the `Rule` it was made from while nobody edited it."""

    chain: str
    handle: int | None  # nft: the rule's handle (None: added here, not read back); iptables: None
    comment: str
    content: tuple[str, ...]


@dataclass
class Listing:
    """What a backend found of envctl's table/chains. `base` describes each hook point envctl
    needs (an nft base chain, an iptables chain or the jump to it) as found; `missing` when
    it is not there. The adapter's `base()` says what each should be."""

    base: dict[str, str] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)

    def comments(self, env: str) -> list[str]:
        return [r.comment for r in self.rows if env_of_comment(r.comment) == env]


def compare_rules(rows: list[Row], env: str, want: list[tuple[Any, tuple[str, ...]]]
                  ) -> tuple[list[Row], list[Any]]:
    """`env`'s rows to delete and the rules to add so that `env` has exactly `want` (each
    rule with its expected content): a row is kept only when chain, comment and content
    all match a wanted rule (each row matches at most one). A wanted rule is a `Rule` or a
    `PortRule`: anything with a chain and a comment."""
    pending = [r for r in rows if env_of_comment(r.comment) == env]
    add = []
    for rule, content in want:
        found = next((r for r in pending if (r.chain, r.comment, r.content)
                      == (rule.chain, rule.comment, content)), None)
        if found is None:
            add.append(rule)
        else:
            pending.remove(found)
    return pending, add


def rule_drift(rows: list[Row], env: str, want: list[tuple[Any, tuple[str, ...]]]
               ) -> list[tuple[str, str, str]]:
    """(field, want, have) for each of `env`'s rules that is missing, extra, or there under
    its comment with other content (a rule edited by hand): then only the differing parts."""
    extra, add = compare_rules(rows, env, want)
    contents = dict(want)
    out = []
    for rule in add:
        edited = next((r for r in extra if r.comment == rule.comment), None)
        if edited is None:
            out.append(("rule", rule.comment, "missing"))
            continue
        extra.remove(edited)
        content = contents[rule]
        gone = [p for p in content if p not in edited.content]
        new = [p for p in edited.content if p not in content]
        if rule.chain != edited.chain:
            gone, new = [f"in {rule.chain}", *gone], [f"in {edited.chain}", *new]
        if not gone and not new:  # the same parts in another order, or duplicated
            gone, new = list(content), list(edited.content)
        out.append((f"rule {rule.comment}", " ".join(gone) or "(nothing)",
                    " ".join(new) or "(nothing)"))
    out += [("rule", "absent", r.comment) for r in extra]
    return out
