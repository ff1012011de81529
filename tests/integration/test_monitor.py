"""`envctl monitor` on the real kernel, in the sandbox: an environment with a service is up;
`monitor --once` writes its CSV rows and its metrics (textfile, stdout); after its service's
supervisor is killed one monitor tick brings it back and logs the events `status` shows; the
/metrics endpoint answers on the sandbox's loopback; `down` leaves only the events log (history,
like job records) and the lock file."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from envctl.monitor.prom import parse_exposition
from tests.fakes import FakeGpu, make_tree, nvml_json
from tests.integration.sandbox import REPO
from tests.integration.test_service import service_state

pytestmark = pytest.mark.root

FAKES = REPO / "tests" / "fakes" / "pynvml"
SPEC = """
name: box
kind: cpu
resources:
  memory: {{max: 256M}}
rootfs:
  binaries: [sh, sleep]
mounts:
  - {{source: {data}, target: /data, create: false}}
service:
  command: ["/bin/sh", "-c", "echo run >> /data/runs; exec sleep 100000"]
  restart: on-failure
"""
UUIDS = ["GPU-11111111-aaaa-bbbb-cccc-000000000000", "GPU-22222222-aaaa-bbbb-cccc-000000000001"]


def alive(identity: dict) -> bool:
    try:
        stat = Path(f"/proc/{identity['pid']}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[0] not in ("Z", "X") and fields[19] == str(identity["start"])


def wait_until(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def box(sandbox, tmp_path):
    """The sandbox with `box` up (its service running) and a fake two-GPU driver tree for the
    monitor's NVML (tests/fakes/pynvml); `down --force` afterwards if a test left it up."""
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)  # the service is root of its user namespace; create: false keeps this
    sandbox.write_spec("box", SPEC.format(data=data))
    res = sandbox.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    gpus = [FakeGpu(u, f"0000:{0x3b + i:02x}:00.0", i) for i, u in enumerate(UUIDS)]
    root = make_tree(tmp_path / "gpu", gpus, nodes=True)
    sandbox.gpu_env = {"ENVCTL_GPU_ROOT": str(root),
                       "FAKE_NVML_JSON": str(nvml_json(tmp_path / "nvml.json", gpus)),
                       "PYTHONPATH": f"{FAKES}:{REPO / 'src'}"}
    sandbox.data = data
    yield sandbox
    left = service_state(sandbox)
    if sandbox.proc.poll() is None and sandbox.journals():
        sandbox.envctl("down", "box", "--force")
    if left and alive(left["supervisor"]):
        os.kill(left["supervisor"]["pid"], signal.SIGKILL)


def monitor_once(sb, tmp_path, *args: str) -> dict:
    res = sb.envctl("monitor", "--once", "--csv-dir", str(tmp_path / "csv"), "--textfile",
                    str(tmp_path / "tf" / "envctl.prom"), *args, env=sb.gpu_env)
    assert res.returncode == 0, res.stderr
    return parse_exposition(res.stdout)


def by_env(samples) -> dict[str, float]:
    return {labels["envctl_environment"]: value for labels, value in samples}


def test_network_bytes_of_its_veth_and_a_spec_that_is_not_up(sandbox, tmp_path):
    """Bytes sent to an environment through its bridge show as received on its veth (the
    monitor reads /sys/class/net of its own netns: a sysfs mounted there); a spec in the
    config directory that is not up shows up=0, configured=1."""
    sb = sandbox
    sb.write_spec("net", "name: net\nkind: cpu\n"
                  "network: {address: 10.231.0.2, bridge_address: 10.231.0.1/24}\n")
    sb.write_spec("later", "name: later\nkind: cpu\n")
    res = sb.envctl("up", "net")
    assert res.returncode == 0, res.stderr
    try:
        send = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                "for _ in range(100): s.sendto(b'x' * 1000, ('10.231.0.2', 9))")
        sb.run(sys.executable, "-c", send, check=True)
        sysfs = tmp_path / "sys"
        sysfs.mkdir()
        # --propagation unchanged: /run/netns stays the shared mount `up` made (the health
        # check would call a private one drift); the sysfs mount is undone before it exits.
        res = sb.run("unshare", "-m", "--propagation", "unchanged", "sh", "-c",
                     'mount -t sysfs sysfs "$1" || exit 1; d=$1; shift; "$@"; rc=$?; '
                     'umount "$d"; exit $rc', "sh", str(sysfs),
                     sys.executable, "-m", "envctl", "monitor", "--once", "--no-heal",
                     env={"ENVCTL_SYS_ROOT": str(sysfs)})
        assert res.returncode == 0, res.stderr
        m = parse_exposition(res.stdout)
        got = {(x["envctl_environment"], x["direction"]): v
               for x, v in m["envctl_environment_network_bytes_total"]}
        assert got[("net", "receive")] >= 100 * 1000, got  # UDP payloads, plus headers
        assert by_env(m["envctl_environment_configured"]) == {"net": 1, "later": 1}
        assert by_env(m["envctl_environment_up"]) == {"net": 1, "later": 0}, res.stderr
    finally:
        res = sb.envctl("down", "net")
        assert res.returncode == 0, res.stderr


