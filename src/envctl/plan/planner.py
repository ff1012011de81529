"""The planner: spec + host facts -> ordered resources. Pure: it never touches the host."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envctl.plan import access, base, cgroup, gpus, host, isolation, network, rootfs
from envctl.plan.builder import Plan
from envctl.resources.service import Service

if TYPE_CHECKING:
    from envctl.facts import HostFacts
    from envctl.spec.models import EnvSpec

# Order matters: teardown is this list reversed. Directories first (state lives there), host
# tuning before the objects that rely on it (modules before devices, ip_forward before NAT),
# the namespace before anything placed in it (the rootfs's /sys is its netns's). The GPU
# section only resolves: its nodes and rules feed the rootfs's /dev and the cgroup allow-list.
# The service runs in all of it, so it comes last and `down` stops it first.


def plan_service(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    """The environment's service (envctl.runtime.service), entered like any job: it needs the
    rootfs and its mount namespace."""
    if spec.service is None:
        return
    if not rootfs.wants_rootfs(spec):
        plan.error(("service",), "the service runs inside the environment's root filesystem, "
                   "and this spec has none: give it a rootfs section (e.g. rootfs: {binaries: "
                   "[sh]})")
        return
    svc = spec.service
    plan.add(Service(spec.name, tuple(svc.command), svc.restart, float(svc.restart_sec)),
             ("service",))


# isolation before cgroup: the kvm platform adds a device rule. access makes nothing: it only
# checks that the users and groups named exist here.
SECTIONS = (access.plan_access, base.plan_dirs, host.plan_host, gpus.plan_gpus,
            isolation.plan_isolation, network.plan_network, rootfs.plan_rootfs,
            cgroup.plan_cgroup, plan_service)


def plan_env(spec: EnvSpec, facts: HostFacts) -> Plan:
    """The ordered resources that make the host match `spec`; PlanError names what cannot be."""
    plan = Plan(spec.name)
    for section in SECTIONS:
        section(spec, facts, plan)
    return plan.finish()
