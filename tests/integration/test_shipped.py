"""The shipped cpu-compute partition comes up on this machine kind and goes without a trace."""

from __future__ import annotations

import grp
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.root
ENTER = Path(__file__).with_name("enter_env.py")

BAD_SPECS = [
    "name: bad\nkind: cpu\nbogus: 1\n",
    "name: cpu-compute\nkind: cpu\n",  # a duplicate name in the directory
    "name: bad\nkind: cpu\nresources:\n  cpu: {quota: 0.5%}\n",  # below the kernel's minimum
]
# Valid specs this host cannot serve: `up --all` skips them and brings up the rest.
UNFIT_SPECS = [
    "name: bad\nkind: cpu\nresources:\n  cpu: {dedicated: 0-63}\n",
    "name: bad\nkind: cpu\nhost:\n  sysctls: {vm.does_not_exist: 1}\n",
]


# cpu-compute's data directories (its relative mount sources): they survive a plain `down`.
CPU_COMPUTE_DATA = {"cpu-compute": ["data", "logs", "results"]}


def test_cpu_compute_up_status_down(shipped):
    sb = shipped
    before = sb.sysctl("net.ipv4.ip_forward")
    plan = sb.envctl_json("plan", "cpu-compute")[0]
    assert plan["resolved"]["threads"] >= 1
    sb.envctl("up", "cpu-compute", check=True)
    status = sb.envctl_json("status", "cpu-compute")[0]
    assert status["up"] and {s["status"] for s in status["steps"]} == {"ok"}
    assert "cpu-compute" in sb.netns()
    assert sb.run("ip", "netns", "exec", "cpu-compute", "true").returncode == 0
    # Its rootfs runs the listed binaries and Python under pivot_root, with its data mounts.
    enter = [sys.executable, str(ENTER), str(sb.run_dir / "mnt.d" / "cpu-compute"),
             str(sb.state / "rootfs" / "cpu-compute"), "--"]
    out = sb.run(*enter, "bash", "-c", "echo $ENVIRONMENT; ls /opt/data; sleep 0; "
                 "echo $OMP_NUM_THREADS $OPENBLAS_NUM_THREADS; cat /etc/hostname")
    assert out.returncode == 0, out.stderr
    threads = str(plan["resolved"]["threads"])
    assert out.stdout.split() == ["cpu-compute", "input", "output", threads, threads,
                                  "cpu-compute"]
    py = sb.run(*enter, "python3", "-c", "import sys, json; print(sys.version_info[0])")
    assert py.stdout == "3\n", py.stderr
    sb.envctl("down", "cpu-compute", check=True)
    assert sb.sysctl("net.ipv4.ip_forward") == before
    assert sb.residue_keeping_data(CPU_COMPUTE_DATA) == {}


@pytest.mark.parametrize("bad", BAD_SPECS)
def test_rejected_spec_exits_2_and_changes_nothing(shipped, bad):
    sb = shipped
    sb.write_spec("bad", bad)
    before = (sb.sysctl("net.ipv4.ip_forward"), sb.sysctl("vm.zone_reclaim_mode"))
    res = sb.envctl("up", "--all")
    assert res.returncode == 2, res.stderr
    assert "bad.yaml" in res.stderr and "nothing was changed" in res.stderr
    assert (sb.sysctl("net.ipv4.ip_forward"), sb.sysctl("vm.zone_reclaim_mode")) == before
    assert sb.residue() == {}
    assert not sb.state.exists()


@pytest.mark.parametrize("unfit", UNFIT_SPECS)
def test_up_all_skips_what_this_host_cannot_serve_and_brings_up_the_rest(shipped, unfit):
    sb = shipped
    sb.write_spec("bad", unfit)
    res = sb.envctl("up", "--all")
    assert res.returncode == 1, res.stderr
    assert "bad.yaml" in res.stderr and "skipped bad: this host cannot serve it" in res.stderr
    assert "skipped gpu-compute" in res.stderr  # no NVIDIA modules on this machine kind
    assert sb.netns() == ["cpu-compute"]
    status = sb.envctl_json("status", "cpu-compute")[0]
    assert status["state"] == "up"
    sb.envctl("down", "--all", check=True)
    assert sb.residue_keeping_data(CPU_COMPUTE_DATA) == {}


# ---------------------------------------------------------------- the README's main job

REPO = Path(__file__).resolve().parents[2]
DEMO_UID = 60020


def _readme_main_job() -> str:
    """The README's quick-start command line (its first sh block), continuations joined."""
    text = (REPO / "README.md").read_text()
    quick = text[text.index("## Quick start"):]
    block = re.search(r"```sh\n(.*?)```", quick, re.S).group(1)
    return block.replace("\\\n", " ")


