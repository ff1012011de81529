"""The Prometheus exposition of the monitor's last Snapshot: a custom collector in a private
registry (never prometheus_client's global one), written to a textfile for node_exporter
(a temporary file renamed over it) and/or served on /metrics by monitor/http.py, which gets the
exposition the loop built at each tick.

Names follow the exporters operators already scrape, so their dashboards work unchanged:
dcgm-exporter's `DCGM_FI_DEV_*` per GPU (labels gpu, UUID, device, modelName, environment:
the one holding the GPU, "" when none) and cAdvisor's `container_*` per environment (labels
environment, id: its cgroup); envctl's own are `envctl_*`. A scrape reads the last tick's
values: it never samples the host itself. docs/monitoring.md lists every metric.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry

from envctl.errors import HostError

if TYPE_CHECKING:
    from envctl.monitor.collect import Snapshot

MIB = 1 << 20
DEFAULT_LISTEN = "127.0.0.1:9464"
GPU_LABELS = ["gpu", "UUID", "device", "modelName", "environment"]
ENV_LABELS = ["environment", "id"]
JOB_STATES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
              "OUT_OF_MEMORY", "LOST")

# (name, help, GpuSample attribute, scale). dcgm-exporter reports framebuffer memory in MiB
# and power in W. Its ECC totals are declared counters there; here they are gauges so that the
# name stays exactly DCGM_FI_DEV_ECC_…_TOTAL (prometheus_client appends `_total` to counters).
_GPU_GAUGES = (
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
_ECC = (("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.",
         "sbe_vol"),
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.",
         "dbe_vol"),
        ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "Total number of single-bit persistent ECC errors.",
         "sbe_agg"),
        ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Total number of double-bit persistent ECC errors.",
         "dbe_agg"))
# cAdvisor's names: (name, help, EnvSample attribute, counter?).
_ENV_METRICS = (
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


class SnapshotCollector:
    """Yields the metric families of the last Snapshot given to `update`."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None
        self.ticks = 0
        self.tick_cpu_seconds = 0.0

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
        yield from self._envs(snap)
        yield from self._envctl(snap)

    def _gpus(self, snap: Snapshot) -> Iterator[Metric]:
        if not snap.gpus:
            return
        labels = {g.uuid: [str(g.index), g.uuid, f"nvidia{g.minor}", g.name,
                           snap.gpu_env.get(g.uuid, "")] for g in snap.gpus}
        for name, doc, attr, scale in _GPU_GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=GPU_LABELS)
            for g in snap.gpus:
                value = getattr(g, attr)
                if value is not None:
                    fam.add_metric(labels[g.uuid], value / scale if scale != 1 else value)
            yield fam
        for name, doc, key in _ECC:
            fam = GaugeMetricFamily(name, doc, labels=GPU_LABELS)
            for g in snap.gpus:
                if key in g.ecc:
                    fam.add_metric(labels[g.uuid], g.ecc[key])
            yield fam
        xids = CounterMetricFamily("envctl_gpu_xid_events", "XID events seen since the "
                                   "monitor started.", labels=GPU_LABELS)
        used = GaugeMetricFamily("envctl_environment_gpu_memory_used_bytes", "GPU memory used "
                                 "by the environment's processes.",
                                 labels=["environment", "gpu", "UUID"])
        index = {g.uuid: str(g.index) for g in snap.gpus}
        for g in snap.gpus:
            xids.add_metric(labels[g.uuid], g.xid_count)
        for s in snap.envs:
            for uuid, n in sorted(s.gpu_memory.items()):
                used.add_metric([s.env, index.get(uuid, ""), uuid], n)
        sick = GaugeMetricFamily("envctl_gpu_quarantined", "1 while envctl keeps the GPU out "
                                 "of every assignment (a fatal XID, ECC, row remapping, retired "
                                 "pages, lost); `envctl gpus --clear` releases it.",
                                 labels=GPU_LABELS)
        for g in snap.gpus:
            sick.add_metric(labels[g.uuid], 1 if g.uuid in snap.quarantined else 0)
        yield xids
        yield used
        yield sick

    def _envs(self, snap: Snapshot) -> Iterator[Metric]:
        for name, doc, attr, counter in _ENV_METRICS:
            cls = CounterMetricFamily if counter else GaugeMetricFamily
            fam = cls(name, doc, labels=ENV_LABELS)
            for s in snap.envs:
                value = getattr(s, attr)
                if value is not None:
                    fam.add_metric([s.env, s.cgroup], value)
            yield fam
        # cAdvisor writes 0 for "no limit".
        limit = GaugeMetricFamily("container_spec_memory_limit_bytes", "Memory limit for the "
                                  "container (0: none).", labels=ENV_LABELS)
        cpus = GaugeMetricFamily("envctl_environment_cpus", "CPUs of the environment's cpuset "
                                 "(every online CPU when it has none).", labels=["environment"])
        pct = GaugeMetricFamily("envctl_environment_cpu_utilization_percent", "CPU used since "
                                "the last tick, in % of the environment's CPUs.",
                                labels=["environment"])
        for s in snap.envs:
            if s.mem_usage is not None:
                limit.add_metric([s.env, s.cgroup], s.mem_limit or 0)
            if s.cpus:
                cpus.add_metric([s.env], s.cpus)
            if s.cpu_percent is not None:
                pct.add_metric([s.env], s.cpu_percent)
        yield limit
        yield cpus
        yield pct

    def _envctl(self, snap: Snapshot) -> Iterator[Metric]:
        up = GaugeMetricFamily("envctl_environment_up", "1 when every step of the environment "
                               "is in place (the last health check), else 0.",
                               labels=["environment"])
        drift = GaugeMetricFamily("envctl_environment_drifted_steps", "Steps found missing or "
                                  "drifted by the last health check.", labels=["environment"])
        heals = CounterMetricFamily("envctl_heals", "Re-converges the monitor ran, by result.",
                                    labels=["environment", "result"])
        retry = GaugeMetricFamily("envctl_heal_backoff_seconds", "Seconds until the next heal "
                                  "of the environment may run (0: now).",
                                  labels=["environment"])
        service = GaugeMetricFamily("envctl_service_up", "1 while the environment's service "
                                    "runs.", labels=["environment"])
        restarts = CounterMetricFamily("envctl_service_restarts", "Restarts of the service by "
                                       "its supervisor.", labels=["environment"])
        jobs = GaugeMetricFamily("envctl_jobs", "Job records by state (finished ones as "
                                 "retained).", labels=["environment", "state"])
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
        yield from (up, drift, heals, retry, service, restarts, jobs)
        if snap.host_cpu_percent is not None:
            yield GaugeMetricFamily("envctl_host_cpu_utilization_percent", "Host CPU used "
                                    "since the last tick (psutil).", value=snap.host_cpu_percent)
        if snap.host_mem_percent is not None:
            yield GaugeMetricFamily("envctl_host_memory_utilization_percent", "Host memory in "
                                    "use (psutil).", value=snap.host_mem_percent)
        yield CounterMetricFamily("envctl_monitor_ticks", "Ticks since the monitor started.",
                                  value=self.ticks)
        yield GaugeMetricFamily("envctl_monitor_tick_cpu_seconds", "CPU time the last tick "
                                "took (sampling and export).", value=self.tick_cpu_seconds)
        yield GaugeMetricFamily("envctl_monitor_last_tick_timestamp_seconds", "When the last "
                                "tick sampled the host (Unix time).", value=snap.time)


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
