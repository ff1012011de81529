"""`envctl list`: one row per environment (its state, address, published ports, CPU and memory
limits, memory in use, GPUs, jobs, description), from the specs, the journals and one read of
each environment's cgroup files, never the per-resource checks of `status`; and the same
state words, and the limits in the spec's units, for `status` and `plan`.

States, from the quickest evidence that is still honest (docs/lifecycle.md):
- up: applied in this boot, every step finished, its network namespace, cgroup and service
  (where it has them) there, and its spec says what `up` applied (the digest `up` recorded);
- not-applied: as up, but its spec says something else now: `envctl up NAME` would apply the
  difference (`envctl plan NAME` shows it);
- degraded: applied in this boot, but a step was left half done (a failed or interrupted
  `up`), its journal cannot be read, or its namespace, cgroup or service is gone;
- down: nothing of it is applied in this boot (never up, taken down, or gone with a reboot).

Drift inside a kernel object (a changed nft rule, a limit rewritten by hand) is `status`'s and
the monitor's to find: they check every resource, which is what `list` must not wait for.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from envctl.engine.journal import Journal
from envctl.errors import EnvctlError, SpecError, StateCorrupt

if TYPE_CHECKING:
    from envctl.engine.engine import Step
    from envctl.host.context import Host
    from envctl.monitor.collect import EnvSample
    from envctl.workspace import Workspace

STATES = ("up", "not-applied", "degraded", "down")
HEADER = ("NAME", "STATE", "ADDRESS", "PORTS", "CPUS", "MEMORY", "GPUS", "JOBS",
          "DESCRIPTION")
# Resource kinds whose objects die with a reboot: one of them applied in this boot is what
# makes an environment more than "down" (directories on disk may outlive it).
_LIVE_KINDS = ("mntns", "netns", "cgroup", "cgroup-slice", "env-dev", "service", "veth",
               "ipconfig", "firewall", "antispoof", "mount")


@dataclass
class Port:
    """A published port: host `host_port` (every host address) -> `port` in the environment."""

    host_port: int
    port: int
    protocol: str = "tcp"

    def __str__(self) -> str:
        return f"0.0.0.0:{self.host_port}->{self.port}/{self.protocol}"

    def to_json(self) -> dict[str, Any]:
        return {"host_address": "0.0.0.0", "host_port": self.host_port, "port": self.port,
                "protocol": self.protocol}


@dataclass
class Limits:
    """The cgroup limits of one environment, in kernel units (None: no limit / not set)."""

    cpu_quota: float | None = None  # in CPUs (1.5 = 150 % of one CPU)
    cpuset: str = ""
    memory_max: int | None = None
    memory_high: int | None = None
    pids_max: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class Row:
    """One environment as `envctl list` shows it."""

    name: str
    state: str
    reasons: list[str] = field(default_factory=list)
    address: str | None = None
    ports: list[Port] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)
    memory_used: int | None = None
    gpus: list[int] = field(default_factory=list)
    gpu_uuids: list[str] = field(default_factory=list)
    gpus_wanted: str = ""  # "all": a spec that is down asks for every GPU
    jobs_running: int = 0
    jobs_pending: int = 0
    description: str = ""
    spec: str | None = None  # the spec file, when the config directory has one

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state, "reasons": self.reasons,
                "address": self.address, "ports": [p.to_json() for p in self.ports],
                "cpus": {"quota": self.limits.cpu_quota, "cpuset": self.limits.cpuset or None},
                "memory": {"used": self.memory_used, "limit": self.limits.memory_max},
                "limits": self.limits.to_json(),
                "gpus": self.gpus, "gpu_uuids": self.gpu_uuids,
                "gpus_wanted": self.gpus_wanted or None,
                "jobs": {"running": self.jobs_running, "pending": self.jobs_pending},
                "description": self.description, "spec": self.spec}

    def cells(self) -> list[str]:
        """The row's columns (HEADER), as text."""
        from envctl.spec.units import format_size

        lim = self.limits
        if lim.cpu_quota is not None:
            cpus = f"{lim.cpu_quota:g}" + (f" on {lim.cpuset}" if lim.cpuset else "")
        else:
            cpus = lim.cpuset or "-"
        used = "-" if self.memory_used is None else format_size(self.memory_used)
        limit = "none" if lim.memory_max is None else format_size(lim.memory_max)
        return [self.name, self.state, self.address or "-",
                ", ".join(str(p) for p in self.ports) or "-", cpus, f"{used} / {limit}",
                ",".join(str(i) for i in self.gpus) or self.gpus_wanted or "-",
                f"{self.jobs_running}/{self.jobs_pending}", self.description]