def test_the_readme_main_job_is_a_plain_user_submitting_through_the_daemon(shipped, tmp_path):
    """The README's main job, step by step, in the sandbox: what it runs is what this test
    runs (the demo user and its group from scripts/demo-user, the submit-job arguments and
    the daemon's readiness line from the README), with the sandbox's envctl."""
    import yaml

    line = _readme_main_job()
    steps = [s.strip() for s in line.split("&&")]
    assert steps[:3] == ["./scripts/install-deps", "./scripts/demo-user",
                         ".venv/bin/envctl up cpu-compute"], steps
    daemon = re.search(r"\{ \.venv/bin/envctl daemon >(\S+) 2>&1 </dev/null & "
                       r"echo \$! >(\S+); \}", line)
    assert daemon, "the README starts the daemon in the background, its log to a file"
    ready = re.search(r"timeout \d+ sh -c 'until grep -qs \"([^\"]+)\" (\S+);", line)
    assert ready and ready.group(2) == daemon.group(1), "a bounded wait on the daemon's log"
    submit = re.search(r"job=\$\(runuser -u (\S+) -- \.venv/bin/envctl submit-job ([^)]*)\)",
                       line)
    assert submit, "a plain user submits"
    user, args = submit.group(1), submit.group(2).split()
    assert "--user" not in args and args[0] == "cpu-compute", args
    for cmd in ("wait", "logs"):
        assert f'runuser -u {user} -- .venv/bin/envctl {cmd} "$job"' in line, cmd
    # The demo user is the one scripts/demo-user makes, in a group the shipped spec admits.
    demo = (REPO / "scripts" / "demo-user").read_text()
    assert f"USER_NAME={user}\n" in demo
    group = re.search(r"--gid (\S+)", demo).group(1)
    spec = yaml.safe_load((REPO / "configs" / "cpu-compute.yaml").read_text())
    assert group in spec["access"]["submit"]["groups"]

    # That user in the sandbox's own /etc/passwd (a copy bound over it, never edited), with
    # the group's real gid; the test's Python, if under root's 0700 home, readable here.
    sb = shipped
    gid = grp.getgrnam(group).gr_gid
    shared = Path(tempfile.mkdtemp(prefix="envctl-readme-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        (shared / "passwd").write_text(Path("/etc/passwd").read_text()
                                       + f"{user}:x:{DEMO_UID}:{gid}::/nonexistent:/bin/sh\n")
        script = [f"mount --bind {shared}/passwd /etc/passwd"]
        python_home = "/root/.pyenv"
        if os.path.realpath(sys.executable).startswith(python_home + "/"):
            (shared / "pyenv").mkdir()
            script += [f"mount --bind {python_home} {shared}/pyenv",
                       "mount -t tmpfs -o mode=0755 envctl-test-root /root",
                       f"mkdir {python_home}", f"mount --bind {shared}/pyenv {python_home}"]
        res = sb.run("sh", "-c", " && ".join(script))
        assert res.returncode == 0, res.stderr
        sb.envctl("up", "cpu-compute", check=True)

        sock, log = str(shared / "envctl.sock"), shared / "daemon.log"
        env = {"ENVCTL_SOCKET": sock}
        proc = sb.popen("sh", "-c", f'exec "$0" -m envctl daemon >{log} 2>&1',
                        sys.executable, env=env)
        try:
            deadline = time.monotonic() + 30
            while ready.group(1) not in (log.read_text() if log.exists() else ""):
                assert proc.poll() is None, f"daemon died: {log.read_text()}"
                assert time.monotonic() < deadline, f"never ready: {log.read_text()}"
                time.sleep(0.05)
            as_user = ["setpriv", f"--reuid={DEMO_UID}", f"--regid={gid}", "--init-groups",
                       "--", "env", "-C", str(REPO), sys.executable, "-m", "envctl"]
            uenv = {**env, "HOME": "/nonexistent"}
            res = sb.run(*as_user, "submit-job", *args, env=uenv)
            assert res.returncode == 0, res.stderr
            job = res.stdout.strip()
            assert job.isdigit(), res.stdout
            res = sb.run(*as_user, "wait", job, env=uenv, timeout=120)
            assert res.returncode == 0 and f"{job} COMPLETED 0:0" in res.stdout, res
            res = sb.run(*as_user, "logs", job, env=uenv)
            assert res.returncode == 0 and "SHA-256 updates/s" in res.stdout, res
            assert f"uid {DEMO_UID}" in res.stdout, res.stdout  # it ran as the user, not root
            record = json.loads((sb.state / "jobs" / f"{job}.json").read_text())
            assert (record["uid"], record["gid"]) == (DEMO_UID, gid)
        finally:
            proc.terminate()
            proc.wait(30)
        sb.envctl("down", "cpu-compute", check=True)
        # Nothing left but the data directories and the job's record, which is history.
        left = sb.residue()
        assert left.pop("state_dir") == ["data", "jobs", "lock"] and left == {}, left
    finally:
        sb.close()  # its mounts go with its namespace, before the tree they show is removed
        shutil.rmtree(shared, ignore_errors=True)
