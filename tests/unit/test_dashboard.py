"""monitoring/grafana/envctl.json names only what envctl exports: every PromQL expression of
every panel and template variable is tokenized, and each metric it selects (and each label its
selectors match on, or its legend names) is looked up in a real exposition: the collector's
over a Snapshot of the monitor tests' fake host (cgroup v2, GPUs through the fake NVML, a veth,
configured specs).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from envctl.monitor import prom
from envctl.monitor.nvml import NvmlSession
from envctl.runtime import jobs as jb
from tests.fakes import gpuhost
from tests.unit.test_monitor import BOOT, fake_host, fake_nvml  # noqa: F401 - a fixture

DASHBOARD = Path(__file__).resolve().parents[2] / "monitoring" / "grafana" / "envctl.json"
# Labels Prometheus adds to every series of a scrape (the target's), not the exporter's.
TARGET_LABELS = {"instance", "job"}

# ---------------------------------------------------------------- a small PromQL tokenizer

_TOKEN = re.compile(r"""
    (?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$\w+)
  | (?P<num>0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?(?:(?:ms|[smhdwy])\d*)*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<ws>\s+)
  | (?P<op>[(){}\[\],=~!<>+\-*/%^@])
""", re.VERBOSE)
# Keywords: binary operators, modifiers, aggregations (`sum by (x) (…)`: not followed by
# '('); those that take a parenthesised list of labels.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "sum", "min",
             "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
             "topk", "quantile", "limitk", "limit_ratio"}
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, at = [], 0
    while at < len(expr):
        m = _TOKEN.match(expr, at)
        if m is None:
            raise ValueError(f"cannot tokenize {expr!r} at {at}: {expr[at:at + 20]!r}")
        at = m.end()
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
    return out


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names its matchers use) of every selector in a PromQL expression:
    identifiers not followed by '(' (functions, aggregations) that are neither keywords nor
    inside a label list (by, on, …), a `{…}` matcher or a `[…]` range."""
    toks = _tokens(expr)
    found: list[tuple[str, set[str]]] = []
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if text == "[":  # a range or subquery: durations only
            i = next(j for j in range(i, len(toks)) if toks[j][1] == "]") + 1
            continue
        if text == "{":  # matchers of a selector without a name before it
            close = next(j for j in range(i, len(toks)) if toks[j][1] == "}")
            found.append(("", _matcher_labels(toks[i + 1:close])))
            i = close + 1
            continue
        if kind == "ident" and text in _LABEL_LISTS:
            if nxt == "(":
                i = next(j for j in range(i, len(toks)) if toks[j][1] == ")") + 1
            else:
                i += 1  # group_left without labels
            continue
        if kind == "ident" and text not in _KEYWORDS and nxt != "(":
            labels: set[str] = set()
            i += 1
            if nxt == "{":
                close = next(j for j in range(i, len(toks)) if toks[j][1] == "}")
                labels = _matcher_labels(toks[i + 1:close])
                i = close + 1
            found.append((text, labels))
            continue
        i += 1
    return found


def _matcher_labels(toks: list[tuple[str, str]]) -> set[str]:
    """The label names of `name op "value", …` matchers."""
    return {text for k, (kind, text) in enumerate(toks)
            if kind == "ident" and k + 1 < len(toks) and toks[k + 1][1] in "=!"}


def _variable_query(query: str) -> str | None:
    """The PromQL inside a Grafana variable query (`label_values(EXPR, label)`,
    `query_result(EXPR)`); None for `label_values(label)` (no metric)."""
    m = re.fullmatch(r"\s*label_values\((.+),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*", query, re.S)
    if m:
        return m.group(1)
    m = re.fullmatch(r"\s*query_result\((.+)\)\s*", query, re.S)
    if m:
        return m.group(1)
    return None


def expressions(dashboard: dict) -> list[tuple[str, str, str]]:
    """(where, PromQL, legend format) of every panel target and query variable, rows' panels
    included."""
    out = []

    def panels(items: list, where: str) -> None:
        for p in items:
            title = f"{where}panel {p.get('title', p.get('id'))!r}"
            for t in p.get("targets") or []:
                if t.get("expr"):
                    out.append((f"{title} target {t.get('refId')}", t["expr"],
                                t.get("legendFormat") or ""))
            panels(p.get("panels") or [], f"{title} > ")

    panels(dashboard.get("panels") or [], "")
    for v in (dashboard.get("templating") or {}).get("list") or []:
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        expr = _variable_query(q or "")
        if expr is not None:
            out.append((f"variable ${v['name']}", expr, ""))
    return out


def problems(dashboard: dict, exported: dict[str, set[str]]) -> list[str]:
    """What the dashboard names that the exposition does not have."""
    bad = []
    for where, expr, legend in expressions(dashboard):
        seen = set(TARGET_LABELS)
        for name, labels in selectors(expr):
            if name and name not in exported:
                bad.append(f"{where}: metric {name} is not exported")
                continue
            known = (exported[name] if name else set()) | TARGET_LABELS
            seen |= known
            for label in sorted(labels - known - {"__name__"}):
                bad.append(f"{where}: {name} has no label {label}")
        # A legend naming a label none of its metrics has draws an empty name.
        for label in sorted(set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)) - seen):
            bad.append(f"{where}: legend {{{{{label}}}}} names a label its metrics lack")
    return bad


# ---------------------------------------------------------------- the exposition


