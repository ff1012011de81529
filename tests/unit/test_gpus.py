"""GPU discovery (the driver's /proc files, NVML through the fake pynvml), the CDI spec and the
`envctl gpus` report, against fake trees: no GPU and no root needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from envctl.engine.journal import Entry, Journal
from envctl.errors import ForeignObject, InputError, UsageError
from envctl.facts import GpuFact, GpuHostFacts, MigFact, PlacedFile
from envctl.gpus import cdi_path, gpu_report, survey, sync_cdi, write_cdi
from envctl.host import gpus as hg
from envctl.host.context import Host
from envctl.plan.cdi import CDI_VERSION, KIND, cdi_spec, library_mounts
from tests.fakes import (
    OPEN_VERSION,
    PROPRIETARY_VERSION,
    PYNVML_DIR,
    FakeGpu,
    check_cdi,
    make_tree,
    nvml_json,
    proc_devices,
)
from tests.unit.fakes import Thing

SRC = Path(__file__).resolve().parents[2] / "src"
A = FakeGpu("GPU-5a0c6f1e-7f2b-4c1d-9e8f-0123456789ab", "0000:b1:00.0", minor=1)
B = FakeGpu("GPU-0f9e8d7c-6b5a-4321-8765-fedcba987654", "0000:3b:00.0", minor=0,
            name="NVIDIA H100 80GB HBM3", mig=True)


@pytest.fixture
def nvml(monkeypatch):
    """The fake pynvml first on sys.path, imported afresh; removed again afterwards."""
    monkeypatch.syspath_prepend(str(PYNVML_DIR))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    import pynvml

    assert Path(pynvml.__file__).parent == PYNVML_DIR
    yield pynvml
    sys.modules.pop("pynvml", None)


@pytest.fixture
def nodes(monkeypatch):
    """The device nodes discovery sees (making real ones needs root: see the integration
    test); NVML is only asked when they exist."""
    def use(found: dict[str, tuple[int, int]]) -> None:
        monkeypatch.setattr(hg, "device_nodes", lambda root: dict(found))
    return use


def all_nodes(*gpus: FakeGpu) -> dict[str, tuple[int, int]]:
    return {"nvidiactl": (195, 255), **{f"nvidia{g.minor}": (195, g.minor) for g in gpus}}


# ---------------------------------------------------------------- parsers


def test_proc_devices_with_the_frontend_module():
    majors = hg.parse_devices(proc_devices(frontend="nvidia-frontend", uvm=511, caps=236))
    assert majors == {"nvidia-frontend": 195, "nvidia-uvm": 511, "nvidia-caps": 236}


def test_proc_devices_of_newer_drivers_name_195_nvidia():
    # register_chrdev_region(…, "nvidia") and (…, "nvidiactl") in kernel-open/nvidia/nv.c
    text = proc_devices(frontend="nvidia", uvm=508, caps=509, imex=510)
    assert hg.parse_devices(text) == {"nvidia-frontend": 195, "nvidia-uvm": 508,
                                      "nvidia-caps": 509, "nvidia-caps-imex-channels": 510}


def test_proc_devices_block_section_is_not_read():
    text = proc_devices(uvm=None, caps=None)  # the block section has "240 nvidia-uvm"
    assert hg.parse_devices(text) == {"nvidia-frontend": 195}
    assert hg.parse_devices("") == {}


@pytest.mark.parametrize(("text", "version"), [
    (PROPRIETARY_VERSION, "550.54.15"),
    (OPEN_VERSION, "580.95.05"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  570.86.15  Release Build  "
     "(root@host)\n", "570.86.15"),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.135  Fri Jan 10 20:00:00 UTC 2025\n",
     "550.135"),
    ("GCC version:  gcc version 12.2.0\n", ""),
    ("", ""),
])
def test_driver_version_lines(text, version):
    assert hg.parse_version(text) == version


def test_information_file_fields():
    info = hg.parse_information(
        "Model: \t\t Tesla K80\nIRQ:   \t\t 33\nGPU UUID: \t GPU-be0a1aaf-c92d-ce5e-6d53-"
        "1f064e6842f6\nBus Location: \t 0000:00:04.0\nDevice Minor: \t 0\nBlacklisted:\t No\n")
    assert info["Model"] == "Tesla K80"
    assert info["GPU UUID"] == "GPU-be0a1aaf-c92d-ce5e-6d53-1f064e6842f6"
    assert info["Bus Location"] == "0000:00:04.0"  # the value keeps its own colons
    assert info["Device Minor"] == "0"


@pytest.mark.parametrize(("raw", "pci"), [
    ("00000000:3B:00.0", "0000:3b:00.0"),  # NVML's spelling
    ("0000:3b:00.0", "0000:3b:00.0"),
    ("00010000:01:00.1", "10000:01:00.1"),  # a VMD domain is wider than 16 bits
    ("3b:00.0", ""),
    ("", ""),
])
def test_pci_addresses_normalised(raw, pci):
    assert hg.normalize_pci(raw) == pci


def test_proc_gpus_are_indexed_in_bus_order(tmp_path):
    make_tree(tmp_path, [A, B])  # A (b1) sorts after B (3b) whatever listdir says
    gpus, problems = hg.read_proc_gpus(tmp_path)
    assert problems == []
    assert [(g.index, g.uuid, g.minor, g.pci) for g in gpus] == [
        (0, B.uuid, 0, "0000:3b:00.0"), (1, A.uuid, 1, "0000:b1:00.0")]
    assert gpus[0].name == "NVIDIA H100 80GB HBM3"


def test_proc_gpu_without_a_uuid_yet_is_a_problem(tmp_path):
    make_tree(tmp_path, [FakeGpu("GPU-????????-????-????-????-????????????", "0000:01:00.0", 0)])
    gpus, problems = hg.read_proc_gpus(tmp_path)
    assert gpus[0].uuid == ""
    assert "does not show this GPU's UUID" in problems[0]


def test_nvml_mode_from_the_environment():
    assert hg.nvml_mode({}) == "auto"
    assert hg.nvml_mode({"ENVCTL_NVML": "off"}) == "off"
    with pytest.raises(InputError, match="ENVCTL_NVML is 'on': allowed values are auto, off"):
        hg.nvml_mode({"ENVCTL_NVML": "on"})
    from envctl.host.context import Host

    assert Host.from_env({}).gpu_root == Path("/")
    assert Host.from_env({"ENVCTL_GPU_ROOT": ""}).gpu_root == Path("/")
    assert Host.from_env({"ENVCTL_GPU_ROOT": "/tmp/x"}).gpu_root == Path("/tmp/x")


# ---------------------------------------------------------------- discovery


def test_discovery_through_nvml(tmp_path, monkeypatch, nvml, nodes):
    make_tree(tmp_path, [A, B])
    monkeypatch.setenv("FAKE_NVML_JSON", str(nvml_json(tmp_path / "nvml.json", [B, A])))
    nodes(all_nodes(A, B))
    facts = hg.discover_gpus(tmp_path)
    assert facts.source == "nvml"
    assert facts.driver == "550.54.15"
    assert facts.gpus == (
        GpuFact(0, B.uuid, B.name, 0, B.memory, True, "0000:3b:00.0", mig_pending=True),
        GpuFact(1, A.uuid, A.name, 1, A.memory, False, "0000:b1:00.0"))
    assert facts.majors == {"nvidia-frontend": 195, "nvidia-uvm": 235, "nvidia-caps": 238}
    assert facts.problems == ()
    assert nvml.calls == {"init": 1, "shutdown": 1}


def test_old_pynvml_bytes_and_a_gpu_without_mig(tmp_path, monkeypatch, nvml, nodes):
    old = FakeGpu(A.uuid, A.pci, 1, name="Tesla V100-SXM2-16GB", mig=None)
    make_tree(tmp_path, [old])
    monkeypatch.setenv("FAKE_NVML_JSON", str(nvml_json(tmp_path / "n.json", [old], bytes=True)))
    nodes(all_nodes(old))
    facts = hg.discover_gpus(tmp_path)
    assert facts.source == "nvml"
    assert facts.gpus[0].uuid == A.uuid and facts.gpus[0].name == "Tesla V100-SXM2-16GB"
    assert facts.gpus[0].pci == "0000:b1:00.0"
    assert facts.gpus[0].mig is False  # "not supported" is no MIG, not a failure


def test_nvml_knows_the_uuid_proc_does_not_show_yet(tmp_path, monkeypatch, nvml, nodes):
    make_tree(tmp_path, [FakeGpu("GPU-????????-????-????-????-????????????", A.pci, 1)])
    monkeypatch.setenv("FAKE_NVML_JSON", str(nvml_json(tmp_path / "n.json", [A])))
    nodes(all_nodes(A))
    facts = hg.discover_gpus(tmp_path)
    assert facts.gpus[0].uuid == A.uuid and facts.problems == ()
    proc = hg.discover_gpus(tmp_path, nvml="off")
    assert proc.gpus[0].uuid == "" and "does not show this GPU's UUID" in proc.problems[0]


def test_nvml_init_failure_falls_back_to_proc(tmp_path, monkeypatch, nvml, nodes):
    make_tree(tmp_path, [A, B])
    monkeypatch.setenv("FAKE_NVML_JSON", str(nvml_json(tmp_path / "n.json", [A, B],
                                                       fail_init=True)))
    nodes(all_nodes(A, B))
    facts = hg.discover_gpus(tmp_path)
    assert facts.source == "proc"
    assert [g.uuid for g in facts.gpus] == [B.uuid, A.uuid]
    assert facts.gpus[0].memory_bytes == 0  # /proc does not say
    assert facts.driver == "550.54.15"
    assert facts.problems == (
        "NVML failed to initialise: NVML Shared Library Not Found; GPUs read from /proc",)
    assert nvml.calls == {"init": 0, "shutdown": 0}


def test_nvml_failing_midway_falls_back_and_shuts_down(tmp_path, monkeypatch, nvml, nodes):
    make_tree(tmp_path, [A])
    monkeypatch.setenv("FAKE_NVML_JSON", str(nvml_json(tmp_path / "n.json", [A],
                                                       fail="nvmlDeviceGetName")))
    nodes(all_nodes(A))
    facts = hg.discover_gpus(tmp_path)
    assert facts.source == "proc" and facts.gpus[0].uuid == A.uuid
    assert "NVML failed while listing GPUs: Unknown Error" in facts.problems[0]
    assert nvml.calls == {"init": 1, "shutdown": 1}


def test_nvml_off_reads_proc_only(tmp_path, monkeypatch, nvml, nodes):
    make_tree(tmp_path, [A])
    monkeypatch.setenv("FAKE_NVML_JSON", str(nvml_json(tmp_path / "n.json", [A])))
    nodes(all_nodes(A))
    facts = hg.discover_gpus(tmp_path, nvml="off")
    assert facts.source == "proc" and facts.problems == ()
    assert nvml.calls["init"] == 0
    with pytest.raises(InputError, match="nvml is 'yes'"):
        hg.discover_gpus(tmp_path, nvml="yes")


def test_nvml_is_not_asked_while_a_node_is_missing(tmp_path, monkeypatch, nvml, nodes):
    # libnvidia-ml would create the node through nvidia-modprobe: discovery must not.
    make_tree(tmp_path, [A, B])
    monkeypatch.setenv("FAKE_NVML_JSON", str(nvml_json(tmp_path / "n.json", [A, B])))
    nodes({"nvidiactl": (195, 255), "nvidia0": (195, 0)})
    facts = hg.discover_gpus(tmp_path)
    assert facts.source == "proc"
    assert nvml.calls["init"] == 0
    assert facts.problems[0].startswith(f"NVML not used: {tmp_path}/dev/nvidia1 missing")


def test_no_driver_no_gpus_no_problems(tmp_path, monkeypatch, nvml):
    make_tree(tmp_path, [], version=None, devices="Character devices:\n  1 mem\n")
    monkeypatch.setenv("FAKE_NVML_JSON", str(nvml_json(tmp_path / "n.json", [A])))
    facts = hg.discover_gpus(tmp_path)
    assert facts == GpuHostFacts()
    assert nvml.calls["init"] == 0  # no driver: NVML is not asked


def test_nothing_at_all_under_the_root(tmp_path):
    assert hg.discover_gpus(tmp_path / "missing") == GpuHostFacts()


def test_driver_without_uvm_and_a_wrong_node(tmp_path, nodes):
    make_tree(tmp_path, [A], devices=proc_devices(uvm=None))
    nodes({"nvidiactl": (195, 255), "nvidia1": (195, 7)})
    facts = hg.discover_gpus(tmp_path, nvml="off")
    assert any("no nvidia-uvm in" in p and "CUDA needs" in p for p in facts.problems)
    assert f"{tmp_path}/dev/nvidia1 is char 195:7, not 195:1" in facts.problems


def test_device_nodes_are_character_devices_by_stat(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").symlink_to("/dev/null")  # a real char device, reachable without root
    (dev / "nvidia1").write_text("")  # a plain file is no node
    (dev / "nvidia-caps").mkdir()
    (dev / "null").symlink_to("/dev/null")  # not an NVIDIA name
    null = os.stat("/dev/null").st_rdev
    assert hg.device_nodes(tmp_path) == {"nvidia0": (os.major(null), os.minor(null))}


def test_discovery_opens_nothing_for_writing(tmp_path):
    """Read-only means read-only: no file opened for writing, no node made, no module
    loaded, no process run (an audit hook on a real discovery, NVML included)."""
    make_tree(tmp_path, [A, B])
    conf = nvml_json(tmp_path / "n.json", [A, B])
    (tmp_path / "dev" / "nvidiactl").symlink_to("/dev/null")
    for g in (A, B):
        (tmp_path / "dev" / f"nvidia{g.minor}").symlink_to("/dev/null")
    code = r'''
import os, sys
from pathlib import Path
seen = []
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
def hook(event, args):
    if event == "open" and (isinstance(args[1], str) and set(args[1]) & set("wax+")
                            or isinstance(args[2], int) and args[2] & WRITE):
        seen.append((event, str(args[0])))
    elif event.startswith(("os.mknod", "os.mkdir", "os.remove", "os.rename", "os.chmod",
                           "subprocess.", "os.exec", "os.posix_spawn", "os.fork",
                           "ctypes.dlopen", "os.truncate", "os.symlink")):
        seen.append((event, str(args[:1])))
sys.addaudithook(hook)
from envctl.host.gpus import discover_gpus
facts = discover_gpus(Path(sys.argv[1]))
print(facts.source, len(facts.gpus), seen)
'''
    env = {**os.environ, "PYTHONPATH": f"{PYNVML_DIR}:{SRC}", "FAKE_NVML_JSON": str(conf)}
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, env=env, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split(" ", 2) == ["nvml", "2", "[]\n"]


# ---------------------------------------------------------------- CDI

FACTS = GpuHostFacts(
    driver="550.54.15",
    gpus=(GpuFact(0, B.uuid, B.name, 0, B.memory, False, B.pci),
          GpuFact(1, A.uuid, A.name, 1, A.memory, False, A.pci)),
    majors={"nvidia-frontend": 195, "nvidia-uvm": 511},
    libraries=(
        PlacedFile("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
                   "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"),
        PlacedFile("/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                   "/usr/lib/x86_64-linux-gnu/libcuda.so.1", link="libcuda.so.550.54.15"),
        PlacedFile("/usr/lib/x86_64-linux-gnu/libcuda.so",
                   "/usr/lib/x86_64-linux-gnu/libcuda.so", link="libcuda.so.1"),
    ),
    source="nvml")


def test_cdi_spec_shape():
    spec = cdi_spec({"gpu-b": [A.uuid, B.uuid], "gpu-a": [], "cpu-x": []}, FACTS)
    assert check_cdi(spec) == []
    # The lowest version with node hostPath: Debian 12's podman (4.3) refuses 0.6.0.
    assert spec["cdiVersion"] == CDI_VERSION == "0.5.0"
    assert spec["kind"] == KIND == "envctl.io/gpu"
    assert [d["name"] for d in spec["devices"]] == ["gpu-b"]  # no GPU, no device
    edits = spec["devices"][0]["containerEdits"]
    assert edits["deviceNodes"] == [
        {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1, "fileMode": 0o660,
         "permissions": "rw"},
        {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 0o660,
         "permissions": "rw"}]
    assert edits["env"] == [f"CUDA_VISIBLE_DEVICES={A.uuid},{B.uuid}"]
    common = spec["containerEdits"]
    assert [(n["path"], n["major"], n["minor"]) for n in common["deviceNodes"]] == [
        ("/dev/nvidiactl", 195, 255), ("/dev/nvidia-uvm", 511, 0),
        ("/dev/nvidia-uvm-tools", 511, 1)]
    # As nvidia-ctk: the NVIDIA runtime hook must not add GPUs of its own.
    assert common["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert "hooks" not in common  # no nvidia-cdi-hook on this host


def test_cdi_library_symlinks_are_mounted_as_the_file_they_name():
    real = "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"
    assert cdi_spec({"g": [A.uuid]}, FACTS)["containerEdits"]["mounts"] == [
        {"hostPath": real, "containerPath": p, "options": ["ro", "nosuid", "nodev", "bind"]}
        for p in ("/usr/lib/x86_64-linux-gnu/libcuda.so",
                  "/usr/lib/x86_64-linux-gnu/libcuda.so.1", real)]
    # A link to a file that is not listed names it all the same; absolute links too.
    assert library_mounts([PlacedFile("/lib/a.so.1", "/opt/x/a.so.1", link="../y/a.so.9"),
                           PlacedFile("/lib/b.so", "/lib/b.so", link="/opt/b.so.2")]) == [
        {"hostPath": "/opt/y/a.so.9", "containerPath": "/lib/a.so.1",
         "options": ["ro", "nosuid", "nodev", "bind"]},
        {"hostPath": "/opt/b.so.2", "containerPath": "/lib/b.so",
         "options": ["ro", "nosuid", "nodev", "bind"]}]


def test_cdi_host_paths_under_another_dev_root_and_without_uvm():
    facts = GpuHostFacts(gpus=FACTS.gpus, majors={"nvidia-frontend": 195})
    spec = cdi_spec({"g": [B.uuid]}, facts, dev_root="/srv/root/dev")
    assert check_cdi(spec) == []
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["hostPath"] == \
        "/srv/root/dev/nvidia0"
    assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == ["/dev/nvidiactl"]
    assert "mounts" not in spec["containerEdits"]


def test_cdi_refuses_unknown_gpus_and_bad_names():
    with pytest.raises(InputError, match="environment 'g' holds GPU-gone, which this host"):
        cdi_spec({"g": ["GPU-gone"]}, FACTS)
    with pytest.raises(InputError, match="CDI device name '-g'"):
        cdi_spec({"-g": [A.uuid]}, FACTS)


def test_the_cdi_check_catches_what_the_spec_refuses():
    good = cdi_spec({"g": [A.uuid]}, FACTS)
    assert check_cdi({**good, "devices": []}) == ["no devices (a CDI spec needs at least one)"]
    assert check_cdi({**good, "kind": "gpu"}) == ["kind 'gpu'"]
    assert check_cdi({**good, "cdiVersion": "0.9.9"}) != []
    bad_node = {"name": "g", "containerEdits": {"deviceNodes": [{"path": "/dev/x",
                                                                 "perms": "rw"}]}}
    assert check_cdi({**good, "devices": [bad_node]}) == ["device g: node field perms"]


# ---------------------------------------------------------------- the report and the file


def _journal(state: Path, env: str, claims: dict, *, entries: bool = True) -> None:
    j = Journal.open(state, env)
    if entries:
        j.put(Entry(f"fake-thing:{env}", Thing(env).to_dict(), {"old": None}, "applied"))
    j.set_meta({"claims": claims})
    j.save()


@pytest.fixture
def host_with_gpus(tmp_path, monkeypatch):
    make_tree(tmp_path / "root", [A, B])
    monkeypatch.setenv("ENVCTL_NVML", "off")
    return Host(state_dir=tmp_path / "state", run_dir=tmp_path / "run",
                proc=tmp_path / "noproc"), tmp_path / "root"


def test_report_says_which_environment_holds_each_gpu(host_with_gpus):
    host, root = host_with_gpus
    _journal(host.state_dir, "gpu-a", {"gpus": {"uuids": [A.uuid], "indices": [1]}})
    _journal(host.state_dir, "gpu-b", {"gpus": {"all": False, "indices": [0], "uuids": []}})
    _journal(host.state_dir, "gone", {"gpus": {"uuids": [B.uuid]}}, entries=False)
    _journal(host.state_dir, "cpu-x", {"address": "10.0.0.2"})
    report = gpu_report(host, root)
    assert [(g["index"], g["uuid"], g["env"]) for g in report["gpus"]] == [
        (0, B.uuid, "gpu-b"), (1, A.uuid, "gpu-a")]
    assert report["driver"] == "550.54.15" and report["source"] == "proc"
    assert report["gpus"][0] == {"index": 0, "uuid": B.uuid, "name": B.name, "minor": 0,
                                 "memory": 0, "mig": False, "mig_pending": False,
                                 "pci": "0000:3b:00.0", "env": "gpu-b", "health": None,
                                 "instances": []}
    assert report["warnings"] == []


def test_report_skips_a_damaged_journal_with_a_note(host_with_gpus):
    host, root = host_with_gpus
    _journal(host.state_dir, "gpu-a", {"gpus": {"uuids": [A.uuid, "GPU-elsewhere"]}})
    (host.state_dir / "journal" / "broken.json").write_text("{not json")
    report = gpu_report(host, root)
    assert [g["env"] for g in report["gpus"]] == [None, "gpu-a"]
    assert report["warnings"][0].startswith("journal of 'broken' not read: state file")
    assert report["warnings"][1] == ("environment 'gpu-a' holds GPU-elsewhere, which this "
                                     "host does not show")


def test_write_cdi_is_atomic_yaml_0644(host_with_gpus, tmp_path):
    host, root = host_with_gpus
    _journal(host.state_dir, "gpu-a", {"gpus": {"uuids": [A.uuid]}})
    target = tmp_path / "etc" / "cdi" / "envctl.yaml"
    old = os.umask(0o077)
    try:
        assert write_cdi(host, root, target) == target
    finally:
        os.umask(old)
    spec = yaml.safe_load(target.read_text())
    assert check_cdi(spec) == []
    assert spec["devices"][0]["name"] == "gpu-a"
    node = spec["devices"][0]["containerEdits"]["deviceNodes"][0]
    assert node["hostPath"] == f"{root}/dev/nvidia1" and node["fileMode"] == 0o660
    assert target.stat().st_mode & 0o7777 == 0o644
    assert sorted(p.name for p in target.parent.iterdir()) == ["envctl.yaml"]  # no temp left


def test_write_cdi_without_holders_writes_nothing(host_with_gpus, tmp_path):
    host, root = host_with_gpus
    target = tmp_path / "cdi" / "envctl.yaml"
    with pytest.raises(UsageError, match="no environment holds a GPU"):
        write_cdi(host, root, target)
    assert not target.parent.exists()


def test_cdi_path_default_and_override():
    assert cdi_path({}) == Path("/etc/cdi/envctl.yaml")
    assert cdi_path({"ENVCTL_CDI_DIR": "/run/cdi"}) == Path("/run/cdi/envctl.yaml")


def test_survey_of_a_host_without_gpus(tmp_path):
    host = Host(state_dir=tmp_path / "state", run_dir=tmp_path / "run")
    found = survey(host, tmp_path)
    assert found.facts == GpuHostFacts() and found.holders == {} and found.warnings == []


# ---------------------------------------------------------------- CDI: MIG, hooks, lifecycle

MIG_A = "MIG-11111111-2222-3333-4444-555555555555"
MIG_B = "MIG-66666666-7777-8888-9999-000000000000"
MIG_FACTS = GpuHostFacts(
    driver="550.54.15",
    gpus=(GpuFact(0, B.uuid, B.name, 0, B.memory, True, B.pci, mig_devices=(
        MigFact(MIG_A, 0, gi=1, ci=0, profile="3g.71gb", gi_minor=12, ci_minor=13),
        MigFact(MIG_B, 0, gi=2, ci=0, profile="3g.71gb", gi_minor=21, ci_minor=22))),
          GpuFact(1, A.uuid, A.name, 1, A.memory, False, A.pci)),
    majors={"nvidia-frontend": 195, "nvidia-uvm": 511, "nvidia-caps": 237},
    libraries=FACTS.libraries, source="nvml")


def test_cdi_one_device_per_mig_instance_with_its_access_nodes_only():
    spec = cdi_spec({"mig-x": [MIG_A], "mig-y": [MIG_B], "whole": [A.uuid]}, MIG_FACTS)
    assert check_cdi(spec) == []
    names = [d["name"] for d in spec["devices"]]
    assert names == ["mig-x", "mig-y", "whole", MIG_A, MIG_B]  # MIG_B only: held by mig-y
    by = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    paths = {n: [(x["path"], x["major"], x["minor"]) for x in e["deviceNodes"]]
             for n, e in by.items()}
    assert paths[MIG_A] == paths["mig-x"] == [
        ("/dev/nvidia0", 195, 0), ("/dev/nvidia-caps/nvidia-cap12", 237, 12),
        ("/dev/nvidia-caps/nvidia-cap13", 237, 13)]
    assert paths[MIG_B] == [("/dev/nvidia0", 195, 0), ("/dev/nvidia-caps/nvidia-cap21", 237, 21),
                            ("/dev/nvidia-caps/nvidia-cap22", 237, 22)]
    everything = [p for ps in paths.values() for p, _, _ in ps]
    assert not any(p.endswith(("nvidia-cap1", "nvidia-cap2")) for p in everything)
    assert by["mig-x"]["env"] == [f"CUDA_VISIBLE_DEVICES={MIG_A}"]
    # An unheld instance gets no device: nothing is handed out that nobody holds.
    assert [d["name"] for d in cdi_spec({"mig-x": [MIG_A]}, MIG_FACTS)["devices"]] == [
        "mig-x", MIG_A]


def test_cdi_mig_instance_device_has_its_holders_mode_and_group():
    """podman showed it: a container given only the instance's device got its nodes and the
    shared ones (common edits) as root's group, where the holder's /dev gives the spec's group.
    The instance's device lists them as the holder's device does."""
    own = [("nvidia0", 195, 0, 0o660, 44), ("nvidiactl", 195, 255, 0o660, 44),
           ("nvidia-uvm", "nvidia-uvm", 0, 0o660, 44),
           ("nvidia-uvm-tools", "nvidia-uvm", 1, 0o660, 44),
           ("nvidia-caps/nvidia-cap12", "nvidia-caps", 12, 0o660, 44),
           ("nvidia-caps/nvidia-cap13", "nvidia-caps", 13, 0o660, 44)]
    spec = cdi_spec({"mig-x": [MIG_A]}, MIG_FACTS, nodes={"mig-x": own})
    assert check_cdi(spec) == []
    by = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    key = {n["path"]: (n["major"], n["minor"], n["fileMode"], n.get("gid")) for n in by["mig-x"]}
    assert {n["path"]: (n["major"], n["minor"], n["fileMode"], n.get("gid"))
            for n in by[MIG_A]} == key == {
        "/dev/nvidia0": (195, 0, 0o660, 44), "/dev/nvidiactl": (195, 255, 0o660, 44),
        "/dev/nvidia-uvm": (511, 0, 0o660, 44), "/dev/nvidia-uvm-tools": (511, 1, 0o660, 44),
        "/dev/nvidia-caps/nvidia-cap12": (237, 12, 0o660, 44),
        "/dev/nvidia-caps/nvidia-cap13": (237, 13, 0o660, 44)}
    # Its own nodes first (parent, then GI and CI access), as without the holder's list.
    assert [n["path"] for n in by[MIG_A]][:3] == [
        "/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13"]


def test_cdi_hooks_as_nvidia_ctk_when_the_host_has_its_hook():
    spec = cdi_spec({"g": [A.uuid]}, FACTS, hook="/usr/bin/nvidia-cdi-hook")
    assert check_cdi(spec) == []
    common = spec["containerEdits"]
    lib = "/usr/lib/x86_64-linux-gnu"
    assert common["hooks"] == [
        {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
         "args": ["nvidia-cdi-hook", "create-symlinks",
                  "--link", f"libcuda.so.1::{lib}/libcuda.so",
                  "--link", f"libcuda.so.550.54.15::{lib}/libcuda.so.1"]},
        {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
         "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", lib]}]
    # Only the file is mounted; the hook makes the links.
    assert [m["containerPath"] for m in common["mounts"]] == [f"{lib}/libcuda.so.550.54.15"]


def test_sync_cdi_follows_the_journals_and_removes_the_file_when_none_is_held(
        host_with_gpus, tmp_path):
    host, root = host_with_gpus
    target = tmp_path / "cdi" / "envctl.yaml"
    assert sync_cdi(host, root, target).action == "absent"
    assert not target.parent.exists()  # a host nobody holds a GPU of: nothing made
    _journal(host.state_dir, "gpu-a", {"gpus": {"uuids": [A.uuid]}})
    assert sync_cdi(host, root, target).action == "written"
    first = target.read_bytes()
    assert sync_cdi(host, root, target).action == "kept"
    _journal(host.state_dir, "gpu-b", {"gpus": {"uuids": [B.uuid]}})
    done = sync_cdi(host, root, target)
    assert (done.action, done.devices) == ("written", ["gpu-a", "gpu-b"])
    # Leaving (a `down` about to begin): gone from the file before its first step.
    assert sync_cdi(host, root, target, leaving=["gpu-b"]).devices == ["gpu-a"]
    assert target.read_bytes() == first
    j = Journal.open(host.state_dir, "gpu-a")  # a `down` that began (and was killed)
    j.set_meta({**j.meta, "down": True})
    j.save()
    assert sync_cdi(host, root, target, leaving=["gpu-b"]).action == "removed"
    assert not target.exists()
    assert sorted(p.name for p in target.parent.iterdir()) == []


def test_sync_cdi_never_rewrites_a_file_envctl_did_not_write(host_with_gpus, tmp_path):
    host, root = host_with_gpus
    target = tmp_path / "cdi" / "envctl.yaml"
    target.parent.mkdir()
    target.write_text("cdiVersion: 0.5.0\nkind: example.com/x\ndevices: []\n")
    assert sync_cdi(host, root, target).action == "foreign"  # none held: left, no error
    _journal(host.state_dir, "gpu-a", {"gpus": {"uuids": [A.uuid]}})
    with pytest.raises(ForeignObject, match="not written by envctl"):
        sync_cdi(host, root, target)
    assert target.read_text().startswith("cdiVersion: 0.5.0\nkind: example.com/x")
    target.unlink()
    assert sync_cdi(host, root, target).action == "written"
    target.write_text(target.read_text() + "# changed by hand\n")  # changed since: not ours
    with pytest.raises(ForeignObject):
        sync_cdi(host, root, target)
    target.unlink()
    target.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ForeignObject, match="symlink"):
        sync_cdi(host, root, target)
    assert not (tmp_path / "elsewhere").exists()


def _table_report() -> dict:
    return {"driver": "550.54.15", "source": "nvml", "problems": [], "warnings": ["w [x]"],
            "gpus": [{"index": 0, "uuid": "GPU-a", "name": "NVIDIA [red]H200", "memory": 1 << 30,
                      "mig": True, "mig_pending": False, "pci": "0000:18:00.0", "env": None,
                      "health": None,
                      "instances": [{"uuid": "MIG-b", "profile": "1g.18gb", "gi": 7, "ci": 0,
                                     "placement": {"start": 0, "size": 1}, "memory": 1 << 30,
                                     "env": "h[0]"}]}]}


def test_gpus_table_is_plain_text_off_a_terminal(monkeypatch, capsys):
    from envctl.cli import _render_gpus

    monkeypatch.delenv("FORCE_COLOR", raising=False)
    _render_gpus(_table_report())
    lines = capsys.readouterr().out.splitlines()
    # Values print as they are: no markup is read in a GPU's name or an environment's.
    assert lines[0] == "driver 550.54.15  (GPUs from nvml)"
    assert lines[2].split() == ["0", "GPU-a", "NVIDIA", "[red]H200", "1G", "on",
                                "0000:18:00.0", "-"]
    assert lines[3] == "       MIG mode off after the next GPU reset"
    assert lines[4].split()[-1] == "h[0]"
    assert lines[5] == "  ! w [x]" and "\x1b" not in "".join(lines)


def test_gpus_table_colours_as_rich_would(monkeypatch, capsys):
    from envctl.cli import _render_gpus

    report = _table_report()
    monkeypatch.setenv("FORCE_COLOR", "1")
    _render_gpus(report)
    out = capsys.readouterr().out
    assert "\x1b[2m(GPUs from nvml)\x1b[0m" in out
    assert "\x1b[33mMIG mode off after the next GPU reset\x1b[0m" in out
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("FORCE_COLOR")
    _render_gpus(report)
    assert "\x1b" not in capsys.readouterr().out
