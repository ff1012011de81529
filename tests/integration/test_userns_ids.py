"""The ids a launch's user namespace maps, on the real kernel: a root job holds its
supplementary groups (here a group the rootfs's /etc/group lists root in, as a GPU node's
group is given) as unmapped host gids, so it still has their access (a root:GROUP 0640 file
on a data mount reads), while its gid_map maps 0 alone and root inside cannot chgrp a file
of its own to that host group and make it set-gid; and `--user` naming an id of the
environment's own host block is refused at request time. Each test ends with the residue
check."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.root

GROUP = 4242  # no host group: a stand-in for video, a GPU node's group

SPEC = f"""
name: ids
kind: cpu
rootfs:
  binaries: [sh, cat, id, touch, chgrp, chmod, stat]
  files:
    - {{path: /etc/group, content: "root:x:0:\\nstaff:x:{GROUP}:root\\nnogroup:x:65534:\\n"}}
mounts:
  - {{source: scratch, target: /scratch}}
resources:
  memory: {{max: 64M}}
"""


@pytest.fixture
def ids(sandbox):
    sandbox.write_spec("ids", SPEC)
    res = sandbox.envctl("up", "ids")
    assert res.returncode == 0, res.stderr
    yield sandbox
    if sandbox.proc.poll() is None:
        res = sandbox.envctl("down", "ids", "--force", "--purge")
        assert res.returncode == 0, res.stderr
        assert sandbox.residue() == {}, sandbox.residue()


def _base(sb) -> int:
    """The environment's root, on the host: the owner of its data directory."""
    return os.stat(sb.state / "data" / "ids" / "scratch").st_uid


def test_a_root_jobs_supplementary_groups_are_held_never_mapped(ids):
    sb = ids
    base = _base(sb)
    data = sb.state / "data" / "ids" / "scratch"
    (data / "group-only").write_text("for the group\n")
    os.chown(data / "group-only", 0, GROUP)
    os.chmod(data / "group-only", 0o640)
    res = sb.envctl("exec", "ids", "--user", "root", "--", "sh", "-c",
                    "cat /proc/self/gid_map; echo groups $(id -G); cat /scratch/group-only; "
                    f"touch /scratch/planted; chgrp {GROUP} /scratch/planted; "
                    "echo chgrp=$?; chmod g+s /scratch/planted")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["0", str(base), "1"], res.stdout
    assert not any(line.split()[:1] == [str(GROUP)] for line in lines[1:3]), res.stdout
    # Held, unmapped: `id` shows the overflow gid, and the group's file reads.
    assert "groups 0 65534" in res.stdout, res.stdout
    assert "for the group" in res.stdout, res.stdout
    assert "chgrp=1" in res.stdout, res.stdout + res.stderr
    st = os.stat(data / "planted")
    assert st.st_gid != GROUP, "root inside made a file of the host group"
    # A non-root job keeps its identity, groups included (mapped to themselves).
    res = sb.envctl("exec", "ids", "--user", "1000", "--", "cat", "/proc/self/gid_map")
    assert res.returncode == 0, res.stderr
    assert ["1000", "1000", "1"] in [line.split() for line in res.stdout.splitlines()]


def test_a_user_of_the_environments_own_block_is_refused_at_request_time(ids):
    """`--user BASE` (root inside's host uid) would map one host id twice: refused before
    anything runs or is recorded, for exec and submit-job alike, with what is allowed."""
    sb = ids
    base = _base(sb)
    jobs = sb.state / "jobs"
    before = sorted(os.listdir(jobs)) if jobs.is_dir() else []
    for argv in (("exec", "ids", "--user", str(base), "--", "id"),
                 ("exec", "ids", "--user", f"1000:{base + 7}", "--", "id"),
                 ("submit-job", "ids", "--user", str(base), "id")):
        res = sb.envctl(*argv)
        assert res.returncode == 2, (argv, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "is one of the host ids of environment 'ids'" in lines[0] \
            and "give --user root for root inside" in lines[0], res.stderr
        assert "Traceback" not in res.stderr
    assert (sorted(os.listdir(jobs)) if jobs.is_dir() else []) == before
    # Root inside and a user outside the block still run.
    res = sb.envctl("exec", "ids", "--user", str(base + 65536), "--", "id", "-u")
    assert res.returncode == 0 and res.stdout.strip() == str(base + 65536), res.stderr
