"""NVIDIA GPU discovery, read-only: the driver's /proc files, its /dev nodes and NVML.

Everything is read under a root (Host.gpu_root: `ENVCTL_GPU_ROOT`, default "/") so tests
point it at a fake tree. What is read, in the formats the driver writes
(kernel-open/nvidia/nv-procfs.c and nv.c / nv-frontend.c of NVIDIA's open-gpu-kernel-modules):

- `proc/devices`, character section, "%3d %s": major 195 is named `nvidia-frontend` by drivers
  with the frontend module and `nvidia` (plus `nvidiactl`) by newer ones; `nvidia-uvm`,
  `nvidia-caps` and `nvidia-caps-imex-channels` have dynamic majors.
- `proc/driver/nvidia/version`: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.135  …"
  (proprietary) or "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release
  Build …" (open modules).
- `proc/driver/nvidia/gpus/<pci>/information`: "Model: \\t\\t NVIDIA A100…", "GPU UUID: \\t
  GPU-…", "Bus Location: \\t 0000:3b:00.0", "Device Minor: \\t 0", one "Key: value" a line.
- `dev/nvidia*`: the nodes, by stat (never opened).
- `proc/driver/nvidia-caps/mig-minors`: "config 1", "monitor 2", "gpu%u/gi%u/access %u",
  "gpu%u/gi%u/ci%u/access %u" (nvidia-caps' static table, keyed by the GPU's minor), and
  `proc/driver/nvidia/capabilities/gpuN/mig/giX[/ciY]/access` ("DeviceFileMinor: %u" …) for
  the instances that exist: the /dev/nvidia-caps/nvidia-cap<minor> node guarding each.

- `sys/bus/pci/devices/<pci>/numa_node` ("%d", -1 without NUMA) and `local_cpulist` ("0-31,64-95"):
  where each GPU sits, unless NVML's CPU and memory affinity answer.

NVML (the `pynvml` module of nvidia-ml-py, imported only here and only when asked) gives what
/proc does not: memory, MIG mode, the driver's own index order. It is asked only when the
driver is loaded and every node it would need exists: libnvidia-ml runs nvidia-modprobe to
create missing nodes, and discovery must create nothing. When NVML cannot answer, the GPUs
come from /proc and `problems` says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import stat
from pathlib import Path
from typing import Any

from envctl.errors import InputError
from envctl.facts import GpuFact, GpuHostFacts, MigFact

NVIDIA_MAJOR = 195  # fixed: NV_MAJOR_DEVICE_NUMBER
CTL_MINOR = 255  # /dev/nvidiactl
NVML_MODES = ("auto", "off")
# The /proc/devices names envctl records; 195 goes under "nvidia-frontend" whichever name the
# driver gave it.
_MAJOR_NAMES = {"nvidia-frontend": "nvidia-frontend", "nvidia": "nvidia-frontend",
                "nvidia-uvm": "nvidia-uvm", "nvidia-caps": "nvidia-caps",
                "nvidia-caps-imex-channels": "nvidia-caps-imex-channels"}
_VERSION = re.compile(r"(?<![\w.])(\d+\.\d+(?:\.\d+)?)(?![\w.])")
# "GPU-<hex and dashes>" (or MIG-…); an uninitialised GPU shows question marks instead.
_UUID = re.compile(r"(?:GPU|MIG)-[A-Za-z0-9-]+")
_PCI = re.compile(r"([0-9a-fA-F]+):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")


def nvml_mode(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """ENVCTL_NVML: "auto" (the default: NVML when the driver is there) or "off" (/proc only)."""
    mode = environ.get("ENVCTL_NVML") or "auto"
    if mode not in NVML_MODES:
        raise InputError(f"ENVCTL_NVML is '{mode}': allowed values are {', '.join(NVML_MODES)}")
    return mode



def nvml_refusal(root: Path, mode: str | None = None) -> str:
    """Why NVML may not be asked on this host now ("" when it may): ENVCTL_NVML=off, no driver
    loaded, or a node libnvidia-ml would create (nvidia-modprobe) is missing."""
    mode = mode or nvml_mode()
    if mode == "off":
        return "ENVCTL_NVML=off: NVML not asked"
    if not read_driver(root):
        return "no NVIDIA driver loaded"
    proc_gpus, _ = read_proc_gpus(root)
    nodes = device_nodes(root)
    missing = [n for n in ["nvidiactl"] + [f"nvidia{g.minor}" for g in proc_gpus]
               if n not in nodes]
    if missing:
        return (f"NVML not asked: {', '.join(str(root / 'dev' / n) for n in missing)} missing "
                "(NVML would create them)")
    return ""


# ---------------------------------------------------------------- parsers (pure)


def parse_devices(text: str) -> dict[str, int]:
    """The NVIDIA character-device majors of a /proc/devices text, keyed as GpuHostFacts keeps
    them; block devices (a second section) are never read as character devices."""
    from envctl.host.devices import parse_char_majors

    majors: dict[str, int] = {}
    for name, major in parse_char_majors(text).items():
        key = _MAJOR_NAMES.get(name)
        if key is not None:
            majors.setdefault(key, major)
    return majors


def parse_version(text: str) -> str:
    """The driver version in a /proc/driver/nvidia/version text ("" when there is none): the
    first dotted number on the NVRM line, which both the proprietary and the open module print
    after the module's name."""
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            found = _VERSION.search(line, len("NVRM version:"))
            return found.group(1) if found else ""
    return ""


