"""What `envctl gpus` does, without rendering: this host's NVIDIA GPUs, which environment holds
each (from the journals), and the CDI spec file for container runtimes, which `up` and `down`
keep in step with the journals (`sync_cdi`).

Read-only except `sync_cdi`, the one file envctl writes here: by `up`, `down` and `gpus --cdi`.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envctl.errors import ForeignObject, HostError, StateCorrupt, UsageError
from envctl.facts import GpuHostFacts
from envctl.host.facts import read_gpus
from envctl.host.gpus import device_nodes

if TYPE_CHECKING:
    from envctl.host.context import Host

DEFAULT_CDI_DIR = Path("/etc/cdi")
CDI_FILE = "envctl.yaml"
CDI_RECORD = "cdi.json"  # under the state directory: digests of the CDI files envctl wrote
HOOK_PATHS = ("/usr/bin/nvidia-cdi-hook", "/usr/local/bin/nvidia-cdi-hook")


def cdi_path(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """Where `--cdi` writes: <ENVCTL_CDI_DIR, default /etc/cdi>/envctl.yaml."""
    return Path(environ.get("ENVCTL_CDI_DIR") or DEFAULT_CDI_DIR) / CDI_FILE


@dataclass
class GpuSurvey:
    """One look at the host: its GPU facts and which environment holds which GPU."""

    facts: GpuHostFacts
    holders: dict[str, list[str]] = field(default_factory=dict)  # env -> UUIDs it holds
    # env -> its GPU device nodes as its /dev has them (the journalled env-dev step):
    # (name under /dev, major or its /proc/devices name, minor, mode, gid)
    nodes: dict[str, list[tuple]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # damaged journals, vanished GPUs
    leaving: set[str] = field(default_factory=set)  # holders whose `down` began: not in CDI


def _digest(data: bytes) -> str:
    # hashlib (OpenSSL's, ~3 ms to import) only where a CDI file is read or written: a plain
    # `envctl gpus` never needs it.
    import hashlib

    return hashlib.sha256(data).hexdigest()


def survey(host: Host, root: Path, *, libraries: bool = True) -> GpuSurvey:
    """Discover the GPUs under `root` (NVML as ENVCTL_NVML says) and read every journal's GPU
    claim. An environment holds the GPUs of its claim while its journal has entries: claims
    go with the last entry, and entries of another boot are dropped when it is opened.
    `libraries`: also find the driver's libraries (ld.so.cache, ELF headers), which only the
    CDI spec needs."""
    facts = read_gpus(root, libraries=libraries)
    out = GpuSurvey(facts)
    by_index = {g.index: g.uuid for g in facts.gpus}
    known = set(by_index.values()) | set(facts.migs())
    # The journals as the monitor reads them (runtime.context), not through Journal.open:
    # rebuilding every entry imports the engine and each resource kind (~12 ms of `gpus`).
    from envctl.runtime.context import journal_names, read_journal_meta

    for env in journal_names(host.state_dir):
        try:
            found, meta = read_journal_meta(host.state_dir, env, host.boot_id)
        except (StateCorrupt, UsageError) as exc:
            out.warnings.append(f"journal of '{env}' not read: {exc}")
            continue
        claim = (meta.get("claims") or {}).get("gpus")
        if not found or not isinstance(claim, dict):  # no entry left in this boot
            continue
        uuids = [u for u in claim.get("uuids") or [] if isinstance(u, str)]
        if not uuids:
            if claim.get("all"):
                uuids = [g.uuid for g in facts.gpus]
            else:
                uuids = [by_index[i] for i in claim.get("indices") or [] if i in by_index]
        gone = [u for u in uuids if u not in known]
        if gone:
            out.warnings.append(f"environment '{env}' holds {', '.join(gone)}, which this "
                                "host does not show")
        held = [u for u in uuids if u in known and u]
        if held:
            out.holders[env] = held
            if meta.get("down"):
                out.leaving.add(env)
            dev = found.get("env-dev")
            if dev is not None:
                out.nodes[env] = [tuple(n) for n in dev.get("nodes", [])]
    return out


def gpu_report(host: Host, root: Path, *, found: GpuSurvey | None = None) -> dict[str, Any]:
    """The driver, each GPU (index, uuid, name, minor, memory, mig, pci) with the environment
    holding it (None when free), the majors and device nodes, and what went wrong looking."""
    from envctl.engine import quarantine
    from envctl.host.gpuhealth import probe

    found = found or survey(host, root)
    facts = found.facts
    owner = {u: env for env, uuids in found.holders.items() for u in uuids}
    try:
        ledger = quarantine.load(host.state_dir)
    except StateCorrupt as exc:
        ledger = quarantine.Quarantine()
        found.warnings.append(str(exc))
    live: dict[str, list[str]] = {}  # found unfit now, not yet in the ledger (`up` records it)
    for f in ledger.fresh(probe(root, facts)[0], host.boot_id):
        if f.detail not in ledger.reason(f.uuid):
            live.setdefault(f.uuid, []).append(f.detail)

    def health(uuid: str) -> dict[str, Any] | None:
        item = ledger.gpus.get(uuid)
        if item is None and uuid not in live:
            return None
        return {"quarantined": item is not None, "since": (item or {}).get("since"),
                "evidence": [e.get("detail") for e in (item or {}).get("evidence", [])],
                "found_now": live.get(uuid, [])}

    def access(minor: int | None) -> str | None:
        return None if minor is None else f"/dev/nvidia-caps/nvidia-cap{minor}"

    return {
        "driver": facts.driver,
        "source": facts.source,
        "gpus": [{"index": g.index, "uuid": g.uuid, "name": g.name, "minor": g.minor,
                  "memory": g.memory_bytes, "mig": g.mig, "mig_pending": g.mig_pending,
                  "pci": g.pci, "env": owner.get(g.uuid), "health": health(g.uuid),
                  "instances": [{"uuid": m.uuid, "gi": m.gi, "ci": m.ci, "profile": m.profile,
                                 "profile_id": m.profile_id,
                                 "placement": {"start": m.start, "size": m.size},
                                 "memory": m.memory_bytes,
                                 "access": [access(m.gi_minor), access(m.ci_minor)],
                                 "env": owner.get(m.uuid)} for m in g.mig_devices]}
                 for g in facts.gpus],
        "majors": dict(facts.majors),
        "nodes": {f"/dev/{name}": list(mm) for name, mm in device_nodes(root).items()},
        "problems": list(facts.problems),
        "warnings": list(found.warnings),
    }


def holds_gpus(host: Host) -> bool:
    """Whether any journal claims GPUs (without looking at the GPUs: NVML is slow to load)."""
    from envctl.engine.journal import Journal

    for env in Journal.environments(host.state_dir):
        try:
            journal = Journal.open(host.state_dir, env, boot=host.boot_id)
        except (StateCorrupt, UsageError):
            continue
        claim = journal.claims.get("gpus")
        if journal.entries and isinstance(claim, dict) and (
                claim.get("all") or claim.get("uuids") or claim.get("indices")):
            return True
    return False


@dataclass
class CdiSync:
    """What `sync_cdi` did to the CDI file: "written", "kept" (already so), "removed",
    "absent" (none held, none there) or "foreign" (none held; a file envctl did not write is
    there, left alone), and the devices it lists."""

    path: Path
    action: str
    devices: list[str] = field(default_factory=list)


def sync_cdi(host: Host, root: Path, path: Path, *, leaving: Iterable[str] = (),
             found: GpuSurvey | None = None) -> CdiSync:
    """Make the CDI file at `path` list what the environments hold now, less those in
    `leaving` (about to go down) and those whose `down` began: written atomically (a temporary
    file, fsynced, renamed over it, mode 0644) when its content changes, removed when none is
    held. Only a file envctl wrote is replaced or removed (its digest is in the state
    directory's record, put there before the file): ForeignObject otherwise, nothing changed.

    Called under the global lock by `up` (after it) and `down` (before and after it), so that
    the file never lists a GPU for an environment that no longer holds it."""
    from envctl.plan.cdi import cdi_spec

    gone = set(leaving)
    if found is None and not holds_gpus(host) and not os.path.lexists(path):
        return CdiSync(path, "absent")  # the common case of a host without GPUs: no NVML
    found = found or survey(host, root)
    holders = {env: uuids for env, uuids in found.holders.items()
               if env not in gone and env not in found.leaving}
    current = _read_cdi(path)
    record = _read_record(host)
    owned = current is None or _digest(current) in record.get(str(path), [])
    if not holders:
        if current is None:
            return CdiSync(path, "absent")
        if not owned:
            return CdiSync(path, "foreign")  # not envctl's to remove; it lists nothing of ours
        _unlink(path)
        _write_record(host, {**record, str(path): []})
        return CdiSync(path, "removed")
    spec = cdi_spec(holders, found.facts, dev_root=str(root / "dev"), nodes=found.nodes,
                    hook=_hook_binary(root))
    names = [d["name"] for d in spec["devices"]]
    import yaml

    data = yaml.safe_dump(spec, sort_keys=False, default_flow_style=False).encode()
    if current == data:
        return CdiSync(path, "kept", names)
    _refuse_foreign(path, owned)
    digest = _digest(data)
    # The new digest on record first: a crash after it leaves a file envctl still knows.
    mine = [] if current is None else [_digest(current)]
    _write_record(host, {**record, str(path): [*mine, digest]})
    from envctl.host.files import atomic_write

    try:
        atomic_write(path, data, mode=0o644)
        # The temporary file was created through the umask; runtimes read it as any user.
        if path.stat().st_mode & 0o7777 != 0o644:
            os.chmod(path, 0o644)
    except OSError as exc:
        raise HostError(f"write CDI spec '{path}': {exc.strerror or exc}") from exc
    _write_record(host, {**record, str(path): [digest]})
    return CdiSync(path, "written", names)


def written_cdi_paths(host: Host) -> list[Path]:
    """The CDI files envctl wrote and has not removed (the state directory's record)."""
    return [Path(p) for p in _read_record(host)]


def remove_cdi(host: Host, path: Path) -> None:
    """Remove the CDI file when envctl wrote it (the fallback of a `down` that could not
    rewrite it); a file envctl did not write stays."""
    current = _read_cdi(path)
    record = _read_record(host)
    if current is None or _digest(current) not in record.get(str(path), []):
        return
    _unlink(path)
    _write_record(host, {**record, str(path): []})


def write_cdi(host: Host, root: Path, path: Path, *, found: GpuSurvey | None = None) -> Path:
    """`envctl gpus --cdi`: `sync_cdi` now. UsageError when no environment holds a GPU (a CDI
    spec must list a device), after removing a file envctl wrote earlier."""
    done = sync_cdi(host, root, path, found=found)
    if done.action in ("absent", "removed", "foreign"):
        raise UsageError(f"no environment holds a GPU, and a CDI spec needs at least one "
                         f"device: nothing written to {path}")
    return path


def _hook_binary(root: Path) -> str | None:
    """nvidia-ctk's hook binary on this host (under the GPU root), as the runtime will run it."""
    for p in HOOK_PATHS:
        try:
            st = os.stat(str(root) + p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
            return str(root) + p if str(root) != "/" else p
    return None


def _read_cdi(path: Path) -> bytes | None:
    """The CDI file's bytes; None when there is none. A symlink there is not envctl's file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ForeignObject(f"CDI spec '{path}' is a symlink, not a file envctl wrote: "
                                "left as it is") from exc
        raise HostError(f"read CDI spec '{path}': {exc.strerror or exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ForeignObject(f"CDI spec '{path}' is not a regular file: left as it is")
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _refuse_foreign(path: Path, owned: bool) -> None:
    if not owned:
        raise ForeignObject(f"CDI spec '{path}' was not written by envctl (or was changed since):"
                            " left as it is; move it away for envctl to keep it in step")


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # gone already: what removal wants
        pass
    except OSError as exc:
        raise HostError(f"remove CDI spec '{path}': {exc.strerror or exc}") from exc


def _read_record(host: Host) -> dict[str, list[str]]:
    try:
        data = json.loads((host.state_dir / CDI_RECORD).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise HostError(f"read state file '{host.state_dir / CDI_RECORD}': {exc}") from exc
    if not isinstance(data, dict):
        raise HostError(f"read state file '{host.state_dir / CDI_RECORD}': not an object")
    return {k: [d for d in v if isinstance(d, str)] for k, v in data.items()
            if isinstance(v, list)}


def _write_record(host: Host, record: dict[str, list[str]]) -> None:
    from envctl.host.files import atomic_write

    kept = {k: v for k, v in record.items() if v}
    if not kept:  # no CDI file of envctl's left: no record either (no residue)
        try:
            (host.state_dir / CDI_RECORD).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise HostError(f"remove state file '{host.state_dir / CDI_RECORD}': "
                            f"{exc.strerror or exc}") from exc
        return
    data = json.dumps(kept, indent=1).encode()
    try:
        atomic_write(host.state_dir / CDI_RECORD, data, mode=0o600)
    except OSError as exc:
        raise HostError(f"write state file '{host.state_dir / CDI_RECORD}': "
                        f"{exc.strerror or exc}") from exc


def clear_gpu(host: Host, root: Path, gpu: str) -> tuple[str, dict[str, Any]]:
    """Release a quarantined GPU (`gpu`: its index or UUID) after the operator's reset: (its
    UUID, the entry removed). XIDs the kernel logged before now are not held against it again
    in this boot. UsageError when no such GPU is quarantined."""
    from envctl.engine import quarantine
    from envctl.host.gpuhealth import read_kmsg

    ledger = quarantine.load(host.state_dir)
    from envctl.text import ascii_digits

    uuid = gpu
    if ascii_digits(gpu):
        by_index = {int(item.get("index", -1)): u for u, item in ledger.gpus.items()}
        uuid = by_index.get(int(gpu), "")
    if uuid not in ledger.gpus:
        held = ", ".join(f"{item.get('index', '?')} ({u})" for u, item in ledger.gpus.items())
        raise UsageError(f"gpus --clear: GPU '{gpu}' is not quarantined (quarantined: "
                         f"{held or 'none'})")
    seqs = [int(r.split(",")[1]) for r in read_kmsg(root)
            if r.count(",") >= 2 and r.split(",")[1].isdigit()]
    item = quarantine.clear(host.state_dir, uuid, boot=host.boot_id, seq=max(seqs, default=0))
    return uuid, item or {}
