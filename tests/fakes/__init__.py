"""Fake NVIDIA hosts for tests: a /proc and /dev tree as the driver writes it, the JSON that
drives the fake `pynvml` (tests/fakes/pynvml), and a check of CDI documents against the spec.

The /proc formats are the driver's own (NVIDIA open-gpu-kernel-modules,
kernel-open/nvidia/nv-procfs.c: "Model: \\t\\t %s", "GPU UUID: \\t %s", "Bus Location: \\t
%04x:%02x:%02x.%x", "Device Minor: \\t %u"; nv-frontend.c / nv.c for the /proc/devices names).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PYNVML_DIR = Path(__file__).resolve().parent / "pynvml"

PROPRIETARY_VERSION = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 "
                       "22:23:56 UTC 2024\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
OPEN_VERSION = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release "
                "Build  (dvs-builder@U22-I3-B17-02-5)  Tue Sep 23 09:55:41 UTC 2025\n"
                "GCC version:  gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04.2) \n")


@dataclass(frozen=True)
class FakeGpu:
    uuid: str
    pci: str  # as /proc writes it: 0000:3b:00.0
    minor: int
    name: str = "NVIDIA A100-SXM4-80GB"
    memory: int = 80 * 1024**3
    mig: bool | None = False  # None: NVML says "not supported"


def information(gpu: FakeGpu) -> str:
    """An information file, byte for byte as nv_procfs_read_gpu_info prints one."""
    return (f"Model: \t\t {gpu.name}\nIRQ:   \t\t 150\nGPU UUID: \t {gpu.uuid}\n"
            "Video BIOS: \t 92.00.45.00.06\nBus Type: \t PCIe\nDMA Size: \t 47 bits\n"
            f"DMA Mask: \t 0x7fffffffffff\nBus Location: \t {gpu.pci}\n"
            f"Device Minor: \t {gpu.minor}\nGPU Firmware: \t 550.54.15\nGPU Excluded:\t No\n")


def proc_devices(*, frontend: str = "nvidia-frontend", uvm: int | None = 235,
                 caps: int | None = 238, imex: int | None = None) -> str:
    """/proc/devices; `frontend` "nvidia" writes it as drivers without the frontend module do
    (195 nvidia, 195 nvidiactl). A block device named like a GPU one must never count."""
    lines = ["Character devices:", "  1 mem", "  4 /dev/vc/0", "  5 /dev/tty", " 10 misc",
             f"195 {frontend}"]
    if frontend == "nvidia":
        lines.append("195 nvidiactl")
    if uvm is not None:
        lines.append(f"{uvm} nvidia-uvm")
    if caps is not None:
        lines.append(f"{caps} nvidia-caps")
    if imex is not None:
        lines.append(f"{imex} nvidia-caps-imex-channels")
    lines += ["", "Block devices:", "  7 loop", "  8 sd", "240 nvidia-uvm", "259 blkext"]
    return "\n".join(lines) + "\n"


def make_tree(root: Path, gpus: list[FakeGpu], *, version: str | None = PROPRIETARY_VERSION,
              devices: str | None = None, nodes: bool = False, uvm: int = 235) -> Path:
    """A fake host under `root`: proc/devices, proc/driver/nvidia/{version,gpus/*/information}
    and, with `nodes` (root only), real character nodes under dev/."""
    proc = root / "proc"
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "devices").write_text(devices if devices is not None else proc_devices(uvm=uvm))
    if version is not None:
        drv = proc / "driver" / "nvidia"
        drv.mkdir(parents=True, exist_ok=True)
        (drv / "version").write_text(version)
        for g in gpus:
            d = drv / "gpus" / g.pci
            d.mkdir(parents=True)
            (d / "information").write_text(information(g))
    (root / "dev").mkdir(exist_ok=True)
    if nodes:
        wanted = [("nvidiactl", 195, 255), ("nvidia-uvm", uvm, 0), ("nvidia-uvm-tools", uvm, 1)]
        wanted += [(f"nvidia{g.minor}", 195, g.minor) for g in gpus]
        for name, major, minor in wanted:
            os.mknod(root / "dev" / name, stat.S_IFCHR | 0o666, os.makedev(major, minor))
    return root


def nvml_json(path: Path, gpus: list[FakeGpu], *, driver: str = "550.54.15",
              **extra: Any) -> Path:
    """The fake pynvml's configuration (FAKE_NVML_JSON), GPUs in NVML's bus-id spelling."""
    def bus_id(pci: str) -> str:
        domain, rest = pci.split(":", 1)
        return f"{int(domain, 16):08X}:{rest.upper()}"

    path.write_text(json.dumps({"driver": driver, **extra, "gpus": [
        {"uuid": g.uuid, "name": g.name, "minor": g.minor, "memory": g.memory, "mig": g.mig,
         "pci": bus_id(g.pci)} for g in gpus]}))
    return path


# ---------------------------------------------------------------- CDI checks

# Field names of each CDI structure (specs-go/config.go, spec 0.8.0).
SPEC_FIELDS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
DEVICE_FIELDS = {"name", "annotations", "containerEdits"}
EDITS_FIELDS = {"env", "deviceNodes", "hooks", "mounts", "intelRdt", "additionalGids"}
NODE_FIELDS = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid",
               "gid"}
MOUNT_FIELDS = {"hostPath", "containerPath", "options", "type"}
RELEASED = {"0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0"}
# pkg/parser: vendor and class start with a letter; a device name with a letter or digit.
VENDOR_OR_CLASS = re.compile(r"[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?")
DEVICE_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?")


def check_cdi(spec: dict[str, Any]) -> list[str]:
    """What the CDI spec and its reference validator (pkg/cdi/producer/validator) would refuse
    in `spec`; [] when nothing. Written from the spec, independently of envctl's code."""
    bad: list[str] = []

    def edits(where: str, e: dict[str, Any], *, non_empty: bool) -> None:
        bad.extend(f"{where}: unknown field {k}" for k in set(e) - EDITS_FIELDS)
        if non_empty and not any(e.get(k) for k in EDITS_FIELDS):
            bad.append(f"{where}: empty container edits")
        for v in e.get("env", []):
            if not isinstance(v, str) or v.find("=") <= 0:
                bad.append(f"{where}: env {v!r}")
        for n in e.get("deviceNodes", []):
            bad.extend(f"{where}: node field {k}" for k in set(n) - NODE_FIELDS)
            if not n.get("path"):
                bad.append(f"{where}: node without path")
            if n.get("type", "") not in ("", "b", "c", "u", "p"):
                bad.append(f"{where}: node type {n['type']!r}")
            if set(n.get("permissions", "")) - set("rwm"):
                bad.append(f"{where}: permissions {n['permissions']!r}")
            for k in ("major", "minor", "fileMode"):
                if k in n and not isinstance(n[k], int):
                    bad.append(f"{where}: {k} is not an integer")
        for m in e.get("mounts", []):
            bad.extend(f"{where}: mount field {k}" for k in set(m) - MOUNT_FIELDS)
            if not m.get("hostPath") or not m.get("containerPath"):
                bad.append(f"{where}: mount without hostPath/containerPath")
            if not isinstance(m.get("options", []), list):
                bad.append(f"{where}: mount options are not a list")

    bad.extend(f"unknown field {k}" for k in set(spec) - SPEC_FIELDS)
    if spec.get("cdiVersion") not in RELEASED:
        bad.append(f"cdiVersion {spec.get('cdiVersion')!r} is not a released version")
    vendor, _, cls = str(spec.get("kind", "")).partition("/")
    if not (VENDOR_OR_CLASS.fullmatch(vendor) and VENDOR_OR_CLASS.fullmatch(cls)):
        bad.append(f"kind {spec.get('kind')!r}")
    devices = spec.get("devices")
    if not devices:
        bad.append("no devices (a CDI spec needs at least one)")
    names = [d.get("name", "") for d in devices or []]
    if len(set(names)) != len(names):
        bad.append("a device name is used twice")
    for d in devices or []:
        bad.extend(f"device field {k}" for k in set(d) - DEVICE_FIELDS)
        if not DEVICE_NAME.fullmatch(d.get("name", "")):
            bad.append(f"device name {d.get('name')!r}")
        edits(f"device {d.get('name')}", d.get("containerEdits") or {}, non_empty=True)
    if not isinstance(spec.get("containerEdits", {}), dict):
        bad.append("containerEdits is not an object")
    else:
        edits("spec", spec.get("containerEdits", {}), non_empty=False)
    return bad
