"""The environment's service as a resource: its supervisor process (envctl.runtime.service),
alive or not. Planned as the environment's last step, so `down` stops it first."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.resources.base import Check, Resource, Status

if TYPE_CHECKING:
    from envctl.host.context import Host


@dataclass(frozen=True)
class Service(Resource):
    """The supervisor of environment `env`'s service, running `command` (an argv) under the
    restart policy `restart` (no / on-failure / always) with `restart_sec` as first backoff.

    check: PRESENT while the recorded supervisor runs (a crash loop backing off included, with
    its restarts in the detail); DRIFTED when it runs another command or policy (apply then
    restarts it); ABSENT when it is gone (killed, the host rebooted, or the service ended and
    its policy does not restart it), with why; for the monitor (host.options["monitor"]) a
    service its policy ended is PRESENT: healing respects the restart policy. Runtime state
    only: nothing to snapshot."""

    kind = "service"
    env: str
    command: tuple[str, ...]
    restart: str = "on-failure"
    restart_sec: float = 1.0

    def ident(self) -> str:
        return self.env

    def describe(self) -> str:
        return f"service {self.env} ({shlex.join(self.command)}; restart: {self.restart})"

    def _spec(self):  # noqa: ANN202 - runtime.service.Service, imported lazily
        from envctl.runtime import service as rs

        return rs.Service(self.env, tuple(self.command), self.restart, float(self.restart_sec))

    def check(self, host: Host) -> Check:
        from envctl.runtime import service as rs

        state = rs.read_state(host, self.env)
        if state is None:
            return Check.absent("not running: no supervisor recorded")
        if host.options.get("monitor") and rs.ended_by_policy(state, host.boot_id):
            # The monitor's check and heal: it ended as its policy says (`restart: no`, or
            # `on-failure` after exit 0), so it stays ended. `status` still says it is
            # missing, and `envctl up`, an operator's, starts it again.
            return Check.present(f"ended as its policy says: {rs.summary(state)}")
        if not rs.alive(state, host.boot_id):
            what = state.get("state")
            if what in ("stopped", "failed"):
                return Check.absent(f"not running: {rs.summary(state)}")
            return Check.absent(f"not running: its supervisor (pid "
                                f"{(state.get('supervisor') or {}).get('pid')}) is gone")
        want = {"command": list(self.command), "restart": self.restart,
                "restart_sec": float(self.restart_sec)}
        have = {"command": list(state.get("command") or ()), "restart": state.get("restart"),
                "restart_sec": float(state.get("restart_sec") or 0)}
        return Check.compare(want, have, rs.summary(state))

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        from envctl.runtime import service as rs

        return "stops it" if rs.alive(rs.read_state(host, self.env), host.boot_id) else ""

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        from envctl.runtime import service as rs

        if self.check(host).status is Status.PRESENT:
            return  # already running this command
        # DRIFTED: another command or policy runs, and the new one replaces it. ABSENT: what a
        # dead supervisor left (its service cgroup, its record) goes first.
        rs.stop(host, self.env)
        rs.start(host, self._spec())

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        from envctl.runtime import service as rs

        rs.stop(host, self.env)