# ---------------------------------------------------------------- reading the resources


def _int(text: str | None) -> int | None:
    try:
        return int(str(text).split()[0])
    except (ValueError, IndexError, TypeError):
        return None  # "max", "-1", "infinity", "": no limit


def _limit(text: str | None) -> int | None:
    n = _int(text)
    return n if n is not None and 0 <= n < 2**62 else None


def _size(text: str) -> int | None:
    """A systemd size property (bytes, or 512M / 1G / …; "infinity": none)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip()
    if text and text[-1].upper() in units and text[:-1].isdigit():
        return int(text[:-1]) * units[text[-1].upper()]
    return _limit(text)


def limits_of(resources: list[dict[str, Any]]) -> Limits:
    """The limits (weights aside) the cgroup resource (cgroupfs, v1 or v2) or the systemd
    slice among `resources` (dict form, as journals record them) sets."""
    lim = Limits()
    for res in resources:
        if res.get("kind") == "cgroup":
            settings = {name: value for _, name, value in res.get("settings") or ()}
            period = _int(settings.get("cpu.cfs_period_us"))
            quota = _int(settings.get("cpu.cfs_quota_us"))
            if "cpu.max" in settings:
                q, _, p = settings["cpu.max"].partition(" ")
                quota, period = _int(q), _int(p)
            if quota is not None and quota > 0 and period:
                lim.cpu_quota = round(quota / period, 4)
            lim.cpuset = settings.get("cpuset.cpus", "")
            lim.memory_max = _limit(settings.get("memory.max")
                                    or settings.get("memory.limit_in_bytes"))
            lim.memory_high = _limit(settings.get("memory.high")
                                     or settings.get("memory.soft_limit_in_bytes"))
            lim.pids_max = _limit(settings.get("pids.max"))
        elif res.get("kind") == "cgroup-slice":
            props = {k: v for k, v in res.get("properties") or ()}
            quota = props.get("CPUQuota", "").rstrip("%")
            if quota.replace(".", "", 1).isdigit():
                lim.cpu_quota = round(float(quota) / 100, 4)
            lim.cpuset = props.get("AllowedCPUs", "")
            lim.memory_max = _size(props.get("MemoryMax", ""))
            lim.memory_high = _size(props.get("MemoryHigh", ""))
            lim.pids_max = _limit(props.get("TasksMax"))
    return lim


def ports_of(resources: list[dict[str, Any]], claims: dict[str, Any]) -> list[Port]:
    """The published ports: from the firewall resource (protocol:host:port), else the claims
    (protocol/host, published to the same port)."""
    for res in resources:
        if res.get("kind") == "firewall" and res.get("ports"):
            out = []
            for p in res["ports"]:
                proto, host, port = str(p).split(":")
                out.append(Port(int(host), int(port), proto))
            return out
    out = []
    for p in claims.get("ports") or ():
        proto, _, host = str(p).partition("/")
        if host.isdigit():
            out.append(Port(int(host), int(host), proto))
    return out


def _gpus(claims: dict[str, Any]) -> tuple[list[int], list[str], bool]:
    """The GPUs held (indices, UUIDs), and whether the spec asks for every GPU (`all`, as a
    spec that is down says before this host resolves it)."""
    g = claims.get("gpus") or {}
    return ([int(i) for i in g.get("indices") or ()], [str(u) for u in g.get("uuids") or ()],
            bool(g.get("all")))


# ---------------------------------------------------------------- the rows


def rows(ws: Workspace | None, host: Host, names: list[str]) -> list[Row]:
    """A row for each of `names` (specs and journals alike), in that order. `ws` may be
    opened `pure` (no host facts): only what a row needs of this host is read."""
    from envctl.monitor.collect import Sampler

    sampler = Sampler(state_dir=host.state_dir, run_dir=host.run_dir, boot_id=host.boot_id,
                      cgroups=host.cgroups, proc=host.proc, host_stats=False)
    samples = {s.env: s for s in sampler.tick().envs}
    cgroups = {env: any(os.path.exists(p) for p in t.files.values())
               for env, t in sampler.targets.items() if t.files}
    jobs = sampler.jobs.counts()
    lazy = _Lazy(ws, host)
    out = []
    for name in names:
        row = _row(lazy, host, name, samples.get(name), cgroups.get(name, False))
        counts = jobs.get(name, {})
        row.jobs_running, row.jobs_pending = counts.get("RUNNING", 0), counts.get("PENDING", 0)
        out.append(row)
    return out


def spec_digest(spec: Any) -> str:
    """A digest of what a spec says (its normalized model, defaults left out: a comment, a
    reordering or a new field with a default does not change it), which `up` records with
    the environment's claims: `list` compares it to tell up from not-applied without
    planning (a rootfs's closure alone costs tens of ms per spec)."""
    import hashlib

    return hashlib.sha256(spec.model_dump_json(exclude_defaults=True).encode()).hexdigest()[:16]


class _Lazy:
    """The specs, and what is read of the host only when a row needs it: the cheap facts
    (CPUs, memory) for a row from a spec, a workspace with every fact for an environment up
    from before `up` recorded spec digests."""

    def __init__(self, ws: Workspace | None, host: Host):
        self.ws, self.host = ws, host
        self._facts: Any = None
        self._full: Any = None

    def spec(self, name: str) -> Any:
        return self.ws.get(name) if self.ws is not None and name in self.ws.names() else None

    def facts(self) -> Any:
        if self._facts is None:
            from envctl.host.facts import gather

            self._facts = gather(proc_root=self.host.proc, sys_root=self.host.sys,
                                 state_dir=self.host.state_dir)
        return self._facts

    def planned(self, name: str) -> dict[str, dict[str, Any]] | None:
        if self._full is None:
            self._full = self.ws.with_host_facts() if self.ws is not None else False
        return _planned(self._full or None, name)[0]


def _planned(ws: Workspace | None, name: str) -> tuple[dict[str, dict[str, Any]] | None, str]:
    """key -> resource (dict form) of what the spec of `name` plans on this host, or None and
    why not ("" when there is no spec)."""
    if ws is None or name not in ws.names():
        return None, ""
    try:
        # As a journal holds them (JSON: lists, not tuples), to compare with what was applied.
        return {r.key: json.loads(json.dumps(r.to_dict())) for r in
                ws.plan(ws.get(name)).resources}, ""
    except SpecError as exc:
        return None, str(exc.problems[0])


def _row(lazy: _Lazy, host: Host, name: str, sample: EnvSample | None,
         cgroup_there: bool) -> Row:
    row = Row(name, "down")
    ls = lazy.spec(name)
    if ls is not None:
        row.spec = str(ls.path)
    try:
        journal = Journal.open(host.state_dir, name, boot=host.boot_id)
    except (StateCorrupt, EnvctlError) as exc:
        row.state, row.reasons = "degraded", [f"journal cannot be read: {exc}"]
        journal = None
    entries = journal.entries if journal is not None else []
    if journal is not None and any(e.resource.get("kind") in _LIVE_KINDS for e in entries):
        row.state = "up"
        applied, claims = [e.resource for e in entries], journal.claims
        row.reasons += _broken(host, name, entries, sample, cgroup_there)
        if row.reasons:
            row.state = "degraded"
        elif ls is not None:
            changed = _changed(lazy, name, ls.spec, claims, entries)
            if changed is not None:
                row.state = "not-applied"
                row.reasons.append(f"its spec changed since `up`{changed}: `envctl plan "
                                   f"{name}` shows what `up` would do")
        row.limits = limits_of(applied)
        row.ports = ports_of(applied, claims)
    elif ls is not None:
        claims = _spec_columns(row, ls.spec, lazy.facts())
    else:
        applied, claims = [e.resource for e in entries], journal.claims if journal else {}
        row.limits, row.ports = limits_of(applied), ports_of(applied, claims)
    row.address = claims.get("address")
    row.gpus, row.gpu_uuids, all_gpus = _gpus(claims)
    if all_gpus and not row.gpus:
        row.gpus_wanted = "all"
    row.description = str(claims.get("description") or (ls.spec.description if ls else ""))
    if sample is not None and row.state != "down":
        row.memory_used = sample.mem_usage
        if sample.mem_limit is not None:
            row.limits.memory_max = sample.mem_limit  # what the kernel enforces now
    return row


def _changed(lazy: _Lazy, name: str, spec: Any, claims: dict[str, Any], entries: list
             ) -> str | None:
    """None when the spec of an applied environment says what `up` applied, else what
    changed (" (1 to create, …)", or "" when only the digest says so). By the digest `up`
    recorded; by planning, for an environment up from before digests were recorded."""
    if "spec_digest" in claims:
        return None if claims["spec_digest"] == spec_digest(spec) else ""
    planned = lazy.planned(name)
    pending = _pending(planned, entries) if planned is not None else ""
    return f" ({pending})" if pending else None


def _spec_columns(row: Row, spec: Any, facts: Any) -> dict[str, Any]:
    """A row's address, ports and limits as `up` would make them (for one that is down), from
    its spec and this host's CPUs and memory; its claims."""
    from envctl.plan.claims import spec_claims
    from envctl.plan.limits import page
    from envctl.spec.resolve import dedicated_cpus
    from envctl.spec.units import format_cpu_list

    cpu, mem = spec.resources.cpu, spec.resources.memory
    quota = getattr(cpu, "cpus", None)
    quota = quota if quota is not None else (None if cpu.quota is None else cpu.quota / 100)
    try:
        cpus = dedicated_cpus(spec, facts).effective(facts)
    except ValueError:
        cpus = ()
    row.limits = Limits(
        cpu_quota=None if quota is None else round(quota, 4),
        cpuset=format_cpu_list(cpus) if cpus else "",
        memory_max=page(mem.max.resolve(facts.memory_bytes)) if mem.max else None,
        memory_high=page(mem.high.resolve(facts.memory_bytes)) if mem.high else None,
        pids_max=spec.resources.pids.max)
    if spec.network is not None:
        row.ports = [Port(p.host, p.port, p.protocol) for p in spec.network.ports]
    return spec_claims(spec, facts)


def _broken(host: Host, name: str, entries: list, sample: EnvSample | None,
            cgroup_there: bool) -> list[str]:
    """What is visibly wrong with an applied environment, from its journal and one stat or
    read per object: half-done steps, a gone namespace, cgroup or service."""
    out = []
    half = [e.key for e in entries if e.status != "applied"]
    if half:
        out.append(f"left half done by a failed or interrupted `up`: {', '.join(half)}")
    kinds = {e.resource.get("kind"): e.resource for e in entries}
    if "netns" in kinds:
        netns = str(kinds["netns"].get("name") or name)
        if not os.path.exists(host.netns_dir / netns):
            out.append(f"network namespace {netns} is gone")
    if ("cgroup" in kinds or "cgroup-slice" in kinds) and not cgroup_there:
        out.append("its cgroup is gone")
    if "service" in kinds and sample is not None and sample.service is not None \
            and not sample.service["up"]:
        out.append(f"its service is {sample.service['state']}")
    return out


def _pending(keys: dict[str, dict[str, Any]], entries: list) -> str:
    """What `up` would change of an applied environment, in counts ("" for nothing)."""
    have = {e.key: e.resource for e in entries}
    create = sum(1 for k in keys if k not in have)
    change = sum(1 for k, r in keys.items() if k in have and have[k] != r)
    remove = sum(1 for k in have if k not in keys)
    parts = [f"{n} to {what}" for n, what in ((create, "create"), (change, "change"),
                                              (remove, "remove")) if n]
    return ", ".join(parts)


# ---------------------------------------------------------------- the same words for `status`


def status_state(steps: list[Step], pending: str = "") -> str:
    """The state `list` would give, from `status`'s check of every resource (`steps`) and
    what `up` would change of what was applied (`pending`, from `_pending`): any resource
    missing or drifted degrades it, where `list` sees only gone namespaces and cgroups."""
    from envctl.engine.engine import KEEP, NOT_APPLIED

    applied = [s for s in steps if s.note != NOT_APPLIED]
    if not any(s.resource.volatile for s in applied):
        return "down"
    if any(s.op != KEEP or "interrupted while applying" in s.note for s in applied):
        return "degraded"
    if pending or len(applied) != len(steps):
        return "not-applied"
    return "up"


def status_states(ws: Workspace | None, host: Host, rows: dict[str, list[Step]]
                  ) -> dict[str, str]:
    """`status_state` of each environment of `status`'s rows."""
    out = {}
    for env, steps in rows.items():
        out[env] = state = status_state(steps)
        planned, _ = _planned(ws, env)
        if state != "up" or planned is None:
            continue
        try:
            journal = Journal.open(host.state_dir, env, boot=host.boot_id)
        except EnvctlError:
            continue
        out[env] = status_state(steps, _pending(planned, journal.entries))
    return out


# ---------------------------------------------------------------- limits in words


def _pct_cpus(percent: float) -> str:
    cpus = percent / 100
    return f"{percent:g}% of one CPU ({cpus:g} CPU{'' if cpus == 1 else 's'})"


def spec_limits(spec: Any, resolved: dict[str, Any]) -> str:
    """The limits of `spec` in the units it used (a percentage of one CPU, or CPUs; a size,
    or a share of the host with what it comes to here), with what the plan resolved
    (`resolved`: the CPUs it runs on, memory in bytes):
    `cpu 150% of one CPU (1.5 CPUs) on 0-1, weight 100, memory 10G (high 8G), pids 16384,
    io weight 900`. Read from the model's normalized fields: `quota` in percent, and a
    `cpus` count where the spec gave one (Docker's meaning)."""
    from envctl.spec.units import format_size

    res = spec.resources
    cpu = res.cpu
    given_cpus = getattr(cpu, "cpus", None)
    if given_cpus is not None:
        text = f"cpu {given_cpus:g} CPU{'' if given_cpus == 1 else 's'}"
    elif cpu.quota is not None:
        text = f"cpu {_pct_cpus(cpu.quota)}"
    else:
        text = "cpu no quota"
    if cpu.period_us != 100_000 and (cpu.quota is not None or given_cpus is not None):
        text += f" per {cpu.period_us} µs"
    if resolved.get("cpus"):
        text += f" on {resolved['cpus']}" + (" (dedicated)" if resolved.get("dedicated")
                                             else "")
    parts = [text]
    if cpu.weight is not None:
        parts.append(f"weight {cpu.weight}")

    def size(name: str) -> str:
        q = getattr(res.memory, name)
        if q.percent is None:
            return format_size(q.bytes)
        got = resolved.get(f"memory.{name}")
        return f"{q.percent:g}% of host" + (f" = {format_size(got)}" if got else "")

    mem = f"memory {size('max')}" if res.memory.max is not None else "memory no limit"
    extra = [f"{what} {size(name)}" for name, what in (("high", "high"), ("swap_max", "swap"))
             if getattr(res.memory, name) is not None]
    parts.append(mem + (f" ({', '.join(extra)})" if extra else ""))
    if res.pids.max is not None:
        parts.append(f"pids {res.pids.max}")
    if res.io.weight is not None:
        parts.append(f"io weight {res.io.weight}")
    return ", ".join(parts)


def applied_limits(lim: Limits) -> str:
    """What a cgroup resource sets, in words (weights aside: cgroup v1 keeps them converted),
    for an environment whose spec is gone: `cpu 1.5 CPUs on 0-1, memory 64M, pids 100`."""
    from envctl.spec.units import format_size

    cpu = "cpu no quota" if lim.cpu_quota is None else \
        f"cpu {lim.cpu_quota:g} CPU{'' if lim.cpu_quota == 1 else 's'}"
    parts = [cpu + (f" on {lim.cpuset}" if lim.cpuset else "")]
    mem = "memory no limit" if lim.memory_max is None else f"memory {format_size(lim.memory_max)}"
    parts.append(mem + (f" (high {format_size(lim.memory_high)})" if lim.memory_high else ""))
    if lim.pids_max is not None:
        parts.append(f"pids {lim.pids_max}")
    return ", ".join(parts)


def limit_summaries(ws: Workspace | None, host: Host, names: list[str],
                    states: dict[str, str]) -> dict[str, str]:
    """For `status`: each environment's limits line. Its spec's words when its spec plans
    what is applied (or it is down); what was applied (from the journal) when there is no
    spec, with the spec's words beside it when the spec has changed since (not-applied)."""
    out = {}
    for name in names:
        spec_text = ""
        if ws is not None and name in ws.names():
            try:
                ls = ws.get(name)
                spec_text = spec_limits(ls.spec, ws.plan(ls).resolved)
            except SpecError:
                spec_text = ""
        state = states.get(name, "down")
        if spec_text and state in ("up", "down", "degraded"):
            out[name] = spec_text
            continue
        try:
            journal = Journal.open(host.state_dir, name, boot=host.boot_id)
        except EnvctlError:
            journal = None
        applied = [e.resource for e in journal.entries] if journal is not None else []
        if not any(r.get("kind") in ("cgroup", "cgroup-slice") for r in applied):
            if spec_text:
                out[name] = spec_text
            continue
        text = applied_limits(limits_of(applied))
        out[name] = text + (f" (spec now: {spec_text})" if spec_text else "")
    return out
