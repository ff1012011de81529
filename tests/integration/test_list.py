"""`envctl list` on the real kernel: environments up in the sandbox, one that is down, one
whose spec was deleted while it is up; each row's state, address, published ports, memory
limit and job count; the state a vanished namespace and a changed spec give; nothing on the
host changes; then nothing is left behind."""

from __future__ import annotations

import json
import os
import time

import pytest

pytestmark = pytest.mark.root

NET = "network:\n  bridge: lst0\n  bridge_address: 10.210.0.1/24\n  address: 10.210.0.{n}\n"
WEB = ("name: web\nkind: cpu\ndescription: the web box\n" + NET.format(n=10)
       + "  ports: [\"18081:80\", 18082/udp]\nrootfs:\n  binaries: [sh, sleep]\n"
       "resources:\n  cpu: {{quota: 50%}}\n  memory: {{max: {mem}}}\n")
IDLE = "name: idle\nkind: cpu\n" + NET.format(n=11) + "resources:\n  memory: {max: 32M}\n"
GONE = "name: gone\nkind: cpu\ndescription: spec deleted\n" + NET.format(n=12)


def listed(sb, *args: str) -> dict[str, dict]:
    return {r["name"]: r for r in sb.envctl_json("list", *args)}


def tree(path) -> list[tuple[str, int, int]]:
    """Every file under `path` with its size and mtime: what a read-only command must keep."""
    out = []
    for d, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out.append((os.path.join(d, f), st.st_size, st.st_mtime_ns))
    return sorted(out)


