"""A GPU's MIG mode (on for the environments that carve it, given back as found) and the MIG
instances envctl makes on it: a GPU instance at one placement with the compute instance that
spans it, made through NVML (host.mig) and destroyed only when envctl's journal says it made
it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envctl.errors import HostError
from envctl.host.mig import mig_gpu
from envctl.resources.base import Check, Diff, Resource, Status

if TYPE_CHECKING:
    from envctl.host.context import Host


def slots(start: int, size: int) -> str:
    """Memory slices start..start+size-1 as `plan` shows them: "0-3", or "4" for one."""
    return f"{start}-{start + size - 1}" if size > 1 else str(start)


@dataclass(frozen=True)
class MigMode(Resource):
    """MIG mode of GPU `index` (`uuid`) is on. Shared: every environment with instances on the
    GPU holds it, and the mode found before the first goes back when the last leaves."""

    kind = "mig-mode"
    shared = True
    uuid: str
    index: int

    def ident(self) -> str:
        return self.uuid

    def describe(self) -> str:
        return f"MIG mode on GPU {self.index} ({self.uuid})"

    def _mode(self, host: Host) -> tuple[bool, bool]:
        with mig_gpu(host.gpu_root, self.index, self.uuid) as gpu:
            return gpu.mode()

    def check(self, host: Host) -> Check:
        current, pending = self._mode(host)
        if current:
            return Check.present()
        return Check(Status.DRIFTED, (Diff("mig", True, False),),
                     "a change is pending a GPU reset" if pending != current else "")

    def snapshot(self, host: Host) -> dict[str, Any]:
        return {"old": self._mode(host)[0]}

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        with mig_gpu(host.gpu_root, self.index, self.uuid) as gpu:
            current, pending = gpu.mode()
            if current:
                return  # already on
            if pending != current:
                # Someone asked for a mode change that only a reset makes real: envctl does
                # not reset a GPU (it would end every process on it).
                raise HostError(f"turn MIG mode on on {gpu.what}: a MIG mode change is pending "
                                "a GPU reset (nvidia-smi -r, or a reboot); `up` again after it")
            gpu.set_mode(True)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        if memo.get("old") is not False:
            return  # it was on before envctl (or unknown): left on
        with mig_gpu(host.gpu_root, self.index, self.uuid) as gpu:
            if gpu.mode()[0]:
                gpu.set_mode(False)

    def undo_note(self, host: Host, memo: dict[str, Any]) -> str:
        return "turned off, as found" if memo.get("old") is False else "left on, as found"


@dataclass(frozen=True)
class MigInstance(Resource):
    """A MIG instance of `profile` on GPU `index` (`uuid`) at memory slices start..start+size-1:
    one GPU instance and the compute instance spanning it. Never adopted: one that is there
    before envctl journals it is refused, so `down` destroys only what envctl made."""

    kind = "mig-instance"
    uuid: str
    index: int
    profile: str
    start: int
    size: int

    def ident(self) -> str:
        return f"{self.uuid}/{self.profile}@{self.start}"

    def describe(self) -> str:
        return (f"MIG {self.profile} on GPU {self.index} at slot"
                f"{'s' if self.size > 1 else ''} {slots(self.start, self.size)}")

    def _found(self, host: Host) -> tuple[bool, int] | None:
        """(MIG mode on, compute instances) of the instance; None when it is not there."""
        with mig_gpu(host.gpu_root, self.index, self.uuid) as gpu:
            if not gpu.mode()[0]:
                return None
            have = gpu.find(self.profile, self.start)
            return None if have is None else (True, have.cis)

    def check(self, host: Host) -> Check:
        found = self._found(host)
        if found is None:
            return Check.absent()
        if not found[1]:
            return Check(Status.DRIFTED, (Diff("compute instance", "present", None),))
        return Check.present()

    def snapshot(self, host: Host) -> dict[str, Any]:
        return {"existed": self._found(host) is not None}

    def refuses(self, memo: dict[str, Any]) -> str:
        if memo.get("existed"):
            return ("a MIG instance envctl did not make is there; name it by its MIG UUID "
                    "(`envctl gpus`) instead of asking for a new one")
        return ""

    def apply(self, host: Host, memo: dict[str, Any]) -> None:
        with mig_gpu(host.gpu_root, self.index, self.uuid) as gpu:
            gpu.create(self.profile, self.start, self.size)

    def remove(self, host: Host, memo: dict[str, Any]) -> None:
        if memo.get("existed"):
            return  # not envctl's (refused at `up`, so never journalled: defence in depth)
        with mig_gpu(host.gpu_root, self.index, self.uuid) as gpu:
            if gpu.mode()[0]:  # with MIG off there is no instance to destroy
                gpu.destroy(self.profile, self.start)