def parse_information(text: str) -> dict[str, str]:
    """The "Key: value" lines of a /proc/driver/nvidia/gpus/<pci>/information file."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out


def normalize_pci(bus_id: str) -> str:
    """A PCI address as /proc and sysfs write it (0000:3b:00.0), from NVML's form too
    (00000000:3B:00.0); "" when it is not one."""
    found = _PCI.fullmatch(bus_id.strip())
    if not found:
        return ""
    domain, bus, dev, fn = found.groups()
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def parse_mig_minors(text: str) -> dict[str, int]:
    """The capability name -> nvidia-caps minor lines of a mig-minors text ("gpu0/gi1/access
    12"); lines of another shape are skipped, as nvidia-container-toolkit's parser does."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, minor = line.strip().rpartition(" ")
        if name and minor.isdigit():
            out.setdefault(name, int(minor))
    return out


def parse_capability(text: str) -> int | None:
    """The DeviceFileMinor of a /proc/driver/nvidia/capabilities/… access file."""
    minor = parse_information(text).get("DeviceFileMinor", "")
    return int(minor) if minor.isdigit() else None


def _pci_key(pci: str) -> tuple[int, ...]:
    found = _PCI.fullmatch(pci)
    return tuple(int(x, 16) for x in found.groups()) if found else (1 << 32,)


# ---------------------------------------------------------------- readers


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return None


def read_majors(root: Path) -> dict[str, int]:
    """The NVIDIA majors in <root>/proc/devices ({} when it cannot be read)."""
    try:
        text = _read(root / "proc" / "devices")
    except OSError:
        return {}
    return parse_devices(text or "")


def read_driver(root: Path) -> str:
    """The loaded driver's version from <root>/proc/driver/nvidia/version; "" when none is."""
    try:
        text = _read(root / "proc" / "driver" / "nvidia" / "version")
    except OSError:
        return ""
    return parse_version(text or "")


def read_proc_gpus(root: Path) -> tuple[list[GpuFact], list[str]]:
    """The GPUs under <root>/proc/driver/nvidia/gpus, indexed in PCI bus order (NVML's default
    order), and what could not be read. /proc knows neither memory nor MIG mode."""
    base = root / "proc" / "driver" / "nvidia" / "gpus"
    problems: list[str] = []
    found: list[tuple[str, dict[str, str]]] = []
    try:
        dirs = sorted(os.listdir(base))
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    except OSError as exc:
        return [], [f"read {base}: {exc.strerror}"]
    for name in dirs:
        path = base / name / "information"
        try:
            text = _read(path)
        except OSError as exc:
            problems.append(f"read {path}: {exc.strerror}")
            continue
        if text is None:
            continue
        info = parse_information(text)
        found.append((normalize_pci(info.get("Bus Location", "")) or normalize_pci(name)
                      or name, info))
    found.sort(key=lambda item: _pci_key(item[0]))
    gpus = []
    for index, (pci, info) in enumerate(found):
        uuid = info.get("GPU UUID", "")
        if not _UUID.fullmatch(uuid):
            problems.append(f"{base / pci / 'information'}: the driver does not show this "
                            f"GPU's UUID yet ('{uuid}'); it is known once the GPU is "
                            "initialised (persistence mode, or NVML)")
            uuid = ""
        minor = info.get("Device Minor", "")
        if not minor.isdigit():
            problems.append(f"{base / pci / 'information'}: no Device Minor")
        gpus.append(GpuFact(index=index, uuid=uuid, name=info.get("Model", ""),
                            minor=int(minor) if minor.isdigit() else 0, pci=pci))
    return gpus, problems


def device_nodes(root: Path) -> dict[str, tuple[int, int]]:
    """The character devices <root>/dev/nvidia* (not the nvidia-caps directories), by name,
    with their major and minor: stat only, nothing is opened."""
    dev = root / "dev"
    out: dict[str, tuple[int, int]] = {}
    try:
        names = sorted(n for n in os.listdir(dev) if n.startswith("nvidia"))
    except OSError:
        return out
    for name in names:
        try:
            st = os.stat(dev / name)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out[name] = (os.major(st.st_rdev), os.minor(st.st_rdev))
    return out


def read_mig_minors(root: Path) -> dict[str, int] | None:
    """<root>/proc/driver/nvidia-caps/mig-minors parsed; None when the driver has none."""
    try:
        text = _read(root / "proc" / "driver" / "nvidia-caps" / "mig-minors")
    except OSError:
        return None
    return None if text is None else parse_mig_minors(text)


def _mig_minors(root: Path, gpu: GpuFact, table: dict[str, int] | None,
                problems: list[str]) -> GpuFact:
    """`gpu` with each MIG device's access minors from mig-minors, checked against the
    driver's capability files of the instances that exist."""
    caps = root / "proc" / "driver" / "nvidia" / "capabilities" / f"gpu{gpu.minor}" / "mig"
    out = []
    for m in gpu.mig_devices:
        found: list[int | None] = []
        for key in (f"gi{m.gi}/access", f"gi{m.gi}/ci{m.ci}/access"):
            minor = (table or {}).get(f"gpu{gpu.minor}/{key}")
            try:
                text = _read(caps / key)
            except OSError:
                text = None
            listed = parse_capability(text) if text is not None else None
            if minor is None:
                problems.append(f"{m.uuid}: no {f'gpu{gpu.minor}/{key}'} in "
                                f"{root / 'proc/driver/nvidia-caps/mig-minors'}; the instance "
                                "cannot be given to an environment")
            elif listed is not None and listed != minor:
                problems.append(f"{caps / key} says minor {listed}, mig-minors {minor}: "
                                f"{m.uuid} cannot be given to an environment")
                minor = None
            found.append(minor)
        out.append(dataclasses.replace(m, gi_minor=found[0], ci_minor=found[1]))
    return dataclasses.replace(gpu, mig_devices=tuple(out))


# ---------------------------------------------------------------- NVML


class _NvmlUnavailable(Exception):
    """NVML could not answer; the message says why, for `problems`."""


def _text(value: Any) -> str:
    # pynvml returns bytes before nvidia-ml-py 11.515 and str after.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml_gpus() -> tuple[str, list[GpuFact]]:
    """The driver version and GPUs as NVML reports them; _NvmlUnavailable when it cannot."""
    try:
        import pynvml
    except ImportError as exc:
        raise _NvmlUnavailable(f"NVML not used: the pynvml module cannot be imported ({exc})") \
            from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise _NvmlUnavailable(f"NVML failed to initialise: {exc}") from None
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                current, pending = pynvml.nvmlDeviceGetMigMode(handle)
                mig, mig_pending = bool(current), bool(pending)
            except pynvml.NVMLError as exc:
                # GPUs without MIG (anything before Ampere) answer "not supported".
                if exc.value != pynvml.NVML_ERROR_NOT_SUPPORTED:
                    raise
                mig = mig_pending = False
            gpus.append(GpuFact(
                index=index,
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                minor=int(pynvml.nvmlDeviceGetMinorNumber(handle)),
                memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                mig=mig,
                pci=normalize_pci(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId)),
                mig_pending=mig_pending,
                mig_devices=_nvml_mig(pynvml, handle, index) if mig else (),
                **_nvml_affinity(pynvml, handle),
            ))
        return driver, gpus
    except pynvml.NVMLError as exc:
        raise _NvmlUnavailable(f"NVML failed while listing GPUs: {exc}") from None
    finally:
        # Nothing is left to release when shutdown itself fails.
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


