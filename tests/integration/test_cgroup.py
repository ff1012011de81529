"""Cgroup limits on this host's real kernel (cgroup v1/hybrid here): throttling, OOM kills,
the device allow-list, dedicated CPUs, stats, teardown with live processes, faults."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envctl.host.cgroups import Cgroups, detect_layout

pytestmark = pytest.mark.root

SPEC = """\
name: {name}
kind: cpu
resources:
  driver: cgroupfs
{resources}
"""

# A child that puts itself into the environment's cgroup (as the job system will), says so on
# stdout, then runs BODY.
ATTACH = """\
import os, sys
from envctl.host.cgroups import Cgroups
Cgroups.from_env().attach(sys.argv[1], os.getpid())
print("attached", flush=True)
"""


def cgroups(sb) -> Cgroups:
    return Cgroups(detect_layout(), sb.cgroup_parent, kill_grace=1.0)


def up(sb, resources: str, name: str = "lim", env: dict | None = None):
    sb.write_spec(name, SPEC.format(name=name, resources=resources))
    return sb.envctl("up", name, env=env)


def start_child(sb, env: str, body: str) -> subprocess.Popen:
    """BODY in the environment's cgroup, running once it is attached (see `spawn`)."""
    return spawn(sb, env, body)


def run_child(sb, env: str, body: str, timeout: float = 60):
    """Run BODY inside the environment's cgroup; returns the completed process."""
    return sb.run(sys.executable, "-c", ATTACH + body,
                  env, timeout=timeout)


