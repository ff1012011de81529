"""Checking a spec's `access:` against this host: every user and group it names exists here.

Nothing is made for it (access is decided at each request, envctl.runtime.access); a name the
host does not know would silently admit nobody, so `validate --host`, `plan` and `up` refuse
it at its line. Plain `validate` never reads the host's users.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from envctl.facts import HostFacts
    from envctl.plan.builder import Plan
    from envctl.spec.models import EnvSpec


def access_names(spec: EnvSpec, kind: str) -> set[str]:
    """The user (`kind` "users") or group ("groups") names of the spec's access lists."""
    if spec.access is None:
        return set()
    return {*getattr(spec.access.submit, kind), *getattr(spec.access.operate, kind)}


def plan_access(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    if spec.access is None:
        return
    for list_name in ("submit", "operate"):
        grant = getattr(spec.access, list_name)
        for i, name in enumerate(grant.users):
            if name not in facts.users:
                plan.error(("access", list_name, "users", i),
                           f"no user '{name}' on this host (its passwd and name service): "
                           "create it or remove it from the list")
        for i, name in enumerate(grant.groups):
            if name not in facts.groups:
                plan.error(("access", list_name, "groups", i),
                           f"no group '{name}' on this host (its group database and name "
                           "service): create it or remove it from the list")
