"""GPU health gating on the fake GPU host with a real kernel: a GPU with pending row
remapping or a fatal XID in the kernel log is quarantined by `up` (ledger, event), given to no
environment, shown by `gpus` and `status`; a job of an environment that already holds it fails
with the reason instead of starting; `gpus --clear` releases it after the operator's reset."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.fakes import gpuhost
from tests.integration.test_gpu_env import UUIDS, fake_gpu_host, gpu_spec, inside

pytestmark = pytest.mark.root


@pytest.fixture
def gpu_host(sandbox, tmp_path):
    if shutil.which("gcc") is None or shutil.which("ldconfig") is None:
        pytest.skip("needs gcc and ldconfig (scripts/install-deps installs them)")
    return sandbox, fake_gpu_host(tmp_path / "gpuroot")


def nvml_set(env: dict[str, str], index: int, **fields) -> None:
    path = env["FAKE_NVML_JSON"]
    with open(path) as f:
        data = json.load(f)
    data["gpus"][index].update(fields)
    with open(path, "w") as f:
        json.dump(data, f)


def pci_of(env: dict[str, str], index: int) -> str:
    with open(env["FAKE_NVML_JSON"]) as f:
        bus = json.load(f)["gpus"][index]["pci"]  # "00000000:3B:00.0"
    domain, b, rest = bus.split(":")
    return f"{int(domain, 16):04x}:{int(b, 16):02x}:{rest.split('.')[0].lower()}"


def events(sb) -> list[dict]:
    path = sb.state / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_sick_gpu_is_quarantined_kept_out_and_fails_the_jobs_of_its_holder(gpu_host, tmp_path):
    sb, env = gpu_host
    root = env["ENVCTL_GPU_ROOT"]
    nvml_set(env, 0, remapped=[0, 2, 1, 0], retired_pending=0)  # row remapping pending
    sb.write_spec("gpu-a", gpu_spec("gpu-a", "1"))

    # plan is read-only: it sees the GPU unfit and plans around it, records nothing.
    plan = sb.envctl("plan", "gpu-a", env=env)
    assert plan.returncode == 0, plan.stderr
    assert not (sb.state / "gpu-quarantine.json").exists()

    res = sb.envctl("up", "gpu-a", env=env)
    assert res.returncode == 0, res.stderr
    assert f"GPU {UUIDS[0]} quarantined: row remapping pending" in res.stderr
    report = sb.envctl_json("gpus", env=env)
    by_uuid = {g["uuid"]: g for g in report["gpus"]}
    assert by_uuid[UUIDS[1]]["env"] == "gpu-a"  # the count went around the sick one
    assert by_uuid[UUIDS[0]]["env"] is None
    assert by_uuid[UUIDS[0]]["health"]["quarantined"] is True
    assert by_uuid[UUIDS[0]]["health"]["evidence"] == ["row remapping pending (a reset "
                                                       "applies it)"]
    assert [e["event"] for e in events(sb)] == ["gpu-quarantined"]
    # Its node is not in the environment's /dev.
    listed = inside(sb, "gpu-a", "ls", "/dev")
    assert listed.returncode == 0, listed.stderr
    assert "nvidia1" in listed.stdout.split() and "nvidia0" not in listed.stdout.split()

    # Named explicitly: refused, exit 2, naming the evidence and the way out.
    sb.write_spec("gpu-b", gpu_spec("gpu-b", "[0]"))
    before = sb.residue()
    res = sb.envctl("up", "gpu-b", env=env)
    assert res.returncode == 2, res.stderr
    assert "is quarantined (row remapping pending" in res.stderr
    assert "envctl gpus --clear 0" in res.stderr
    assert sb.residue() == before

    # GPU 1, held by gpu-a, logs XID 79 (fallen off the bus): the next `up` records it
    # (though gpu-b is refused), and gpu-a's jobs fail with the reason instead of starting.
    kmsg = os.path.join(root, "dev", "kmsg")
    with open(kmsg, "w") as f:
        f.write("6,100,5000,-;nvidia: loading out-of-tree module\n"
                f"4,812,9000,-;NVRM: Xid (PCI:{pci_of(env, 1)}): 79, pid=1234, GPU has fallen "
                "off the bus.\n")
    res = sb.envctl("up", "gpu-b", env=env)
    assert res.returncode == 2 and f"GPU {UUIDS[1]} quarantined: XID 79" in res.stderr
    assert events(sb)[-1]["env"] == "gpu-a" and "XID 79" in events(sb)[-1]["detail"]
    status = sb.envctl_json("status", "gpu-a", env=env)
    assert "is quarantined: XID 79" in json.dumps(status)
    job = sb.envctl("submit-job", "--json", "--user", "root", "gpu-a", "/bin/true",
                    env=env)
    rec = json.loads(job.stdout) if job.stdout.strip() else {}
    if rec.get("state") not in ("FAILED",):
        res = sb.envctl("wait", "--json", str(rec["id"]), env=env, timeout=120)
        rec = json.loads(res.stdout)[0]
    assert rec["state"] == "FAILED", (job.stderr, rec)
    assert "quarantined: XID 79" in rec["error"]

    # The operator resets GPU 1 and clears it: the XID logged before the clear does not count
    # again; jobs run, and GPU 0 stays quarantined.
    res = sb.envctl("gpus", "--clear", "1", env=env)
    assert res.returncode == 0, res.stderr
    assert [e["event"] for e in events(sb)][-1] == "gpu-cleared"
    assert sb.envctl("up", "gpu-a", env=env).returncode == 0
    report = sb.envctl_json("gpus", env=env)
    health = {g["uuid"]: g["health"] for g in report["gpus"]}
    assert health[UUIDS[1]] is None and health[UUIDS[0]]["quarantined"]
    res = sb.envctl("gpus", "--clear", "1", env=env)
    assert res.returncode == 2 and "is not quarantined" in res.stderr
    job = sb.envctl("submit-job", "--json", "--user", "root", "gpu-a", "/bin/true", env=env)
    assert job.returncode == 0, job.stderr
    res = sb.envctl("wait", "--json", str(json.loads(job.stdout)["id"]), env=env, timeout=120)
    assert json.loads(res.stdout)[0]["state"] == "COMPLETED", res.stdout

    assert sb.envctl("down", "gpu-a", env=env).returncode == 0
    residue = sb.residue()
    # What outlives `down` is history: the events, the jobs and the quarantine (GPU 0's).
    assert residue.pop("state_dir") == ["events.jsonl", "gpu-quarantine.json",
                                        "gpu-quarantine.lock", "jobs", "lock"]
    assert residue == {}


def test_gpus_reads_health_without_writing(gpu_host, tmp_path):
    sb, env = gpu_host
    nvml_set(env, 1, ecc={"sbe_vol": 0, "dbe_vol": 3, "sbe_agg": 0, "dbe_agg": 3})
    res = sb.envctl("gpus", "--json", env=env)
    assert res.returncode == 0, res.stderr
    health = {g["uuid"]: g["health"] for g in json.loads(res.stdout)["gpus"]}
    assert health[UUIDS[0]] is None
    assert health[UUIDS[1]] == {"quarantined": False, "since": None, "evidence": [],
                                "found_now": ["3 volatile uncorrectable ECC error(s) since "
                                              "the last reset"]}
    assert not (sb.state / "gpu-quarantine.json").exists()
    assert gpuhost.gpu_uuid(1) == UUIDS[1]