_CPU_WORDS, _NODE_WORDS = 64, 16  # affinity masks of 64-bit words: 4096 CPUs, 1024 nodes


def _bits(words: Any) -> tuple[int, ...]:
    """The set bits of an NVML affinity mask (an array of unsigned longs, 64 bits each)."""
    out = []
    for w, word in enumerate(words):
        word = int(word)
        while word:  # one step a set bit: most words of a 4096-CPU mask are 0
            low = word & -word
            out.append(w * 64 + low.bit_length() - 1)
            word ^= low
    return tuple(out)


def _nvml_affinity(pynvml: Any, handle: Any) -> dict[str, Any]:
    """A GPU's local CPUs and NUMA node as NVML's affinity calls give them ({} when this NVML
    has neither: sysfs is read instead)."""
    out: dict[str, Any] = {}
    try:
        cpus = _bits(pynvml.nvmlDeviceGetCpuAffinity(handle, _CPU_WORDS))
        nodes = _bits(pynvml.nvmlDeviceGetMemoryAffinity(
            handle, _NODE_WORDS, getattr(pynvml, "NVML_AFFINITY_SCOPE_NODE", 0)))
    except (pynvml.NVMLError, AttributeError):
        # Older libraries lack the calls (AttributeError: older nvidia-ml-py) or answer "not
        # supported": sysfs says the same from the PCI side.
        return out
    if cpus:
        out.update(local_cpus=cpus, affinity="nvml")
    if nodes:
        out.update(numa_node=nodes[0], affinity="nvml")
    return out


