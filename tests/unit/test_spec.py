"""Spec validation: good specs load, bad ones name file, line, field and what is allowed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from envctl.errors import SpecError
from envctl.spec.loader import load_specs, parse_spec
from envctl.spec.units import format_cpu_list, format_size, parse_cpu_list, parse_size

REPO = Path(__file__).resolve().parents[2]

BASE = """\
name: demo
kind: cpu
network:
  bridge: br-demo
  bridge_address: 10.9.0.1/24
  address: 10.9.0.5
"""


def errors(text: str) -> list:
    with pytest.raises(SpecError) as exc:
        parse_spec(textwrap.dedent(text), "demo.yaml")
    return exc.value.problems


def one_error(text: str):
    problems = errors(text)
    assert len(problems) == 1, [str(p) for p in problems]
    return problems[0]


def test_minimal_spec_loads_with_defaults():
    ls = parse_spec("name: a\nkind: cpu\n", "a.yaml")
    assert ls.spec.name == "a" and ls.spec.network is None
    assert not ls.spec.gpus.wanted


def test_shipped_configs_validate_together():
    loaded = load_specs(sorted((REPO / "configs").glob("*.yaml")))
    assert {ls.spec.name for ls in loaded} == {"cpu-compute", "gpu-compute"}
    cpu = next(ls.spec for ls in loaded if ls.spec.name == "cpu-compute")
    assert str(cpu.network.address) == "10.200.0.21" and cpu.network.ports[0].host == 9090
    assert cpu.resources.cpu.cpus == 15 and cpu.resources.cpu.percent == 1500.0
    assert cpu.resources.io.weight == 900
    assert cpu.resources.memory.max.percent == 70
    gpu = next(ls.spec for ls in loaded if ls.spec.name == "gpu-compute")
    assert gpu.gpus.all and [m.name for m in gpu.host.modules] == ["nvidia", "nvidia_uvm"]
    assert gpu.rootfs.env["CUDA_VISIBLE_DEVICES"] == "all"


@pytest.mark.parametrize(
    "text, field, line, words",
    [
        ("name: demo\nkind: cpu\nextra: 1\n", "extra", 3, ["unknown field 'extra'", "kind"]),
        ("name: demo\nkind: tpu\n", "kind", 2, ["'gpu' or 'cpu'"]),
        ("name: Demo_1\nkind: cpu\n", "name", 1, ["a-z"]),
        ("name: " + "a" * 40 + "\nkind: cpu\n", "name", 1, ["1-32 characters"]),
        ("kind: cpu\n", "name", None, ["required"]),
        (BASE.replace("br-demo", "a-very-long-bridge-name"), "network.bridge", 4,
         ["interface name", "1-15"]),
        (BASE.replace("10.9.0.1/24", "10.9.0.1/33"), "network.bridge_address", 5, []),
        (BASE.replace("10.9.0.1/24", "10.9.0.0/24"), "network.bridge_address", 5,
         ["network or broadcast"]),
        # Each at the line of the value that is wrong, not at the section's.
        (BASE.replace("address: 10.9.0.5", "address: 10.8.0.5"), "network.address", 6,
         ["outside the bridge subnet 10.9.0.0/24"]),
        (BASE + "  gateway: 10.1.1.1\n", "network.gateway", 7, ["gateway 10.1.1.1 is outside"]),
        (BASE.replace("address: 10.9.0.5", "address: 10.9.0.1"), "network.address", 6,
         ["bridge's own address"]),
        (BASE + "  ports: [8080, 8080]\n", "network.ports[1]", 7,
         ["8080/tcp is forwarded twice", "entry 1 repeats entry 0"]),
        (BASE + "  ports:\n    - 8080\n    - 9090\n    - 8080/tcp\n", "network.ports[2]", 10,
         ["8080/tcp is forwarded twice"]),
        (BASE + "  ports: ['80:70000']\n", "network.ports[0]", 7, ["1 to 65535"]),
        (BASE + "  ports: ['http']\n", "network.ports[0]", 7, ["HOST[:ENV]"]),
        ("name: demo\nkind: cpu\nresources:\n  memory:\n    max: 170%\n",
         "resources.memory.max", 5, ["at most 100%"]),
        ("name: demo\nkind: cpu\nresources:\n  memory:\n    max: lots\n",
         "resources.memory.max", 5, ["not a size"]),
        ("name: demo\nkind: cpu\nresources:\n  memory:\n    max: 1G\n    high: 2G\n",
         "resources.memory.high", 6, ["memory.high (2G) is above memory.max (1G)"]),
        ("name: demo\nkind: cpu\nresources:\n  cpu:\n    dedicated: 2-1\n",
         "resources.cpu.dedicated", 5, ["backwards"]),
        ("name: demo\nkind: cpu\nresources:\n  cpu:\n    dedicated: 1,1\n",
         "resources.cpu.dedicated", 5, ["twice"]),
        ("name: demo\nkind: cpu\nresources:\n  cpu:\n    quota: -5%\n",
         "resources.cpu.quota", 5, []),
        ("name: demo\nkind: cpu\nresources:\n  cpu:\n    weight: 0\n",
         "resources.cpu.weight", 5, ["from 1 to 10000"]),
        ("name: demo\nkind: cpu\nresources:\n  io:\n    weight: 20000\n",
         "resources.io.weight", 5, ["10000"]),
        ("name: demo\nkind: cpu\ngpus: 1\n", "gpus", 3, ["kind: cpu", "GPUs"]),
        ("name: demo\nkind: gpu\ngpus: [0, GPU-1]\n", "gpus", 3, ["not a mix"]),
        ("name: demo\nkind: gpu\ngpus: [0, 0]\n", "gpus[1]", 3, ["GPU index 0", "twice"]),
        ("name: demo\nkind: gpu\ngpus:\n  - 1\n  - 0\n  - 1\n", "gpus[2]", 6, ["twice"]),
        ("name: demo\nkind: cpu\nmounts:\n  - {source: a, target: data}\n",
         "mounts[0].target", 4, ["absolute"]),
        ("name: demo\nkind: cpu\nmounts:\n  - {source: ../etc, target: /x}\n",
         "mounts[0].source", 4, ["'..'"]),
        ("name: demo\nkind: cpu\nmounts:\n  - {source: a, target: /x}\n"
         "  - {source: b, target: /x}\n", "mounts[1].target", 5, ["/x is used twice"]),
        ("name: demo\nkind: cpu\nhost:\n  sysctls:\n    bad name: 1\n",
         "host.sysctls.bad name", 5, []),
        ("name: demo\nkind: cpu\nhost:\n  sysctls:\n    vm.x: {value: 1, policy: maybe}\n",
         "host.sysctls.vm.x.policy", 5, ["'required' or 'best-effort'"]),
        ("name: demo\nkind: cpu\nhost:\n  modules: [nvidia, nvidia]\n", "host.modules[1]", 4,
         ["twice"]),
        ("name: demo\nkind: cpu\nservice:\n  command: ''\n", "service.command", 4, ["empty"]),
        ("name: demo\nkind: cpu\nrootfs:\n  env:\n    1BAD: x\n", "rootfs.env.1BAD", 5, []),
        ("name: demo\nkind: cpu\nrootfs:\n  files:\n    - {path: /etc/x}\n",
         "rootfs.files[0]", 5, ["exactly one of"]),
    ],
)
def test_bad_specs_name_field_and_line(text, field, line, words):
    problem = one_error(text)
    assert problem.file == "demo.yaml"
    assert problem.field == field, str(problem)
    if line is not None:
        assert problem.line == line, str(problem)
    for w in words:
        assert w in problem.message, str(problem)


def test_yaml_syntax_error_has_line_and_column():
    p = one_error("name: demo\nkind: [cpu\n")
    assert "YAML syntax error" in p.message and p.line is not None and p.column is not None


def test_duplicate_key_is_an_error():
    p = one_error("name: demo\nkind: cpu\nname: other\n")
    assert p.line == 3 and "appears twice" in p.message


def test_every_problem_of_a_file_is_reported_at_once():
    problems = errors("name: Bad\nkind: x\nnetwork: {address: 1.2.3.4, bogus: 1}\n")
    fields = {p.field for p in problems}
    assert {"name", "kind", "network.bogus"} <= fields


def test_empty_and_multi_document_files_are_refused():
    assert "empty" in one_error("").message
    assert "several YAML documents" in one_error("name: a\nkind: cpu\n---\nname: b\n").message


def test_problem_renders_file_line_column_field():
    p = one_error("name: demo\nkind: cpu\nextra: 1\n")
    assert str(p).startswith("demo.yaml:3:1: extra: unknown field")


def test_shorthands():
    ls = parse_spec(BASE + "  ports: [8080, '9000:90/udp']\ngpus: none\n", "x.yaml")
    p1, p2 = ls.spec.network.ports
    assert (p1.host, p1.port, p1.protocol) == (8080, 8080, "tcp")
    assert (p2.host, p2.port, p2.protocol) == (9000, 90, "udp")
    ls = parse_spec("name: g\nkind: gpu\ngpus: [GPU-aa, GPU-bb]\nservice: {command: 'a b'}\n",
                    "g.yaml")
    assert ls.spec.gpus.uuids == ("GPU-aa", "GPU-bb")
    assert ls.spec.service.command == ("a", "b")
    ls = parse_spec("name: g\nkind: gpu\ngpus: 2\nhost:\n  sysctls: {vm.x: true}\n"
                    "  modules: [nvidia]\n  governor: performance\n", "g.yaml")
    assert ls.spec.gpus.count == 2 and ls.spec.host.sysctls["vm.x"].value == "1"
    assert ls.spec.host.modules[0].name == "nvidia"
    assert ls.spec.host.governor.name == "performance"


@pytest.mark.parametrize("text, want", [("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)),
                                        (5, (5,)), ([3, 1], (1, 3)), ("", ())])
def test_cpu_lists(text, want):
    assert parse_cpu_list(text) == want


@pytest.mark.parametrize("cpus", [(0,), (0, 1, 2, 5), (1, 3, 4, 5, 9)])
def test_cpu_list_round_trip(cpus):
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize("text, want", [("512M", 512 << 20), ("16GiB", 16 << 30),
                                        ("1.5G", 3 << 29), (4096, 4096), ("10", 10)])
def test_sizes(text, want):
    assert parse_size(text) == want


def test_format_size():
    assert format_size(512) == "512"
    assert format_size(16 << 30) == "16G"
    assert format_size(3 << 29) == "1.5G"


@pytest.mark.parametrize("modules", [
    "[-nvidia]",
    "[{name: nvidia, options: {'--config': /tmp/x}}]",
    "[{name: nvidia, options: {a b: 1}}]",
    "[{name: nvidia, options: {NVreg: \"1\\nx\"}}]",
])
def test_module_names_and_options_cannot_smuggle_modprobe_options(modules):
    problems = errors(f"name: demo\nkind: gpu\nhost:\n  modules: {modules}\n")
    assert problems and all(p.field.startswith("host.modules") for p in problems)


@pytest.mark.parametrize(("name", "dotted"), [
    ("net/ipv4/ip_forward", "net.ipv4.ip_forward"),
    ("net.ipv4.conf.eth0/100.rp_filter", "net.ipv4.conf.eth0/100.rp_filter"),
    ("net/ipv4/conf/eth0.100/rp_filter", "net.ipv4.conf.eth0/100.rp_filter"),
])
def test_sysctl_names_take_both_of_sysctls_spellings(name, dotted):
    from envctl.spec.sysctls import canonical

    spec = parse_spec(f"name: a\nkind: cpu\nhost:\n  sysctls:\n    {name}: 1\n", "a.yaml").spec
    assert [canonical(n) for n in spec.host.sysctls] == [dotted]


@pytest.mark.parametrize("name", ["net/../etc", "net..x", "net//x", "net/ipv4/./x", "net./x"])
def test_sysctl_names_never_leave_proc_sys(name):
    with pytest.raises(SpecError, match="a sysctl name is"):
        parse_spec(f"name: a\nkind: cpu\nhost:\n  sysctls:\n    {name}: 1\n", "a.yaml")


def test_jobs_max_output_is_a_size_default_1g_and_0_or_none_unbounded():
    from envctl.plan.claims import spec_claims
    from envctl.spec.models import DEFAULT_MAX_OUTPUT, EnvSpec

    def bound(v):
        return EnvSpec(name="a", kind="cpu", jobs={"max_output": v}).jobs.max_output

    assert EnvSpec(name="a", kind="cpu").jobs.max_output == DEFAULT_MAX_OUTPUT == 1 << 30
    assert [bound(v) for v in ("1M", "2G", 4096, 0, "0", "none", None)] == [
        1 << 20, 2 << 30, 4096, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="'lots' is not a size"):
        bound("lots")
    # Recorded for the supervisors only when it is not the default.
    assert "max_output" not in spec_claims(EnvSpec(name="a", kind="cpu"), None)
    assert spec_claims(EnvSpec(name="a", kind="cpu", jobs={"max_output": "1M"}),
                       None)["max_output"] == 1 << 20


def test_jobs_per_user_bounds_default_1000_jobs_and_10g_staged_and_reach_the_context():
    from envctl.plan.claims import spec_claims
    from envctl.runtime.context import EnvContext
    from envctl.spec.models import (
        DEFAULT_MAX_QUEUED_PER_USER,
        DEFAULT_MAX_STAGED_PER_USER,
        EnvSpec,
    )

    jobs = EnvSpec(name="a", kind="cpu").jobs
    assert (jobs.max_queued_per_user, jobs.max_staged_per_user) == (1000, 10 << 30) == (
        DEFAULT_MAX_QUEUED_PER_USER, DEFAULT_MAX_STAGED_PER_USER)
    # The context's defaults (no pydantic there) are the spec's.
    assert (EnvContext._defaults["max_queued_per_user"],
            EnvContext._defaults["max_staged_per_user"]) == (1000, 10 << 30)
    assert "jobs" not in spec_claims(EnvSpec(name="a", kind="cpu"), None)
    spec = EnvSpec(name="a", kind="cpu", jobs={"max_queued_per_user": 5,
                                               "max_staged_per_user": "1M"})
    assert spec_claims(spec, None)["jobs"] == {"max_queued_per_user": 5,
                                                "max_staged_per_user": 1 << 20}
    assert EnvSpec(name="a", kind="cpu", jobs={"max_staged_per_user": "none"}
                   ).jobs.max_staged_per_user == 0
    with pytest.raises(ValueError, match="max_queued_per_user"):
        EnvSpec(name="a", kind="cpu", jobs={"max_queued_per_user": 0})
