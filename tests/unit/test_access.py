"""Who may do what (envctl.runtime.access): admins by uid 0 and by group, submit by user and
by group, operate implies submit, a job's owner, another environment's operator, --user, and
the one-line refusals. Against this host's real user and group databases: the names used are
Debian's base-passwd ones (every Debian system has them, with these ids)."""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from envctl.errors import AccessDenied, SpecError
from envctl.runtime.access import (
    Access,
    Caller,
    Grant,
    admin_group,
    check_job,
    check_operate,
    check_run_as,
    check_submit,
    check_user_option,
    is_admin,
    load_access,
)
from envctl.runtime.jobs import Job
from envctl.spec.loader import parse_spec

REPO = Path(__file__).resolve().parents[2]

# base-passwd: daemon 1, bin 2, sys 3, nobody 65534; groups daemon 1, bin 2, sys 3, adm 4.
DAEMON, BIN, SYS, NOBODY = 1, 2, 3, 65534
ADM = 4


@pytest.fixture(autouse=True)
def _base_passwd(monkeypatch):
    for name, uid in (("daemon", DAEMON), ("bin", BIN), ("sys", SYS), ("nobody", NOBODY)):
        if pwd.getpwnam(name).pw_uid != uid:
            pytest.skip(f"this host's {name} is not uid {uid} (not Debian's base-passwd)")
    for name, gid in (("daemon", DAEMON), ("bin", BIN), ("sys", SYS), ("adm", ADM)):
        if grp.getgrnam(name).gr_gid != gid:
            pytest.skip(f"this host's group {name} is not gid {gid}")
    monkeypatch.delenv("ENVCTL_ADMIN_GROUP", raising=False)


def _access(submit_users=(), submit_groups=(), operate_users=(), operate_groups=()) -> Access:
    return Access(Grant(tuple(submit_users), tuple(submit_groups)),
                  Grant(tuple(operate_users), tuple(operate_groups)), "x.yaml")


def _denied(fn, *args) -> str:
    with pytest.raises(AccessDenied) as exc:
        fn(*args)
    assert exc.value.exit_code == 1
    text = str(exc.value)
    assert "\n" not in text
    return text


# ---------------------------------------------------------------- callers and admins


def test_a_caller_is_named_by_the_host_else_by_its_uid():
    assert Caller(DAEMON, DAEMON).name == "daemon"
    assert Caller(4_000_000_000, 1).name == "4000000000"  # no passwd entry
    me = Caller.of_process()
    assert (me.uid, me.gid, me.pid) == (os.getuid(), os.getgid(), os.getpid())


def test_root_is_an_admin_whatever_its_groups():
    assert is_admin(Caller(0, 0))
    assert is_admin(Caller(0, 12345))


def test_the_admin_group_makes_admins_by_primary_or_supplementary_gid(monkeypatch):
    assert admin_group() == "envctl"
    monkeypatch.setenv("ENVCTL_ADMIN_GROUP", "adm")
    assert admin_group() == "adm"
    assert is_admin(Caller(NOBODY, ADM))  # primary
    assert is_admin(Caller(NOBODY, NOBODY, (DAEMON, ADM)))  # supplementary
    assert not is_admin(Caller(NOBODY, NOBODY, (DAEMON,)))
    # An admin passes every check, with or without an access list.
    admin = Caller(NOBODY, NOBODY, (ADM,))
    check_submit("e", None, admin)
    check_operate("e", None, admin)
    check_user_option(admin, "root")
    check_job(Job(id=1, env="e", argv=["x"], uid=DAEMON), None, admin, "cancel")


def test_an_admin_group_the_host_lacks_makes_no_admin(monkeypatch):
    monkeypatch.setenv("ENVCTL_ADMIN_GROUP", "no-such-group-here")
    assert not is_admin(Caller(NOBODY, NOBODY, (ADM,)))
    assert is_admin(Caller(0, 0))


# ---------------------------------------------------------------- submit and operate


