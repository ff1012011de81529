"""The runtime's entry path without root: what it reads of an environment's journal, users,
the job's environment, argument parsing of `envctl exec`, launch checks, error mapping, the
cgroup directories of a launch, and that `exec` starts without the spec, the planner, pydantic
or YAML. (The launch itself, on the real kernel: tests/integration/test_exec.py.)"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envctl.errors import StateCorrupt, UsageError
from envctl.host.context import Host
from envctl.runtime import context as rc
from envctl.runtime import launch as rl
from envctl.runtime.exec import parse_args

REPO = Path(__file__).resolve().parents[2]
BOOT = "boot-now"


def entry(kind: str, key: str, boot: str = BOOT, **fields) -> dict:
    return {"key": key, "resource": {"kind": kind, **fields}, "memo": {}, "status": "applied",
            "boot": boot}


def write_journal(state: Path, env: str, entries: list[dict], *, meta: dict | None = None,
                  log: list[dict] | None = None) -> None:
    d = state / "journal"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{env}.json").write_text(json.dumps({"version": 1, "env": env, "entries": entries,
                                               "meta": meta or {}, "log": 1}))
    if log:
        (d / f"{env}.1.log").write_text("".join(json.dumps(r) + "\n" for r in log))


def box_entries(root: Path, *, cpus: str = "1-2", boot: str = BOOT) -> list[dict]:
    return [
        entry("rootfs", "rootfs:box", boot="old", env="box", root=str(root)),
        entry("mntns", "mntns:box", boot=boot, env="box"),
        entry("netns", "netns:box", boot=boot, name="box"),
        entry("cgroup", "cgroup:box", boot=boot, env="box", version=1, parent="p",
              controllers=["cpu", "cpuset", "memory"],
              settings=[["cpuset", "cpuset.cpus", cpus], ["cpuset", "cpuset.mems", "0"]]),
        entry("env-dev", "env-dev:box", boot=boot, env="box", root=str(root),
              nodes=[["nvidia0", 195, 0, 0o660, 44], ["nvidiactl", 195, 255, 0o660, 44],
                     ["nvidia-uvm", "nvidia-uvm", 0, 0o660, 44]]),
    ]


@pytest.fixture
def rootfs(tmp_path) -> Path:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "environment").write_text("PATH=/usr/bin:/bin\nFOO=a=b c\n\nENVIRONMENT=box\n")
    (root / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
        "alice:x:1500:1500::/home/alice:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\ntty:x:5:alice\nnogroup:x:65534:\n"
                                        "alice:x:1500:\nvideo:x:44:bob,alice\n")
    return root


def ctx_of(root: Path, **kw) -> rc.EnvContext:
    base = {"env": "box", "root": root, "mntns": Path("/nonexistent"), "netns": None,
            "hostname": "box", "environ": {"PATH": "/bin"}, "cpus": (0, 1, 2, 3)}
    return rc.EnvContext(**{**base, **kw})


# ---------------------------------------------------------------- the journal


def test_read_journal_replays_the_log_and_drops_other_boots(tmp_path, rootfs):
    state = tmp_path / "state"
    entries = box_entries(rootfs)
    write_journal(state, "box", entries[:2], meta={"claims": {"gpus": {"uuids": ["GPU-1"]}}},
                  log=[{"put": entries[2]}, {"put": entries[3]}, {"drop": "netns:box"},
                       {"put": entry("netns", "netns:box", name="other")},
                       {"meta": {"claims": {"gpus": {"uuids": ["GPU-2"]}}}}])
    found, claims = rc.read_journal(state, "box", BOOT)
    assert found["netns"]["name"] == "other"
    assert found["rootfs"]["root"] == str(rootfs)  # on disk: kept from another boot
    assert claims == {"gpus": {"uuids": ["GPU-2"]}}
    # Another boot: the namespaces are gone, the environment is not up.
    found, _ = rc.read_journal(state, "box", "boot-later")
    assert set(found) == {"rootfs"}  # mntns, netns, cgroup and env-dev went with the boot


def test_read_journal_sees_what_the_engines_journal_holds(tmp_path, rootfs):
    """The runtime's reader against journals the engine wrote: folded, with a log after the
    fold, with a torn last line; damage before a good record is StateCorrupt for both."""
    from envctl.engine.journal import Entry, Journal
    from envctl.resources.cgroup import Cgroup
    from envctl.resources.mounts import MountNamespace
    from envctl.resources.netns import NetNamespace
    from envctl.resources.rootfs import RootfsTree

    state = tmp_path / "state"

    def put(j: Journal, res, boot: str = BOOT) -> None:
        j.put(Entry(f"{res.kind}:{res.ident()}", res.to_dict(), {}, "applied",
                    boot=boot))

    def same() -> None:
        engine = Journal.open(state, "box", boot=BOOT)
        want: dict[str, dict] = {}
        for e in engine.entries:
            want.setdefault(e.resource["kind"], e.resource)
        found, claims = rc.read_journal(state, "box", BOOT)
        assert found == want and claims == engine.claims

    j = Journal.open(state, "box", boot=BOOT)
    put(j, RootfsTree("box", str(rootfs)), boot="old")
    put(j, MountNamespace("box"))
    put(j, NetNamespace("box"), boot="old")  # another boot's: dropped by both
    j.set_meta({"claims": {"gpus": {"uuids": ["GPU-1"]}}})
    j.save()
    same()
    # After the fold: a log of changes the file does not hold yet.
    j = Journal.open(state, "box", boot=BOOT)
    put(j, NetNamespace("other"))
    put(j, Cgroup("box", 1, ("cpu", "cpuset"), (("cpuset", "cpuset.cpus", "0-1"),), "p"))
    j.drop("mntns:box")
    put(j, MountNamespace("box"))
    j.set_meta({"claims": {}})
    same()
    logs = sorted((state / "journal").glob("box.*.log"))
    assert len(logs) == 1
    with logs[0].open("ab") as f:
        f.write(b'{"put": {"key": "torn')  # a crash while appending
    same()
    with logs[0].open("ab") as f:
        f.write(b'\n{"drop": "netns:box"}\n')  # ... and a good record after the damage
    with pytest.raises(StateCorrupt, match="damaged and records follow"):
        Journal.open(state, "box", boot=BOOT)
    with pytest.raises(StateCorrupt, match="damaged and records follow"):
        rc.read_journal(state, "box", BOOT)


def test_load_reads_what_a_launch_needs(tmp_path, rootfs, monkeypatch):
    state, run = tmp_path / "state", tmp_path / "run"
    write_journal(state, "box", box_entries(rootfs),
                  meta={"claims": {"gpus": {"uuids": ["GPU-a", "GPU-b"]},
                                   "gpu_cpus": {"GPU-a": [0, 1]}}})
    host = Host(state_dir=state, run_dir=run, netns_dir=tmp_path / "netns")
    host.__dict__["boot_id"] = BOOT
    # Everything but the holder, which only the kernel makes: a plain file holds nothing.
    (run / "mnt.d").mkdir(parents=True)
    (run / "mnt.d" / "box").touch()
    with pytest.raises(rc.HostError, match="holds no mount namespace; `envctl up box`"):
        rc.EnvContext.load(host, "box")
    monkeypatch.setattr(rc, "_check_holder", lambda env, path: None)
    ctx = rc.EnvContext.load(host, "box")
    assert ctx.root == rootfs and ctx.mntns == run / "mnt.d" / "box"
    assert ctx.netns == tmp_path / "netns" / "box" and ctx.hostname == "box"
    assert ctx.environ == {"PATH": "/usr/bin:/bin", "FOO": "a=b c", "ENVIRONMENT": "box"}
    assert ctx.cgroup == rc.EnvCgroup("cgroupfs", "p", 1, ("cpu", "cpuset", "memory"))
    assert ctx.cpus == (1, 2) and ctx.gpus == ("GPU-a", "GPU-b") and ctx.device_gids == (44,)
    assert ctx.gpu_cpus == {"GPU-a": (0, 1)}  # where its GPUs sit: jobs' CPUs near them


def test_load_refuses_what_is_not_up_or_has_no_rootfs(tmp_path, rootfs, monkeypatch):
    monkeypatch.setenv("ENVCTL_CONFIG_DIR", str(REPO / "configs"))
    state = tmp_path / "state"
    host = Host(state_dir=state, run_dir=tmp_path / "run")
    host.__dict__["boot_id"] = BOOT
    # No spec named box (the checkout's configs) and no journal: a typo, saying what exists.
    with pytest.raises(UsageError, match="no environment 'box': no spec of that name in .* "
                       r"\(known: cpu-compute, gpu-compute\)"):
        rc.EnvContext.load(host, "box")
    with pytest.raises(UsageError, match="environment 'cpu-compute' is not up: bring it up"):
        rc.EnvContext.load(host, "cpu-compute")
    with pytest.raises(UsageError, match="not an environment name"):
        rc.EnvContext.load(host, "../etc")
    write_journal(state, "box", box_entries(rootfs)[1:])
    with pytest.raises(UsageError, match="has no root filesystem"):
        rc.EnvContext.load(host, "box")
    write_journal(state, "box", box_entries(rootfs, boot="before-the-reboot"))
    with pytest.raises(UsageError, match="is not up"):
        rc.EnvContext.load(host, "box")
    (state / "journal" / "box.json").write_text('{"version": 1, "entries": [{"key": 1}]}')
    with pytest.raises(StateCorrupt):
        rc.EnvContext.load(host, "box")


def test_cpu_lists_read_and_written_as_the_spec_units_do():
    from envctl.spec.units import format_cpu_list, parse_cpu_list

    for text in ("0", "0-3", "0-3,8,10-11", "5,1,2", " 2 - 3 , 7", ""):
        assert rc.parse_cpus(text) == (parse_cpu_list(text) if text.strip() else ())
    for cpus in ((0,), (0, 1, 2, 3), (0, 2, 4), (1, 2, 3, 7, 9, 10)):
        assert rc.format_cpus(cpus) == format_cpu_list(cpus)


def test_constants_kept_in_step_with_their_owners():
    from envctl.facts import DEFAULT_PARENT
    from envctl.resources.mounts import MNT_DIR

    assert rc.DEFAULT_PARENT == DEFAULT_PARENT and rc.MNT_DIR == MNT_DIR


# ---------------------------------------------------------------- users and variables


def test_users(rootfs):
    ctx = ctx_of(rootfs)
    assert rl.resolve_user("root", ctx, {}) == rl.User(0, 0, ())
    assert rl.resolve_user("0", ctx, {}) == rl.User(0, 0, ())
    assert rl.resolve_user("nobody", ctx, {}) == rl.User(65534, 65534, ())
    assert rl.resolve_user("65534", ctx, {}) == rl.User(65534, 65534, ())
    # Supplementary groups from the environment's /etc/group; a group asked for by name.
    assert rl.resolve_user("alice", ctx, {}) == rl.User(1500, 1500, (5, 44))
    assert rl.resolve_user("alice:video", ctx, {}) == rl.User(1500, 44, (5,))
    assert rl.resolve_user("4242:4343", ctx, {}) == rl.User(4242, 4343, ())
    assert rl.resolve_user("4242", ctx, {}) == rl.User(4242, 4242, ())  # no entry: gid = uid
    # Without --user: the user behind sudo, never root.
    assert rl.resolve_user(None, ctx, {"SUDO_UID": "1000", "SUDO_GID": "100"}) == \
        rl.User(1000, 100, ())
    for environ in ({}, {"SUDO_UID": "0", "SUDO_GID": "0"}, {"SUDO_UID": ""}):
        with pytest.raises(UsageError, match="runs nothing as root unless asked: give --user"):
            rl.resolve_user(None, ctx, environ)
    with pytest.raises(UsageError, match="no user 'no-such-user-xyz'"):
        rl.resolve_user("no-such-user-xyz", ctx, {})
    with pytest.raises(UsageError, match="no group 'no-such-group-xyz'"):
        rl.resolve_user("alice:no-such-group-xyz", ctx, {})
    # The groups of the environment's GPU nodes: every job may use its environment's GPUs.
    gpu = ctx_of(rootfs, device_gids=(44, 107))
    assert rl.resolve_user("alice", gpu, {}) == rl.User(1500, 1500, (5, 44, 107))
    assert rl.resolve_user("4242", gpu, {}) == rl.User(4242, 4242, (44, 107))
    assert rl.resolve_user(None, gpu, {"SUDO_UID": "1000", "SUDO_GID": "44"}) == \
        rl.User(1000, 44, (107,))


def test_users_in_the_environments_own_id_block_are_refused_at_request_time(rootfs):
    base = 0x7000_0000
    ctx = ctx_of(rootfs, userns=base, userns_size=65536)
    for spec, what in ((str(base), f"uid {base}"), (f"{base + 9}", f"uid {base + 9}"),
                       (f"1000:{base}", f"gid {base}"), (f"root:{base + 65535}",
                                                         f"gid {base + 65535}")):
        with pytest.raises(UsageError, match=f"--user '{spec}': {what} is one of the host ids "
                                             f"of environment 'box''s user namespace "
                                             f"\\({base}-{base + 65535}; {base} is its root\\)"):
            rl.resolve_user(spec, ctx, {})
    with pytest.raises(UsageError, match=f"the sudo user \\({base}\\): uid {base}"):
        rl.resolve_user(None, ctx, {"SUDO_UID": str(base)})
    # Just outside the block, root inside, and any id without a user namespace: accepted.
    assert rl.resolve_user(str(base + 65536), ctx, {}).uid == base + 65536
    assert rl.resolve_user(str(base - 1), ctx, {}).uid == base - 1
    assert rl.resolve_user("root", ctx, {}) == rl.User(0, 0, ())
    assert rl.resolve_user(str(base), ctx_of(rootfs), {}).uid == base
    # A GPU node's group inside the block (a host that put one there) is refused as well.
    with pytest.raises(UsageError, match=f"group {base + 1} is one of"):
        rl.resolve_user("alice", ctx_of(rootfs, userns=base, userns_size=65536,
                                        device_gids=(base + 1,)), {})


def test_job_environ(rootfs):
    ctx = ctx_of(rootfs, environ={"PATH": "/bin", "FOO": "1"})
    assert rl.job_environ(ctx, rl.User(0, 0)) == {"PATH": "/bin", "FOO": "1", "HOME": "/root"}
    assert rl.job_environ(ctx, rl.User(1500, 1500), {"FOO": "2"})["HOME"] == "/home/alice"
    assert rl.job_environ(ctx, rl.User(777, 777))["HOME"] == "/"


# ---------------------------------------------------------------- checks and errors


def test_launch_checks_refuse_what_cannot_be_right(rootfs):
    ctx = ctx_of(rootfs, cpus=(2, 3))
    root = rl.User(0, 0)

    def check(**kw):
        base = {"ctx": ctx, "argv": ["sh"], "environ": {"PATH": "/bin"}, "user": root}
        return rl._check(rl.Launch(**{**base, **kw}))

    plan = check()
    assert plan["cpus"] == (2, 3) and plan["keep"] == 0xA80425FB  # Docker's default set
    assert check(user=rl.User(1000, 1000))["keep"] == 0  # other users: none
    assert check(caps=("CAP_NET_ADMIN", "kill"))["keep"] == (1 << 12) | (1 << 5)
    assert plan["argv"] == [b"sh"] and plan["environ"] == {b"PATH": b"/bin"}
    for kw, message in (({"argv": []}, "give the command"), ({"argv": [""]}, "empty string"),
                        ({"argv": ["a", "b\0c"]}, "argument 1 contains a NUL"),
                        ({"environ": {"A=B": "1"}}, "environment variable 'A=B'"),
                        ({"cwd": "tmp"}, "an absolute path"),
                        ({"caps": ("SYS_WIZARD",)}, "unknown capabilities SYS_WIZARD"),
                        ({"cpus": (1, 2)}, r"CPUs \[1\]: the environment 'box' runs on CPUs 2,3"),
                        ({"binds": [rl.Bind("/x", "/a/../etc")]}, "bind target")):
        with pytest.raises(UsageError, match=message):
            check(**kw)


def test_capability_numbers_are_the_kernels():
    assert rl.CAPS["CHOWN"] == 0 and rl.CAPS["SYS_CHROOT"] == 18 and rl.CAPS["SYS_ADMIN"] == 21
    assert rl.CAPS["MKNOD"] == 27 and rl.CAPS["SETFCAP"] == 31
    assert rl.CAPS["CHECKPOINT_RESTORE"] == 40
    assert len(rl.DEFAULT_CAPS) == 14 and "SYS_ADMIN" not in rl.DEFAULT_CAPS


def test_errors_before_the_exec_name_the_step(rootfs):
    launch = rl.Launch(ctx_of(rootfs), ["frob", "-x"], {"PATH": "/usr/bin"}, rl.User(0, 0))
    err = rl._error(launch, f"exec\0{errno.ENOENT}\0frob".encode())
    assert isinstance(err, rl.CommandNotFound) and err.exit_code == 127
    assert str(err) == "frob: command not found in environment 'box' (PATH=/usr/bin)"
    launch.argv = ["/opt/frob"]
    err = rl._error(launch, f"exec\0{errno.ENOENT}\0/opt/frob".encode())
    assert err.exit_code == 127 and "no such file" in str(err)
    err = rl._error(launch, f"exec\0{errno.EACCES}\0/opt/frob".encode())
    assert err.exit_code == 126 and str(err).endswith("Permission denied")
    err = rl._error(launch, f"pivot_root\0{errno.EINVAL}\0/srv/root".encode())
    assert (err.step, err.errno, err.exit_code) == ("pivot_root", errno.EINVAL, 1)
    assert str(err) == "enter environment 'box': pivot_root: /srv/root: Invalid argument"


def test_exit_codes_as_a_shell_reports_them():
    assert rl.exit_code(3 << 8) == 3
    assert rl.exit_code(9) == 137 and rl.exit_code(15) == 143


# ---------------------------------------------------------------- cgroups


def test_cgroup_dirs_are_where_the_cgroup_adapter_puts_them(rootfs):
    from envctl.host.cgroups import Cgroups, detect_layout

    lay = detect_layout()
    if lay.version not in (1, 2):
        pytest.skip("no cgroup hierarchy here")
    ctx = ctx_of(rootfs, cgroup=rc.EnvCgroup("cgroupfs", "p", lay.version, lay.controllers()))
    assert rl.cgroup_dirs(ctx, "exec-1") == Cgroups(lay, "p").dirs("box/exec-1")
    v1, unified = rl._cgroup_mounts()
    assert unified == lay.unified and {c: v1[c] for c in lay.v1} == lay.v1
    assert rl.cgroup_dirs(ctx_of(rootfs), "exec-1") == []  # no cgroup
    sliced = ctx_of(rootfs, cgroup=rc.EnvCgroup("systemd", "p", lay.version))
    assert rl.cgroup_dirs(sliced, "exec-1") == [] and rl.create_cgroup(sliced, "x") == []


# ---------------------------------------------------------------- the exec command


def test_exec_arguments_as_the_typer_command_reads_them():
    assert parse_args(["exec", "box", "--", "ls", "-l"]) == ("box", ["ls", "-l"], {})
    assert parse_args(["exec", "box", "--user", "65534", "--", "id"]) == \
        ("box", ["id"], {"user": "65534"})
    assert parse_args(["exec", "-u", "root", "box", "--", "--", "-x"]) == \
        ("box", ["--", "-x"], {"user": "root"})
    assert parse_args(["exec", "--user=0", "box", "true"]) == ("box", ["true"], {"user": "0"})
    # docker exec's -e and -w, and their long forms, repeatable where they are.
    assert parse_args(["exec", "-e", "A=1", "--env=B=2", "box", "-w", "/tmp", "--workdir",
                       "/srv", "--", "pwd"]) == \
        ("box", ["pwd"], {"env_vars": ["A=1", "B=2"], "workdir": "/srv"})
    # Anything else is the typer CLI's to answer (help, other options, missing parts).
    for args in (["exec", "--help"], ["exec", "box", "-h", "--", "x"], ["exec", "box"],
                 ["exec", "-e=A=1", "box", "x"], ["exec", "box", "-w"],
                 ["exec", "box", "--"], ["exec", "box", "--user"], ["--debug", "exec", "b"],
                 ["status"], []):
        assert parse_args(args) is None, args


def test_cli_exec_refuses_an_environment_that_is_not_up(tmp_path):
    """A spec of that name: `envctl up` it. No spec and not up: a typo, with what exists."""
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "b.yaml").write_text("# the box\nname: 'box'  # a comment\nkind: cpu\n")
    env = {**os.environ, "ENVCTL_STATE_DIR": str(tmp_path / "state"),
           "ENVCTL_RUN_DIR": str(tmp_path / "run"), "PYTHONPATH": str(REPO / "src"),
           "ENVCTL_CONFIG_DIR": str(configs)}
    for entry_point in (["-m", "envctl"], ["-c", "from envctl.runtime.exec import fast_entry; "
                                                  "fast_entry()"]):
        res = subprocess.run([sys.executable, *entry_point, "exec", "box", "--user", "root",
                              "--", "true"], capture_output=True, text=True, env=env)
        assert res.returncode == 2, res.stderr
        assert res.stderr == "error: environment 'box' is not up: bring it up with " \
                             "`envctl up box`\n"
        res = subprocess.run([sys.executable, *entry_point, "exec", "bxo", "--user", "root",
                              "--", "true"], capture_output=True, text=True, env=env)
        assert res.returncode == 2, res.stderr
        assert res.stderr == (f"error: no environment 'bxo': no spec of that name in {configs} "
                              "and not up on this host (known: box)\n")


# The launch path's latency budget (docs/benchmarks.md): none of these on the way to a launch.
# typer/click: the fast paths skip the CLI; dataclasses/inspect/typing: envctl.record.
FORBIDDEN = ("pydantic", "yaml", "envctl.spec", "envctl.plan", "envctl.workspace",
             "envctl.render", "envctl.app", "rich", "pyroute2", "envctl.facts",
             "envctl.resources", "envctl.engine", "envctl.host.cgroups", "typer", "click",
             "dataclasses", "inspect", "typing", "shutil", "bz2", "lzma", "hashlib")
# The slice names of the systemd driver: a module that imports nothing (and its package, whose
# __init__ is a docstring).
ALLOWED = ("envctl.spec", "envctl.spec.naming")


@pytest.mark.parametrize("entry_point", [
    ["-m", "envctl", "exec", "box", "--user", "root", "--", "true"],
    ["-c", "from envctl.runtime.exec import fast_entry; fast_entry()", "exec", "box", "--user",
     "root", "--", "true"],
    ["-m", "envctl", "submit-job", "box", "--user", "root", "/bin/true"]])
def test_exec_imports_neither_specs_nor_planner_nor_resource_kinds(tmp_path, rootfs,
                                                                   entry_point):
    """`exec` and `submit-job` read the journal of an environment with every usual kind in
    it, and import none of the spec, the planner, pydantic, YAML, rich, the engine, any
    resource kind, the typer CLI, or dataclasses and typing."""
    state = tmp_path / "state"
    # Made in this boot as far as the journal says ("": journals from before boots were kept).
    entries = box_entries(rootfs, boot="") + [
        entry("sysctl", "sysctl:x", name="net.ipv4.ip_forward", value="1"),
        entry("governor", "governor:0", policy="policy0", cpus="0", governor="performance"),
        entry("mount", "mount:box:/", env="box", root=str(rootfs), target="/",
              source=str(rootfs)),
        entry("cgroup-devices", "cgroup-devices:box", env="box", version=1, rules=[]),
        entry("veth", "veth:box", name="v")]
    write_journal(state, "box", entries)
    env = {**os.environ, "ENVCTL_STATE_DIR": str(state), "ENVCTL_RUN_DIR": str(tmp_path / "run"),
           "PYTHONPATH": str(REPO / "src")}
    res = subprocess.run([sys.executable, "-X", "importtime", *entry_point],
                         capture_output=True, text=True, env=env)
    # Read the journal all the way to its mount namespace holder, which is not there.
    assert res.returncode == 1, res.stderr
    assert "mount namespace" in res.stderr and "`envctl up box` makes it again" in res.stderr
    modules = {line.split("|")[-1].strip() for line in res.stderr.splitlines()
               if line.startswith("import time:") and "cumulative" not in line}
    assert "envctl.runtime.context" in modules
    assert sorted(m for m in modules if m.startswith(FORBIDDEN) and m not in ALLOWED) == []


# What the supervisor and the launcher import after the CLI's fork (a job's /job bind: the
# mount helpers; the systemd driver: its scope), which the test above never reaches.
AFTER_THE_FORK = """
import sys
import time
from pathlib import Path

