"""The CDI file checked by a real consumer: Debian's podman runs a container with
`--device envctl.io/gpu=<environment>` (or a MIG instance's UUID) from the file `up` wrote on
the fake GPU host, and the container's /dev has exactly that environment's GPU nodes, with the
same numbers; after `down` podman refuses the name.

podman runs in a mount namespace of its own inside the sandbox, so that nothing of it touches
the machine: /run is a fresh tmpfs there (podman's storage, run and tmp directories, its
configuration files, the CDI folder /var/run/cdi, which is a bind of the fake host's CDI
folder), /etc/cdi is hidden by a tmpfs where the machine has one (podman 4.3 has no setting
for its spec folders: it reads /etc/cdi and /var/run/cdi), and the storage driver is vfs
(no overlay mounts). The container gets no cgroup (`--cgroups disabled`: no libpod_parent on
the machine) and conmon stays in the test's cgroup; everything podman made goes with that
namespace when its last process (conmon) ends.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.fakes import gpuhost
from tests.integration.test_gpu_env import gpu_spec, inside

pytestmark = pytest.mark.root

# argv: CDI folder, podman's state folder (on the namespace's own /run), podman's arguments.
PODMAN_SH = r"""
set -e
cdi=$1 state=$2
shift 2
mount -t tmpfs envctl-podman /run
mkdir -p /run/cdi "$state"
mount --bind "$cdi" /run/cdi
# The machine's own CDI specs stay out (and ours never land there).
if [ -d /etc/cdi ]; then mount -t tmpfs envctl-podman /etc/cdi; fi
# crun refuses a hybrid host whose cgroup2 hierarchy has controllers ("cgroups in hybrid mode
# not supported, drop all controllers from cgroupv2"), even with --cgroups disabled: hidden.
if [ "$(stat -f -c %T /sys/fs/cgroup/unified 2>/dev/null)" = cgroup2fs ]; then
  mount -t tmpfs envctl-podman /sys/fs/cgroup/unified
fi
# The machine's containers.conf and storage.conf do not apply: only these.
: > "$state/containers.conf"
printf '[storage]\ndriver = "vfs"\nrunroot = "%s/runroot"\ngraphroot = "%s/root"\n' \
  "$state" "$state" > "$state/storage.conf"
export CONTAINERS_CONF="$state/containers.conf" CONTAINERS_STORAGE_CONF="$state/storage.conf"
exec podman --root "$state/root" --runroot "$state/runroot" --tmpdir "$state/tmp" \
  --storage-driver vfs --cgroup-manager cgroupfs --events-backend file "$@"
"""
# What the container prints: each node under /dev (and /dev/nvidia-caps), then its environment.
LIST = ('for f in /dev/* /dev/nvidia-caps/*; do [ -c "$f" ] && stat -c "%n %t:%T %a %g" "$f"; '
        "done; echo --; env")


@pytest.fixture
def podman_host(sandbox, tmp_path):
    for tool in ("podman", "busybox", "gcc", "ldconfig"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (scripts/install-deps installs it)")
    if not static(shutil.which("busybox")):
        pytest.skip("needs a static busybox as the container's root (busybox-static)")
    rootfs = tmp_path / "container"
    (rootfs / "bin").mkdir(parents=True)
    # A static busybox (busybox-static) is the container's whole root filesystem.
    shutil.copy(shutil.which("busybox"), rootfs / "bin" / "busybox")
    for name in ("sh", "stat", "env", "ls", "true"):
        (rootfs / "bin" / name).symlink_to("busybox")
    env = gpuhost.make_host(tmp_path / "gpuroot", gpus=2, numa=1)
    Path(env["ENVCTL_CDI_DIR"]).mkdir(parents=True)
    yield sandbox, env, rootfs
    # conmon outlives `podman run` by a moment; none of this test's may stay behind.
    assert wait_gone(f"/run/{sandbox.cgroup_parent}-podman"), "the test's conmon still runs"


def static(path: str) -> bool:
    """True when the ELF file at `path` asks for no program interpreter (PT_INTERP)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:5] != b"\x7fELF\x02":  # a 64-bit ELF file
            return False
        phoff, = struct.unpack_from("<Q", head, 0x20)
        size, count = struct.unpack_from("<HH", head, 0x36)
        f.seek(phoff)
        table = f.read(size * count)
    return all(struct.unpack_from("<I", table, i * size)[0] != 3 for i in range(count))


