"""Placement near the GPUs on the real kernel: a fake two-GPU host whose GPU 0 is local to CPU 0
and GPU 1 to CPU 1 (tests/fakes/gpuhost.py --gpus 2 --numa 2 --cpus 2: this VM has two CPUs),
and environments asking `dedicated: {near_gpus: true}` get their GPU's CPU in their cgroup's
cpuset; one that cannot have it is refused with exit 2 and nothing made."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.fakes import gpuhost
from tests.integration.test_jobs import script

pytestmark = pytest.mark.root


@pytest.fixture
def near_host(sandbox, tmp_path):
    if shutil.which("gcc") is None or shutil.which("ldconfig") is None:
        pytest.skip("needs gcc and ldconfig (scripts/install-deps installs them)")
    if len(os.sched_getaffinity(0)) < 2 or not Path("/sys/devices/system/cpu/cpu1").exists():
        pytest.skip("needs CPUs 0 and 1")
    return sandbox, gpuhost.make_host(tmp_path / "gpuroot", gpus=2, numa=2, cpus=2)


def near_spec(name: str, gpu: int) -> str:
    return f"""
name: {name}
kind: gpu
rootfs:
  binaries: [cat]
gpus: [{gpu}]
resources:
  cpu:
    dedicated: {{near_gpus: true, count: 1}}
"""


def cpuset_cpus(sb, env: str) -> str:
    found = list(Path("/sys/fs/cgroup").glob(f"cpuset/{sb.cgroup_parent}/{env}")) or \
        [Path("/sys/fs/cgroup") / sb.cgroup_parent / env]
    return (found[0] / "cpuset.cpus").read_text().strip()


def test_each_environment_gets_the_cpu_near_its_gpu(near_host):
    sb, env = near_host
    sb.write_spec("near-one", near_spec("near-one", 1))
    sb.write_spec("near-zero", near_spec("near-zero", 0))
    plan = sb.envctl("plan", "near-one", env=env)
    assert plan.returncode == 0, plan.stderr
    assert "placement: GPU 1 <-> NUMA 1 <-> CPUs 1" in plan.stdout
    for name in ("near-one", "near-zero"):
        res = sb.envctl("up", name, env=env)
        assert res.returncode == 0, res.stderr
    assert cpuset_cpus(sb, "near-one") == "1"
    assert cpuset_cpus(sb, "near-zero") == "0"
    # Where its GPU sits, recorded for the jobs' CPU choice (EnvContext.gpu_cpus).
    claims = json.loads((sb.state / "journal" / "near-one.json").read_text())["meta"]["claims"]
    assert claims["gpu_cpus"] == {gpuhost.gpu_uuid(1): [1]} and claims["cpus"] == [1]
    # A second `up` keeps them where they are.
    assert sb.envctl("up", "near-one", env=env).returncode == 0
    assert cpuset_cpus(sb, "near-one") == "1"
    for name in ("near-one", "near-zero"):
        assert sb.envctl("down", name, env=env).returncode == 0
    assert sb.residue() == {}


def test_a_cpu_near_the_gpu_taken_elsewhere_is_refused_with_what_is_free(near_host):
    sb, env = near_host
    sb.write_spec("pinned", "name: pinned\nkind: cpu\nresources:\n  cpu:\n    dedicated: [1]\n")
    sb.write_spec("near-one", near_spec("near-one", 1))
    res = sb.envctl("up", "near-one", env=env)
    assert res.returncode == 2, res.stderr
    assert "wants 1 dedicated CPU near GPU 1 (CPUs 1), and none are free there (1 dedicated " \
           "to pinned); lower count or free those CPUs" in res.stderr
    assert sb.residue() == {}


def test_gpu_probe_prints_the_fake_hosts_facts_through_nvml_and_changes_nothing(tmp_path):
    """scripts/gpu-probe on the fake HGX host with its device nodes (mknod: root), so NVML is
    asked: MIG mode, profiles with placements, the 56 instances, sysfs against NVML's
    affinity, the health fields; the fake NVML's state file is byte for byte as before."""
    import subprocess
    import sys

    env = gpuhost.make_host(tmp_path / "hgx", gpus=8, numa=2, mig=True, libraries=False)
    before = Path(env["FAKE_NVML_JSON"]).read_bytes()
    probe = Path(__file__).resolve().parents[2] / "scripts" / "gpu-probe"
    res = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", **env}, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "GPUs: 8" in out and "driver: 550.54.15" in out
    assert out.count("MIG mode: current 1, pending 1") == 8
    assert out.count("MIG devices: 7") == 8
    assert "profile 2: 3g.71gb id 9, 3 slices, 69632 MiB, up to 2; placements 0:4 4:4" in out
    assert f"GI 7 CI 0 {gpuhost.mig_uuid(7, 7, 0)}" in out
    assert out.count("sysfs numa_node / local_cpulist: 1 / 32-63") == 4
    assert out.count("NVML CPU affinity: 32-63") == 4
    assert "remapped rows (corrected, uncorrected, pending, failure): [Not Supported]" in out
    assert "XIDs: none" in out
    assert Path(env["FAKE_NVML_JSON"]).read_bytes() == before


def test_a_jobs_cpu_by_count_is_the_one_near_its_gpu(near_host):
    """An environment with both GPUs and both CPUs; a job given GPU 1 and `--cpus 1` runs on
    CPU 1 (its GPU's), not on CPU 0 (the lowest free, as before); one given GPU 0 on CPU 0.
    The job's own cgroup's cpuset says so."""
    sb, env = near_host
    sb.write_spec("near-ab", near_spec("near-ab", 0).replace("gpus: [0]", "gpus: all")
                  .replace("binaries: [cat]", "binaries: [bash, sleep]")
                  .replace("count: 1", "count: 2"))
    res = sb.envctl("up", "near-ab", env=env)
    assert res.returncode == 0, res.stderr
    hold = script(sb, "hold.sh", "#!/bin/bash\nexec sleep 600\n")
    jobs = []
    try:
        for gpu in (1, 0):
            out = sb.envctl("submit-job", "--json", "--user", "root", "near-ab", "--gpus",
                            gpuhost.gpu_uuid(gpu), "--cpus", "1", hold, env=env)
            assert out.returncode == 0, out.stderr
            rec = json.loads(out.stdout)
            jobs.append(rec["id"])
            assert (rec["state"], rec["gpus"], rec["cpus"]) == (
                "RUNNING", [gpuhost.gpu_uuid(gpu)], [gpu]), rec
            cg = rec["cgroup"]  # the job's own cgroup: its cpuset is the kernel's word
            cpuset = Path("/sys/fs/cgroup/cpuset") / cg["parent"] / cg["name"] / "cpuset.cpus"
            if not cpuset.exists():  # a v2 host
                cpuset = Path("/sys/fs/cgroup") / cg["parent"] / cg["name"] / "cpuset.cpus"
            assert cpuset.read_text().strip() == str(gpu), rec
    finally:
        for jid in jobs:
            assert sb.envctl("cancel", str(jid), "--grace", "0", env=env).returncode == 0
        if jobs:
            sb.envctl("wait", *map(str, jobs), timeout=120, env=env)
        assert sb.envctl("down", "near-ab", env=env).returncode == 0
    residue = sb.residue()
    assert residue.pop("state_dir", None) in (["jobs", "lock"], None), residue  # job records
    assert residue == {}, residue
