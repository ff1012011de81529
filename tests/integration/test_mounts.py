"""Mount namespaces on the real kernel: the holder, mounts made inside the environment's
namespace only, read-only binds, targets that lead out of the rootfs, a mount point swapped
while mounting, the environment's /dev, and propagation from a shared parent.

Each test drives the resources through a Host whose run and state directories are the
sandbox's, in a Python process inside the sandbox, and watches from other processes: `nsenter
--mount=HOLDER` for the environment's namespace, /proc/PID/mountinfo for the sandbox's. Every
test ends with the sandbox's whole mount table as it found it, and the sandbox's residue check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.sandbox import stderr_of

pytestmark = pytest.mark.root

PRELUDE = r'''
import json, os, subprocess, sys
from pathlib import Path
from envctl.errors import HostError
from envctl.host import mounts as m
from envctl.host.context import Host
from envctl.resources import mounts as r

P = json.loads(sys.argv[1])
root, base = P["root"], Path(P["base"])
host = Host(state_dir=Path(P["state"]), run_dir=Path(P["run"]))
ns = r.namespaces(host)
holder = str(ns.path("alpha"))
out = {}


def attempt(fn, *args, **kw):
    try:
        fn(*args, **kw)
        return "ok"
    except HostError as exc:
        return f"HostError: {exc}"


def table(path="/proc/thread-self/mountinfo"):
    return sorted(f"{x.mount_point} {x.fstype} {','.join(sorted(x.flags))}"
                  for x in m.mountinfo(path))


def ns_table():
    """The environment's mount table as a process that joined it sees it."""
    res = subprocess.run(["nsenter", f"--mount={holder}", "cat", "/proc/self/mountinfo"],
                         capture_output=True, text=True, check=True)
    return sorted(f"{x.mount_point} {x.fstype} {','.join(sorted(x.flags))}"
                  for x in m.parse_mountinfo(res.stdout))


def in_ns(*argv):
    """Run argv in the environment's namespace: (exit status, stderr)."""
    res = subprocess.run(["nsenter", f"--mount={holder}", *argv], capture_output=True,
                         text=True)
    return [res.returncode, res.stderr.strip()]


def under(rows, prefix):
    return [x for x in rows if x.split()[0].startswith(prefix)]


def steps():
    return [r.MountNamespaceDir(), r.MountNamespace("alpha"),
            r.Mount("alpha", root, "/", root, "bind", ("ro", "nosuid", "nodev"))]


def up(resources):
    memos = []
    for res in resources:
        memo = res.snapshot(host)
        assert not res.refuses(memo), res.refuses(memo)
        res.apply(host, memo)
        memos.append(memo)
    return memos


def down(resources, memos):
    for res, memo in reversed(list(zip(resources, memos))):
        res.remove(host, memo)
'''

STAT_NODES = r'''
import json, os, stat, sys
out = {}
for name in sorted(os.listdir(sys.argv[1])):
    st = os.lstat(os.path.join(sys.argv[1], name))
    if stat.S_ISCHR(st.st_mode):
        out[name] = [os.major(st.st_rdev), os.minor(st.st_rdev), oct(stat.S_IMODE(st.st_mode)),
                     st.st_uid, st.st_gid]
    elif stat.S_ISLNK(st.st_mode):
        out[name] = os.readlink(os.path.join(sys.argv[1], name))
st = os.stat(os.path.join(sys.argv[1], "ptmx"))
out["ptmx resolves to"] = [os.major(st.st_rdev), os.minor(st.st_rdev)]
print(json.dumps(out))
'''


def table(sb) -> list[str]:
    """The sandbox's whole mount table: mount point, type and per-mount options."""
    rows = []
    for line in Path(f"/proc/{sb.pid}/mountinfo").read_text().splitlines():
        parts = line.split()
        sep = parts.index("-")
        rows.append(f"{parts[4]} {parts[sep + 1]} {parts[5]}")
    return sorted(rows)


@pytest.fixture
def host(clean, tmp_path):
    """The sandbox, a tiny rootfs with its mount points, bind sources, and a check at the end
    that the sandbox's mount table is what it was."""
    root = tmp_path / "rootfs"
    for d in ("dev", "tmp", "sys", "proc", "etc", "data/ro", "data/rw", "data/race", "lib"):
        (root / d).mkdir(parents=True)
    (root / "lib" / "libfake.so").touch()
    (root / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    for src in ("src-ro", "src-rw"):
        (tmp_path / src).mkdir()
    (tmp_path / "src-ro" / "f").write_text("data\n")
    (tmp_path / "libfake.so.1").write_text("library\n")
    before = table(clean)
    clean.params = {"root": str(root), "base": str(tmp_path), "run": str(clean.run_dir),
                    "state": str(clean.state)}
    yield clean
    assert table(clean) == before, "the sandbox's mount table changed"


def py(sb, body: str, **extra) -> dict:
    params = {**sb.params, **extra}
    res = sb.run(sys.executable, "-c", PRELUDE + body + "\nprint(json.dumps(out))",
                 json.dumps(params), timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the namespace and its mounts


def test_mounts_live_in_the_namespace_and_the_host_sees_only_the_holder(host):
    sb = host
    sb.run("ip", "netns", "add", "t-mnt", check=True)
    sb.run("ip", "link", "add", "t-mv0", "type", "veth", "peer", "name", "t-mv1", check=True)
    out = py(sb, r'''
