"""The Container Device Interface (CDI) spec of the GPUs environments hold: a pure function of
plain values, so container runtimes (podman, containerd, CRI-O, docker) can run a container
with exactly one environment's GPUs (`--device envctl.io/gpu=<environment>`).

Written to the CDI specification (cncf-tags/container-device-interface, SPEC.md; field names
as in specs-go/config.go; checks as in pkg/cdi/producer/validator): `cdiVersion`, `kind`,
`devices` (each a `name` and non-empty `containerEdits`) and `containerEdits` applied with any
of them. Version 0.5.0 is declared, the lowest that has what the file uses (`hostPath` on a
device node), as the reference library's MinimumRequiredVersion picks: Debian 12's podman
(4.3) refuses 0.6.0 specs ("unresolvable CDI devices").

Devices: one per environment holding GPUs (named after it: everything it holds), and one per
MIG instance it holds (named by its MIG UUID: the parent's nvidiaN plus the instance's GPU and
compute instance access nodes, never the MIG config or monitor capability; with the mode and
group its holder's /dev gives them, as the environment's device has them). Only what an
environment holds is listed: a device no environment holds is not handed out.

As `nvidia-ctk cdi generate` does: NVIDIA_VISIBLE_DEVICES=void (the NVIDIA runtime hook must
not add GPUs of its own), and the driver's libraries bind-mounted read-only (ro, nosuid, nodev)
at their host paths. Where the host has nvidia-ctk's hook binary (`hook`), its
`create-symlinks` hook recreates the soname symlinks and `update-ldcache` adds the libraries'
folders to the container's ld.so.cache, with nvidia-ctk's arguments. envctl ships no hook of
its own, so without that binary a symlink (libcuda.so.1) is mounted as the file it names
instead, which the dynamic loader finds all the same in the default folders, and no hook is
listed (a hook whose binary is missing fails every container).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

from envctl.errors import InputError
from envctl.facts import GpuHostFacts, PlacedFile

CDI_VERSION = "0.5.0"
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
HOOK_NAME = "nvidia-cdi-hook"  # argv[0] of nvidia-ctk's hooks
# The nodes every GPU needs, in the common edits (and in each device with its holder's group).
SHARED_PATHS = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def cdi_spec(envs: Mapping[str, Sequence[str]], gpu: GpuHostFacts,
             dev_root: str = "/dev",
             nodes: Mapping[str, Sequence[Sequence[Any]]] | None = None, *,
             hook: str | None = None) -> dict[str, Any]:
    """The CDI spec: one device per environment holding GPUs, named after it, and one per MIG
    instance it holds, named by the instance's UUID.

    envs: environment name -> the UUIDs (GPU-… or MIG-…) it holds (an environment with none
    gets no device: CDI refuses a device that changes nothing). gpu: this host's facts.
    dev_root: where the host's device nodes are (each node's `hostPath` when it is not /dev).
    nodes: environment -> the GPU nodes its own /dev has ((name, major or its /proc/devices
    name, minor, mode, gid), as planned): given, the environment's device lists exactly those,
    with their group, so a container gets what the environment gets. hook: the host path of
    nvidia-ctk's hook binary, when there is one (the create-symlinks and update-ldcache hooks).

    Example: cdi_spec({"gpu-a": ["GPU-5a0c…"]}, facts)["devices"][0]["name"] == "gpu-a"
    """
    by_uuid = {g.uuid: g for g in gpu.gpus if g.uuid}
    migs = gpu.migs()
    major = gpu.majors.get("nvidia-frontend", NVIDIA_MAJOR)
    devices = []
    instances = []
    for env in sorted(envs):
        uuids = list(dict.fromkeys(envs[env]))  # each once, in the given order
        if not uuids:
            continue
        if not DEVICE_NAME.fullmatch(env):
            raise InputError(f"CDI device name '{env}': letters, digits, '_', '-', '.' and "
                             "':' only, starting and ending with a letter or digit")
        unknown = [u for u in uuids if u not in by_uuid and u not in migs]
        if unknown:
            raise InputError(f"environment '{env}' holds {', '.join(unknown)}, which this host "
                             "does not show")
        own = (nodes or {}).get(env)
        if own:
            listed = [_node(n[0], _major(n[1], gpu), n[2], dev_root, mode=n[3], gid=n[4])
                      for n in own]
        else:
            listed = []
            for u in uuids:
                listed += _nodes_of(u, by_uuid, migs, gpu, major, dev_root)
            listed = list({n["path"]: n for n in listed}.values())  # a parent once
        visible = ",".join(uuids)
        devices.append({"name": env, "containerEdits": {
            "env": [f"CUDA_VISIBLE_DEVICES={visible}"],
            "deviceNodes": listed,
        }})
        held = {n["path"]: n for n in listed} if own else {}
        for u in uuids:
            if u in migs and migs[u][1].gi_minor is not None and migs[u][1].ci_minor is not None:
                # As its holder's /dev has them (mode and group), with the shared nodes too:
                # the common edits' (root's group) would leave a container of the instance
                # alone unable to open what the environment's group opens.
                inst = [held.get(n["path"], n)
                        for n in _nodes_of(u, by_uuid, migs, gpu, major, dev_root)]
                inst += [held[p] for p in SHARED_PATHS if p in held]
                # CUDA_VISIBLE_DEVICES is left to the container: with two instances' devices
                # the runtime would have to pick one value of it.
                instances.append({"name": u, "containerEdits": {"deviceNodes": inst}})
    devices += sorted(instances, key=lambda d: d["name"])
    common: dict[str, Any] = {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}
    shared = [_node("nvidiactl", major, CTL_MINOR, dev_root)]
    uvm = gpu.majors.get("nvidia-uvm")
    if uvm is not None:  # without it CUDA cannot run; discovery reports that as a problem
        shared += [_node("nvidia-uvm", uvm, 0, dev_root), _node("nvidia-uvm-tools", uvm, 1,
                                                                 dev_root)]
    common["deviceNodes"] = shared
    if hook:
        mounts, links = library_files(gpu.libraries)
        hooks = []
        if links:
            hooks.append(_hook(hook, "create-symlinks",
                               [a for t, p in links for a in ("--link", f"{t}::{p}")]))
        folders = sorted({posixpath.dirname(m["containerPath"]) for m in mounts})
        if folders:
            hooks.append(_hook(hook, "update-ldcache",
                               [a for f in folders for a in ("--folder", f)]))
        if hooks:
            common["hooks"] = hooks
    else:
        mounts = library_mounts(gpu.libraries)
    if mounts:
        common["mounts"] = mounts
    return {"cdiVersion": CDI_VERSION, "kind": KIND, "devices": devices,
            "containerEdits": common}


def _nodes_of(uuid: str, by_uuid: Mapping[str, Any], migs: Mapping[str, tuple[Any, Any]],
              gpu: GpuHostFacts, major: int, dev_root: str) -> list[dict[str, Any]]:
    """The nodes one GPU or MIG instance needs: nvidiaN; for an instance, its parent's
    nvidiaN and its GPU and compute instance access nodes (nvidia-caps, from mig-minors)."""
    if uuid in by_uuid:
        minor = by_uuid[uuid].minor
        return [_node(f"nvidia{minor}", major, minor, dev_root)]
    parent, mig = migs[uuid]
    out = [_node(f"nvidia{parent.minor}", major, parent.minor, dev_root)]
    caps = gpu.majors.get("nvidia-caps")
    for cap in (mig.gi_minor, mig.ci_minor):
        if cap is not None and caps is not None:
            out.append(_node(f"nvidia-caps/nvidia-cap{cap}", caps, cap, dev_root))
    return out


def _hook(path: str, name: str, args: list[str]) -> dict[str, Any]:
    """A createContainer hook of nvidia-ctk's hook binary, with its argument conventions."""
    return {"hookName": "createContainer", "path": path, "args": [HOOK_NAME, name, *args]}


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


def library_files(libraries: Sequence[PlacedFile]) -> tuple[list[dict[str, Any]],
                                                           list[tuple[str, str]]]:
    """For the create-symlinks hook: read-only bind mounts of the libraries that are files,
    and (link target, link path) for those that are symlinks, as nvidia-ctk lists them."""
    mounts = {f.path: {"hostPath": f.source, "containerPath": f.path,
                       "options": list(MOUNT_OPTIONS)} for f in libraries if not f.link}
    links = sorted({(f.link, f.path) for f in libraries if f.link}, key=lambda t: t[1])
    return [mounts[p] for p in sorted(mounts)], links
