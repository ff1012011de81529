"""Run INSIDE the systemd VM (tests/vm/test_vm_systemd.py boots it: systemd is PID 1, cgroup
v2 with every controller): the systemd cgroup driver against a real systemd — the slice and
its properties, limits in the slice's cgroup, device access before and after a daemon-reload
(one device through a /dev/char link envctl made, and removes at down), drift repair,
attach/run, teardown with a live process (also one that ignores SIGTERM from a sub-cgroup of a
delegated scope), an operator's drop-in kept, a slice somebody else started refused and left
running, repeated down, no residue."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envctl.host import systemd as sd
from envctl.host.cgroups import read_cgroup_facts
from tests.integration.sandbox import Sandbox, stderr_of

pytestmark = pytest.mark.root
ROOT = Path("/sys/fs/cgroup")
UNITS = Path("/run/systemd/system")
SPEC = """\
name: {name}
kind: cpu
resources:
  driver: systemd
{resources}
"""
# A child that moves itself into the environment's slice (a transient scope, as the job system
# will), then on each line of stdin tries to open some devices and prints what happened.
PROBE = """\
import errno, os, sys
from envctl.host.systemd import Systemd
print("scope", Systemd.from_env().attach(sys.argv[1], os.getpid()), flush=True)
for line in sys.stdin:
    if line.strip() == "burn":
        import time
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            pass
        print("burnt", flush=True)
        continue
    out = []
    for path in ("/dev/null", "/dev/urandom", "/dev/kmsg"):
        try:
            os.close(os.open(path, os.O_RDONLY))
            out.append("ok")
        except OSError as exc:
            out.append(errno.errorcode[exc.errno])
    print(" ".join(out), flush=True)
