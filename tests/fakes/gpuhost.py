"""A fake HGX host anyone can run: the NVIDIA driver's /proc and /dev, sysfs PCI topology, driver
libraries in a fake ld.so.cache and the fake NVML's JSON, under one directory.

    eval "$(python3 tests/fakes/gpuhost.py /tmp/hgx --gpus 8 --model H200 --numa 2 --mig)"
    envctl gpus

prints `export NAME=VALUE` lines (ENVCTL_GPU_ROOT, FAKE_NVML_JSON, PYTHONPATH) that point envctl
and the fake `pynvml` (tests/fakes/pynvml) at it. Formats are the driver's own:

- /proc/driver/nvidia-caps/mig-minors: "config 1", "monitor 2", then "gpu%u/gi%u/access %u" and
  "gpu%u/gi%u/ci%u/access %u" for every GPU minor (0-7 here), GI 0-14 and CI 0-7: the minors
  are static, 3 + 135·gpu + 9·gi (+ 1 + ci for a CI), as nvidia-caps allocates them (the
  k8s-dra-driver-gpu and Slurm read the same table).
- /proc/driver/nvidia/capabilities/mig/{config,monitor} and, for each instance that exists,
  capabilities/gpuN/mig/giX/access and giX/ciY/access: "DeviceFileMinor: %u\\nDeviceFileMode:
  %u\\nDeviceFileModify: 1\\n" (config 0400, monitor 0440, access 0444).
- /sys/bus/pci/devices/<pci>/{numa_node,local_cpulist,vendor,device,class} and
  /sys/devices/system/node/nodeN/cpulist: GPU i on node i·numa/gpus, the CPUs split evenly over
  the nodes (`--gpus 2 --numa 2 --cpus 2`: GPU 1 is local to CPU 1), and the same in the fake
  NVML's cpu_affinity / memory_affinity.
- /dev: nvidiaN, nvidiactl, nvidia-uvm(-tools) and nvidia-caps/nvidia-cap{1,2} plus each existing
  instance's access nodes (on a real host nvidia-modprobe makes those on demand), made with
  mknod when run as root; without root the tree has no nodes, and says so on stderr.

`--mig` turns MIG mode on for every GPU and lays out seven 1g instances on each (56 on an 8-GPU
host, one compute instance each); `--mig-layout 3g.71gb,2g.35gb,1g.18gb` lays out those instead.
Profiles and placements are those of `nvidia-smi mig -lgip` / `-lgipp` on an H100 80GB and an
H200 141GB (MIG user guide, "Supported MIG Profiles").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PYNVML_DIR = Path(__file__).resolve().parent / "pynvml"
DRIVER = "550.54.15"
UVM_MAJOR = 509
CAPS_MAJOR = 508
LIBDIR = "usr/lib/x86_64-linux-gnu"
# The bus numbers of an HGX H100/H200 baseboard's eight GPUs.
HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
MIG_GI_MAX = 15  # GI ids 0-14 per GPU (nvidia-caps' table)
MIG_CI_MAX = 8  # CI ids 0-7 per GI

# NVML profile index (NVML_GPU_INSTANCE_PROFILE_*: 1_SLICE 0, 2_SLICE 1, 3_SLICE 2, 4_SLICE 3,
# 7_SLICE 4, 1_SLICE_REV1 7, 1_SLICE_REV2 9) -> (profile id as nvidia-smi shows it, compute
# slices, memory slices, instances at most, the CI profile index of its one full CI, the
# placement starts of `nvidia-smi mig -lgipp`).
_PROFILES = {0: (19, 1, 1, 7, 0, range(7)), 7: (20, 1, 1, 1, 0, range(7)),
             9: (15, 1, 2, 4, 0, (0, 2, 4, 6)), 1: (14, 2, 2, 3, 1, (0, 2, 4)),
             2: (9, 3, 4, 2, 2, (0, 4)), 3: (5, 4, 4, 1, 3, (0,)), 4: (0, 7, 8, 1, 4, (0,))}
MODELS: dict[str, dict[str, Any]] = {
    "H100": {"name": "NVIDIA H100 80GB HBM3", "memory": 85_520_809_984,
             "profiles": {0: ("1g.10gb", 9856), 7: ("1g.10gb+me", 9856), 9: ("1g.20gb", 19968),
                          1: ("2g.20gb", 19968), 2: ("3g.40gb", 40192), 3: ("4g.40gb", 40192),
                          4: ("7g.80gb", 80768)}},
    "H200": {"name": "NVIDIA H200", "memory": 150_754_820_096,
             "profiles": {0: ("1g.18gb", 16384), 7: ("1g.18gb+me", 16384), 9: ("1g.35gb", 32768),
                          1: ("2g.35gb", 32768), 2: ("3g.71gb", 69632), 3: ("4g.71gb", 69632),
                          4: ("7g.141gb", 140288)}},
}


def gpu_uuid(index: int) -> str:
    digit = "123456789abcdef0"[index % 16]
    return f"GPU-{digit * 8}-aaaa-bbbb-cccc-{index:012x}"


def mig_uuid(index: int, gi: int, ci: int) -> str:
    digit = "123456789abcdef0"[index % 16]
    return f"MIG-{digit * 8}-{gi:04x}-{ci:04x}-9999-{index:012x}"


def gi_minor(gpu_minor: int, gi: int) -> int:
    return 3 + gpu_minor * MIG_GI_MAX * (1 + MIG_CI_MAX) + gi * (1 + MIG_CI_MAX)


def ci_minor(gpu_minor: int, gi: int, ci: int) -> int:
    return gi_minor(gpu_minor, gi) + 1 + ci


def profiles(model: str) -> list[dict[str, Any]]:
    """The GPU instance profiles of `model` as the fake NVML serves them."""
    out = []
    for index, (name, memory_mb) in MODELS[model]["profiles"].items():
        pid, slices, mem_slices, count, ci_profile, starts = _PROFILES[index]
        out.append({"index": index, "id": pid, "name": name, "slices": slices,
                    "memory_slices": mem_slices, "instances": count, "memory_mb": memory_mb,
                    "ci_profile": ci_profile,
                    "placements": [[s, mem_slices] for s in starts]})
    return out


def gi_id(size: int, start: int) -> int:
    """The GPU instance id NVML gives an instance at this placement (one id per slot: 7g 0,
    3g/4g 1-2, 2g 3-6, 1g 7-13), so ids stay within nvidia-caps' 0-14."""
    return {8: 0, 4: 1 + start // 4, 2: 3 + start // 2}.get(size, 7 + start)


def layout(model: str, names: list[str]) -> list[dict[str, Any]]:
    """GPU instances for profile `names`, each at the lowest free placement, one full compute
    instance each; ValueError when one does not fit."""
    table = {p["name"]: p for p in profiles(model)}
    used: set[int] = set()
    out = []
    for name in names:
        if name not in table:
            raise ValueError(f"no MIG profile {name} on {model} (profiles: {', '.join(table)})")
        p = table[name]
        for start, size in p["placements"]:
            slots = set(range(start, start + size))
            if not slots & used:
                used |= slots
                out.append({"id": gi_id(size, start), "profile": p["index"], "start": start,
                            "size": size, "cis": [{"id": 0, "profile": p["ci_profile"]}]})
                break
        else:
            raise ValueError(f"{name} does not fit in MIG layout {', '.join(names)} on {model}")
    return out


def _mknod(path: Path, mode: int, major: int, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
    os.chmod(path, mode)


def _libraries(root: Path) -> bool:
    """Tiny shared objects with the driver's sonames, in a fake ld.so.cache (needs gcc)."""
    if shutil.which("gcc") is None or shutil.which("ldconfig") is None:
        return False
    libdir = root / LIBDIR
    libdir.mkdir(parents=True)
    src = root / "x.c"
    src.write_text("int nv(void) { return 1; }\n")
    for lib, soname in (("libcuda", "libcuda.so.1"), ("libnvidia-ml", "libnvidia-ml.so.1")):
        subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o",
                        str(libdir / f"{lib}.so.{DRIVER}"), str(src)], check=True,
                       capture_output=True)
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc" / "ld.so.conf").write_text(f"/{LIBDIR}\n")
    subprocess.run(["ldconfig", "-r", str(root)], check=True, capture_output=True)
    return True


