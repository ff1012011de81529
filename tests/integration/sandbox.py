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

import contextlib
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
CGROUP_ROOT = Path("/sys/fs/cgroup")


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
        # cgroupfs is global (no namespace hides it): every sandbox gets its own parent.
        self.cgroup_parent = f"envctl-test-{os.getpid()}-{os.urandom(3).hex()}"

    # ------------------------------------------------------------------ running things

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENVCTL_")}
        env.update({
            "ENVCTL_STATE_DIR": str(self.state),
            "ENVCTL_RUN_DIR": str(self.run_dir),
            "ENVCTL_CONFIG_DIR": str(self.config_dir),
            "PYTHONPATH": str(REPO / "src"),
            "COLUMNS": "200",
            "ENVCTL_CGROUP_PARENT": self.cgroup_parent,
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
        files = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
        files += sorted(p.name for p in self.state.glob("shared.*")) \
            if self.state.is_dir() else []
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
            # `down` of the last environment removes the state directory itself.
            "state_dir": sorted(os.listdir(self.state)) if self.state.is_dir() else [],
            "cgroups": self.cgroups(),
        }
        return {k: v for k, v in found.items() if v}

    def cgroups(self) -> list[str]:
        """This sandbox's cgroup parent (and anything below it) in every hierarchy."""
        found = []
        tops = list(CGROUP_ROOT.glob(f"*/{self.cgroup_parent}"))
        if (CGROUP_ROOT / self.cgroup_parent).is_dir():  # a pure v2 host
            tops.append(CGROUP_ROOT / self.cgroup_parent)
        for d in tops:
            found += [str(p) for p in sorted(d.rglob("*")) if p.is_dir()] + [str(d)]
        return sorted(found)

    def remove_cgroups(self) -> None:
        """Kill what a failed test left in this sandbox's cgroups and remove them."""
        for path in sorted(self.cgroups(), key=len, reverse=True):
            d = Path(path)
            for _ in range(100):
                pids = (d / "cgroup.procs").read_text().split() if d.is_dir() else []
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.05)
            with contextlib.suppress(OSError):
                d.rmdir()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.remove_cgroups()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


# ---------------------------------------------------------------- fake host trees (host tuning)

# A stand-in for modprobe and rmmod over a fake tree (ENVCTL_KMOD_ROOT): proc/modules,
# sys/module/NAME and lib/modules/RELEASE/modules.dep, logging each call to kmod.log.
FAKE_KMOD = r'''
import os, shutil, sys
from pathlib import Path

root = Path(__file__).resolve().parent
tool, args = sys.argv[1], sys.argv[2:]
with open(root / "kmod.log", "a") as log:
    log.write(" ".join([tool, *args]) + "\n")
proc = root / "proc" / "modules"
tree = root / "lib" / "modules" / os.uname().release


def table():
    out = {}
    for line in proc.read_text().splitlines():
        p = line.split()
        out[p[0]] = [int(p[2]), [h for h in p[3].split(",") if h and h != "-"]]
    return out


def save(t):
    proc.write_text("".join(f"{n} 16384 {r} {','.join(h) + ',' if h else '-'} Live 0x0\n"
                            for n, (r, h) in t.items()))


def norm(p):
    base = p.rsplit("/", 1)[-1]
    return base[: base.index(".ko")].replace("-", "_")


def deps_of(name):
    for line in (tree / "modules.dep").read_text().splitlines():
        path, _, deps = line.partition(":")
        if norm(path) == name:
            return [norm(d) for d in deps.split()]
    sys.exit(print(f"modprobe: FATAL: Module {name} not found in directory {tree}",
                   file=sys.stderr) or 1)


def insert(t, name, holder=None, options=()):
    if name not in t:
        for dep in reversed(deps_of(name)):
            insert(t, dep, holder=name)
        t[name] = [0, []]
        d = root / "sys" / "module" / name
        (d / "parameters").mkdir(parents=True, exist_ok=True)
        (d / "initstate").write_text("live\n")
        for opt in options:
            k, _, v = opt.partition("=")
            (d / "parameters" / k).write_text(v + "\n")
    if holder is not None and holder not in t[name][1]:
        t[name][0] += 1
        t[name][1].append(holder)


t = table()
name = args[0].replace("-", "_")
if tool == "modprobe":
    insert(t, name, options=args[1:])
    save(t)
elif tool == "rmmod":
    if name not in t:
        sys.exit(print(f"rmmod: ERROR: Module {name} is not currently loaded",
                       file=sys.stderr) or 1)
    if t[name][0] > 0:
        sys.exit(print(f"rmmod: ERROR: Module {name} is in use", file=sys.stderr) or 1)
    del t[name]
    for other in t.values():
        if name in other[1]:
            other[1].remove(name)
            other[0] -= 1
    save(t)
    shutil.rmtree(root / "sys" / "module" / name)
'''