def _int_or_none(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.lstrip("-").isdigit() else None


def read_pci_affinity(root: Path, pci: str) -> tuple[int | None, tuple[int, ...]]:
    """The NUMA node (None: -1, no NUMA, or unreadable) and local CPUs of the PCI device `pci`
    under <root>/sys/bus/pci/devices."""
    from envctl.spec.units import parse_cpu_list

    base = root / "sys" / "bus" / "pci" / "devices" / pci
    try:
        node, cpus = _read(base / "numa_node"), _read(base / "local_cpulist")
    except OSError:
        return None, ()
    found = _int_or_none(node)
    try:
        local = parse_cpu_list(cpus.strip()) if cpus and cpus.strip() else ()
    except ValueError:
        local = ()
    return (found if found is not None and found >= 0 else None), local


def _with_affinity(root: Path, gpu: GpuFact, problems: list[str]) -> GpuFact:
    """`gpu` with where it sits: NVML's affinity when it gave one, else sysfs's; a problem
    when the two disagree (a BIOS that hides NUMA from one of them)."""
    from envctl.spec.units import format_cpu_list

    node, cpus = read_pci_affinity(root, gpu.pci) if gpu.pci else (None, ())
    if gpu.affinity == "nvml":
        if cpus and gpu.local_cpus and cpus != gpu.local_cpus:
            problems.append(f"GPU {gpu.index}: NVML's CPU affinity is "
                            f"{format_cpu_list(gpu.local_cpus)}, sysfs local_cpulist "
                            f"{format_cpu_list(cpus)}; NVML's is used")
        return dataclasses.replace(gpu, numa_node=gpu.numa_node if gpu.numa_node is not None
                                   else node, local_cpus=gpu.local_cpus or cpus)
    if node is None and not cpus:
        return gpu
    return dataclasses.replace(gpu, numa_node=node, local_cpus=cpus, affinity="sysfs")


def _nvml_mig(pynvml: Any, handle: Any, index: int) -> tuple[MigFact, ...]:
    """The MIG devices of a MIG-enabled GPU: each compute instance with its GPU instance's
    profile and placement. Read calls only (no instance is made or destroyed)."""
    names: dict[int, str] = {}  # profile id -> name, over NVML's profile indices
    for profile in range(getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 10)):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile)
        except pynvml.NVMLError as exc:
            # Profiles this GPU lacks answer "not supported" (or "invalid" on older drivers).
            if exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise
        name = _text(getattr(info, "name", "") or "").removeprefix("MIG ")
        # A v1 structure has no name: nvidia-smi's form from the slices and memory.
        names[int(info.id)] = name or f"{info.sliceCount}g.{round(info.memorySizeMB / 1024)}gb"
    out = []
    for n in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, n)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_NOT_FOUND:  # an unused index
                continue
            raise
        gi_id = int(pynvml.nvmlDeviceGetGpuInstanceId(mig))
        gi = pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id))
        out.append(MigFact(
            uuid=_text(pynvml.nvmlDeviceGetUUID(mig)), parent=index, gi=gi_id,
            ci=int(pynvml.nvmlDeviceGetComputeInstanceId(mig)),
            profile=names.get(int(gi.profileId), ""), profile_id=int(gi.profileId),
            start=int(gi.placement.start), size=int(gi.placement.size),
            memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(mig).total)))
    return tuple(sorted(out, key=lambda m: (m.gi, m.ci)))