def make_host(root: Path, *, gpus: int = 8, model: str = "H200", numa: int = 2,
              cpus: int = 64, mig: bool = False, mig_layout: list[str] | None = None,
              nodes: bool | None = None, libraries: bool = True) -> dict[str, str]:
    """Make the fake host under `root` (which must not exist) and return the variables that
    point envctl at it. nodes: make device nodes (default: when root)."""
    if model not in MODELS:
        raise ValueError(f"model {model}: one of {', '.join(MODELS)}")
    if not 1 <= gpus <= 8 or not 1 <= numa <= gpus:
        raise ValueError("--gpus is 1-8 and --numa 1-GPUS")
    spec = MODELS[model]
    mig = mig or bool(mig_layout)
    instances = layout(model, mig_layout or [spec["profiles"][0][0]] * 7) if mig else []
    nodes = os.geteuid() == 0 if nodes is None else nodes
    root.mkdir(parents=True)
    proc, sys_, dev = root / "proc", root / "sys", root / "dev"
    nv = proc / "driver" / "nvidia"
    (nv / "gpus").mkdir(parents=True)
    (proc / "devices").write_text(
        "Character devices:\n  1 mem\n  5 /dev/tty\n136 pts\n195 nvidia-frontend\n"
        f"{UVM_MAJOR} nvidia-uvm\n{CAPS_MAJOR} nvidia-caps\n\nBlock devices:\n  8 sd\n")
    (nv / "version").write_text(
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {DRIVER}  Tue Mar  5 22:14:33 UTC "
        "2024\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    caps = nv / "capabilities"
    (caps / "mig").mkdir(parents=True)
    (caps / "mig" / "config").write_text("DeviceFileMinor: 1\nDeviceFileMode: 256\n"
                                         "DeviceFileModify: 1\n")
    (caps / "mig" / "monitor").write_text("DeviceFileMinor: 2\nDeviceFileMode: 288\n"
                                          "DeviceFileModify: 1\n")
    minors = ["config 1", "monitor 2"]
    for g in range(8):  # the driver's table is static: every GPU it could drive
        for gi in range(MIG_GI_MAX):
            minors.append(f"gpu{g}/gi{gi}/access {gi_minor(g, gi)}")
            minors += [f"gpu{g}/gi{gi}/ci{ci}/access {ci_minor(g, gi, ci)}"
                       for ci in range(MIG_CI_MAX)]
    (proc / "driver" / "nvidia-caps").mkdir(parents=True)
    (proc / "driver" / "nvidia-caps" / "mig-minors").write_text("\n".join(minors) + "\n")

    per_node = max(cpus // numa, 1)
    for n in range(numa):
        node = sys_ / "devices" / "system" / "node" / f"node{n}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text(f"{n * per_node}-{(n + 1) * per_node - 1}\n")
    listed, access_nodes = [], []
    for index in range(gpus):
        pci = f"0000:{HGX_BUSES[index]:02x}:00.0"
        uuid, node = gpu_uuid(index), index * numa // gpus
        info = nv / "gpus" / pci
        info.mkdir()
        (info / "information").write_text(
            f"Model: \t\t {spec['name']}\nIRQ:   \t\t 150\nGPU UUID: \t {uuid}\n"
            "Video BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
            f"DMA Mask: \t 0xfffffffffffff\nBus Location: \t {pci}\nDevice Minor: \t {index}\n"
            "GPU Excluded:\t No\n")
        pcidir = sys_ / "bus" / "pci" / "devices" / pci
        pcidir.mkdir(parents=True)
        for name, value in (("numa_node", node), ("vendor", "0x10de"),
                            ("device", "0x2335" if model == "H200" else "0x2330"),
                            ("class", "0x030200"),
                            ("local_cpulist", f"{node * per_node}-{(node + 1) * per_node - 1}")):
            (pcidir / name).write_text(f"{value}\n")
        gis = []
        for inst in instances:
            gis.append({**inst, "cis": [{**ci, "uuid": mig_uuid(index, inst["id"], ci["id"])}
                                        for ci in inst["cis"]]})
            gdir = caps / f"gpu{index}" / "mig" / f"gi{inst['id']}"
            gdir.mkdir(parents=True)
            (gdir / "access").write_text(f"DeviceFileMinor: {gi_minor(index, inst['id'])}\n"
                                         "DeviceFileMode: 292\nDeviceFileModify: 1\n")
            access_nodes.append(gi_minor(index, inst["id"]))
            for ci in inst["cis"]:
                (gdir / f"ci{ci['id']}").mkdir()
                (gdir / f"ci{ci['id']}" / "access").write_text(
                    f"DeviceFileMinor: {ci_minor(index, inst['id'], ci['id'])}\n"
                    "DeviceFileMode: 292\nDeviceFileModify: 1\n")
                access_nodes.append(ci_minor(index, inst["id"], ci["id"]))
        domain, rest = pci.split(":", 1)
        listed.append({"uuid": uuid, "name": spec["name"], "minor": index,
                       "memory": spec["memory"], "mig": mig, "mig_pending": mig,
                       "pci": f"{int(domain, 16):08X}:{rest.upper()}",
                       "mig_profiles": profiles(model), "gpu_instances": gis,
                       "gpm": True,  # Hopper: GPM, per MIG instance too
                       # NVML's view of where it sits: the same as sysfs's, as on a sound BIOS.
                       "cpu_affinity": list(range(node * per_node, (node + 1) * per_node)),
                       "memory_affinity": [node]})
    nvml = root / "nvml.json"
    nvml.write_text(json.dumps({"driver": DRIVER, "gpus": listed}, indent=1))

    dev.mkdir()
    if nodes:
        for name, major, minor in [(f"nvidia{i}", 195, i) for i in range(gpus)] + [
                ("nvidiactl", 195, 255), ("nvidia-uvm", UVM_MAJOR, 0),
                ("nvidia-uvm-tools", UVM_MAJOR, 1)]:
            _mknod(dev / name, 0o666, major, minor)
        _mknod(dev / "nvidia-caps" / "nvidia-cap1", 0o400, CAPS_MAJOR, 1)
        _mknod(dev / "nvidia-caps" / "nvidia-cap2", 0o440, CAPS_MAJOR, 2)
        for minor in access_nodes:
            _mknod(dev / "nvidia-caps" / f"nvidia-cap{minor}", 0o444, CAPS_MAJOR, minor)
    else:
        print(f"gpuhost: not root, so {dev} has no device nodes (discovery reads /proc only)",
              file=sys.stderr)
    if libraries and not _libraries(root):
        print("gpuhost: no gcc/ldconfig, so no driver libraries", file=sys.stderr)
    # The CDI file `up` writes goes to the fake host too, never the machine's /etc/cdi.
    return {"ENVCTL_GPU_ROOT": str(root), "FAKE_NVML_JSON": str(nvml),
            "ENVCTL_CDI_DIR": str(root / "etc" / "cdi"),
            "PYTHONPATH": f"{PYNVML_DIR}:{REPO / 'src'}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="where the fake host goes (must not exist)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--model", choices=sorted(MODELS), default="H200")
    ap.add_argument("--numa", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=64, help="CPUs of the host, split over NUMA")
    ap.add_argument("--mig", action="store_true", help="MIG on, seven 1g instances a GPU")
    ap.add_argument("--mig-layout", help="MIG on, these profiles on each GPU (comma-separated)")
    args = ap.parse_args(argv)
    try:
        env = make_host(args.dir, gpus=args.gpus, model=args.model, numa=args.numa,
                        cpus=args.cpus, mig=args.mig,
                        mig_layout=args.mig_layout.split(",") if args.mig_layout else None)
    except (ValueError, FileExistsError) as exc:
        print(f"gpuhost: {exc}", file=sys.stderr)
        return 2
    for name, value in env.items():
        print(f"export {name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
