"""Planning the environment's network: its namespace (bridge, veth, NAT come with their issue)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envctl.plan.builder import Plan
from envctl.resources.netns import NetNamespace

if TYPE_CHECKING:
    from envctl.host.facts import HostFacts
    from envctl.spec.models import EnvSpec


def plan_network(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    if spec.network is None:
        return
    plan.add(NetNamespace(spec.name))
