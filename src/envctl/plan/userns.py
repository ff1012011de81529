"""Which host ids root inside each environment is: the user namespace every native launch
enters maps uid and gid 0 to the first id of a block of USERNS_SIZE host ids that belongs to
that environment alone while it is up. Chosen for all specs read together, so that no two
environments, no host user or group and no /etc/subuid or /etc/subgid range overlap. Pure:
facts in, blocks out.

The pool is 0x70000000-0x7FFDFFFF: above the ids systemd-nspawn picks for its containers
(0x00080000-0x6FFFFFFF) and below systemd's reserved foreign range (0x7FFE0000) and 2^31
(above which some tools read an id as negative). Each environment prefers the block its name
hashes to, so the same name on the same host gets the same ids again after a `down`, and
only moves when that block is taken."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from envctl.facts import HostFacts
    from envctl.spec.models import EnvSpec

USERNS_SIZE = 1 << 16
POOL_FIRST, POOL_END = 0x7000, 0x7FFE  # blocks (of USERNS_SIZE ids) of the pool


def wants_userns(spec: EnvSpec) -> bool:
    """Native launches run in a user namespace unless the spec opts out (gVisor's sandbox has
    its own); an environment without a root filesystem launches nothing."""
    from envctl.plan.rootfs import wants_rootfs

    return spec.runtime.userns and spec.runtime.isolation == "native" and wants_rootfs(spec)


def preferred_block(name: str) -> int:
    return POOL_FIRST + zlib.crc32(name.encode()) % (POOL_END - POOL_FIRST)


def assign_userns(specs: list[EnvSpec], facts: HostFacts
                  ) -> tuple[dict[str, int], dict[str, str]]:
    """Environment -> the first host id of its block, and environment -> why it has none.
    An environment that is up keeps the block its journal records (never moved while up);
    one that collides with a host id since is refused, naming what is in the way."""
    taken = list(facts.host_ids)
    for env, base in facts.userns_held.items():
        taken.append((base, base + USERNS_SIZE, f"environment '{env}'"))
    assigned: dict[str, int] = {}
    refused: dict[str, str] = {}
    for spec in sorted(specs, key=lambda s: s.name):
        if not wants_userns(spec):
            continue
        held = facts.userns_held.get(spec.name)
        if held is not None:
            clash = _clash(held, [t for t in taken if t[2] != f"environment '{spec.name}'"])
            if clash:
                refused[spec.name] = (f"its user namespace's host ids {held}-"
                                      f"{held + USERNS_SIZE - 1} now include {clash}")
            else:
                assigned[spec.name] = held
            continue
        first = preferred_block(spec.name)
        blocks = list(range(first, POOL_END)) + list(range(POOL_FIRST, first))
        base = next((b * USERNS_SIZE for b in blocks if not _clash(b * USERNS_SIZE, taken)),
                    None)
        if base is None:
            refused[spec.name] = "no block of host ids is free for its user namespace"
            continue
        assigned[spec.name] = base
        taken.append((base, base + USERNS_SIZE, f"environment '{spec.name}'"))
    return assigned, refused


def _clash(base: int, taken: list[tuple[int, int, str]]) -> str:
    """What in `taken` overlaps [base, base + USERNS_SIZE), or ""."""
    end = base + USERNS_SIZE
    return next((what for lo, hi, what in taken if lo < end and base < hi), "")