def test_submit_by_user_and_by_group():
    acc = _access(submit_users=["daemon"], submit_groups=["sys"])
    check_submit("cpu-compute", acc, Caller(DAEMON, DAEMON))  # by user
    check_submit("cpu-compute", acc, Caller(NOBODY, NOBODY, (SYS,)))  # by supplementary group
    check_submit("cpu-compute", acc, Caller(NOBODY, SYS))  # by primary group
    text = _denied(check_submit, "cpu-compute", acc, Caller(BIN, BIN, (ADM,)))
    assert text == ("bin is not in access.submit of cpu-compute (users: daemon; groups: sys)")


def test_a_user_is_matched_by_uid_not_by_the_name_a_client_could_choose():
    # Only the kernel's uid counts: a caller with another uid is not 'daemon'.
    acc = _access(submit_users=["daemon"])
    _denied(check_submit, "e", acc, Caller(BIN, DAEMON))
    # A group is matched by gid: being uid 'sys' is not being in group 'sys'.
    acc = _access(submit_groups=["sys"])
    _denied(check_submit, "e", acc, Caller(SYS, NOBODY))


def test_operate_implies_submit_and_the_refusal_names_both_lists():
    acc = _access(submit_users=["daemon"], operate_groups=["adm"])
    check_submit("e", acc, Caller(NOBODY, NOBODY, (ADM,)))
    check_operate("e", acc, Caller(NOBODY, NOBODY, (ADM,)))
    text = _denied(check_submit, "e", acc, Caller(BIN, BIN))
    assert text == ("bin is not in access.submit of e (users: daemon) nor access.operate "
                    "(groups: adm)")


def test_submit_does_not_imply_operate():
    acc = _access(submit_users=["daemon"], operate_groups=["adm"])
    text = _denied(check_operate, "cpu-compute", acc, Caller(DAEMON, DAEMON))
    assert text == "daemon is not in access.operate of cpu-compute (groups: adm)"
    acc = _access(submit_users=["daemon"])
    assert _denied(check_operate, "e", acc, Caller(DAEMON, DAEMON)) == (
        "daemon is not in access.operate of e (nobody)")


def test_without_an_access_list_only_admins_may():
    text = _denied(check_submit, "cpu-compute", None, Caller(DAEMON, DAEMON))
    assert text == ("daemon may not use cpu-compute: its spec has no access list, so only "
                    "envctl admins (root, group envctl) may use it")
    assert "may not operate cpu-compute" in _denied(check_operate, "cpu-compute", None,
                                                     Caller(DAEMON, DAEMON))
    check_submit("cpu-compute", None, Caller(0, 0))


def test_a_name_the_host_does_not_know_admits_nobody():
    acc = _access(submit_users=["no-such-user-here"], submit_groups=["no-such-group-here"])
    _denied(check_submit, "e", acc, Caller(4_000_000_000, 4_000_000_000))


def test_a_refused_spec_admits_no_one_but_admins_and_says_why():
    acc = Access(file="x.yaml", refused="its spec is invalid (x.yaml:3: kind: bad)")
    text = _denied(check_submit, "e", acc, Caller(DAEMON, DAEMON))
    assert text == ("daemon may not use e: its spec is invalid (x.yaml:3: kind: bad), so only "
                    "envctl admins (root, group envctl) may use it")
    check_operate("e", acc, Caller(0, 0))


# ---------------------------------------------------------------- jobs


def _job(**kw) -> Job:
    return Job(**{"id": 7, "env": "cpu-compute", "argv": ["x"], "uid": BIN, "gid": BIN, **kw})


def test_the_owner_of_a_job_is_its_submitter_else_its_user():
    acc = _access(submit_users=["daemon", "bin"], operate_groups=["adm"])
    # Submitted by daemon (through sudo or the daemon), running as bin: daemon's, not bin's.
    job = _job(submitter=[DAEMON, DAEMON])
    check_job(job, acc, Caller(DAEMON, DAEMON), "cancel")
    text = _denied(check_job, job, acc, Caller(BIN, BIN), "cancel")
    assert text == ("bin may not cancel job 7 of daemon (only its owner, access.operate of "
                    "cpu-compute (groups: adm) and envctl admins)")
    # Submitted by root for --user bin: bin's.
    check_job(_job(), acc, Caller(BIN, BIN), "read the logs of")


