"""The CLI's contract: exit codes, one-line errors, JSON output, root checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envctl import __version__
from envctl.cli import main

REPO = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ENVCTL_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("ENVCTL_CONFIG_DIR", str(REPO / "configs"))
    monkeypatch.setenv("COLUMNS", "200")


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"envctl {__version__}"


def test_help_has_examples(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "sudo envctl up cpu-compute" in out


def test_validate_a_directory_and_a_file(capsys, tmp_path):
    d = tmp_path / "specs"
    d.mkdir()
    (d / "a.yaml").write_text("name: a\nkind: cpu\nresources: {memory: {max: 10%}}\n")
    (d / "b.yaml").write_text("name: b\nkind: cpu\n")
    code, out, _ = run(capsys, "validate", str(d))
    assert code == 0 and out.startswith("ok: a, b")
    code, out, _ = run(capsys, "--config-dir", str(d), "validate", str(d / "b.yaml"), "--json")
    assert json.loads(out) == {"ok": True, "environments": ["b"], "host": False,
                               "warnings": []}


def test_validate_the_shipped_cpu_partition(capsys):
    code, out, _ = run(capsys, "validate", str(REPO / "configs" / "cpu-compute.yaml"))
    assert code == 0 and out.startswith("ok: cpu-compute (2 spec(s)")


def test_validate_reports_every_problem_with_exit_2(capsys, tmp_path):
    d = tmp_path / "specs"
    d.mkdir()
    (d / "a.yaml").write_text("name: a\nkind: cpu\nbogus: 1\n")
    (d / "b.yaml").write_text("name: b\nkind: [\n")
    code, _, err = run(capsys, "validate", str(d))
    assert code == 2
    assert f"{d}/a.yaml:3:1: bogus: unknown field" in err
    assert f"{d}/b.yaml:" in err and "YAML syntax error" in err
    assert "2 problem(s); nothing was changed" in err


def test_unknown_environment_is_a_usage_error(capsys):
    code, _, err = run(capsys, "plan", "nope")
    assert code == 2 and "no environment 'nope'" in err and "cpu-compute" in err


def test_bad_option_is_exit_2(capsys):
    code, _, _ = run(capsys, "plan", "--frobnicate")
    assert code == 2


def test_up_without_root_says_so_and_changes_nothing(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    code, _, err = run(capsys, "up", "cpu-compute")
    assert code == 1 and "needs root" in err and "Traceback" not in err
    assert not (tmp_path / "state").exists()
    code, _, err = run(capsys, "down", "cpu-compute")
    assert code == 1 and "needs root" in err


def test_up_with_bad_spec_is_refused_before_the_root_check(capsys, monkeypatch, tmp_path):
    d = tmp_path / "specs"
    d.mkdir()
    (d / "a.yaml").write_text("name: a\nkind: cpu\nresources:\n  cpu: {dedicated: 0-99}\n")
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    code, _, err = run(capsys, "--config-dir", str(d), "up", "a")
    assert code == 2 and "a.yaml:4" in err and "not online" in err


def test_plan_json_is_parseable(capsys):
    code, out, _ = run(capsys, "plan", "cpu-compute", "--json")
    assert code == 0
    data = json.loads(out)
    assert data[0]["env"] == "cpu-compute"
    assert {s["op"] for s in data[0]["steps"]} <= {"+", "~", "=", "-"}
    assert "cpus" in data[0]["resolved"]


def test_plan_takes_a_spec_file_path(capsys):
    code, out, _ = run(capsys, "plan", str(REPO / "configs" / "cpu-compute.yaml"), "--json")
    assert code == 0 and json.loads(out)[0]["env"] == "cpu-compute"


def test_status_of_nothing_is_ok(capsys):
    code, out, _ = run(capsys, "status", "--json")
    assert code == 0
    assert {e["env"] for e in json.loads(out)} == {"cpu-compute", "gpu-compute"}


def test_names_and_all_together_is_a_usage_error(capsys):
    code, _, err = run(capsys, "plan", "cpu-compute", "--all")
    assert code == 2 and "not both" in err


def test_a_name_that_is_not_an_environment_name_is_refused(capsys, monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 0)
    code, _, err = run(capsys, "down", "Bad..name")
    assert code == 2 and "'Bad..name' is not an environment name" in err


def test_validate_json_lists_problems_on_stdout(capsys, tmp_path):
    d = tmp_path / "specs"
    d.mkdir()
    (d / "a.yaml").write_text("name: a\nkind: cpu\nbogus: 1\n")
    code, out, _ = run(capsys, "validate", str(d), "--json")
    data = json.loads(out)
    assert code == 2 and data["ok"] is False
    assert data["problems"][0]["line"] == 3 and data["problems"][0]["field"] == "bogus"


def test_the_command_exits_with_mains_code_and_all_its_output(tmp_path):
    """`python -m envctl` ends with os._exit: the exit code and every byte of output must
    still come out (big JSON to a pipe included)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ENVCTL_STATE_DIR": str(tmp_path / "state")}
    ok = subprocess.run([sys.executable, "-m", "envctl", "-C", str(REPO / "configs"),
                         "plan", "cpu-compute", "--json"], capture_output=True, text=True,
                        env=env)
    assert ok.returncode == 0, ok.stderr
    assert [p["env"] for p in json.loads(ok.stdout)] == ["cpu-compute"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: Bad\nkind: cpu\n")
    res = subprocess.run([sys.executable, "-m", "envctl", "validate", str(bad), "--json"],
                         capture_output=True, text=True, env=env)
    assert res.returncode == 2
    assert json.loads(res.stdout)["ok"] is False and "bad.yaml:1:" in res.stderr
    usage = subprocess.run([sys.executable, "-m", "envctl", "down"], capture_output=True,
                           text=True, env=env)
    assert usage.returncode == 2 and "--all" in usage.stderr


def test_backend_and_driver_flags_say_what_auto_means(capsys, monkeypatch):
    # Set first so that monkeypatch restores them: the flags write these variables.
    monkeypatch.setenv("ENVCTL_FIREWALL", "nftables")
    monkeypatch.setenv("ENVCTL_CGROUP_DRIVER", "cgroupfs")
    code, out, _ = run(capsys, "--firewall", "iptables", "plan", "cpu-compute", "--json")
    assert code == 0 and json.loads(out)[0]["resolved"]["firewall"] == "iptables"
    code, out, _ = run(capsys, "plan", "cpu-compute", "--json")
    assert json.loads(out)[0]["resolved"]["firewall"] == "iptables"  # this process's setting
    monkeypatch.setenv("ENVCTL_FIREWALL", "nftables")
    code, out, _ = run(capsys, "plan", "cpu-compute", "--json")
    assert json.loads(out)[0]["resolved"]["firewall"] == "nftables"
    code, _, err = run(capsys, "--firewall", "pf", "plan", "cpu-compute")
    assert code == 2 and "'pf' is not one of 'nftables', 'iptables'" in err
    code, out, err = run(capsys, "--cgroup-driver", "systemd", "plan", "cpu-compute", "--json")
    if code == 0:
        assert json.loads(out)[0]["resolved"]["cgroup.driver"] == "systemd"
    else:  # PID 1 is not systemd: the spec's `auto` now asks for it, and that is refused
        assert code == 2 and "needs systemd as PID 1" in err


# ---------------------------------------------------------------- as operators use it


def test_global_options_are_accepted_after_the_subcommand(capsys, tmp_path):
    d = tmp_path / "specs"
    d.mkdir()
    (d / "x.yaml").write_text("name: x\nkind: cpu\n")
    code, out, err = run(capsys, "plan", "x", "--config-dir", str(d), "--json")
    assert code == 0, err
    assert json.loads(out)[0]["env"] == "x"
    code, out, _ = run(capsys, "plan", "x", f"--config-dir={d}", "--json", "--debug")
    assert code == 0 and json.loads(out)[0]["env"] == "x"


def test_hoisting_stops_at_a_double_dash():
    from envctl.cli import hoist_global_options

    assert hoist_global_options(["plan", "x", "-C", "d"]) == ["-C", "d", "plan", "x"]
    assert hoist_global_options(["--debug", "up", "x", "--lock-timeout=3"]) == [
        "--debug", "--lock-timeout=3", "up", "x"]
    assert hoist_global_options(["exec", "x", "--", "cmd", "--debug"]) == [
        "exec", "x", "--", "cmd", "--debug"]


@pytest.mark.parametrize("argv", [
    ("plan", "--frobnicate"),
    ("status", "--bogus"),
    ("--firewall", "pf", "plan", "cpu-compute"),
    ("down",),
    ("plan", "cpu-compute", "--all"),
    ("nosuchcommand",),
])
def test_every_usage_error_is_one_error_line_and_exit_2(capsys, monkeypatch, argv):
    monkeypatch.setattr("os.geteuid", lambda: 0)
    code, out, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Usage:" not in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ("status", "nope"),
    ("status", "nope", "--check"),
    ("plan", "--down", "nope"),
    ("down", "nope"),
])
def test_unknown_environment_names_are_exit_2_everywhere(capsys, monkeypatch, argv):
    monkeypatch.setattr("os.geteuid", lambda: 0)  # down checks root before names
    code, _, err = run(capsys, *argv)
    assert code == 2, err
    assert "no environment 'nope'" in err and "cpu-compute" in err


