"""Run INSIDE the VM that tests/vm/test_vm_boot.py boots (systemd PID 1, cgroup v2, booted to
multi-user.target with envctl's units installed by `envctl install-units` before systemd
started): what the boot did, then the units' lifecycle. Two boots, one class each:

TestFirstBoot: `web` (netns, address, limits, a service) came up and `broken` (a kernel module
this kernel lacks) was skipped; envctl.service is active (`up` exited 1: SuccessExitStatus) and
its status names `broken`; the service's supervisor outlived `up` in a scope of its own
(nothing left in envctl.service's cgroup); the monitor serves /metrics on loopback and reads
web's slice (cpu.max quota, throttling counters, PSI); `install-units` from a checkout's venv a
user owns is refused and changes nothing; the service's process killed -> the monitor brings it
back; envctl-retry.service retries `broken` with backoff; `systemctl reload` with a job running
in `web` keeps the job and the service; `systemctl stop` with the job running refuses (`down`
exits 3: the unit failed, everything up), and after a cancel and a start, `systemctl stop
envctl` with `broken` still broken -> nothing left, and start -> web up again; `broken` fixed ->
the retry brings it up by itself, and a reload succeeds; `systemctl stop envctl` -> nothing
left; `systemctl start` -> converged again; the state is copied to /out/state for the second
boot, which follows a power loss (`poweroff -f`: nothing stopped).

TestSecondBoot: with the first boot's state (journals of another boot), boot converges again:
both up, the unit active, status clean; web's service killed -> the monitor brings it back (its
supervisor, forked by the monitor, in a scope of its own). Everything is left up, with a job
running in web, and the boot ends with a clean `systemctl poweroff`:
envctl-shutdown-probe.service, ordered before envctl.service and the monitor, so stopped after
both at shutdown, runs this file's `shutdown_probe` as its ExecStop= and writes what envctl
left (residue(), `envctl status --json`, envctl.service's stop result and journal, the job
records: that job cancelled by the shutdown) to /out/shutdown.json for tests/vm/test_vm_boot.py
to check on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from envctl.monitor.prom import parse_exposition
from envctl.spec.naming import host_veth

ENVCTL = os.environ.get("ENVCTL_VM_ENVCTL", "envctl")
CONFIG = Path("/etc/envctl/environments")
STATE = Path("/var/lib/envctl")
RUN = Path("/run/envctl")
METRICS = "http://127.0.0.1:9464/metrics"
BRIDGE = "envctl-vmbr"
CG = Path("/sys/fs/cgroup")
UNIT_FILES = Path("/etc/systemd/system")

WEB = """\
name: web
kind: cpu
network:
  bridge: envctl-vmbr
  bridge_address: 10.77.0.1/24
  address: 10.77.0.2
  nat: false
rootfs:
  binaries: [sh, sleep]
resources:
  cpu: {quota: 50%}
  memory: {max: 64M}
  pids: {max: 64}
service:
  command: [/bin/sh, -c, "exec sleep infinity"]
  restart: "no"
"""
# `restart: no`: the service's supervisor does not bring it back itself, so only the monitor
# can. A module this kernel does not have: `up --all` skips `broken` and brings `web` up.
BROKEN = """\
name: broken
kind: cpu
resources:
  pids: {max: 32}
host:
  modules: [envctl_vm_no_such_module]