class FakeKmod:
    """A fake module tree and tools; `modules` maps each installable module to its
    dependencies as modules.dep lists them (nearest first)."""

    def __init__(self, root: Path, modules: dict[str, list[str]], *,
                 loaded: dict[str, tuple[int, list[str]]] | None = None,
                 builtin: tuple[str, ...] = ()):
        self.root = root
        tree = root / "lib" / "modules" / os.uname().release
        tree.mkdir(parents=True, exist_ok=True)
        (tree / "modules.dep").write_text("".join(
            f"kernel/drivers/{m}.ko.xz:{''.join(f' kernel/drivers/{d}.ko.xz' for d in deps)}\n"
            for m, deps in modules.items()))
        (tree / "modules.builtin").write_text("".join(f"kernel/{b}.ko\n" for b in builtin))
        (root / "proc").mkdir(exist_ok=True)
        (root / "sys" / "module").mkdir(parents=True, exist_ok=True)
        self.script = root / "fake-kmod.py"
        self.script.write_text(FAKE_KMOD)
        self.save({name: [r, list(h)] for name, (r, h) in (loaded or {}).items()})
        for name in loaded or {}:
            (root / "sys" / "module" / name).mkdir(exist_ok=True)
            (root / "sys" / "module" / name / "initstate").write_text("live\n")

    def env(self) -> dict[str, str]:
        return {"ENVCTL_KMOD_ROOT": str(self.root),
                "ENVCTL_MODPROBE": f"{sys.executable} {self.script} modprobe",
                "ENVCTL_RMMOD": f"{sys.executable} {self.script} rmmod"}

    def table(self) -> dict[str, list]:
        out = {}
        for line in (self.root / "proc" / "modules").read_text().splitlines():
            p = line.split()
            out[p[0]] = [int(p[2]), [h for h in p[3].split(",") if h and h != "-"]]
        return out

    def save(self, table: dict[str, list]) -> None:
        (self.root / "proc" / "modules").write_text("".join(
            f"{n} 16384 {r} {','.join(h) + ',' if h else '-'} Live 0x0\n"
            for n, (r, h) in table.items()))

    def loaded(self) -> list[str]:
        return sorted(self.table())

    def use(self, name: str, delta: int = 1) -> None:
        """A process opens (or closes) the module: its refcount moves by `delta`."""
        t = self.table()
        t[name][0] += delta
        self.save(t)

    def log(self) -> list[str]:
        p = self.root / "kmod.log"
        return p.read_text().splitlines() if p.exists() else []


class FakeCpufreq:
    """A fake sysfs tree (ENVCTL_SYS_ROOT) with online CPUs and, per CPU that has cpufreq,
    its governor and the governors it offers."""

    DEFAULT = ("performance", "powersave", "ondemand", "schedutil")

    def __init__(self, root: Path, governors: dict[int, str | None], *,
                 available: dict[int, tuple[str, ...]] | None = None):
        self.root = root
        cpu_dir = root / "devices" / "system" / "cpu"
        cpu_dir.mkdir(parents=True, exist_ok=True)
        (cpu_dir / "online").write_text(",".join(str(c) for c in sorted(governors)) + "\n")
        for cpu, gov in governors.items():
            if gov is None:
                (cpu_dir / f"cpu{cpu}").mkdir(exist_ok=True)  # no cpufreq on this one
                continue
            d = cpu_dir / f"cpu{cpu}" / "cpufreq"
            d.mkdir(parents=True, exist_ok=True)
            (d / "scaling_governor").write_text(gov + "\n")
            offered = (available or {}).get(cpu, self.DEFAULT)
            (d / "scaling_available_governors").write_text(" ".join(offered) + " \n")

    def env(self) -> dict[str, str]:
        return {"ENVCTL_SYS_ROOT": str(self.root)}

    def governors(self) -> dict[int, str]:
        cpu_dir = self.root / "devices" / "system" / "cpu"
        return {int(p.parent.parent.name[3:]): p.read_text().strip()
                for p in sorted(cpu_dir.glob("cpu*/cpufreq/scaling_governor"))}