def test_once_writes_csv_and_metrics_of_the_environment(box, tmp_path):
    sb = box
    m = monitor_once(sb, tmp_path, "--no-heal")
    assert by_env(m["envctl_environment_up"]) == {"box": 1}
    assert by_env(m["envctl_service_up"]) == {"box": 1}
    assert by_env(m["envctl_environment_configured"]) == {"box": 1}  # its spec is there
    assert by_env(m["envctl_environment_memory_limit_bytes"]) == {"box": 256 << 20}
    usage = by_env(m["envctl_environment_memory_usage_bytes"])["box"]
    assert 0 < usage < 256 << 20
    assert by_env(m["envctl_environment_tasks"])["box"] >= 2  # the service's init and sleep
    assert by_env(m["envctl_environment_cpu_usage_seconds_total"])["box"] > 0
    # The real kernel's v1 files: IO bytes (blkio), OOM kills (memory.oom_control), the CFS
    # period (cpu.cfs_period_us); no PSI on v1.
    io = {x["direction"]: v for x, v in m["envctl_environment_io_bytes_total"]
          if x["envctl_environment"] == "box"}
    assert io.keys() == {"read", "write"} and min(io.values()) >= 0
    events = {(x["envctl_environment"], x["event"]): v
              for x, v in m["envctl_environment_memory_events_total"]}
    assert events == {("box", "oom_kill"): 0}
    assert by_env(m["envctl_environment_cpu_period_seconds"])["box"] > 0
    assert "envctl_environment_pressure_stalled_seconds_total" not in m
    (labels, _), = [x for x in m["envctl_environment_memory_usage_bytes"]]
    assert labels["id"] == f"/{sb.cgroup_parent}/box"
    # The fake GPUs, through NVML (opened once, in the monitor).
    assert sorted(x["UUID"] for x, _ in m["envctl_gpu_memory_free_bytes"]) == UUIDS
    assert not [n for n in m if n.startswith(("DCGM_", "container_"))]  # no --compat
    # --compat adds dcgm-exporter's and cAdvisor's names (a run without CSV: rows above).
    compat = monitor_once(sb, tmp_path, "--no-heal", "--compat", "dcgm,cadvisor", "--csv-dir",
                          "none")
    assert sorted(x["UUID"] for x, _ in compat["DCGM_FI_DEV_FB_FREE"]) == UUIDS
    assert {x["environment"]: v for x, v in compat["container_spec_memory_limit_bytes"]} == {
        "box": 256 << 20}
    # The textfile says the same as stdout did.
    text = (tmp_path / "tf" / "envctl.prom").read_text()
    assert by_env(parse_exposition(text)["envctl_service_up"]) == {"box": 1}
    assert os.listdir(tmp_path / "tf") == ["envctl.prom"]
    cpu = (tmp_path / "csv" / "cpu-metrics.csv").read_text().splitlines()
    assert cpu[0] == "Timestamp,Type,CPU_Utilization,Memory_Utilization,Environment"
    (row,) = [r.split(",") for r in cpu[1:] if r.endswith(",box")]
    assert row[1] == "environment" and row[2] and 0 < float(row[3]) < 100
    gpu = (tmp_path / "csv" / "gpu-metrics.csv").read_text().splitlines()
    assert gpu[0] == "Timestamp,Type,Utilization,Memory,Temperature,Environment"
    assert [r.split(",")[1] for r in gpu[1:]] == ["GPU0", "GPU1"]
    assert not (sb.state / "events.jsonl").exists()  # healthy: nothing to say


