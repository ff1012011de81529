"""envctl's boot units (envctl.units, `install-units` / `uninstall-units`): what the templates
say, rendering with this installation's envctl, ownership (only what envctl wrote is
rewritten or removed), idempotence, systemctl calls through a fake, and `systemd-analyze
verify` on the rendered files."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from envctl import units as un
from envctl.cli import main
from envctl.errors import HostError, InputError

REPO = Path(__file__).resolve().parents[2]
VENV_ENVCTL = str(Path(sys.executable).parent / "envctl")


def settings(text: str) -> dict[str, list[str]]:
    """'[Section]Key' -> every value it is given (comments and blank lines skipped)."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        key, value = line.split("=", 1)
        out.setdefault(section + key, []).append(value)
    return out


@pytest.fixture
def fake_systemctl(tmp_path):
    """A systemctl that appends its arguments to a file, one call per line."""
    log = tmp_path / "systemctl.log"
    script = tmp_path / "systemctl"
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    script.chmod(0o755)

    def calls() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    return str(script), calls


@pytest.fixture
def units(tmp_path, fake_systemctl):
    d = tmp_path / "units"
    d.mkdir()
    return un.Units(d, tmp_path / "state", systemctl=[fake_systemctl[0]], booted=True)


def texts(command=("/opt/envctl/bin/envctl",), env=None) -> dict[str, str]:
    return un.render_all(list(command), env or {})


# ---------------------------------------------------------------- the templates


def test_the_boot_unit_is_the_oneshot_the_issue_asks_for():
    s = settings((REPO / "systemd/envctl.service").read_text())
    assert s["[Service]Type"] == ["oneshot"] and s["[Service]RemainAfterExit"] == ["yes"]
    assert s["[Service]ExecStart"] == ["envctl up --all"]
    # Reload stops nothing; stop never cancels jobs by itself (no --force: `down` refuses
    # while jobs run, unless the host is shutting down).
    assert s["[Service]ExecReload"] == ["envctl up --all"]
    assert s["[Service]ExecStop"] == ["envctl down --all"]
    # A partial `up` (exit 1) keeps the unit active; a refused stop (errors.Busy, exit 3)
    # fails it, so that `systemctl status` and `--failed` show what was left running.
    from envctl.errors import Busy

    assert s["[Service]SuccessExitStatus"] == ["1"] and Busy.exit_code == 3
    after = " ".join(s["[Unit]After"]).split()
    assert {"network-online.target", "local-fs.target", "remote-fs.target",
            "nvidia-persistenced.service", "nvidia-fabricmanager.service"} <= set(after)
    # The monitor and the retry are started with the environments (and ordered after them).
    assert " ".join(s["[Unit]Wants"]).split() == ["network-online.target",
                                                  "envctl-monitor.service",
                                                  "envctl-retry.service"]
    # The NVIDIA daemons are ordering only: a host without them must still boot the unit.
    for daemon in ("nvidia-persistenced.service", "nvidia-fabricmanager.service"):
        assert daemon not in " ".join(s.get("[Unit]Wants", []) + s.get("[Unit]Requires", []))
    # The supervisors `up` forks stay in the unit's cgroup: only `up` itself may be killed.
    assert s["[Service]KillMode"] == ["process"]
    # `up --all` exiting 1 (one environment not up) keeps the unit active: a failed unit is
    # never stopped, so ExecStop would not take the others down at stop or shutdown.
    assert s["[Service]SuccessExitStatus"] == ["1"]
    assert s["[Install]WantedBy"] == ["multi-user.target"]


def test_the_monitor_unit_restarts_always_after_the_boot_unit():
    s = settings((REPO / "systemd/envctl-monitor.service").read_text())
    assert s["[Service]Restart"] == ["always"]
    assert "envctl.service" in s["[Unit]After"]
    # Neither Wants nor Requires: (re)starting the monitor must never run `up --all` again.
    assert "[Unit]Wants" not in s and "[Unit]Requires" not in s
    assert s["[Service]KillMode"] == ["process"]
    assert s["[Service]ExecStart"][0].startswith("envctl monitor --listen 127.0.0.1:")
    # sd_notify: READY=1 after the first tick, WATCHDOG=1 from the loop (monitor/notify.py).
    assert s["[Service]Type"] == ["notify"] and s["[Service]NotifyAccess"] == ["main"]
    assert s["[Service]WatchdogSec"] == ["5min"] and s["[Service]TimeoutStartSec"] == ["5min"]


