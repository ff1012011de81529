"""Run INSIDE the v2 VM (tests/vm/test_vm_cgroup.py boots it): the cgroup tests of
tests/integration/test_cgroup.py against a real cgroup v2 kernel with every controller,
teardown of sub-cgroups a process made and of processes that ignore SIGTERM included."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envctl.host.cgroups import Cgroups, detect_layout, read_cgroup_facts
from envctl.monitor.prom import parse_exposition
from tests.integration.sandbox import Sandbox
from tests.integration.test_cgroup import (
    ATTACH,
    KMSG_PROBE,
    SPEC,
    SUB_CGROUP,
    ask,
    expect,
    rmdirs,
    run_child,
    sleeper,
    spawn,
    start_child,
    stop,
    up,
)

pytestmark = pytest.mark.root
ROOT = Path("/sys/fs/cgroup")


@pytest.fixture
def clean(tmp_path):
    if detect_layout().version != 2:
        pytest.skip("not a cgroup v2 host")
    sb = Sandbox(tmp_path)
    sb.nft_tables = lambda: []  # the VM loads no nf_tables module; envctl's cgroups need none
    yield sb
    residue = sb.residue()
    sb.close()
    assert residue == {}, "residue left behind"


def cg(sb) -> Cgroups:
    return Cgroups(detect_layout(), sb.cgroup_parent, kill_grace=1.0)


def path(sb, *rest: str) -> Path:
    return ROOT.joinpath(sb.cgroup_parent, *rest)


def read(sb, *rest: str) -> str:
    return path(sb, *rest).read_text().strip()


def test_layout_is_pure_v2_with_all_controllers():
    facts = read_cgroup_facts()
    assert facts.layout == "v2" and facts.version == 2
    assert set(facts.controllers) == {"cpu", "cpuset", "memory", "io", "pids"}


def test_up_writes_limits_and_down_removes_everything(clean):
    sb = clean
    io = "\n  io: {weight: 200}" if read_cgroup_facts().io_weight else ""
    res = up(sb, "  cpu: {quota: 50%, weight: 200}\n  memory: {max: 64M, high: 48M}\n"
                 "  pids: {max: 64}" + io)
    assert res.returncode == 0, res.stderr
    assert read(sb, "lim", "cpu.max") == "50000 100000"
    assert read(sb, "lim", "cpu.weight") == "200"
    assert read(sb, "lim", "memory.max") == str(64 * 2**20)
    assert read(sb, "lim", "memory.high") == str(48 * 2**20)
    assert read(sb, "lim", "pids.max") == "64"
    if io:
        weight_file = read_cgroup_facts().io_weight
        assert "200" in read(sb, "lim", weight_file) or weight_file == "io.bfq.weight"
    # The parent delegates the controllers to the environment.
    assert {"cpu", "memory", "pids"} <= set(read(sb, "cgroup.subtree_control").split())
    status = sb.envctl_json("status", "lim")[0]
    assert {s["status"] for s in status["steps"]} == {"ok"}, status
    path(sb, "lim", "pids.max").write_text("5")
    assert sb.envctl("up", "lim").returncode == 0
    assert read(sb, "lim", "pids.max") == "64"
    for _ in range(2):
        sb.envctl("down", "lim", check=True)


def test_cpu_burner_under_half_quota_is_throttled(clean):
    sb = clean
    assert up(sb, "  cpu: {quota: 50%}").returncode == 0
    proc = start_child(sb, "lim", "while True: pass\n")
    try:
        expect(proc, "attached")
        deadline = time.monotonic() + 60
        st = cg(sb).stats("lim")
        while (st.nr_throttled or 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.5)
            st = cg(sb).stats("lim")
        assert st.nr_throttled >= 5 and st.throttled_us > 0, st
        assert st.cpu_usage_us > 0
    finally:
        sb.envctl("down", "lim", check=True)
        proc.wait(timeout=30)


def test_memory_hog_above_limit_is_oom_killed(clean):
    sb = clean
    assert up(sb, "  memory: {max: 32M}").returncode == 0
    hog = ("chunks = []\nfor _ in range(64):\n    chunks.append(bytearray(8 << 20))\n"
           "print('survived')\n")
    res = run_child(sb, "lim", hog, timeout=300)
    assert res.returncode == -9, (res.returncode, res.stdout, res.stderr)
    st = cg(sb).stats("lim")
    assert st.oom_kills >= 1, st
    assert st.memory_peak is not None and st.memory_peak <= 32 * 2**20
    sb.envctl("down", "lim", check=True)


def test_bpf_device_program_refuses_devices_outside_the_list(clean):
    sb = clean
    assert up(sb, "").returncode == 0
    body = """\
