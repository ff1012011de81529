"""envctl's own systemd units (envctl.service, envctl-monitor.service, envctl-daemon.socket and
envctl-daemon.service): rendered from the templates in systemd/ with this installation's
envctl, written to the system unit directory, enabled and removed again — only the files and
links envctl wrote.

Ownership: every file and `.wants/` link written is recorded, with the SHA-256 of the text,
in `<state>/units.json` after it is written. A unit file is envctl's when the record says so
and the file still has that text, or when it is byte-for-byte what envctl would write now (a
crash between the write and the record, a state directory restored from a backup); anything
else at that path (the operator's own unit, or envctl's edited by hand) is refused and never
overwritten or removed. Customisation goes in a drop-in (`systemctl edit envctl.service`),
which envctl never touches.

Enabling is the link `systemctl enable` makes for `[Install] WantedBy=T`:
`<unit dir>/T.wants/UNIT -> <unit dir>/UNIT`, made here with symlink(2) so it works without a
running systemd (an image build) and in a test directory; `systemctl daemon-reload` follows
when systemd is PID 1 and something changed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shlex
import stat
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from envctl.errors import HostError, InputError
from envctl.host.files import atomic_write, read_json, write_json

NAMES = ("envctl.service", "envctl-monitor.service", "envctl-retry.service",
         "envctl-daemon.socket", "envctl-daemon.service")
DEFAULT_UNIT_DIR = Path("/etc/systemd/system")
RECORD = "units.json"
# The settings that say which specs and which state envctl works on: the units must see the
# same ones as the operator's shell that installed them, or `envctl status` and the boot unit
# would disagree about what is up. Test-only knobs (fake /proc, fake systemctl) stay out.
CARRIED = ("ENVCTL_CONFIG_DIR", "ENVCTL_STATE_DIR", "ENVCTL_RUN_DIR", "ENVCTL_CGROUP_DRIVER",
           "ENVCTL_CGROUP_PARENT", "ENVCTL_FIREWALL", "ENVCTL_SOCKET")
HEADER = ("# Written by `envctl install-units` from systemd/{name}; `envctl uninstall-units` "
          "removes it.\n# Do not edit: customise it with a drop-in "
          "(systemctl edit {name}).\n")
# ExecStart=/ExecStop= lines whose command is the bare word `envctl` (after systemd's
# prefixes - @ : + !), which rendering points at this installation's envctl.
_EXEC = re.compile(r"^(Exec[A-Za-z]+=[-@:+!]*)envctl(?=\s|$)", re.MULTILINE)
_PLAIN = re.compile(r"[A-Za-z0-9_./:=@+,-]+")


# ---------------------------------------------------------------- rendering


def envctl_command(executable: str = sys.executable) -> list[str]:
    """How a unit runs this installation's envctl: the console script beside the interpreter
    (`<venv>/bin/envctl`), else `<python> -m envctl` (a checkout run without installing).

    The interpreter path is kept as given, not resolved: a venv's python is a symlink to the
    base interpreter, and resolving it would lose the venv and its packages."""
    script = Path(executable).parent / "envctl"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [executable, "-m", "envctl"]


def _shebang(script: Path) -> list[Path]:
    """The interpreter a script's `#!` line names ([] when it has none)."""
    try:
        with open(script, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return []
    words = first[2:].split() if first.startswith(b"#!") else []
    return [Path(os.fsdecode(words[0]))] if words and words[0].startswith(b"/") else []


def code_paths(command: Sequence[str], *, executable: str = sys.executable,
               prefix: str = sys.prefix, base_prefix: str = sys.base_prefix,
               package: Path = Path(__file__).resolve().parent,
               search_path: Sequence[str] = tuple(sys.path)
               ) -> tuple[list[Path], list[Path]]:
    """What the units run as root at every boot: (files checked with every directory above
    them and every symlink on the way: the command, the interpreter its `#!` names and this
    one, and each directory modules are imported from (sys.path: the stdlib, site-packages,
    what .pth files add); trees checked file by file as well: the venv when this is one, and
    the envctl package, which in an editable install is the checkout's src/envctl)."""
    first = Path(command[0])
    imported = [Path(p) for p in search_path if p.startswith("/") and os.path.isdir(p)]
    files = [first, *_shebang(first), Path(executable), *imported]
    trees = [Path(prefix)] if Path(prefix) != Path(base_prefix) else []
    # Every import directory file by file too (the stdlib, a site-packages outside the venv):
    # a module in a root-owned directory that a user owns is root code at the next boot.
    return list(dict.fromkeys(files)), list(dict.fromkeys([*trees, package, *imported]))


def _tree_problem(tree: Path, trusted: frozenset[int], *,
                  walked: set[tuple[int, int]] | None = None) -> tuple[Path, str] | None:
    """The first entry under `tree` that someone not in `trusted` could change (owned by
    them, or writable by group or others: no sticky exception inside code), with why; a
    symlink is judged by where it leads (changeable_by_others), and one that leads to a
    directory has that directory walked as well, as Python's imports would go into it
    (`walked`: the directories' (device, inode) seen, so a loop of links ends)."""
    from envctl.spec.loader import changeable_by_others

    walked = set() if walked is None else walked
    for here, dirs, names in os.walk(tree):
        try:
            st = os.stat(here)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in walked:
            dirs.clear()  # walked already (through a link, or the tree itself)
            continue
        walked.add((st.st_dev, st.st_ino))
        dirs.sort()
        for name in [*dirs, *sorted(names)]:
            path = Path(here) / name
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                bad = changeable_by_others([path], trusted=trusted)
                if bad:
                    return bad[0][1], bad[0][2]
                if os.path.isdir(path):
                    inner = _tree_problem(path.resolve(), trusted, walked=walked)
                    if inner:
                        return inner
                continue
            if st.st_uid not in trusted:
                return path, f"is owned by uid {st.st_uid}, not root"
            if st.st_mode & 0o022:
                mode = stat.S_IMODE(st.st_mode)
                return path, f"is writable by group or others (mode {mode:04o})"
    return None


def refuse_writable_code(command: Sequence[str], *, trusted: frozenset[int] | None = None,
                         **where: Any) -> None:
    """HostError (exit 1, one line; before anything is written) when anyone whose uid is not
    in `trusted` could change what the units would run as root: the executable, the
    interpreter, the venv or the envctl package (code_paths), or a directory above or a
    symlink on the way to any of them. The rule specs already follow, checked like theirs
    only when running as root, which is when it matters (`trusted` None: {0} as root, else
    nothing is checked: a user's install-units writes a unit dir of its own, not root code)."""
    from envctl.spec.loader import changeable_by_others

    if trusted is None:
        if os.geteuid() != 0:
            return
        trusted = frozenset({0})
    files, trees = code_paths(command, **where)
    found = [(q, why) for _, q, why in changeable_by_others([*files, *trees], trusted=trusted)]
    walked: set[tuple[int, int]] = set()
    for tree in trees:
        if not found:
            bad = _tree_problem(tree, trusted, walked=walked)
            found += [bad] if bad else []
    if found:
        q, why = found[0]
        raise HostError(f"install units: {q} {why}: the units run {command[0]} as root at "
                        "every boot, so only root may be able to change it, its interpreter, "
                        "venv and envctl package, and every directory above them; chown root "
                        f"and chmod go-w {q} (or install envctl where only root can write)")


def template_dir() -> Path:
    """The directory of the unit templates: systemd/ of the checkout (an editable install),
    else <prefix>/share/envctl/systemd."""
    for d in (Path(__file__).resolve().parents[2] / "systemd",
              Path(sys.prefix) / "share" / "envctl" / "systemd"):
        if (d / NAMES[0]).is_file():
            return d
    raise HostError("install units: no unit templates (systemd/envctl.service) beside the "
                    f"envctl package or under {Path(sys.prefix) / 'share/envctl/systemd'}")


def carried_environment(environ: Mapping[str, str], config_dir: str | None) -> dict[str, str]:
    """The CARRIED settings set in `environ` (paths made absolute), with --config-dir, when
    given, as ENVCTL_CONFIG_DIR."""
    env = {k: environ[k] for k in CARRIED if environ.get(k)}
    if config_dir:
        env["ENVCTL_CONFIG_DIR"] = config_dir
    for k in ("ENVCTL_CONFIG_DIR", "ENVCTL_STATE_DIR", "ENVCTL_RUN_DIR", "ENVCTL_SOCKET"):
        if k in env:
            env[k] = os.path.abspath(env[k])
    return env


def _escape(text: str, what: str) -> str:
    if any(ord(c) < 32 or c == "\x7f" for c in text):
        raise InputError(f"install units: {what} {text!r}: control characters cannot be "
                         "written into a unit file")
    # % starts a systemd specifier in both settings; \ and " are the quoting's own.
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")


def exec_word(word: str) -> str:
    """One argument of an Exec*= line, quoted so systemd reads it back unchanged."""
    if word and _PLAIN.fullmatch(word):
        return word
    return '"' + _escape(word, "argument").replace("$", "$$") + '"'


def render(name: str, template: str, command: Sequence[str],
           environment: Mapping[str, str] = {},  # noqa: B006 - read only
           socket: str | None = None, mounts: Sequence[str] = ()) -> str:
    """The unit file for `template`: the header, the template with each Exec line's `envctl`
    replaced by `command`, `environment` as Environment= lines at the top of [Service], and
    `mounts` (mount_paths) as a RequiresMountsFor= line at the end of [Unit].

    A service must run envctl; a socket unit (no [Service], no Exec lines) gets `socket`, when
    given, as its ListenStream= instead: the path the CLI and the daemon use."""
    if name.endswith(".socket"):
        text = template
        if socket is not None:
            if not socket.startswith("/"):
                raise InputError(f"install unit '{name}': ENVCTL_SOCKET {socket!r}: an "
                                 "absolute path")
            text, n = re.subn(r"^ListenStream=.*$", lambda m: "ListenStream=" + _escape(
                socket, "ENVCTL_SOCKET"), text, flags=re.MULTILINE)
            if n != 1:
                raise HostError(f"install unit '{name}': the template needs one "
                                "ListenStream= line")
        return HEADER.format(name=name) + text
    quoted = " ".join(exec_word(w) for w in command)
    text, n = _EXEC.subn(lambda m: m.group(1) + quoted, template)
    if n == 0:
        raise HostError(f"install unit '{name}': the template runs no `envctl` command")
    if mounts:
        text, n = re.subn(r"\n\n\[Service\]\n", lambda m: "\n" + MOUNTS_COMMENT
                          + _mounts_line(mounts) + "\n[Service]\n", text, count=1)
        if n == 0:
            raise HostError(f"install unit '{name}': the template has no [Service] section")
    if environment:
        lines = "".join(f'Environment="{_escape(k, "name")}={_escape(v, k)}"\n'
                        for k, v in sorted(environment.items()))
        text, n = re.subn(r"^\[Service\]\n", lambda m: m.group(0) + lines, text, count=1,
                          flags=re.MULTILINE)
        if n == 0:
            raise HostError(f"install unit '{name}': the template has no [Service] section")
    return HEADER.format(name=name) + text


def mount_paths(specs: Sequence[Any], *other: str) -> list[str]:
    """What envctl.service needs mounted before `up --all` (its RequiresMountsFor=): each
    spec's absolute mount sources (relative ones live in the state directory) and `other`
    (the state and config directories), deduplicated, in order."""
    paths = [m.source for s in specs for m in s.mounts if m.source.startswith("/")]
    return list(dict.fromkeys(os.path.normpath(p) for p in [*paths, *other] if p))


MOUNTS_COMMENT = ("# Written by install-units from the specs' absolute mount sources, the "
                  "state and config\n# directories (docs/boot.md): run it again after "
                  "adding a data source.\n")


def _mounts_line(paths: Sequence[str]) -> str:
    words = [p if _PLAIN.fullmatch(p) else '"' + _escape(p, "mount path") + '"' for p in paths]
    return f"RequiresMountsFor={' '.join(words)}\n"


def wanted_by(text: str) -> list[str]:
    """The targets of [Install] WantedBy= in a unit file's text."""
    targets: list[str] = []
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Install]" and line.startswith("WantedBy="):
            targets += line.split("=", 1)[1].split()
    return targets


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- installing


