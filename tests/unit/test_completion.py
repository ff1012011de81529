"""Shell completion: environment names (specs, journals) and job ids, from the completion
functions and through the real protocol (`_ENVCTL_COMPLETE=complete_bash`, as typer's
installed script calls envctl). No root; unreadable places give no candidates, never an
error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from envctl import completion, workspace

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    cfg, state = tmp_path / "cfg", tmp_path / "state"
    cfg.mkdir()
    (cfg / "alpha.yaml").write_text("# a partition\nname: alpha\nkind: cpu\n")
    (cfg / "file-name.yml").write_text("kind: cpu\nname: 'beta'  # its own name\n")
    (cfg / "gamma.yaml").write_text("kind: cpu\n  name: nested\n")  # no top-level name
    (cfg / "notes.txt").write_text("name: not-a-spec\n")
    (cfg / "odd.yaml").mkdir()  # cannot be read: its stem
    (state / "journal").mkdir(parents=True)
    (state / "journal" / "delta.json").write_text("{}")
    (state / "journal" / "alpha.json").write_text("{}")
    jobs = state / "jobs"
    jobs.mkdir()
    for jid, st in ((1, "COMPLETED"), (2, "RUNNING"), (10, "PENDING"), (11, "FAILED")):
        (jobs / f"{jid}.json").write_text(json.dumps({"id": jid, "name": f"j{jid}",
                                                      "env": "alpha", "state": st}))
    (jobs / "12.json").write_text("{not json")
    (jobs / "12").mkdir()
    (jobs / "2.cancel").write_text("10")
    (jobs / ".next").write_text("13")
    monkeypatch.setenv("ENVCTL_CONFIG_DIR", str(cfg))
    monkeypatch.setenv("ENVCTL_STATE_DIR", str(state))
    return cfg, state


def test_environment_names_come_from_specs_and_journals(dirs):
    assert completion.environments("") == ["alpha", "beta", "delta", "gamma", "odd"]
    assert completion.environments("a") == ["alpha"]
    assert completion.environments("zz") == []


def test_an_explicit_config_dir_and_unreadable_places_give_what_can_be_read(dirs, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.yaml").write_text("name: epsilon\n")
    assert completion.environments("", explicit_config=str(other)) == ["alpha", "delta",
                                                                        "epsilon"]
    # A config "directory" that is a file, a state directory that does not exist: nothing.
    assert completion.environments("", explicit_config=str(other / "x.yaml")) == ["alpha",
                                                                                   "delta"]
    os.environ["ENVCTL_STATE_DIR"] = str(tmp_path / "nowhere")
    assert completion.environments("", explicit_config=str(other / "x.yaml")) == []
    assert completion.jobs("") == []


def test_job_ids_newest_first_and_only_active_ones_for_cancel(dirs):
    assert completion.jobs("") == [("12", ""), ("11", "j11 alpha FAILED"),
                                   ("10", "j10 alpha PENDING"), ("2", "j2 alpha RUNNING"),
                                   ("1", "j1 alpha COMPLETED")]
    assert [i for i, _ in completion.jobs("1")] == ["12", "11", "10", "1"]
    assert completion.jobs("", active_only=True) == [("10", "j10 alpha PENDING"),
                                                     ("2", "j2 alpha RUNNING")]


@pytest.mark.parametrize("env", [{}, {"ENVCTL_CONFIG_DIR": "/etc"}, {"ENVCTL_CONFIG_DIR": ""}])
@pytest.mark.parametrize("with_configs", [True, False])
def test_the_config_dir_rule_is_the_one_the_workspace_reads(env, with_configs, tmp_path,
                                                            monkeypatch):
    from envctl.runtime.context import SYSTEM_CONFIG_DIR

    monkeypatch.chdir(tmp_path)
    if with_configs:
        (tmp_path / "configs").mkdir()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if not env:
        monkeypatch.delenv("ENVCTL_CONFIG_DIR", raising=False)
    assert completion.config_dir is workspace.config_dir  # one rule, not a copy of it
    assert completion.config_dir("/x") == Path("/x")  # --config-dir first
    if env.get("ENVCTL_CONFIG_DIR"):
        want = Path(env["ENVCTL_CONFIG_DIR"])
    elif SYSTEM_CONFIG_DIR.is_dir() or not with_configs:
        want = SYSTEM_CONFIG_DIR
    else:
        want = Path("configs")
    assert completion.config_dir(None) == want


def complete(words: str, env: dict[str, str], shell: str = "bash") -> subprocess.CompletedProcess:
    """What the installed bash script asks `envctl` for at a Tab after `words`."""
    cword = len(words.split()) - (0 if words.endswith(" ") else 1)
    extra = {"_ENVCTL_COMPLETE": f"complete_{shell}", "COMP_WORDS": words,
             "COMP_CWORD": str(cword), "_TYPER_COMPLETE_ARGS": words,
             "_TYPER_COMPLETE_FISH_ACTION": "get-args"}
    return subprocess.run([sys.executable, "-m", "envctl"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC), **env, **extra},
                          timeout=60)


def test_the_completion_protocol_through_python_m_envctl(dirs):
    env = {"ENVCTL_CONFIG_DIR": str(dirs[0]), "ENVCTL_STATE_DIR": str(dirs[1])}
    for words, want in (("envctl up ", "alpha beta delta gamma odd"),
                        ("envctl status a", "alpha"),
                        ("envctl down alpha ", "alpha beta delta gamma odd"),
                        ("envctl exec ", "alpha beta delta gamma odd"),
                        ("envctl submit-job b", "beta"),
                        ("envctl jobs ", "alpha beta delta gamma odd"),
                        ("envctl logs 1", "12 11 10 1"),
                        ("envctl wait ", "12 11 10 2 1"),
                        ("envctl cancel ", "10 2"),
                        (f"envctl -C {dirs[0].parent} plan ", "alpha delta"),
                        (f"envctl up -C {dirs[0].parent} ", "alpha delta"),
                        (f"envctl status --config-dir={dirs[0].parent} d", "delta")):
        res = complete(words, env)
        assert res.returncode == 0 and res.stderr == "", (words, res.stderr)
        assert res.stdout.split() == want.split(), (words, res.stdout)
    fish = complete("envctl cancel ", env, "fish")
    assert fish.stdout.splitlines() == ["10\tj10 alpha PENDING", "2\tj2 alpha RUNNING"]
    zsh = complete("envctl up a", env, "zsh")
    assert zsh.returncode == 0 and '"alpha"' in zsh.stdout, zsh.stdout


def test_completion_never_fails_loudly(tmp_path):
    env = {"ENVCTL_CONFIG_DIR": str(tmp_path / "missing"), "ENVCTL_STATE_DIR": "/proc/1/nope"}
    for words in ("envctl up ", "envctl cancel ", "envctl logs x"):
        res = complete(words, env)
        assert res.returncode == 0 and res.stderr == "" and res.stdout.strip() == "", \
            (words, res.stdout, res.stderr)
    res = complete("envctl --bogus up ", env)  # an unknown option: still no error
    assert res.returncode == 0 and res.stderr == "", res.stderr


def test_the_completion_options_are_offered():
    res = subprocess.run([sys.executable, "-m", "envctl", "--help"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(SRC),
                                         "COLUMNS": "200"}, timeout=60)
    assert "--install-completion" in res.stdout and "--show-completion" in res.stdout
    script = subprocess.run([sys.executable, "-m", "envctl", "--show-completion", "bash"],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(SRC)})
    assert script.returncode == 0, script.stderr
    assert "_ENVCTL_COMPLETE=complete_bash" in script.stdout
    assert "complete -o default -F _envctl_completion envctl" in script.stdout


def test_the_config_dir_typed_anywhere_on_the_line():
    read = completion.typed_config_dir
    assert read({"COMP_WORDS": "envctl up -C /a b"}) == "/a"
    assert read({"COMP_WORDS": "envctl -C /x up --config-dir=/y "}) == "/y"
    assert read({"_TYPER_COMPLETE_ARGS": "envctl status --config-dir '/with space' "}) == \
        "/with space"
    assert read({"COMP_WORDS": "envctl up -C"}) is None
    assert read({"COMP_WORDS": "envctl up 'open"}) is None
    assert read({}) is None
