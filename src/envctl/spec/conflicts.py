"""Cross-environment checks: what two specs claim that only one may have."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envctl.errors import Problem
from envctl.spec.naming import host_veth
from envctl.spec.resolve import dedicated_cpus
from envctl.spec.sysctls import canonical

if TYPE_CHECKING:
    from envctl.facts import HostFacts
    from envctl.spec.loader import LoadedSpec


def find_conflicts(specs: list[LoadedSpec], facts: HostFacts | None = None) -> list[Problem]:
    """Every conflict among `specs`, each reported on the second claimant with the first named,
    at the line of the second claim. A partial spec (what is valid of one with errors) claims
    only what its file says: nothing that stands in for a value taken out (LoadedSpec.knows)."""
    problems: list[Problem] = []

    def claim(table: dict, key: object, ls: LoadedSpec, loc: tuple, what: str) -> None:
        if not ls.knows(loc):
            return
        first = table.get(key)
        if first is None:
            table[key] = (ls, loc)
            return
        other, where = first[0], first[0].problem(first[1], "")
        at = f"{where.file}:{where.line}" if where.line is not None else where.file
        mine = "this spec" if other is ls else f"environment '{other.spec.name}'"
        problems.append(ls.problem(loc, f"{what} is already claimed by {mine} ({at})"))

    names: dict = {}
    veths: dict = {}
    cpus: dict = {}
    gpus: dict = {}
    wanting_gpus: list[tuple[LoadedSpec, None]] = []
    addresses: dict = {}
    ports: dict = {}
    bridges: dict[str, tuple[LoadedSpec, object]] = {}
    sysctls: dict[str, tuple[LoadedSpec, str]] = {}
    memory: list[tuple[LoadedSpec, int]] = []

    for ls in specs:
        s = ls.spec
        claim(names, s.name, ls, ("name",), f"name '{s.name}'")

        for cpu in _explicit_or_resolved_cpus(ls, facts):
            claim(cpus, cpu, ls, ("resources", "cpu", "dedicated"), f"dedicated CPU {cpu}")

        for i, idx in enumerate(s.gpus.indices):
            claim(gpus, ("index", idx), ls, _gpu_loc(ls, "indices", i), f"GPU {idx}")
        for i, uuid in enumerate(s.gpus.uuids):
            claim(gpus, ("uuid", uuid), ls, _gpu_loc(ls, "uuids", i), f"GPU {uuid}")
        if s.gpus.all:
            claim(gpus, "all", ls, ("gpus",), "every GPU")
        if s.gpus.wanted:
            # `all` takes every GPU: nobody else may have one (counts are matched to the GPUs
            # a host has by `validate --host`, `plan` and `up`).
            for other, _ in wanting_gpus:
                if (s.gpus.all or other.spec.gpus.all) and not (s.gpus.all and
                                                               other.spec.gpus.all):
                    problems.append(ls.problem(("gpus",), (
                        f"{'every GPU' if s.gpus.all else 'a GPU'} is wanted, but environment "
                        f"'{other.spec.name}' ({other.path}) has "
                        f"{'every GPU' if other.spec.gpus.all else 'GPUs of its own'}")))
                    break
            wanting_gpus.append((ls, None))

        net = s.network
        # A bridge's name and address are compared together: neither may be a default
        # standing in for a value with an error.
        bridge_known = ls.knows(("network", "bridge"), ("network", "bridge_address"))
        if net is not None and bridge_known:
            seen = bridges.get(net.bridge)
            if seen and seen[1] != net.bridge_address:
                problems.append(ls.problem(
                    ("network", "bridge_address"),
                    f"bridge '{net.bridge}' has address {seen[1]} in environment "
                    f"'{seen[0].spec.name}' ({seen[0].path}); environments sharing a bridge "
                    "must agree on it"))
            for other_name, (other, other_addr) in bridges.items():
                if other_name != net.bridge and other_addr.network.overlaps(net.subnet):
                    problems.append(ls.problem(
                        ("network", "bridge_address"),
                        f"subnet {net.subnet} overlaps {other_addr.network} of bridge "
                        f"'{other_name}' ({other.path})"))
            bridges.setdefault(net.bridge, (ls, net.bridge_address))
        if net is not None:
            # Derived names are hashed, so this almost never fires; when it does, say so
            # rather than let two environments fight over one interface.
            claim(veths, host_veth(s.name), ls, ("name",),
                  f"host interface name {host_veth(s.name)} (derived from the name)")
            claim(addresses, net.address, ls, ("network", "address"), f"address {net.address}")
            for i, pf in enumerate(net.ports):
                claim(ports, (pf.host, pf.protocol), ls, ("network", "ports", i),
                      f"host port {pf.host}/{pf.protocol}")

        # By canonical name: two spellings of one kernel value (net.ipv4.conf.all.forwarding and
        # net.ipv4.ip_forward) are one value; `spelled` keeps the name each spec used. Values
        # compare as the kernel prints them (runs of white space are one separator).
        wanted_sysctls: dict[str, str] = {}
        spelled: dict[str, str] = {}
        for name, item in s.host.sysctls.items():
            key, value = canonical(name), _value(item.value)
            if key in wanted_sysctls and wanted_sysctls[key] != value:
                problems.append(ls.problem(("host", "sysctls", name), (
                    f"wants {name}={value} but {spelled[key]}={wanted_sysctls[key]} in the same "
                    "spec is the same kernel value")))
                continue
            wanted_sysctls[key], spelled[key] = value, name
        if net is not None and (net.nat or net.ports) and ls.knows(("network", "nat")):
            # The network plan needs forwarding on; another environment must not want it off.
            forward = wanted_sysctls.setdefault("net.ipv4.ip_forward", "1")
            if forward != "1":
                problems.append(ls.problem(
                    ("host", "sysctls", spelled["net.ipv4.ip_forward"]),
                    f"wants {spelled['net.ipv4.ip_forward']}={forward}, but network.nat or "
                    "network.ports need net.ipv4.ip_forward=1"))
        for key, value in wanted_sysctls.items():
            name = spelled.get(key, key)
            seen_sysctl = sysctls.get(key)
            if seen_sysctl and seen_sysctl[1] != value:
                loc = ("host", "sysctls", name) if name in s.host.sysctls else ("network",)
                other = next((n for n in seen_sysctl[0].spec.host.sysctls if canonical(n) == key),
                             key)
                theirs = seen_sysctl[1] if other == name else \
                    f"{other}={seen_sysctl[1]} (the same kernel value)"
                problems.append(ls.problem(
                    loc,
                    f"wants {name}={value} but environment '{seen_sysctl[0].spec.name}' "
                    f"({seen_sysctl[0].path}) wants {theirs}; one host value serves both"))
            sysctls.setdefault(key, (ls, value))

        mx = s.resources.memory.max
        if mx is not None and facts is not None:
            memory.append((ls, mx.resolve(facts.memory_bytes)))

    shares = [(ls, ls.spec.resources.memory.max.percent) for ls in specs
              if ls.spec.resources.memory.max is not None
              and ls.spec.resources.memory.max.percent is not None]
    if facts is None and sum(p for _, p in shares) > 100:
        # Shares of host memory add up the same on every host.
        parts = ", ".join(f"{ls.spec.name} {p:g}%" for ls, p in shares)
        problems.append(shares[-1][0].problem(
            ("resources", "memory", "max"),
            f"memory limits add up to {sum(p for _, p in shares):g}% of host memory "
            f"({parts}), more than all of it"))
    if facts is not None and memory:
        total = sum(b for _, b in memory)
        if total > facts.memory_bytes:
            from envctl.spec.units import format_size

            parts = ", ".join(f"{ls.spec.name} {format_size(b)}" for ls, b in memory)
            last = memory[-1][0]
            problems.append(last.problem(
                ("resources", "memory", "max"),
                f"memory limits add up to {format_size(total)} ({parts}), more than the host's "
                f"{format_size(facts.memory_bytes)}"))
    return problems


def _gpu_loc(ls: LoadedSpec, form: str, i: int) -> tuple:
    """Where the i-th GPU index or UUID is written: `gpus: [0, 1]` or `gpus: {indices: […]}`."""
    return ("gpus", form, i) if ("gpus", form) in ls.marks else ("gpus", i)


def _explicit_or_resolved_cpus(ls: LoadedSpec, facts: HostFacts | None) -> tuple[int, ...]:
    ded = ls.spec.resources.cpu.dedicated
    if isinstance(ded, tuple):
        return ded
    if ded is None or facts is None:
        return ()
    try:
        return dedicated_cpus(ls.spec, facts).cpus
    except ValueError:
        return ()  # reported by the planner with its own message


def _value(text: str) -> str:
    """A sysctl value as the kernel compares it: runs of white space are one separator."""
    return " ".join(text.split())