def podman(sb, env: dict[str, str], rootfs: Path, device: str,
           *argv: str) -> subprocess.CompletedProcess:
    """`podman run --rm --device envctl.io/gpu=DEVICE` of `argv` in a busybox container."""
    # In conmon's argv (found by wait_gone); podman wants a runroot of 50 characters at most.
    state = f"/run/{sb.cgroup_parent}-podman"
    return sb.run(
        "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", PODMAN_SH,
        "podman-cdi", env["ENVCTL_CDI_DIR"], state,
        "run", "--rm", "--network", "none", "--log-driver", "none", "--cgroups", "disabled",
        # The machine's hard RLIMIT_NOFILE may be below podman's default (1048576): crun's
        # setrlimit then fails ("Operation not permitted").
        "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
        "--device", f"envctl.io/gpu={device}", "--rootfs", str(rootfs), *argv, timeout=60)


def seen(res: subprocess.CompletedProcess) -> tuple[dict[str, str], dict[str, str]]:
    """The container's character devices (path -> "major:minor mode gid", numbers in hex) and
    its environment."""
    assert res.returncode == 0, res.stderr
    nodes, _, environ = res.stdout.partition("--\n")
    devs = dict(line.split(" ", 1) for line in nodes.splitlines())
    return devs, dict(line.split("=", 1) for line in environ.splitlines() if "=" in line)


def gpu_nodes(devs: dict[str, str]) -> dict[str, str]:
    return {p: n for p, n in devs.items() if "nvidia" in p}


def own_nodes(sb, env_name: str, env: dict[str, str]) -> dict[str, str]:
    """The GPU nodes of the environment's own /dev, as envctl made them."""
    out = inside(sb, env_name, "bash", "-c", "shopt -s nullglob; for f in /dev/nvidia* "
                 "/dev/nvidia-caps/*; do [ -c $f ] && stat -c '%n %t:%T %a %g' $f; done; true",
                 extra=env)
    assert out.returncode == 0, out.stderr
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def wait_gone(marker: str) -> bool:
    """True once no process has `marker` in its argv (bounded: 10 s)."""
    for _ in range(200):
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    alive.append(pid)
            except OSError:
                continue  # gone meanwhile
        if not alive:
            return True
        time.sleep(0.05)
    return False


