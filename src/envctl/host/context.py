"""The Host handle every resource receives: where the kernel's files are and the adapters to use."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

from envctl.record import Factory, Record

DEFAULT_STATE_DIR = Path("/var/lib/envctl")
DEFAULT_RUN_DIR = Path("/run/envctl")


class Host(Record):
    """Paths of the host (overridable so tests can point at a sandbox) and lazy adapters."""

    state_dir: Path = DEFAULT_STATE_DIR
    run_dir: Path = DEFAULT_RUN_DIR
    proc: Path = Path("/proc")
    sys: Path = Path("/sys")
    netns_dir: Path = Path("/run/netns")
    options: dict[str, str] = Factory(dict)
    # Kernel modules: a root holding proc/modules, sys/module and lib/modules (None: the real
    # ones) and the argv (shlex-split) of the tools; tests point all of them at fakes.
    kmod_root: Path | None = None
    modprobe: str = "modprobe"
    rmmod: str = "rmmod"
    # Where the NVIDIA driver's /proc, /dev and ld.so.cache are read (ENVCTL_GPU_ROOT: a fake
    # tree in tests).
    gpu_root: Path = Path("/")
    # Called by long steps (rootfs assembly) as (what, done, total); the CLI draws a progress
    # bar on a TTY, nothing with --json. None: nobody is watching.
    progress: Callable[[str, int, int], None] | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ[str] = os.environ) -> Host:
        """The real host, with ENVCTL_STATE_DIR / ENVCTL_RUN_DIR / ENVCTL_SYS_ROOT overrides."""
        return cls(
            state_dir=Path(environ.get("ENVCTL_STATE_DIR", DEFAULT_STATE_DIR)),
            run_dir=Path(environ.get("ENVCTL_RUN_DIR", DEFAULT_RUN_DIR)),
            proc=Path(environ.get("ENVCTL_PROC_ROOT", "/proc")),
            sys=Path(environ.get("ENVCTL_SYS_ROOT", "/sys")),
            kmod_root=Path(environ["ENVCTL_KMOD_ROOT"]) if environ.get("ENVCTL_KMOD_ROOT")
            else None,
            modprobe=environ.get("ENVCTL_MODPROBE", "modprobe"),
            rmmod=environ.get("ENVCTL_RMMOD", "rmmod"),
            gpu_root=Path(environ.get("ENVCTL_GPU_ROOT") or "/"),
        )

    @cached_property
    def boot_id(self) -> str:
        """This boot's id, which journals record ("" when the kernel does not say)."""
        try:
            return (self.proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
        except OSError:
            return ""

    def base(self, name: str) -> Path:
        """A named base directory that resources refer to instead of absolute paths."""
        return {"state": self.state_dir, "run": self.run_dir, "host": Path("/")}[name]

    @cached_property
    def sysctl(self):  # noqa: ANN201 - the adapter type lives in a lazily imported module
        from envctl.host.procfs import Sysctls

        return Sysctls(self.proc)

    @cached_property
    def netns(self):  # noqa: ANN201
        from envctl.host.netns import NetNamespaces

        return NetNamespaces(self.netns_dir)

    @cached_property
    def kmod(self):  # noqa: ANN201
        # Everything under kmod_root when set (ENVCTL_KMOD_ROOT): a fake tree in tests.
        import shlex

        from envctl.host.kmod import KernelModules

        root = self.kmod_root
        if root is not None:
            proc, sys, lib = root / "proc", root / "sys", root / "lib" / "modules"
        else:
            proc, sys, lib = self.proc, self.sys, Path("/lib/modules")
        return KernelModules(proc=proc, sys=sys, lib=lib, modprobe=shlex.split(self.modprobe),
                             rmmod=shlex.split(self.rmmod))

    @cached_property
    def cpufreq(self):  # noqa: ANN201
        from envctl.host.cpufreq import CpuFreq

        return CpuFreq(self.sys)

    @cached_property
    def cgroups(self):  # noqa: ANN201
        # ENVCTL_CGROUP_ROOT / ENVCTL_CGROUP_PARENT let tests use their own parent cgroup.
        from envctl.host.cgroups import Cgroups

        return Cgroups.from_env(proc_root=self.proc)

    @cached_property
    def systemd(self):  # noqa: ANN201
        # The systemd cgroup driver's adapter; ENVCTL_SYSTEMCTL points it at a fake systemctl.
        from envctl.host.systemd import Systemd

        return Systemd.from_env(proc_root=self.proc)

    @cached_property
    def netlink(self):  # noqa: ANN201
        from envctl.host.netlink import Netlink

        return Netlink(self.netns_dir)

    def firewall(self, backend: str):  # noqa: ANN201
        """The adapter of firewall `backend` ('nftables' or 'iptables'), made once."""
        from envctl.host.firewall import adapter

        return adapter(self, backend)