host_before = table()
res = steps() + [
    r.EnvDev("alpha", root),
    r.Mount("alpha", root, "/tmp", "tmpfs", "tmpfs", ("nosuid", "nodev"),
            data="mode=1777,size=16m"),
    r.Mount("alpha", root, "/sys", "sysfs", "sysfs", ("ro", "nosuid", "nodev", "noexec"),
            netns="t-mnt"),
    r.Mount("alpha", root, "/data/ro", str(base / "src-ro"), "bind", ("ro", "nosuid", "nodev")),
    r.Mount("alpha", root, "/data/rw", str(base / "src-rw"), "bind", ("nosuid", "nodev")),
    r.Mount("alpha", root, "/lib/libfake.so", str(base / "libfake.so.1"), "bind",
            ("ro", "nosuid", "nodev"), file=True),
]
out["absent"] = [str(x.check(host).status.name) for x in res]
memos = up(res)
out["host"] = sorted(set(table()) - set(host_before))
out["host gone"] = sorted(set(host_before) - set(table()))
out["ns"] = under(ns_table(), root)
out["state"] = ns.state("alpha")

# check() of every kind is read-only, in the host's table and in the namespace's.
tables = (table(), ns_table())
out["checks"] = [x.check(host).describe() or x.check(host).status.name for x in res]
out["checks read-only"] = (table(), ns_table()) == tables
out["apply again"] = [attempt(x.apply, host, mo) for x, mo in zip(res, memos)]
out["apply again read-only"] = (table(), ns_table()) == tables

out["write ro"] = in_ns("sh", "-c", f"echo x > {root}/data/ro/new")
out["write rw"] = in_ns("sh", "-c", f"echo x > {root}/data/rw/new")
out["write rootfs"] = in_ns("touch", f"{root}/new")
out["write tmp"] = in_ns("touch", f"{root}/tmp/new")
out["lib"] = subprocess.run(["nsenter", f"--mount={holder}", "cat", f"{root}/lib/libfake.so"],
                            capture_output=True, text=True).stdout
out["sys net"] = sorted(subprocess.run(
    ["nsenter", f"--mount={holder}", "ls", f"{root}/sys/class/net"],
    capture_output=True, text=True).stdout.split())
