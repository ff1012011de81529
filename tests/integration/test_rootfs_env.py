"""An environment with a root filesystem and data mounts, end to end through the CLI: the
assembled tree runs real binaries (bash, Python, an OpenMP program, one found through an
$ORIGIN RUNPATH) under a mount namespace + pivot_root, re-`up` copies nothing, drift is
reported and repaired, and `down` leaves no mount, file or namespace behind."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

ENTER = Path(__file__).with_name("enter_env.py")

OMP = r"""
#include <omp.h>
#include <stdio.h>
int main(void) {
    int n = 0;
    #pragma omp parallel reduction(+:n)
    n += 1;
    printf("omp %d\n", n);
    return 0;
}
"""
LIB = r"""
const char *greeting(void) { return "hello from $ORIGIN"; }
"""
MAIN = r"""
#include <stdio.h>
const char *greeting(void);
int main(void) { puts(greeting()); return 0; }
"""


@pytest.fixture(scope="module")
def programs():
    """An OpenMP program and one that finds its library through RUNPATH $ORIGIN/../lib (not
    under /tmp, which every environment mounts over)."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc (scripts/install-deps installs it)")
    d = Path(tempfile.mkdtemp(prefix="envctl-test-progs-", dir="/var/tmp"))
    try:
        yield _build(d)
    finally:
        shutil.rmtree(d)


