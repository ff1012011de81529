"""Mount namespaces without root: mountinfo parsing, the holder's states, the fields a mount or
/dev refuses before touching anything, and the /dev nodes kept equal to the cgroup allow-list."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from envctl.errors import HostError
from envctl.host import mounts as m
from envctl.host.context import Host
from envctl.host.safepath import Escape
from envctl.plan.limits import DEFAULT_DEVICES
from envctl.resources.base import Resource, Status
from envctl.resources.mounts import (
    SAFE_NODES,
    EnvDev,
    Mount,
    MountNamespace,
    MountNamespaceDir,
    dev_cgroup_rules,
    namespaces,
)

MOUNTINFO = (
    "22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw\n"
    "63 43 254:0 /srv/my\\040data /mnt/with\\040space\\134x ro,nosuid,nodev,relatime "
    "master:7 - ext4 /dev/vda rw,discard\n"
    "86 63 0:4 mnt:[4026532178] /run/envctl/mnt/alpha rw - nsfs nsfs rw\n"
    "90 88 0:41 / /r/dev/shm rw,nosuid,nodev shared:3 master:2 - tmpfs shm rw,mode=1777\n"
    "91 88 0:42 / /r/x rw unbindable - tmpfs t rw\n"
    "garbage line\n"
)


def test_mountinfo_is_parsed_with_escapes_and_propagation():
    rows = m.parse_mountinfo(MOUNTINFO)
    assert [r.mount_id for r in rows] == [22, 63, 86, 90, 91]  # the garbage line is skipped
    proc, data, holder, shm, unb = rows
    assert (proc.parent_id, proc.dev, proc.root, proc.mount_point) == (1, "0:21", "/", "/proc")
    assert proc.flags == {"nosuid", "nodev", "noexec"} and proc.propagation == "shared"
    assert data.root == "/srv/my data" and data.mount_point == "/mnt/with space\\x"
    assert data.flags == {"ro", "nosuid", "nodev"} and data.propagation == "slave"
    assert (data.fstype, data.source, data.super_options) == ("ext4", "/dev/vda",
                                                              ("rw", "discard"))
    assert holder.fstype == "nsfs" and holder.propagation == "private" and holder.flags == set()
    assert shm.propagation == "shared,slave" and shm.optional == ("shared:3", "master:2")
    assert unb.propagation == "unbindable"


def test_the_dev_nodes_match_the_cgroup_allow_list():
    """What every /dev holds (its nodes and its devpts instance) is exactly what the cgroup
    allow-list lets every environment open: neither can change without the other."""
    assert sorted(dev_cgroup_rules()) == sorted(DEFAULT_DEVICES)
    assert len(set(dev_cgroup_rules())) == len(dev_cgroup_rules())
    gpu = (("nvidia0", 195, 0, 0o660, 44),)
    assert dev_cgroup_rules(SAFE_NODES + gpu)[-3:] == ("c 195:0 rwm", "c 5:2 rwm",
                                                       "c 136:* rwm")


@pytest.fixture
def host(tmp_path):
    return Host(state_dir=tmp_path / "state", run_dir=tmp_path / "run")


def test_the_holder_states_and_who_owns_what(host, tmp_path):
    ns = namespaces(host)
    res = MountNamespace("alpha")
    assert ns.path("alpha") == tmp_path / "run" / "mnt.d" / "alpha"
    assert ns.state("alpha") == m.ABSENT and res.check(host).status is Status.ABSENT
    ns.dir.mkdir(parents=True)
    holder = ns.path("alpha")
    holder.touch()  # what a crash between making the mount point and the bind leaves
    memo = res.snapshot(host)
    assert memo == {"found": "file", "path": str(holder)} and res.refuses(memo) == ""
    assert res.check(host).describe() == f"{holder} holds no namespace"
    holder.write_text("someone's notes")
    memo = res.snapshot(host)
    assert memo["found"] == "other"
    assert res.refuses(memo) == f"{holder} exists and is not a mount namespace envctl made"
    assert res.check(host).status is Status.WRONG_KIND
    holder.unlink()
    holder.symlink_to("/proc/self/ns/mnt")  # a symlink to a namespace is not a holder
    assert ns.state("alpha") == m.OTHER
    held = {"found": "held", "path": str(holder)}
    assert res.refuses(held).startswith(f"a mount namespace is already held at {holder} ")


def test_without_a_namespace_checks_say_absent_and_removals_succeed(host):
    root = "/nonexistent/rootfs"
    for res in (Mount("alpha", root, "/tmp", "tmpfs", "tmpfs"), EnvDev("alpha", root)):
        check = res.check(host)
        assert (check.status, check.detail) == (Status.ABSENT, "no mount namespace")
        res.remove(host, {})
    MountNamespace("alpha").remove(host, {})
    assert not host.run_dir.exists()


@pytest.mark.parametrize(("fields", "why"), [
    ({"fstype": "proc"}, "type 'proc' is not one of bind, tmpfs, sysfs"),
    ({"target": "data"}, "the target must be an absolute path without '.' or '..'"),
    ({"target": "/data/../etc"}, "the target must be an absolute path without '.' or '..'"),
    ({"target": "/data/./x"}, "the target must be an absolute path without '.' or '..'"),
    ({"target": "/", "fstype": "tmpfs"}, "target / is only the rootfs's own bind"),
    ({"target": "/", "source": "/srv"}, "target / is only the rootfs's own bind"),
    ({"options": ("ro", "sync")}, "options sync: allowed are ro, nosuid, nodev, noexec"),
    ({"file": True, "fstype": "tmpfs"}, "only a bind mount can be a file mount"),
    ({"root": "rootfs"}, "the root 'rootfs' must be an absolute path"),
])
def test_fields_the_planner_never_makes_are_refused_before_anything(host, tmp_path, fields, why):
    base = {"env": "alpha", "root": str(tmp_path / "rootfs"), "target": "/data",
            "source": "/srv", "fstype": "bind"}
    res = Mount(**{**base, **fields})
    with pytest.raises(HostError) as exc:
        res.apply(host, {})
    assert str(exc.value).startswith(f"mount {res.target} in 'alpha': {why}")
    with pytest.raises(HostError):
        res.check(host)
    assert sorted(os.listdir(tmp_path)) == []  # not even the run directory


@pytest.mark.parametrize("name", ["", "a/b", "..", "pts", "shm", "ptmx", "fd"])
def test_device_names_that_would_leave_dev_or_clash_are_refused(host, tmp_path, name):
    res = EnvDev("alpha", str(tmp_path / "rootfs"), ((name, 195, 0, 0o660, 44),))
    with pytest.raises(HostError, match=f"device node name {name!r} is not allowed"):
        res.apply(host, {})
    assert not host.run_dir.exists()


def test_resources_survive_the_journal():
    gpu = (("nvidia0", 195, 0, 0o660, 44), ("nvidiactl", 195, 255, 0o660, 44))
    for res in (MountNamespaceDir(), MountNamespace("alpha"),
                Mount("alpha", "/r", "/lib/x.so", "/usr/lib/x.so", "bind",
                      ("ro", "nosuid", "nodev"), file=True),
                Mount("alpha", "/r", "/sys", "sysfs", "sysfs", ("ro",), netns="/run/netns/a"),
                EnvDev("alpha", "/r", gpu, shm_size="1g")):
        assert Resource.from_dict(json.loads(json.dumps(res.to_dict()))) == res
    assert Mount("alpha", "/r", "/", "/r", "bind", ("ro", "nosuid", "nodev")).key == "mount:alpha:/"
    assert EnvDev("alpha", "/r", gpu).describe() == "/dev of alpha (tmpfs, 2 more node(s))"


def test_failures_read_as_an_operator_reads_them():
    assert "leaves the root filesystem" in m.why(Escape(errno.EXDEV, "x", "x"))
    assert "does not exist in the root filesystem" in m.why(FileNotFoundError(errno.ENOENT, "x"))
    assert m.why(NotADirectoryError(errno.ENOTDIR, "x")) == "the mount point is not a directory"
    assert m.why(m.Moved(errno.EXDEV, "mount point changed while mounting (now /a, expected "
                         "/b); unmounted again")).startswith("mount point changed")
    assert m.why(OSError(errno.EPERM, "x")) == os.strerror(errno.EPERM)


def test_the_directory_state_reads_this_thread_s_mount_table(tmp_path):
    ns = m.MountNamespaces(tmp_path / "mnt.d")
    assert ns.dir_state() == (False, False, "")
    (tmp_path / "mnt.d").mkdir()
    assert ns.dir_state() == (True, False, "")
    assert ns.held() == []
    assert MountNamespaceDir().check(Host(run_dir=tmp_path)).describe() == "not a mount point"
    assert MountNamespaceDir().snapshot(Host(run_dir=tmp_path)) == {
        "existed": True, "mounted": False, "propagation": ""}


def test_mount_points_resolve_beneath_the_root_without_root(tmp_path):
    """open_mountpoint needs no privilege: symlinks inside are followed, outside refused."""
    root = tmp_path / "rootfs"
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")
    (root / "out").symlink_to("/etc")
    (root / "usr" / "lib" / "x.so").touch()
    with m.open_mountpoint(str(root), "/lib") as mp:
        assert mp.path == str(root / "usr" / "lib")
    with m.open_mountpoint(str(root), "/lib/x.so", file=True) as mp:
        assert mp.path == str(root / "usr" / "lib" / "x.so")
    with pytest.raises(Escape):
        m.open_mountpoint(str(root), "/out")
    with pytest.raises(IsADirectoryError):
        m.open_mountpoint(str(root), "/lib", file=True)
    with pytest.raises(NotADirectoryError):
        m.open_mountpoint(str(root), "/lib/x.so")
    assert Path(root / "out").is_symlink()


def test_a_sysfs_enters_the_environment_s_network_namespace_by_name_or_path(tmp_path):
    host = Host(netns_dir=tmp_path / "netns")
    sysfs = Mount("alpha", "/r", "/sys", "sysfs", "sysfs", ("ro",), netns="alpha")
    assert sysfs._netns(host) == str(tmp_path / "netns" / "alpha")
    assert Mount("alpha", "/r", "/sys", "sysfs", "sysfs", netns="/x/y")._netns(host) == "/x/y"
    assert Mount("alpha", "/r", "/sys", "sysfs", "sysfs")._netns(host) == ""
    # Only a sysfs shows the mounting process's network namespace: nothing else enters one.
    assert Mount("alpha", "/r", "/tmp", "tmpfs", "tmpfs", netns="alpha")._netns(host) == ""


def test_making_the_values_loads_no_adapter():
    """The planner makes these resources: that must not load the adapter (nor ctypes)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from envctl.resources.mounts import EnvDev, Mount, MountNamespace, "
            "MountNamespaceDir\n"
            "[r.describe() for r in (Mount('a', '/r', '/', '/r'), EnvDev('a', '/r'), "
            "MountNamespace('a'), MountNamespaceDir())]\n"
            "print(sorted(m for m in sys.modules if m.startswith(('ctypes', 'envctl.host'))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert res.stdout.strip() == "[]"