def test_the_retry_unit_runs_after_the_boot_unit_and_stops_with_it():
    s = settings((REPO / "systemd/envctl-retry.service").read_text())
    assert s["[Service]ExecStart"] == ["envctl up --retry --window 600"]
    assert s["[Unit]After"] == ["envctl.service"] and s["[Unit]PartOf"] == ["envctl.service"]
    # Started only through envctl.service's Wants= (never on its own: no [Install]), and the
    # supervisors of what it brings up outlive it.
    assert not any(k.startswith("[Install]") for k in s)
    assert "[Unit]Wants" not in s and "[Unit]Requires" not in s
    assert s["[Service]KillMode"] == ["process"]


def test_the_daemon_socket_is_the_one_the_cli_connects_to():
    s = settings((REPO / "systemd/envctl-daemon.socket").read_text())
    assert s["[Socket]ListenStream"] == ["/run/envctl/envctl.sock"]
    # Anyone connects (the daemon decides by SO_PEERCRED); only root can replace the socket.
    assert s["[Socket]SocketMode"] == ["0666"] and s["[Socket]DirectoryMode"] == ["0755"]
    assert s["[Socket]SocketUser"] == ["root"] and s["[Socket]Accept"] == ["no"]
    assert s["[Install]WantedBy"] == ["sockets.target"]
    assert not any(k.startswith("[Service]") or "Exec" in k for k in s)


def test_the_daemon_service_takes_the_socket_and_leaves_the_jobs_alone():
    s = settings((REPO / "systemd/envctl-daemon.service").read_text())
    assert s["[Service]ExecStart"] == ["envctl daemon"]
    assert s["[Service]Type"] == ["simple"]
    # Supervisors are double-forked into the unit's cgroup: a stop kills the daemon alone.
    assert s["[Service]KillMode"] == ["process"]
    assert s["[Service]Restart"] == ["on-failure"]
    assert s["[Unit]Requires"] == ["envctl-daemon.socket"]
    assert "envctl-daemon.socket" in s["[Unit]After"] and "envctl.service" in s["[Unit]After"]
    # Ordering only: (re)starting the daemon never runs `up --all`.
    assert "envctl.service" not in " ".join(s.get("[Unit]Wants", []) + s["[Unit]Requires"])
    assert s["[Install]WantedBy"] == ["multi-user.target"]


def test_the_socket_unit_listens_at_envctl_socket_and_runs_nothing():
    t = texts(env={"ENVCTL_SOCKET": "/run/other/envctl.sock"})
    sock = settings(t["envctl-daemon.socket"])
    assert sock["[Socket]ListenStream"] == ["/run/other/envctl.sock"]
    assert t["envctl-daemon.socket"].startswith("# Written by `envctl install-units`")
    # The daemon gets the same path (its directory check, its log).
    d = settings(t["envctl-daemon.service"])
    assert d["[Service]ExecStart"] == ["/opt/envctl/bin/envctl daemon"]
    assert '"ENVCTL_SOCKET=/run/other/envctl.sock"' in d["[Service]Environment"]
    assert settings(texts()["envctl-daemon.socket"])["[Socket]ListenStream"] == [
        "/run/envctl/envctl.sock"]
    with pytest.raises(InputError, match="control characters"):
        texts(env={"ENVCTL_SOCKET": "/run/x\nExecStartPre=/bin/evil"})
    with pytest.raises(HostError, match="one ListenStream= line"):
        un.render("envctl-daemon.socket", "[Socket]\n", [], socket="/run/x.sock")