import errno
for path in ("/dev/null", "/dev/urandom", "/dev/kmsg"):
    try:
        os.close(os.open(path, os.O_RDONLY))
        print(path, "ok")
    except OSError as exc:
        print(path, errno.errorcode[exc.errno])
"""
    res = run_child(sb, "lim", body, timeout=120)
    assert res.stdout.split("\n")[1:4] == ["/dev/null ok", "/dev/urandom ok", "/dev/kmsg EPERM"]
    sb.envctl("down", "lim", check=True)


def test_dedicated_cpus_show_in_the_process_affinity(clean):
    sb = clean
    assert up(sb, "  cpu: {dedicated: [1]}").returncode == 0
    assert read(sb, "lim", "cpuset.cpus") == "1"
    res = run_child(sb, "lim", "print(sorted(os.sched_getaffinity(0)))\n", timeout=120)
    assert res.stdout.split("\n")[1] == "[1]", res.stdout + res.stderr
    sb.envctl("down", "lim", check=True)


def test_down_kills_live_processes_with_cgroup_kill(clean):
    sb = clean
    assert up(sb, "  pids: {max: 32}").returncode == 0
    kids = [spawn(sb, "lim", "import time\ntime.sleep(1000)\n") for _ in range(2)]
    for k in kids:
        expect(k, "attached")
    assert cg(sb).stats("lim").pids_current == 2
    sb.envctl("down", "lim", check=True)
    for k in kids:
        assert k.wait(timeout=30) != 0
    sb.envctl("down", "lim", check=True)


def test_fault_at_every_cgroup_step_leaves_no_residue(clean):
    sb = clean
    sb.write_spec("lim", SPEC.format(name="lim", resources="  memory: {max: 64M}"))
    keys = [s["key"] for s in sb.envctl_json("plan", "lim")[0]["steps"]]
    for i, key in enumerate(keys):
        if not key.startswith("cgroup"):
            continue
        res = sb.envctl("up", "lim", env={"ENVCTL_FAULT": f"fail@after:#{i}"})
        assert res.returncode == 1, res.stderr
        assert sb.residue() == {}, key


def test_down_kills_processes_in_their_own_sub_cgroup(clean):
    sb = clean
    assert up(sb, "  pids: {max: 32}\n  memory: {max: 64M}").returncode == 0
    kid = spawn(sb, "lim", SUB_CGROUP)
    try:
        expect(kid, "attached")
        expect(kid, "moved")
        assert read(sb, "lim", "job", "cgroup.procs")
        res = sb.envctl("down", "lim", env={"ENVCTL_KILL_GRACE": "1"})
        assert res.returncode == 0, res.stdout + res.stderr
        assert kid.wait(timeout=60) != 0
    finally:
        stop(kid)


def test_device_program_stays_until_the_processes_are_gone(clean):
    sb = clean
    assert up(sb, "").returncode == 0
    from envctl.host import bpf

    kid = spawn(sb, "lim", KMSG_PROBE)
    try:
        expect(kid, "attached")
        expect(kid, "ready")
        assert ask(kid) == "kmsg EPERM"
        res = sb.envctl("down", "lim", env={"ENVCTL_FAULT": "fail@remove:cgroup:lim"})
        assert res.returncode == 1, res.stdout + res.stderr
        assert bpf.attached_device_programs(path(sb, "lim"))
        assert ask(kid) == "kmsg EPERM"
        sb.envctl("down", "lim", env={"ENVCTL_KILL_GRACE": "1"}, check=True)
        assert kid.wait(timeout=60) == -9
    finally:
        stop(kid)


def test_cgroup_envctl_did_not_make_is_refused_and_left_alone(clean):
    sb = clean
    theirs = path(sb, "lim")
    theirs.mkdir(parents=True)
    owner = sleeper()
    try:
        (theirs / "cgroup.procs").write_text(str(owner.pid))
        res = up(sb, "  pids: {max: 32}")
        assert res.returncode == 1 and str(theirs) in res.stderr, res.stderr
        sb.envctl("down", "lim", check=True)
        assert owner.poll() is None
        assert (theirs / "cgroup.procs").read_text().split() == [str(owner.pid)]
        assert theirs.parent.is_dir()  # the parent was theirs too: kept
    finally:
        owner.kill()
        owner.wait()
        rmdirs(theirs, theirs.parent)


def test_a_job_over_its_environments_memory_is_out_of_memory_on_v2(clean, tmp_path):
    """On v2 a job's cgroup has memory.events only once the environment's cgroup delegates the
    memory controller to its children (launch._delegate): the OOM kill is then counted in the
    job's cgroup, and the job ends OUT_OF_MEMORY, not just FAILED by SIGKILL."""
    import json

    sb = clean
    sb.write_spec("lim", "name: lim\nkind: cpu\nrootfs: {binaries: [sh], python: true}\n"
                         "resources: {memory: {max: 64M}}\n")
    assert sb.envctl("up", "lim").returncode == 0
    try:
        hog = tmp_path / "hog.py"
        hog.write_text("b = b'x' * (200 << 20)\nprint(len(b))\n")
        res = sb.envctl("submit-job", "lim", "--user", "root", "--wait", str(hog))
        assert res.returncode == 128 + 9, res.stderr
        (record,) = [json.loads(p.read_text()) for p in (sb.state / "jobs").glob("*.json")]
        assert record["state"] == "OUT_OF_MEMORY", record
    finally:
        sb.envctl("down", "lim", check=True)
    # Job records are history and outlive `down` (docs/runtime.md): the only thing left.
    assert sorted(p.name for p in sb.state.iterdir()) == ["jobs", "lock"]
    shutil.rmtree(sb.state)