down(res, memos)
out["after"] = table() == host_before
out["holder"] = os.path.exists(holder)
out["mnt dir"] = os.path.exists(ns.dir)
''')
    run = sb.params["run"]
    root = sb.params["root"]
    assert out["absent"] == ["ABSENT"] * 9
    # The host's table gets the private self-bind and the holder, nothing else.
    assert [row.split()[0] for row in out["host"]] == [f"{run}/mnt.d", f"{run}/mnt.d/alpha"]
    assert out["host"][1].split()[1] == "nsfs"
    assert out["host gone"] == [] and out["state"] == "held"
    ns = {row.split()[0][len(root):] or "/": row.split()[1:] for row in out["ns"]}
    assert ns["/"][1:] == ["nodev,nosuid,ro"], ns
    assert ns["/tmp"] == ["tmpfs", "nodev,nosuid"]
    assert ns["/sys"] == ["sysfs", "nodev,noexec,nosuid,ro"]
    assert ns["/data/ro"][1:] == ["nodev,nosuid,ro"]
    assert ns["/data/rw"][1:] == ["nodev,nosuid"]
    assert ns["/lib/libfake.so"][1:] == ["nodev,nosuid,ro"]
    assert ns["/dev"] == ["tmpfs", "noexec,nosuid"] and ns["/dev/pts"][0] == "devpts"
    assert out["checks"] == ["PRESENT"] * 9, out["checks"]
    assert out["checks read-only"] and out["apply again read-only"]
    assert out["apply again"] == ["ok"] * 9
    assert out["write ro"][0] != 0 and "Read-only file system" in out["write ro"][1]
    assert out["write rw"] == [0, ""]
    assert (Path(sb.params["base"]) / "src-rw" / "new").read_text() == "x\n"
    assert out["write rootfs"][0] != 0 and "Read-only file system" in out["write rootfs"][1]
    assert out["write tmp"] == [0, ""] and not (Path(root) / "tmp" / "new").exists()
    assert out["lib"] == "library\n"
    # sysfs was mounted from inside the environment's network namespace: the sandbox's veth
    # is not there.
    assert out["sys net"] == ["lo"]
    assert out["after"] and not out["holder"] and not out["mnt dir"]
    sb.run("ip", "link", "del", "t-mv0", check=True)
    sb.run("ip", "netns", "del", "t-mnt", check=True)


def test_drift_is_reported_and_repaired(host):
    out = py(host, r'''
ro = r.Mount("alpha", root, "/data/ro", str(base / "src-ro"), "bind", ("ro", "nosuid", "nodev"))
res = steps() + [ro]
memos = up(res)
in_ns("mount", "-o", "remount,bind,rw", f"{root}/data/ro")
out["rw"] = ro.check(host).describe()
ro.apply(host, memos[-1])
out["fixed"] = ro.check(host).status.name
# Another source at the target (what an earlier spec put there): replaced, not stacked.
other = r.Mount("alpha", root, "/data/ro", str(base / "src-rw"), "bind", ("ro", "nosuid", "nodev"))
out["other"] = other.check(host).describe()
other.apply(host, memos[-1])
out["mounts at target"] = len(under(ns_table(), f"{root}/data/ro"))
out["other ok"] = other.check(host).status.name
# remove() of the old resource leaves the new one (not its mount).
ro.remove(host, memos[-1])
out["still"] = other.check(host).status.name
res[-1] = other
down(res, memos)
''')
    assert out["rw"] == "options: nodev, nosuid -> nodev, nosuid, ro"
    assert out["fixed"] == "PRESENT"
    assert out["other"].startswith("source: ") and out["other"].endswith("src-rw")
    assert out["mounts at target"] == 1 and out["other ok"] == "PRESENT"
    assert out["still"] == "PRESENT"


# ---------------------------------------------------------------- propagation


def test_a_shared_parent_mount_propagates_nothing_out(host, tmp_path):
    sb = host
    shared = tmp_path / "shared"
    shared.mkdir()
    sb.run("mount", "-t", "tmpfs", "t-shared", str(shared), check=True)
    sb.run("mount", "--make-shared", str(shared), check=True)
    for d in ("rootfs/tmp", "rootfs/data", "run"):
        sb.run("mkdir", "-p", str(shared / d), check=True)
    # A peer of the shared mount in another namespace: what would propagate out shows there.
    peer = sb.popen("unshare", "--mount", "--propagation", "unchanged", "--", "sh", "-c",
                    "echo ready; exec sleep 1000")
    try:
        assert peer.stdout.readline().strip() == "ready"
        peer_table = Path(f"/proc/{peer.pid}/mountinfo")

        def peer_rows() -> list[str]:
            return sorted(" ".join(line.split()[4:5] + line.split()[line.split().index("-") + 1:
                                                                   line.split().index("-") + 2])
                          for line in peer_table.read_text().splitlines())

        before = peer_rows()
        # Two steps: up, look at the peer while the environment is up, then down.
        res = subprocess.Popen(
            ["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable, "-c", PRELUDE + r'''
probe = base / "shared" / "probe"
probe.touch()
fd = m._new_namespace()
try:
    m.mount(m.fd_path(fd), str(probe), None, m.MS_BIND)
    out["bind on shared"] = "ok"
except OSError as exc:
    out["bind on shared"] = exc.errno