def _build(d: Path) -> dict[str, str]:
    (d / "omp.c").write_text(OMP)
    (d / "lib.c").write_text(LIB)
    (d / "main.c").write_text(MAIN)
    app = d / "app"
    (app / "bin").mkdir(parents=True)
    (app / "lib").mkdir()

    def cc(*args: str) -> None:
        res = subprocess.run(["gcc", *args], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr

    cc("-fopenmp", "-o", str(d / "omp"), str(d / "omp.c"))
    cc("-shared", "-fPIC", "-o", str(app / "lib" / "libhello.so"), str(d / "lib.c"))
    cc("-o", str(app / "bin" / "hello"), str(d / "main.c"), f"-L{app / 'lib'}", "-lhello",
       "-Wl,-rpath,$ORIGIN/../lib", "-Wl,--enable-new-dtags")
    return {"omp": str(d / "omp"), "hello": str(app / "bin" / "hello")}


def spec(programs: dict[str, str], *, binaries: str | None = None) -> str:
    bins = binaries or f"[bash, sh, ls, cat, env, python3, {programs['omp']}, " \
                       f"{programs['hello']}]"
    return f"""
name: box
kind: cpu
rootfs:
  binaries: {bins}
  python: true
  env: {{ENVIRONMENT: box}}
  thread_env: [OMP_NUM_THREADS]
mounts:
  - {{source: logs, target: /var/log}}
  - {{source: data, target: /opt/data/input, read_only: true}}
"""


def inside(sb, *argv: str) -> subprocess.CompletedProcess:
    holder = sb.run_dir / "mnt.d" / "box"
    root = sb.state / "rootfs" / "box"
    return sb.run(sys.executable, str(ENTER), str(holder), str(root), "--", *argv)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """path -> (inode, mtime_ns) of every file in the tree, symlinks not followed."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in files + dirs:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_ino, st.st_mtime_ns)
    return out


def test_rootfs_runs_its_binaries_under_pivot_root_and_down_leaves_nothing(sandbox, programs):
    sb = sandbox
    sb.write_spec("box", spec(programs))
    host_mounts = sb.mounts_under("/")
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    # The host's mount table gained only the namespace's holder (and its private directory).
    added = [m for m in sb.mounts_under("/") if m not in host_mounts]
    assert sorted(added) == sorted([str(sb.run_dir / "mnt.d"), str(sb.run_dir / "mnt.d" / "box")])

    out = inside(sb, "bash", "-c", "echo $ENVIRONMENT $OMP_NUM_THREADS; ls /; cat /etc/hostname")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0] == f"box {len(os.sched_getaffinity(0))}"
    assert {"bin", "etc", "usr", "dev", "proc", "tmp"} <= set(out.stdout.split())
    assert "box" in lines[-2]
    py = inside(sb, "python3", "-c", "import json, ssl, sqlite3, ctypes, os; "
                "print(json.dumps(sorted(os.listdir('/dev'))))")
    assert py.returncode == 0, py.stderr
    assert sorted(eval(py.stdout)) == sorted(["null", "zero", "full", "random", "urandom", "tty",
                                              "ptmx", "pts", "shm", "fd", "stdin", "stdout",
                                              "stderr"])
    omp = inside(sb, programs["omp"])
    assert omp.returncode == 0 and omp.stdout.startswith("omp "), omp.stderr
    hello = inside(sb, programs["hello"])
    assert hello.returncode == 0 and hello.stdout == "hello from $ORIGIN\n", hello.stderr

    # The tree is read-only; /var/log is the data directory, /opt/data/input read-only.
    ro = inside(sb, "bash", "-c", "echo x > /usr/x")
    assert ro.returncode != 0 and "Read-only file system" in ro.stderr
    ro = inside(sb, "bash", "-c", "echo x > /opt/data/input/x")
    assert ro.returncode != 0 and "Read-only file system" in ro.stderr
    rw = inside(sb, "bash", "-c", "echo kept > /var/log/job.log && echo t > /tmp/t")
    assert rw.returncode == 0, rw.stderr
    logs = sb.state / "data" / "box" / "logs"
    assert (logs / "job.log").read_text() == "kept\n"

    res = sb.envctl("down", "box")
    assert res.returncode == 0, res.stderr
    # The data directory survives `down` (and nothing else does) ...
    assert (logs / "job.log").read_text() == "kept\n"
    residue = sb.residue()
    assert residue.pop("state_dir", None) == ["data", "lock"], residue
    assert residue == {}
    assert not (sb.state / "rootfs").exists()
    # ... until --purge: bring it up and down again with --purge ...
    assert sb.envctl("up", "box").returncode == 0
    res = sb.envctl("down", "box", "--purge")
    assert res.returncode == 0, res.stderr
    assert sb.residue() == {}
    # ... or, once it is down, `down --purge` of it as it is (not up).
    assert sb.envctl("up", "box").returncode == 0
    assert sb.envctl("down", "box").returncode == 0
    assert (sb.state / "data" / "box" / "logs").is_dir()
    res = sb.envctl("down", "box", "--purge")
    assert res.returncode == 0 and "data directories deleted" in res.stdout, res.stdout
    assert sb.residue() == {}
    # ... and `down --force --purge` the same, its spec gone too (nothing found by name).
    assert sb.envctl("up", "box").returncode == 0
    assert sb.envctl("down", "box").returncode == 0
    (sb.config_dir / "box.yaml").unlink()
    res = sb.envctl("down", "box", "--force", "--purge")
    assert res.returncode == 0, res.stderr
    assert sb.residue() == {}


def test_re_up_copies_nothing_and_drift_is_reported_then_repaired(sandbox, programs):
    sb = sandbox
    sb.write_spec("box", spec(programs))
    assert sb.envctl("up", "box").returncode == 0
    root = sb.state / "rootfs" / "box"
    before = tree(root)
    res = sb.envctl_json("up", "box")
    assert [s["op"] for s in res[0]["steps"] if s["op"] != "="] == []
    assert tree(root) == before, "an unchanged rootfs was written again"

    bash = root / "usr" / "bin" / "bash"
    if not bash.exists():
        bash = next(p for p in (root / "usr" / "bin").iterdir() if p.name == "bash")
    # Tampering: the file is replaced (the tree is read-only only inside the environment).
    bash.unlink()
    bash.write_bytes(b"#!/bin/sh\necho tampered\n")
    status = sb.envctl_json("status", "box")
    drifted = [s for s in status[0]["steps"] if s["op"] != "="]
    assert [s["kind"] for s in drifted] == ["rootfs"], drifted
    assert "/usr/bin/bash" in " ".join(str(v) for s in drifted for v in s.values())
    assert sb.envctl("up", "box").returncode == 0
    out = inside(sb, "bash", "-c", "echo repaired")
    assert out.stdout == "repaired\n", out.stderr

    # A binary that leaves the spec leaves the tree at the next `up`.
    sb.write_spec("box", spec(programs, binaries="[bash, sh, python3]"))
    assert sb.envctl("up", "box").returncode == 0
    assert not (root / "usr" / "bin" / "ls").exists()
    assert inside(sb, "ls").returncode == 127
    assert sb.envctl("down", "box", "--purge").returncode == 0
    assert sb.residue() == {}


SMALL = """
name: box
kind: cpu
rootfs:
  binaries: [sh, cat]
  python: true
mounts:
  - {source: logs, target: /var/log}
  - {source: /SRC, target: /opt/in, read_only: true}
"""


@pytest.mark.parametrize("point", ["apply", "after"])
def test_kill_9_at_every_step_of_a_rootfs_up_then_down_leaves_nothing(sandbox, tmp_path, point):
    sb = sandbox
    src = tmp_path / "src"
    sb.write_spec("box", SMALL.replace("/SRC", str(src)))
    plan = sb.envctl_json("plan", "box")
    keys = [s["key"] for s in plan[0]["steps"]]
    assert any(k.startswith("rootfs:") for k in keys) and any(k.startswith("mount:") for k in keys)
    logs = keys.index("dir:state:data/box/logs")
    shared = next(j for j, k in enumerate(keys) if k.startswith("shared-dir:host:"))
    for i, key in enumerate(keys):
        res = sb.envctl("up", "box", env={"ENVCTL_FAULT": f"kill@{point}:#{i}"})
        assert res.returncode == -9, (key, res.stderr)
        res = sb.envctl("down", "box")
        assert res.returncode == 0, (key, res.stderr)
        # The data directories the killed `up` made (both empty) survive `down`, as data
        # directories do; nothing else does. Removed here, as an operator would, for the
        # next round to start from a clean host.
        made_logs, made_src = (j < i or (j == i and point == "after") for j in (logs, shared))
        # So does the record that envctl made the shared host directory (host-dirs.json),
        # which is what lets a later `down --purge` delete it.
        residue = sb.residue()
        kept = (["data"] if made_logs else []) + (["host-dirs.json"] if made_src else [])
        assert residue.pop("state_dir", None) == (sorted([*kept, "lock"]) if kept else None), key
        assert residue == {}, key
        if made_logs:
            assert (sb.state / "data" / "box" / "logs").is_dir(), key
        if kept:
            shutil.rmtree(sb.state)
        assert src.is_dir() == made_src, key
        if made_src:
            src.rmdir()


def test_a_binary_under_a_directory_the_environment_mounts_over_is_a_plan_error(sandbox):
    sb = sandbox
    prog = sb.root / "prog"
    shutil.copy("/usr/bin/true", prog)
    sb.write_spec("box", f"name: box\nkind: cpu\nrootfs: {{binaries: [{prog}]}}\n")
    res = sb.envctl("up", "box")
    assert res.returncode == 2 and f"{prog} would be placed under /tmp" in res.stderr, \
        res.stderr
    assert sb.residue() == {}


def test_a_symlink_a_job_plants_in_a_data_directory_is_never_followed(sandbox):
    """Data directories are writable inside: a job replaces the source of a nested data
    mount with a symlink to a host directory. `up` must neither chmod that directory nor
    bind it into the environment."""
    sb = sandbox
    victim = sb.root / "victim"
    victim.mkdir(mode=0o700)
    os.chmod(victim, 0o700)
    (victim / "secret").write_text("host secret\n")
    sb.write_spec("box", "name: box\nkind: cpu\nrootfs: {binaries: [sh, cat, mv, ln]}\nmounts:\n"
                  "  - {source: models, target: /models}\n"
                  "  - {source: models/cache, target: /cache}\n")
    assert sb.envctl("up", "box").returncode == 0
    out = inside(sb, "sh", "-c", f"mv /models/cache /models/old && ln -s {victim} /models/cache")
    assert out.returncode == 0, out.stderr
    res = sb.envctl("up", "box")
    assert res.returncode == 1, res.stderr
    assert "symlink" in res.stderr
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o700
    assert inside(sb, "cat", "/cache/secret").returncode != 0
    assert sb.envctl("down", "box", "--purge").returncode == 0
    assert victim.is_dir() and (victim / "secret").read_text() == "host secret\n"
    assert sb.residue() == {}


def test_a_data_source_a_job_deleted_is_made_again_and_bound_again(sandbox):
    sb = sandbox
    sb.write_spec("box", "name: box\nkind: cpu\nrootfs: {binaries: [sh, cat, rmdir]}\nmounts:\n"
                  "  - {source: models, target: /models}\n"
                  "  - {source: models/cache, target: /cache}\n")
    assert sb.envctl("up", "box").returncode == 0
    out = inside(sb, "rmdir", "/models/cache")
    assert out.returncode == 0, out.stderr
    status = sb.envctl_json("status", "box")[0]
    assert status["state"] != "up" or any(s["op"] != "=" for s in status["steps"])
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    out = inside(sb, "sh", "-c", "echo new > /cache/f && cat /models/cache/f")
    assert out.stdout == "new\n", out.stderr
    assert sb.envctl("down", "box", "--purge").returncode == 0
    assert sb.residue() == {}


def test_purging_one_environment_keeps_a_host_directory_another_still_mounts(sandbox):
    sb = sandbox
    src = sb.root / "shared-src"
    for name in ("aa", "bb"):
        sb.write_spec(name, f"name: {name}\nkind: cpu\nrootfs: {{binaries: [sh]}}\nmounts:\n"
                            f"  - {{source: {src}, target: /data}}\n")
    assert sb.envctl("up", "aa", "bb").returncode == 0
    (src / "result").write_text("bb's\n")
    res = sb.envctl("down", "aa", "--purge")
    assert res.returncode == 0, res.stderr
    assert (src / "result").read_text() == "bb's\n"
    res = sb.envctl("down", "bb", "--purge")
    assert res.returncode == 0, res.stderr
    assert not src.exists()  # envctl made it; the last one to go purged it
    assert sb.residue() == {}