# IO on the VM's disk (tests/vm/test_vm_cgroup.py gives it one: every filesystem here is 9p
# or tmpfs, whose IO io.stat does not count), opened before the process joins `lim`: lim's
# device program (envctl's allow-list) refuses the disk, and is asked at open() only. Then, in
# lim, the IO with O_DIRECT, so that each byte goes to the device (and is counted in the
# cgroup of the process that issues it), not to the page cache; then four CPU-bound
# processes, more than the VM's two CPUs: the quota throttles them, and while they may run
# they wait for a CPU (PSI's cpu "some").
OPEN_DISK = 'import os\nfd = os.open("/dev/vda", os.O_RDWR | os.O_DIRECT)\n'
BUSY = """\
import mmap
buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT needs
for i in range(4):
    os.pwritev(fd, [buf], i << 20)
for i in range(8):
    os.preadv(fd, [buf], i << 20)
os.fsync(fd)
os.close(fd)
print("io done", flush=True)
os.fork()
os.fork()
while True:
    pass
"""
RAW = ("cpu.max", "cpu.stat", "io.stat", "memory.events", "cpu.pressure", "memory.pressure",
       "io.pressure")


def raw_counters(sb) -> dict[str, float]:
    """The counters the monitor exports, read here from lim's files by a parser of this test's
    own (seconds and bytes, as the exposition says them)."""
    files = {f: read(sb, "lim", f) for f in RAW}
    stat = dict(line.split() for line in files["cpu.stat"].splitlines())
    out = {"periods": int(stat["nr_periods"]), "throttled_periods": int(stat["nr_throttled"]),
           "throttled_seconds": int(stat["throttled_usec"]) / 1e6,
           "read": sum(int(n) for n in re.findall(r"\brbytes=(\d+)", files["io.stat"])),
           "write": sum(int(n) for n in re.findall(r"\bwbytes=(\d+)", files["io.stat"]))}
    for res in ("cpu", "memory", "io"):
        for line in files[f"{res}.pressure"].splitlines():
            out[f"{res}.{line.split()[0]}"] = int(line.rsplit("total=", 1)[1]) / 1e6
    return out


