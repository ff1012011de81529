"""GPU environments on a fake GPU host: real character devices made with mknod in a temp /dev,
a fake /proc (devices, driver version, per-GPU information), a fake NVML module and fake driver
libraries in a fake ld.so.cache. The environment gets exactly its assigned nodes with the right
numbers, mode and group; its cgroup denies the others; GPUs are exclusive and a count resolves
the same way every time."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fakes import check_cdi, gpuhost

pytestmark = pytest.mark.root

ENTER = Path(__file__).with_name("enter_env.py")
DRIVER = gpuhost.DRIVER
UVM_MAJOR = gpuhost.UVM_MAJOR
CAPS_MAJOR = gpuhost.CAPS_MAJOR
UUIDS = [gpuhost.gpu_uuid(0), gpuhost.gpu_uuid(1)]
LIBDIR = gpuhost.LIBDIR


def fake_gpu_host(root: Path, **kw) -> dict[str, str]:
    """A fake driver tree with two GPUs (minors 0 and 1) by default (tests/fakes/gpuhost.py);
    the variables that point envctl at it."""
    return gpuhost.make_host(root, **{"gpus": 2, "numa": 1, **kw})


@pytest.fixture
def gpu_host(sandbox, tmp_path):
    if shutil.which("gcc") is None or shutil.which("ldconfig") is None:
        pytest.skip("needs gcc and ldconfig (scripts/install-deps installs them)")
    return sandbox, fake_gpu_host(tmp_path / "gpuroot")


def gpu_spec(name: str, gpus: str) -> str:
    return f"""
name: {name}
kind: gpu
rootfs:
  binaries: [bash, ls, cat, stat]