from envctl.runtime import launch, submit, supervisor  # noqa: F401
from envctl.runtime.context import EnvCgroup, EnvContext

from envctl.host import mounts  # noqa: F401 - launch.start with binds
ctx = EnvContext(env="box", root=Path("/"), mntns=Path("/nonexistent"), netns=None,
                 hostname="box", cgroup=EnvCgroup("systemd", "", 2))
assert launch.systemd_attach(ctx) is not None
print("\\n".join(sys.modules))
"""


def test_the_supervisor_and_launcher_import_nothing_costly():
    """`submit-job`'s supervisor and launcher, forked from the CLI, stay on the latency
    budget too: no dataclasses (via the mount helpers) and no systemd adapter, facts or spec
    units (via the systemd driver's attach)."""
    res = subprocess.run([sys.executable, "-c", AFTER_THE_FORK], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert res.returncode == 0, res.stderr
    modules = set(res.stdout.split())
    assert {"envctl.host.mounts", "envctl.host.scope"} <= modules
    assert sorted(m for m in modules if m.startswith(FORBIDDEN) and m not in ALLOWED) == []


def _refusing_busctl(tmp_path, monkeypatch, message: str) -> None:
    """A busctl first on PATH that writes its arguments to tmp_path/argv and refuses."""
    fake = tmp_path / "bin" / "busctl"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/argv\n"
                    f"echo '{message}' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")


def test_the_systemd_drivers_attach_names_the_slice_and_reports_a_refusal(tmp_path,
                                                                          monkeypatch):
    """Launch.attach for the systemd driver: StartTransientUnit of `<slice>-<pid>.scope` in the
    environment's slice (of the parent `up` recorded), and systemd's refusal as a HostError
    naming the slice."""
    from envctl.errors import HostError
    from envctl.runtime.context import EnvCgroup, EnvContext

    _refusing_busctl(tmp_path, monkeypatch, "Unit envctl-box-4242.scope already exists.")
    for parent, unit in (("", "envctl-box.slice"), ("hpc", "hpc-box.slice")):
        ctx = EnvContext(env="box", root=tmp_path, mntns=tmp_path / "mnt", netns=None,
                         hostname="box", cgroup=EnvCgroup("systemd", parent, 2))
        with pytest.raises(HostError) as err:
            rl.systemd_attach(ctx)(4242)
        assert str(err.value) == (f"attach to slice '{unit}': process 4242: Unit "
                                  "envctl-box-4242.scope already exists.")
        argv = (tmp_path / "argv").read_text().split()
        assert argv[:6] == ["call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                            "org.freedesktop.systemd1.Manager", "StartTransientUnit",
                            "ssa(sv)a(sa(sv))"]
        assert argv[6] == f"{unit.removesuffix('.slice')}-4242.scope"
        assert argv[-6:-4] == ["s", unit]
    cgroupfs = EnvContext(env="box", root=tmp_path, mntns=tmp_path / "mnt", netns=None,
                          hostname="box", cgroup=EnvCgroup("cgroupfs", "", 1))
    assert rl.systemd_attach(cgroupfs) is None


def test_a_supervisors_own_scope_is_named_for_it_and_a_refusal_names_the_slice(tmp_path,
                                                                              monkeypatch):
    """supervisor_scope (systemd driver): StartTransientUnit of this process into
    `<slice>-<what>-<pid>.scope` of the environment's slice, started at once and awaited by
    what it returns; systemd's refusal is a HostError naming the slice. None for cgroupfs."""
    from envctl.errors import HostError
    from envctl.runtime.context import EnvCgroup, EnvContext

    _refusing_busctl(tmp_path, monkeypatch, "Access denied")
    ctx = EnvContext(env="box", root=tmp_path, mntns=tmp_path / "mnt", netns=None,
                     hostname="box", cgroup=EnvCgroup("systemd", "hpc", 2))
    done = rl.supervisor_scope(ctx, "job7-supervisor")
    with pytest.raises(HostError) as err:
        done()
    pid = os.getpid()
    assert str(err.value) == (f"supervisor scope in slice 'hpc-box.slice': process {pid}: "
                              "Access denied")
    argv = (tmp_path / "argv").read_text().split()
    assert argv[6] == f"hpc-box-job7-supervisor-{pid}.scope"
    assert argv[10:13] == ["au", "1", str(pid)] and argv[-6:-4] == ["s", "hpc-box.slice"]
    cgroupfs = EnvContext(env="box", root=tmp_path, mntns=tmp_path / "mnt", netns=None,
                          hostname="box", cgroup=EnvCgroup("cgroupfs", "", 2))
    assert rl.supervisor_scope(cgroupfs, "job7-supervisor") is None


@pytest.mark.parametrize("attach_fails", [False, True])
def test_a_launcher_that_fails_while_it_is_attached_reports_its_own_step(tmp_path, rootfs,
                                                                         attach_fails):
    """The caller joins the launcher to its cgroup while the launcher sets up: when the
    launcher fails first (here: a "mount namespace" that is a plain file), its step is what
    the launch reports, whether the join then succeeds (the go-ahead meets a closed pipe) or
    fails (an attach refused for the ended process)."""
    from envctl.errors import HostError

    holder = tmp_path / "not-a-namespace"
    holder.write_text("")
    ctx = ctx_of(rootfs, mntns=holder)

    def attach(pid):
        deadline = time.monotonic() + 30
        while True:  # until the launcher has failed and ended (a zombie: nobody reaped it)
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            if stat[stat.rfind(b")") + 2:][:1] == b"Z":
                break
            assert time.monotonic() < deadline, "the launcher never ended"
            time.sleep(0.01)
        if attach_fails:
            raise HostError(f"attach to slice 'envctl-box.slice': process {pid} exited")

    user = rl.User(os.getuid(), os.getgid())
    with pytest.raises(rl.LaunchError) as err:
        rl.start(rl.Launch(ctx, ["true"], {}, user, attach=attach))
    assert err.value.step == "setns mnt", err.value
    assert str(err.value).startswith("enter environment 'box': setns mnt: ")
    assert str(holder) in str(err.value)


def test_a_scope_with_its_own_devices_and_cpus_asks_systemd_for_them(tmp_path, monkeypatch):
    """A narrowing job's or exec's scope (systemd driver): DevicePolicy=closed, one
    DeviceAllow= per rule spelled as the slice spells them, and on v2 AllowedCPUs= as the
    D-Bus byte mask; v1 gets no AllowedCPUs (systemd has no cpuset to write there)."""
    from envctl.errors import HostError
    from envctl.runtime.context import EnvCgroup, EnvContext

    _refusing_busctl(tmp_path, monkeypatch, "refused")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "devices").write_text("Character devices:\n136 pts\n195 nvidia-frontend\n")
    rules = ("c 195:1 rw", "c 195:255 rw", "c 136:* rwm")
    for version in (2, 1):
        ctx = EnvContext(env="box", root=tmp_path, mntns=tmp_path / "mnt", netns=None,
                         hostname="box", cgroup=EnvCgroup("systemd", "", version))
        with pytest.raises(HostError):
            rl.systemd_attach(ctx, mem=1 << 20, devices=rules, cpus=(1, 9), proc=proc)(4242)
        argv = (tmp_path / "argv").read_text().split()
        props = argv[argv.index("ssa(sv)a(sa(sv))") + 3:]  # after the name and "fail"
        count = int(props[0])
        text = " ".join(props[1:])
        assert "MemoryMax t 1048576" in text
        assert "DevicePolicy s closed" in text
        assert ("DeviceAllow a(ss) 3 /dev/char/195:1 rw /dev/char/195:255 rw char-pts rwm"
                in text)
        if version == 2:
            assert "AllowedCPUs ay 2 2 2" in text  # CPU 1: byte 0 bit 1; CPU 9: byte 1 bit 1
            assert count == 3 + 4
        else:
            assert "AllowedCPUs" not in text and count == 3 + 3
    # Without a list of its own: no device properties (the slice's list applies).
    rl.systemd_attach(ctx)
    with pytest.raises(HostError):
        rl.systemd_attach(ctx)(4242)
    assert "Device" not in (tmp_path / "argv").read_text()


def test_a_scope_list_naming_a_major_systemd_cannot_name_is_refused_before_the_launch(
        tmp_path):
    from envctl.errors import HostError
    from envctl.runtime.context import EnvCgroup, EnvContext

    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "devices").write_text("Character devices:\n1 mem\n")
    ctx = EnvContext(env="box", root=tmp_path, mntns=tmp_path / "mnt", netns=None,
                     hostname="box", cgroup=EnvCgroup("systemd", "", 2))
    with pytest.raises(HostError, match="major 250 is not in /proc/devices"):
        rl.systemd_attach(ctx, devices=("c 250:* rw",), proc=proc)
