"""Planning the environment's network: netns, bridge, anti-spoofing, veth, addresses,
forwarding, firewall."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from envctl.plan.builder import Plan
from envctl.resources.bridge import Bridge
from envctl.resources.firewall import AntiSpoof, FirewallBase, FirewallRules, route_localnet
from envctl.resources.netns import NetNamespace, NetnsDir
from envctl.resources.sysctl import Sysctl
from envctl.resources.veth import IpConfig, Veth
from envctl.spec.naming import host_veth

if TYPE_CHECKING:
    from envctl.facts import HostFacts
    from envctl.spec.models import EnvSpec


def peer_mac(env: str) -> str:
    """The hardware address of environment `env`'s interface: `02:` (locally administered,
    unicast) and 5 bytes of a hash of the name, so it is known at plan time (anti-spoofing
    pins it to the port) and the same at every `up`."""
    digest = hashlib.sha256(f"envctl-mac:{env}".encode()).digest()
    return ":".join(f"{b:02x}" for b in (0x02, *digest[:5]))


def nft_installed(facts: HostFacts) -> bool:
    """Whether nft can be driven here, whatever the firewall backend: the `nft` fact when the
    host's facts carry it (envctl.host.firewall.nft_installed), else what auto-detection of the
    backend found (it picks nftables exactly when nft is installed)."""
    found = facts.extra.get("nft")
    return bool(found) if found is not None else facts.firewall == "nftables"


def plan_network(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    """In the order `up` needs them (teardown is the reverse): the namespace directory and the
    namespace, the bridge, the port's anti-spoofing rules (before the port exists, so it never
    exists unpinned), the veth pair into the namespace, its addresses and route, forwarding,
    then the firewall rules that refer to all of them, and with published ports the bridge's
    route_localnet. Shared tables and chains come right before the first rules that need
    them."""
    net = spec.network
    if net is None:
        return
    plan.add(NetnsDir())
    plan.add(NetNamespace(spec.name))
    plan.add(Bridge(net.bridge, str(net.bridge_address)), ("network", "bridge"))
    port, mac = host_veth(spec.name), peer_mac(spec.name)
    if nft_installed(facts):
        plan.add(FirewallBase("nftables-bridge"), ("network",))
        plan.add(AntiSpoof(spec.name, port, mac, str(net.address)), ("network",))
    else:
        plan.warn(f"anti-spoofing needs nftables (the nft command or libnftables), which is "
                  f"not installed: environments on bridge {net.bridge} can claim each other's "
                  "addresses; install the nftables package")
    plan.add(Veth(port, net.bridge, spec.name, net.interface, net.isolate, mac),
             ("network", "interface"))
    plen = net.subnet.prefixlen
    plan.add(IpConfig(spec.name, net.interface, f"{net.address}/{plen}", str(net.gateway_ip)),
             ("network", "address"))
    if net.nat or net.ports:
        # Routing between the bridge and the rest of the host; the planner dedups it with the
        # same sysctl asked for under host.sysctls.
        plan.add(Sysctl("net.ipv4.ip_forward", "1"), ("network",))
    backend = facts.firewall if net.firewall == "auto" else net.firewall
    plan.resolved["firewall"] = backend
    ports = tuple(f"{p.protocol}:{p.host}:{p.port}" for p in net.ports)
    if net.nat or net.ports or net.isolate:
        plan.add(FirewallBase(backend), ("network", "firewall"))
        plan.add(FirewallRules(spec.name, backend, net.bridge, str(net.address), net.nat,
                               net.isolate, ports, subnet=str(net.subnet)),
                 ("network", "firewall"))
    if net.ports:
        # Published ports answer on the host's loopback: the output DNAT of 127.0.0.1 leaves
        # by the bridge with a loopback source, which the kernel routes only with this. After
        # the rules, whose loopback guard must be there first (and, at teardown, still be
        # there until this is restored): see fwrules.loopback_rules.
        plan.add(Sysctl(route_localnet(net.bridge), "1"), ("network", "ports"))
