"""A fleet of throwaway hosts for the Ansible collection: each inventory host is a Sandbox
(its own network + mount namespace and state, run and config directories), reached by
Ansible's local connection through a per-host Python that enters the sandbox first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.integration.sandbox import REPO, Sandbox

ANSIBLE_ROOT = REPO / "ansible"  # holds ansible_collections/envctl/fleet
COLLECTION = ANSIBLE_ROOT / "ansible_collections" / "envctl" / "fleet"
EXAMPLES = ANSIBLE_ROOT / "examples"
VENV_BIN = Path(sys.executable).parent  # not resolved: the venv's scripts sit beside it
ENVCTL_BIN = VENV_BIN / "envctl"

# The per-host interpreter: Ansible runs every module with it; it takes the sandbox's ENVCTL_*
# variables and enters its namespaces, then runs this venv's Python on the module.
INTERPRETER = """\
#!{python}
import os, sys
os.environ.pop("PYTHONPATH", None)
os.environ.update({env!r})
os.execvp("nsenter", ["nsenter", "-t", "{pid}", "-n", "-m", "--", sys.executable,
                      *sys.argv[1:]])
"""

RECAP = re.compile(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$", re.MULTILINE)


def ansible_tool(name: str) -> str:
    return str(VENV_BIN / name)


@dataclass
class FleetHost:
    name: str
    sandbox: Sandbox
    interpreter: Path

    @property
    def unit_dir(self) -> Path:
        """Where the role's `envctl install-units` writes (systemd is not PID 1 here: the
        units are written and enabled, nothing is started)."""
        return self.sandbox.root / "units"

    def spec_files(self) -> dict[str, str]:
        return {p.name: p.read_text() for p in sorted(self.sandbox.config_dir.iterdir())}

    def up(self) -> dict[str, str]:
        """Each environment envctl knows here and its state (up / degraded / down)."""
        return {row["env"]: row["state"] for row in self.sandbox.envctl_json("status")}


@dataclass
class PlaybookRun:
    rc: int
    output: str
    recap: dict[str, dict[str, int]]

    def counts(self, host: str) -> dict[str, int]:
        assert host in self.recap, f"no recap line for {host}:\n{self.output}"
        return self.recap[host]


def make_host(name: str, root: Path) -> FleetHost:
    root.mkdir(parents=True)
    sb = Sandbox(root)
    interp = root / "python"
    write_interpreter(sb, interp)
    return FleetHost(name, sb, interp)


def write_interpreter(sb: Sandbox, path: Path, *, pythonpath: bool = True) -> None:
    """The host's Python for Ansible: this one in the sandbox's namespaces, with its ENVCTL_*
    (and, unless `pythonpath` is False, PYTHONPATH at this checkout's src: False for a host
    that is to run the envctl it installed, as a real one does)."""
    env = {k: v for k, v in sb.env().items()
           if k.startswith("ENVCTL_") or (pythonpath and k == "PYTHONPATH")}
    path.write_text(INTERPRETER.format(python=sys.executable, env=env, pid=sb.pid))
    path.chmod(0o755)


def inventory(hosts: list[FleetHost], host_vars: dict[str, dict]) -> dict:
    """An inventory of the sandboxes in the group envctl_hosts (the example playbook's), with
    the role's install part off, envctl pointed at this checkout's and the boot units written
    into each host's own directory. systemd is not PID 1 in a sandbox: the role's handlers
    run over no unit (a real host's lists are the role's defaults)."""
    return {"envctl_hosts": {
        "vars": {"ansible_connection": "local", "ansible_become": False,
                 "envctl_install": False, "envctl_bin": str(ENVCTL_BIN),
                 "envctl_units_start": [], "envctl_units_restart": []},
        "hosts": {h.name: {"ansible_python_interpreter": str(h.interpreter),
                           "envctl_config_dir": str(h.sandbox.config_dir),
                           "envctl_unit_dir": str(h.unit_dir),
                           **host_vars.get(h.name, {})} for h in hosts},
    }}


def ansible_env(work: Path) -> dict[str, str]:
    """Ansible's environment: this collection, temp files under `work`, no colours, and no
    ENVCTL_* of the caller (each host's come from its interpreter)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ENVCTL_", "ANSIBLE_"))}
    env.update({
        "HOME": str(work),  # ansible-test keeps its virtual environments under ~/.ansible
        "ANSIBLE_COLLECTIONS_PATH": str(ANSIBLE_ROOT),
        "ANSIBLE_HOME": str(work / "ansible-home"),
        "ANSIBLE_LOCAL_TEMP": str(work / "ansible-local"),
        "ANSIBLE_REMOTE_TMP": str(work / "ansible-remote"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_RETRY_FILES_ENABLED": "0",
        "ANSIBLE_DEPRECATION_WARNINGS": "0",
        "ANSIBLE_STDOUT_CALLBACK": "default",
    })
    return env


def run_playbook(work: Path, inv: dict, playbook: Path, *args: str,
                 timeout: float = 240) -> PlaybookRun:
    inv_path = work / "inventory.yml"
    inv_path.write_text(yaml.safe_dump(inv, sort_keys=False))
    res = subprocess.run([ansible_tool("ansible-playbook"), "-i", str(inv_path), str(playbook),
                          *args], cwd=work, env=ansible_env(work), capture_output=True,
                         text=True, timeout=timeout)
    output = res.stdout + res.stderr
    recap = {m.group(1): {k: int(v) for k, v in (kv.split("=") for kv in m.group(2).split())}
             for m in RECAP.finditer(res.stdout)}
    return PlaybookRun(res.returncode, output, recap)