gpus: {gpus}
"""


def inside(sb, env: str, *argv: str, extra=None) -> subprocess.CompletedProcess:
    return sb.run(sys.executable, str(ENTER), str(sb.run_dir / "mnt.d" / env),
                  str(sb.state / "rootfs" / env), "--", *argv, env=extra)


def env_cgroup(sb, env: str) -> Path:
    found = list(Path("/sys/fs/cgroup").glob(f"devices/{sb.cgroup_parent}/{env}")) or \
        [Path("/sys/fs/cgroup") / sb.cgroup_parent / env]
    return found[0]


OPEN = ("import os, sys\n"
        "open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()))\n"
        "for path in sys.argv[2:]:\n"
        "    try:\n"
        "        os.close(os.open(path, os.O_RDWR))\n"
        "        print(path, 'opened')\n"
        "    except OSError as exc:\n"
        "        print(path, exc.errno)\n")


def test_gpu_environment_gets_exactly_its_nodes_and_its_cgroup_denies_the_others(gpu_host):
    sb, env = gpu_host
    sb.write_spec("gpu-a", gpu_spec("gpu-a", "1"))
    res = sb.envctl("up", "gpu-a", env=env)
    assert res.returncode == 0, res.stderr

    out = inside(sb, "gpu-a", "stat", "-c", "%n %F %t:%T %a %g", "/dev/nvidia0", "/dev/nvidiactl",
                 "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", extra=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")[:-1]
    assert lines == ["/dev/nvidia0 character special file c3:0 660 44",
                     "/dev/nvidiactl character special file c3:ff 660 44",
                     f"/dev/nvidia-uvm character special file {UVM_MAJOR:x}:0 660 44",
                     f"/dev/nvidia-uvm-tools character special file {UVM_MAJOR:x}:1 660 44"]
    assert inside(sb, "gpu-a", "ls", "/dev/nvidia1", extra=env).returncode != 0
    environment = inside(sb, "gpu-a", "cat", "/etc/environment", extra=env).stdout
    assert f"CUDA_VISIBLE_DEVICES={UUIDS[0]}\n" in environment
    assert f"NVIDIA_VISIBLE_DEVICES={UUIDS[0]}\n" in environment
    # The driver libraries are bind-mounted read-only, with their soname links.
    libs = inside(sb, "gpu-a", "ls", f"/{LIBDIR}", extra=env).stdout.split()
    assert {f"libcuda.so.{DRIVER}", "libcuda.so.1", f"libnvidia-ml.so.{DRIVER}"} <= set(libs)

    # The cgroup: the assigned node is allowed (ENXIO: no driver behind the fake node), the
    # other GPU is denied (EPERM) — from a process in the environment's cgroup.
    dev = Path(env["ENVCTL_GPU_ROOT"]) / "dev"
    probe = sb.run(sys.executable, "-c", OPEN, str(env_cgroup(sb, "gpu-a")), str(dev / "nvidia0"),
                   str(dev / "nvidia1"), str(dev / "nvidiactl"), str(dev / "nvidia-uvm"))
    assert probe.returncode == 0, probe.stderr
    result = dict(line.rsplit(" ", 1) for line in probe.stdout.splitlines())
    assert result == {str(dev / "nvidia0"): str(errno.ENXIO),
                      str(dev / "nvidia1"): str(errno.EPERM),
                      str(dev / "nvidiactl"): str(errno.ENXIO),
                      str(dev / "nvidia-uvm"): str(errno.ENXIO)}

    gpus = sb.envctl_json("gpus", env=env)
    held = {g["uuid"]: g["env"] for g in gpus["gpus"]}
    assert held == {UUIDS[0]: "gpu-a", UUIDS[1]: None}
    # `up` wrote the CDI file: exactly this environment's GPU; `down` removes it.
    cdi = Path(env["ENVCTL_CDI_DIR"]) / "envctl.yaml"
    doc = yaml.safe_load(cdi.read_text())
    assert check_cdi(doc) == [] and [d["name"] for d in doc["devices"]] == ["gpu-a"]
    assert [n["path"] for n in doc["devices"][0]["containerEdits"]["deviceNodes"]
            if "nvidia" in n["path"]][:1] == ["/dev/nvidia0"]
    assert doc["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert sb.envctl("down", "gpu-a", env=env).returncode == 0
    assert not cdi.exists()
    assert sb.residue() == {}


def test_cdi_file_after_kill_9_at_every_step_then_down_is_as_before(gpu_host):
    """Another environment holds GPU 1 (its file is written); `up` of gpu-a killed at each
    step, then `down`: the file is byte for byte what it was, never listing gpu-a."""
    sb, env = gpu_host
    sb.write_spec("gpu-b", gpu_spec("gpu-b", "[1]"))
    assert sb.envctl("up", "gpu-b", env=env).returncode == 0
    cdi = Path(env["ENVCTL_CDI_DIR"]) / "envctl.yaml"
    before = cdi.read_bytes()
    sb.write_spec("gpu-a", gpu_spec("gpu-a", "[0]"))
    for index in range(200):  # until the fault's index is past the last step
        res = sb.envctl("up", "gpu-a", env={**env, "ENVCTL_FAULT": f"kill@after:#{index}"})
        if res.returncode == 0:
            assert [d["name"] for d in yaml.safe_load(cdi.read_text())["devices"]] == [
                "gpu-a", "gpu-b"]
        else:
            assert cdi.read_bytes() == before, (index, res.stderr)
        down = sb.envctl("down", "gpu-a", env=env)
        assert down.returncode == 0, down.stderr
        assert cdi.read_bytes() == before
        if res.returncode == 0:
            break
    assert index > 3  # killed at several steps first
    assert sb.envctl("down", "gpu-b", env=env).returncode == 0
    assert not cdi.exists()
    assert sb.residue() == {}


def test_gpus_are_exclusive_and_a_count_resolves_the_same_way_every_time(gpu_host):
    sb, env = gpu_host
    sb.write_spec("gpu-a", gpu_spec("gpu-a", "1"))
    sb.write_spec("gpu-b", gpu_spec("gpu-b", "1"))
    plans = [sb.envctl_json("plan", "gpu-b", env=env) for _ in range(3)]
    assert {json.dumps(p) for p in plans} == {json.dumps(plans[0])}
    assert sb.envctl("up", "gpu-b", env=env).returncode == 0
    assert sb.envctl("up", "gpu-a", env=env).returncode == 0
    gpus = sb.envctl_json("gpus", env=env)
    held = {g["uuid"]: g["env"] for g in gpus["gpus"]}
    # Counts resolve for every spec read together, in name order from the lowest index:
    # gpu-a gets 0 and gpu-b gets 1, although gpu-b came up first and alone.
    assert held == {UUIDS[0]: "gpu-a", UUIDS[1]: "gpu-b"}
    # Re-up does not move anything.
    assert sb.envctl("up", "gpu-a", "gpu-b", env=env).returncode == 0
    again = sb.envctl_json("gpus", env=env)
    assert {g["uuid"]: g["env"] for g in again["gpus"]} == held

    # A third environment asking for a GPU that is held: exit 2, nothing changes.
    sb.write_spec("gpu-c", gpu_spec("gpu-c", "[1]"))
    before = sb.residue()
    res = sb.envctl("up", "gpu-c", env=env)
    assert res.returncode == 2, res.stderr
    assert "held by environment 'gpu-b'" in res.stderr
    assert sb.residue() == before
    (sb.config_dir / "gpu-c.yaml").unlink()
    # A host without the GPUs a spec asks for: exit 2 saying what was found.
    sb.write_spec("gpu-d", gpu_spec("gpu-d", "[5]"))
    res = sb.envctl("plan", "gpu-d", env=env)
    assert res.returncode == 2 and "no GPU with index 5" in res.stderr, res.stderr
    (sb.config_dir / "gpu-d.yaml").unlink()
    assert sb.envctl("down", "gpu-a", "gpu-b", env=env).returncode == 0
    assert sb.residue() == {}


def test_modeset_node_when_asked_and_mig_caps_refused(gpu_host):
    sb, env = gpu_host
    sb.write_spec("gpu-a", gpu_spec("gpu-a", "{indices: [1], modeset: true, group: '0'}"))
    res = sb.envctl("up", "gpu-a", env=env)
    assert res.returncode == 0, res.stderr
    out = inside(sb, "gpu-a", "stat", "-c", "%n %t:%T %a %g", "/dev/nvidia1",
                 "/dev/nvidia-modeset", extra=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:-1] == ["/dev/nvidia1 c3:1 660 0",
                                           "/dev/nvidia-modeset c3:fe 660 0"]
    assert inside(sb, "gpu-a", "ls", "/dev/nvidia0", extra=env).returncode != 0
    assert inside(sb, "gpu-a", "ls", "/dev/nvidia-caps", extra=env).returncode != 0
    assert sb.envctl_json("status", "gpu-a", env=env)[0]["state"] == "up"
    # The CDI spec gives a container exactly what the environment's /dev has, group included.
    cdi = sb.root / "cdi.yaml"
    res = sb.envctl("gpus", "--cdi", "--cdi-path", str(cdi), env=env)
    assert res.returncode == 0, res.stderr
    doc = yaml.safe_load(cdi.read_text())
    assert check_cdi(doc) == []
    (device,) = doc["devices"]
    nodes = {n["path"]: (n["major"], n["minor"], n["fileMode"], n["gid"])
             for n in device["containerEdits"]["deviceNodes"]}
    assert nodes == {"/dev/nvidia1": (195, 1, 0o660, 0),
                     "/dev/nvidia-modeset": (195, 254, 0o660, 0),
                     "/dev/nvidiactl": (195, 255, 0o660, 0),
                     "/dev/nvidia-uvm": (UVM_MAJOR, 0, 0o660, 0),
                     "/dev/nvidia-uvm-tools": (UVM_MAJOR, 1, 0o660, 0)}
    mounts = {m["containerPath"] for m in doc["containerEdits"]["mounts"]}
    assert f"/{LIBDIR}/libcuda.so.{DRIVER}" in mounts
    assert sb.envctl("down", "gpu-a", env=env).returncode == 0
    # gpus.mig_caps granted nvidia-cap1 (MIG config): refused, at its line, nothing changed.
    sb.write_spec("gpu-b", gpu_spec("gpu-b", "{count: 1, mig_caps: true}"))
    res = sb.envctl("up", "gpu-b", env=env)
    assert res.returncode == 2 and "gpu-b.yaml:6:" in res.stderr, res.stderr
    assert "mig_caps is no longer accepted: it granted nvidia-cap1" in res.stderr
    (sb.config_dir / "gpu-b.yaml").unlink()
    assert sb.residue() == {}


@pytest.fixture
def mig_host(sandbox, tmp_path):
    if shutil.which("gcc") is None or shutil.which("ldconfig") is None:
        pytest.skip("needs gcc and ldconfig (scripts/install-deps installs them)")
    return sandbox, fake_gpu_host(tmp_path / "gpuroot",
                                  mig_layout=["3g.71gb", "2g.35gb", "1g.18gb"])


def test_a_mig_environment_opens_its_instance_and_not_another_nor_the_mig_config(mig_host):
    sb, env = mig_host
    gpus = sb.envctl_json("gpus", env=env)
    assert gpus["problems"] == []
    tree = {g["uuid"]: [(m["profile"], m["gi"], m["ci"], m["placement"]["start"],
                         m["placement"]["size"], m["env"]) for m in g["instances"]]
            for g in gpus["gpus"]}
    assert tree[UUIDS[1]] == [("3g.71gb", 1, 0, 0, 4, None), ("2g.35gb", 5, 0, 4, 2, None),
                              ("1g.18gb", 13, 0, 6, 1, None)]
    mine, other = gpus["gpus"][1]["instances"][1], gpus["gpus"][1]["instances"][0]
    gi, ci = (gpuhost.gi_minor(1, 5), gpuhost.ci_minor(1, 5, 0))
    assert mine["access"] == [f"/dev/nvidia-caps/nvidia-cap{gi}",
                              f"/dev/nvidia-caps/nvidia-cap{ci}"]

    sb.write_spec("mig-a", gpu_spec("mig-a", f"[{mine['uuid']}]"))
    res = sb.envctl("up", "mig-a", env=env)
    assert res.returncode == 0, res.stderr
    out = inside(sb, "mig-a", "ls", "/dev", "/dev/nvidia-caps", extra=env)
    assert out.returncode == 0, out.stderr
    listed = out.stdout.split("\n\n")
    assert {"nvidia1", "nvidiactl", "nvidia-caps"} <= set(listed[0].split()[1:])
    assert "nvidia0" not in listed[0]
    assert sorted(listed[1].split()[1:]) == sorted([f"nvidia-cap{gi}", f"nvidia-cap{ci}"])
    environment = inside(sb, "mig-a", "cat", "/etc/environment", extra=env).stdout
    assert f"CUDA_VISIBLE_DEVICES={mine['uuid']}\n" in environment

    # From the environment's cgroup: its access nodes open (ENXIO: no driver behind the fake
    # nodes), another instance's and MIG config/monitor are refused (EPERM).
    caps = Path(env["ENVCTL_GPU_ROOT"]) / "dev" / "nvidia-caps"
    og, oc = gpuhost.gi_minor(1, other["gi"]), gpuhost.ci_minor(1, other["gi"], 0)
    paths = [caps / f"nvidia-cap{n}" for n in (gi, ci, og, oc, 1, 2)]
    probe = sb.run(sys.executable, "-c", OPEN.replace("os.O_RDWR", "os.O_RDONLY"),
                   str(env_cgroup(sb, "mig-a")), *map(str, paths))
    assert probe.returncode == 0, probe.stderr
    result = dict(line.rsplit(" ", 1) for line in probe.stdout.splitlines())
    assert result == {str(paths[0]): str(errno.ENXIO), str(paths[1]): str(errno.ENXIO),
                      **{str(p): str(errno.EPERM) for p in paths[2:]}}

    held = {m["uuid"]: m["env"] for g in sb.envctl_json("gpus", env=env)["gpus"]
            for m in g["instances"]}
    assert held[mine["uuid"]] == "mig-a" and held[other["uuid"]] is None
    # The parent GPU, whole, cannot be given while one of its instances is held.
    sb.write_spec("gpu-c", gpu_spec("gpu-c", "[1]"))
    res = sb.envctl("plan", "gpu-c", env=env)
    assert res.returncode == 2 and "is held by environment 'mig-a'" in res.stderr, res.stderr
    (sb.config_dir / "gpu-c.yaml").unlink()
    assert sb.envctl("down", "mig-a", env=env).returncode == 0
    assert sb.residue() == {}


def test_more_count_specs_than_gpus_brought_up_together_are_refused_before_any_change(gpu_host):
    sb, env = gpu_host
    for name in ("ga", "gb", "gc"):
        sb.write_spec(name, gpu_spec(name, "1"))
    res = sb.envctl("up", "ga", "gb", "gc", env=env)
    assert res.returncode == 2, res.stderr
    assert "gc.yaml" in res.stderr and "0 of this host's 2 are free" in res.stderr
    assert sb.residue() == {}


def test_from_inside_an_unassigned_gpu_cannot_be_opened(gpu_host):
    """`envctl exec` as root (CAP_MKNOD kept): the other GPU's node is not in /dev, and making
    it with mknod is refused; the assigned one opens (ENXIO: the fake node has no driver
    behind it, but the device rules let it through) from the launch's user namespace."""
    sb, env = gpu_host
    sb.write_spec("gpu-a", gpu_spec("gpu-a", "1").replace("[bash, ls, cat, stat]",
                                                          "[bash, ls, cat, stat, mknod]"))
    res = sb.envctl("up", "gpu-a", env=env)
    assert res.returncode == 0, res.stderr

    def ex(script: str) -> subprocess.CompletedProcess:
        return sb.run(sys.executable, "-m", "envctl", "exec", "gpu-a", "--user", "root", "--",
                      "bash", "-c", script, env=env)

    res = ex("ls /dev/nvidia1")
    assert res.returncode != 0 and "No such file" in res.stderr
    res = ex("exec 3<>/dev/nvidia0")
    assert res.returncode != 0 and "No such device or address" in res.stderr  # ENXIO: allowed
    res = ex("mknod /tmp/nv1 c 195 1")
    assert res.returncode != 0 and "Operation not permitted" in res.stderr, res.stderr
    # Root inside is the root of a user namespace, which makes no device node at all, not
    # even an allowed one (and one made anyway could not be opened: every writable place is
    # nodev).
    res = ex("mknod /tmp/null c 1 3")
    assert res.returncode != 0 and "Operation not permitted" in res.stderr, res.stderr
    assert sb.envctl("down", "gpu-a", env=env).returncode == 0
    assert sb.residue() == {}
