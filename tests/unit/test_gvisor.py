"""`runtime.isolation: gvisor` without root: the spec field, the plan checks against the
host's runsc (platform offered, runsc missing, GPUs without --nvproxy), the isolation level
recorded with the claims and read back by EnvContext, the OCI config builder (checked against
the runtime-spec's required fields and types), the mounts it binds again, the platform parser
of `runsc flags`, and the sweep of dead launches' bundles."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from envctl.errors import SpecError
from envctl.facts import HostFacts, RunscFacts
from envctl.host.runsc import parse_platforms
from envctl.plan.builder import PlanError
from envctl.plan.claims import spec_claims
from envctl.plan.planner import plan_env
from envctl.runtime import gvisor
from envctl.runtime.context import EnvContext
from envctl.runtime.launch import DEFAULT_CAPS, User
from envctl.spec.loader import parse_spec

RUNSC_2022 = RunscFacts(path="/usr/bin/runsc", version="runsc version 0.0~20221219.0",
                        platforms=("ptrace", "kvm"))
HOST = HostFacts(cpus=(0, 1), runsc=RUNSC_2022)

SPEC = """
name: box
kind: {kind}
rootfs: {{binaries: [sh]}}
{extra}
runtime:
  isolation: gvisor
  gvisor: {{platform: {platform}}}