def test_podman_gives_a_container_exactly_the_environments_nodes_until_its_down(podman_host):
    sb, env, rootfs = podman_host
    caps = f"{gpuhost.CAPS_MAJOR:x}"
    sb.write_spec("gpu-b", gpu_spec("gpu-b", "[1]"))
    sb.write_spec("mig-a", gpu_spec("mig-a", "{mig: [{gpu: 0, profile: 1g.18gb}]}"))
    res = sb.envctl("up", "mig-a", "gpu-b", env=env)
    assert res.returncode == 0, res.stderr
    cdi = Path(env["ENVCTL_CDI_DIR"]) / "envctl.yaml"
    names = [d["name"] for d in yaml.safe_load(cdi.read_text())["devices"]]
    assert names[:2] == ["gpu-b", "mig-a"] and len(names) == 3, names
    mig_uuid = names[2]
    assert mig_uuid.startswith("MIG-")
    (instance,) = json.loads(Path(env["FAKE_NVML_JSON"]).read_text())["gpus"][0]["gpu_instances"]
    gi = instance["id"]
    # Mode 0660 and the spec's group (gpus.group: video), as in the environment's /dev.
    mode = f"660 {grp.getgrnam('video').gr_gid}"
    access = {f"/dev/nvidia-caps/nvidia-cap{m}": f"{caps}:{m:x} {mode}"
              for m in (gpuhost.gi_minor(0, gi), gpuhost.ci_minor(0, gi, 0))}
    common = {"/dev/nvidiactl": f"c3:ff {mode}",
              "/dev/nvidia-uvm": f"{gpuhost.UVM_MAJOR:x}:0 {mode}",
              "/dev/nvidia-uvm-tools": f"{gpuhost.UVM_MAJOR:x}:1 {mode}"}

    # Each environment's device: exactly the GPU nodes of its own /dev, the same numbers.
    devs, environ = seen(podman(sb, env, rootfs, "mig-a", "sh", "-c", LIST))
    assert gpu_nodes(devs) == own_nodes(sb, "mig-a", env) == {
        "/dev/nvidia0": f"c3:0 {mode}", **common, **access}
    assert environ["CUDA_VISIBLE_DEVICES"] == mig_uuid
    assert environ["NVIDIA_VISIBLE_DEVICES"] == "void"
    devs, environ = seen(podman(sb, env, rootfs, "gpu-b", "sh", "-c", LIST))
    gpu_b = {"/dev/nvidia1": f"c3:1 {mode}", **common}
    assert gpu_nodes(devs) == own_nodes(sb, "gpu-b", env) == gpu_b
    assert environ["CUDA_VISIBLE_DEVICES"] == gpuhost.gpu_uuid(1)
    # The MIG instance's own device: its parent's nvidiaN and its access nodes, as its holder's
    # /dev has them, never the MIG config or monitor capability (nvidia-cap1, nvidia-cap2).
    devs, _ = seen(podman(sb, env, rootfs, mig_uuid, "sh", "-c", LIST))
    assert gpu_nodes(devs) == {"/dev/nvidia0": f"c3:0 {mode}", **common, **access}
    # The driver's libraries, bind-mounted read-only at their paths (a soname link as the
    # file it names: this host has no nvidia-cdi-hook to make the links).
    lib = f"/{gpuhost.LIBDIR}"
    res = podman(sb, env, rootfs, "gpu-b", "sh", "-c", f"ls {lib}; echo --; cat /proc/mounts")
    assert res.returncode == 0, res.stderr
    files, _, mounts = res.stdout.partition("--\n")
    assert sorted(files.split()) == sorted(f"{name}.so{v}" for name in ("libcuda", "libnvidia-ml")
                                           for v in (".1", f".{gpuhost.DRIVER}"))
    options = {m.split()[1]: set(m.split()[3].split(",")) for m in mounts.splitlines()
               if m.split()[1].startswith(lib)}
    assert len(options) == 4 and all({"ro", "nosuid", "nodev"} <= o for o in options.values())

    # After `down`, the file no longer offers the environment nor its instance.
    assert sb.envctl("down", "mig-a", env=env).returncode == 0
    for gone in ("mig-a", mig_uuid):
        res = podman(sb, env, rootfs, gone, "true")
        assert res.returncode != 0
        assert f"unresolvable CDI devices envctl.io/gpu={gone}" in res.stderr, res.stderr
    devs, _ = seen(podman(sb, env, rootfs, "gpu-b", "sh", "-c", LIST))
    assert gpu_nodes(devs) == gpu_b
    assert sb.envctl("down", "gpu-b", env=env).returncode == 0
    assert not cdi.exists()
    res = podman(sb, env, rootfs, "gpu-b", "true")
    assert "unresolvable CDI devices envctl.io/gpu=gpu-b" in res.stderr, res.stderr
    for name in ("mig-a", "gpu-b"):
        (sb.config_dir / f"{name}.yaml").unlink()
    assert sb.residue() == {}


def test_podman_runs_the_hooks_of_nvidia_ctk_with_envctls_arguments(podman_host, tmp_path):
    """Where the host has nvidia-ctk's hook binary, the CDI file lists its create-symlinks and
    update-ldcache hooks: podman accepts them and its runtime runs both, as createContainer
    hooks, with nvidia-ctk's arguments; only the libraries' real files are mounted."""
    sb, env, rootfs = podman_host
    log = tmp_path / "hook.log"
    hook = Path(env["ENVCTL_GPU_ROOT"]) / "usr" / "bin" / "nvidia-cdi-hook"
    hook.parent.mkdir(parents=True)
    # A stand-in that records how it was run (the real one edits the container's tree).
    hook.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    hook.chmod(0o755)
    sb.write_spec("gpu-b", gpu_spec("gpu-b", "[1]"))
    res = sb.envctl("up", "gpu-b", env=env)
    assert res.returncode == 0, res.stderr
    res = podman(sb, env, rootfs, "gpu-b", "ls", f"/{gpuhost.LIBDIR}")
    assert res.returncode == 0, res.stderr
    lib = f"/{gpuhost.LIBDIR}"
    assert sorted(res.stdout.split()) == [f"libcuda.so.{gpuhost.DRIVER}",
                                          f"libnvidia-ml.so.{gpuhost.DRIVER}"]
    assert log.read_text().splitlines() == [
        f"create-symlinks --link libcuda.so.{gpuhost.DRIVER}::{lib}/libcuda.so.1 "
        f"--link libnvidia-ml.so.{gpuhost.DRIVER}::{lib}/libnvidia-ml.so.1",
        f"update-ldcache --folder {lib}"]
    assert sb.envctl("down", "gpu-b", env=env).returncode == 0
    (sb.config_dir / "gpu-b.yaml").unlink()
    assert sb.residue() == {}