def wait_running(sb, job_id: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        jobs = {j["id"]: j for j in sb.envctl_json("jobs")}
        if jobs.get(job_id, {}).get("state") == "RUNNING":
            return
        assert job_id in jobs, f"job {job_id} ended early: {sb.envctl_json('jobs', '--all')}"
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never ran: {sb.envctl_json('jobs', '--all')}")


def test_list_shows_every_environment_as_it_is(sandbox):
    sb = sandbox
    sb.write_spec("web", WEB.format(mem="64M"))
    sb.write_spec("idle", IDLE)
    gone = sb.write_spec("gone", GONE)
    try:
        sb.envctl("up", "web", "gone", check=True)
        gone.unlink()  # still up: list knows it from its journal
        prog = sb.root / "loop.sh"
        prog.write_text("#!/bin/sh\nexec sleep 600\n")
        prog.chmod(0o755)
        job = json.loads(sb.envctl("submit-job", "--json", "--user", "root", "web", str(prog),
                                   check=True).stdout)
        wait_running(sb, job["id"])

        before = tree(sb.state), tree(sb.run_dir)
        rows = listed(sb)
        assert (tree(sb.state), tree(sb.run_dir)) == before  # read-only
        assert list(rows) == ["idle", "web", "gone"]
        web, idle, gone_row = rows["web"], rows["idle"], rows["gone"]
        assert web["state"] == "up", web
        assert web["address"] == "10.210.0.10"
        assert [(p["host_port"], p["port"], p["protocol"]) for p in web["ports"]] == [
            (18081, 80, "tcp"), (18082, 18082, "udp")]
        assert web["memory"]["limit"] == 64 << 20 and web["memory"]["used"] is not None
        assert web["cpus"]["quota"] == 0.5
        assert web["jobs"] == {"running": 1, "pending": 0}
        assert web["description"] == "the web box"
        assert idle["state"] == "down" and idle["address"] == "10.210.0.11"
        assert idle["memory"] == {"used": None, "limit": 32 << 20}
        assert gone_row["state"] == "up" and gone_row["spec"] is None
        assert gone_row["description"] == "spec deleted" and gone_row["address"] == "10.210.0.12"

        # The person's view: one line each, the alias too.
        out = sb.envctl("ps", check=True).stdout.splitlines()
        assert out[0].split()[:4] == ["NAME", "STATE", "ADDRESS", "PORTS"]
        line = next(x for x in out if x.startswith("web "))
        assert "0.0.0.0:18081->80/tcp, 0.0.0.0:18082->18082/udp" in line
        assert " up " in line and "/ 64M" in line and " 1/0 " in line
        assert line.endswith("the web box")

        # `status` says the limits in the spec's units, and the same state words.
        status = {r["env"]: r for r in sb.envctl_json("status")}
        assert status["web"]["state"] == "up" and status["idle"]["state"] == "down"
        assert status["web"]["limits"].startswith("cpu 50% of one CPU (0.5 CPUs) on ")
        assert status["web"]["limits"].endswith(", memory 64M")
        assert status["gone"]["limits"].startswith("cpu no quota on ")  # from its journal
        assert "limits       cpu 50% of one CPU (0.5 CPUs)" in sb.envctl("status", "web",
                                                                       check=True).stdout

        # A changed spec is not applied yet; a namespace gone behind envctl's back degrades.
        sb.write_spec("web", WEB.format(mem="128M"))
        sb.run("ip", "netns", "del", "gone", check=True)
        rows = listed(sb)
        assert rows["web"]["state"] == "not-applied", rows["web"]
        assert "envctl plan web" in rows["web"]["reasons"][0]
        assert rows["gone"]["state"] == "degraded"
        assert rows["gone"]["reasons"] == ["network namespace gone is gone"]
        assert listed(sb, "web")["web"]["state"] == "not-applied"  # by name
        status = {r["env"]: r for r in sb.envctl_json("status")}
        assert status["web"]["state"] == "not-applied" and status["gone"]["state"] == "degraded"
        applied, _, now = status["web"]["limits"].partition(" (spec now: ")
        assert applied.startswith("cpu 0.5 CPUs on ") and applied.endswith(", memory 64M")
        assert now.startswith("cpu 50% of one CPU") and now.endswith(", memory 128M)")
        res = sb.envctl("list", "nosuch")
        assert res.returncode == 2 and "nosuch" in res.stderr
    finally:
        sb.envctl("down", "--all", "--force")
    assert all(r["state"] == "down" for r in listed(sb).values())
    residue = sb.residue()
    # Job records are history: they outlive the environment (and keep the state directory).
    assert residue.pop("state_dir", None) == ["jobs", "lock"], residue
    assert residue == {}, residue


SVC = ("name: svc\nkind: cpu\nrootfs:\n  binaries: [sh, sleep]\nservice:\n"
       "  command: [/bin/sh, -c, \"exec sleep 600\"]\n  restart: \"no\"\n")


def test_a_service_that_died_degrades_the_environment(sandbox):
    sb = sandbox
    sb.write_spec("svc", SVC)
    try:
        sb.envctl("up", "svc", check=True)
        row = listed(sb)["svc"]
        assert row["state"] == "up", row
        record = sb.run_dir / "svc" / "service.json"  # its supervisor's record
        deadline = time.monotonic() + 60
        while not (state := json.loads(record.read_text())).get("pid"):
            assert time.monotonic() < deadline, state
            time.sleep(0.05)
        os.kill(state["pid"], 9)  # the service's program, behind envctl's back (restart: no)
        deadline = time.monotonic() + 60
        while (row := listed(sb)["svc"])["state"] == "up":
            assert time.monotonic() < deadline, row
            time.sleep(0.05)
        assert row["state"] == "degraded" and row["reasons"][0].startswith("its service is "), \
            row
    finally:
        sb.envctl("down", "--all", "--force")
    assert sb.residue() == {}


def test_an_environment_up_from_before_spec_digests_is_compared_by_its_plan(sandbox):
    """`up` records a digest of the spec, which `list` compares; one brought up by an envctl
    that did not record it is compared by planning its spec (slower, as exact)."""
    from envctl.engine.journal import Journal

    sb = sandbox
    sb.write_spec("idle", IDLE)
    try:
        sb.envctl("up", "idle", check=True)
        journal = Journal.open(sb.state, "idle")
        assert "spec_digest" in journal.claims
        sb.write_spec("idle", IDLE.replace("32M", "48M"))
        assert listed(sb)["idle"]["state"] == "not-applied"
        sb.write_spec("idle", "# a comment changes nothing\n" + IDLE)
        assert listed(sb)["idle"]["state"] == "up"

        claims = {k: v for k, v in journal.claims.items() if k != "spec_digest"}
        journal.set_meta({**journal.meta, "claims": claims})
        journal.save()
        assert listed(sb)["idle"]["state"] == "up"
        sb.write_spec("idle", IDLE.replace("32M", "48M"))
        row = listed(sb)["idle"]
        assert row["state"] == "not-applied" and "(1 to change)" in row["reasons"][0], row
    finally:
        sb.envctl("down", "--all")
    assert sb.residue() == {}