"""


@pytest.fixture
def sb(tmp_path):
    facts = read_cgroup_facts()
    if not facts.systemd or facts.version != 2:
        pytest.skip("not a systemd host on cgroup v2")
    box = Sandbox(tmp_path)
    box.nft_tables = lambda: []  # the VM loads no nf_tables module
    yield box
    residue = {**box.residue(), **slice_residue(box)}
    box.close()
    assert residue == {}, "residue left behind"


def names(sb) -> tuple[str, str, Path]:
    parent = sd.parent_slice(sb.cgroup_parent)
    unit = sd.env_slice("lim", sb.cgroup_parent)
    return parent, unit, ROOT / parent / unit


def slice_residue(sb) -> dict[str, list[str]]:
    prefix = sd.parent_slice(sb.cgroup_parent).removesuffix(".slice")
    units = subprocess.run(["systemctl", "list-units", "--all", "--plain", "--no-legend",
                            f"{prefix}*"], capture_output=True, text=True,
                           timeout=120).stdout.split("\n")
    found = {"units": sorted(line.split()[0] for line in units if line.strip()),
             "unit_files": sorted(p.name for p in UNITS.glob(f"{prefix}*")),
             "slice_cgroups": sorted(str(p) for p in ROOT.glob(f"{prefix}*"))}
    return {k: v for k, v in found.items() if v}


def cgroup_of(pid: int) -> str:
    """Process `pid`'s cgroup (v2), as /proc/PID/cgroup's `0::` line gives it."""
    return Path(f"/proc/{pid}/cgroup").read_text().strip().split("::", 1)[1]


def show(unit: str, *keys: str) -> dict[str, str]:
    out = subprocess.run(["systemctl", "show", "-p", ",".join(keys), "--", unit],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def up(sb, resources: str):
    sb.write_spec("lim", SPEC.format(name="lim", resources=resources))
    return sb.envctl("up", "lim", timeout=300)


def test_slice_limits_devices_reload_drift_and_teardown(sb):
    parent, unit, cg = names(sb)
    # No /dev/char/1:9 (as for a node nvidia-modprobe made): envctl links it before the slice,
    # and removes the link with the environment; 1:3, if udev made it, stays.
    Path("/dev/char/1:9").unlink(missing_ok=True)
    udev_1_3 = os.path.lexists("/dev/char/1:3")
    res = up(sb, "  cpu: {quota: 50%, weight: 200}\n  memory: {max: 64M, high: 48M}\n"
                 "  pids: {max: 32}")
    assert res.returncode == 0, res.stdout + res.stderr

    # The slice exists, from envctl's runtime unit file, with the properties.
    assert (UNITS / unit).is_file() and (UNITS / parent).is_file()
    props = show(unit, "ActiveState", "FragmentPath", "CPUQuotaPerSecUSec", "MemoryMax",
                 "MemoryHigh", "TasksMax", "DevicePolicy", "CPUWeight")
    assert props == {"ActiveState": "active", "FragmentPath": str(UNITS / unit),
                     "CPUQuotaPerSecUSec": "500ms", "MemoryMax": str(64 * 2**20),
                     "MemoryHigh": str(48 * 2**20), "TasksMax": "32",
                     "DevicePolicy": "closed", "CPUWeight": "200"}
    # systemd wrote the limits into the slice's cgroup.
    assert (cg / "cpu.max").read_text().split() == ["50000", "100000"]
    assert (cg / "memory.max").read_text().strip() == str(64 * 2**20)
    assert (cg / "pids.max").read_text().strip() == "32"
    assert Path("/dev/char/1:3").resolve() == Path("/dev/null")
    assert os.readlink("/dev/char/1:9") == "../urandom"

    status = sb.envctl_json("status", "lim")[0]
    assert {s["status"] for s in status["steps"]} == {"ok"}, status
    assert status["cgroup"]["driver"] == "systemd"
    assert "driver systemd" in sb.envctl("status", "lim", check=True).stdout

    # A process moved into the slice: allowed devices open, others do not; the same after
    # systemd re-applies every unit's cgroup settings on daemon-reload.
    child = subprocess.Popen(["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable,
                              "-c", PROBE, "lim"], env=sb.env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        scope = child.stdout.readline().split()
        assert scope[:1] == ["scope"], stderr_of(child)
        # (nsenter execs the probe: same pid)
        assert Path(f"/proc/{child.pid}/cgroup").read_text().strip() == \
            f"0::/{parent}/{unit}/{scope[1]}"
        for reload in (False, True):
            if reload:
                subprocess.run(["systemctl", "daemon-reload"], check=True, timeout=120)
            child.stdin.write("probe\n")
            child.stdin.flush()
            # (/dev/urandom is 1:9, through the link envctl made)
            assert child.stdout.readline().split() == ["ok", "ok", "EPERM"], reload
        # The quota throttles it (cpu.stat of the slice, through envctl's stats).
        child.stdin.write("burn\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "burnt"
        stats = sb.envctl_json("status", "lim")[0]["cgroup"]["stats"]
        assert stats["pids_current"] >= 1 and stats["nr_throttled"] >= 1, stats

        # Drift: an operator's set-property is reported precisely and repaired by `up`.
        subprocess.run(["systemctl", "set-property", "--runtime", unit, "TasksMax=5"],
                       check=True, timeout=120)
        status = sb.envctl_json("status", "lim")[0]
        diffs = [d for s in status["steps"] for d in s["diffs"]]
        assert diffs == [{"field": "TasksMax", "want": "32", "have": "5"}], status
        assert sb.envctl("up", "lim", timeout=300).returncode == 0
        assert (cg / "pids.max").read_text().strip() == "32"

        # Down with the process alive: it is stopped, the slice and its unit file go.
        sb.envctl("down", "lim", check=True, timeout=300)
        assert child.wait(timeout=60) != 0
    finally:
        if child.poll() is None:
            child.kill()
    assert not (UNITS / unit).exists() and not cg.exists()
    assert not os.path.lexists("/dev/char/1:9")
    assert os.path.lexists("/dev/char/1:3") == udev_1_3
    # (systemd loads any slice name on demand; gone means inactive and unlisted)
    assert show(unit, "ActiveState")["ActiveState"] == "inactive"
    sb.envctl("down", "lim", check=True, timeout=300)  # repeatable


def test_run_argv_puts_a_command_in_the_slice(sb):
    parent, unit, cg = names(sb)
    assert up(sb, "  memory: {max: 32M}").returncode == 0
    s = sd.Systemd.from_env()
    s.parent = sb.cgroup_parent
    res = subprocess.run(s.run_argv("lim", ["cat", "/proc/self/cgroup"]), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"0::/{parent}/{unit}/" in res.stdout, res.stdout
    status = json.loads(sb.envctl("status", "lim", "--json", check=True).stdout)
    assert status[0]["cgroup"]["driver"] == "systemd"
    sb.envctl("down", "lim", check=True, timeout=300)


# In a scope with Delegate=yes (as podman's): makes a sub-cgroup of its scope, moves there,
# ignores SIGTERM, and waits.
DELEGATED = """\
import os, signal, time
from pathlib import Path
here = Path("/sys/fs/cgroup" + open("/proc/self/cgroup").read().split("::")[-1].strip())
(here / "job").mkdir()
(here / "job" / "cgroup.procs").write_text(str(os.getpid()))
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("moved", here / "job", flush=True)
time.sleep(1000)
"""


def wait_for(done, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_teardown_kills_a_stubborn_process_in_a_delegated_sub_cgroup(sb):
    parent, unit, cg = names(sb)
    assert up(sb, "  pids: {max: 32}").returncode == 0
    kid = subprocess.Popen(["systemd-run", "--quiet", "--scope", "-p", "Delegate=yes",
                            f"--slice={unit}", "--", sys.executable, "-c", DELEGATED],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = kid.stdout.readline().split()
        assert line[:1] == ["moved"], (line, stderr_of(kid))
        assert Path(line[1]).is_relative_to(cg)
        res = sb.envctl("down", "lim", env={"ENVCTL_KILL_GRACE": "1"}, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        assert kid.wait(timeout=60) == -9  # SIGTERM ignored: SIGKILL after the grace
        assert not cg.exists()
    finally:
        if kid.poll() is None:
            kid.kill()
        kid.communicate()


def test_an_operators_drop_in_is_kept(sb):
    parent, unit, cg = names(sb)
    dropin = Path("/etc/systemd/system") / f"{unit}.d" / "10-ops.conf"
    dropin.parent.mkdir(parents=True)
    dropin.write_text("[Slice]\nIOAccounting=yes\n")
    try:
        assert up(sb, "  pids: {max: 32}").returncode == 0
        # A repair through set-property leaves envctl's own runtime drop-in; down removes it.
        subprocess.run(["systemctl", "set-property", "--runtime", unit, "TasksMax=5"],
                       check=True, timeout=120)
        assert sb.envctl("up", "lim", timeout=300).returncode == 0
        control = Path("/run/systemd/system.control") / f"{unit}.d"
        assert (control / "50-TasksMax.conf").exists()
        sb.envctl("down", "lim", check=True, timeout=300)
        assert dropin.exists()
        assert not control.exists()
    finally:
        dropin.unlink(missing_ok=True)
        dropin.parent.rmdir()
        subprocess.run(["systemctl", "daemon-reload"], check=True, timeout=120)


def test_a_slice_somebody_started_is_refused_and_left_running(sb):
    parent, unit, cg = names(sb)
    sb.write_spec("lim", SPEC.format(name="lim", resources="  pids: {max: 32}"))
    theirs = subprocess.Popen(["systemd-run", "--quiet", "--scope", f"--slice={unit}", "--",
                               "sleep", "1000"])
    try:
        assert wait_for(lambda: show(unit, "ActiveState")["ActiveState"] == "active")
        steps = {s["key"]: s for s in sb.envctl_json("plan", "lim")[0]["steps"]}
        assert steps["cgroup-slice:lim"]["op"] == "!", steps
        res = sb.envctl("up", "lim", timeout=300)
        assert res.returncode == 1 and "envctl did not start it" in res.stderr, res.stderr
        sb.envctl("down", "lim", check=True, timeout=300)
        assert theirs.poll() is None
        assert show(unit, "ActiveState")["ActiveState"] == "active"
        assert show(parent, "ActiveState")["ActiveState"] == "active"
        assert str(theirs.pid) in (cg / "cgroup.procs").read_text() or any(
            str(theirs.pid) in p.read_text() for p in cg.rglob("cgroup.procs"))
    finally:
        theirs.kill()
        theirs.wait()
        for u in (unit, parent):  # slices stay active until stopped
            with contextlib.suppress(subprocess.CalledProcessError):
                subprocess.run(["systemctl", "stop", u], check=True, timeout=120)


def test_exec_and_a_job_run_in_transient_scopes_of_the_slice(sb, tmp_path):
    """With the systemd driver a launch is moved into a transient scope of the environment's
    slice through systemd (never by writing systemd's cgroup tree); the scope goes with it."""
    parent, unit, cg = names(sb)
    sb.write_spec("lim", 'name: lim\nkind: cpu\nrootfs: {binaries: [sh, sleep, "true"]}\n'
                         "resources:\n  driver: systemd\n  memory: {max: 64M}\n")
    assert sb.envctl("up", "lim", timeout=300).returncode == 0
    proc = sb.popen(sys.executable, "-m", "envctl", "exec", "lim", "--user", "root", "--",
                    "sleep", "60")
    try:
        def scopes() -> list[Path]:
            return [p for p in cg.glob("*.scope") if (p / "cgroup.procs").read_text().strip()]

        assert wait_for(lambda: scopes()), f"no scope under {cg}: {stderr_of(proc)}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert wait_for(lambda: not list(cg.glob("*.scope"))), "the exec's scope stayed"
    job = tmp_path / "job.sh"
    job.write_text("#!/bin/sh\nexit 3\n")
    job.chmod(0o755)
    res = sb.envctl("submit-job", "lim", "--user", "root", "--wait", str(job), timeout=120)
    assert res.returncode == 3, res.stderr
    assert wait_for(lambda: not list(cg.glob("*.scope"))), "the job's scope stayed"
    sb.envctl("down", "lim", check=True, timeout=300)
    # Job records are history and outlive `down`: the only thing left.
    assert sorted(p.name for p in sb.state.iterdir()) == ["jobs", "lock"]
    import shutil

    shutil.rmtree(sb.state)


def test_the_service_runs_restarts_and_stops_in_scopes_of_the_slice(sb):
    """The environment's service with the systemd driver: it runs in a transient scope of the
    slice (made through systemd), is started again in a new scope when it is killed, and
    `down` stops it and leaves no scope."""
    parent, unit, cg = names(sb)
    sb.write_spec("lim", 'name: lim\nkind: cpu\nrootfs: {binaries: [sh, sleep]}\n'
                         "resources:\n  driver: systemd\n  memory: {max: 64M}\n"
                         "service: {command: [sleep, '100000'], restart: always, "
                         "restart_sec: 0.2}\n")
    res = sb.envctl("up", "lim", timeout=300)
    assert res.returncode == 0, res.stderr
    state_file = sb.run_dir / "lim" / "service.json"

    def running() -> dict | None:
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            return None
        return state if state.get("state") == "running" and state.get("pid") else None

    assert wait_for(running), f"the service did not start: {state_file.read_text()}"
    first = running()
    where = cgroup_of(first["pid"])
    assert where.startswith(f"/{parent}/{unit}/") and ".scope" in where, where
    os.kill(first["pid"], 9)
    assert wait_for(lambda: (s := running()) and s["pid"] != first["pid"]), \
        f"not restarted: {state_file.read_text()}"
    second = running()
    again = cgroup_of(second["pid"])
    assert again.startswith(f"/{parent}/{unit}/") and ".scope" in again, again
    assert wait_for(lambda: not (ROOT / where.lstrip("/")).exists()), "the old scope stayed"
    sb.envctl("down", "lim", check=True, timeout=300)
    assert not Path(f"/proc/{second['pid']}").exists()  # the fixture checks the slices


def in_unit(sb, *args: str) -> subprocess.CompletedProcess:
    """envctl as the main process of a transient service (as a timer's or a oneshot's would
    run it): when it exits, systemd stops the unit and kills what is left in its cgroup."""
    env = sb.env()
    sets = [f"--setenv={k}={v}" for k, v in env.items()
            if k.startswith("ENVCTL_") or k in ("PYTHONPATH", "PATH")]
    return subprocess.run(["systemd-run", "--pipe", "--wait", "--quiet", "--collect", *sets,
                           "--", "nsenter", "-t", str(sb.pid), "-n", "-m", "--",
                           sys.executable, "-m", "envctl", *args],
                          capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_supervisors_outlive_the_unit_that_ran_envctl(sb, tmp_path):
    """The service's supervisor (started by `up`) and a job's (by `submit-job`) each move into
    a scope of their own in the environment's slice before they say they run: the transient
    unit that ran envctl ends, systemd kills what is left in it, and both go on; the job ends
    COMPLETED, not CANCELLED by that SIGTERM."""
    parent, unit, cg = names(sb)
    base = unit.removesuffix(".slice")
    sb.write_spec("lim", 'name: lim\nkind: cpu\nrootfs: {binaries: [sh, sleep]}\n'
                         "resources:\n  driver: systemd\n  memory: {max: 64M}\n"
                         "service: {command: [sleep, '100000'], restart: on-failure}\n")
    res = in_unit(sb, "up", "lim")
    assert res.returncode == 0, res.stdout + res.stderr
    state = json.loads((sb.run_dir / "lim" / "service.json").read_text())
    sup = state["supervisor"]["pid"]

    assert state["state"] == "running", state
    assert cgroup_of(sup) == f"/{parent}/{unit}/{base}-service-supervisor-{sup}.scope"
    job = tmp_path / "job.sh"
    job.write_text("#!/bin/sh\nwhile [ ! -e /job/go ]; do sleep 0.1; done\necho done\n")
    job.chmod(0o755)
    res = in_unit(sb, "submit-job", "lim", "--user", "root", "--json", str(job))
    assert res.returncode == 0, res.stdout + res.stderr
    rec = json.loads(res.stdout)
    jsup = rec["supervisor"]["pid"]
    # The unit is gone (systemd-run --wait returned): both supervisors were out of it.
    assert cgroup_of(jsup) == \
        f"/{parent}/{unit}/{base}-job{rec['id']}-supervisor-{jsup}.scope"
    assert Path(f"/proc/{sup}").exists()
    (sb.state / "jobs" / str(rec["id"]) / "go").write_text("")
    res = sb.envctl("wait", str(rec["id"]), "--json", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    done = json.loads(res.stdout)[0]
    assert (done["state"], done["exit_code"]) == ("COMPLETED", 0), done
    # Each scope goes with its process.
    assert wait_for(lambda: not (cg / f"{base}-job{rec['id']}-supervisor-{jsup}.scope").exists())
    sb.envctl("down", "lim", check=True, timeout=300)
    # (a process that has exited stays in /proc until systemd, its parent, has reaped it)
    assert wait_for(lambda: not Path(f"/proc/{sup}").exists()), "the supervisor outlived down"
    assert wait_for(lambda: not (cg / f"{base}-service-supervisor-{sup}.scope").exists())
    import shutil

    shutil.rmtree(sb.state)


def test_a_supervisor_systemd_will_not_scope_fails_its_job_and_leaves_nothing(sb, tmp_path):
    """systemd refuses the supervisor's own scope (a busctl that refuses that one call): the
    job, already started, is killed and recorded FAILED with the reason, as never started;
    its scope and processes go. The service's first start fails `up` the same way."""
    parent, unit, cg = names(sb)
    fake = tmp_path / "bin" / "busctl"
    fake.parent.mkdir()
    real = subprocess.run(["sh", "-c", "command -v busctl"], capture_output=True, text=True,
                          check=True).stdout.strip()
    fake.write_text('#!/bin/sh\ncase "$*" in *-supervisor-*) '
                    'echo "refused by the test" >&2; exit 1;; esac\n'
                    f'exec {real} "$@"\n')
    fake.chmod(0o755)
    path = {"PATH": f"{fake.parent}:{os.environ['PATH']}"}
    sb.write_spec("lim", 'name: lim\nkind: cpu\nrootfs: {binaries: [sh, sleep]}\n'
                         "resources:\n  driver: systemd\n")
    assert sb.envctl("up", "lim", timeout=300).returncode == 0
    job = tmp_path / "job.sh"
    job.write_text("#!/bin/sh\nexec sleep 1000\n")
    job.chmod(0o755)
    res = sb.envctl("submit-job", "lim", "--user", "root", "--json", str(job), env=path)
    assert res.returncode == 1, res.stdout + res.stderr
    rec = json.loads(res.stdout)
    assert rec["state"] == "FAILED" and rec["start_time"] is None, rec
    assert "refused by the test" in rec["error"] and f"slice '{unit}'" in rec["error"], rec
    assert wait_for(lambda: not list(cg.glob("*.scope"))), list(cg.glob("*.scope"))
    ps = subprocess.run(["pgrep", "-f", "^sleep 1000$"], capture_output=True, text=True)
    assert ps.stdout == "", ps.stdout
    # The service: `up` fails its step with the same reason and rolls it back.
    sb.write_spec("lim", 'name: lim\nkind: cpu\nrootfs: {binaries: [sh, sleep]}\n'
                         "resources:\n  driver: systemd\n"
                         "service: {command: [sleep, '1000']}\n")
    res = sb.envctl("up", "lim", env=path, timeout=300)
    assert res.returncode != 0 and "refused by the test" in res.stderr, res.stderr
    assert wait_for(lambda: not list(cg.glob("*.scope"))), list(cg.glob("*.scope"))
    ps = subprocess.run(["pgrep", "-f", "^sleep 1000$"], capture_output=True, text=True)
    assert ps.stdout == "", ps.stdout
    sb.envctl("down", "lim", check=True, timeout=300)
    import shutil

    shutil.rmtree(sb.state)