@pytest.mark.parametrize("name", un.NAMES)
def test_no_hardening_that_would_break_provisioning(name):
    """Settings that give the unit its own mount namespace hide the netns and rootfs mounts
    from the host; seccomp, capability and no-new-privileges settings are inherited by the
    environments' services (docs/boot.md). Delegate= is not needed: the cgroupfs driver writes
    /sys/fs/cgroup/<parent>, not the unit's cgroup, and the systemd driver makes slices."""
    s = settings((REPO / "systemd" / name).read_text())
    banned = {"ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts",
              "PrivateNetwork", "ProtectKernelTunables", "ProtectKernelModules",
              "ProtectControlGroups", "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths",
              "TemporaryFileSystem", "MountFlags", "NoNewPrivileges", "CapabilityBoundingSet",
              "SystemCallFilter", "RestrictNamespaces", "MemoryDenyWriteExecute",
              "RestrictAddressFamilies", "LockPersonality", "Delegate", "DynamicUser"}
    assert not {k.split("]", 1)[1] for k in s} & banned


# ---------------------------------------------------------------- rendering


def test_render_points_every_exec_line_at_the_command_and_carries_the_settings():
    t = texts(["/opt/my envctl/bin/envctl"], {"ENVCTL_CONFIG_DIR": "/etc/e 100%",
                                              "ENVCTL_STATE_DIR": "/var/lib/envctl"})
    s = settings(t["envctl.service"])
    assert s["[Service]ExecStart"] == ['"/opt/my envctl/bin/envctl" up --all']
    assert s["[Service]ExecStop"] == ['"/opt/my envctl/bin/envctl" down --all']
    assert s["[Service]Environment"] == ['"ENVCTL_CONFIG_DIR=/etc/e 100%%"',
                                         '"ENVCTL_STATE_DIR=/var/lib/envctl"']
    assert t["envctl.service"].startswith("# Written by `envctl install-units`")
    m = settings(t["envctl-monitor.service"])
    assert m["[Service]ExecStart"][0].startswith('"/opt/my envctl/bin/envctl" monitor ')
    assert "envctl up" not in t["envctl-monitor.service"].replace("`envctl", "")


def test_exec_words_are_quoted_for_systemd():
    assert un.exec_word("/usr/bin/python3") == "/usr/bin/python3"
    assert un.exec_word("-m") == "-m"
    assert un.exec_word('a "b" $HOME 5%') == '"a \\"b\\" $$HOME 5%%"'
    with pytest.raises(InputError, match="control characters"):
        un.exec_word("a\nExecStartPre=/bin/evil")


def test_envctl_command_is_the_console_script_beside_the_interpreter(tmp_path):
    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir(parents=True)
    python = bin_ / "python"
    python.symlink_to(sys.executable)  # a venv's python links to the base interpreter
    assert un.envctl_command(str(python)) == [str(python), "-m", "envctl"]
    (bin_ / "envctl").write_text("#!/bin/sh\n")
    (bin_ / "envctl").chmod(0o755)
    # Not resolved through the symlink: the venv (and its packages) is kept.
    assert un.envctl_command(str(python)) == [str(bin_ / "envctl")]


def test_carried_environment_is_the_state_and_spec_settings_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {"ENVCTL_STATE_DIR": "st", "ENVCTL_CGROUP_DRIVER": "systemd",
           "ENVCTL_SYSTEMCTL": "/fake", "ENVCTL_PROC_ROOT": "/fake/proc", "PATH": "/bin"}
    assert un.carried_environment(env, "cfg") == {
        "ENVCTL_STATE_DIR": str(tmp_path / "st"), "ENVCTL_CGROUP_DRIVER": "systemd",
        "ENVCTL_CONFIG_DIR": str(tmp_path / "cfg")}


# ---------------------------------------------------------------- install / uninstall