"""
FIXED = "name: broken\nkind: cpu\nresources:\n  pids: {max: 32}\n"
# The monitor ticks every 2 s instead of 30 (a drop-in, as an operator customises the unit).
DROPIN = "[Service]\nExecStart=\nExecStart={envctl} monitor --listen 127.0.0.1:9464 --interval 2\n"


# Stopped after envctl.service and the monitor at shutdown (Before=: stop order is the reverse
# of start order), while /out and the checkout are still mounted (RequiresMountsFor=): its
# ExecStop= records what the shutdown's `envctl down --all` left.
SHUTDOWN_PROBE = """\
[Unit]
Description=envctl VM test: what envctl left at shutdown
Before=envctl.service envctl-monitor.service envctl-daemon.service
RequiresMountsFor=/out {repo}
[Service]
Type=oneshot
RemainAfterExit=yes
Environment=ENVCTL_VM_ENVCTL={envctl}
ExecStart=/bin/true
ExecStop={python} {repo}/tests/vm/guest_boot.py shutdown-probe /out/shutdown.json
TimeoutStopSec=10min
[Install]
WantedBy=multi-user.target
"""


def preboot_script(envctl: str, *, state_from: str = "", shutdown_probe: bool = False) -> str:
    """What runs chrooted into the VM's root before systemd starts (harness.run_systemd_boot):
    specs, units, the monitor's drop-in, (second boot) the first boot's state, and
    (`shutdown_probe`) envctl-shutdown-probe.service."""
    restore = (f"mkdir -p {STATE} && cp -a {state_from}/. {STATE}/\n" if state_from else "")
    if shutdown_probe:
        repo = Path(__file__).resolve().parents[2]
        unit = SHUTDOWN_PROBE.format(repo=repo, envctl=envctl, python=sys.executable)
        restore += (f"cat > {UNIT_FILES}/envctl-shutdown-probe.service <<'END'\n{unit}END\n"
                    f"mkdir -p {UNIT_FILES}/multi-user.target.wants\n"
                    f"ln -sf ../envctl-shutdown-probe.service "
                    f"{UNIT_FILES}/multi-user.target.wants/\n")
    return (f"set -ex\nmkdir -p {CONFIG}\n"
            f"cat > {CONFIG}/web.yaml <<'END'\n{WEB}END\n"
            f"cat > {CONFIG}/broken.yaml <<'END'\n{BROKEN if not state_from else FIXED}END\n"
            f"{restore}"
            f"{envctl} install-units\n"
            f"mkdir -p {UNIT_FILES}/envctl-monitor.service.d\n"
            f"cat > {UNIT_FILES}/envctl-monitor.service.d/10-test.conf <<'END'\n"
            f"{DROPIN.format(envctl=envctl)}END\n")


# ---------------------------------------------------------------- helpers


def run(*argv: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check:
        assert res.returncode == 0, f"{argv}: {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


def show(unit: str, *keys: str) -> dict[str, str]:
    out = run("systemctl", "show", "-p", ",".join(keys), "--", unit).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_for(done, what: str, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while True:
        got = done()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def status(env: str) -> dict:
    rows = json.loads(run(ENVCTL, "status", env, "--json").stdout)
    assert len(rows) == 1, rows
    return rows[0]


def service_state(env: str) -> dict | None:
    try:
        return json.loads((RUN / env / "service.json").read_text())
    except (OSError, ValueError):
        return None


def running(env: str) -> dict | None:
    st = service_state(env)
    if st and st.get("state") == "running" and st.get("pid") and \
            Path(f"/proc/{st['pid']}").exists():
        return st
    return None


def cgroup_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text().strip().split("::", 1)[1]


def metrics() -> str:
    try:
        with urllib.request.urlopen(METRICS, timeout=10) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def assert_up(env: str) -> None:
    st = status(env)
    bad = [s for s in st["steps"] if s["status"] != "ok"]
    assert not bad, bad


def assert_web_up() -> None:
    assert Path("/run/netns/web").exists()
    addrs = run("ip", "-n", "web", "-4", "-o", "addr", "show").stdout
    assert "10.77.0.2/24" in addrs, addrs
    # The systemd driver (systemd is PID 1): the environment's slice, limits written by systemd.
    cg = CG / "envctl.slice" / "envctl-web.slice"
    assert (cg / "cpu.max").read_text().split() == ["50000", "100000"]
    assert (cg / "memory.max").read_text().strip() == str(64 << 20)
    assert (cg / "pids.max").read_text().strip() == "64"
    st = wait_for(lambda: running("web"), "web's service to run")
    # The service's command runs inside the environment's slice and network namespace.
    assert cgroup_of(st["pid"]).startswith("/envctl.slice/envctl-web.slice/"), cgroup_of(
        st["pid"])
    assert os.stat(f"/proc/{st['pid']}/ns/net").st_ino == os.stat("/run/netns/web").st_ino
    assert_up("web")


def residue() -> dict[str, list[str]]:
    """What envctl made that is still here: none after `systemctl stop envctl`."""
    links = run("ip", "-o", "link", "show").stdout
    units = run("systemctl", "list-units", "--all", "--plain", "--no-legend",
                "envctl*.slice").stdout.split("\n")
    tables = run("nft", "list", "tables", check=False).stdout
    found = {
        "netns": sorted(p.name for p in Path("/run/netns").glob("*"))
        if Path("/run/netns").is_dir() else [],
        "links": [ln for ln in links.splitlines() if BRIDGE in ln or host_veth("web") in ln],
        "slices": sorted(ln.split()[0] for ln in units if ln.strip()),
        "slice_cgroups": sorted(str(p) for p in CG.glob("envctl*")),
        "nft": [t for t in tables.splitlines() if "envctl" in t],
        "journals": sorted(p.name for p in (STATE / "journal").glob("*"))
        if (STATE / "journal").is_dir() else [],
        "unit_procs": [f"{u}: {(CG / 'system.slice' / u / 'cgroup.procs').read_text()}"
                       for u in ("envctl.service", "envctl-monitor.service",
                                 "envctl-retry.service")
                       if (CG / "system.slice" / u / "cgroup.procs").exists()
                       and (CG / "system.slice" / u / "cgroup.procs").read_text().strip()],
    }
    return {k: v for k, v in found.items() if v}


def envctl_processes() -> list[str]:
    """Processes in a cgroup of envctl's (its slices, its two units), but this one."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cgroup = (proc / "cgroup").read_text().strip()
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "envctl" in cgroup and "envctl-shutdown-probe" not in cgroup:
            found.append(f"{proc.name} {cgroup} {cmd}")
    return found