def test_the_owner_keeps_its_job_after_leaving_the_list():
    check_job(_job(), None, Caller(BIN, BIN), "wait for")


def test_an_operator_handles_every_job_of_its_environment_only():
    job = _job(submitter=[DAEMON, DAEMON])
    ops = _access(operate_groups=["adm"])
    check_job(job, ops, Caller(NOBODY, NOBODY, (ADM,)), "cancel")
    # The same caller, operator of another environment: this one's list does not name it.
    other = _access(operate_groups=["sys"])
    text = _denied(check_job, job, other, Caller(NOBODY, NOBODY, (ADM,)), "cancel")
    assert text.startswith("nobody may not cancel job 7 of daemon (only its owner, "
                           "access.operate of cpu-compute (groups: sys)")
    # A submitter of the environment is no operator of its jobs.
    sub = _access(submit_groups=["adm"])
    _denied(check_job, job, sub, Caller(NOBODY, NOBODY, (ADM,)), "wait for")
    # Without a list: owner and admins only.
    text = _denied(check_job, job, None, Caller(NOBODY, NOBODY), "read the logs of")
    assert "operators of cpu-compute (its spec has no access list)" in text


# ---------------------------------------------------------------- --user


def test_a_non_admin_may_name_only_itself_with_user():
    me = Caller(DAEMON, DAEMON, (ADM,))
    check_user_option(me, None)
    check_user_option(me, "daemon")
    check_user_option(me, str(DAEMON))
    check_user_option(me, "daemon:adm")  # a group the caller is in
    check_user_option(me, f"{DAEMON}:{DAEMON}")
    assert _denied(check_user_option, me, "root") == (
        "daemon may not run a job as root: --user may name only yourself unless you are one "
        "of the envctl admins (root, group envctl)")
    _denied(check_user_option, me, "0")
    _denied(check_user_option, me, "bin")
    _denied(check_user_option, me, "no-such-user-here")
    assert "with group sys" in _denied(check_user_option, me, "daemon:sys")
    _denied(check_user_option, me, "daemon:0")


def test_what_a_launch_resolved_must_be_the_caller():
    me = Caller(DAEMON, DAEMON, (ADM,))
    check_run_as(me, DAEMON, ADM)
    _denied(check_run_as, me, 0, 0)
    _denied(check_run_as, me, DAEMON, 0)
    check_run_as(Caller(0, 0), 0, 0)


# ---------------------------------------------------------------- the spec's access


SPEC = """\
name: team
kind: cpu
access:
  submit: {users: [daemon], groups: [sys]}
  operate: {groups: [adm]}
"""


def test_load_access_reads_the_named_spec(tmp_path):
    (tmp_path / "a.yaml").write_text("name: other\nkind: cpu\n")
    (tmp_path / "team.yaml").write_text(SPEC)
    acc = load_access("team", tmp_path)
    assert acc == Access(Grant(("daemon",), ("sys",)), Grant((), ("adm",)),
                         str(tmp_path / "team.yaml"))
    assert load_access("other", tmp_path) is None  # no access section
    assert load_access("missing", tmp_path) is None  # no such spec
    assert load_access("team", tmp_path / "nowhere") is None


def test_load_access_of_an_invalid_spec_admits_only_admins(tmp_path):
    (tmp_path / "team.yaml").write_text(SPEC.replace("kind: cpu", "kind: cpux"))
    acc = load_access("team", tmp_path)
    assert acc is not None and acc.refused.startswith("its spec is invalid (")
    assert not acc.submit and not acc.operate
    text = _denied(check_submit, "team", acc, Caller(DAEMON, DAEMON))
    assert "team.yaml:2" in text