os.close(fd)
probe.unlink()
res = steps() + [r.Mount("alpha", root, "/tmp", "tmpfs", "tmpfs", ("nosuid", "nodev"))]
memos = up(res)
out["dir"] = [ns.dir_state().propagation, res[0].check(host).status.name]
out["ns"] = under(ns_table(), root)
print("up", flush=True)
sys.stdin.readline()
down(res, memos)
print(json.dumps(out), flush=True)
''', json.dumps({**sb.params, "root": str(shared / "rootfs"), "run": str(shared / "run")})],
            env=sb.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        line = res.stdout.readline()
        assert line.strip() == "up", stderr_of(res)
        during = peer_rows()
        res.stdin.write("\n")
        res.stdin.flush()
        result = json.loads(res.stdout.readline())
        assert res.wait(timeout=60) == 0, res.stderr.read()
        after = peer_rows()
    finally:
        peer.kill()
        peer.wait()
    assert result["bind on shared"] == 22  # EINVAL
    assert result["dir"] == ["private", "PRESENT"]
    root = str(shared / "rootfs")
    assert [row.split()[:2] for row in result["ns"]] == [[root, "tmpfs"], [f"{root}/tmp",
                                                                            "tmpfs"]]
    # Only the (empty) self-bind of <run>/mnt reached the peer: no holder, no mount of the
    # environment.
    assert sorted(set(during) - set(before)) == [f"{shared}/run/mnt.d tmpfs"]
    assert after == before
    sb.run("umount", str(shared), check=True)


# ---------------------------------------------------------------- targets that lead out


def test_targets_leading_out_of_the_rootfs_are_refused_and_nothing_is_mounted(host):
    root = Path(host.params["root"])
    (root / "data" / "to-etc").symlink_to("/etc")
    (root / "data" / "absolute").symlink_to("/data/rw")  # absolute, even if inside
    (root / "data" / "rel-out").symlink_to("../../../../../../../../etc")
    (root / "data" / "rel-in").symlink_to("rw")
    out = py(host, r'''
res = steps()
memos = up(res)
host_before, ns_before = table(), ns_table()
src = str(base / "src-ro")
for target in ("/data/../etc", "/../etc", "/data/to-etc", "/data/absolute", "/data/rel-out",
               "/data/missing", "/lib/libfake.so"):
    mnt = r.Mount("alpha", root, target, src, "bind", ("ro", "nosuid", "nodev"))
    out[target] = attempt(mnt.apply, host, {})
out["nothing mounted"] = (table(), ns_table()) == (host_before, ns_before)
# A relative symlink that stays inside is followed: the mount sits where it leads.
inside = r.Mount("alpha", root, "/data/rel-in", src, "bind", ("ro", "nosuid", "nodev"))
inside.apply(host, {})
out["rel-in"] = [x.split()[0] for x in set(ns_table()) - set(ns_before)]
out["rel-in check"] = inside.check(host).status.name
inside.remove(host, {})
down(res, memos)
''')
    for target in ("/data/../etc", "/../etc"):
        assert out[target].startswith(f"HostError: mount {target} in 'alpha': ")
        assert "'.' or '..'" in out[target]
    for target in ("/data/to-etc", "/data/absolute", "/data/rel-out"):
        assert out[target] == (f"HostError: mount {target} in 'alpha': the path leaves the "
                               "root filesystem ('..', an absolute symlink or a symlink "
                               "pointing outside it)")
    assert "does not exist in the root filesystem" in out["/data/missing"]
    assert "is not a directory" in out["/lib/libfake.so"]
    assert out["nothing mounted"]
    assert out["rel-in"] == [f"{root}/data/rw"] and out["rel-in check"] == "PRESENT"
    assert (Path("/etc/passwd").read_text() != "") and os.listdir(root / "etc") == ["passwd"]


@pytest.mark.parametrize("swap", ["rename", "rmdir"])
def test_a_mount_point_swapped_for_a_symlink_after_it_was_opened(host, swap):
    """Resolve, swap the directory for a symlink to /etc, mount on the descriptor: the mount
    never reaches /etc, and what landed in the rootfs is unmounted again."""
    out = py(host, r'''
