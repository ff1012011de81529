"""The Container Device Interface (CDI) spec of the GPUs environments hold: a pure function of
plain values, so container runtimes (podman, containerd, CRI-O, docker) can run a container
with exactly one environment's GPUs (`--device envctl.io/gpu=<environment>`).

Written to the CDI specification (cncf-tags/container-device-interface, SPEC.md; field names
as in specs-go/config.go; checks as in pkg/cdi/producer/validator): `cdiVersion`, `kind`,
`devices` (each a `name` and non-empty `containerEdits`) and `containerEdits` applied with any
of them. Version 0.6.0 is declared: `hostPath` on a device node needs 0.5.0, and 0.6.0 is read
by every runtime of the last years.

Like `nvidia-ctk cdi generate`, the driver's libraries are bind-mounted read-only (ro, nosuid,
nodev) at their host paths. nvidia-ctk recreates soname symlinks with its own hook binary
(nvidia-cdi-hook create-symlinks); envctl ships no hook, so a symlink (libcuda.so.1) is
mounted as the file it names instead, which the dynamic loader finds all the same.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

from envctl.errors import InputError
from envctl.facts import GpuHostFacts, PlacedFile

CDI_VERSION = "0.6.0"
KIND = "envctl.io/gpu"
NVIDIA_MAJOR = 195  # /dev/nvidiaN and /dev/nvidiactl, fixed by the driver
CTL_MINOR = 255
NODE_MODE = 0o660
NODE_PERMISSIONS = "rw"  # cgroup access: read and write, never mknod
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")
# A device name as pkg/parser.ValidateDeviceName accepts it.
DEVICE_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?")
# The kind: a vendor (DNS-like) and a class, as pkg/parser validates them.
KIND_NAME = re.compile(r"[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?/[A-Za-z](?:[A-Za-z0-9_.-]*"
                       r"[A-Za-z0-9])?")
_SYMLINK_DEPTH = 40  # as the kernel's limit on nested symlinks (ELOOP)


def cdi_spec(envs: Mapping[str, Sequence[str]], gpu: GpuHostFacts,
             dev_root: str = "/dev",
             nodes: Mapping[str, Sequence[Sequence[Any]]] | None = None) -> dict[str, Any]:
    """The CDI spec: one device per environment holding GPUs, named after it.

    envs: environment name -> the UUIDs of the GPUs it holds (an environment with none gets
    no device: CDI refuses a device that changes nothing). gpu: this host's facts. dev_root:
    where the host's device nodes are (each node's `hostPath` when it is not /dev). nodes:
    environment -> the GPU nodes its own /dev has ((name, major or its /proc/devices name,
    minor, mode, gid), as planned): given, the device lists exactly those, with their group, so
    a container gets what the environment gets (nvidia-modeset, MIG capabilities included).

    Example: cdi_spec({"gpu-a": ["GPU-5a0c…"]}, facts)["devices"][0]["name"] == "gpu-a"
    """
    by_uuid = {g.uuid: g for g in gpu.gpus if g.uuid}
    major = gpu.majors.get("nvidia-frontend", NVIDIA_MAJOR)
    devices = []
    for env in sorted(envs):
        uuids = list(dict.fromkeys(envs[env]))  # each once, in the given order
        if not uuids:
            continue
        if not DEVICE_NAME.fullmatch(env):
            raise InputError(f"CDI device name '{env}': letters, digits, '_', '-', '.' and "
                             "':' only, starting and ending with a letter or digit")
        unknown = [u for u in uuids if u not in by_uuid]
        if unknown:
            raise InputError(f"environment '{env}' holds {', '.join(unknown)}, which this host "
                             "does not show")
        own = (nodes or {}).get(env)
        if own:
            listed = [_node(n[0], _major(n[1], gpu), n[2], dev_root, mode=n[3], gid=n[4])
                      for n in own]
        else:
            listed = [_node(f"nvidia{by_uuid[u].minor}", major, by_uuid[u].minor, dev_root)
                      for u in uuids]
        visible = ",".join(uuids)
        devices.append({"name": env, "containerEdits": {
            "env": [f"NVIDIA_VISIBLE_DEVICES={visible}", f"CUDA_VISIBLE_DEVICES={visible}"],
            "deviceNodes": listed,
        }})
    common: dict[str, Any] = {}
    nodes = [_node("nvidiactl", major, CTL_MINOR, dev_root)]
    uvm = gpu.majors.get("nvidia-uvm")
    if uvm is not None:  # without it CUDA cannot run; discovery reports that as a problem
        nodes += [_node("nvidia-uvm", uvm, 0, dev_root), _node("nvidia-uvm-tools", uvm, 1,
                                                                dev_root)]
    common["deviceNodes"] = nodes
    mounts = library_mounts(gpu.libraries)
    if mounts:
        common["mounts"] = mounts
    return {"cdiVersion": CDI_VERSION, "kind": KIND, "devices": devices,
            "containerEdits": common}


def _major(major: int | str, gpu: GpuHostFacts) -> int:
    """A node's major: a number, or a /proc/devices name (nvidia-uvm, nvidia-caps)."""
    if isinstance(major, int):
        return major
    if major not in gpu.majors:
        raise InputError(f"device '{major}' is not in /proc/devices: its driver is not loaded")
    return gpu.majors[major]


def _node(name: str, major: int, minor: int, dev_root: str, *, mode: int = NODE_MODE,
          gid: int | None = None) -> dict[str, Any]:
    node: dict[str, Any] = {"path": f"/dev/{name}"}
    host = posixpath.join(dev_root, name)
    if host != node["path"]:
        node["hostPath"] = host
    node.update({"type": "c", "major": major, "minor": minor, "fileMode": mode,
                 "permissions": NODE_PERMISSIONS})
    if gid is not None:
        node.update({"uid": 0, "gid": gid})
    return node


def library_mounts(libraries: Sequence[PlacedFile]) -> list[dict[str, Any]]:
    """Read-only bind mounts of the driver's libraries at their paths; a symlink is mounted as
    the file it finally names (followed through the other symlinks listed)."""
    by_source = {f.source: f for f in libraries}
    mounts: dict[str, dict[str, Any]] = {}
    for f in libraries:
        host = f.source
        link = f.link
        for _ in range(_SYMLINK_DEPTH):
            if not link:
                break
            host = posixpath.normpath(posixpath.join(posixpath.dirname(host), link))
            nxt = by_source.get(host)
            link = nxt.link if nxt is not None else ""
        mounts.setdefault(f.path, {"hostPath": host, "containerPath": f.path,
                                   "options": list(MOUNT_OPTIONS)})
    return [mounts[p] for p in sorted(mounts)]