def test_install_writes_enables_reloads_and_is_idempotent(units, fake_systemctl):
    _, calls = fake_systemctl
    changes = units.install(texts())
    assert [(c.action, c.unit) for c in changes] == [
        ("wrote", "envctl.service"), ("enabled", "envctl.service"),
        ("wrote", "envctl-monitor.service"), ("enabled", "envctl-monitor.service"),
        ("wrote", "envctl-retry.service"),  # no [Install]: envctl.service's Wants= starts it
        ("wrote", "envctl-daemon.socket"), ("enabled", "envctl-daemon.socket"),
        ("wrote", "envctl-daemon.service"), ("enabled", "envctl-daemon.service"),
        ("reloaded", "systemd")]
    for name, text in texts().items():
        path = units.unit_dir / name
        assert path.read_text() == text
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        if name == "envctl-retry.service":
            continue
        target = "sockets.target" if name.endswith(".socket") else "multi-user.target"
        link = units.unit_dir / f"{target}.wants" / name
        assert os.readlink(link) == str(path)
    assert calls() == ["daemon-reload"]

    again = units.install(texts())
    assert [c.action for c in again] == ["kept"] * 5
    assert calls() == ["daemon-reload"]  # nothing changed: no reload

    # Another envctl installation: envctl's own files are rewritten.
    other = units.install(texts(["/usr/local/bin/envctl"]))
    # (the socket unit runs no envctl: it is the same text, kept)
    assert [c.action for c in other] == ["rewrote", "rewrote", "rewrote", "kept", "rewrote",
                                         "reloaded"]
    assert "ExecStart=/usr/local/bin/envctl up --all" in \
        (units.unit_dir / "envctl.service").read_text()


def test_install_now_starts_them(units, fake_systemctl):
    _, calls = fake_systemctl
    units.install(texts(), now=True)
    assert calls() == ["daemon-reload", "start envctl.service envctl-monitor.service "
                       "envctl-retry.service envctl-daemon.socket envctl-daemon.service"]


def test_without_a_running_systemd_nothing_is_called(tmp_path, fake_systemctl):
    _, calls = fake_systemctl
    u = un.Units(tmp_path / "units", tmp_path / "state", systemctl=[fake_systemctl[0]],
                 booted=False)
    assert [c.action for c in u.install(texts())] == ["wrote", "enabled"] * 2 + ["wrote"] + \
        ["wrote", "enabled"] * 2
    with pytest.raises(HostError, match="systemd is not running"):
        u.install(texts(), now=True)
    assert [c.action for c in u.uninstall()] == ["disabled", "removed"] * 3 + ["removed"] + \
        ["disabled", "removed"]  # sorted: envctl-retry.service (no link) before envctl.service
    assert calls() == []


def test_a_unit_file_envctl_did_not_write_is_refused_and_nothing_is_written(units, fake_systemctl):
    _, calls = fake_systemctl
    theirs = units.unit_dir / "envctl-monitor.service"
    theirs.write_text("[Service]\nExecStart=/usr/bin/their-monitor\n")
    with pytest.raises(HostError, match="envctl-monitor.service exists and envctl did not "
                                        "write it"):
        units.install(texts())
    # Checked before the first write: not even envctl.service was written.
    assert sorted(p.name for p in units.unit_dir.iterdir()) == ["envctl-monitor.service"]
    assert theirs.read_text().endswith("their-monitor\n")
    assert not units.record_path.exists() and calls() == []
    assert units.uninstall() == []  # nothing envctl wrote: nothing to remove
    assert theirs.exists()


def test_a_file_edited_by_hand_is_neither_overwritten_nor_removed(units):
    units.install(texts())
    path = units.unit_dir / "envctl.service"
    path.write_text(path.read_text() + "Nice=5\n")
    with pytest.raises(HostError, match="edited since"):
        units.install(texts(["/elsewhere/envctl"]))
    with pytest.raises(HostError, match="changed since envctl wrote it"):
        units.uninstall()
    assert path.read_text().endswith("Nice=5\n")
    assert (units.unit_dir / "envctl-monitor.service").exists()  # nothing removed


def test_identical_content_is_adopted(units, tmp_path):
    for name, text in texts().items():
        (units.unit_dir / name).write_text(text)  # as after a crash before the record
    assert [c.action for c in units.install(texts())] == ["kept", "enabled"] * 2 + ["kept"] + \
        ["kept", "enabled"] * 2 + ["reloaded"]
    assert json.loads(units.record_path.read_text())["units"].keys() == set(un.NAMES)


