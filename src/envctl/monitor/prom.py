"""The Prometheus exposition of the monitor's last Snapshot: a custom collector in a private
registry (never prometheus_client's global one), written to a textfile for node_exporter
(a temporary file renamed over it) and/or served on /metrics by monitor/http.py, which gets the
exposition the loop built at each tick.

Every metric is envctl's own, `envctl_*`, in base units (seconds, bytes, watts, joules, hertz,
celsius; ratios 0-1, never percents; counters end in `_total`). Labels join with the exporters
a host may also run: per GPU dcgm-exporter's `gpu`, `UUID`, `pci_bus_id`, `device`,
`modelName`, `Hostname`; per MIG instance (`envctl_mig_*`) those of its parent GPU (dcgm-exporter
puts the parent's UUID in `UUID`) plus dcgm-exporter's `GPU_I_ID` (NVML's GPU instance id) and
`GPU_I_PROFILE` (1g.18gb), and `mig_uuid` (the MIG-… UUID environments hold); per environment
cAdvisor's `id` (its cgroup). The environment is
`envctl_environment`, a name no scrape target carries, so neither `honor_labels` setting
renames or drops it. `compat` (`envctl monitor --compat dcgm,cadvisor`) adds dcgm-exporter's
`DCGM_FI_DEV_*` and cAdvisor's `container_*` names for dashboards built on them: off by
default, so a host that runs those exporters does not export each series twice. A scrape reads
the last tick's values: it never samples the host itself. docs/monitoring.md lists every
metric.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry

from envctl.errors import HostError, InputError

if TYPE_CHECKING:
    from envctl.monitor.collect import EnvSample, Snapshot
    from envctl.monitor.nvml import GpuSample

MIB = 1 << 20
DEFAULT_LISTEN = "127.0.0.1:9464"
ENV = "envctl_environment"
GPU_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", ENV]
ENV_LABELS = [ENV, "id"]
MIG_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "GPU_I_ID",
              "GPU_I_PROFILE", "mig_uuid", ENV]
JOB_STATES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
              "OUT_OF_MEMORY", "LOST")
COMPAT = ("dcgm", "cadvisor")
# XIDs whose counter exists at 0 before the first one (so that increase() sees the first):
# those that quarantine a GPU (envctl.host.gpuhealth.FATAL_XIDS) and the common
# application/driver ones (13 graphics engine exception, 31 MMU fault, 43 channel stopped, 45
# preemptive cleanup). Any other code appears at its first event.
XID_CODES = (13, 31, 43, 45, 48, 63, 64, 74, 79, 92, 94, 95)
# nvmlClocksEventReason* bits (nvml.h) and the `reason` label each gets.
CLOCK_REASONS = (("gpu_idle", 0x1), ("applications_clocks_setting", 0x2),
                 ("sw_power_cap", 0x4), ("hw_slowdown", 0x8), ("sync_boost", 0x10),
                 ("sw_thermal_slowdown", 0x20), ("hw_thermal_slowdown", 0x40),
                 ("hw_power_brake_slowdown", 0x80), ("display_clock_setting", 0x100))
ECC = (("sbe_vol", "corrected", "volatile"), ("dbe_vol", "uncorrected", "volatile"),
       ("sbe_agg", "corrected", "aggregate"), ("dbe_agg", "uncorrected", "aggregate"))


def parse_compat(text: str | None) -> frozenset[str]:
    """`--compat dcgm,cadvisor` -> the names asked for; "" or none -> nothing."""
    if not text or text.strip().lower() == "none":
        return frozenset()
    names = {n.strip().lower() for n in text.split(",") if n.strip()}
    if bad := sorted(names - set(COMPAT)):
        raise InputError(f"--compat '{text}': unknown {', '.join(bad)}; allowed: "
                         f"{', '.join(COMPAT)} (comma-separated) or none")
    return frozenset(names)


# (name, help, GpuSample attribute, scale): value = attribute * scale.
_GPU_GAUGES = (
    ("envctl_gpu_utilization_ratio", "Fraction of the last sample period a kernel ran.",
     "util", 0.01),
    ("envctl_gpu_memory_copy_utilization_ratio", "Fraction of the last sample period memory "
     "was read or written.", "mem_util", 0.01),
    ("envctl_gpu_memory_total_bytes", "Framebuffer memory.", "fb_total", 1),
    ("envctl_gpu_memory_used_bytes", "Framebuffer memory used.", "fb_used", 1),
    ("envctl_gpu_memory_free_bytes", "Framebuffer memory free.", "fb_free", 1),
    ("envctl_gpu_temperature_celsius", "GPU temperature.", "temp", 1),
    ("envctl_gpu_power_watts", "Power draw.", "power_w", 1),
    ("envctl_gpu_power_limit_watts", "The enforced power limit.", "power_limit_w", 1),
    ("envctl_gpu_sm_clock_hertz", "SM clock.", "sm_clock_hz", 1),
    ("envctl_gpu_memory_clock_hertz", "Memory clock.", "mem_clock_hz", 1),
    ("envctl_gpu_last_xid", "The last XID seen since the monitor started (absent until one "
     "is).", "xid", 1),
)
_GPU_COUNTERS = (
    ("envctl_gpu_energy_joules", "Energy consumed since the driver loaded.", "energy_j"),
    ("envctl_gpu_pcie_replays", "PCIe replays (link errors the GPU retried).", "pcie_replays"),
    ("envctl_gpu_xid_events", "XID events seen since the monitor started, every code.",
     "xid_count"),
)
# (name, help, MigSample attribute, scale). Four series an instance, not dcgm's dozens: with
# 56 instances on an HGX host every series costs the tick (prometheus_client escapes each
# label of each sample); free memory is total minus used.
_MIG_GAUGES = (
    ("envctl_mig_memory_total_bytes", "The MIG instance's memory (its GPU instance's).",
     "fb_total", 1),
    ("envctl_mig_memory_used_bytes", "The MIG instance's memory used.", "fb_used", 1),
    ("envctl_mig_graphics_utilization_ratio", "Fraction of the last tick any engine of the "
     "GPU instance was active (GPM; as DCGM_FI_PROF_GR_ENGINE_ACTIVE; absent without GPM).",
     "util", 0.01),
    ("envctl_mig_sm_utilization_ratio", "Fraction of the GPU instance's SMs busy over the "
     "last tick (GPM; as DCGM_FI_PROF_SM_ACTIVE; absent without GPM).", "sm_util", 0.01),
)
# (name, help, EnvSample attribute, counter?).
_ENV_METRICS = (
    ("envctl_environment_cpu_usage_seconds", "CPU time its cgroup consumed.", "cpu_seconds",
     True),
    ("envctl_environment_cpu_periods", "CFS enforcement periods elapsed.", "periods", True),
    ("envctl_environment_cpu_throttled_periods", "CFS periods in which it was throttled.",
     "throttled_periods", True),
    ("envctl_environment_cpu_throttled_seconds", "Time it was throttled.",
     "throttled_seconds", True),
    ("envctl_environment_cpu_quota_seconds", "CPU time allowed per period (cpu.max; absent: "
     "no quota).", "cpu_quota", False),
    ("envctl_environment_cpu_period_seconds", "The CFS period of its quota.", "cpu_period",
     False),
    ("envctl_environment_memory_usage_bytes", "Memory used, page cache included.",
     "mem_usage", False),
    ("envctl_environment_memory_working_set_bytes", "Memory used minus inactive file cache "
     "(as cAdvisor's working set).", "mem_working_set", False),
    ("envctl_environment_memory_max_usage_bytes", "The peak of its memory use.", "mem_peak",
     False),
    ("envctl_environment_tasks", "Processes and threads in it (pids.current).", "tasks",
     False),
)


# Per-environment counters with one more label: name -> (help, label).
_ENV_COUNTERS = {
    "envctl_environment_memory_events": ("memory.events counts (v2: high, max, oom, oom_kill; "
                                         "v1: oom_kill).", "event"),
    "envctl_environment_io_bytes": ("Bytes read and written, every device.", "direction"),
    "envctl_environment_network_bytes": ("Bytes through its veth, as the environment sees "
                                         "them (receive, transmit).", "direction"),
}


def _env_families(envs: list[EnvSample], table: tuple[tuple[str, str, str, bool], ...],
                  labels: list[str]) -> Iterator[Metric]:
    """One family per (name, help, EnvSample attribute, counter?) of `table`, a sample per
    environment that has a value, labelled (environment, its cgroup)."""
    for name, doc, attr, counter in table:
        cls = CounterMetricFamily if counter else GaugeMetricFamily
        fam = cls(name, doc, labels=labels)
        for s in envs:
            value = getattr(s, attr)
            if value is not None:
                fam.add_metric([s.env, s.cgroup], value)
        yield fam


class SnapshotCollector:
    """Yields the metric families of the last Snapshot given to `update`; `compat` adds the
    dcgm-exporter and/or cAdvisor names (COMPAT)."""

    def __init__(self, *, compat: Iterable[str] = ()) -> None:
        self.snapshot: Snapshot | None = None
        self.ticks = 0
        self.tick_cpu_seconds = 0.0
        self.compat = frozenset(compat)
        self.hostname = socket.gethostname()

    def update(self, snap: Snapshot, *, tick_cpu_seconds: float = 0.0) -> None:
        self.snapshot = snap
        self.ticks += 1
        self.tick_cpu_seconds = tick_cpu_seconds

    def describe(self) -> list[Metric]:
        return []  # nothing fixed: registering must not collect

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        yield from self._gpus(snap)
        yield from self._migs(snap)
        yield from self._envs(snap)
        yield from self._envctl(snap)
        if "dcgm" in self.compat:
            yield from _dcgm(snap, self.hostname)
        if "cadvisor" in self.compat:
            yield from _cadvisor(snap)

    def _gpu_labels(self, snap: Snapshot, g: GpuSample) -> list[str]:
        return [str(g.index), g.uuid, g.pci_bus_id, f"nvidia{g.minor}", g.name, self.hostname,
                snap.gpu_env.get(g.uuid, "")]

    def _gpus(self, snap: Snapshot) -> Iterator[Metric]:
        if not snap.gpus:
            return
        labels = {g.uuid: self._gpu_labels(snap, g) for g in snap.gpus}
        for name, doc, attr, scale in _GPU_GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=GPU_LABELS)
            for g in snap.gpus:
                value = getattr(g, attr)
                if value is not None:
                    fam.add_metric(labels[g.uuid], value * scale if scale != 1 else value)
            yield fam
        for name, doc, attr in _GPU_COUNTERS:
            cnt = CounterMetricFamily(name, doc, labels=GPU_LABELS)
            for g in snap.gpus:
                value = getattr(g, attr)
                if value is not None:
                    cnt.add_metric(labels[g.uuid], value)
            yield cnt
        ecc = CounterMetricFamily("envctl_gpu_ecc_errors", "ECC errors (absent on GPUs "
                                  "without ECC).", labels=GPU_LABELS + ["error", "counter"])
        xids = CounterMetricFamily("envctl_gpu_xid_errors", "XID events by code since the "
                                   "monitor started.", labels=GPU_LABELS + ["err_code"])
        reasons = GaugeMetricFamily("envctl_gpu_clock_event_active", "1 while this reason "
                                    "holds the clocks down (NVML's clock event reasons).",
                                    labels=GPU_LABELS + ["reason"])
        rows = CounterMetricFamily("envctl_gpu_remapped_rows", "Memory rows remapped (Ampere "
                                   "and newer), by the kind of error that caused it.",
                                   labels=GPU_LABELS + ["error"])
        remap = GaugeMetricFamily("envctl_gpu_row_remap_state", "1 while a row remap is "
                                  "pending (a reset applies it) or has failed.",
                                  labels=GPU_LABELS + ["state"])
        sick = GaugeMetricFamily("envctl_gpu_quarantined", "1 while envctl keeps the GPU out "
                                 "of every assignment (a fatal XID, ECC, row remapping, retired "
                                 "pages, lost); `envctl gpus --clear` releases it.",
                                 labels=GPU_LABELS)
        lost = GaugeMetricFamily("envctl_gpu_lost", "1 once NVML said the GPU is lost (fell "
                                 "off the bus).", labels=GPU_LABELS)
        for g in snap.gpus:
            lab = labels[g.uuid]
            for key, error, counter in ECC:
                if key in g.ecc:
                    ecc.add_metric(lab + [error, counter], g.ecc[key])
            for code in sorted(set(XID_CODES) | set(g.xids)):
                xids.add_metric(lab + [str(code)], g.xids.get(code, 0))
            if g.clock_reasons is not None:
                for reason, bit in CLOCK_REASONS:
                    reasons.add_metric(lab + [reason], 1 if g.clock_reasons & bit else 0)
            if g.remapped is not None:
                corr, unc, pending, failed = g.remapped
                rows.add_metric(lab + ["corrected"], corr)
                rows.add_metric(lab + ["uncorrected"], unc)
                remap.add_metric(lab + ["pending"], 1 if pending else 0)
                remap.add_metric(lab + ["failed"], 1 if failed else 0)
            sick.add_metric(lab, 1 if g.uuid in snap.quarantined else 0)
            lost.add_metric(lab, 1 if g.lost else 0)
        yield from (ecc, xids, reasons, rows, remap, sick, lost)
        used = GaugeMetricFamily("envctl_environment_gpu_memory_used_bytes", "GPU memory used "
                                 "by the environment's processes (on a MIG instance: `UUID` "
                                 "its parent's, with GPU_I_ID, GPU_I_PROFILE and mig_uuid).",
                                 labels=[ENV, "gpu", "UUID", "GPU_I_ID", "GPU_I_PROFILE",
                                         "mig_uuid"])
        index = {g.uuid: [str(g.index), g.uuid, "", "", ""] for g in snap.gpus}
        index.update({m.uuid: [str(m.parent), m.parent_uuid, str(m.gi), m.profile, m.uuid]
                      for m in snap.migs})
        for s in snap.envs:
            for uuid, n in sorted(s.gpu_memory.items()):
                used.add_metric([s.env, *index.get(uuid, ["", uuid, "", "", ""])], n)
        yield used

    def _migs(self, snap: Snapshot) -> Iterator[Metric]:
        """The MIG instances' series, labelled as dcgm-exporter labels a MIG instance's."""
        if not snap.migs:
            return
        parents = {g.index: g for g in snap.gpus}
        labels = []
        for m in snap.migs:
            g = parents.get(m.parent)
            labels.append([str(m.parent), m.parent_uuid, g.pci_bus_id if g else "",
                           f"nvidia{g.minor}" if g else "", g.name if g else "",
                           self.hostname, str(m.gi), m.profile, m.uuid,
                           snap.gpu_env.get(m.uuid, "")])
        for name, doc, attr, scale in _MIG_GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=MIG_LABELS)
            for m, lab in zip(snap.migs, labels, strict=True):
                value = getattr(m, attr)
                if value is not None:
                    fam.add_metric(lab, value * scale if scale != 1 else value)
            yield fam

    def _envs(self, snap: Snapshot) -> Iterator[Metric]:
        yield from _env_families(snap.envs, _ENV_METRICS, ENV_LABELS)
        limit = GaugeMetricFamily("envctl_environment_memory_limit_bytes", "Its memory limit "
                                  "(0: none, as cAdvisor).", labels=ENV_LABELS)
        cpus = GaugeMetricFamily("envctl_environment_cpus", "CPUs of the environment's cpuset "
                                 "(every online CPU when it has none).", labels=[ENV])
        ratio = GaugeMetricFamily("envctl_environment_cpu_utilization_ratio", "CPU used since "
                                  "the last tick, as a fraction of the environment's CPUs.",
                                  labels=[ENV])
        pressure = CounterMetricFamily("envctl_environment_pressure_stalled_seconds", "PSI: "
                                       "time some or all of its tasks stalled on a resource "
                                       "(cgroup v2 only).",
                                       labels=ENV_LABELS + ["resource", "kind"])
        extra = {name: CounterMetricFamily(name, doc, labels=ENV_LABELS + [label])
                 for name, (doc, label) in _ENV_COUNTERS.items()}
        for s in snap.envs:
            key = [s.env, s.cgroup]
            if s.mem_usage is not None:
                limit.add_metric(key, s.mem_limit or 0)
            if s.cpus:
                cpus.add_metric([s.env], s.cpus)
            if s.cpu_percent is not None:
                ratio.add_metric([s.env], s.cpu_percent / 100.0)
            for (res, kind), secs in sorted(s.pressure.items()):
                pressure.add_metric(key + [res, kind], secs)
            for event, n in sorted(s.mem_events.items()):
                extra["envctl_environment_memory_events"].add_metric(key + [event], n)
            for fam_name, pair in (("envctl_environment_io_bytes",
                                    (s.io_read_bytes, s.io_write_bytes)),
                                   ("envctl_environment_network_bytes",
                                    (s.net_rx_bytes, s.net_tx_bytes))):
                directions = ("read", "write") if "io" in fam_name else ("receive", "transmit")
                for direction, n in zip(directions, pair, strict=True):
                    if n is not None:
                        extra[fam_name].add_metric(key + [direction], n)
        yield from (limit, cpus, ratio, pressure, *extra.values())

    def _envctl(self, snap: Snapshot) -> Iterator[Metric]:
        configured = GaugeMetricFamily("envctl_environment_configured", "1 for each spec in "
                                       "the config directory (desired), 0 for an environment "
                                       "up without one.", labels=[ENV])
        up = GaugeMetricFamily("envctl_environment_up", "1 when every step of the environment "
                               "is in place (the last health check), else 0; 0 for a "
                               "configured spec that is not up.", labels=[ENV])
        drift = GaugeMetricFamily("envctl_environment_drifted_steps", "Steps found missing or "
                                  "drifted by the last health check.", labels=[ENV])
        heals = CounterMetricFamily("envctl_heals", "Re-converges the monitor ran, by result.",
                                    labels=[ENV, "result"])
        retry = GaugeMetricFamily("envctl_heal_backoff_seconds", "Seconds until the next heal "
                                  "of the environment may run (0: now).", labels=[ENV])
        service = GaugeMetricFamily("envctl_service_up", "1 while the environment's service "
                                    "runs.", labels=[ENV])
        restarts = CounterMetricFamily("envctl_service_restarts", "Restarts of the service by "
                                       "its supervisor.", labels=[ENV])
        jobs = GaugeMetricFamily("envctl_jobs", "Job records by state (finished ones as "
                                 "retained).", labels=[ENV, "state"])
        sampled = {s.env for s in snap.envs}
        wanted = set(snap.configured)
        for name in sorted(wanted | sampled) if snap.configured else ():
            configured.add_metric([name], 1 if name in wanted else 0)
        for name in sorted(wanted - sampled):
            up.add_metric([name], 0)  # skipped at boot, or taken down: desired, not up
        for s in snap.envs:
            h = snap.health.get(s.env)
            if h is not None:
                up.add_metric([s.env], 1 if h.get("state") == "up" else 0)
                drift.add_metric([s.env], h.get("drift", 0))
                heals.add_metric([s.env, "ok"], h.get("heals", 0))
                heals.add_metric([s.env, "failed"], h.get("heal_failures", 0))
                retry.add_metric([s.env], h.get("retry_in", 0.0))
            if s.service is not None:
                service.add_metric([s.env], 1 if s.service["up"] else 0)
                restarts.add_metric([s.env], s.service["restarts"])
            for state in JOB_STATES:
                jobs.add_metric([s.env, state], s.jobs.get(state, 0))
        yield from (configured, up, drift, heals, retry, service, restarts, jobs)
        if snap.host_cpu_percent is not None:
            yield GaugeMetricFamily("envctl_host_cpu_utilization_ratio", "Host CPU used since "
                                    "the last tick (psutil), 0-1.",
                                    value=snap.host_cpu_percent / 100.0)
        if snap.host_mem_percent is not None:
            yield GaugeMetricFamily("envctl_host_memory_utilization_ratio", "Host memory in "
                                    "use (psutil), 0-1.", value=snap.host_mem_percent / 100.0)
        yield CounterMetricFamily("envctl_monitor_ticks", "Ticks since the monitor started.",
                                  value=self.ticks)
        yield GaugeMetricFamily("envctl_monitor_tick_cpu_seconds", "CPU time the last tick "
                                "took (sampling and export).", value=self.tick_cpu_seconds)
        yield GaugeMetricFamily("envctl_monitor_last_tick_timestamp_seconds", "When the last "
                                "tick sampled the host (Unix time).", value=snap.time)
        yield GaugeMetricFamily("envctl_monitor_gpu_sampling_paused", "1 while the operator "
                                "paused GPU sampling (envctl maintenance --gpus on): NVML shut "
                                "down, no GPU series.", value=1 if snap.gpus_paused else 0)


# ---------------------------------------------------------------- --compat


# dcgm-exporter's names: (name, help, GpuSample attribute, divisor). It reports framebuffer
# memory in MiB and power in W. Its ECC totals are declared counters there; here they are
# gauges so that the name stays exactly DCGM_FI_DEV_…_TOTAL (prometheus_client appends `_total`
# to counters).
_DCGM = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "util", 1),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "mem_util", 1),
    ("DCGM_FI_DEV_FB_TOTAL", "Total framebuffer memory (in MiB).", "fb_total", MIB),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "fb_used", MIB),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "fb_free", MIB),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temp", 1),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w", 1),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered (since the monitor "
     "started).", "xid", 1),
)
_DCGM_ECC = (("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC "
              "errors.", "sbe_vol"),
             ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC "
              "errors.", "dbe_vol"),
             ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "Total number of single-bit persistent ECC "
              "errors.", "sbe_agg"),
             ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Total number of double-bit persistent ECC "
              "errors.", "dbe_agg"))
DCGM_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "environment"]
# cAdvisor's names: (name, help, EnvSample attribute, counter?).
_CADVISOR = (
    ("container_cpu_usage_seconds", "Cumulative cpu time consumed in seconds.", "cpu_seconds",
     True),
    ("container_cpu_cfs_periods", "Number of elapsed enforcement period intervals.",
     "periods", True),
    ("container_cpu_cfs_throttled_periods", "Number of throttled period intervals.",
     "throttled_periods", True),
    ("container_cpu_cfs_throttled_seconds", "Total time duration the container has been "
     "throttled.", "throttled_seconds", True),
    ("container_memory_usage_bytes", "Current memory usage in bytes, including all memory "
     "regardless of when it was accessed.", "mem_usage", False),
    ("container_memory_working_set_bytes", "Current working set in bytes.", "mem_working_set",
     False),
    ("container_memory_max_usage_bytes", "Maximum memory usage recorded in bytes.", "mem_peak",
     False),
    ("container_oom_events", "Count of out of memory events observed for the container.",
     "oom_kills", True),
    ("container_threads", "Number of threads running inside the container (pids.current: "
     "processes and threads).", "tasks", False),
)
CADVISOR_LABELS = ["environment", "id"]


def _dcgm(snap: Snapshot, hostname: str) -> Iterator[Metric]:
    """dcgm-exporter's names, units and labels (the holder as `environment`, as envctl named
    it before its own names)."""
    if not snap.gpus:
        return
    labels = {g.uuid: [str(g.index), g.uuid, g.pci_bus_id, f"nvidia{g.minor}", g.name,
                       hostname, snap.gpu_env.get(g.uuid, "")] for g in snap.gpus}
    for name, doc, attr, scale in _DCGM:
        fam = GaugeMetricFamily(name, doc, labels=DCGM_LABELS)
        for g in snap.gpus:
            value = getattr(g, attr)
            if value is not None:
                fam.add_metric(labels[g.uuid], value / scale if scale != 1 else value)
        if name in _DCGM_MIG:
            _add_migs(fam, snap, hostname, *_DCGM_MIG[name])
        yield fam
    for name, doc, key in _DCGM_ECC:
        fam = GaugeMetricFamily(name, doc, labels=DCGM_LABELS)
        for g in snap.gpus:
            if key in g.ecc:
                fam.add_metric(labels[g.uuid], g.ecc[key])
        yield fam
    yield from _dcgm_prof(snap, hostname)


# A MIG instance's series under dcgm-exporter's names: name -> (MigSample attribute,
# divisor). Memory in MiB, as its whole GPUs'; GR_ENGINE_ACTIVE and SM_ACTIVE are ratios.
_DCGM_MIG = {"DCGM_FI_DEV_FB_TOTAL": ("fb_total", MIB), "DCGM_FI_DEV_FB_USED": ("fb_used", MIB),
             "DCGM_FI_DEV_FB_FREE": ("fb_free", MIB)}
_DCGM_PROF = (("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "Ratio of time the graphics engine is active.",
               "util", 100),
              ("DCGM_FI_PROF_SM_ACTIVE", "The ratio of cycles an SM has at least 1 warp "
               "assigned.", "sm_util", 100))


def _add_migs(fam: Metric, snap: Snapshot, hostname: str, attr: str, scale: int) -> None:
    """The MIG instances' samples into `fam`, labelled as dcgm-exporter labels an instance:
    its parent's `gpu`, `UUID`, `pci_bus_id`, `device`, `modelName`, plus GPU_I_PROFILE and
    GPU_I_ID (a family may hold samples of both label sets, as dcgm-exporter's do)."""
    from prometheus_client.samples import Sample

    parents = {g.index: g for g in snap.gpus}
    for m in snap.migs:
        value, g = getattr(m, attr), parents.get(m.parent)
        if value is None or g is None:
            continue
        lab = dict(zip(DCGM_LABELS, [str(g.index), g.uuid, g.pci_bus_id, f"nvidia{g.minor}",
                                     g.name, hostname, snap.gpu_env.get(m.uuid, "")],
                       strict=True))
        lab.update(GPU_I_PROFILE=m.profile, GPU_I_ID=str(m.gi))
        fam.samples.append(Sample(fam.name, lab, value / scale))


def _dcgm_prof(snap: Snapshot, hostname: str) -> Iterator[Metric]:
    """GPM's activity of the MIG instances under dcgm-exporter's profiling names (envctl
    has no such value of a whole GPU)."""
    for name, doc, attr, scale in _DCGM_PROF:
        fam = GaugeMetricFamily(name, doc)
        _add_migs(fam, snap, hostname, attr, scale)
        if fam.samples:
            yield fam


def _cadvisor(snap: Snapshot) -> Iterator[Metric]:
    """cAdvisor's names, units and labels (`environment`, `id`)."""
    envs: list[EnvSample] = snap.envs
    yield from _env_families(envs, _CADVISOR, CADVISOR_LABELS)
    limit = GaugeMetricFamily("container_spec_memory_limit_bytes", "Memory limit for the "
                              "container (0: none).", labels=CADVISOR_LABELS)
    for s in envs:
        if s.mem_usage is not None:
            limit.add_metric([s.env, s.cgroup], s.mem_limit or 0)
    yield limit


def registry_for(collector: SnapshotCollector) -> CollectorRegistry:
    """A private registry holding only `collector`."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


def exposition(registry: CollectorRegistry) -> bytes:
    """The text format (0.0.4) of everything in `registry`."""
    from prometheus_client.exposition import generate_latest

    return generate_latest(registry)


def write_textfile(path: Path, registry: CollectorRegistry) -> None:
    """Replace `path` by the exposition: written to a temporary file beside it, then renamed,
    so node_exporter's textfile collector never reads half of one."""
    from envctl.host.files import atomic_write

    try:
        atomic_write(path, exposition(registry), durable=False)
    except OSError as exc:
        raise HostError(f"write metrics textfile {path}: {exc.strerror}") from exc


# ---------------------------------------------------------------- parsing


def parse_exposition(text: str) -> dict[str, Any]:
    """name -> [(labels, value)] of an exposition text, through prometheus_client's parser
    (for tests and `top`)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out
