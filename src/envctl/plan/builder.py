"""The plan being built: ordered resources, warnings, resolved values and input errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envctl.errors import InputError
from envctl.resources.base import Resource

Loc = tuple[str | int, ...]


class PlanError(InputError):
    """The spec cannot be planned on this host; `issues` point at the fields to blame."""

    def __init__(self, env: str, issues: list[tuple[Loc, str]]):
        self.env = env
        self.issues = issues
        super().__init__("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in issues))


@dataclass
class Plan:
    env: str
    resources: list[Resource] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # Values resolved against the host (CPUs, bytes of memory), shown by `plan`.
    resolved: dict[str, Any] = field(default_factory=dict)
    errors: list[tuple[Loc, str]] = field(default_factory=list)

    def add(self, res: Resource, loc: Loc = ()) -> None:
        """Append a resource; the same key twice must be the same resource."""
        for existing in self.resources:
            if existing.key == res.key:
                if existing != res:
                    self.error(loc, f"{res.describe()} conflicts with {existing.describe()} "
                                    "planned from another part of the spec")
                return
        self.resources.append(res)

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def error(self, loc: Loc, message: str) -> None:
        self.errors.append((loc, message))

    def finish(self) -> Plan:
        if self.errors:
            raise PlanError(self.env, self.errors)
        return self