"""


def spec(platform: str = "ptrace", kind: str = "cpu", extra: str = ""):
    return parse_spec(SPEC.format(platform=platform, kind=kind, extra=extra), "box.yaml").spec


def issues(spec_, facts: HostFacts) -> list[str]:
    with pytest.raises(PlanError) as exc:
        plan_env(spec_, facts)
    return [f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in exc.value.issues]


# ---------------------------------------------------------------- spec and plan


def test_isolation_defaults_to_native_and_a_gvisor_section_needs_it():
    plain = parse_spec("name: box\nkind: cpu\n", "box.yaml").spec
    assert plain.runtime.isolation == "native"
    assert "isolation" not in spec_claims(plain, None)
    with pytest.raises(SpecError, match="runtime.gvisor is set but runtime.isolation is"):
        parse_spec("name: box\nkind: cpu\nruntime: {gvisor: {platform: kvm}}\n", "box.yaml")
    with pytest.raises(SpecError, match="ptrace"):
        parse_spec("name: box\nkind: cpu\nruntime: {isolation: gvisor, gvisor: "
                   "{platform: hyperv}}\n", "box.yaml")
    with pytest.raises(SpecError, match="native"):
        parse_spec("name: box\nkind: cpu\nruntime: {isolation: kata}\n", "box.yaml")


def test_the_level_goes_from_spec_to_claims_to_the_launch_context(tmp_path):
    s = spec("ptrace")
    plan = plan_env(s, HOST)
    assert plan.resolved["isolation"] == "gvisor (ptrace)"
    claims = spec_claims(s, HOST)
    assert claims["isolation"] == {"level": "gvisor", "platform": "ptrace"}
    # The journal's claims hand it back as EnvContext.load reads them (the integration tests
    # show a launch then runs under gVisor: its kernel is gVisor's).
    import json

    from envctl.runtime.context import read_journal

    (tmp_path / "journal").mkdir()
    (tmp_path / "journal" / "box.json").write_text(json.dumps(
        {"version": 1, "log": 0, "entries": [], "meta": {"claims": claims}}))
    _, read = read_journal(tmp_path, "box", "")
    assert read["isolation"] == claims["isolation"]


def test_a_platform_the_hosts_runsc_lacks_is_a_plan_error():
    (msg,) = issues(spec("systrap"), HOST)
    assert msg.startswith("runtime.gvisor.platform: platform 'systrap' is not offered by this "
                          "host's runsc (runsc version 0.0~20221219.0), which offers ptrace, "
                          "kvm")
    plan_env(spec("kvm"), HOST)  # offered (whether /dev/kvm works is the launch's to say)


def test_the_kvm_platform_may_open_dev_kvm_and_ptrace_may_not():
    """runsc runs in the launch's cgroup: its Sentry opens /dev/kvm through the environment's
    device rules, which allow it for the kvm platform only."""
    def device_rules(platform: str) -> list[str]:
        plan = plan_env(spec(platform), HOST)
        found = [r for res in plan.resources for r in getattr(res, "rules", ()) or ()]
        assert found, [res.describe() for res in plan.resources]
        return found

    assert "c 10:232 rw" in device_rules("kvm")
    assert "c 10:232 rw" not in device_rules("ptrace")


def test_runsc_missing_names_the_package():
    (msg,) = issues(spec(), HostFacts(runsc=RunscFacts()))
    assert "not installed" in msg and "'runsc'" in msg and msg.startswith("runtime.isolation")


def test_a_gpu_environment_under_gvisor_without_nvproxy_is_a_plan_error():
    found = issues(spec(kind="gpu", extra="gpus: {count: 1}"), HOST)
    assert any("--nvproxy" in m and m.startswith("runtime.isolation") for m in found), found


def test_gvisor_needs_a_rootfs():
    s = parse_spec("name: box\nkind: cpu\nruntime: {isolation: gvisor}\n", "box.yaml").spec
    (msg,) = issues(s, HOST)
    assert "root filesystem" in msg


def test_platforms_are_read_from_runsc_flags_help():
    old = ('  -platform string\n    \tspecifies which platform to use: ptrace (default), kvm. '
           '(default "ptrace")\n  -platform_device_path string\n')
    new = ('  -platform string\n    \tspecifies which platform to use: systrap (default), '
           'ptrace, kvm. (default "systrap")\n')
    assert parse_platforms(old) == ("ptrace", "kvm")
    assert parse_platforms(new) == ("systrap", "ptrace", "kvm")
    assert parse_platforms("  -network value\n") == ()


# ---------------------------------------------------------------- the OCI bundle

CTX = EnvContext(env="box", root=Path("/var/lib/envctl/rootfs/box"),
                 mntns=Path("/run/envctl/mnt.d/box"), netns=Path("/run/netns/box"),
                 hostname="box", isolation="gvisor", platform="ptrace")


def test_oci_config_has_the_runtime_specs_required_fields_and_types():
    mounts = [gvisor.SubMount("/var/lib/envctl/rootfs/box/tmp", "/tmp", False),
              gvisor.SubMount("/var/lib/envctl/rootfs/box/job", "/job", True)]
    cfg = gvisor.oci_config(CTX, argv=["/job/run", "a b"], environ={"PATH": "/bin", "X": "1"},
                            user=User(1000, 1000, (44, 1000)), cwd="/work",
                            caps=DEFAULT_CAPS, mounts=mounts)
    # runtime-spec config.md: ociVersion (SemVer), root.path, process.cwd (absolute),
    # process.args (non-empty), process.user.uid/gid, mounts[].destination (absolute).
    assert cfg["ociVersion"].count(".") == 2
    assert cfg["root"] == {"path": "/var/lib/envctl/rootfs/box", "readonly": True}
    proc = cfg["process"]
    assert proc["args"] == ["/job/run", "a b"] and proc["cwd"] == "/work"
    assert proc["env"] == ["PATH=/bin", "X=1"]
    assert proc["user"] == {"uid": 1000, "gid": 1000, "additionalGids": [44]}
    assert proc["noNewPrivileges"] is True and proc["terminal"] is False
    caps = proc["capabilities"]
    assert caps["bounding"] == caps["effective"] == caps["permitted"]
    assert "CAP_CHOWN" in caps["bounding"] and "CAP_SYS_ADMIN" not in caps["bounding"]
    assert caps["inheritable"] == caps["ambient"] == []
    assert cfg["hostname"] == "box"
    dests = [m["destination"] for m in cfg["mounts"]]
    assert all(d.startswith("/") for d in dests)
    assert dests[:5] == ["/proc", "/dev", "/dev/pts", "/dev/shm", "/sys"]
    by = {m["destination"]: m for m in cfg["mounts"]}
    assert "ro" in by["/sys"]["options"]
    assert by["/tmp"] == {"destination": "/tmp", "type": "bind",
                          "source": "/var/lib/envctl/rootfs/box/tmp",
                          "options": ["rbind", "rw", "nosuid", "nodev"]}
    assert "ro" in by["/job"]["options"]
    # No network namespace (runsc --network host, in the environment's), no cgroupsPath.
    kinds = [n["type"] for n in cfg["linux"]["namespaces"]]
    assert "network" not in kinds and "pid" in kinds and "cgroupsPath" not in cfg["linux"]


def test_runsc_flags_keep_cgroups_and_network_as_the_launcher_set_them():
    argv = gvisor.runsc_argv("/usr/bin/runsc", Path("/run/envctl/box/gvisor/x"), "ptrace",
                             network=True)
    assert argv[:5] == ["/usr/bin/runsc", "--root", "/run/envctl/box/gvisor/x/state", "--log",
                        "/run/envctl/box/gvisor/x/runsc.log"]
    assert "--ignore-cgroups" in argv
    assert argv[-4:] == ["--platform", "ptrace", "--network", "host"]
    assert gvisor.runsc_argv("runsc", Path("/x"), "", network=False)[-3:] == [
        "ptrace", "--network", "none"]


def test_kept_caps_maps_bits_back_to_names():
    from envctl.caps import NUMBERS

    bits = (1 << NUMBERS["CHOWN"]) | (1 << NUMBERS["KILL"])
    assert gvisor.kept_caps(bits) == ("CHOWN", "KILL")
    assert gvisor.kept_caps(0) == ()


def test_sub_mounts_are_those_below_the_rootfs_but_gvisors_own():
    root = "/var/lib/envctl/rootfs/box"
    info = "\n".join([
        f"100 1 254:0 {root} {root} ro,nosuid,nodev - ext4 /dev/vda rw",
        f"101 100 0:50 / {root}/dev rw,nosuid - tmpfs tmpfs rw",
        f"102 101 0:51 / {root}/dev/pts rw - devpts devpts rw",
        f"103 100 0:52 / {root}/tmp rw,nosuid,nodev - tmpfs tmpfs rw",
        f"104 100 0:53 / {root}/sys ro - sysfs sysfs ro",
        f"105 100 254:0 /srv/data {root}/data\\040set rw,nosuid - ext4 /dev/vda rw",
        f"106 100 254:0 /usr/lib/python3.11 {root}/usr/lib/python3.11 ro - ext4 /dev/vda rw",
        "107 1 0:54 / /var/lib/envctl/rootfs/boxer rw - tmpfs tmpfs rw",  # another env
        f"108 100 0:55 / {root}/tmp rw,nosuid,nodev - tmpfs tmpfs rw",  # over the first
    ])
    got = gvisor.sub_mounts(root, info)
    assert got == [
        gvisor.SubMount(f"{root}/data set", "/data set", False),
        gvisor.SubMount(f"{root}/usr/lib/python3.11", "/usr/lib/python3.11", True),
        gvisor.SubMount(f"{root}/tmp", "/tmp", False),
    ]


def test_sweep_removes_only_bundles_whose_launch_is_gone(tmp_path):
    live, dead = "box-live", "box-dead"
    for ident in (live, dead):
        (tmp_path / ident / "state").mkdir(parents=True)
        (tmp_path / f"{ident}.lock").touch()
    (tmp_path / "box-orphan").mkdir()  # its lock already gone
    fd = os.open(tmp_path / f"{live}.lock", os.O_RDWR)
    try:
        # Held by another open file description, as the live launch holds it.
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert sorted(gvisor.sweep(tmp_path)) == ["box-dead", "box-orphan"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [live, f"{live}.lock"]
    finally:
        os.close(fd)
    assert gvisor.sweep(tmp_path) == [live]
    assert list(tmp_path.iterdir()) == []


def test_box_dir_is_in_the_environments_run_directory():
    assert gvisor.box_dir(CTX) == Path("/run/envctl/box/gvisor")