def test_status_of_an_environment_that_is_down_calls_nothing_drifted(capsys):
    code, out, _ = run(capsys, "status", "cpu-compute", "--json")
    assert code == 0
    row = json.loads(out)[0]
    assert row["up"] is False
    assert {s["status"] for s in row["steps"]} == {"not-applied"}
    # The spec's description (down: from the spec; up: as `up` recorded it).
    assert row["description"] == "Dedicated-core CPU partition for batch and benchmark jobs"
    code, out, _ = run(capsys, "status", "cpu-compute")
    assert "drifted" not in out and "not applied" in out
    assert out.splitlines()[0].split(None, 2)[2] == row["description"]


def test_validate_is_the_same_on_any_machine_and_host_fitness_is_asked_for(capsys):
    # gpu-compute needs the NVIDIA modules, which this machine lacks: a CI runner without a
    # GPU still validates the GPU host's specs; --host says what this host cannot serve.
    code, out, err = run(capsys, "validate", str(REPO / "configs"))
    assert code == 0, err
    assert out.startswith("ok: ") and "gpu-compute" in out
    code, _, err = run(capsys, "validate", "--host", str(REPO / "configs"))
    assert code == 2 and "nvidia" in err


def test_piped_output_is_never_wrapped(tmp_path):
    import os
    import subprocess
    import sys

    d = tmp_path / "specs"
    d.mkdir()
    ports = ", ".join(f'"{8000 + i}:{80 + i}"' for i in range(12))
    (d / "wide.yaml").write_text(f"name: wide\nkind: cpu\nnetwork:\n  address: 10.200.0.9\n"
                                 f"  ports: [{ports}]\n")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["ENVCTL_STATE_DIR"] = str(tmp_path / "state")
    res = subprocess.run([sys.executable, "-m", "envctl", "-C", str(d), "plan", "wide"],
                         capture_output=True, text=True, env=env, check=False)
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if "firewall rules of wide" in x)
    assert "tcp/8011->91" in line and len(line) > 120