res = steps()[:2]  # the rootfs stays writable, so the directory can be swapped
memos = up(res)
host_before, ns_before = table(), ns_table()
race = Path(root) / "data" / "race"
with ns.entered("alpha"):
    mp = m.open_mountpoint(root, "/data/race")
    if P["swap"] == "rename":
        race.rename(race.with_name("race.old"))
    else:
        race.rmdir()
    race.symlink_to("/etc")
    try:
        m.mount_on(mp, "tmpfs", source="t-race", flags=m.MS_NOSUID)
        out["result"] = "mounted"
    except m.Moved as exc:
        out["result"] = f"moved: {exc.strerror}"
    except OSError as exc:
        out["result"] = f"{type(exc).__name__}: {exc.errno}"
    mp.close()
    out["ns t-race"] = [x.mount_point for x in m.mountinfo(m.THREAD_MOUNTINFO)
                        if x.source == "t-race"]
out["tables"] = (table(), ns_table()) == (host_before, ns_before)
out["etc in ns"] = [x for x in ns_table() if x.split()[0] == "/etc"]
down(res, memos)
''', swap=swap)
    if swap == "rename":
        assert out["result"].startswith("moved: mount point changed while mounting (")
    else:
        assert out["result"] == "FileNotFoundError: 2"  # an unlinked directory takes no mount
    assert out["ns t-race"] == [] and out["tables"] and out["etc in ns"] == []
    assert not any(row.split()[0] == "/etc" for row in table(host))


# ---------------------------------------------------------------- /dev


def test_env_dev_nodes_drift_and_removal(host):
    out = py(host, r'''
gpus = (("nvidia0", 195, 0, 0o660, 44), ("nvidiactl", 195, 255, 0o660, 44))
dev = r.EnvDev("alpha", root, gpus)
res = steps() + [dev]
memos = up(res)
out["check"] = dev.check(host).status.name
out["nodes"] = json.loads(subprocess.run(
    ["nsenter", f"--mount={holder}", sys.executable, "-c", P["stat"], f"{root}/dev"],
    capture_output=True, text=True, check=True).stdout)
out["mounts"] = [x.split()[:2] for x in under(ns_table(), f"{root}/dev")]
# Drift: a node nobody asked for, a mode changed, a safe node gone.
in_ns("mknod", "-m", "0666", f"{root}/dev/nvidia9", "c", "195", "9")
in_ns("chmod", "0666", f"{root}/dev/nvidia0")
in_ns("rm", f"{root}/dev/zero")
tables = (table(), ns_table())
out["drift"] = dev.check(host).describe()
out["check read-only"] = (table(), ns_table()) == tables
dev.apply(host, memos[-1])
out["fixed"] = dev.check(host).status.name
out["nvidia9"] = in_ns("test", "-e", f"{root}/dev/nvidia9")[0]
dev.remove(host, memos[-1])
out["removed"] = under(ns_table(), f"{root}/dev")
out["after remove"] = dev.check(host).status.name
down(res[:-1], memos[:-1])
''', stat=STAT_NODES)
    assert out["check"] == "PRESENT"
    nodes = out["nodes"]
    assert nodes["nvidia0"] == [195, 0, "0o660", 0, 44]
    assert nodes["nvidiactl"] == [195, 255, "0o660", 0, 44]
    for name, major, minor in (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8),
                               ("urandom", 1, 9), ("tty", 5, 0)):
        assert nodes[name] == [major, minor, "0o666", 0, 0], name
    assert nodes["ptmx"] == "pts/ptmx" and nodes["ptmx resolves to"] == [5, 2]
    assert nodes["fd"] == "/proc/self/fd" and nodes["stderr"] == "/proc/self/fd/2"
    assert sorted(k for k, v in nodes.items() if isinstance(v, list)) == sorted(
        ["nvidia0", "nvidiactl", "null", "zero", "full", "random", "urandom", "tty",
         "ptmx resolves to"])
    root = host.params["root"]
    assert out["mounts"] == [[f"{root}/dev", "tmpfs"], [f"{root}/dev/pts", "devpts"],
                             [f"{root}/dev/shm", "tmpfs"]]
    assert out["drift"] == ("/dev/nvidia0: c 195:0 0666 gid 44 -> c 195:0 0660 gid 44; "
                            "/dev/nvidia9: c 195:9 0666 gid 0 -> none; "
                            "/dev/zero: none -> c 1:5 0666 gid 0")
    assert out["check read-only"]
    assert out["fixed"] == "PRESENT" and out["nvidia9"] == 1
    assert out["removed"] == [] and out["after remove"] == "ABSENT"


# ---------------------------------------------------------------- the holder


def test_holder_ownership_and_a_namespace_that_went_first(host):
    run = Path(host.params["run"])
    out = py(host, r'''
