"""What `envctl gpus` does, without rendering: this host's NVIDIA GPUs, which environment holds
each (from the journals), and the CDI spec file for container runtimes.

Read-only except `write_cdi`, the one file the command writes when asked (`--cdi`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envctl.engine.journal import Journal
from envctl.errors import HostError, StateCorrupt, UsageError
from envctl.facts import GpuHostFacts
from envctl.host.facts import read_gpus
from envctl.host.gpus import device_nodes

if TYPE_CHECKING:
    from envctl.host.context import Host

DEFAULT_CDI_DIR = Path("/etc/cdi")
CDI_FILE = "envctl.yaml"


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


def survey(host: Host, root: Path) -> GpuSurvey:
    """Discover the GPUs under `root` (NVML as ENVCTL_NVML says) and read every journal's GPU
    claim. An environment holds the GPUs of its claim while its journal has entries: claims
    go with the last entry, and entries of another boot are dropped when it is opened."""
    facts = read_gpus(root)
    out = GpuSurvey(facts)
    by_index = {g.index: g.uuid for g in facts.gpus}
    known = set(by_index.values()) | set(facts.migs())
    for env in Journal.environments(host.state_dir):
        try:
            journal = Journal.open(host.state_dir, env, boot=host.boot_id)
        except (StateCorrupt, UsageError) as exc:
            out.warnings.append(f"journal of '{env}' not read: {exc}")
            continue
        claim = journal.claims.get("gpus")
        if not journal.entries or not isinstance(claim, dict):
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
            dev = next((e.resource for e in journal.entries
                        if e.resource.get("kind") == "env-dev"), None)
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


def write_cdi(host: Host, root: Path, path: Path, *, found: GpuSurvey | None = None) -> Path:
    """Write the CDI spec of the GPUs environments hold to `path` (YAML): a temporary file in
    the same directory, fsynced, renamed over it, mode 0644; the directory is made if missing.
    UsageError when no environment holds a GPU (a CDI spec must list a device)."""
    from envctl.host.files import atomic_write
    from envctl.plan.cdi import cdi_spec

    found = found or survey(host, root)
    if not found.holders:
        raise UsageError(f"no environment holds a GPU, and a CDI spec needs at least one "
                         f"device: nothing written to {path}")
    spec = cdi_spec(found.holders, found.facts, dev_root=str(root / "dev"), nodes=found.nodes)
    import yaml

    data = yaml.safe_dump(spec, sort_keys=False, default_flow_style=False).encode()
    try:
        atomic_write(path, data, mode=0o644)
        # The temporary file was created through the umask; runtimes read it as any user.
        if path.stat().st_mode & 0o7777 != 0o644:
            os.chmod(path, 0o644)
    except OSError as exc:
        raise HostError(f"write CDI spec '{path}': {exc.strerror or exc}") from exc
    return path


def clear_gpu(host: Host, root: Path, gpu: str) -> tuple[str, dict[str, Any]]:
    """Release a quarantined GPU (`gpu`: its index or UUID) after the operator's reset: (its
    UUID, the entry removed). XIDs the kernel logged before now are not held against it again
    in this boot. UsageError when no such GPU is quarantined."""
    from envctl.engine import quarantine
    from envctl.host.gpuhealth import read_kmsg

    ledger = quarantine.load(host.state_dir)
    uuid = gpu
    if gpu.isdigit():
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
