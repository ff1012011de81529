"""Planning rootfs, mounts and GPUs (pure): GPU assignment, nodes and allow-list rules, /etc
files, mount order, and the plan errors a host without what the spec needs gets."""

from __future__ import annotations

import dataclasses

import pytest

from envctl.errors import HostError, SpecError
from envctl.facts import GpuFact, GpuHostFacts, HostFacts, MigFact, PlacedFile, RootfsFacts
from envctl.host.devices import resolve_rules
from envctl.plan.builder import PlanError
from envctl.plan.gpus import ENV_KEY, NODES_KEY, assign_gpus
from envctl.plan.limits import GPU_DEVICES_KEY
from envctl.plan.planner import plan_env
from envctl.spec.loader import parse_spec

GPUS = GpuHostFacts(driver="550.54.15", gpus=tuple(
    GpuFact(i, f"GPU-{i}", minor=i) for i in range(4)), majors={"nvidia-uvm": 509})
TREE = RootfsFacts(files=(PlacedFile("/usr/bin/bash", "/usr/bin/bash"),),
                   links=(("bin", "usr/bin"),))


def spec(name: str, body: str = ""):
    return parse_spec(f"name: {name}\nkind: gpu\n{body}", f"{name}.yaml").spec


def facts(**kw) -> HostFacts:
    base = dict(cpus=(0, 1, 2, 3), gpu=GPUS, groups={"video": 44},
                rootfs={n: TREE for n in ("a", "b", "c", "d")}, state_dir="/s")
    base.update(kw)
    return HostFacts(**base)


def test_counts_resolve_in_name_order_after_explicit_claims_and_keep_what_they_hold():
    a, b, c = spec("a", "gpus: 2"), spec("b", "gpus: [1]"), spec("c", "gpus: 1")
    got, why = assign_gpus([c, b, a], facts())
    assert why == {}
    assert got == {"b": ("GPU-1",), "a": ("GPU-0", "GPU-2"), "c": ("GPU-3",)}
    # `c` is up holding GPU 0: it keeps it, and `a` takes the lowest free ones instead.
    got, _ = assign_gpus([a, b, c], facts(gpu_held={"GPU-0": "c"}))
    assert got == {"b": ("GPU-1",), "a": ("GPU-2", "GPU-3"), "c": ("GPU-0",)}
    # The same input gives the same answer every time.
    assert all(assign_gpus([a, b, c], facts())[0] == assign_gpus([c, a, b], facts())[0]
               for _ in range(3))


def test_a_held_or_missing_gpu_is_refused_with_why():
    got, why = assign_gpus([spec("a", "gpus: [1]")], facts(gpu_held={"GPU-1": "other"}))
    assert got == {} and why == {"a": "GPU 1 (GPU-1) is held by environment 'other'"}
    _, why = assign_gpus([spec("a", "gpus: 5")], facts(gpu_held={"GPU-0": "x"}))
    assert why["a"] == ("wants 5 GPUs and 3 of this host's 4 are free (the others are held or "
                        "claimed by x)")
    _, why = assign_gpus([spec("a", "gpus: [7]")], facts())
    assert why["a"] == "no GPU with index 7 here"


def test_specs_read_together_never_share_a_gpu_however_they_name_it():
    """Counts beyond the GPUs there are, and an index and a UUID naming one GPU: the spec
    left without is a plan error, never planned alone onto a GPU another spec got."""
    import dataclasses

    two = dataclasses.replace(GPUS, gpus=GPUS.gpus[:2])
    specs = [spec("a", "gpus: 1"), spec("b", "gpus: 1"), spec("c", "gpus: 1")]
    got, why = assign_gpus(specs, facts(gpu=two))
    assert got == {"a": ("GPU-0",), "b": ("GPU-1",)} and "0 of this host's 2" in why["c"]
    joint = facts(gpu=two, gpu_assigned=got, gpu_refused=why)
    with pytest.raises(PlanError, match="wants 1 GPU and 0 of this host's 2 are free"):
        plan_env(specs[2], joint)
    specs = [spec("a", "gpus: [0]"), spec("b", "gpus: {uuids: [GPU-0]}")]
    got, why = assign_gpus(specs, facts())
    assert got == {"a": ("GPU-0",)}
    assert why == {"b": "GPU 0 (GPU-0) is also claimed by environment 'a'"}
    with pytest.raises(PlanError, match="also claimed by environment 'a'"):
        plan_env(specs[1], facts(gpu_assigned=got, gpu_refused=why))


