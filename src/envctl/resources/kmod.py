"""Kernel modules: loaded with modprobe, unloaded at teardown only if envctl loaded them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.errors import HostError
from envctl.host.kmod import ABSENT, BUILTIN, LOADED
from envctl.resources.base import Check, Diff, Resource, Status

if TYPE_CHECKING:
    from envctl.host.context import Host


@dataclass(frozen=True)
class KernelModule(Resource):
    """Module `name` loaded, with `options` (`key=value`) passed to modprobe when envctl loads
    it. Shared: gpu environments all wanting `nvidia` hold it together; the state found before
    the first of them decides whether the last one unloads it.

    Options apply only when envctl loads the module: one the host already had keeps its own.

    Soft dependencies (modprobe's `softdep`) are resources of their own around the module that
    wants them, like its modules.dep dependencies; then each module of the chain is loaded
    `alone` (its own softdeps left to their resources), so each snapshot is taken before its
    own load, and `soft` marks one modprobe would go on without.
    """

    kind = "kmod"
    shared = True
    name: str
    options: tuple[str, ...] = ()
    alone: bool = False
    soft: bool = False

    def ident(self) -> str:
        return self.name

    def describe(self) -> str:
        opts = f" {' '.join(self.options)}" if self.options else ""
        return f"kernel module {self.name}{opts}{' (soft dependency)' if self.soft else ''}"

    def check(self, host: Host) -> Check:
        state = host.kmod.state(self.name)
        if state == LOADED:
            return Check.present()
        if state == BUILTIN:
            return Check.present("built into the kernel")
        return Check(Status.ABSENT, (Diff("state", "loaded", "not loaded"),))

    def snapshot(self, host: Host) -> dict[str, Any]:
        return {"state": host.kmod.state(self.name)}

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        if host.kmod.state(self.name) != ABSENT:
            return  # already loaded (or built in): nothing to do
        try:
            host.kmod.load(self.name, self.options, alone=self.alone)
        except HostError:
            if self.soft:
                # modprobe goes on without a soft dependency that fails to load (it is
                # optional by definition); so does envctl: `status` shows it missing.
                return
            raise
        # modprobe exits 0 for a name its config maps elsewhere: verify, never assume.
        if host.kmod.state(self.name) == ABSENT and not self.soft:
            raise HostError(f"load kernel module '{self.name}': modprobe succeeded but "
                            f"{self.name} is not in {host.kmod.proc_modules}")

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        if memo.get("state", ABSENT) != ABSENT:
            return  # the host had it before envctl: it stays
        usage = host.kmod.usage(self.name)
        if usage is None:
            return  # already unloaded
        if usage.in_use:
            # A process or another module uses it now; it stays loaded, as the host's.
            return
        host.kmod.unload(self.name)

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        state = memo.get("state", ABSENT)
        if state == LOADED:
            return "stays loaded: it was loaded before envctl"
        if state == BUILTIN:
            return "built into the kernel: nothing to undo"
        usage = host.kmod.usage(self.name)
        if usage is None:
            return ""
        return "stays loaded: in use" if usage.in_use else "unloaded: envctl loaded it"