def spawn(sb, env: str, body: str, extra: dict | None = None) -> subprocess.Popen:
    """BODY in the environment's cgroup (attached first), its stdin, stdout and stderr piped."""
    code = ATTACH + body
    return subprocess.Popen(["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable,
                             "-c", code, env], env=sb.env(extra), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def expect(proc: subprocess.Popen, want: str) -> None:
    """The child's next line is `want`; otherwise fail showing what it said on stderr."""
    line = proc.stdout.readline().strip()
    if line != want:
        proc.kill()
        raise AssertionError(f"child said {line!r}, not {want!r}; stderr:\n{proc.stderr.read()}")


def ask(proc: subprocess.Popen, line: str = "probe") -> str:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


# Moves itself (and a child it forks) into a sub-cgroup of its own, as podman, `systemd --user`
# or a job system would: teardown has to find it below the environment's cgroup.
SUB_CGROUP = """\
import time
from pathlib import Path
from envctl.host.cgroups import Cgroups
cg = Cgroups.from_env()
for d in cg.dirs(sys.argv[1], ("pids", "memory", "freezer", "")):
    if d.is_dir():
        (d / "job").mkdir()
        (d / "job" / "cgroup.procs").write_text(str(os.getpid()))
if os.fork() == 0:
    time.sleep(1000)
    os._exit(0)
print("moved", flush=True)
time.sleep(1000)
"""

# Ignores SIGTERM, then on each line of stdin tries to open /dev/kmsg (outside the allow-list).
KMSG_PROBE = """\
import errno, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
for line in sys.stdin:
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY))
        print("kmsg ok", flush=True)
    except OSError as exc:
        print("kmsg", errno.errorcode[exc.errno], flush=True)
"""


def sleeper() -> subprocess.Popen:
    """A process of somebody else's, outside every environment."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])


def rmdirs(*dirs: Path) -> None:
    for d in dirs:
        with contextlib.suppress(FileNotFoundError):
            d.rmdir()


def v1_path(sb, controller: str, *rest: str) -> Path:
    lay = detect_layout()
    return Path(lay.v1[controller], sb.cgroup_parent, *rest)


@pytest.fixture(autouse=True)
def _needs_v1():
    if detect_layout().version != 1:
        pytest.skip("these tests drive cgroup v1 (tests/vm runs the v2 ones)")


def test_up_writes_limits_and_down_removes_everything(clean):
    sb = clean
    res = up(sb, """\
  cpu: {quota: 50%, period_us: 100000, weight: 200}
  memory: {max: 64M, high: 48M}
  pids: {max: 64}""")
    assert res.returncode == 0, res.stderr
    assert v1_path(sb, "cpu", "lim", "cpu.cfs_quota_us").read_text().strip() == "50000"
    assert v1_path(sb, "cpu", "lim", "cpu.shares").read_text().strip() == "2048"
    assert v1_path(sb, "memory", "lim", "memory.limit_in_bytes").read_text().strip() == \
        str(64 * 2**20)
    assert v1_path(sb, "memory", "lim", "memory.soft_limit_in_bytes").read_text().strip() == \
        str(48 * 2**20)
    assert v1_path(sb, "pids", "lim", "pids.max").read_text().strip() == "64"
    # The parent's cpuset was initialised (else no task could enter the child).
    assert v1_path(sb, "cpuset", "cpuset.cpus").read_text().strip()
    status = sb.envctl_json("status", "lim")[0]
    assert {s["status"] for s in status["steps"]} == {"ok"}
    assert status["cgroup"]["driver"] == "cgroupfs" and status["cgroup"]["version"] == 1
    assert status["cgroup"]["stats"]["pids_current"] == 0
    assert "driver cgroupfs (cgroup v1)" in sb.envctl("status", "lim", check=True).stdout
    # Up again is a no-op; drift is seen and repaired.
    v1_path(sb, "pids", "lim", "pids.max").write_text("5")
    status = sb.envctl_json("status", "lim")[0]
    assert [s["diffs"] for s in status["steps"] if s["status"] == "drifted"] == \
        [[{"field": "pids.max", "want": "64", "have": "5"}]]
    assert sb.envctl("up", "lim").returncode == 0
    assert v1_path(sb, "pids", "lim", "pids.max").read_text().strip() == "64"
    for _ in range(2):
        sb.envctl("down", "lim", check=True)


def test_cpus_is_written_as_the_equivalent_quota(clean):
    sb = clean
    res = up(sb, "  cpu: {cpus: 0.5, period_us: 50000}")
    assert res.returncode == 0, res.stderr
    assert v1_path(sb, "cpu", "lim", "cpu.cfs_quota_us").read_text().strip() == "25000"
    assert v1_path(sb, "cpu", "lim", "cpu.cfs_period_us").read_text().strip() == "50000"
    # The same limit written as a quota changes nothing on the host.
    sb.write_spec("lim", SPEC.format(name="lim", resources="  cpu: {quota: 50%, period_us: 50000}"))
    plan = sb.envctl_json("plan", "lim")[0]
    assert {s["op"] for s in plan["steps"]} == {"="}, plan["steps"]
    sb.envctl("down", "lim", check=True)


def test_cpu_burner_under_half_quota_is_throttled(clean):
    sb = clean
    assert up(sb, "  cpu: {quota: 50%}").returncode == 0
    proc = start_child(sb, "lim", "while True: pass\n")
    try:
        expect(proc, "attached")
        deadline = time.monotonic() + 20
        st = cgroups(sb).stats("lim")
        while (st.nr_throttled or 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
            st = cgroups(sb).stats("lim")
        assert st.nr_throttled >= 5, st
        assert st.throttled_us > 0 and st.cpu_usage_us > 0
        # 50 % of one CPU: over the observed periods, roughly half of them throttled.
        assert st.nr_throttled <= st.nr_periods
    finally:
        # Down with the burner still running: it is killed and nothing is left.
        sb.envctl("down", "lim", check=True)
        proc.wait(timeout=10)


def test_memory_hog_above_limit_is_oom_killed(clean):
    sb = clean
    assert up(sb, "  memory: {max: 32M}").returncode == 0
    hog = ("chunks = []\nfor _ in range(64):\n    chunks.append(bytearray(8 << 20))\n"
           "print('survived')\n")
    res = run_child(sb, "lim", hog)
    assert res.returncode == -9, (res.returncode, res.stdout, res.stderr)
    assert "survived" not in res.stdout
    st = cgroups(sb).stats("lim")
    assert st.oom_kills >= 1
    assert st.memory_peak <= 32 * 2**20
    sb.envctl("down", "lim", check=True)


def test_device_outside_the_allow_list_is_refused(clean):
    sb = clean
    assert up(sb, "").returncode == 0
    body = """\
import errno
for path in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/kmsg"):
    try:
        os.close(os.open(path, os.O_RDONLY))
        print(path, "ok")
    except OSError as exc:
        print(path, errno.errorcode[exc.errno])
"""
    res = run_child(sb, "lim", body)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[1:5] == ["/dev/null ok", "/dev/zero ok", "/dev/urandom ok",
                                           "/dev/kmsg EPERM"]
    rules = v1_path(sb, "devices", "lim", "devices.list").read_text().split("\n")
    assert "c 136:* rwm" in rules and "a *:* rwm" not in rules
    sb.envctl("down", "lim", check=True)


def test_dedicated_cpus_show_in_the_process_affinity(clean):
    sb = clean
    assert up(sb, "  cpu: {dedicated: [1]}").returncode == 0
    assert v1_path(sb, "cpuset", "lim", "cpuset.cpus").read_text().strip() == "1"
    res = run_child(sb, "lim", "print(sorted(os.sched_getaffinity(0)))\n")
    assert res.stdout.split("\n")[1] == "[1]", res.stdout + res.stderr
    sb.envctl("down", "lim", check=True)


def test_down_kills_live_processes_and_repeats(clean):
    sb = clean
    assert up(sb, "  pids: {max: 32}").returncode == 0
    kids = [start_child(sb, "lim", "import time\ntime.sleep(1000)\n") for _ in range(3)]
    for k in kids:
        expect(k, "attached")
    assert len(cgroups(sb).procs("lim")) == 3
    assert cgroups(sb).stats("lim").pids_current == 3
    sb.envctl("down", "lim", check=True)
    for k in kids:
        assert k.wait(timeout=10) != 0
    assert sb.cgroups() == []
    sb.envctl("down", "lim", check=True)  # repeated down: nothing to do, success


def test_cgroup_removed_by_hand_counts_as_removed(clean):
    sb = clean
    assert up(sb, "  pids: {max: 32}").returncode == 0
    cgroups(sb).remove("lim")
    st = sb.envctl_json("status", "lim")[0]
    assert "missing" in {s["status"] for s in st["steps"]}
    sb.envctl("down", "lim", check=True)


def test_down_uses_the_parent_recorded_at_up(clean):
    sb = clean
    assert up(sb, "  pids: {max: 32}").returncode == 0
    assert sb.cgroups() != []
    # ENVCTL_CGROUP_PARENT (or its default) changed between up and down: the journal's wins.
    other = f"{sb.cgroup_parent}-other"
    sb.envctl("down", "lim", env={"ENVCTL_CGROUP_PARENT": other}, check=True)
    assert sb.cgroups() == []
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{other}"))


@pytest.mark.parametrize("point", ["before", "apply", "after"])
def test_fault_at_every_cgroup_step_leaves_no_residue(clean, point):
    sb = clean
    resources = "  cpu: {quota: 50%, dedicated: [0]}\n  memory: {max: 64M}\n  pids: {max: 64}"
    sb.write_spec("lim", SPEC.format(name="lim", resources=resources))
    keys = [s["key"] for s in sb.envctl_json("plan", "lim")[0]["steps"]]
    # A parent other than the default is its own shared holding, named after it.
    assert {f"cgroup-parent:parent:{sb.cgroup_parent}", "cgroup:lim",
            "cgroup-devices:lim"} <= set(keys)
    for i, key in enumerate(keys):
        res = sb.envctl("up", "lim", env={"ENVCTL_FAULT": f"fail@{point}:#{i}"})
        assert res.returncode == 1, res.stderr
        assert sb.residue() == {}, key


def test_fault_while_removing_then_down_again(clean):
    sb = clean
    assert up(sb, "  pids: {max: 32}").returncode == 0
    res = sb.envctl("down", "lim", env={"ENVCTL_FAULT": "fail@remove:cgroup:lim"})
    assert res.returncode == 1
    assert sb.cgroups()  # the cgroup stayed, recorded for the next down
    sb.envctl("down", "lim", check=True)


def test_values_the_host_cannot_honour_are_plan_errors(sandbox):
    sb = sandbox
    res = up(sb, "  cpu: {quota: 0.5%}")
    assert res.returncode == 2 and "1000 µs minimum" in res.stderr
    res = up(sb, "  memory: {swap_max: 1G}")
    assert res.returncode == 2 and "swap_max" in res.stderr
    assert sb.cgroups() == []


def test_down_kills_processes_that_moved_into_their_own_sub_cgroup(clean):
    sb = clean
    assert up(sb, "  pids: {max: 32}\n  memory: {max: 64M}").returncode == 0
    kid = spawn(sb, "lim", SUB_CGROUP)
    try:
        expect(kid, "attached")
        expect(kid, "moved")
        assert (v1_path(sb, "pids", "lim", "job", "cgroup.procs").read_text().split())
        for _ in range(2):  # a second down finds nothing left, and succeeds
            res = sb.envctl("down", "lim", env={"ENVCTL_KILL_GRACE": "1"})
            assert res.returncode == 0, res.stdout + res.stderr
        assert kid.wait(timeout=30) != 0
        assert sb.cgroups() == []
    finally:
        stop(kid)


def test_sigterm_ignoring_process_never_gets_wider_device_access(clean):
    sb = clean
    assert up(sb, "").returncode == 0
    kid = spawn(sb, "lim", KMSG_PROBE)
    try:
        expect(kid, "attached")
        expect(kid, "ready")
        assert ask(kid) == "kmsg EPERM"
        # Down stops at the cgroup step, after the device step (teardown is the plan reversed):
        # the allow-list must not have been lifted while the process is alive.
        res = sb.envctl("down", "lim", env={"ENVCTL_FAULT": "fail@remove:cgroup:lim"})
        assert res.returncode == 1, res.stdout + res.stderr
        assert "a *:* rwm" not in v1_path(sb, "devices", "lim", "devices.list").read_text()
        assert ask(kid) == "kmsg EPERM"
        # The next down kills it (SIGTERM is ignored: SIGKILL after the grace period).
        sb.envctl("down", "lim", env={"ENVCTL_KILL_GRACE": "1"}, check=True)
        assert kid.wait(timeout=30) == -9
    finally:
        stop(kid)


def test_cgroup_envctl_did_not_make_is_refused_and_left_alone(clean):
    sb = clean
    theirs = v1_path(sb, "pids", "lim")
    theirs.mkdir(parents=True)
    owner = sleeper()
    try:
        (theirs / "cgroup.procs").write_text(str(owner.pid))
        sb.write_spec("lim", SPEC.format(name="lim", resources="  pids: {max: 32}"))
        steps = {s["key"]: s for s in sb.envctl_json("plan", "lim")[0]["steps"]}
        assert steps["cgroup:lim"]["op"] == "!", steps["cgroup:lim"]
        res = sb.envctl("up", "lim")
        assert res.returncode == 1 and str(theirs) in res.stderr, res.stderr
        sb.envctl("down", "lim", check=True)
        # Untouched: still there, its limit as it was, its process alive and inside.
        assert (theirs / "pids.max").read_text().strip() == "max"
        assert owner.poll() is None
        assert (theirs / "cgroup.procs").read_text().split() == [str(owner.pid)]
        assert sb.cgroups() == sorted([str(theirs), str(theirs.parent)])
    finally:
        owner.kill()
        owner.wait()
        rmdirs(theirs, theirs.parent)


def test_parent_that_existed_keeps_its_cpuset(clean):
    sb = clean
    theirs = v1_path(sb, "cpuset")
    theirs.mkdir()  # made by an operator, in one hierarchy only; its cpuset is empty
    try:
        assert up(sb, "  pids: {max: 32}").returncode == 0
        assert (theirs / "cpuset.cpus").read_text().strip()  # envctl filled it to use it
        sb.envctl("down", "lim", check=True)
        assert sb.cgroups() == [str(theirs)]  # envctl's own parents are gone, theirs is kept
        assert (theirs / "cpuset.cpus").read_text().strip() == ""
        assert (theirs / "cpuset.mems").read_text().strip() == ""
    finally:
        rmdirs(theirs)


# ---------------------------------------------------------------- v2 paths on this host
# The hybrid layout here mounts cgroup2 (without resource controllers) at /sys/fs/cgroup/
# unified. Pointing ENVCTL_CGROUP_ROOT at it makes envctl drive it as a v2 host: the parent,
# the environment's cgroup, the BPF device program and cgroup.kill all run on the real kernel.

UNIFIED = Path("/sys/fs/cgroup/unified")


@pytest.fixture
def v2only(clean):
    if not (UNIFIED / "cgroup.procs").exists():
        pytest.skip("no cgroup2 mount at /sys/fs/cgroup/unified")
    return clean


def test_v2_bpf_device_program_refuses_devices_outside_the_list(v2only):
    sb = v2only
    env = {"ENVCTL_CGROUP_ROOT": str(UNIFIED)}
    assert up(sb, "", env=env).returncode == 0
    from envctl.host import bpf
    from envctl.plan.cgroup import DEFAULT_DEVICES

    path = UNIFIED / sb.cgroup_parent / "lim"
    assert bpf.attached_device_programs(path) == [bpf.program_name(DEFAULT_DEVICES)]
    status = sb.envctl_json("status", "lim", env=env)[0]
    assert {s["status"] for s in status["steps"]} == {"ok"}
    body = """\
import errno
for path, mode in (("/dev/null", os.O_RDWR), ("/dev/urandom", os.O_RDONLY),
                   ("/dev/kmsg", os.O_RDONLY)):
    try:
        os.close(os.open(path, mode))
        print(path, "ok")
    except OSError as exc:
        print(path, errno.errorcode[exc.errno])
"""
    res = sb.run(sys.executable, "-c", ATTACH + body,
                 "lim", env=env)
    assert res.stdout.split("\n")[1:4] == ["/dev/null ok", "/dev/urandom ok", "/dev/kmsg EPERM"]
    # Teardown with a live process: cgroup.kill, then rmdir.
    kid = spawn(sb, "lim", "import time\ntime.sleep(1000)\n", env)
    expect(kid, "attached")
    sb.envctl("down", "lim", env=env, check=True)
    assert kid.wait(timeout=10) != 0
    sb.envctl("down", "lim", env=env, check=True)


def test_v2_fault_at_every_step_leaves_no_residue(v2only):
    sb = v2only
    env = {"ENVCTL_CGROUP_ROOT": str(UNIFIED)}
    sb.write_spec("lim", SPEC.format(name="lim", resources=""))
    keys = [s["key"] for s in sb.envctl_json("plan", "lim", env=env)[0]["steps"]]
    for point in ("apply", "after"):
        for i, key in enumerate(keys):
            res = sb.envctl("up", "lim", env={**env, "ENVCTL_FAULT": f"fail@{point}:#{i}"})
            assert res.returncode == 1, res.stderr
            assert sb.residue() == {}, key


def test_v2_down_kills_processes_in_their_own_sub_cgroup(v2only):
    sb = v2only
    env = {"ENVCTL_CGROUP_ROOT": str(UNIFIED), "ENVCTL_KILL_GRACE": "1"}
    assert up(sb, "", env=env).returncode == 0
    kid = spawn(sb, "lim", SUB_CGROUP, env)
    try:
        expect(kid, "attached")
        expect(kid, "moved")
        assert (UNIFIED / sb.cgroup_parent / "lim/job/cgroup.procs").read_text().split()
        res = sb.envctl("down", "lim", env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        assert kid.wait(timeout=30) != 0
        assert sb.cgroups() == []
    finally:
        stop(kid)


def test_v2_device_program_stays_until_the_processes_are_gone(v2only):
    sb = v2only
    env = {"ENVCTL_CGROUP_ROOT": str(UNIFIED)}
    assert up(sb, "", env=env).returncode == 0
    from envctl.host import bpf

    kid = spawn(sb, "lim", KMSG_PROBE, env)
    try:
        expect(kid, "attached")
        expect(kid, "ready")
        assert ask(kid) == "kmsg EPERM"
        res = sb.envctl("down", "lim", env={**env, "ENVCTL_FAULT": "fail@remove:cgroup:lim"})
        assert res.returncode == 1, res.stdout + res.stderr
        assert bpf.attached_device_programs(UNIFIED / sb.cgroup_parent / "lim")
        assert ask(kid) == "kmsg EPERM"
        sb.envctl("down", "lim", env={**env, "ENVCTL_KILL_GRACE": "1"}, check=True)
        assert kid.wait(timeout=30) == -9
    finally:
        stop(kid)


# A launch's cgroup of its own below the environment's, with its own device list (what a job
# with --gpus and an exec get), made by launch.create_cgroup; a child in it, then one in the
# environment's cgroup, each try /dev/null (both lists), /dev/urandom (the environment's only)
# and /dev/kmsg (neither).
OWN_DEVICES = r"""
import errno, json, os, sys
from pathlib import Path
from envctl.runtime.context import EnvCgroup, EnvContext
from envctl.runtime import launch as rl

parent = sys.argv[1]
ctx = EnvContext(env="lim", root=Path("/"), mntns=Path("/"), netns=None, hostname="lim",
                 cgroup=EnvCgroup("cgroupfs", parent, 2))

def probe(cgroup):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        with open(cgroup / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
        out = []
        for path in ("/dev/null", "/dev/urandom", "/dev/kmsg"):
            try:
                os.close(os.open(path, os.O_RDONLY))
                out.append("ok")
            except OSError as exc:
                out.append(errno.errorcode[exc.errno])
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    text = os.read(r, 4096).decode()
    os.waitpid(pid, 0)
    return json.loads(text)

dirs = rl.create_cgroup(ctx, "job-1", devices=("c 1:3 rwm",))
try:
    job = probe(dirs[0])
finally:
    rl.remove_cgroup(ctx, "job-1")
gone = not dirs[0].exists()
# The environment's own cgroup holds no process once down runs: a sibling for the check.
sib = dirs[0].parent / "plain"
sib.mkdir()
try:
    env = probe(sib)
finally:
    sib.rmdir()
print(json.dumps({"job": job, "env": env, "gone": gone}))
"""


def test_v2_a_launch_cgroup_gets_its_own_device_program_below_the_environments(v2only):
    sb = v2only
    env = {"ENVCTL_CGROUP_ROOT": str(UNIFIED)}
    assert up(sb, "", env=env).returncode == 0
    from envctl.host import bpf

    path = UNIFIED / sb.cgroup_parent / "lim"
    flags, _ = bpf.device_programs(path)
    assert flags & bpf.BPF_F_ALLOW_MULTI
    res = sb.run(sys.executable, "-c", OWN_DEVICES, sb.cgroup_parent, env=env)
    assert res.returncode == 0, res.stderr
    import json

    got = json.loads(res.stdout)
    assert got["job"] == ["ok", "EPERM", "EPERM"]  # its own list narrows the environment's
    assert got["env"] == ["ok", "ok", "EPERM"]
    assert got["gone"]
    sb.envctl("down", "lim", env=env, check=True)


def _attach_legacy(path: Path, rules: tuple[str, ...]) -> None:
    """What an envctl before per-job device lists did: one program, no BPF_F_ALLOW_MULTI."""
    import os

    from envctl.host import bpf

    bpf.detach_device_programs(path, name="lim")
    cg = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    prog = bpf.load(rules)
    try:
        bpf._attach(cg, prog, 0, "lim")
    finally:
        os.close(prog)
        os.close(cg)


def test_v2_up_swaps_a_legacy_program_with_the_environments_processes_kept(v2only):
    sb = v2only
    env = {"ENVCTL_CGROUP_ROOT": str(UNIFIED), "ENVCTL_KILL_GRACE": "1"}
    assert up(sb, "", env=env).returncode == 0
    from envctl.host import bpf
    from envctl.plan.cgroup import DEFAULT_DEVICES

    path = UNIFIED / sb.cgroup_parent / "lim"
    _attach_legacy(path, DEFAULT_DEVICES)
    assert bpf.device_programs(path) == (0, [bpf.program_name(DEFAULT_DEVICES)])
    status = sb.envctl_json("status", "lim", env=env)[0]
    drift = [s for s in status["steps"] if s["status"] != "ok"]
    assert [s["key"] for s in drift] == ["cgroup-devices:lim"], status
    assert not bpf.allows_children(path)
    res = sb.run(sys.executable, "-c", OWN_DEVICES, sb.cgroup_parent, env=env)
    assert res.returncode != 0 and "envctl up lim" in res.stderr
    assert not (path / "job-1").exists()
    kid = spawn(sb, "lim", KMSG_PROBE, env)
    try:
        expect(kid, "attached")
        expect(kid, "ready")
        assert ask(kid) == "kmsg EPERM"
        res = sb.envctl("up", "lim", env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        assert bpf.device_programs(path) == (bpf.BPF_F_ALLOW_MULTI,
                                              [bpf.program_name(DEFAULT_DEVICES)])
        assert (path / "cgroup.freeze").read_text().strip() == "0"
        assert not bpf.left_frozen(path)
        assert ask(kid) == "kmsg EPERM"  # running through the swap, and never unlisted
        status = sb.envctl_json("status", "lim", env=env)[0]
        assert {s["status"] for s in status["steps"]} == {"ok"}
        res = sb.run(sys.executable, "-c", OWN_DEVICES, sb.cgroup_parent, env=env)
        assert res.returncode == 0, res.stderr
        sb.envctl("down", "lim", env=env, check=True)
        assert kid.wait(timeout=30) == -9
    finally:
        stop(kid)


def test_v2_up_thaws_a_cgroup_a_cut_short_swap_left_frozen(v2only):
    sb = v2only
    env = {"ENVCTL_CGROUP_ROOT": str(UNIFIED)}
    assert up(sb, "", env=env).returncode == 0
    import os

    from envctl.host import bpf

    path = UNIFIED / sb.cgroup_parent / "lim"
    # As a run killed between its attach and its thaw leaves it.
    os.setxattr(path, bpf.THAW_XATTR, b"1")
    (path / "cgroup.freeze").write_text("1")
    status = sb.envctl_json("status", "lim", env=env)[0]
    assert [s["key"] for s in status["steps"] if s["status"] != "ok"] == ["cgroup-devices:lim"]
    assert sb.envctl("up", "lim", env=env).returncode == 0
    assert (path / "cgroup.freeze").read_text().strip() == "0" and not bpf.left_frozen(path)
    # Frozen by its operator (no marker): envctl leaves it so.
    (path / "cgroup.freeze").write_text("1")
    status = sb.envctl_json("status", "lim", env=env)[0]
    assert {s["status"] for s in status["steps"]} == {"ok"}
    (path / "cgroup.freeze").write_text("0")
    sb.envctl("down", "lim", env=env, check=True)