def test_gpu_nodes_rules_and_variables_come_from_one_list():
    plan = plan_env(spec("a", "gpus: {indices: [2], modeset: true}\nrootfs: {binaries: [bash]}"),
                    facts())
    assert plan.resolved[NODES_KEY] == (
        ("nvidia2", 195, 2, 0o660, 44), ("nvidiactl", 195, 255, 0o660, 44),
        ("nvidia-uvm", "nvidia-uvm", 0, 0o660, 44),
        ("nvidia-uvm-tools", "nvidia-uvm", 1, 0o660, 44),
        ("nvidia-modeset", 195, 254, 0o660, 44))
    assert plan.resolved[GPU_DEVICES_KEY] == (
        "c 195:2 rw", "c 195:255 rw", "c nvidia-uvm:0 rw", "c nvidia-uvm:1 rw", "c 195:254 rw")
    assert plan.resolved[ENV_KEY] == {"CUDA_VISIBLE_DEVICES": "GPU-2",
                                      "NVIDIA_VISIBLE_DEVICES": "GPU-2"}
    devices = next(r for r in plan.resources if r.kind == "cgroup-devices")
    assert set(plan.resolved[GPU_DEVICES_KEY]) <= set(devices.rules)
    dev = next(r for r in plan.resources if r.kind == "env-dev")
    assert dev.nodes == plan.resolved[NODES_KEY]
    tree = next(r for r in plan.resources if r.kind == "rootfs")
    environment = dict((p, text) for p, text, _ in tree.generated)["/etc/environment"]
    assert "CUDA_VISIBLE_DEVICES=GPU-2\n" in environment


def test_a_host_without_gpus_or_the_group_is_a_plan_error_saying_what_was_found():
    with pytest.raises(PlanError, match="wants 2 GPUs, but this host has no NVIDIA driver "
                                        "loaded .* and no GPUs"):
        plan_env(spec("a", "gpus: 2"), facts(gpu=GpuHostFacts()))
    with pytest.raises(PlanError, match="group 'render' does not exist"):
        plan_env(spec("a", "gpus: {count: 1, group: render}"), facts())
    # mig_caps (nvidia-cap1, MIG's config capability) is refused at parse time, at its line.
    with pytest.raises(SpecError, match=r"a.yaml:4:3: gpus.mig_caps: mig_caps is no longer "
                                        r"accepted: it granted nvidia-cap1"):
        spec("a", "gpus:\n  mig_caps: false")


MIGS = tuple(MigFact(f"MIG-{gi}", parent=1, gi=gi, ci=0, profile="1g.18gb", start=gi - 7,
                     size=1, gi_minor=3 + 135 + 9 * gi, ci_minor=3 + 135 + 9 * gi + 1)
             for gi in (7, 8))
MIG_GPUS = dataclasses.replace(GPUS, majors={"nvidia-uvm": 509, "nvidia-caps": 508}, gpus=(
    GPUS.gpus[0], dataclasses.replace(GPUS.gpus[1], mig=True, mig_devices=MIGS), *GPUS.gpus[2:]))


