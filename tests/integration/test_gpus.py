"""`envctl gpus` as a command, on a fake NVIDIA host with real character nodes (mknod needs
root): the report, the CDI file `--cdi` writes, and nothing written without it.

NVML is the fake pynvml (tests/fakes/pynvml) put first on PYTHONPATH, so the real NVML code
path runs unmodified; the driver's /proc files are those of tests/fakes.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from envctl.engine.journal import Entry, Journal
from envctl.resources.dirs import Directory
from tests.fakes import PYNVML_DIR, FakeGpu, check_cdi, make_tree, nvml_json
from tests.integration.sandbox import REPO

pytestmark = pytest.mark.root

A = FakeGpu("GPU-5a0c6f1e-7f2b-4c1d-9e8f-0123456789ab", "0000:b1:00.0", minor=1)
B = FakeGpu("GPU-0f9e8d7c-6b5a-4321-8765-fedcba987654", "0000:3b:00.0", minor=0,
            name="NVIDIA H100 80GB HBM3", memory=80 * 1024**3, mig=True)


@pytest.fixture
def gpu_host(clean, tmp_path):
    """The sandbox, a fake GPU host under tmp/gpu-root and the environment that points
    envctl at it; state, run and CDI directories of its own under tmp/gpu."""
    root = make_tree(tmp_path / "gpu-root", [A, B], nodes=True)
    base = tmp_path / "gpu"
    env = {"ENVCTL_GPU_ROOT": str(root),
           "PYTHONPATH": f"{PYNVML_DIR}{os.pathsep}{REPO / 'src'}",
           "FAKE_NVML_JSON": str(nvml_json(tmp_path / "nvml.json", [B, A])),
           "ENVCTL_STATE_DIR": str(base / "state"), "ENVCTL_RUN_DIR": str(base / "run"),
           "ENVCTL_CDI_DIR": str(base / "cdi")}
    return clean, root, base, env


def hold(state: Path, env: str, uuids: list[str]) -> None:
    """A journal of `env` with one step and a GPU claim, as `up` leaves one."""
    journal = Journal.open(state, env)
    journal.put(Entry(f"dir:state:envs/{env}", Directory("state", f"envs/{env}").to_dict(),
                      {"existed": False, "made": []}, "applied"))
    journal.set_meta({"claims": {"gpus": {"uuids": uuids, "indices": []}}})
    journal.save()


def tree(path: Path) -> dict[str, tuple[int, int, int]]:
    """Every file and directory under `path`, with mode, size and mtime."""
    out = {}
    for p in sorted(path.rglob("*")):
        st = p.lstat()
        out[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def test_report_from_nvml_and_nothing_written(gpu_host, tmp_path):
    sb, root, base, env = gpu_host
    hold(base / "state", "gpu-a", [A.uuid])
    before = tree(tmp_path)
    res = sb.envctl("gpus", "--json", env=env, check=True)
    assert tree(tmp_path) == before  # read-only: not a file made or touched
    report = json.loads(res.stdout)
    assert report["driver"] == "550.54.15" and report["source"] == "nvml"
    assert report["gpus"] == [
        {"index": 0, "uuid": B.uuid, "name": B.name, "minor": 0, "memory": B.memory,
         "mig": True, "mig_pending": True, "pci": "0000:3b:00.0", "env": None, "health": None,
         "instances": []},
        {"index": 1, "uuid": A.uuid, "name": A.name, "minor": 1, "memory": A.memory,
         "mig": False, "mig_pending": False, "pci": "0000:b1:00.0", "env": "gpu-a",
         "health": None,
         "instances": []}]
    assert report["majors"] == {"nvidia-frontend": 195, "nvidia-uvm": 235, "nvidia-caps": 238}
    assert report["nodes"] == {"/dev/nvidia-uvm": [235, 0], "/dev/nvidia-uvm-tools": [235, 1],
                               "/dev/nvidia0": [195, 0], "/dev/nvidia1": [195, 1],
                               "/dev/nvidiactl": [195, 255]}
    assert report["problems"] == [] and report["warnings"] == [] and report["cdi"] is None

    text = sb.envctl("gpus", env=env, check=True).stdout
    assert tree(tmp_path) == before
    lines = text.splitlines()
    assert lines[0].startswith("driver 550.54.15")
    assert A.uuid in lines[3] and lines[3].rstrip().endswith("gpu-a")
    assert "80G" in lines[2] and lines[2].split()[-1] == "-"


def test_cdi_file_written_on_request(gpu_host):
    sb, root, base, env = gpu_host
    hold(base / "state", "gpu-a", [A.uuid])
    hold(base / "state", "gpu-b", [B.uuid])
    res = sb.envctl("gpus", "--json", "--cdi", env=env, check=True)
    path = base / "cdi" / "envctl.yaml"
    assert json.loads(res.stdout)["cdi"] == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(os.listdir(path.parent)) == ["envctl.yaml"]
    spec = yaml.safe_load(path.read_text())
    assert check_cdi(spec) == []
    assert {d["name"]: [(n["hostPath"], n["major"], n["minor"])
                        for n in d["containerEdits"]["deviceNodes"]]
            for d in spec["devices"]} == {"gpu-a": [(f"{root}/dev/nvidia1", 195, 1)],
                                          "gpu-b": [(f"{root}/dev/nvidia0", 195, 0)]}
    # Every node the spec names is the real node at its hostPath.
    for n in spec["containerEdits"]["deviceNodes"] + [
            n for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]:
        st = os.stat(n["hostPath"])
        assert stat.S_ISCHR(st.st_mode)
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (n["major"], n["minor"])

    # --cdi-path, in text mode: rewritten in place, the same document.
    other = base / "elsewhere" / "gpus.yaml"
    res = sb.envctl("gpus", "--cdi", "--cdi-path", str(other), env=env, check=True)
    assert res.stdout.rstrip().endswith(f"wrote {other}")
    assert yaml.safe_load(other.read_text()) == spec


def test_cdi_refused_when_no_environment_holds_a_gpu(gpu_host):
    sb, root, base, env = gpu_host
    res = sb.envctl("gpus", "--cdi", env=env)
    assert res.returncode == 2
    assert "no environment holds a GPU" in res.stderr
    assert not (base / "cdi").exists()


def test_nvml_failure_falls_back_to_proc(gpu_host, tmp_path):
    sb, root, base, env = gpu_host
    env["FAKE_NVML_JSON"] = str(nvml_json(tmp_path / "broken.json", [A, B], fail_init=9))
    report = sb.envctl_json("gpus", env=env)
    assert report["source"] == "proc"
    assert [g["uuid"] for g in report["gpus"]] == [B.uuid, A.uuid]
    assert report["problems"] == [
        "NVML failed to initialise: Driver Not Loaded; GPUs read from /proc"]


@pytest.mark.parametrize(("version", "says"), [
    (None, "no NVIDIA GPU found (no NVIDIA driver is loaded)"),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 2024\n",
     "no NVIDIA GPU found (driver 550.54.15 is loaded but shows no GPU)"),
])
def test_without_gpus(clean, tmp_path, version, says):
    root = make_tree(tmp_path / "empty", [], version=version)
    res = clean.envctl("gpus", env={"ENVCTL_GPU_ROOT": str(root), "ENVCTL_NVML": "off",
                                    "ENVCTL_STATE_DIR": str(tmp_path / "s")}, check=True)
    assert res.stdout.splitlines()[0] == says