def test_diffs_read_as_values_never_python_reprs():
    from envctl.resources.base import Diff

    assert str(Diff("rules", ["a *:* rwm", "c 1:3 rwm"], None)) == \
        "rules: none -> a *:* rwm, c 1:3 rwm"
    assert str(Diff("isolated", True, False)) == "isolated: off -> on"


def test_specs_others_can_write_are_refused_for_up_but_fine_to_plan(capsys, monkeypatch,
                                                                    tmp_path):
    import os

    # Should the refusal ever regress, the first step fails before it changes this host.
    monkeypatch.setenv("ENVCTL_FAULT", "fail@before:*")

    d = tmp_path / "specs"
    d.mkdir()
    spec = d / "a.yaml"
    spec.write_text("name: a\nkind: cpu\n")
    spec.chmod(0o666)
    code, _, err = run(capsys, "--config-dir", str(d), "plan", "a")
    assert code == 0, err
    code, _, err = run(capsys, "--config-dir", str(d), "up", "a")
    assert code == 2 and f"{spec} is writable by group and others (mode 0666)" in err
    assert not (tmp_path / "state").exists()
    spec.chmod(0o644)
    os.chown(d, 1000, 0)
    code, _, err = run(capsys, "--config-dir", str(d), "up", "a")
    assert code == 2 and f"{d} is owned by uid 1000, not root" in err
    assert not (tmp_path / "state").exists()


def test_validate_without_a_host_still_finds_what_the_specs_alone_decide(capsys, tmp_path):
    d = tmp_path / "specs"
    d.mkdir()
    (d / "a.yaml").write_text("name: a\nkind: cpu\nhost:\n  governor: performance\n"
                              "  modules: [{name: dummy, options: {numdummies: 2}}]\n")
    (d / "b.yaml").write_text("name: b\nkind: cpu\nresources: {cpu: {dedicated: [1]}}\n"
                              "host:\n  governor: {name: powersave, cpus: dedicated}\n"
                              "  modules: [{name: dummy, options: {numdummies: 3}}]\n")
    code, _, err = run(capsys, "validate", str(d))
    assert code == 2
    assert "wants governor powersave on cpu 1 but environment 'a'" in err
    assert "loads dummy with options 'numdummies=3'" in err


def test_output_never_turns_a_mac_address_into_an_emoji(capsys):
    from envctl.cli import _console

    _console().print("peer address 02:ab:cd:ef:01:23")
    assert "02:ab:cd:ef:01:23" in capsys.readouterr().out


def test_status_works_from_the_journals_when_a_spec_is_broken(capsys, monkeypatch, tmp_path):
    d = tmp_path / "specs"
    d.mkdir()
    (d / "a.yaml").write_text("name: a\nkind: cpu\n")
    (d / "b.yaml").write_text("name: b\nkind: [\n")
    code, out, err = run(capsys, "--config-dir", str(d), "status", "--check")
    assert code == 0, err
    assert "b.yaml" in err and "showing what the journals record" in err