def test_a_foreign_wants_link_is_refused(units):
    wants = units.unit_dir / "multi-user.target.wants"
    wants.mkdir()
    (wants / "envctl.service").symlink_to("/lib/systemd/system/something.service")
    with pytest.raises(HostError, match="points to /lib/systemd/system/something.service"):
        units.install(texts())
    assert not (units.unit_dir / "envctl.service").exists()


def test_uninstall_removes_only_what_envctl_wrote(units, fake_systemctl):
    _, calls = fake_systemctl
    other_wants = units.unit_dir / "multi-user.target.wants" / "ssh.service"
    units.install(texts())
    other_wants.symlink_to("/lib/systemd/system/ssh.service")
    dropin = units.unit_dir / "envctl.service.d" / "10-local.conf"
    dropin.parent.mkdir()
    dropin.write_text("[Service]\nEnvironment=X=1\n")
    changes = units.uninstall(now=True)
    order = ["envctl-daemon.service", "envctl-daemon.socket", "envctl-monitor.service",
             "envctl-retry.service", "envctl.service"]
    assert [(c.action, c.unit) for c in changes] == [("stopped", n) for n in order] + [
        (a, n) for n in order for a in ("disabled", "removed")
        if (a, n) != ("disabled", "envctl-retry.service")] + [("reloaded", "systemd")]
    assert calls()[-2:] == ["stop " + " ".join(order), "daemon-reload"]
    assert sorted(str(p.relative_to(units.unit_dir)) for p in units.unit_dir.rglob("*")) == [
        "envctl.service.d", "envctl.service.d/10-local.conf", "multi-user.target.wants",
        "multi-user.target.wants/ssh.service"]
    assert not units.record_path.exists()
    assert units.uninstall() == []  # repeatable


def test_uninstall_removes_the_wants_directory_it_made(units):
    units.install(texts())
    units.uninstall()
    assert list(units.unit_dir.iterdir()) == []


def test_a_link_repointed_by_the_operator_is_kept(units):
    units.install(texts())
    link = units.unit_dir / "multi-user.target.wants" / "envctl.service"
    link.unlink()
    link.symlink_to("/etc/systemd/system/their.service")
    units.uninstall()
    assert os.readlink(link) == "/etc/systemd/system/their.service"
    assert not (units.unit_dir / "envctl.service").exists()


# ---------------------------------------------------------------- systemd-analyze verify


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_analyze_verify_is_clean(tmp_path):
    def verify(command: list[str], where: str) -> subprocess.CompletedProcess:
        d = tmp_path / where
        d.mkdir()
        for name, text in un.render_all(command, {"ENVCTL_STATE_DIR": "/var/lib/envctl"},
                                        mounts=["/srv/data sets/x", "/var/lib/envctl"]
                                        ).items():
            (d / name).write_text(text)
        return subprocess.run(["systemd-analyze", "verify", *sorted(map(str, d.iterdir()))],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)

    res = verify(un.envctl_command(), "good")
    assert res.returncode == 0 and res.stdout + res.stderr == "", res.stdout + res.stderr
    # The check sees what is wrong: a command that does not exist fails it.
    bad = verify([str(tmp_path / "nowhere" / "envctl")], "bad")
    assert bad.returncode != 0 and "nowhere/envctl" in bad.stderr, bad.stderr