@pytest.fixture
def exported(tmp_path, fake_nvml, monkeypatch) -> dict[str, set[str]]:  # noqa: F811
    """sample name -> label names, of the collector's exposition of a full Snapshot."""
    fh = fake_host(tmp_path, 2, version=2, gpus=2)
    monkeypatch.setenv("FAKE_NVML_JSON", str(fh.nvml_json))
    cfg = json.loads(fh.nvml_json.read_text())
    cfg["gpus"][0]["xids"] = [79]
    # GPU 1 in MIG mode with one instance, with GPM: the MIG panels' series.
    gis = gpuhost.layout("H200", ["3g.71gb"])
    gis[0]["cis"][0]["uuid"] = gpuhost.mig_uuid(1, gis[0]["id"], 0)
    gis[0].update(used=1 << 30, gpm={"graphics": 50.0, "sm": 25.0})
    cfg["gpus"][1].update(mig=True, mig_profiles=gpuhost.profiles("H200"), gpu_instances=gis,
                          gpm=True)
    fh.nvml_json.write_text(json.dumps(cfg))
    net = tmp_path / "net"
    (net / "ve-env0" / "statistics").mkdir(parents=True)
    for f in ("rx_bytes", "tx_bytes"):
        (net / "ve-env0" / "statistics" / f).write_text("1\n")
    j = fh.state / "journal" / "env0.json"
    data = json.loads(j.read_text())
    data["entries"] += [
        {"key": "veth:ve-env0", "resource": {"kind": "veth", "name": "ve-env0"}, "memo": {},
         "status": "applied", "shared": False, "boot": BOOT},
        {"key": "service:env0", "resource": {"kind": "service", "env": "env0"}, "memo": {},
         "status": "applied", "shared": False, "boot": BOOT}]
    j.write_text(json.dumps(data))
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "env0.yaml").write_text("name: env0\n")
    jb.write(fh.state, jb.Job(id=1, env="env0", argv=["x"], state=jb.State.RUNNING))
    s = fh.sampler(nvml=NvmlSession(fake_nvml), config_dir=conf, sys_class_net=net)
    s.prime()
    for t in s.targets.values():
        t.last_cpu = (t.last_cpu[0] - 1, t.last_cpu[1]) if t.last_cpu else None
    s.tick()  # GPM: utilisation between two samples
    snap = s.tick()
    s.close()
    snap.health = {"env0": {"state": "up", "drift": 0, "heals": 1, "heal_failures": 0,
                            "retry_in": 0.0}}
    snap.quarantined = {}
    col = prom.SnapshotCollector()
    col.update(snap, tick_cpu_seconds=0.001)
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(prom.exposition(prom.registry_for(col)).decode()):
        for sample in fam.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


# ---------------------------------------------------------------- tests


def test_every_query_names_metrics_envctl_exports(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 30  # every panel's targets and the variables were found
    assert problems(dashboard, exported) == []
    used = {name for _, e, _ in exprs for name, _ in selectors(e)}
    # What the dashboard is for: environments' CPU, memory, IO, pressure; GPUs' utilisation,
    # memory, power, temperature and health; jobs by state.
    for name in ("envctl_environment_cpu_utilization_ratio",
                 "envctl_environment_memory_working_set_bytes",
                 "envctl_environment_io_bytes_total",
                 "envctl_environment_pressure_stalled_seconds_total",
                 "envctl_gpu_utilization_ratio", "envctl_gpu_memory_used_bytes",
                 "envctl_gpu_power_watts", "envctl_gpu_temperature_celsius",
                 "envctl_gpu_quarantined", "envctl_gpu_xid_errors_total", "envctl_jobs",
                 "envctl_mig_memory_used_bytes", "envctl_mig_graphics_utilization_ratio"):
        assert name in used, name
    assert not [n for n in used if not n.startswith("envctl_")]  # no --compat names


def test_a_panel_naming_what_envctl_does_not_export_fails(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    broken = copy.deepcopy(dashboard)
    row = next(p for p in broken["panels"] if p["type"] == "row")
    row["panels"] = [{"title": "old", "targets": [
        {"refId": "A", "expr": 'sum by (environment) (rate(container_cpu_usage_seconds_total'
                               '{environment=~"$environment"}[5m]))'},
        {"refId": "B", "expr": 'envctl_jobs{environmnet="box", state="RUNNING"}'},
        {"refId": "C", "expr": "envctl_service_up", "legendFormat": "{{environment}}"}]}]
    broken["templating"]["list"].append({"type": "query", "name": "old",
                                         "query": "label_values(DCGM_FI_DEV_GPU_UTIL, gpu)"})
    assert problems(broken, exported) == [
        "panel 'Overview' > panel 'old' target A: metric container_cpu_usage_seconds_total is "
        "not exported",
        "panel 'Overview' > panel 'old' target B: envctl_jobs has no label environmnet",
        "panel 'Overview' > panel 'old' target C: legend {{environment}} names a label its "
        "metrics lack",
        "variable $old: metric DCGM_FI_DEV_GPU_UTIL is not exported"]


@pytest.mark.parametrize("expr, want", [
    ('sum by (state) (envctl_jobs{instance=~"$instance", state!="LOST"})',
     [("envctl_jobs", {"instance", "state"})]),
    ("rate(a_total[$__rate_interval]) / on(gpu) group_left(modelName) b", [
        ("a_total", set()), ("b", set())]),
    ("histogram_quantile(0.9, sum(rate(x_bucket[5m:1m])) by (le)) > 1e3", [
        ("x_bucket", set())]),
    ("count(a == 1 unless on(instance) b offset 1h30m) or vector(0)", [("a", set()),
                                                                      ("b", set())]),
    ('time() - max(c{job="x"}) and bool d', [("c", {"job"}), ("d", set())]),
])
def test_the_tokenizer_finds_metric_names_only(expr, want):
    assert selectors(expr) == want


def test_every_panel_has_a_datasource_and_a_unique_id():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