def test_help_gives_each_command_its_whole_summary(capsys, monkeypatch):
    """`envctl --help` wraps each command's one-line summary to the terminal; the
    docstrings' own line breaks never cut one mid-sentence: a summary's line ends only where
    its next word would not fit."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run(capsys, "--help")
    assert code == 0
    rows = [line for line in out.split("Commands")[1].splitlines() if line.startswith("│ ")]
    name, summary = rows[0][2:].split(None, 1)
    start = rows[0].index(summary)  # where the description column begins
    width = len(rows[0]) - 2 - start  # … and its width, up to the border
    for line, nxt in zip(rows, rows[1:], strict=False):
        if nxt[2:start].strip():
            continue  # the next command's first line
        text, following = line[start:-1].rstrip(), nxt[start:-1].split()
        assert len(text) + 1 + len(following[0]) > width, (text, following[0])


def test_jobs_of_an_unknown_environment_is_a_typo(capsys):
    code, _, err = run(capsys, "jobs", "cpu-compte")
    assert code == 2 and "no environment 'cpu-compte'" in err and "cpu-compute" in err
    code, out, _ = run(capsys, "jobs", "cpu-compute")  # a spec, no jobs: an empty table
    assert code == 0 and out.split() == ["ID", "NAME", "ENV", "USER", "STATE", "ELAPSED",
                                         "EXIT", "CPUS", "MEM", "GPUS", "START", "PROGRAM"]


def _finished_record(tmp_path) -> None:
    from envctl.runtime import jobs as jb

    jb.write(tmp_path / "state", jb.Job(
        id=3, env="cpu-compute", argv=["/job/b"], name="b", user="alice", uid=1000,
        state=jb.State.COMPLETED, submit_time=90.0, start_time=100.0, end_time=165.5,
        exit_code=0, cpu_seconds=3.5, cpu_user_seconds=3.25, cpu_system_seconds=0.25,
        peak_memory_bytes=3 << 20, gpus=["GPU-a", "GPU-b"], gpu_seconds=131.0,
        gpu_energy_joules=1234.5, output_truncated=["stdout"]), durable=False)


def test_jobs_format_picks_the_columns_and_json_has_the_accounting(capsys, tmp_path):
    _finished_record(tmp_path)
    code, out, _ = run(capsys, "jobs", "--all", "--format",
                       "id, user,state,elapsed,cpu_user,cpu_sys,maxrss,gpu_seconds,energy_j,"
                       "truncated")
    assert code == 0
    header, row = (line.split() for line in out.splitlines())
    assert header == ["ID", "USER", "STATE", "ELAPSED", "USERCPU", "SYSCPU", "MAXRSS",
                      "GPU_SEC", "ENERGY_J", "TRUNCATED"]
    assert row == ["3", "alice", "COMPLETED", "1:05", "0:03.250", "0:00.250", "3M", "131.0",
                   "1234.5", "stdout"]
    code, out, _ = run(capsys, "jobs", "--all", "--json")
    rec = json.loads(out)[0]
    assert code == 0 and rec["elapsed"] == 65.5 and rec["cpu_user_seconds"] == 3.25
    assert rec["cpu_system_seconds"] == 0.25 and rec["gpu_energy_joules"] == 1234.5
    assert rec["output_truncated"] == ["stdout"] and rec["peak_memory_bytes"] == 3 << 20


def test_jobs_format_refuses_an_unknown_field_listing_the_allowed(capsys, tmp_path):
    code, out, err = run(capsys, "jobs", "--format", "id,maxvmsize")
    assert code == 2 and not out
    assert "unknown field(s) maxvmsize" in err and "cpu_user" in err and "energy_j" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "jobs", "--format", "id", "--json")
    assert code == 2 and "--format" in err


def test_a_spec_linked_into_a_directory_someone_else_owns_is_refused_for_up(capsys, monkeypatch,
                                                                           tmp_path):
    """The spec in the config directory is a link, through a second link in a root-owned
    directory, to a root-owned file in uid 1000's directory: uid 1000 can swap that file (or
    the link's target), so `up` refuses it, naming that directory."""
    import os

    # Should the refusal ever regress, the first step fails before it changes this host.
    monkeypatch.setenv("ENVCTL_FAULT", "fail@before:*")

    d = tmp_path / "specs"
    d.mkdir()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "a.yaml").write_text("name: a\nkind: cpu\n")
    os.chown(theirs, 1000, 0)
    hop = tmp_path / "hop"
    hop.symlink_to(theirs)
    (d / "a.yaml").symlink_to(hop / "a.yaml")
    code, _, err = run(capsys, "--config-dir", str(d), "up", "a")
    assert code == 2 and f"{theirs} is owned by uid 1000, not root" in err, err
    assert not (tmp_path / "state").exists()