def test_a_mig_uuid_gets_its_parent_node_and_only_its_own_access_capabilities():
    plan = plan_env(spec("a", "gpus: [MIG-8]"), facts(gpu=MIG_GPUS))
    nodes = {(n[0], n[1], n[2]) for n in plan.resolved[NODES_KEY]}
    assert nodes == {("nvidia1", 195, 1), ("nvidiactl", 195, 255), ("nvidia-uvm", "nvidia-uvm", 0),
                     ("nvidia-uvm-tools", "nvidia-uvm", 1),
                     ("nvidia-caps/nvidia-cap210", "nvidia-caps", 210),
                     ("nvidia-caps/nvidia-cap211", "nvidia-caps", 211)}
    assert plan.resolved[ENV_KEY]["CUDA_VISIBLE_DEVICES"] == "MIG-8"
    assert not any(n[0] in ("nvidia-caps/nvidia-cap1", "nvidia-caps/nvidia-cap2")
                   for n in plan.resolved[NODES_KEY])


def test_a_whole_gpu_and_its_mig_devices_exclude_each_other():
    got, why = assign_gpus([spec("a", "gpus: [MIG-7]"), spec("b", "gpus: [MIG-8]")],
                           facts(gpu=MIG_GPUS))
    assert why == {} and got == {"a": ("MIG-7",), "b": ("MIG-8",)}
    _, why = assign_gpus([spec("a", "gpus: [1]")], facts(gpu=MIG_GPUS, gpu_held={"MIG-8": "b"}))
    assert "MIG 1g.18gb GI 8 CI 0 of GPU 1 (MIG-8) is held by environment 'b'" in why["a"]
    _, why = assign_gpus([spec("a", "gpus: [MIG-7]")], facts(gpu=MIG_GPUS,
                                                          gpu_held={"GPU-1": "b"}))
    assert "GPU 1 (GPU-1) is held by environment 'b'" in why["a"]
    # A count never takes a GPU one of whose MIG devices another environment holds.
    got, _ = assign_gpus([spec("a", "gpus: 2")], facts(gpu=MIG_GPUS, gpu_held={"MIG-7": "b"}))
    assert got == {"a": ("GPU-0", "GPU-2")}
    _, why = assign_gpus([spec("a", "gpus: [MIG-9]")], facts(gpu=MIG_GPUS))
    assert why["a"] == "no GPU MIG-9 here (`envctl gpus` lists the MIG devices)"


def test_a_spec_variable_naming_other_gpus_is_overridden_with_a_warning():
    plan = plan_env(spec("a", "gpus: 1\nrootfs: {env: {CUDA_VISIBLE_DEVICES: all}}"), facts())
    assert any("rootfs.env.CUDA_VISIBLE_DEVICES is 'all'" in w for w in plan.warnings)


def test_the_rootfs_plan_mounts_in_order_and_writes_etc():
    s = parse_spec("name: c\nkind: cpu\nnetwork: {bridge: br0, bridge_address: 10.9.0.1/24, "
                   "address: 10.9.0.2}\nrootfs: {binaries: [bash], env: {A: b}, "
                   "thread_env: [OMP_NUM_THREADS]}\nmounts:\n  - {source: logs, target: /var/log}"
                   "\n  - {source: /srv/in, target: /in, read_only: true}\n", "c.yaml").spec
    plan = plan_env(s, facts(resolv_conf="nameserver 10.0.0.2\n"))
    kinds = [(r.kind, getattr(r, "target", "")) for r in plan.resources
             if r.kind in ("rootfs", "mntns-dir", "mntns", "mount", "env-dev")]
    assert kinds == [("rootfs", ""), ("mntns-dir", ""), ("mntns", ""), ("mount", "/"),
                     ("env-dev", ""), ("mount", "/tmp"), ("mount", "/sys"),
                     ("mount", "/var/log"), ("mount", "/in")]
    mounts = {r.target: r for r in plan.resources if r.kind == "mount"}
    assert mounts["/"].options == ("ro", "nosuid", "nodev")
    assert mounts["/var/log"].source == "/s/data/c/logs"
    assert mounts["/var/log"].options == ("nosuid", "nodev")
    assert mounts["/in"].options == ("ro", "nosuid", "nodev")
    assert mounts["/sys"].netns == "c"
    dirs = [r.key for r in plan.resources if r.kind.endswith("dir")]
    # The host directory other specs may mount too is held through the ledger.
    assert "dir:state:data/c/logs" in dirs and "shared-dir:host:srv/in" in dirs
    tree = next(r for r in plan.resources if r.kind == "rootfs")
    assert tree.root == "/s/rootfs/c"
    etc = {p: text for p, text, _ in tree.generated}
    assert etc["/etc/environment"] == ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                                       "/sbin:/bin\nA=b\nOMP_NUM_THREADS=4\n")
    assert etc["/etc/hostname"] == "c\n"
    assert "10.9.0.2\tc\n" in etc["/etc/hosts"]
    assert etc["/etc/resolv.conf"] == "nameserver 10.0.0.2\n"
    assert dict(tree.dirs) == {"/in": 0o755, "/var/log": 0o755}