@dataclass(frozen=True)
class Change:
    """One thing install/uninstall did or found: `action` is wrote, rewrote, kept, enabled,
    removed, disabled, reloaded, started, stopped."""

    action: str
    unit: str
    path: str = ""

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.action} {self.unit}" + (f" ({self.path})" if self.path else "")


class Units:
    """envctl's units in `unit_dir`, recorded in `<state_dir>/units.json`."""

    def __init__(self, unit_dir: Path, state_dir: Path, *,
                 systemctl: Sequence[str] = ("systemctl",), booted: bool | None = None):
        self.unit_dir = unit_dir
        self.record_path = state_dir / RECORD
        self.systemctl = list(systemctl)
        # sd_booted(3): systemd is PID 1 when /run/systemd/system is a directory.
        self.booted = Path("/run/systemd/system").is_dir() if booted is None else booted

    @classmethod
    def from_env(cls, state_dir: Path, unit_dir: str | None = None,
                 environ: Mapping[str, str] = os.environ) -> Units:
        """--unit-dir, else $ENVCTL_BOOT_UNIT_DIR, else /etc/systemd/system;
        ENVCTL_SYSTEMCTL (shlex-split argv) points tests at a fake systemctl."""
        return cls(Path(unit_dir or environ.get("ENVCTL_BOOT_UNIT_DIR") or DEFAULT_UNIT_DIR),
                   state_dir, systemctl=shlex.split(environ.get("ENVCTL_SYSTEMCTL", "systemctl")))

    # -- the record
    def _record(self) -> dict[str, Any]:
        try:
            rec = read_json(self.record_path)
        except (OSError, ValueError) as exc:
            raise HostError(f"read unit record '{self.record_path}': {exc}") from exc
        return rec if isinstance(rec, dict) and isinstance(rec.get("units"), dict) \
            else {"units": {}}

    def _save(self, rec: dict[str, Any]) -> None:
        try:
            if rec["units"]:
                write_json(self.record_path, rec)
            else:
                self.record_path.unlink(missing_ok=True)
        except OSError as exc:
            raise HostError(f"write unit record '{self.record_path}': {exc.strerror}") from exc

    # -- install
    def install(self, texts: Mapping[str, str], *, now: bool = False) -> list[Change]:
        """Write each unit (name -> text) and its WantedBy links; a no-op for what is already
        so. Everything is checked before the first write: a foreign file or link stops it all.
        """
        rec = self._record()
        plan: list[tuple[str, str, str]] = []  # (name, action, text)
        for name, text in texts.items():
            plan.append((name, self._decide(name, text, rec), text))
        links = {name: [self._link(name, t) for t in wanted_by(text)]
                 for name, _, text in plan}
        for name, targets in links.items():
            for link in targets:
                self._check_link(name, link)

        changes: list[Change] = []
        for name, action, text in plan:
            path = self.unit_dir / name
            entry = rec["units"].setdefault(name, {"path": str(path), "links": []})
            if action == "kept":
                changes.append(Change("kept", name, str(path)))
            else:
                self._write(name, path, text)
                changes.append(Change(action, name, str(path)))
            entry["path"], entry["sha256"] = str(path), _sha(text.encode())
            self._save(rec)
            for link in links[name]:
                made_dir = not link.parent.is_dir()
                if self._enable(name, link):
                    changes.append(Change("enabled", name, str(link)))
                if made_dir:  # removed again with the last link in it
                    entry.setdefault("dirs", []).append(str(link.parent))
                if str(link) not in entry["links"]:
                    entry["links"].append(str(link))
                self._save(rec)
        if any(c.action != "kept" for c in changes):
            changes += self._reload()
        if now:
            if not self.booted:
                raise HostError("install units --now: systemd is not running here; the units "
                                "were installed and start at the next boot")
            self._ctl("start", *texts)
            changes += [Change("started", n) for n in texts]
        return changes

    def _decide(self, name: str, text: str, rec: dict[str, Any]) -> str:
        """wrote (nothing there), kept (already this text), rewrote (envctl's older text);
        HostError for a file envctl did not write, or one edited since."""
        path = self.unit_dir / name
        old = rec["units"].get(name)
        if old and old.get("path") != str(path) and _exists(Path(old["path"])):
            raise HostError(f"install unit '{name}': envctl installed it as {old['path']}; "
                            "run `envctl uninstall-units` first to move it")
        have = _read(path)
        if have is None:
            return "wrote"
        if have == text.encode():
            return "kept"  # ours, or byte-for-byte what we write: adopted
        if old and old.get("path") == str(path) and old.get("sha256") == _sha(have):
            return "rewrote"
        raise HostError(f"install unit '{name}': {path} exists and envctl did not write it "
                        "(or it was edited since): remove it, or put local settings in a "
                        f"drop-in (systemctl edit {name})")

    def _link(self, name: str, target: str) -> Path:
        return self.unit_dir / f"{target}.wants" / name

    def _check_link(self, name: str, link: Path) -> None:
        try:
            dest = os.readlink(link)
        except FileNotFoundError:
            return
        except OSError as exc:  # EINVAL: a file, not a link
            raise HostError(f"enable unit '{name}': {link} exists and is not a link") from exc
        if dest != str(self.unit_dir / name):
            raise HostError(f"enable unit '{name}': {link} points to {dest}, not to the unit "
                            "envctl installs: remove it first")

    def _write(self, name: str, path: Path, text: str) -> None:
        try:
            atomic_write(path, text.encode(), mode=0o644)
        except OSError as exc:
            raise HostError(f"install unit '{name}': write {path}: {exc.strerror}") from exc

    def _enable(self, name: str, link: Path) -> bool:
        """The WantedBy link; False when it is already there (checked by _check_link)."""
        try:
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(self.unit_dir / name, link)
        except FileExistsError:
            return False
        except OSError as exc:
            raise HostError(f"enable unit '{name}': link {link}: {exc.strerror}") from exc
        return True

    # -- uninstall
    def uninstall(self, *, now: bool = False) -> list[Change]:
        """Disable and remove the units envctl installed (a no-op when there are none). A
        unit file edited since envctl wrote it stops it all, before anything is removed."""
        rec = self._record()
        units = rec["units"]
        for name, entry in units.items():
            have = _read(Path(entry["path"]))
            if have is not None and _sha(have) != entry.get("sha256"):
                raise HostError(f"uninstall unit '{name}': {entry['path']} was changed since "
                                "envctl wrote it: move it aside or restore it, then run this "
                                "again")
        changes: list[Change] = []
        if now and units and self.booted:
            self._ctl("stop", *units)
            changes += [Change("stopped", n) for n in units]
        for name in list(units):
            entry = units[name]
            for link in list(entry.get("links", [])):
                if _unlink_if(Path(link), entry["path"]):
                    changes.append(Change("disabled", name, link))
                entry["links"].remove(link)
            for d in entry.get("dirs", []):
                with contextlib.suppress(OSError):  # ENOTEMPTY: someone else's links too
                    os.rmdir(d)
            if _unlink_if(Path(entry["path"]), None):
                changes.append(Change("removed", name, entry["path"]))
            del units[name]
            self._save(rec)
        if changes:
            changes += self._reload()
        return changes

    # -- systemctl
    def _reload(self) -> list[Change]:
        if not self.booted:
            return []  # no systemd running (an image build): it reads the files at boot
        self._ctl("daemon-reload")
        return [Change("reloaded", "systemd")]

    def _ctl(self, *args: str) -> None:
        argv = [*self.systemctl, *args]
        try:
            res = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        except OSError as exc:
            raise HostError(f"units: {argv[0]}: {exc.strerror}") from exc
        if res.returncode != 0:
            cause = (res.stderr or res.stdout).strip().splitlines()
            raise HostError(f"units: systemctl {' '.join(args)}: "
                            f"{cause[-1] if cause else f'exit status {res.returncode}'}")