# ---------------------------------------------------------------- the CLI


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_cli_install_and_uninstall(capsys, tmp_path, monkeypatch, fake_systemctl):
    monkeypatch.setenv("ENVCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ENVCTL_SYSTEMCTL", fake_systemctl[0])
    monkeypatch.delenv("ENVCTL_CONFIG_DIR", raising=False)
    d = tmp_path / "units"
    code, out, err = run_cli(capsys, "install-units", "--unit-dir", str(d), "-C",
                             str(tmp_path / "cfg"), "--json")
    assert code == 0, err
    assert {(c["action"], c["unit"]) for c in json.loads(out)} >= {
        ("wrote", "envctl.service"), ("enabled", "envctl-monitor.service")}
    s = settings((d / "envctl.service").read_text())
    assert s["[Service]ExecStart"] == [" ".join(un.envctl_command()) + " up --all"]
    assert f'"ENVCTL_CONFIG_DIR={tmp_path / "cfg"}"' in s["[Service]Environment"]
    assert f'"ENVCTL_STATE_DIR={tmp_path / "state"}"' in s["[Service]Environment"]

    (d / "envctl.service").write_text("[Service]\nExecStart=/bin/true\n")
    code, _, err = run_cli(capsys, "uninstall-units")
    assert code == 1 and err.startswith("error: uninstall unit 'envctl.service'"), err
    assert err.count("\n") == 1  # one line, no traceback
    (d / "envctl.service").unlink()
    code, out, err = run_cli(capsys, "uninstall-units")
    assert code == 0, err
    assert "removed envctl-monitor.service" in out
    code, out, _ = run_cli(capsys, "uninstall-units")
    assert code == 0 and out.strip() == "nothing installed"


def test_install_units_carries_the_config_directory_this_command_reads(capsys, tmp_path,
                                                                        monkeypatch,
                                                                        fake_systemctl):
    """Without -C or ENVCTL_CONFIG_DIR, a checkout's ./configs (what `envctl up` reads from
    there) goes into the units as an absolute path: they run from /."""
    from envctl.workspace import SYSTEM_CONFIG_DIR

    if SYSTEM_CONFIG_DIR.is_dir():
        pytest.skip("/etc/envctl/environments exists here: it wins over ./configs")
    monkeypatch.setenv("ENVCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ENVCTL_SYSTEMCTL", fake_systemctl[0])
    monkeypatch.delenv("ENVCTL_CONFIG_DIR", raising=False)
    (tmp_path / "configs").mkdir()
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "units"
    code, _, err = run_cli(capsys, "install-units", "--unit-dir", str(d))
    assert code == 0, err
    s = settings((d / "envctl.service").read_text())
    assert f'"ENVCTL_CONFIG_DIR={tmp_path.resolve() / "configs"}"' in s["[Service]Environment"]


# ---------------------------------------------------------------- code only root can change


