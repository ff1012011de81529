"""Planning host tuning: sysctls (and, with their issue, kernel modules and the CPU governor)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envctl.plan.builder import Plan
from envctl.resources.sysctl import Sysctl

if TYPE_CHECKING:
    from envctl.host.facts import HostFacts
    from envctl.spec.models import EnvSpec


def plan_host(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    for name, item in spec.host.sysctls.items():
        if name not in facts.sysctls:
            msg = f"this kernel ({facts.kernel}) has no sysctl {name}"
            if item.policy == "required":
                plan.error(("host", "sysctls", name), msg + " (policy: required)")
            else:
                plan.warn(msg + "; skipped (policy: best-effort)")
            continue
        plan.add(Sysctl(name, item.value), ("host", "sysctls", name))
