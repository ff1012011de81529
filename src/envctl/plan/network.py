"""Planning the environment's network: netns, bridge, veth, addresses, forwarding, firewall."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envctl.plan.builder import Plan
from envctl.resources.bridge import Bridge
from envctl.resources.firewall import FirewallRules
from envctl.resources.netns import NetNamespace
from envctl.resources.sysctl import Sysctl
from envctl.resources.veth import IpConfig, Veth
from envctl.spec.naming import host_veth

if TYPE_CHECKING:
    from envctl.facts import HostFacts
    from envctl.spec.models import EnvSpec


def plan_network(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    """In the order `up` needs them (teardown is the reverse): the namespace, the bridge, the
    veth pair into the namespace, its addresses and route, forwarding, then the firewall rules
    that refer to all of them."""
    net = spec.network
    if net is None:
        return
    plan.add(NetNamespace(spec.name))
    plan.add(Bridge(net.bridge, str(net.bridge_address)), ("network", "bridge"))
    plan.add(Veth(host_veth(spec.name), net.bridge, spec.name, net.interface, net.isolate),
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
        plan.add(FirewallRules(spec.name, backend, net.bridge, str(net.address), net.nat,
                               net.isolate, ports), ("network", "firewall"))