# ---------------------------------------------------------------- discovery


def discover_gpus(root: Path, *, nvml: str = "auto") -> GpuHostFacts:
    """The NVIDIA driver, GPUs and majors under `root` (without `libraries`).

    nvml: "auto" asks NVML when the driver is loaded and its nodes exist, falling back to
    /proc/driver/nvidia (the reason in `problems`); "off" reads /proc only.

    Example: discover_gpus(Path("/")).gpus[0].uuid == "GPU-5a0c…"
    """
    if nvml not in NVML_MODES:
        raise InputError(f"nvml is '{nvml}': allowed values are {', '.join(NVML_MODES)}")
    majors = read_majors(root)
    driver = read_driver(root)
    proc_gpus, proc_problems = read_proc_gpus(root)
    nodes = device_nodes(root)
    gpus, source = proc_gpus, "proc"
    problems: list[str] = []
    if nvml == "auto" and driver:
        # NVML's library creates missing nodes (nvidia-modprobe): ask it only when none is.
        wanted = ["nvidiactl"] + [f"nvidia{g.minor}" for g in proc_gpus]
        missing = [n for n in wanted if n not in nodes]
        if missing:
            problems.append(f"NVML not used: {', '.join(str(root / 'dev' / n) for n in missing)}"
                            " missing (NVML would create them); GPUs read from /proc")
        else:
            try:
                nvml_driver, gpus = _nvml_gpus()
                source = "nvml"
                driver = driver or nvml_driver
            except _NvmlUnavailable as exc:
                problems.append(f"{exc}; GPUs read from /proc")
        if source == "nvml" and len(gpus) != len(proc_gpus):
            problems.append(f"NVML shows {len(gpus)} GPU(s), /proc/driver/nvidia/gpus "
                            f"{len(proc_gpus)}")
    if source == "proc":  # what /proc could not say matters only when it is the source
        problems += proc_problems
    gpus = [_with_affinity(root, g, problems) for g in gpus]
    if any(g.mig_devices for g in gpus):
        table = read_mig_minors(root)
        gpus = [_mig_minors(root, g, table, problems) for g in gpus]
    if driver:
        problems += _node_problems(root, gpus, majors, nodes)
    return GpuHostFacts(driver=driver, gpus=tuple(gpus), majors=majors,
                        source=source if gpus else "", problems=tuple(problems))


def _node_problems(root: Path, gpus: list[GpuFact], majors: dict[str, int],
                   nodes: dict[str, tuple[int, int]]) -> list[str]:
    """What an environment would miss: the UVM driver, or a node that is not the GPU's."""
    out = []
    if "nvidia-uvm" not in majors:
        out.append(f"no nvidia-uvm in {root / 'proc' / 'devices'}: CUDA needs the nvidia-uvm "
                   "module loaded")
    for name, want in [("nvidiactl", (NVIDIA_MAJOR, CTL_MINOR))] + [
            (f"nvidia{g.minor}", (NVIDIA_MAJOR, g.minor)) for g in gpus]:
        have = nodes.get(name)
        if have is not None and have != want:
            out.append(f"{root / 'dev' / name} is char {have[0]}:{have[1]}, not "
                       f"{want[0]}:{want[1]}")
    return out
