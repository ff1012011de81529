"""Kernel modules: what /proc/modules, /sys/module and /lib/modules say, and modprobe/rmmod."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from envctl.errors import HostError

LOADED, BUILTIN, ABSENT = "loaded", "builtin", "absent"
_SUFFIXES = (".ko", ".ko.xz", ".ko.zst", ".ko.gz")


def canonical(name: str) -> str:
    """The kernel's spelling of a module name: '-' and '_' are the same, /proc shows '_'."""
    return name.replace("-", "_")


def _module_of(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    for suffix in _SUFFIXES:
        if base.endswith(suffix):
            return canonical(base[: -len(suffix)])
    return canonical(base)


@dataclass(frozen=True)
class Usage:
    """One line of /proc/modules: how many references and which modules depend on it."""

    refcount: int | None  # None: the kernel prints '-' (the module cannot be unloaded)
    holders: tuple[str, ...]

    @property
    def in_use(self) -> bool:
        return self.refcount is None or self.refcount > 0 or bool(self.holders)


@dataclass(frozen=True)
class Availability:
    """Whether the module can be loaded on this kernel; `reason` says why not. `deps` and
    `post` are what `modprobe NAME` loads before and after it, in its order: the modules.dep
    dependencies and soft dependencies (`soft` names the latter); `note` says what envctl
    cannot follow (an install command)."""

    ok: bool
    deps: tuple[str, ...] = ()
    reason: str = ""
    post: tuple[str, ...] = ()
    soft: tuple[str, ...] = ()
    note: str = ""


def parse_proc_modules(text: str) -> dict[str, Usage]:
    """`name size refcount users state address` per line; users is `a,b,` or `-`."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        refcount = int(parts[2]) if parts[2].isdigit() else None
        holders = tuple(h for h in parts[3].split(",") if h and h != "-")
        out[parts[0]] = Usage(refcount, holders)
    return out


def parse_modules_dep(text: str, name: str) -> tuple[str, ...] | None:
    """The dependencies of `name` (load order: deepest first), or None when it is not listed."""
    want = canonical(name)
    for line in text.splitlines():
        path, sep, deps = line.partition(":")
        if sep and _module_of(path) == want:
            # modules.dep lists a module's dependencies nearest first; modprobe loads the last
            # one first.
            return tuple(reversed([_module_of(d) for d in deps.split()]))
    return None


def parse_show_depends(text: str) -> tuple[str | None, ...]:
    """What `modprobe --show-depends` prints, in load order: one module per `insmod PATH
    [OPTIONS]` line, None per `install COMMAND` line (modprobe would run a command, which may
    load anything); `builtin NAME` lines are left out (in the kernel image: nothing to load)."""
    out: list[str | None] = []
    for line in text.splitlines():
        word, _, rest = line.partition(" ")
        if word == "insmod" and rest.split():
            out.append(_module_of(rest.split()[0]))
        elif word == "install":
            out.append(None)
    return tuple(out)


class KernelModules:
    """The module adapter. `root` (tests: a fake tree) holds proc/modules, sys/module and
    lib/modules; `modprobe` and `rmmod` are argv prefixes (tests: a fake script)."""

    def __init__(self, *, proc: Path, sys: Path, lib: Path, release: str | None = None,
                 modprobe: Sequence[str] = ("modprobe",), rmmod: Sequence[str] = ("rmmod",)):
        self.proc_modules = proc / "modules"
        self.sys_module = sys / "module"
        self.lib = lib
        self.release = release or os.uname().release
        self.modprobe = tuple(modprobe)
        self.rmmod = tuple(rmmod)

    # ------------------------------------------------------------------ read-only

    @property
    def tree(self) -> Path:
        return self.lib / self.release

    def loadable(self) -> bool:
        """Whether the kernel supports loadable modules at all (CONFIG_MODULES)."""
        return self.proc_modules.exists()

    def loaded(self) -> dict[str, Usage]:
        try:
            return parse_proc_modules(self.proc_modules.read_text())
        except FileNotFoundError:
            return {}  # no loadable-module support: nothing is loaded, built-ins may exist
        except OSError as exc:
            raise HostError(f"read kernel modules '{self.proc_modules}': {exc.strerror}") from exc

    def state(self, name: str) -> str:
        """LOADED (in /proc/modules), BUILTIN (in the kernel image) or ABSENT."""
        name = canonical(name)
        if name in self.loaded():
            return LOADED
        # A built-in shows in /sys/module only when it has parameters or a version, and has
        # no `initstate` (that file belongs to loaded modules); modules.builtin lists them all.
        sysdir = self.sys_module / name
        if sysdir.is_dir() and not (sysdir / "initstate").exists():
            return BUILTIN
        if name in self._builtin_list():
            return BUILTIN
        return ABSENT

    def usage(self, name: str) -> Usage | None:
        return self.loaded().get(canonical(name))

    def _builtin_list(self) -> set[str]:
        try:
            text = (self.tree / "modules.builtin").read_text()
        except OSError:
            return set()
        return {_module_of(line.strip()) for line in text.splitlines() if line.strip()}

    def availability(self, name: str) -> Availability:
        """Whether modprobe could load `name` here (modules.dep), and what else it would load
        (its soft dependencies: `modprobe --show-depends`, a dry run that changes nothing)."""
        if not self.tree.is_dir():
            return Availability(False, reason=f"{self.tree} does not exist (no modules are "
                                              "installed for this kernel)")
        try:
            text = (self.tree / "modules.dep").read_text()
        except FileNotFoundError:
            return self._scan(name)
        except OSError as exc:
            return Availability(False, reason=f"cannot read {self.tree}/modules.dep: "
                                              f"{exc.strerror}")
        deps = parse_modules_dep(text, name)
        if deps is None:
            return Availability(False, reason=f"no file for it under {self.tree} "
                                              "(not in modules.dep)")
        if not self.loadable():
            return Availability(False, reason=f"kernel {self.release} has no loadable-module "
                                              f"support ({self.proc_modules} is missing)")
        return self._with_softdeps(name, deps)

    def _with_softdeps(self, name: str, deps: tuple[str, ...]) -> Availability:
        """Split modprobe's own load order around `name`. modprobe loads a module's `pre:`
        softdeps before it and its `post:` ones after it, for it and for each of its
        dependencies (kmod's probe list, libkmod-module.c), so envctl plans each module of
        that order as a resource of its own, in that order: each is snapshotted just before
        it is loaded, and teardown (the reverse) unloads a post softdep before the module it
        follows. Without softdeps it is modules.dep alone, as before."""
        try:
            order = self.show_depends(name)
        except HostError as exc:
            return Availability(True, deps, note=f"its soft dependencies are unknown ({exc})")
        if None in order:
            # An install command runs instead of a plain load: it may load anything.
            return Availability(True, deps, note=(
                f"modprobe's configuration runs an install command when loading it or a "
                f"module it needs (modprobe --show-depends {name}); what that command loads "
                "is not tracked"))
        seen = list(dict.fromkeys(m for m in order if m is not None))  # first place wins
        want = canonical(name)
        soft = tuple(m for m in seen if m != want and m not in deps)
        if want not in seen or not soft:
            return Availability(True, deps)
        at = seen.index(want)
        return Availability(True, tuple(seen[:at]), post=tuple(seen[at + 1:]), soft=soft)

    def show_depends(self, name: str) -> tuple[str | None, ...]:
        """`modprobe --show-depends NAME`: what loading `name` would load, in order (see
        parse_show_depends). Read-only: modprobe prints and changes nothing."""
        return parse_show_depends(self._run("read", name, "modprobe --show-depends",
                                            [*self.modprobe, "--show-depends", name]))

    def _scan(self, name: str) -> Availability:
        # No modules.dep (depmod never ran): look for the file itself; dependencies unknown.
        want = canonical(name)
        for _dirpath, _dirs, files in os.walk(self.tree):
            if any(f.endswith(_SUFFIXES) and _module_of(f) == want for f in files):
                return Availability(True)
        return Availability(False, reason=f"no file for it under {self.tree}")

    # ------------------------------------------------------------------ changes

    def load(self, name: str, options: Sequence[str] = (), *, alone: bool = False) -> None:
        """modprobe NAME [OPT=VAL …]: dependencies first, as kmod resolves them. `alone`: not
        its own soft dependencies (they are loaded as resources of their own): kmod's
        --ignore-install leaves out the named module's softdeps and its install command, and
        kmod ignores the install command of a module that has softdeps anyway."""
        flags = ["--ignore-install"] if alone else []
        self._run("load", name, "modprobe", [*self.modprobe, *flags, name, *options])

    def unload(self, name: str) -> None:
        """rmmod NAME: this module only. `modprobe -r` would also drop unused dependencies,
        which may be modules the host had before envctl."""
        self._run("unload", name, "rmmod", [*self.rmmod, canonical(name)])

    def _run(self, action: str, name: str, tool: str, argv: list[str]) -> str:
        """Run `argv`; its stdout, or HostError naming the action, the module and the cause."""
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        except FileNotFoundError as exc:
            raise HostError(f"{action} kernel module '{name}': {tool}: not installed "
                            "(Debian package kmod)") from exc
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise HostError(f"{action} kernel module '{name}': {tool}: {exc}") from exc
        if res.returncode != 0:
            cause = (res.stderr or res.stdout).strip().splitlines()
            raise HostError(f"{action} kernel module '{name}': {tool}: "
                            f"{cause[-1] if cause else f'exit status {res.returncode}'}")
        return res.stdout