def test_one_tick_heals_a_dead_service_and_logs_it(box, tmp_path):
    sb = box
    before = service_state(sb)
    # An edit since `up` is the operator's to apply: the heal restores what was applied.
    sb.write_spec("box", SPEC.format(data=sb.data).replace("echo run", "echo edited"))
    os.kill(before["supervisor"]["pid"], signal.SIGKILL)  # the service dies with it
    assert wait_until(lambda: not alive(before["supervisor"]))
    (env,) = sb.envctl_json("status", "box")
    assert env["state"] == "degraded"
    m = monitor_once(sb, tmp_path, "--heal")  # --once alone is a probe: it heals nothing
    after = service_state(sb)
    assert after["state"] == "running" and alive(after["supervisor"])
    assert after["supervisor"] != before["supervisor"]
    assert wait_until(lambda: (sb.data / "runs").read_text().count("run") == 2)
    assert "edited" not in (sb.data / "runs").read_text()
    assert after["command"] == before["command"]
    assert {(x["envctl_environment"], x["result"]): v for x, v in m["envctl_heals_total"]} == {
        ("box", "ok"): 1, ("box", "failed"): 0}
    assert by_env(m["envctl_service_up"]) == {"box": 1}
    lines = [json.loads(x) for x in (sb.state / "events.jsonl").read_text().splitlines()]
    assert [(x["env"], x["event"]) for x in lines] == [("box", "drift"), ("box", "healed")]
    assert "service box" in lines[0]["detail"] and "service box" in lines[1]["detail"]
    (env,) = sb.envctl_json("status", "box")
    # Everything applied is there again; the edit is still the operator's to apply.
    assert env["state"] == "not-applied" and all(s["op"] == "=" for s in env["steps"])
    assert [e["event"] for e in env["events"]] == ["drift", "healed"]
    res = sb.envctl("status", "box")
    assert "monitor events:" in res.stdout and " healed: " in res.stdout
    # A `down` killed half-way (the service gone, the cgroup and older steps not yet) is not
    # drift to heal back, even when something it had yet to remove goes missing meanwhile.
    res = sb.envctl("down", "box", env={"ENVCTL_FAULT": "kill@remove:cgroup*"})
    assert res.returncode != 0, res.stderr
    gone = [p for p in sb.cgroups() if p.endswith("/box")]  # empty now: the service is gone
    assert gone
    for path in gone:
        os.rmdir(path)
    res = sb.envctl("monitor", "--once", "--heal", env=sb.gpu_env)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in (sb.state / "events.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines[-2:]] == ["drift", "heal-skipped"], lines[-2:]
    assert "did not finish" in lines[-1]["detail"]
    assert not any(os.path.exists(p) for p in gone)  # not made again
    assert service_state(sb) is None or service_state(sb)["state"] != "running"
    # Down leaves the history (the events log) and the lock file, nothing else.
    assert sb.envctl("down", "box").returncode == 0
    residue = sb.residue()
    assert residue.pop("state_dir", None) == ["events.jsonl", "lock"], residue
    assert residue == {}, residue


def test_once_alone_is_a_probe_that_changes_nothing(box, tmp_path):
    """`monitor --once` samples and prints: an environment whose service died stays as it is
    (no heal, no event), and no CSV is appended anywhere, the default directory included."""
    sb = box
    before = service_state(sb)
    os.kill(before["supervisor"]["pid"], signal.SIGKILL)
    assert wait_until(lambda: not alive(before["supervisor"]))
    csv = [Path("/var/log/envctl") / f for f in ("cpu-metrics.csv", "gpu-metrics.csv")]
    seen = [(p.stat().st_size, p.stat().st_mtime_ns) if p.exists() else None for p in csv]
    res = sb.envctl("monitor", "--once", env=sb.gpu_env)
    assert res.returncode == 0, res.stderr
    assert by_env(parse_exposition(res.stdout)["envctl_service_up"]) == {"box": 0}
    assert [(p.stat().st_size, p.stat().st_mtime_ns) if p.exists() else None
            for p in csv] == seen
    assert not (sb.state / "events.jsonl").exists()
    (env,) = sb.envctl_json("status", "box")
    assert env["state"] == "degraded"
    assert not alive(before["supervisor"])


def test_metrics_endpoint_on_loopback_and_sigterm_ends_it(box, tmp_path):
    sb = box
    proc = sb.popen(sys.executable, "-m", "envctl", "monitor", "--interval", "1", "--listen",
                    "127.0.0.1:9464", "--csv-dir", "none", "--no-heal", env=sb.gpu_env)
    fetch = ("import urllib.request as u; print(u.urlopen('http://127.0.0.1:9464/metrics', "
             "timeout=5).read().decode())")
    got = {}

    def answered() -> bool:
        res = sb.run(sys.executable, "-c", fetch)
        if res.returncode == 0 and "envctl_service_up{" in res.stdout:
            got["text"] = res.stdout
            return True
        assert proc.poll() is None, proc.stderr.read()
        return False

    try:
        assert wait_until(answered, 60)
        m = parse_exposition(got["text"])
        assert by_env(m["envctl_service_up"]) == {"box": 1}
        assert m["envctl_monitor_ticks_total"][0][1] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "serving metrics on http://127.0.0.1:9464/metrics" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Nothing answers any more, and --no-heal wrote no events.
    assert sb.run(sys.executable, "-c", fetch).returncode != 0
    assert not (sb.state / "events.jsonl").exists()
    assert sb.envctl("down", "box").returncode == 0
    residue = sb.residue()
    assert residue.pop("state_dir", None) in (None, ["lock"]), residue
    assert residue == {}, residue


PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("open")
except OSError as exc:
    print(type(exc).__name__)
"""


NET_SPEC = """\
name: netbox
kind: cpu
network:
  bridge: t-br0
  bridge_address: 10.231.0.1/24
  address: 10.231.0.2
  ports: [9090]
"""


def test_a_partition_reaches_the_metrics_port_only_when_bound_beyond_loopback(sandbox):
    """The choice docs/monitoring.md states: envctl's firewall filters nothing addressed to
    the host itself, so /metrics stays on loopback by default, which an environment cannot
    reach (its gateway address has no listener; loopback packets arriving on the bridge are
    dropped: test_network), and an address beyond loopback is reached by every environment
    through its gateway: the monitor warns when started so."""
    sb = sandbox
    sb.write_spec("netbox", NET_SPEC)
    res = sb.envctl("up", "netbox")
    assert res.returncode == 0, res.stderr
    gateway = "10.231.0.1"

    def probe(ns: str | None, addr: str, port: int) -> str:
        argv = ["ip", "netns", "exec", ns] if ns else []
        res = sb.run(*argv, sys.executable, "-c", PROBE, addr, str(port))
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    try:
        for listen, port, want in (("127.0.0.1", 9464, "ConnectionRefusedError"),
                                   ("0.0.0.0", 9465, "open")):
            proc = sb.popen(sys.executable, "-m", "envctl", "monitor", "--interval", "5",
                            "--listen", f"{listen}:{port}", "--csv-dir", "none", "--no-heal")
            try:
                line = proc.stderr.readline()
                assert "serving metrics on" in line, line + proc.stderr.read()
                warned = proc.stderr.readline() if listen != "127.0.0.1" else ""
                assert wait_until(lambda p=port: probe(None, "127.0.0.1", p) == "open")
                assert probe("netbox", gateway, port) == want
                if listen != "127.0.0.1":
                    assert "every environment reaches it through its gateway" in warned
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0, proc.stderr.read()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        assert sb.envctl("down", "netbox").returncode == 0


def test_healing_respects_restart_no_and_maintenance(box, tmp_path):
    """A `restart: no` service that ended stays ended through monitor ticks (status still says
    it is missing; `up` is the operator's way to start it); `envctl maintenance box on` stops
    the heal of a killed supervisor (status shows it), `off` lets the next tick heal it."""
    sb = box
    once = SPEC.format(data=sb.data).replace("exec sleep 100000", "exit 3").replace(
        "restart: on-failure", 'restart: "no"')
    sb.write_spec("box", once)
    assert sb.envctl("up", "box").returncode == 0
    assert wait_until(lambda: (service_state(sb) or {}).get("state") == "failed")
    assert wait_until(lambda: not alive(service_state(sb)["supervisor"]))
    for _ in range(2):
        res = sb.envctl("monitor", "--once", "--heal", env=sb.gpu_env)
        assert res.returncode == 0, res.stderr
    assert service_state(sb)["state"] == "failed"
    assert (sb.data / "runs").read_text().count("run") == 2  # the first up's and this one's
    assert not (sb.state / "events.jsonl").exists()  # no drift, no heal
    (env,) = sb.envctl_json("status", "box")
    assert env["state"] == "degraded"  # status still says so: the operator decides
    # Back to a service that runs; maintenance pauses the heal of its killed supervisor.
    sb.write_spec("box", SPEC.format(data=sb.data))
    assert sb.envctl("up", "box").returncode == 0
    assert wait_until(lambda: (service_state(sb) or {}).get("state") == "running")
    res = sb.envctl("maintenance", "box", "on")
    assert res.returncode == 0 and "maintenance on" in res.stdout, res.stderr
    before = service_state(sb)
    os.kill(before["supervisor"]["pid"], signal.SIGKILL)
    assert wait_until(lambda: not alive(before["supervisor"]))
    res = sb.envctl("monitor", "--once", "--heal", env=sb.gpu_env)
    assert res.returncode == 0, res.stderr
    assert "heal-paused" in res.stderr
    assert not alive(service_state(sb)["supervisor"])  # not healed
    (env,) = sb.envctl_json("status", "box")
    assert env["maintenance"]["since"] > 0 and env["state"] == "degraded"
    assert "maintenance: on since" in sb.envctl("status", "box").stdout
    assert sb.envctl("maintenance", "box", "off").returncode == 0
    res = sb.envctl("monitor", "--once", "--heal", env=sb.gpu_env)
    assert res.returncode == 0, res.stderr
    assert service_state(sb)["state"] == "running" and alive(service_state(sb)["supervisor"])
    # Refusals: an unknown environment, a mode that is neither on nor off (exit 2).
    assert sb.envctl("maintenance", "nothere", "on").returncode == 2
    assert sb.envctl("maintenance", "box", "maybe").returncode == 2
    assert sb.envctl("down", "box").returncode == 0
    residue = sb.residue()
    assert residue.pop("state_dir", None) == ["events.jsonl", "lock"], residue
    assert residue == {}, residue


def test_maintenance_gpus_lets_the_running_monitor_release_nvml(box, tmp_path):
    """`envctl maintenance --gpus on` with a monitor running (the fake NVML, two GPUs): the
    monitor shuts NVML down, `on` returns once it has (nvml-held.d/PID gone), /metrics says
    paused and has no GPU series, status says so; `off` and the next tick sample the GPUs
    again. SIGTERM leaves no nvml-held.d; down leaves what it always does."""
    sb = box
    held_dir = sb.run_dir / "nvml-held.d"
    held = held_dir / str(os.getpid())  # replaced below by the monitor's pid
    proc = sb.popen(sys.executable, "-m", "envctl", "monitor", "--interval", "1", "--listen",
                    "127.0.0.1:9465", "--csv-dir", "none", "--no-heal", env=sb.gpu_env)
    fetch = ("import urllib.request as u; print(u.urlopen('http://127.0.0.1:9465/metrics', "
             "timeout=5).read().decode())")

    def metrics() -> dict:
        res = sb.run(sys.executable, "-c", fetch)
        assert proc.poll() is None, proc.stderr.read()
        return parse_exposition(res.stdout) if res.returncode == 0 else {}

    def gpus_sampled() -> bool:
        m = metrics()
        return bool(m.get("envctl_gpu_memory_free_bytes")) and m[
            "envctl_monitor_gpu_sampling_paused"][0][1] == 0

    try:
        assert wait_until(gpus_sampled, 60)
        held = held_dir / str(proc.pid)
        assert json.loads(held.read_text())["pid"] == proc.pid
        res = sb.envctl("maintenance", "--gpus", "on")
        assert res.returncode == 0, res.stdout + res.stderr
        assert "no envctl process holds NVML" in res.stdout and not held.exists()
        assert wait_until(lambda: metrics().get("envctl_monitor_gpu_sampling_paused",
                                                [(0, 0)])[0][1] == 1, 30)
        assert "envctl_gpu_memory_free_bytes" not in metrics()
        assert not held.exists()  # ticks while paused open nothing
        assert "GPU sampling paused" in sb.envctl("status").stdout
        assert sb.envctl("maintenance", "--gpus", "maybe").returncode == 2
        assert sb.envctl("maintenance", "--gpus", "on", "box").returncode == 2
        res = sb.envctl("maintenance", "--gpus", "off")
        assert res.returncode == 0 and "resumed" in res.stdout, res.stderr
        assert wait_until(gpus_sampled, 30)
        assert json.loads(held.read_text())["pid"] == proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "GPU sampling paused" in err and "GPU sampling resumed" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not held_dir.exists()
    assert sb.envctl("down", "box").returncode == 0
    residue = sb.residue()
    assert residue.pop("state_dir", None) in (None, ["lock"]), residue
    assert residue == {}, residue