@pytest.mark.parametrize("body, match", [
    ("rootfs: {binaries: [bash]}\nmounts: [{source: x, target: /proc/x}]", "managed by envctl"),
    ("rootfs: {binaries: [bash]}\nmounts: [{source: x, target: /tmp/scratch}]",
     "managed by envctl"),
    ("rootfs: {files: [{path: /tmp/x, content: a}]}", "mounted over"),
])
def test_targets_envctl_mounts_over_are_plan_errors(body, match):
    with pytest.raises(PlanError, match=match):
        plan_env(parse_spec(f"name: c\nkind: cpu\n{body}\n", "c.yaml").spec, facts())


def test_what_the_host_lacks_is_a_plan_error_and_loopback_dns_a_warning():
    missing = RootfsFacts(missing=(("binary nvidia-smi", "not found in /usr/bin, /bin"),))
    with pytest.raises(PlanError, match="binary nvidia-smi: not found"):
        plan_env(spec("a", "rootfs: {binaries: [nvidia-smi]}"), facts(rootfs={"a": missing}))
    placed_in_tmp = RootfsFacts(files=(PlacedFile("/tmp/x/prog", "/tmp/x/prog"),))
    with pytest.raises(PlanError, match="/tmp/x/prog would be placed under /tmp"):
        plan_env(spec("a", "rootfs: {binaries: [/tmp/x/prog]}"), facts(rootfs={"a": placed_in_tmp}))
    s = parse_spec("name: c\nkind: cpu\nnetwork: {bridge: br0, bridge_address: 10.9.0.1/24, "
                   "address: 10.9.0.2}\nrootfs: {binaries: [bash]}\n", "c.yaml").spec
    plan = plan_env(s, facts(resolv_conf="nameserver 127.0.0.53\n"))
    assert any("only loopback nameservers" in w for w in plan.warnings)


def test_named_majors_are_read_from_proc_devices(tmp_path):
    (tmp_path / "devices").write_text("Character devices:\n195 nvidia-frontend\n509 nvidia-uvm\n"
                                      "\nBlock devices:\n510 nvidia-uvm\n")
    rules = ("c 1:3 rwm", "c nvidia-uvm:1 rw", "c 136:* rwm")
    assert resolve_rules(rules, tmp_path) == ("c 1:3 rwm", "c 509:1 rw", "c 136:* rwm")
    with pytest.raises(HostError, match="'nvidia-caps' is not in .*: its driver is not loaded"):
        resolve_rules(("c nvidia-caps:1 rw",), tmp_path)


def test_what_the_host_lacks_is_reported_at_the_entry_that_asks_for_it():
    missing = RootfsFacts(missing=(
        ("binary nvidia-smi", "not found in /usr/bin, /bin"),
        ("library libcuda.so*", "no library in ld.so.cache matches"),
        ("python", "no python3 in /usr/bin"),
        ("library libfoo.so.1 (needed by /usr/bin/sh)", "not found"),
    ))
    with pytest.raises(PlanError) as exc:
        plan_env(spec("a", "rootfs: {binaries: [sh, nvidia-smi], libraries: [libcuda.so*], "
                           "python: true}"), facts(rootfs={"a": missing}))
    assert [loc for loc, _ in exc.value.issues] == [
        ("rootfs", "binaries", 1), ("rootfs", "libraries", 0), ("rootfs", "python"),
        ("rootfs",)]