def fake_venv(tmp_path: Path) -> dict:
    """A venv-shaped tree (bin/envctl whose #! is bin/python, a link to this interpreter; an
    envctl package under lib/) and the code_paths arguments that point at it."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    script = venv / "bin" / "envctl"
    script.write_text(f"#!{venv}/bin/python\nfrom envctl.entry import main\nmain()\n")
    script.chmod(0o755)
    pkg = venv / "lib" / "site-packages" / "envctl"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    os.chmod(tmp_path, 0o755)
    return {"command": [str(script)], "executable": str(venv / "bin" / "python"),
            "prefix": str(venv), "base_prefix": sys.base_prefix, "package": pkg,
            "search_path": [str(pkg.parent), "relative/ignored"]}


# Root and whoever runs the tests (root here; a user in CI): what the fake venv is made by.
TRUSTED = frozenset({0, os.geteuid()})


def refused(where: dict) -> str:
    args = dict(where)
    command = args.pop("command")
    with pytest.raises(HostError) as exc:
        un.refuse_writable_code(command, trusted=TRUSTED, **args)
    return str(exc.value)


def test_code_only_root_can_change_is_accepted(tmp_path):
    where = fake_venv(tmp_path)
    args = dict(where)
    un.refuse_writable_code(args.pop("command"), trusted=TRUSTED, **args)
    files, trees = un.code_paths(where["command"], **{k: v for k, v in where.items()
                                                      if k != "command"})
    # The script, the interpreter its #! names, the import path, and the venv, package and
    # import path trees.
    assert [str(f) for f in files] == [where["command"][0], where["executable"],
                                       where["search_path"][0]]
    assert trees == [Path(where["prefix"]), where["package"], Path(where["search_path"][0])]


@pytest.mark.parametrize("what", ["venv", "bin", "script", "package file", "above"])
def test_group_writable_code_or_directories_are_refused(tmp_path, what):
    where = fake_venv(tmp_path)
    venv = Path(where["prefix"])
    target = {"venv": venv, "bin": venv / "bin", "script": venv / "bin" / "envctl",
              "package file": where["package"] / "__init__.py", "above": tmp_path}[what]
    target.chmod(stat.S_IMODE(target.stat().st_mode) | 0o020)
    msg = refused(where)
    assert msg.startswith(f"install units: {target} is writable by group"), msg
    assert "\n" not in msg and "chmod go-w" in msg


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("what", ["script", "package file", "venv"])
def test_code_owned_by_a_user_is_refused(tmp_path, what):
    where = fake_venv(tmp_path)
    venv = Path(where["prefix"])
    target = {"script": venv / "bin" / "envctl", "venv": venv,
              "package file": where["package"] / "__init__.py"}[what]
    os.chown(target, 1000, 1000)
    msg = refused(where)
    assert msg.startswith(f"install units: {target} is owned by uid 1000, not root"), msg


def test_a_directory_on_the_import_path_others_can_write_is_refused(tmp_path):
    """A site-packages a .pth file adds (outside the venv): its own directory is judged."""
    where = fake_venv(tmp_path)
    deps = tmp_path / "deps"
    deps.mkdir()
    deps.chmod(0o777)
    where["search_path"] = [str(deps)]
    assert refused(where).startswith(f"install units: {deps} is writable by group and others")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_symlink_into_a_users_directory_is_refused(tmp_path):
    """A root-owned link in the package that leads into a user's directory: python follows
    it at import, so its target is judged."""
    where = fake_venv(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    (home / "evil.py").write_text("")
    os.chown(home, 1000, 1000)
    (where["package"] / "evil.py").symlink_to(home / "evil.py")
    assert f"install units: {home} is owned by uid 1000" in refused(where)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_users_module_in_an_import_directory_outside_the_venv_is_refused(tmp_path):
    """A site-packages a .pth file adds, root's own directory, holding one module a user
    owns: the directory alone was judged, so the module became root code at boot."""
    where = fake_venv(tmp_path)
    deps = tmp_path / "deps"
    (deps / "dep").mkdir(parents=True)
    (deps / "dep" / "__init__.py").write_text("")
    os.chown(deps / "dep" / "__init__.py", 1000, 1000)
    where["search_path"] = [str(deps)]
    msg = refused(where)
    assert msg.startswith(f"install units: {deps / 'dep' / '__init__.py'} is owned by uid "
                          "1000"), msg


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_symlinked_directory_in_the_venv_is_walked_too(tmp_path):
    """A root-owned link in the venv to a root-owned directory elsewhere, holding a file a
    user owns: the link and the directory pass, the file must not (os.walk does not follow
    links: the directory's contents went unchecked). A loop of links ends."""
    where = fake_venv(tmp_path)
    shared = tmp_path / "shared"
    (shared / "mod").mkdir(parents=True)
    (shared / "mod" / "x.py").write_text("")
    (shared / "loop").symlink_to(shared)
    (Path(where["prefix"]) / "lib" / "shared").symlink_to(shared)
    args = dict(where)
    un.refuse_writable_code(args.pop("command"), trusted=TRUSTED, **args)  # all root's: fine
    os.chown(shared / "mod" / "x.py", 1000, 1000)
    msg = refused(where)
    assert f"{shared / 'mod' / 'x.py'} is owned by uid 1000" in msg, msg


@pytest.mark.skipif(os.geteuid() != 0, reason="checked only as root, as spec files are")
def test_cli_install_units_refuses_user_writable_code_and_writes_nothing(
        capsys, tmp_path, monkeypatch, fake_systemctl):
    where = fake_venv(tmp_path)
    script = Path(where["command"][0])
    script.chmod(0o775)
    monkeypatch.setattr(un, "envctl_command", lambda: where["command"])
    monkeypatch.setenv("ENVCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ENVCTL_SYSTEMCTL", fake_systemctl[0])
    d = tmp_path / "units"
    code, out, err = run_cli(capsys, "install-units", "--unit-dir", str(d), "-C",
                             str(tmp_path / "cfg"))
    assert code == 1 and err.startswith(f"error: install units: {script} is writable by "
                                        "group"), err
    assert err.count("\n") == 1
    assert not d.exists() and not (tmp_path / "state" / "units.json").exists()


# ---------------------------------------------------------------- the mounts it waits for


def test_envctl_service_requires_the_mounts_of_the_specs_data_sources(capsys, tmp_path,
                                                                      monkeypatch,
                                                                      fake_systemctl):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    for name, sources in {"a": ["/srv/data sets/x", "scratch"],
                          "b": ["/nfs/shared/", "/srv/data sets/x"]}.items():
        (cfg / f"{name}.yaml").write_text(f"name: {name}\nkind: cpu\nmounts:\n" + "".join(
            f"  - {{source: {s}, target: /m{i}}}\n" for i, s in enumerate(sources)))
    monkeypatch.setenv("ENVCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ENVCTL_SYSTEMCTL", fake_systemctl[0])
    d = tmp_path / "units"
    code, _, err = run_cli(capsys, "install-units", "--unit-dir", str(d), "-C", str(cfg))
    assert code == 0, err
    s = settings((d / "envctl.service").read_text())
    # Absolute sources once each (a relative one lives in the state directory), then the
    # state and config directories; quoted for systemd where needed.
    assert s["[Unit]RequiresMountsFor"] == [
        f'"/srv/data sets/x" /nfs/shared {tmp_path / "state"} {cfg}']
    for other in ("envctl-monitor.service", "envctl-retry.service", "envctl-daemon.service"):
        assert "[Unit]RequiresMountsFor" not in settings((d / other).read_text())

    # A spec added with a new data source: install-units again rewrites the unit.
    (cfg / "c.yaml").write_text("name: c\nkind: cpu\nmounts:\n"
                                "  - {source: /lustre/c, target: /c}\n")
    code, out, err = run_cli(capsys, "install-units", "--unit-dir", str(d), "-C", str(cfg))
    assert code == 0 and "rewrote envctl.service" in out, err
    assert "/lustre/c" in settings((d / "envctl.service").read_text())["[Unit]RequiresMountsFor"][0]

    # Broken specs: installed all the same, with a warning and only the state and config.
    (cfg / "c.yaml").write_text("name: c\nkind: cpu\nresources: {memory: {max: lots}}\n")
    code, out, err = run_cli(capsys, "install-units", "--unit-dir", str(d), "-C", str(cfg))
    assert code == 0 and "warning: specs not read" in err, err
    assert settings((d / "envctl.service").read_text())["[Unit]RequiresMountsFor"] == [
        f"{tmp_path / 'state'} {cfg}"]


def test_not_root_nothing_is_checked(tmp_path, monkeypatch):
    """As for spec files: a user's install-units (its own --unit-dir) makes no root code."""
    where = fake_venv(tmp_path)
    Path(where["command"][0]).chmod(0o777)
    monkeypatch.setattr(un.os, "geteuid", lambda: 1000)
    args = dict(where)
    un.refuse_writable_code(args.pop("command"), **args)  # no HostError
    monkeypatch.setattr(un.os, "geteuid", lambda: 0)
    with pytest.raises(HostError):
        un.refuse_writable_code(where["command"], **{k: v for k, v in where.items()
                                                      if k != "command"})


def test_the_wheel_carries_every_unit_template():
    """install-units run from an installed wheel reads its templates from share/envctl/systemd:
    a unit added under systemd/ and not to pyproject's data-files breaks it there alone."""
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    shipped = meta["tool"]["setuptools"]["data-files"]["share/envctl/systemd"]
    units = sorted(f"systemd/{p.name}" for p in (REPO / "systemd").iterdir()
                   if p.suffix in (".service", ".socket", ".timer"))
    assert sorted(shipped) == units
