"""A throwaway network + mount namespace standing in for "the host" in integration tests.

A `sleep` process is started with `unshare --net --mount --propagation private`; every command
of a test runs inside it through `nsenter`. Inside:
- /run/netns is a private tmpfs, so named namespaces never appear on the real host;
- global sysctls that tests may change (vm.*, kernel.numa_balancing) are bind-mounted over
  with plain files, so the real host's values are never written;
- state, runtime and config directories live under the test's tmp_path.
Killing the sleep process frees every kernel object made inside.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Global (not per-netns) sysctls faked inside every sandbox: writes land in a file.
FAKED_SYSCTLS = ("vm/zone_reclaim_mode", "kernel/numa_balancing")


class Sandbox:
    def __init__(self, root: Path, *, config_dir: Path | None = None):
        self.root = root
        self.state = root / "state"
        self.run_dir = root / "run"
        self.config_dir = config_dir or root / "configs"
        self.config_dir.mkdir(parents=True, exist_ok=True)
        fakes = root / "fake-sysctl"
        fakes.mkdir(exist_ok=True)
        script = ["set -e", "mkdir -p /run/netns", "mount -t tmpfs envctl-test /run/netns",
                  "ip link set lo up"]
        for rel in FAKED_SYSCTLS:
            real = Path("/proc/sys") / rel
            if real.exists():
                fake = fakes / rel.replace("/", ".")
                fake.write_text(real.read_text())
                script.append(f"mount --bind {fake} {real}")
        script += ["echo ready", "exec sleep 100000"]
        self.proc = subprocess.Popen(
            ["unshare", "--net", "--mount", "--propagation", "private", "--", "sh", "-c",
             "\n".join(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"sandbox did not start: {self.proc.stderr.read()}")
        time.sleep(0.01)
        self.pid = self.proc.pid

    # ------------------------------------------------------------------ running things

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENVCTL_")}
        env.update({
            "ENVCTL_STATE_DIR": str(self.state),
            "ENVCTL_RUN_DIR": str(self.run_dir),
            "ENVCTL_CONFIG_DIR": str(self.config_dir),
            "PYTHONPATH": str(REPO / "src"),
            "COLUMNS": "200",
        })
        env.update(extra or {})
        return env

    def run(self, *argv: str, env: dict[str, str] | None = None, check: bool = False,
            timeout: float = 60, input: str | None = None) -> subprocess.CompletedProcess:
        cmd = ["nsenter", "-t", str(self.pid), "-n", "-m", "--", *argv]
        res = subprocess.run(cmd, env=self.env(env), capture_output=True, text=True,
                             timeout=timeout, input=input)
        if check and res.returncode != 0:
            raise AssertionError(f"{argv} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def popen(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        cmd = ["nsenter", "-t", str(self.pid), "-n", "-m", "--", *argv]
        return subprocess.Popen(cmd, env=self.env(env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def envctl(self, *args: str, env: dict[str, str] | None = None, check: bool = False,
               timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run(sys.executable, "-m", "envctl", *args, env=env, check=check,
                        timeout=timeout)

    def envctl_json(self, *args: str, env: dict[str, str] | None = None):
        res = self.envctl(*args, "--json", env=env, check=True)
        return json.loads(res.stdout)

    def sysctl(self, name: str) -> str:
        path = "/proc/sys/" + name.replace(".", "/")
        return self.run("cat", path, check=True).stdout.strip()

    def set_sysctl(self, name: str, value: str) -> None:
        path = "/proc/sys/" + name.replace(".", "/")
        self.run("sh", "-c", f"echo {value} > {path}", check=True)

    def write_spec(self, name: str, text: str) -> Path:
        p = self.config_dir / f"{name}.yaml"
        p.write_text(text)
        return p

    # ------------------------------------------------------------------ residue

    def netns(self) -> list[str]:
        return sorted(os.listdir(f"/proc/{self.pid}/root/run/netns"))

    def links(self) -> list[str]:
        out = self.run("ip", "-j", "link", "show", check=True).stdout
        return sorted(link["ifname"] for link in json.loads(out) if link["ifname"] != "lo")

    def nft_tables(self) -> list[str]:
        if shutil.which("nft") is None:
            return []
        out = self.run("nft", "-j", "list", "tables", check=True).stdout
        return sorted(f"{t['table']['family']} {t['table']['name']}"
                      for t in json.loads(out)["nftables"] if "table" in t)

    def mounts_under(self, *prefixes: str) -> list[str]:
        text = Path(f"/proc/{self.pid}/mountinfo").read_text()
        points = [line.split()[4] for line in text.splitlines()]
        return [p for p in points if any(p.startswith(x) for x in prefixes)]

    def journals(self) -> list[str]:
        d = self.state / "journal"
        files = sorted(p.name for p in d.glob("*.json")) if d.is_dir() else []
        if (self.state / "shared.json").exists():
            files.append("shared.json")
        return files

    def residue(self) -> dict[str, list[str]]:
        """Everything an environment could leave behind; empty lists when clean."""
        found = {
            "netns": self.netns(),
            "links": self.links(),
            "nft": self.nft_tables(),
            "mounts": self.mounts_under(str(self.run_dir), str(self.state)),
            "journal": self.journals(),
            "env_dirs": sorted(os.listdir(self.state / "envs"))
            if (self.state / "envs").is_dir() else [],
            "run_dirs": sorted(os.listdir(self.run_dir)) if self.run_dir.is_dir() else [],
        }
        return {k: v for k, v in found.items() if v}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()
