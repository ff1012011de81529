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


def stderr_of(proc: subprocess.Popen) -> str:
    """What `proc` wrote to stderr, for a failure message; killed first if it still runs (a
    read of a live process's stderr would wait for it to end, until the test's time-out)."""
    if proc.poll() is None:
        proc.kill()
    return proc.communicate(timeout=30)[1]


class Sandbox:
    def __init__(self, root: Path, *, config_dir: Path | None = None,
                 netns_mounted: bool = True):
        """`netns_mounted=False`: /run/netns is a plain directory on a private tmpfs /run (a
        host where nothing has mounted it yet), and the residue check includes mounts there."""
        self.root = root
        self.netns_mounted = netns_mounted
        self.state = root / "state"
        self.run_dir = root / "run"
        self.config_dir = config_dir or root / "configs"
        self.config_dir.mkdir(parents=True, exist_ok=True)
        fakes = root / "fake-sysctl"
        fakes.mkdir(exist_ok=True)
        script = ["set -e", "mkdir -p /run/netns", "mount -t tmpfs envctl-test /run/netns",
                  "ip link set lo up"]
        if not netns_mounted:
            script[1:3] = ["mount -t tmpfs envctl-test-run /run", "mkdir /run/netns"]
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
            raise RuntimeError(f"sandbox did not start: {stderr_of(self.proc)}")
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
            # `up`/`down` keep the CDI file in step: never the machine's /etc/cdi in a test.
            "ENVCTL_CDI_DIR": str(self.state.parent / "cdi"),
            "PYTHONPATH": str(REPO / "src"),
            "COLUMNS": "200",
            "ENVCTL_CGROUP_PARENT": self.cgroup_parent,
            # A daemon of the host's own (/run/envctl/envctl.sock, the README's quick start)
            # must not serve the sandbox's commands: none answers here unless a test starts one.
            # A path nobody makes, below a directory every user may search: a plain user's
            # client finds no daemon there (ENOENT), as on a host without one, rather than a
            # socket it may not reach (EACCES below the test's 0700 directory).
            "ENVCTL_SOCKET": f"/run/{self.cgroup_parent}-no-daemon/envctl.sock",
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
        """Every nftables table, of every family ("inet envctl", "bridge envctl", anybody's)."""
        if shutil.which("nft") is None:
            return []
        out = self.run("nft", "-j", "list", "tables", check=True).stdout
        return sorted(f"{t['table']['family']} {t['table']['name']}"
                      for t in json.loads(out)["nftables"] if "table" in t)

    def mounts_under(self, *prefixes: str) -> list[str]:
        text = Path(f"/proc/{self.pid}/mountinfo").read_text()
        points = [line.split()[4] for line in text.splitlines()]
        return [p for p in points if any(p.startswith(x) for x in prefixes)]

    def is_mount_point(self, path: str) -> bool:
        text = Path(f"/proc/{self.pid}/mountinfo").read_text()
        return any(line.split()[4] == path for line in text.splitlines())

    def ip_tables_names(self) -> list[str]:
        """The legacy xtables tables that exist in the sandbox's network namespace."""
        return self.run("cat", "/proc/net/ip_tables_names", check=True).stdout.split()

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
        if not self.netns_mounted:
            found["netns_dir"] = self.mounts_under("/run/netns")
        return {k: v for k, v in found.items() if v}

    def residue_keeping_data(self, data: dict[str, list[str]]) -> dict[str, list[str]]:
        """The residue after a plain `down` of environments whose data directories (their
        specs' relative mount sources, `data`: env -> sources) survive it, as data does:
        asserts they are exactly those and leaves them (and the lock beside them) out."""
        found = self.residue()
        d = self.state / "data"
        assert {e: sorted(os.listdir(d / e)) for e in os.listdir(d)} == \
            {e: sorted(v) for e, v in data.items()}, "data directories"
        kept = found.pop("state_dir", [])
        assert kept == ["data", "lock"], kept
        return found

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
            # A test that failed during teardown may leave a v1 cgroup frozen: its processes
            # die of SIGKILL only once thawed. v2 kills a whole subtree with cgroup.kill.
            for name, value in (("freezer.state", "THAWED"), ("cgroup.kill", "1")):
                with contextlib.suppress(OSError):
                    (d / name).write_text(value)
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
# sys/module/NAME, lib/modules/RELEASE/modules.dep and etc/modprobe.d/*.conf (softdep and install
# lines), logging each call that may change something to kmod.log. Like kmod's modprobe: the
# probe list is the module's dependencies (each with its soft dependencies), then its own `pre:`
# softdeps, itself and its `post:` softdeps; -i/--ignore-install leaves out the named module's
# own softdeps (and install command); -D/--show-depends prints the list and loads nothing; a
# softdep that fails to load is skipped. Modules named in a `broken` file fail to load.
FAKE_KMOD = r'''
import os, shutil, sys
from pathlib import Path

root = Path(__file__).resolve().parent
tool, args = sys.argv[1], sys.argv[2:]
flags = {a for a in args if a.startswith("-")}
args = [a for a in args if not a.startswith("-")]
show = bool(flags & {"-D", "--show-depends"})
alone = bool(flags & {"-i", "--ignore-install"})
if not show:  # a dry run changes nothing: not logged
    with open(root / "kmod.log", "a") as log:
        log.write(" ".join([tool, *sorted(flags), *args]) + "\n")
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
    # modules.dep order (nearest first), or None when the module is not installed.
    for line in (tree / "modules.dep").read_text().splitlines():
        path, _, deps = line.partition(":")
        if norm(path) == name:
            return [norm(d) for d in deps.split()]
    return None


def config():
    softdeps, install = {}, {}
    conf = root / "etc" / "modprobe.d"
    for f in sorted(conf.glob("*.conf")) if conf.is_dir() else ():
        for line in f.read_text().splitlines():
            words = line.split()
            if words[:1] == ["softdep"]:
                pre, post, into = [], [], None
                for w in words[2:]:
                    into = pre if w == "pre:" else post if w == "post:" else into
                    if w not in ("pre:", "post:"):
                        into.append(w.replace("-", "_"))
                softdeps.setdefault(words[1].replace("-", "_"), (pre, post))
            elif words[:1] == ["install"]:
                install.setdefault(words[1].replace("-", "_"), " ".join(words[2:]))
    return softdeps, install


SOFTDEPS, INSTALL = config()


def probe_list(name, out, visited, ignorecmd=False):
    if name in visited:
        return
    visited.add(name)
    for dep in reversed(deps_of(name) or []):
        fill_softdep(dep, out, visited)
    if ignorecmd:
        out.append((name, True))
    else:
        fill_softdep(name, out, visited)


def fill_softdep(name, out, visited):
    pre, post = SOFTDEPS.get(name, ([], []))
    for m in pre:
        if deps_of(m) is not None:  # kmod skips a softdep it cannot find
            probe_list(m, out, visited)
    out.append((name, bool(pre or post)))
    for m in post:
        if deps_of(m) is not None:
            probe_list(m, out, visited)


def insert(t, name, options=()):
    broken = root / "broken"
    if broken.exists() and name in broken.read_text().split():
        return f"could not insert '{name}': No such device"
    t[name] = [0, []]
    for dep in deps_of(name):  # the kernel counts each module that uses a dependency
        t[dep][0] += 1
        t[dep][1].append(name)
    d = root / "sys" / "module" / name
    (d / "parameters").mkdir(parents=True, exist_ok=True)
    (d / "initstate").write_text("live\n")
    for opt in options:
        k, _, v = opt.partition("=")
        (d / "parameters" / k).write_text(v + "\n")
    return ""


t = table()
name = args[0].replace("-", "_")
if tool == "modprobe":
    if deps_of(name) is None:
        sys.exit(print(f"modprobe: FATAL: Module {name} not found in directory {tree}",
                       file=sys.stderr) or 1)
    if name in t and not show:
        sys.exit(0)
    order = []
    probe_list(name, order, set(), ignorecmd=alone)
    required = {name, *(deps_of(name) or [])}
    for m, ignorecmd in order:
        opts = args[1:] if m == name else []
        cmd = INSTALL.get(m) if not ignorecmd else None
        if show:
            print(f"install {cmd} {' '.join(opts)}" if cmd else
                  f"insmod {tree}/kernel/drivers/{m}.ko.xz {' '.join(opts)}")
        elif m not in t:
            err = insert(t, m, opts)  # an install command here stands for plain loading
            if err and m in required:
                save(t)
                sys.exit(print(f"modprobe: ERROR: {err}", file=sys.stderr) or 1)
    if not show:
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
    dependencies as modules.dep lists them (nearest first); `softdeps` maps a module to its
    (pre, post) soft dependencies and `install` to an install command, both written to
    etc/modprobe.d under the root; modules in `broken` fail to load."""

    def __init__(self, root: Path, modules: dict[str, list[str]], *,
                 loaded: dict[str, tuple[int, list[str]]] | None = None,
                 builtin: tuple[str, ...] = (),
                 softdeps: dict[str, tuple[list[str], list[str]]] | None = None,
                 install: dict[str, str] | None = None, broken: tuple[str, ...] = ()):
        self.root = root
        tree = root / "lib" / "modules" / os.uname().release
        tree.mkdir(parents=True, exist_ok=True)
        (tree / "modules.dep").write_text("".join(
            f"kernel/drivers/{m}.ko.xz:{''.join(f' kernel/drivers/{d}.ko.xz' for d in deps)}\n"
            for m, deps in modules.items()))
        (tree / "modules.builtin").write_text("".join(f"kernel/{b}.ko\n" for b in builtin))
        conf = root / "etc" / "modprobe.d"
        conf.mkdir(parents=True, exist_ok=True)
        (conf / "envctl-test.conf").write_text("".join(
            [f"softdep {m} pre: {' '.join(pre)} post: {' '.join(post)}\n"
             for m, (pre, post) in (softdeps or {}).items()]
            + [f"install {m} {cmd}\n" for m, cmd in (install or {}).items()]))
        (root / "broken").write_text(" ".join(broken))
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
    its governor and the governors it offers. `policies` maps a policy number to its CPUs:
    as in the kernel, devices/system/cpu/cpufreq/policyN holds the files (and related_cpus)
    and each of its CPUs' cpufreq is a link to it; the policy's governor is governors[N]. A
    CPU in no policy has its own cpufreq directory without related_cpus."""

    DEFAULT = ("performance", "powersave", "ondemand", "schedutil")

    def __init__(self, root: Path, governors: dict[int, str | None], *,
                 available: dict[int, tuple[str, ...]] | None = None,
                 policies: dict[int, tuple[int, ...]] | None = None):
        self.root = root
        cpu_dir = root / "devices" / "system" / "cpu"
        cpu_dir.mkdir(parents=True, exist_ok=True)
        (cpu_dir / "online").write_text(",".join(str(c) for c in sorted(governors)) + "\n")
        in_policy = {c: n for n, cpus in (policies or {}).items() for c in cpus}
        for n, cpus in (policies or {}).items():
            d = cpu_dir / "cpufreq" / f"policy{n}"
            self._files(d, governors[n], (available or {}).get(n, self.DEFAULT))
            (d / "related_cpus").write_text(" ".join(map(str, cpus)) + "\n")
            (d / "affected_cpus").write_text(" ".join(map(str, cpus)) + "\n")
        for cpu, gov in governors.items():
            (cpu_dir / f"cpu{cpu}").mkdir(exist_ok=True)
            if cpu in in_policy:
                (cpu_dir / f"cpu{cpu}" / "cpufreq").symlink_to(
                    f"../cpufreq/policy{in_policy[cpu]}")
            elif gov is not None:  # None: no cpufreq on this one
                self._files(cpu_dir / f"cpu{cpu}" / "cpufreq", gov,
                            (available or {}).get(cpu, self.DEFAULT))

    @staticmethod
    def _files(d: Path, gov: str | None, offered: tuple[str, ...]) -> None:
        d.mkdir(parents=True, exist_ok=True)
        (d / "scaling_governor").write_text(f"{gov}\n")
        (d / "scaling_available_governors").write_text(" ".join(offered) + " \n")

    def env(self) -> dict[str, str]:
        return {"ENVCTL_SYS_ROOT": str(self.root)}

    def governors(self) -> dict[int, str]:
        """Each CPU's governor, read through its cpufreq (a link for CPUs of a policy)."""
        cpu_dir = self.root / "devices" / "system" / "cpu"
        out = {}
        for d in sorted(cpu_dir.glob("cpu[0-9]*")):
            f = d / "cpufreq" / "scaling_governor"
            if f.exists():
                out[int(d.name[3:])] = f.read_text().strip()
        return out
