"""The CSV files of the setup envctl replaces, `gpu-metrics.csv` and `cpu-metrics.csv`, with
their original columns plus `Environment`, appended each tick and rotated by size.

    gpu-metrics.csv  Timestamp,Type,Utilization,Memory,Temperature,Environment
                     one row per GPU: Type GPU<index>, utilisation %, memory used MiB, C,
                     the environment that holds the GPU ("" when none); then one row per
                     MIG instance: Type GPU<index>/GI<id>/CI<id> (its parent, GPU and
                     compute instance ids, as nvidia-smi lists MIG devices), utilisation %
                     from GPM ("" without it), its memory used MiB, no temperature (an
                     instance has none of its own), the environment that holds it
    cpu-metrics.csv  Timestamp,Type,CPU_Utilization,Memory_Utilization,Environment
                     one row `host` (all CPUs %, memory used % of RAM, Environment ""), then
                     one row `environment` per environment that is up (% of its CPUs, memory
                     % of its limit, or of RAM when it has none)

Timestamps are UTC with their offset, `%Y-%m-%d %H:%M:%S+00:00` (the setup's `date` wrote
local time without one, which a DST change or a host in another zone makes ambiguous); an
unknown value is an empty field. Each file is opened, appended to and closed every tick (no
descriptor kept, so an outside logrotate works too). When one is larger than `max_bytes` it
becomes `NAME.1` (`NAME.1` becomes `NAME.2` …, `keep` old files) and a new one starts with the
header.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from envctl.monitor.collect import Snapshot

GPU_FILE = "gpu-metrics.csv"
CPU_FILE = "cpu-metrics.csv"
GPU_HEADER = "Timestamp,Type,Utilization,Memory,Temperature,Environment"
CPU_HEADER = "Timestamp,Type,CPU_Utilization,Memory_Utilization,Environment"
MAX_BYTES = 10 << 20
KEEP = 5
MIB = 1 << 20


def _num(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


class CsvWriter:
    """Appends a Snapshot's rows to the two files in `directory` (made when missing)."""

    def __init__(self, directory: Path, *, max_bytes: int = MAX_BYTES, keep: int = KEEP):
        self.dir = directory
        self.max_bytes = max_bytes
        self.keep = max(1, keep)

    def write(self, snap: Snapshot) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S+00:00", time.gmtime(snap.time))
        gpu_rows = [f"{stamp},GPU{g.index},{_num(g.util)},"
                    f"{_num(None if g.fb_used is None else g.fb_used // MIB)},{_num(g.temp)},"
                    f"{snap.gpu_env.get(g.uuid, '')}" for g in snap.gpus]
        gpu_rows += [f"{stamp},GPU{m.parent}/GI{m.gi}/CI{m.ci},{_num(m.util)},"
                     f"{_num(None if m.fb_used is None else m.fb_used // MIB)},,"
                     f"{snap.gpu_env.get(m.uuid, '')}" for m in snap.migs]
        cpu_rows = [f"{stamp},host,{_num(snap.host_cpu_percent)},"
                    f"{_num(snap.host_mem_percent)},"]
        for s in snap.envs:
            mem = s.mem_percent
            if mem is None and s.mem_usage is not None and snap.host_mem_total:
                mem = 100.0 * s.mem_usage / snap.host_mem_total
            cpu_rows.append(f"{stamp},environment,{_num(s.cpu_percent)},{_num(mem)},{s.env}")
        self.dir.mkdir(parents=True, exist_ok=True)
        if gpu_rows:
            self._append(GPU_FILE, GPU_HEADER, gpu_rows)
        self._append(CPU_FILE, CPU_HEADER, cpu_rows)

    def _append(self, name: str, header: str, rows: list[str]) -> None:
        path = self.dir / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size > self.max_bytes:
            self._rotate(path)
            size = 0
        text = "\n".join(rows) + "\n"
        if size == 0:
            text = header + "\n" + text
        # Never through a symlink, and only into a regular file (O_NONBLOCK: a FIFO must not
        # hang the tick): the directory may be another user's, who could otherwise name a root
        # file for root to append to.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                     | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", str(path))
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def _rotate(self, path: Path) -> None:
        """NAME -> NAME.1, NAME.1 -> NAME.2, …; the oldest beyond `keep` is dropped."""
        with contextlib.suppress(FileNotFoundError):
            path.with_name(f"{path.name}.{self.keep}").unlink()
        for n in range(self.keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                path.with_name(f"{path.name}.{n}").replace(path.with_name(f"{path.name}.{n + 1}"))
        path.replace(path.with_name(f"{path.name}.1"))
