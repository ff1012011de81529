"""The shipped cpu-compute partition comes up on this machine kind and goes without a trace."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.root
ENTER = Path(__file__).with_name("enter_env.py")

BAD_SPECS = [
    "name: bad\nkind: cpu\nbogus: 1\n",
    "name: cpu-compute\nkind: cpu\n",  # a duplicate name in the directory
    "name: bad\nkind: cpu\nresources:\n  cpu: {quota: 0.5%}\n",  # below the kernel's minimum
]
# Valid specs this host cannot serve: `up --all` skips them and brings up the rest.
UNFIT_SPECS = [
    "name: bad\nkind: cpu\nresources:\n  cpu: {dedicated: 0-63}\n",
    "name: bad\nkind: cpu\nhost:\n  sysctls: {vm.does_not_exist: 1}\n",
]


# cpu-compute's data directories (its relative mount sources): they survive a plain `down`.
CPU_COMPUTE_DATA = {"cpu-compute": ["data", "logs", "results"]}


def test_cpu_compute_up_status_down(shipped):
    sb = shipped
    before = sb.sysctl("net.ipv4.ip_forward")
    plan = sb.envctl_json("plan", "cpu-compute")[0]
    assert plan["resolved"]["threads"] >= 1
    sb.envctl("up", "cpu-compute", check=True)
    status = sb.envctl_json("status", "cpu-compute")[0]
    assert status["up"] and {s["status"] for s in status["steps"]} == {"ok"}
    assert "cpu-compute" in sb.netns()
    assert sb.run("ip", "netns", "exec", "cpu-compute", "true").returncode == 0
    # Its rootfs runs the listed binaries and Python under pivot_root, with its data mounts.
    enter = [sys.executable, str(ENTER), str(sb.run_dir / "mnt.d" / "cpu-compute"),
             str(sb.state / "rootfs" / "cpu-compute"), "--"]
    out = sb.run(*enter, "bash", "-c", "echo $ENVIRONMENT; ls /opt/data; sleep 0; "
                 "echo $OMP_NUM_THREADS $OPENBLAS_NUM_THREADS; cat /etc/hostname")
    assert out.returncode == 0, out.stderr
    threads = str(plan["resolved"]["threads"])
    assert out.stdout.split() == ["cpu-compute", "input", "output", threads, threads,
                                  "cpu-compute"]
    py = sb.run(*enter, "python3", "-c", "import sys, json; print(sys.version_info[0])")
    assert py.stdout == "3\n", py.stderr
    sb.envctl("down", "cpu-compute", check=True)
    assert sb.sysctl("net.ipv4.ip_forward") == before
    assert sb.residue_keeping_data(CPU_COMPUTE_DATA) == {}


@pytest.mark.parametrize("bad", BAD_SPECS)
def test_rejected_spec_exits_2_and_changes_nothing(shipped, bad):
    sb = shipped
    sb.write_spec("bad", bad)
    before = (sb.sysctl("net.ipv4.ip_forward"), sb.sysctl("vm.zone_reclaim_mode"))
    res = sb.envctl("up", "--all")
    assert res.returncode == 2, res.stderr
    assert "bad.yaml" in res.stderr and "nothing was changed" in res.stderr
    assert (sb.sysctl("net.ipv4.ip_forward"), sb.sysctl("vm.zone_reclaim_mode")) == before
    assert sb.residue() == {}
    assert not sb.state.exists()


@pytest.mark.parametrize("unfit", UNFIT_SPECS)
def test_up_all_skips_what_this_host_cannot_serve_and_brings_up_the_rest(shipped, unfit):
    sb = shipped
    sb.write_spec("bad", unfit)
    res = sb.envctl("up", "--all")
    assert res.returncode == 1, res.stderr
    assert "bad.yaml" in res.stderr and "skipped bad: this host cannot serve it" in res.stderr
    assert "skipped gpu-compute" in res.stderr  # no NVIDIA modules on this machine kind
    assert sb.netns() == ["cpu-compute"]
    status = sb.envctl_json("status", "cpu-compute")[0]
    assert status["state"] == "up"
    sb.envctl("down", "--all", check=True)
    assert sb.residue_keeping_data(CPU_COMPUTE_DATA) == {}
