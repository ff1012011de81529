"""scripts/gpu-probe on the fake HGX host (tests/fakes/gpuhost.py), without NVML (no device
nodes: not root) and as a static check that it only queries NVML. The run through the fake
NVML, which needs real device nodes, is in tests/integration/test_gpu_placement.py."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.fakes import gpuhost

PROBE = Path(__file__).resolve().parents[2] / "scripts" / "gpu-probe"
# NVML calls that change a GPU: gpu-probe must name none of them.
CHANGING = ("nvmlDeviceSet", "nvmlDeviceCreate", "nvmlGpuInstanceCreate", "nvmlDeviceReset",
            "nvmlDeviceClear", "nvmlGpuInstanceDestroy", "nvmlComputeInstanceDestroy",
            "nvmlDeviceModify", "nvmlSystemSet")


def run_probe(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), str(root)], capture_output=True,
                          text=True, env=env, timeout=60, check=False)


def test_probe_reads_the_fake_host_and_does_not_ask_nvml_without_its_nodes(tmp_path):
    env = gpuhost.make_host(tmp_path / "hgx", gpus=8, numa=2, mig=True, nodes=False,
                            libraries=False)
    res = run_probe(tmp_path / "hgx", {"PATH": "/usr/bin:/bin", **env})
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "proc/devices (nvidia): 195 nvidia-frontend; 509 nvidia-uvm; 508 nvidia-caps" in out
    assert f"gpu 0000:db:00.0: NVIDIA H200; {gpuhost.gpu_uuid(7)}; minor 7; excluded No" in out
    assert "mig-minors: 1082 lines; config 1; monitor 2; first: gpu0/gi0/access 3" in out
    assert "NVML: not asked: /dev/nvidiactl, /dev/nvidia0" in out


def test_probe_names_only_nvml_queries():
    tree = ast.parse(PROBE.read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and n.attr.startswith("nvml")}
    names |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
              and isinstance(n.value, str) and n.value.startswith("nvml")}
    assert "nvmlDeviceGetMigMode" in names  # the walk sees its calls
    assert sorted(n for n in names if n.startswith(CHANGING)) == []