def _read(path: Path) -> bytes | None:
    """A unit file's bytes; None when nothing is there. A link or a directory is never
    envctl's (it writes plain files): its 'content' is the link target, so it never matches."""
    try:
        if path.is_symlink():
            return b"symlink:" + os.readlink(path).encode()
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return b"directory"
    except OSError as exc:
        raise HostError(f"units: read {path}: {exc.strerror}") from exc


def _exists(path: Path) -> bool:
    return os.path.lexists(path)


def _unlink_if(path: Path, points_to: str | None) -> bool:
    """Remove `path` (when `points_to` is given: only a link to it); False when it is not
    there, or is a link somewhere else (the operator's: kept)."""
    try:
        if points_to is not None and os.readlink(path) != points_to:
            return False
        path.unlink()
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        if points_to is not None and exc.errno == errno.EINVAL:  # EINVAL: not a link, not ours
            return False
        raise HostError(f"uninstall: remove {path}: {exc.strerror}") from exc
    return True


def render_all(command: Sequence[str], environment: Mapping[str, str],
               templates: Path | None = None, mounts: Sequence[str] = ()) -> dict[str, str]:
    """Every unit of NAMES rendered from its template; the socket unit listens where
    `environment`'s ENVCTL_SOCKET says (else the template's /run/envctl/envctl.sock);
    envctl.service requires `mounts` mounted (RequiresMountsFor=)."""
    d = templates or template_dir()
    out = {}
    for name in NAMES:
        try:
            template = (d / name).read_text()
        except OSError as exc:
            raise HostError(f"install unit '{name}': read {d / name}: {exc.strerror}") from exc
        out[name] = render(name, template, command, environment,
                           socket=environment.get("ENVCTL_SOCKET"),
                           mounts=mounts if name == "envctl.service" else ())
    return out
