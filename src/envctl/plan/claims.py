"""What an environment holds that no other may have while it is up (its address, host ports,
dedicated CPUs, GPUs, derived interface name, its user namespace's block of host ids, the value
of each sysctl, the governor of each cpufreq policy, each module's options), and the conflicts
of specs with environments that are up but not among the specs read now (a renamed spec,
another config directory). Pure.

`up` records an environment's claims in its journal; commands that change the host read them
back for every environment that is up, so a spec elsewhere cannot take what it holds."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Any

from envctl.plan.host import cpufreq_policy, governor_cpus, module_name, module_options
from envctl.plan.userns import USERNS_SIZE
from envctl.spec.models import (
    DEFAULT_MAX_OUTPUT,
    DEFAULT_MAX_QUEUED_PER_USER,
    DEFAULT_MAX_STAGED_PER_USER,
)
from envctl.spec.naming import host_veth
from envctl.spec.resolve import dedicated_cpus
from envctl.spec.sysctls import canonical

if TYPE_CHECKING:
    from envctl.errors import Problem
    from envctl.facts import HostFacts
    from envctl.spec.loader import LoadedSpec
    from envctl.spec.models import EnvSpec


def spec_claims(spec: EnvSpec, facts: HostFacts | None) -> dict[str, Any]:
    """The claims of `spec` as plain JSON values (what the journal records)."""
    out: dict[str, Any] = {}
    net = spec.network
    if net is not None:
        out["address"] = str(net.address)
        out["bridge"] = {"name": net.bridge, "address": str(net.bridge_address)}
        out["ports"] = [f"{p.protocol}/{p.host}" for p in net.ports]
        out["veth"] = host_veth(spec.name)
    cpus: tuple[int, ...] = ()
    ded = spec.resources.cpu.dedicated
    if isinstance(ded, tuple):
        cpus = ded
    elif ded is not None and facts is not None:
        try:
            cpus = dedicated_cpus(spec, facts).cpus
        except ValueError:
            cpus = ()
    if cpus:
        out["cpus"] = list(cpus)
    sysctls = {canonical(name): item.value for name, item in spec.host.sysctls.items()}
    if net is not None and (net.nat or net.ports):
        sysctls.setdefault("net.ipv4.ip_forward", "1")  # the network plan turns it on
    if sysctls:
        out["sysctls"] = sysctls
    if facts is not None and spec.host.governor is not None:
        governors = {f"policy{cpufreq_policy(cpu, facts)[0]}": spec.host.governor.name
                     for cpu in governor_cpus(spec, facts)}
        if governors:
            out["governors"] = governors
    if spec.host.modules:
        out["modules"] = {module_name(m.name): list(module_options(m))
                          for m in spec.host.modules}
    gpus = spec.gpus
    assigned = facts.gpu_assigned.get(spec.name) if facts is not None else None
    if gpus.wanted and assigned is not None:
        # What this host resolved it to (a count or `all` as the GPUs it got): other specs'
        # resolutions and `envctl gpus` read the UUIDs back from the journal.
        index = {g.uuid: g.index for g in facts.gpu.gpus}
        out["gpus"] = {"all": False, "indices": [index[u] for u in assigned if u in index],
                       "uuids": list(assigned)}
        # Not a claim: where each GPU sits, for choosing a job's CPUs near its GPUs.
        parent = {**{g.uuid: g for g in facts.gpu.gpus},
                  **{u: g for u, (g, _) in facts.gpu.migs().items()}}
        near = {u: list(parent[u].local_cpus) for u in assigned
                if u in parent and parent[u].local_cpus}
        if near:
            out["gpu_cpus"] = near
    elif gpus.wanted:
        out["gpus"] = {"all": gpus.all, "indices": list(gpus.indices),
                       "uuids": list(gpus.uuids)}
    if spec.runtime.capabilities is not None:
        # Not a claim: recorded with them so that every launch reads it from the journal.
        out["capabilities"] = list(spec.runtime.capabilities)
    base = facts.userns_assigned.get(spec.name) if facts is not None else None
    if base is not None:
        # The block of host ids its user namespace maps (root inside is `base`).
        out["userns"] = {"base": base, "size": USERNS_SIZE}
    if spec.description:
        # Not a claim: what `status` and `top` show of an environment that is up.
        out["description"] = spec.description
    if spec.runtime.seccomp != "default":
        # Not a claim: the seccomp profile every launch installs (runtime.seccomp).
        out["seccomp"] = spec.runtime.seccomp
    if spec.runtime.nested_userns:
        out["nested_userns"] = True
    if spec.jobs.max_output != DEFAULT_MAX_OUTPUT:
        # Not a claim: the output bound every job's supervisor applies (jobs.max_output).
        out["max_output"] = spec.jobs.max_output
    limits = {k: v for k, v in (("max_running", spec.jobs.max_running),
                                 ("max_running_per_user", spec.jobs.max_running_per_user))
              if v is not None}
    for k, v, default in (("max_queued_per_user", spec.jobs.max_queued_per_user,
                           DEFAULT_MAX_QUEUED_PER_USER),
                          ("max_staged_per_user", spec.jobs.max_staged_per_user,
                           DEFAULT_MAX_STAGED_PER_USER)):
        if v != default:
            limits[k] = v
    if limits:
        # Not a claim: the queue's limits, read by every submit and kick (runtime.queue).
        out["jobs"] = limits
    if spec.runtime.isolation != "native":
        # Not a claim either: how every launch enters the environment (runtime.gvisor).
        out["isolation"] = {"level": spec.runtime.isolation,
                            "platform": spec.runtime.gvisor.platform}
    return out


def held_conflicts(specs: list[LoadedSpec], held: dict[str, tuple[str, dict[str, Any]]],
                   facts: HostFacts | None) -> list[Problem]:
    """Every claim of `specs` that an environment which is up (`held`: name -> (where its
    journal is, its recorded claims)) already holds. Environments with a spec among `specs`
    are not in `held`: their spec is checked against the others by spec.conflicts."""
    problems: list[Problem] = []
    for ls in specs:
        mine = spec_claims(ls.spec, facts)
        for env, (where, theirs) in sorted(held.items()):
            if env == ls.spec.name:
                continue
            for loc, what in _clashes(mine, theirs):
                if not ls.knows(loc, *_ALSO_READ.get(loc, ())):
                    continue  # a default standing in for a value with an error (partial)
                problems.append(ls.problem(loc, f"{what} is held by environment '{env}', which "
                                                f"is up (journal {where}) but has no spec here; "
                                                f"take it down first (envctl down {env})"))
    return problems


# What a clash reported at a place is also decided by.
_ALSO_READ: dict[tuple, tuple[tuple, ...]] = {
    ("network", "bridge_address"): (("network", "bridge"),),
    # The network plan turns forwarding on for nat (spec_claims).
    ("host", "sysctls", "net.ipv4.ip_forward"): (("network", "nat"),),
}


def _clashes(mine: dict[str, Any], theirs: dict[str, Any]) -> list[tuple[tuple, str]]:
    out: list[tuple[tuple, str]] = []
    if mine.get("address") and mine.get("address") == theirs.get("address"):
        out.append((("network", "address"), f"address {mine['address']}"))
    if mine.get("veth") and mine.get("veth") == theirs.get("veth"):
        out.append((("name",), f"host interface name {mine['veth']} (derived from the name)"))
    for i, port in enumerate(mine.get("ports", [])):
        if port in theirs.get("ports", []):
            out.append((("network", "ports", i), f"host port {port}"))
    mb, tb = mine.get("bridge"), theirs.get("bridge")
    if mb and tb:
        mnet = ipaddress.ip_interface(mb["address"]).network
        tnet = ipaddress.ip_interface(tb["address"]).network
        if mb["name"] == tb["name"] and mb["address"] != tb["address"]:
            out.append((("network", "bridge_address"), f"bridge '{mb['name']}' with address "
                        f"{tb['address']} (environments sharing a bridge must agree on it)"))
        elif mb["name"] != tb["name"] and mnet.overlaps(tnet):
            out.append((("network", "bridge_address"), f"subnet {tnet} of bridge "
                        f"'{tb['name']}'"))
    shared = sorted(set(mine.get("cpus", [])) & set(theirs.get("cpus", [])))
    if shared:
        out.append((("resources", "cpu", "dedicated"),
                    f"dedicated CPU{'s' if len(shared) > 1 else ''} "
                    f"{', '.join(map(str, shared))}"))
    for name, value in sorted(mine.get("sysctls", {}).items()):
        have = theirs.get("sysctls", {}).get(name)
        if have is not None and " ".join(have.split()) != " ".join(value.split()):
            out.append((("host", "sysctls", name), f"{name} (set to {have}; this spec wants "
                                                   f"{value}, and one host value serves both)"))
    for policy, name in sorted(mine.get("governors", {}).items()):
        have = theirs.get("governors", {}).get(policy)
        if have is not None and have != name:
            out.append((("host", "governor", "name"),
                        f"cpufreq {policy} (governor {have}; this spec wants {name})"))
    for module, options in sorted(mine.get("modules", {}).items()):
        have = theirs.get("modules", {}).get(module)
        if have is not None and have != options:
            out.append((("host", "modules"), f"kernel module {module} (loaded with options "
                        f"'{' '.join(have)}'; this spec wants '{' '.join(options)}')"))
    mu, tu = mine.get("userns"), theirs.get("userns")
    if mu and tu and mu["base"] < tu["base"] + tu["size"] and tu["base"] < mu["base"] + mu["size"]:
        out.append((("runtime", "userns"), f"user namespace host ids {tu['base']}-"
                    f"{tu['base'] + tu['size'] - 1}"))
    mg, tg = mine.get("gpus"), theirs.get("gpus")
    if mg and tg:
        if mg["all"] or tg["all"]:
            out.append((("gpus",), "every GPU" if tg["all"] else "a GPU"))
        else:
            both = sorted(set(mg["indices"]) & set(tg["indices"]))
            both += sorted(set(mg["uuids"]) & set(tg["uuids"]))
            if both:
                out.append((("gpus",), f"GPU {', '.join(map(str, both))}"))
    return out