def lim_series(text: str) -> dict[str, dict[str, float]]:
    """The exposition's samples of `lim`: name -> {its other label values joined (resource
    and kind, direction, event), "" for none: value}."""
    out: dict[str, dict[str, float]] = {}
    for name, rows in parse_exposition(text).items():
        for labels, value in rows:
            if labels.get("envctl_environment") == "lim":
                key = ".".join(labels[k] for k in ("resource", "kind", "direction", "event")
                               if k in labels)
                out.setdefault(name, {})[key] = value
    return out


def test_the_monitor_reads_quota_throttling_pressure_and_io_of_a_real_cgroup(clean):
    """`envctl monitor --once` on an environment under a CPU quota that a busy process has
    hit, after IO on a real block device: cpu.max as the spec says, cpu.stat's throttling,
    memory.events, PSI and io.stat, each between what this test reads from the files just
    before and just after the monitor's sample (units and parsing: unit tests check them
    against fake files only)."""
    sb = clean
    assert Path("/dev/vda").is_block_device(), "no disk in the VM (test_vm_cgroup.py)"
    assert up(sb, "  cpu: {quota: 20%}\n  memory: {max: 64M}").returncode == 0
    busy = subprocess.Popen(["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable,
                             "-c", OPEN_DISK + ATTACH + BUSY, "lim"], env=sb.env(None),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        expect(busy, "attached")
        expect(busy, "io done")
        deadline = time.monotonic() + 60
        while (cg(sb).stats("lim").nr_throttled or 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.5)
        before = raw_counters(sb)
        res = sb.envctl("monitor", "--once", "--no-heal")
        after = raw_counters(sb)
        files = {f: read(sb, "lim", f) for f in RAW}
    finally:
        sb.envctl("down", "lim", check=True)
        busy.wait(timeout=30)
    assert res.returncode == 0, res.stderr
    m = lim_series(res.stdout)
    print("lim's files:", json.dumps(files, indent=1), "the monitor's series:",
          json.dumps(m, indent=1), sep="\n")
    # cpu.max: 20% of the 100 ms period.
    assert m["envctl_environment_cpu_quota_seconds"] == {"": 0.02}, m
    assert m["envctl_environment_cpu_period_seconds"] == {"": 0.1}, m
    got = {k: m[f"envctl_environment_cpu_{k}_total"][""]
           for k in ("periods", "throttled_periods", "throttled_seconds")}
    got.update({d: m["envctl_environment_io_bytes_total"][d] for d in ("read", "write")})
    got.update(m["envctl_environment_pressure_stalled_seconds_total"])
    # Every PSI line of the three files (cpu's "full" included, as 6.1 writes it per cgroup).
    assert set(m["envctl_environment_pressure_stalled_seconds_total"]) == {
        f"{r}.{k}" for r in ("cpu", "memory", "io") for k in ("some", "full")}, m
    for key, value in got.items():
        assert before[key] <= value <= after[key], (key, before[key], value, after[key])
    assert got["throttled_periods"] >= 5 and got["throttled_seconds"] > 0, got
    # At least the bytes BUSY moved (O_DIRECT: 8 MiB read and 4 MiB written on the disk).
    assert got["read"] >= 8 << 20 and got["write"] >= 4 << 20, got
    # Four runnable processes on two CPUs waited for one; the direct IO waited for the disk.
    assert got["cpu.some"] > 0 and got["io.some"] > 0, got
    assert set(m["envctl_environment_memory_events_total"]) == {
        "high", "max", "oom", "oom_kill"}, m
