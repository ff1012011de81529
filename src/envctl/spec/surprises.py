"""Values a spec may hold that are valid but rarely mean what they say: warnings, not errors."""

from __future__ import annotations

import math
from typing import Any

# `quota` is percent of one CPU (systemd's CPUQuota=), so a bare `quota: 1.5` is 1.5 % of one
# CPU, while Docker's --cpus and compose's `cpus:` read 1.5 as one and a half CPUs. Below this
# a bare number is far more likely CPUs than a percentage; a CPU count of 10 or more, as a
# bare quota, would be 10% or more: a slow environment rather than a silent surprise.
BARE_QUOTA_BELOW = 10


def surprises(data: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """(location, message) for each surprising value in a spec's plain data (as YAML read it,
    before validation: whether a number was written with `%` is gone after it)."""
    out: list[tuple[tuple[str | int, ...], str]] = []
    cpu = _get(data, "resources", "cpu")
    quota = cpu.get("quota") if isinstance(cpu, dict) else None
    if (isinstance(quota, int | float) and not isinstance(quota, bool) and math.isfinite(quota)
            and 0 < quota < BARE_QUOTA_BELOW):
        out.append((("resources", "cpu", "quota"), (
            f"quota {quota:g} is {quota:g}% of one CPU ({quota / 100:g} CPUs): a bare number "
            f"is percent, as systemd's CPUQuota= reads it. For {quota:g} CPUs write "
            f"quota: {quota * 100:g}% or cpus: {quota:g} (as docker run --cpus); to mean "
            f"{quota:g} percent, write quota: {quota:g}%")))
    return out


def _get(data: Any, *path: str) -> Any:
    for part in path:
        if not isinstance(data, dict):
            return None
        data = data.get(part)
    return data