@pytest.mark.skipif(os.geteuid() != 0, reason="the spec's owner is checked when root reads it")
def test_load_access_as_root_refuses_a_spec_others_may_write(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text(SPEC)
    os.chmod(tmp_path, 0o755)
    os.chmod(path, 0o666)
    acc = load_access("team", tmp_path)
    assert acc is not None and "is writable by group and others" in acc.refused
    os.chown(path, DAEMON, 0)
    os.chmod(path, 0o644)
    acc = load_access("team", tmp_path)
    assert acc is not None and "is owned by uid 1, not root" in acc.refused
    os.chown(path, 0, 0)
    assert load_access("team", tmp_path).refused == ""


def test_access_in_the_spec_names_field_and_line():
    bad = textwrap.dedent("""\
        name: demo
        kind: cpu
        access:
          submit:
            users: [alice, 1001, alice]
            groups: ["-x"]
          operate: {grups: [a]}
        """)
    with pytest.raises(SpecError) as exc:
        parse_spec(bad, "demo.yaml")
    got = sorted((p.line, p.field, p.message) for p in exc.value.problems)
    assert [(line, field) for line, field, _ in got] == [
        (5, "access.submit.users[1]"), (6, "access.submit.groups[0]"),
        (7, "access.operate.grups")]
    assert "named, not numbered" in got[0][2]
    assert "a group name is 1-32 letters" in got[1][2]
    assert "unknown field 'grups'" in got[2][2]
    with pytest.raises(SpecError) as exc:
        parse_spec(bad.replace("1001, ", "").replace('"-x"', "a").replace("grups", "groups"),
                   "demo.yaml")
    (p,) = exc.value.problems
    assert (p.line, p.field) == (5, "access.submit.users[1]")
    assert "user 'alice' is listed twice" in p.message


def test_access_accepts_posix_names():
    ls = parse_spec("name: a\nkind: cpu\naccess:\n  submit: {users: [a.b, _x, 'M$'], "
                    "groups: [team-a]}\n", "a.yaml")
    assert ls.spec.access.submit.users == ("a.b", "_x", "M$")
    assert ls.spec.access.operate.users == ()


def test_access_imports_nothing_heavy():
    code = ("import sys, envctl.runtime.access; "
            "print(sorted(m for m in ('typing', 'pydantic', 'yaml', 'dataclasses', "
            "'envctl.spec.loader', 'envctl.workspace') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


# ---------------------------------------------------------------- the host knows the names


HOST_SPEC = """\
name: team
kind: cpu
access:
  submit: {users: [daemon, envctl-no-such-user], groups: [sys]}
  operate:
    groups: [envctl-no-such-group, adm]
"""


def test_the_planner_refuses_names_the_host_lacks_at_their_place():
    from envctl.facts import HostFacts
    from envctl.plan.builder import PlanError
    from envctl.plan.planner import plan_env

    spec = parse_spec(HOST_SPEC, "team.yaml").spec
    facts = HostFacts(users={"daemon": DAEMON}, groups={"sys": SYS, "adm": ADM})
    with pytest.raises(PlanError) as exc:
        plan_env(spec, facts)
    assert [loc for loc, _ in exc.value.issues] == [
        ("access", "submit", "users", 1), ("access", "operate", "groups", 0)]
    facts = HostFacts(users={"daemon": DAEMON, "envctl-no-such-user": 5000},
                      groups={"sys": SYS, "adm": ADM, "envctl-no-such-group": 5000})
    plan_env(spec, facts)  # every name known: nothing refused (and nothing made for access)


def test_validate_host_names_unknown_users_and_groups_plain_validate_does_not(capsys, tmp_path,
                                                                             monkeypatch):
    from tests.unit.test_cli import run

    monkeypatch.setenv("ENVCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ENVCTL_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("ENVCTL_CONFIG_DIR", str(tmp_path / "specs"))
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "team.yaml").write_text(HOST_SPEC)
    code, out, _ = run(capsys, "validate", str(tmp_path / "specs"))
    assert code == 0 and out.startswith("ok: team"), out
    code, _, err = run(capsys, "validate", "--host", str(tmp_path / "specs"))
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and lines == [
        f"error: {tmp_path}/specs/team.yaml:4:28: access.submit.users[1]: no user "
        "'envctl-no-such-user' on this host (its passwd and name service): create it or "
        "remove it from the list",
        f"error: {tmp_path}/specs/team.yaml:6:14: access.operate.groups[0]: no group "
        "'envctl-no-such-group' on this host (its group database and name service): create "
        "it or remove it from the list"], err
