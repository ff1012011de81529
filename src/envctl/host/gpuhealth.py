"""GPU health, read-only: what says a GPU must not be given to anyone until it is reset.

A GPU is unfit when any of these holds (the conditions NVIDIA's own guidance and DCGM's health
checks drain a node on):

- a fatal XID since its last reset: 48 (double-bit ECC), 63/64 (row remapping / page
  retirement recorded or failed), 74 (NVLink), 79 (fallen off the bus), 92 (high single-bit
  ECC rate), 94/95 (contained / uncontained ECC error). Read from the kernel log
  (`<root>/dev/kmsg`, "NVRM: Xid (PCI:0000:3b:00): 79, …"), which holds what happened since
  boot; each finding carries its kmsg sequence number so that an operator's `--clear` after a
  reset forgets what came before it (the caller filters, see envctl.engine.quarantine);
- volatile uncorrectable ECC errors (nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE) > 0:
  the count since the last driver load or reset);
- row remapping pending or failed (nvmlDeviceGetRemappedRows: (corrected, uncorrected,
  isPending, failureOccurred); Ampere and newer);
- retired pages pending (nvmlDeviceGetRetiredPagesPendingStatus == NVML_FEATURE_ENABLED;
  before Ampere: later GPUs answer NOT_SUPPORTED);
- NVML_ERROR_GPU_IS_LOST from any of these calls.

NVML is asked under discovery's rule (envctl.host.gpus.nvml_refusal): never when it would
create device nodes. A call a GPU does not support is no evidence either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envctl.facts import GpuHostFacts

FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95})
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\): (\d+)")
# At most this much of the kernel log is read (its ring buffer is smaller on every distro).
MAX_KMSG_RECORDS = 1 << 16


@dataclass(frozen=True)
class Finding:
    """One piece of evidence against one GPU. `seq`: the kmsg record of an XID (0 otherwise)."""

    uuid: str
    index: int
    what: str  # "xid", "ecc", "row-remap", "retired-pages", "lost"
    detail: str
    seq: int = 0
    covers: tuple[str, ...] = ()  # its MIG devices' UUIDs (the same hardware)


def parse_kmsg(records: list[str]) -> list[tuple[int, str, int]]:
    """(sequence, "dddd:bb:dd" PCI prefix, XID) of each fatal NVRM Xid line among /dev/kmsg
    records ("6,1234,5678,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=…")."""
    out = []
    for rec in records:
        prefix, _, message = rec.partition(";")
        fields = prefix.split(",")
        # The driver's own record: the kernel's (facility 0 of the "facility<<3|level" field;
        # a write to /dev/kmsg is LOG_USER's) and starting with its "NVRM: " prefix. The same
        # words inside another record are anybody's: the kernel quotes what users give it
        # ("tmpfs: Unknown parameter '…'" for a mount in a user namespace of their own).
        found = _XID.match(message)
        if not found or len(fields) < 2 or not fields[1].isdigit() \
                or not fields[0].isdigit() or int(fields[0]) >> 3 != 0:
            continue
        xid = int(found.group(4))
        if xid in FATAL_XIDS:
            domain, bus, dev = (int(x, 16) for x in found.groups()[:3])
            out.append((int(fields[1]), f"{domain:04x}:{bus:02x}:{dev:02x}", xid))
    return out


def read_kmsg(root: Path) -> list[str]:
    """The records of <root>/dev/kmsg, read without waiting (one record a read(2), EAGAIN at
    the end; a plain file in tests ends with an empty read). [] when it cannot be read."""
    try:
        fd = os.open(root / "dev" / "kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    out: list[str] = []
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):  # a fake log (tests): records one a line
            with os.fdopen(os.dup(fd), "r", errors="replace") as f:
                return [line.rstrip("\n") for line in f][:MAX_KMSG_RECORDS]
        for _ in range(MAX_KMSG_RECORDS):
            try:
                data = os.read(fd, 8192)
            except OSError as exc:
                # EAGAIN: the end; EPIPE: the ring overwrote the next record, go on.
                if exc.errno == errno.EPIPE:
                    continue
                break
            if not data:
                break
            out.append(data.decode(errors="replace").split("\n", 1)[0])
    finally:
        os.close(fd)
    return out


def _xid_findings(root: Path, facts: GpuHostFacts) -> list[Finding]:
    by_pci = {g.pci[:-2]: g for g in facts.gpus if g.pci}  # "0000:3b:00.0" -> "0000:3b:00"
    out = []
    for seq, pci, xid in parse_kmsg(read_kmsg(root)):
        g = by_pci.get(pci)
        if g is not None and g.uuid:
            out.append(Finding(g.uuid, g.index, "xid", f"XID {xid} (kernel log record {seq})",
                               seq, tuple(m.uuid for m in g.mig_devices)))
    return out


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _lost(uuid: str, index: int) -> Finding:
    return Finding(uuid, index, "lost", "NVML: GPU is lost (fallen off the bus or its driver "
                   "state is broken)")


def _nvml_findings(nv: Any, facts: GpuHostFacts) -> list[Finding]:
    """What NVML says of each GPU of `facts` (matched by UUID, else by index: a lost GPU may
    not tell its UUID)."""
    by_index = {g.index: g for g in facts.gpus}
    by_uuid = {g.uuid: g for g in facts.gpus}
    lost_code = getattr(nv, "NVML_ERROR_GPU_IS_LOST", 15)
    out: list[Finding] = []
    for index in range(nv.nvmlDeviceGetCount()):
        fallback = by_index.get(index)
        uuid = fallback.uuid if fallback else ""

        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nv.nvmlDeviceGetUUID(h))
        except nv.NVMLError as exc:
            if exc.value == lost_code:  # else: this GPU cannot be read now, no evidence
                out.append(_lost(uuid, index))
            continue
        g = by_uuid.get(uuid) or fallback
        if g is None:
            continue
        index = g.index
        checks = (
            ("ecc", nv.nvmlDeviceGetTotalEccErrors,
             (nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)),
            ("row-remap", getattr(nv, "nvmlDeviceGetRemappedRows", None), ()),
            ("retired-pages", getattr(nv, "nvmlDeviceGetRetiredPagesPendingStatus", None), ()),
        )
        for what, call, args in checks:
            if call is None:  # an nvidia-ml-py too old to have the call
                continue
            try:
                value = call(h, *args)
            except nv.NVMLError as exc:
                if exc.value == lost_code:
                    out.append(_lost(uuid, index))
                    break
                continue  # not supported (or not answered): no evidence either way
            if what == "ecc" and int(value) > 0:
                out.append(Finding(uuid, index, what, f"{int(value)} volatile uncorrectable "
                                   "ECC error(s) since the last reset"))
            elif what == "row-remap":
                _, unc, pending, failure = (int(x) for x in value)
                if failure:
                    out.append(Finding(uuid, index, what, "row remapping failed"))
                elif pending:
                    out.append(Finding(uuid, index, what, "row remapping pending (a reset "
                                       "applies it)"))
            elif what == "retired-pages" and int(value) == getattr(nv, "NVML_FEATURE_ENABLED", 1):
                out.append(Finding(uuid, index, what, "retired pages pending (a reset retires "
                                   "them)"))
    migs = {g.uuid: tuple(m.uuid for m in g.mig_devices) for g in facts.gpus}
    return [dataclasses.replace(f, covers=migs.get(f.uuid, ())) for f in out]


def probe(root: Path, facts: GpuHostFacts) -> tuple[list[Finding], str]:
    """Every finding against the GPUs of `facts`, and why NVML was not asked ("" when it was,
    or when no driver is loaded). Read-only: nothing is created, reset or cleared."""
    from envctl.host.gpus import nvml_refusal

    if not facts.gpus:
        return [], ""
    found = _xid_findings(root, facts)
    why = nvml_refusal(root)
    if why:
        return found, why
    try:
        import pynvml
    except ImportError as exc:
        return found, f"GPU health not read: the pynvml module cannot be imported ({exc})"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return found, f"GPU health not read: NVML failed to initialise: {exc}"
    try:
        found += _nvml_findings(pynvml, facts)
    except pynvml.NVMLError as exc:
        return found, f"GPU health not fully read: {exc}"
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    return found, ""
