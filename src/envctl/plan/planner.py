"""The planner: spec + host facts -> ordered resources. Pure: it never touches the host."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envctl.plan import base, cgroup, host, network
from envctl.plan.builder import Plan

if TYPE_CHECKING:
    from envctl.facts import HostFacts
    from envctl.spec.models import EnvSpec

# Order matters: teardown is this list reversed. Directories first (state lives there), host
# tuning before the objects that rely on it (modules before devices, ip_forward before NAT),
# the namespace before anything placed in it.
SECTIONS = (base.plan_dirs, host.plan_host, network.plan_network, cgroup.plan_cgroup)


def plan_env(spec: EnvSpec, facts: HostFacts) -> Plan:
    """The ordered resources that make the host match `spec`; PlanError names what cannot be."""
    plan = Plan(spec.name)
    for section in SECTIONS:
        section(spec, facts, plan)
    return plan.finish()