def kill_service_and_wait_for_the_monitor() -> None:
    old = running("web")
    # Its supervisor lost first (the OOM killer, a bug), then the service: nothing but the
    # monitor brings it back. (A service that ended by itself under restart: no stays ended:
    # the supervisor marks that end and the monitor respects it, docs/monitoring.md.)
    os.kill(old["supervisor"]["pid"], signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(old["pid"], signal.SIGKILL)
    new = wait_for(lambda: (st := running("web")) and st["pid"] != old["pid"] and st,
                   "the monitor to restart web's service")
    # The new supervisor, forked by the monitor, moved out of the monitor's cgroup into a
    # scope of its own (a restart of the monitor cannot take it).
    assert_supervisor_scoped(new["supervisor"]["pid"])
    assert_up("web")


def assert_supervisor_scoped(sup: int) -> None:
    """The service's supervisor is in its own scope of web's slice, not in the unit whose
    envctl forked it (envctl.service's `up`, the monitor's heal)."""
    assert cgroup_of(sup) == \
        f"/envctl.slice/envctl-web.slice/envctl-web-service-supervisor-{sup}.scope"


def journal(unit: str) -> str:
    return run("journalctl", "-b", "-u", unit, "--no-pager", "-o", "cat", check=False).stdout


def job(job_id: int) -> dict:
    return json.loads((STATE / "jobs" / f"{job_id}.json").read_text())


def stop_and_check_residue() -> None:
    run("systemctl", "stop", "envctl.service", timeout=600)
    assert show("envctl-monitor.service", "ActiveState")["ActiveState"] == "inactive"
    assert show("envctl.service", "ActiveState")["ActiveState"] == "inactive"
    assert residue() == {}


# ---------------------------------------------------------------- the first boot


class TestFirstBoot:
    def test_the_broken_environment_is_left_out_and_named(self):
        # (the runner is ordered after envctl.service: its start job has finished)
        # Exit 1 (SuccessExitStatus=1): active, so that stop and shutdown take web down.
        props = show("envctl.service", "ActiveState", "Result", "ExecMainStatus")
        assert props == {"ActiveState": "active", "Result": "success",
                         "ExecMainStatus": "1"}, props
        journal = run("journalctl", "-b", "-u", "envctl.service", "--no-pager", "-o", "cat",
                      check=False).stdout
        assert "skipped broken: this host cannot serve it" in journal, journal
        assert "envctl_vm_no_such_module" in journal, journal
        # (`up` prints the skip before its step list: with systemctl's default 10 lines it
        # has scrolled out of `systemctl status` by then)
        st = run("systemctl", "status", "--no-pager", "-n", "100", "-l", "envctl.service",
                 check=False).stdout
        assert "not up: broken (skipped)" in st and "skipped broken" in st, st
        assert not Path("/run/netns/broken").exists()

    def test_the_good_environment_is_up(self):
        assert_web_up()
        # Its supervisor was forked by `up` and outlived it although `up` exited 1: it moved
        # into a scope of its own, and nothing is left in envctl.service's cgroup.
        assert_supervisor_scoped(running("web")["supervisor"]["pid"])
        procs = CG / "system.slice" / "envctl.service" / "cgroup.procs"
        assert not procs.exists() or procs.read_text().strip() == "", procs.read_text()

    def test_the_monitor_serves_metrics_on_loopback(self):
        assert show("envctl-monitor.service", "ActiveState")["ActiveState"] == "active"
        # Up, not only configured: envctl_environment_configured names web when it is down too.
        def web_up() -> bool:
            rows = parse_exposition(metrics()).get("envctl_environment_up", [])
            return any(labels.get("envctl_environment") == "web" and v == 1
                       for labels, v in rows)

        wait_for(web_up, "the monitor's /metrics with web up")

    def test_the_monitor_reads_the_slices_quota_and_pressure(self):
        # The systemd driver's cgroup (web's slice, limits written by systemd): cpu.max as
        # the spec says (50% of the 100 ms period), PSI of every resource (cgroup v2).
        text = wait_for(lambda: (m := metrics()) and 'envctl_environment="web"' in m and m,
                        "the monitor's /metrics with web")
        m = {name: [(labels, v) for labels, v in rows
                    if labels.get("envctl_environment") == "web"]
             for name, rows in parse_exposition(text).items()}
        assert [v for _, v in m["envctl_environment_cpu_quota_seconds"]] == [0.05], m
        assert [v for _, v in m["envctl_environment_cpu_period_seconds"]] == [0.1], m
        stalls = {(x["resource"], x["kind"])
                  for x, _ in m["envctl_environment_pressure_stalled_seconds_total"]}
        assert {("cpu", "some"), ("memory", "some"), ("io", "some")} <= stalls, stalls
        # The throttling counters of cpu.stat (a sleeping service: any values, but there).
        for name in ("periods", "throttled_periods", "throttled_seconds"):
            assert len(m[f"envctl_environment_cpu_{name}_total"]) == 1, m

    def test_install_units_refuses_a_venv_a_user_owns(self):
        # A checkout's venv owned by a user, envctl installed in it (editable, as
        # `pip install -e` does: a .pth naming the checkout, beside the deps'
        # site-packages): its install-units would make the user's code root's at every
        # boot. Refused, exit 1, one line, before anything is written: the installed units
        # and their record stay byte for byte, and enabled.
        home = Path("/home/envctl-vm-user")
        venv = home / "checkout" / ".venv"
        run(sys.executable, "-m", "venv", "--without-pip", str(venv))
        site = next((venv / "lib").glob("python3*/site-packages"))
        paths = [str(Path(__file__).resolve().parents[2] / "src"),
                 *(p for p in sys.path if p.endswith("site-packages"))]
        (site / "envctl-vm.pth").write_text("\n".join(paths) + "\n")
        script = venv / "bin" / "envctl"
        script.write_text(f"#!{venv}/bin/python\nimport sys\nfrom envctl.entry import main\n"
                          "sys.exit(main())\n")
        script.chmod(0o755)
        run("chown", "-R", "1000:1000", str(home))
        installed = sorted(UNIT_FILES.glob("envctl*.service"))
        before = {p: p.read_bytes() for p in [*installed, STATE / "units.json"]}
        assert len(installed) >= 4, installed
        res = run(str(script), "install-units", check=False)
        assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
        assert res.stderr.startswith(f"error: install units: {script} is owned by uid 1000, "
                                     "not root: the units run"), res.stderr
        assert res.stderr.count("\n") == 1 and res.stdout == "", res.stderr
        assert {p: p.read_bytes() for p in before} == before
        assert sorted(UNIT_FILES.glob("envctl*.service")) == installed
        assert run("systemctl", "is-enabled", "envctl.service").stdout.strip() == "enabled"
        shutil.rmtree(home)

    def test_a_killed_service_is_brought_back_by_the_monitor(self):
        kill_service_and_wait_for_the_monitor()

    def test_the_retry_unit_retries_broken_with_backoff(self):
        # envctl.service's Wants= started it once `up --all` was done; broken still fails.
        assert show("envctl-retry.service", "ActiveState")["ActiveState"] == "active"
        wait_for(lambda: "retrying broken in 4 s" in journal("envctl-retry.service"),
                 "the retry's third wait (1 s, 2 s, then 4 s)")

    def test_reload_with_a_job_running_stops_nothing(self):
        sub = json.loads(run(ENVCTL, "submit-job", "--json", "--user", "root", "web",
                             "sleep", "1000").stdout)
        TestFirstBoot.job_id = sub["id"]
        wait_for(lambda: job(sub["id"])["state"] == "RUNNING", "the job to run")
        before, service = job(sub["id"])["supervisor"], running("web")["pid"]
        # broken is still broken: `up --all` exits 1, which SuccessExitStatus=1 counts as
        # success for ExecReload= too; the unit stays active with everything as it was.
        run("systemctl", "reload", "envctl.service", timeout=600)
        assert show("envctl.service", "ActiveState")["ActiveState"] == "active"
        assert "not up: broken (skipped)" in journal("envctl.service")
        now = job(sub["id"])
        assert now["state"] == "RUNNING" and now["supervisor"] == before, now
        assert running("web")["pid"] == service
        assert_web_up()

    def test_stop_with_a_job_running_refuses_and_keeps_everything(self):
        jid = TestFirstBoot.job_id
        # ExecStop='s `down` refuses (exit 3, errors.Busy: not in SuccessExitStatus=1): the
        # unit ends failed (Result exit-code; `systemctl stop` exits 0 all the same, as
        # systemd does for a failed ExecStop=), its monitor and retry stopped (PartOf=), and
        # nothing was taken down (KillMode=process: the supervisors are not its processes).
        # The refusal is in the journal.
        run("systemctl", "stop", "envctl.service", timeout=600)
        props = show("envctl.service", "ActiveState", "Result")
        assert props == {"ActiveState": "failed", "Result": "exit-code"}, props
        assert show("envctl-monitor.service", "ActiveState")["ActiveState"] == "inactive"
        assert show("envctl-retry.service", "ActiveState")["ActiveState"] == "inactive"
        assert f"down web: 1 job(s) still running ({jid})" in journal("envctl.service")
        assert job(jid)["state"] == "RUNNING"
        assert_web_up()
        final = json.loads(run(ENVCTL, "cancel", "--json", str(jid)).stdout)
        assert final[0]["state"] == "CANCELLED" and final[0]["reason"] is None, final
        run("systemctl", "start", "envctl.service", timeout=600)
        assert show("envctl.service", "ActiveState")["ActiveState"] == "active"
        # Wants= starts the monitor beside it; Type=notify: active at READY=1, its first tick.
        wait_for(lambda: show("envctl-monitor.service", "ActiveState")["ActiveState"]
                 == "active", "the monitor to be ready")

    def test_stop_with_one_broken_leaves_nothing_and_start_brings_web_back(self):
        stop_and_check_residue()
        run("systemctl", "start", "envctl.service", "envctl-monitor.service", timeout=600)
        assert show("envctl.service", "ActiveState")["ActiveState"] == "active"
        assert_web_up()
        assert not Path("/run/netns/broken").exists()

    def test_fixed_after_boot_it_comes_up_by_itself_within_the_retry_window(self):
        (CONFIG / "broken.yaml").write_text(FIXED)  # nobody runs anything after this
        wait_for(lambda: show("envctl-retry.service", "ActiveState", "Result") == {
            "ActiveState": "inactive", "Result": "success"}, "the retry to end", timeout=180)
        assert "every environment is up" in journal("envctl-retry.service")
        assert_up("broken")
        assert_web_up()
        # Now a reload has nothing left to bring up: it succeeds, and stops nothing.
        service = running("web")["pid"]
        run("systemctl", "reload", "envctl.service", timeout=600)
        assert running("web")["pid"] == service

    def test_stop_leaves_nothing_behind(self):
        stop_and_check_residue()

    def test_start_converges_again(self):
        run("systemctl", "start", "envctl.service", "envctl-monitor.service", timeout=600)
        assert show("envctl.service", "Result")["Result"] == "success"
        assert_web_up()
        assert_up("broken")
        # For the second boot: the state as a disk would keep it through a power loss.
        out = Path("/out/state")
        shutil.rmtree(out, ignore_errors=True)
        run("sync")
        shutil.copytree(STATE, out, symlinks=True,
                        ignore=shutil.ignore_patterns("lock"))


# ---------------------------------------------------------------- the second boot


class TestSecondBoot:
    def test_boot_converges_with_the_last_boots_state(self):
        props = show("envctl.service", "ActiveState", "Result")
        assert props == {"ActiveState": "active", "Result": "success"}, props
        assert_web_up()
        assert_up("broken")
        journal = run("journalctl", "-b", "-u", "envctl.service", "--no-pager", "-o", "cat",
                      check=False).stdout
        assert "error" not in journal.lower(), journal

    def test_a_killed_service_is_brought_back_by_the_monitor(self):
        kill_service_and_wait_for_the_monitor()

    def test_a_job_is_left_running_into_the_poweroff(self):
        # At the clean poweroff, envctl.service's ExecStop= (`down --all`, no --force) finds
        # it running while `systemctl is-system-running` says "stopping": it is cancelled,
        # recorded CANCELLED with the reason "host shutdown", and web goes down all the same
        # (systemd may SIGTERM its supervisor's scope first: the supervisor records the same
        # reason). The probe copies the record out (checked in tests/vm/test_vm_boot.py).
        sub = json.loads(run(ENVCTL, "submit-job", "--json", "--user", "root", "web",
                             "sleep", "1000").stdout)
        wait_for(lambda: job(sub["id"])["state"] == "RUNNING", "the job to run")
        Path("/out/shutdown_job").write_text(f"{sub['id']}\n")

    def test_everything_is_left_up_for_the_clean_poweroff(self):
        # The runner powers off cleanly after this file: the probe records what the
        # shutdown's ExecStop= left (checked in tests/vm/test_vm_boot.py).
        assert show("envctl-shutdown-probe.service", "ActiveState")["ActiveState"] == "active"
        assert show("envctl.service", "ActiveState")["ActiveState"] == "active"
        assert show("envctl-monitor.service", "ActiveState")["ActiveState"] == "active"
        assert_web_up()
        assert_up("broken")
        # From here on the monitor logs nothing: systemd's teardown of the slices at the
        # shutdown is not drift (tests/vm/test_vm_boot.py reads the events after this time).
        Path("/out/left_up_at").write_text(f"{time.time()}\n")


def shutdown_probe(target: Path) -> None:
    """ExecStop= of envctl-shutdown-probe.service: runs at shutdown once envctl.service and
    the monitor have stopped. Writes the record atomically: a file there means the probe ran
    to its end."""
    probes = {
        "envctl_service": lambda: show("envctl.service", "ActiveState", "Result",
                                       "ExecMainStatus"),
        "monitor": lambda: show("envctl-monitor.service", "ActiveState")["ActiveState"],
        "residue": residue,
        "status": lambda: json.loads(run(ENVCTL, "status", "--json").stdout),
        "journal": lambda: run("journalctl", "-b", "-u", "envctl.service", "--no-pager",
                               "-o", "cat", check=False).stdout,
        "processes": envctl_processes,
        "jobs": lambda: {p.stem: {k: v for k, v in json.loads(p.read_text()).items()
                                  if k in ("state", "reason", "exit_code", "signal")}
                         for p in sorted((STATE / "jobs").glob("*.json"))},
    }
    record = {}
    for key, probe in probes.items():
        try:
            record[key] = probe()
        except Exception as exc:  # recorded for the host side's message, not lost
            record[key] = f"probe failed: {exc!r}"
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, target)


@pytest.fixture(autouse=True)
def _root():
    if os.geteuid() != 0 or not Path("/run/systemd/system").is_dir():
        pytest.skip("runs inside the boot VM (tests/vm/test_vm_boot.py)")


if __name__ == "__main__" and sys.argv[1:2] == ["shutdown-probe"]:
    shutdown_probe(Path(sys.argv[2]))