mntns = r.MountNamespace("alpha")
ns.make_private_dir()
# An empty plain file (a crash between creating the mount point and binding): taken over.
Path(holder).touch()
memo = mntns.snapshot(host)
out["file"] = [memo["found"], mntns.refuses(memo), mntns.check(host).status.name]
mntns.apply(host, memo)
out["made"] = mntns.check(host).status.name
# A namespace already held there that no journal records: refused.
memo2 = mntns.snapshot(host)
out["held"] = mntns.refuses(memo2)
# The mounts' remove succeeds when the namespace itself is gone.
rootbind = steps()[2]
rootbind.apply(host, {})
mntns.remove(host, memo)
out["state"] = ns.state("alpha")
out["mount remove"] = attempt(rootbind.remove, host, {})
out["mount check"] = rootbind.check(host).describe()
out["enter"] = attempt(lambda: ns.entered("alpha").__enter__())
# Something else at the holder: refused and never removed.
os.mkdir(holder)
memo3 = mntns.snapshot(host)
out["other"] = [mntns.refuses(memo3), mntns.check(host).status.name]
mntns.remove(host, memo3)
out["kept"] = os.path.isdir(holder)
os.rmdir(holder)
r.MountNamespaceDir().remove(host, {"existed": False, "mounted": False})
''')
    assert out["file"] == ["file", "", "ABSENT"] and out["made"] == "PRESENT"
    assert out["held"].startswith(f"a mount namespace is already held at {run}/mnt.d/alpha")
    assert out["state"] == "absent" and out["mount remove"] == "ok"
    assert out["mount check"] == "no mount namespace"
    assert out["enter"] == (f"HostError: mount namespace 'alpha': {run}/mnt.d/alpha does not "
                            "exist")
    assert out["other"] == [f"{run}/mnt.d/alpha exists and is not a mount namespace envctl made",
                            "WRONG_KIND"]
    assert out["kept"]


def test_entered_comes_back_to_the_host_after_an_error(host):
    out = py(host, r'''
import threading, time
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # setns needs CLONE_FS
res = steps()
memos = up(res)
home = os.readlink("/proc/thread-self/ns/mnt"), os.getcwd()
try:
    with ns.entered("alpha"):
        out["inside"] = os.readlink("/proc/thread-self/ns/mnt") != home[0]
        raise RuntimeError("boom")
except RuntimeError:
    pass
out["back"] = (os.readlink("/proc/thread-self/ns/mnt"), os.getcwd()) == home
down(res, memos)
''')
    assert out == {"inside": True, "back": True}


def test_sandbox_has_nothing_left_after_a_failed_apply(host):
    """A bind whose source is missing fails before mounting: nothing in either table."""
    out = py(host, r'''
res = steps()
memos = up(res)
before = (table(), ns_table())
bad = r.Mount("alpha", root, "/data/ro", str(base / "no-such"), "bind", ("ro",))
out["bad"] = attempt(bad.apply, host, {})
out["same"] = (table(), ns_table()) == before
down(res, memos)
''')
    assert out["bad"].startswith("HostError: mount /data/ro in 'alpha': source ")
    assert "No such file or directory" in out["bad"] and out["same"]



def test_a_directory_that_was_a_shared_mount_point_gets_its_propagation_back(host):
    sb = host
    mnt = Path(sb.params["run"]) / "mnt.d"
    sb.run("mkdir", "-p", str(mnt), check=True)
    sb.run("mount", "--bind", str(mnt), str(mnt), check=True)
    sb.run("mount", "--make-shared", str(mnt), check=True)
    out = py(sb, r'''
d = r.MountNamespaceDir()
memo = d.snapshot(host)
out["memo"] = memo
out["before"] = d.check(host).describe()
d.apply(host, memo)
out["applied"] = [ns.dir_state().propagation, d.check(host).status.name]
out["note"] = d.undo_note(host, memo)
d.remove(host, memo)
out["after"] = list(ns.dir_state())
''')
    assert out["memo"] == {"existed": True, "mounted": True, "propagation": "shared"}
    assert out["before"] == "propagation: shared -> private"
    assert out["applied"] == ["private", "PRESENT"]
    assert out["note"] == "kept: it was a mount point before envctl; propagation private -> shared"
    assert out["after"] == [True, True, "shared"]  # still the operator's mount, shared again
    sb.run("umount", str(mnt), check=True)
    sb.run("rmdir", str(mnt), check=True)
