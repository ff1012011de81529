"""Planning `runtime.isolation`: whether this host can run the environment's programs the way
its spec asks (gVisor: runsc installed, the platform offered, GPUs passed through). Adds no
step: the level is recorded with the claims and read by every launch (envctl.runtime.gvisor).
The kvm platform adds /dev/kvm to the environment's device rules (planned before the cgroup):
runsc runs in the launch's cgroup, and its Sentry opens /dev/kvm."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envctl.plan.limits import GPU_DEVICES_KEY
from envctl.plan.rootfs import wants_rootfs
from envctl.plan.userns import USERNS_SIZE

if TYPE_CHECKING:
    from envctl.facts import HostFacts
    from envctl.plan.builder import Plan
    from envctl.spec.models import EnvSpec

# /dev/kvm (misc major 10, minor 232): the kvm platform's Sentry opens it, in the launch's cgroup.
KVM_DEVICE = "c 10:232 rw"
# The Debian package that ships runsc (envctl.host.runsc.PACKAGE; not imported: plan/ never
# imports host/).
RUNSC_PACKAGE = "runsc"


def plan_isolation(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    rt = spec.runtime
    _plan_userns(spec, facts, plan)
    _plan_host_network(spec, plan)
    if rt.isolation == "native":
        return
    platform = rt.gvisor.platform
    plan.resolved["isolation"] = f"gvisor ({platform})"
    if platform == "kvm":
        plan.resolved[GPU_DEVICES_KEY] = (*plan.resolved.get(GPU_DEVICES_KEY, ()), KVM_DEVICE)
    if not wants_rootfs(spec):
        plan.error(("runtime", "isolation"), "gVisor runs the environment's programs in its "
                   "root filesystem, and this spec has none: give it a rootfs section (e.g. "
                   "rootfs: {binaries: [sh]})")
    runsc = facts.runsc
    if runsc is None:
        return  # not read (a caller that plans without the host): nothing to check against
    if not runsc.path:
        plan.error(("runtime", "isolation"), "isolation: gvisor needs gVisor's runsc, which "
                   f"is not installed on this host (Debian package '{RUNSC_PACKAGE}': apt-get "
                   "install runsc)")
        return
    if runsc.problem:
        plan.error(("runtime", "isolation"), f"isolation: gvisor: {runsc.problem}")
        return
    if platform not in runsc.platforms:
        plan.error(("runtime", "gvisor", "platform"), (
            f"platform '{platform}' is not offered by this host's runsc ({runsc.version}), "
            f"which offers {', '.join(runsc.platforms)}"))
    if spec.gpus.wanted and not runsc.nvproxy:
        plan.error(("runtime", "isolation"), (
            f"a GPU environment cannot run under gVisor with this host's runsc "
            f"({runsc.version}): it has no --nvproxy, so the sandbox would see no GPU; use "
            "isolation: native, or a runsc with nvproxy (gVisor release 2023-06 or later)"))
    elif spec.gpus.wanted:
        plan.error(("runtime", "isolation"), (
            "GPUs under gVisor (runsc --nvproxy) are not wired into envctl yet: the sandbox "
            "would see no GPU; use isolation: native"))


def _plan_host_network(spec: EnvSpec, plan: Plan) -> None:
    """An environment without `network:` runs its jobs in the host's network namespace, as
    `docker run --network host` does: say so, since the partition is then no network
    boundary at all (docs/security.md)."""
    if spec.network is None and wants_rootfs(spec):
        plan.warn("no network: section: this environment's jobs share the host's network "
                  "namespace (every service on the host's 127.0.0.1, its abstract unix sockets, "
                  "its ports and interfaces), as `docker run --network host` does; give it a "
                  "network: section to isolate it")


def _plan_userns(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    """Root inside as the host sees it: the block of ids allocated for the environment's user
    namespace (recorded with the claims), or the host's root, which `plan` warns about."""
    rt = spec.runtime
    if rt.isolation != "native" or not wants_rootfs(spec):
        return
    if not rt.userns:
        plan.warn("runtime.userns is false: root inside this environment is root on the host, "
                  "held back by capabilities and the seccomp filter alone; a file it makes on a "
                  "data mount is root's, a set-id one too")
        plan.resolved["userns"] = "none (root inside is the host's root)"
        return
    if spec.name in facts.userns_refused:
        plan.error(("runtime", "userns"), f"{facts.userns_refused[spec.name]}; give the "
                   "environment another name, free the ids, or set runtime.userns: false")
        return
    base = facts.userns_assigned.get(spec.name)
    if base is not None:
        plan.resolved["userns"] = (f"root inside is host uid/gid {base} (block {base}-"
                                   f"{base + USERNS_SIZE - 1}); a job's own user keeps its "
                                   "host ids")
