"""MIG instances declared in the spec (`gpus: {mig: […]}`) on the fake GPU host: `up` turns
MIG mode on and makes them through the fake NVML (state in its JSON file, as separate
processes see it), the environment gets exactly their access nodes, a second `up` changes
nothing in NVML, `down` destroys only what envctl made and gives MIG mode back; kill -9 at
every step then `down` leaves NVML as it was; after a reboot they are made again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.fakes import gpuhost
from tests.integration.test_gpu_env import gpu_spec, inside
from tests.integration.test_lifecycle import fake_boot, reboot

pytestmark = pytest.mark.root

LAYOUT = "{mig: [{gpu: 0, profile: 3g.71gb}, {gpu: 0, profile: 1g.18gb, count: 2}]}"


@pytest.fixture
def h200(sandbox, tmp_path):
    if shutil.which("gcc") is None or shutil.which("ldconfig") is None:
        pytest.skip("needs gcc and ldconfig (scripts/install-deps installs them)")
    return sandbox, gpuhost.make_host(tmp_path / "gpuroot", gpus=2, numa=1)


def nvml_state(env: dict[str, str]) -> dict:
    return json.loads(Path(env["FAKE_NVML_JSON"]).read_text())


def gpus_of(env: dict[str, str]) -> list[dict]:
    """The fake NVML's GPUs as NVML's state, without its log and UUID counter."""
    return nvml_state(env)["gpus"]


def writes(env: dict[str, str]) -> list:
    return nvml_state(env).get("writes", [])


def test_up_makes_the_layout_gives_its_nodes_and_down_gives_the_gpu_back(h200):
    sb, env = h200
    before = gpus_of(env)
    assert not before[0]["mig"]
    sb.write_spec("mig-a", gpu_spec("mig-a", LAYOUT))
    plan = sb.envctl("plan", "mig-a", env=env)
    assert plan.returncode == 0, plan.stderr
    text = " ".join(plan.stdout.split())
    assert "GPU 0: 3g.71gb at slots 0-3 (new)" in text, plan.stdout
    assert "GPU 0: 1g.18gb at slot 4 (new)" in text and "1g.18gb at slot 5 (new)" in text
    assert writes(env) == []  # plan is read-only

    done = sb.envctl_json("up", "mig-a", env=env)
    # What the first half of `up` made shows as made, though the second found it done.
    assert [(s["op"], s["kind"]) for s in done[0]["steps"] if s["kind"].startswith("mig")] == [
        ("~", "mig-mode"), ("+", "mig-instance"), ("+", "mig-instance"), ("+", "mig-instance")]
    gpu0 = gpus_of(env)[0]
    assert gpu0["mig"] is True
    made = sorted((gi["start"], gi["size"]) for gi in gpu0["gpu_instances"])
    assert made == [(0, 4), (4, 1), (5, 1)]
    uuids = [gi["cis"][0]["uuid"] for gi in sorted(gpu0["gpu_instances"],
                                                   key=lambda g: g["id"])]
    minors = sorted(m for gi in gpu0["gpu_instances"] for m in (
        gpuhost.gi_minor(0, gi["id"]), gpuhost.ci_minor(0, gi["id"], 0)))
    out = inside(sb, "mig-a", "ls", "/dev", "/dev/nvidia-caps", extra=env)
    assert out.returncode == 0, out.stderr
    listed = out.stdout.split("\n\n")
    assert {"nvidia0", "nvidiactl", "nvidia-caps"} <= set(listed[0].split()[1:])
    assert "nvidia1" not in listed[0]
    assert sorted(listed[1].split()[1:]) == sorted(f"nvidia-cap{m}" for m in minors)
    environment = inside(sb, "mig-a", "cat", "/etc/environment", extra=env).stdout
    visible = [line for line in environment.splitlines()
               if line.startswith("CUDA_VISIBLE_DEVICES=")]
    assert visible and sorted(visible[0].split("=", 1)[1].split(",")) == sorted(uuids)
    cdi = yaml.safe_load((Path(env["ENVCTL_CDI_DIR"]) / "envctl.yaml").read_text())
    devices = {d["name"]: sorted(n["path"] for n in d["containerEdits"]["deviceNodes"])
               for d in cdi["devices"]}
    assert sorted(devices) == sorted(["mig-a", *uuids])
    assert [p for p in devices["mig-a"] if "nvidia-caps" in p] == sorted(
        f"/dev/nvidia-caps/nvidia-cap{m}" for m in minors)
    held = {m["uuid"]: m["env"] for g in sb.envctl_json("gpus", env=env)["gpus"]
            for m in g["instances"]}
    assert held == {u: "mig-a" for u in uuids}

    log = writes(env)
    status = sb.envctl_json("status", "mig-a", env=env)[0]
    assert status["up"] is True, status
    again = sb.envctl("up", "mig-a", env=env)
    assert again.returncode == 0, again.stderr
    assert writes(env) == log  # a second `up` changes nothing in NVML

    down = sb.envctl("down", "mig-a", env=env)
    assert down.returncode == 0, down.stderr
    assert [{k: v for k, v in g.items()} for g in gpus_of(env)] == before
    caps = Path(env["ENVCTL_GPU_ROOT"]) / "proc/driver/nvidia/capabilities/gpu0/mig"
    assert not caps.exists() or list(caps.iterdir()) == []
    (sb.config_dir / "mig-a.yaml").unlink()
    assert sb.residue() == {}


def test_what_does_not_fit_and_slots_others_hold_are_refused_before_any_change(h200):
    sb, env = h200
    sb.write_spec("mig-a", gpu_spec("mig-a", "{mig: [{gpu: 0, profile: 3g.71gb, start: 4}]}"))
    assert sb.envctl("up", "mig-a", env=env).returncode == 0
    log = writes(env)
    # Another spec asking for the same slots: refused, naming who holds them and what is free.
    sb.write_spec("mig-b", gpu_spec("mig-b", "{mig: [{gpu: 0, profile: 3g.71gb, start: 4}]}"))
    res = sb.envctl("up", "mig-b", env=env)
    assert res.returncode == 2, res.stderr
    assert "no room on GPU 0 for 3g.71gb (it needs slots 4-7; free slots: 0-3; held by " \
        "environment 'mig-a')" in res.stderr, res.stderr
    # More than the GPU holds, and a profile name no GPU has.
    sb.write_spec("mig-b", gpu_spec("mig-b", "{mig: [{gpu: 0, profile: 1g.18gb, count: 5}]}"))
    res = sb.envctl("plan", "mig-b", env=env)
    assert res.returncode == 2 and "free slots: none; its instances before it take slots " \
        "0, 1, 2, 3; held by environment 'mig-a')" in res.stderr, res.stderr
    sb.write_spec("mig-b", gpu_spec("mig-b", "{mig: [{gpu: 0, profile: 3g.80gb}]}"))
    res = sb.envctl("plan", "mig-b", env=env)
    assert res.returncode == 2 and "no MIG profile '3g.80gb': allowed are" in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 3, res.stderr
    # Two specs read together claiming the same slots: the second in name order is refused.
    sb.write_spec("mig-b", gpu_spec("mig-b", "{mig: [{gpu: 1, profile: 4g.71gb}]}"))
    sb.write_spec("mig-c", gpu_spec("mig-c", "{mig: [{gpu: 1, profile: 3g.71gb, start: 0}]}"))
    res = sb.envctl("up", "mig-b", "mig-c", env=env)
    assert res.returncode == 2, res.stderr
    assert "no room on GPU 1 for 3g.71gb (it needs slots 0-3; free slots: 4-7; held by " \
        "environment 'mig-b')" in res.stderr, res.stderr
    assert writes(env) == log  # nothing changed
    # A whole GPU the spec read with it would carve is not given (mig-b carves GPU 1) ...
    sb.write_spec("mig-c", gpu_spec("mig-c", "[1]"))
    res = sb.envctl("plan", "mig-c", env=env)
    assert res.returncode == 2 and "also claimed by environment 'mig-b'" in res.stderr, \
        res.stderr
    # ... and one another environment holds cannot be carved.
    (sb.config_dir / "mig-b.yaml").unlink()
    assert sb.envctl("up", "mig-c", env=env).returncode == 0
    sb.write_spec("mig-b", gpu_spec("mig-b", "{mig: [{gpu: 1, profile: 4g.71gb}]}"))
    res = sb.envctl("plan", "mig-b", env=env)
    assert res.returncode == 2 and "GPU 1 is held whole by environment 'mig-c'" in res.stderr
    for name in ("mig-a", "mig-c"):
        assert sb.envctl("down", name, env=env).returncode == 0
    for name in ("mig-a", "mig-b", "mig-c"):
        (sb.config_dir / f"{name}.yaml").unlink()
    assert sb.residue() == {}


def _set(env: dict[str, str], index: int, **fields) -> None:
    path = Path(env["FAKE_NVML_JSON"])
    state = json.loads(path.read_text())
    state["gpus"][index].update(fields)
    path.write_text(json.dumps(state))


def test_mig_mode_is_not_turned_on_under_processes_nor_over_a_pending_reset(h200):
    sb, env = h200
    sb.write_spec("mig-a", gpu_spec("mig-a", "{mig: [{gpu: 0, profile: 7g.141gb}]}"))
    _set(env, 0, processes=[[4242, 1 << 30]])
    res = sb.envctl("up", "mig-a", env=env)
    assert res.returncode == 1
    assert "processes hold the GPU (pid 4242); stop them first" in res.stderr, res.stderr
    _set(env, 0, processes=[], mig_pending=True)  # someone asked; only a reset makes it so
    res = sb.envctl("up", "mig-a", env=env)
    assert res.returncode == 1 and "pending a GPU reset" in res.stderr, res.stderr
    assert writes(env) == []
    _set(env, 0, mig_pending=False, mig_reset_required=True)  # an A100-like GPU
    res = sb.envctl("up", "mig-a", env=env)
    assert res.returncode == 1 and "pending a GPU reset" in res.stderr, res.stderr
    assert gpus_of(env)[0]["mig"] is False
    assert sb.envctl("status", "mig-a", env=env).returncode in (0, 1)
    (sb.config_dir / "mig-a.yaml").unlink()
    assert sb.residue() == {}


def test_kill_9_at_every_step_then_down_leaves_nvml_as_before(h200):
    sb, env = h200
    before = gpus_of(env)
    sb.write_spec("mig-a", gpu_spec("mig-a", LAYOUT))
    for point in ("apply", "after"):
        for index in range(200):  # until the fault's index is past the last step
            res = sb.envctl("up", "mig-a", env={**env, "ENVCTL_FAULT": f"kill@{point}:#{index}"})
            down = sb.envctl("down", "mig-a", env=env)
            assert down.returncode == 0, down.stderr
            assert gpus_of(env) == before, (point, index, res.stderr, down.stdout)
            if res.returncode == 0:
                break
        assert index > 5  # killed at the MIG steps and after them
    for index in range(200):  # `down` killed at each of its steps, then `down` again
        assert sb.envctl("up", "mig-a", env=env).returncode == 0
        res = sb.envctl("down", "mig-a", env={**env, "ENVCTL_FAULT": f"kill@remove:#{index}"})
        down = sb.envctl("down", "mig-a", env=env)
        assert down.returncode == 0, down.stderr
        assert gpus_of(env) == before, (index, res.stderr, down.stdout)
        if res.returncode == 0:
            break
    assert index > 5
    (sb.config_dir / "mig-a.yaml").unlink()
    assert sb.residue() == {}


def test_after_a_reboot_up_makes_the_instances_again_rather_than_adopting(h200):
    sb, env = h200
    fake_boot(sb, str(uuid.uuid4()))
    booted = Path(env["FAKE_NVML_JSON"]).read_text()  # the driver's state at each boot
    sb.write_spec("mig-a", gpu_spec("mig-a", LAYOUT))
    assert sb.envctl("up", "mig-a", env=env).returncode == 0
    first = {gi["cis"][0]["uuid"] for gi in gpus_of(env)[0]["gpu_instances"]}
    after = reboot(sb)  # instances and (on Hopper) MIG mode are gone with the boot
    try:
        for stale in after.run_dir.iterdir():  # /run is a tmpfs: empty at boot
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        state = json.loads(booted)  # the driver as it boots, its UUID counter going on
        state["mig_serial"] = nvml_state(env)["mig_serial"]
        Path(env["FAKE_NVML_JSON"]).write_text(json.dumps(state))
        shutil.rmtree(Path(env["ENVCTL_GPU_ROOT"]) / "proc/driver/nvidia/capabilities/gpu0")
        status = after.envctl_json("status", "mig-a", env=env)[0]
        assert status["up"] is False
        res = after.envctl("up", "mig-a", env=env)
        assert res.returncode == 0, res.stderr
        made = [w[0] for w in writes(env)]
        assert made.count("nvmlDeviceCreateGpuInstanceWithPlacement") == 3
        assert made.count("nvmlDeviceSetMigMode") == 1
        second = {gi["cis"][0]["uuid"] for gi in gpus_of(env)[0]["gpu_instances"]}
        assert len(second) == 3 and not second & first  # new instances, new UUIDs
        environment = inside(after, "mig-a", "cat", "/etc/environment", extra=env).stdout
        assert all(u in environment for u in second), environment
        assert after.envctl("down", "mig-a", env=env).returncode == 0
        assert gpus_of(env) == state["gpus"]
        (after.config_dir / "mig-a.yaml").unlink()
        assert after.residue() == {}
    finally:
        after.close()


def test_a_changed_layout_gives_back_the_old_instances_before_making_the_new(h200):
    sb, env = h200
    before = gpus_of(env)
    sb.write_spec("mig-a", gpu_spec("mig-a", LAYOUT))
    assert sb.envctl("up", "mig-a", env=env).returncode == 0
    # The same slots, another layout: the old instances go first, then the 7g is made.
    sb.write_spec("mig-a", gpu_spec("mig-a", "{mig: [{gpu: 0, profile: 7g.141gb}]}"))
    res = sb.envctl("up", "mig-a", env=env)
    assert res.returncode == 0, res.stderr
    gis = gpus_of(env)[0]["gpu_instances"]
    assert [(gi["start"], gi["size"]) for gi in gis] == [(0, 8)]
    uuid = gis[0]["cis"][0]["uuid"]
    environment = inside(sb, "mig-a", "cat", "/etc/environment", extra=env).stdout
    assert f"CUDA_VISIBLE_DEVICES={uuid}\n" in environment
    assert sb.envctl("down", "mig-a", env=env).returncode == 0
    assert gpus_of(env) == before
    (sb.config_dir / "mig-a.yaml").unlink()
    assert sb.residue() == {}


def test_two_environments_carve_one_gpu_and_mig_mode_goes_back_with_the_last(h200):
    sb, env = h200
    before = gpus_of(env)
    sb.write_spec("mig-a", gpu_spec("mig-a", "{mig: [{gpu: 0, profile: 3g.71gb}]}"))
    sb.write_spec("mig-b", gpu_spec("mig-b", "{mig: [{gpu: 0, profile: 3g.71gb}]}"))
    res = sb.envctl("up", "mig-a", "mig-b", env=env)
    assert res.returncode == 0, res.stderr
    assert sorted(gi["start"] for gi in gpus_of(env)[0]["gpu_instances"]) == [0, 4]
    assert sb.envctl("down", "mig-a", env=env).returncode == 0
    gpu0 = gpus_of(env)[0]
    assert gpu0["mig"] is True  # mig-b still carves it
    assert [gi["start"] for gi in gpu0["gpu_instances"]] == [4]
    assert sb.envctl("down", "mig-b", env=env).returncode == 0
    assert gpus_of(env) == before
    for name in ("mig-a", "mig-b"):
        (sb.config_dir / f"{name}.yaml").unlink()
    assert sb.residue() == {}


def test_instances_and_mig_mode_envctl_found_are_left_as_found(sandbox, tmp_path):
    if shutil.which("gcc") is None or shutil.which("ldconfig") is None:
        pytest.skip("needs gcc and ldconfig (scripts/install-deps installs them)")
    sb, env = sandbox, gpuhost.make_host(tmp_path / "gpuroot", gpus=1, numa=1,
                                         mig_layout=["3g.71gb"])
    before = gpus_of(env)
    sb.write_spec("mig-a", gpu_spec("mig-a", "{mig: [{gpu: 0, profile: 3g.71gb}]}"))
    plan = sb.envctl("plan", "mig-a", env=env)
    assert "GPU 0: 3g.71gb at slots 4-7 (new)" in " ".join(plan.stdout.split()), plan.stdout
    assert sb.envctl("up", "mig-a", env=env).returncode == 0
    assert sorted(gi["start"] for gi in gpus_of(env)[0]["gpu_instances"]) == [0, 4]
    # Pinned over the instance envctl did not make: refused, naming it.
    sb.write_spec("mig-b", gpu_spec("mig-b", "{mig: [{gpu: 0, profile: 3g.71gb, start: 0}]}"))
    res = sb.envctl("plan", "mig-b", env=env)
    assert res.returncode == 2 and "an instance envctl did not make holds some" in res.stderr
    (sb.config_dir / "mig-b.yaml").unlink()
    assert sb.envctl("down", "mig-a", env=env).returncode == 0
    assert gpus_of(env) == before  # its own instance and MIG mode on, as found
    (sb.config_dir / "mig-a.yaml").unlink()
    assert sb.residue() == {}


def test_an_instance_made_by_someone_else_between_plan_and_apply_is_refused_not_adopted(
        sandbox, tmp_path):
    from tests.integration.test_engine import wait_for

    if shutil.which("gcc") is None or shutil.which("ldconfig") is None:
        pytest.skip("needs gcc and ldconfig (scripts/install-deps installs them)")
    sb, env = sandbox, gpuhost.make_host(tmp_path / "gpuroot", gpus=1, numa=1,
                                         mig_layout=["1g.18gb"])
    sb.write_spec("mig-a", gpu_spec("mig-a", "{mig: [{gpu: 0, profile: 3g.71gb, start: 4}]}"))
    go = tmp_path / "go"
    proc = sb.popen(sys.executable, "-m", "envctl", "up", "mig-a",
                    env={**env, "ENVCTL_FAULT": f"until={go}@before:mig-instance:*"})
    try:
        wait_for("up to reach the MIG instance step", Path(f"{go}.waiting").exists, proc)
        path = Path(env["FAKE_NVML_JSON"])
        state = json.loads(path.read_text())  # someone runs nvidia-smi mig -cgi 9 meanwhile
        state["gpus"][0]["gpu_instances"].append(
            {"id": 2, "profile": 2, "start": 4, "size": 4,
             "cis": [{"id": 0, "profile": 2, "uuid": "MIG-someone-elses"}]})
        path.write_text(json.dumps(state))
        before = gpus_of(env)
    finally:
        go.touch()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "a MIG instance envctl did not make is there" in err, err
    assert gpus_of(env) == before  # not adopted, not destroyed; MIG mode on, as found
    assert sb.envctl("down", "mig-a", env=env).returncode == 0
    assert gpus_of(env) == before
    (sb.config_dir / "mig-a.yaml").unlink()
    assert sb.residue() == {}


def test_the_monitor_samples_each_instance_and_gives_its_processes_to_the_holder(h200,
                                                                                 tmp_path):
    """`monitor --once` on the fake host: one series set per MIG instance, labelled as
    dcgm-exporter labels it (parent `gpu`/`UUID`, GPU_I_ID, GPU_I_PROFILE) and with its
    holder; a process of the environment's cgroup on an instance counts as the environment's
    GPU memory under the instance; one CSV row per instance."""
    from envctl.monitor.prom import parse_exposition
    from tests.integration.test_gpu_env import env_cgroup

    sb, env = h200
    sb.write_spec("mig-a", gpu_spec("mig-a", LAYOUT))
    assert sb.envctl("up", "mig-a", env=env).returncode == 0
    sleeper = subprocess.Popen(["sleep", "1000"])
    try:
        (env_cgroup(sb, "mig-a") / "cgroup.procs").write_text(str(sleeper.pid))
        state = nvml_state(env)
        gis = sorted(state["gpus"][0]["gpu_instances"], key=lambda g: g["id"])
        big = next(gi for gi in gis if gi["size"] == 4)  # the 3g.71gb one
        big.update(used=5 << 30, processes=[[sleeper.pid, 5 << 30]])
        Path(env["FAKE_NVML_JSON"]).write_text(json.dumps(state))
        res = sb.envctl("monitor", "--once", "--csv-dir", str(tmp_path / "csv"), env=env)
        assert res.returncode == 0, res.stderr
        m = parse_exposition(res.stdout)
    finally:
        sleeper.kill()
        sleeper.wait()
    used = {lab["mig_uuid"]: (lab, v) for lab, v in m["envctl_mig_memory_used_bytes"]}
    assert sorted(used) == sorted(gi["cis"][0]["uuid"] for gi in gis)
    lab, value = used[big["cis"][0]["uuid"]]
    assert value == 5 << 30
    assert (lab["gpu"], lab["UUID"], lab["GPU_I_ID"], lab["GPU_I_PROFILE"],
            lab["envctl_environment"]) == ("0", state["gpus"][0]["uuid"], str(big["id"]),
                                           "3g.71gb", "mig-a")
    # One tick: GPM has one sample, no activity between two yet.
    assert "envctl_mig_graphics_utilization_ratio" not in m
    mine = [(lab["mig_uuid"], v) for lab, v in m["envctl_environment_gpu_memory_used_bytes"]
            if lab["envctl_environment"] == "mig-a"]
    assert mine == [(big["cis"][0]["uuid"], 5 << 30)]
    rows = (tmp_path / "csv" / "gpu-metrics.csv").read_text().splitlines()
    mig_rows = [r.split(",") for r in rows if "/GI" in r]
    assert sorted(r[1] for r in mig_rows) == sorted(f"GPU0/GI{gi['id']}/CI0" for gi in gis)
    assert all(r[-1] == "mig-a" for r in mig_rows)
    assert sb.envctl("down", "mig-a", env=env).returncode == 0
    (sb.config_dir / "mig-a.yaml").unlink()
    assert sb.residue() == {}
