"""Bad input never reaches the kernel: every value the host would misread is a spec error."""

from __future__ import annotations

import time

import pytest

from envctl.errors import SpecError
from envctl.facts import HostFacts, ModuleFact
from envctl.plan.builder import PlanError
from envctl.plan.planner import plan_env
from envctl.resources.kmod import KernelModule
from envctl.resources.sysctl import Sysctl
from envctl.spec.loader import parse_spec
from envctl.spec.units import parse_cpu_list, parse_size

HEAD = "name: demo\nkind: gpu\n"
NET = "network: {bridge_address: 10.9.0.1/24, address: 10.9.0.5, ports: [%s]}"
FACTS = HostFacts(cpus=(0, 1, 2, 3), memory_bytes=8 << 30,
                  sysctls=frozenset({"vm.x", "kernel.printk"}),
                  modules={"nvidia": ModuleFact("available")})


def problems(body: str) -> list:
    with pytest.raises(SpecError) as exc:
        parse_spec(HEAD + body + "\n", "demo.yaml")
    return exc.value.problems


def accepted(body: str):
    return parse_spec(HEAD + body + "\n", "demo.yaml").spec


@pytest.mark.parametrize(("body", "field", "words"), [
    # -- non-finite, out-of-range and boolean numbers
    ("resources: {cpu: {quota: .nan}}", "resources.cpu.quota", ["finite percentage", "150%"]),
    ("resources: {cpu: {quota: .inf}}", "resources.cpu.quota", ["finite percentage"]),
    ("resources: {cpu: {quota: -.inf}}", "resources.cpu.quota", ["above 0%"]),
    ("resources: {cpu: {quota: '%s%%'}}" % ("9" * 400), "resources.cpu.quota", ["at most"]),
    ("resources: {cpu: {quota: 1e+300}}", "resources.cpu.quota", ["at most"]),
    ("resources: {cpu: {quota: true}}", "resources.cpu.quota", ["percentage"]),
    ("resources: {cpu: {quota: 0.5%}}", "resources.cpu.quota", ["1000 µs minimum"]),
    ("resources: {cpu: {quota: 2%, period_us: 10000}}", "resources.cpu.quota",
     ["200 µs", "1000 µs minimum"]),
    ("resources: {cpu: {weight: true}}", "resources.cpu.weight", ["1 to 10000", "not true"]),
    ("resources: {cpu: {weight: 1.0}}", "resources.cpu.weight", ["whole number"]),
    ("resources: {cpu: {weight: 99999999999999999999}}", "resources.cpu.weight", ["10000"]),
    ("resources: {cpu: {period_us: true}}", "resources.cpu.period_us", ["1000 to 1000000"]),
    ("resources: {io: {weight: false}}", "resources.io.weight", ["1 to 10000"]),
    ("resources: {pids: {max: true}}", "resources.pids.max", ["1 to 4194304"]),
    ("resources: {pids: {max: 99999999999999999999}}", "resources.pids.max", ["4194304"]),
    ("resources: {pids: {max: 0}}", "resources.pids.max", ["1 to 4194304"]),
    ("resources: {cpu: {dedicated: {reserve_first: true}}}",
     "resources.cpu.dedicated.reserve_first", ["whole number"]),
    ("resources: {cpu: {dedicated: {reserve_first: -1}}}",
     "resources.cpu.dedicated.reserve_first", ["0 to 65535"]),
    ("resources: {cpu: {dedicated: [true]}}", "resources.cpu.dedicated", ["boolean"]),
    ("resources: {cpu: {dedicated: 0-999999999}}", "resources.cpu.dedicated", ["65535"]),
    ("resources: {cpu: {dedicated: [99999999999999999999]}}", "resources.cpu.dedicated",
     ["65535"]),
    ("resources: {cpu: {dedicated: '\u00b2'}}", "resources.cpu.dedicated", ["not a CPU number"]),
    ("resources: {memory: {nodes: 0-999999999}}", "resources.memory.nodes",
     ["memory node", "65535"]),
    ("service: {command: x, restart_sec: .nan}", "service.restart_sec", ["finite", "86400"]),
    ("service: {command: x, restart_sec: .inf}", "service.restart_sec", ["finite"]),
    ("service: {command: x, restart_sec: true}", "service.restart_sec", ["seconds"]),
    ("service: {command: x, restart_sec: -1}", "service.restart_sec", ["0 to 86400"]),
    ("rootfs: {files: [{path: /x, content: a, mode: 99999}]}", "rootfs.files[0].mode",
     ["07777"]),
    ("rootfs: {files: [{path: /x, content: a, mode: true}]}", "rootfs.files[0].mode",
     ["07777"]),
    ("rootfs: {files: [{path: /x, content: a, mode: '0999'}]}", "rootfs.files[0].mode",
     ["octal"]),
    # -- every mapping form held to the ranges of its shorthand
    ("resources: {memory: {max: {bytes: -4096}}}", "resources.memory.max.bytes",
     ["whole number"]),
    ("resources: {memory: {max: {bytes: true}}}", "resources.memory.max.bytes",
     ["whole number"]),
    (f"resources: {{memory: {{swap_max: {{bytes: {2**64}}}}}}}", "resources.memory.swap_max.bytes",
     ["4611686018427387904"]),
    ("resources: {memory: {max: {percent: 500}}}", "resources.memory.max.percent", ["100"]),
    ("resources: {memory: {max: {percent: -1}}}", "resources.memory.max.percent", ["above 0"]),
    ("resources: {memory: {max: {percent: .nan}}}", "resources.memory.max.percent", ["finite"]),
    ("resources: {memory: {max: {percent: true}}}", "resources.memory.max.percent", ["finite"]),
    ("resources: {memory: {max: {bytes: 4096, percent: 5}}}", "resources.memory.max",
     ["one of bytes or percent"]),
    ("resources: {memory: {max: {}}}", "resources.memory.max", ["one of bytes or percent"]),
    ("gpus: {count: true}", "gpus.count", ["whole number"]),
    ("gpus: {count: 99999}", "gpus.count", ["0 to 254"]),
    ("gpus: {indices: [0, 0]}", "gpus.indices[1]", ["twice"]),
    ("gpus: {indices: [-1]}", "gpus.indices[0]", ["0 to 253"]),
    ("gpus: [300]", "gpus.indices[0]", ["0 to 253"]),
    ("gpus: {uuids: [foo]}", "gpus.uuids[0]", ["GPU-"]),
    ("gpus: ['GPU-a,GPU-b']", "gpus.uuids[0]", ["GPU-"]),
    ("gpus: {uuids: [GPU-a, GPU-a]}", "gpus.uuids[1]", ["twice"]),
    ("gpus: {all: true, count: 2}", "gpus", ["one of"]),
    ("gpus: {all: 1}", "gpus.all", ["true or false"]),
    ("network: {bridge_address: 10.9.0.1/24, address: 10.9.0.5, nat: 'no'}", "network.nat",
     ["true or false", "not 'no'"]),
    (NET % "{host: true, port: 80}", "network.ports[0].host", ["1 to 65535", "not true"]),
    (NET % "{host: 80, port: 0}", "network.ports[0].port", ["1 to 65535"]),
    (NET % "'0'", "network.ports[0]", ["1 to 65535"]),
    (NET % "0", "network.ports[0]", ["1 to 65535"]),
    (NET % "'80:99999'", "network.ports[0]", ["1 to 65535"]),
    (NET % "true", "network.ports[0]", ["HOST[:ENV]", "not true"]),
    (NET % "80.5", "network.ports[0]", ["HOST[:ENV]", "not 80.5"]),
    ("host: {governor: {name: 'per formance'}}", "host.governor.name", ["a-z"]),
    ("host: {governor: {name: abcdefghijklmnop}}", "host.governor.name", ["1-15"]),
    ("host: {governor: abcdefghijklmnop}", "host.governor.name", ["1-15"]),
    # -- sizes that round to zero pages (swap_max 0 is fine: no swap)
    ("resources: {memory: {max: 0}}", "resources.memory.max", ["4K", "leave it out"]),
    ("resources: {memory: {max: 100}}", "resources.memory.max", ["4K"]),
    ("resources: {memory: {high: {bytes: 4095}}}", "resources.memory.high", ["4K"]),
    ("resources: {memory: {max: 1.5}}", "resources.memory.max", ["whole number of bytes"]),
    ("resources: {memory: {max: .nan}}", "resources.memory.max", ["whole number of bytes"]),
    ("resources: {memory: {max: 99999999P}}", "resources.memory.max", ["at most 4096P"]),
    ("resources: {memory: {max: '%sG'}}" % ("9" * 400), "resources.memory.max",
     ["at most 4096P"]),
    # -- module names, options and values that modprobe would split or read as options
    ("host: {modules: [{name: nvidia, options: {a: '1 evil=2'}}]}",
     "host.modules[0].options.a", ["spaces"]),
    ("host: {modules: [{name: nvidia, options: {a: \"1\\tevil=2\"}}]}",
     "host.modules[0].options.a", ["spaces"]),
    ("host: {modules: [{name: nvidia, options: {a: \"1\\u00a0evil=2\"}}]}",
     "host.modules[0].options.a", ["spaces"]),
    ("host: {modules: [{name: nvidia, options: {a: '\"x'}}]}",
     "host.modules[0].options.a", ["quotes"]),
    ("host: {modules: [{name: nvidia, options: {a: \"'x y\"}}]}",
     "host.modules[0].options.a", ["quotes"]),
    # 'à' is c3 a0 in UTF-8, and the kernel's isspace() takes 0xa0 for a space.
    ("host: {modules: [{name: nvidia, options: {a: \"\u00e0\"}}]}",
     "host.modules[0].options.a", ["ASCII"]),
    ("host: {modules: [{name: nvidia, options: {a: null}}]}",
     "host.modules[0].options.a", ["text, a number"]),
    ("host: {modules: [{name: nvidia, options: {a: .nan}}]}",
     "host.modules[0].options.a", ["text, a number"]),
    ("host: {modules: [{name: nvidia, options: {a: [[1]]}}]}",
     "host.modules[0].options.a", ["text, a number"]),
    ("host: {modules: [{name: nvidia, options: {-a: 1}}]}",
     "host.modules[0].options.-a", ["letter"]),
    ("host: {modules: [-nvidia]}", "host.modules[0].name", ["not '-'"]),
    ("host: {modules: [{name: --config=/tmp/x}]}", "host.modules[0].name", ["not '-'"]),
    # -- sysctl values the kernel would read as two writes or as nothing
    ("host: {sysctls: {vm.x: \"1\\n2\"}}", "host.sysctls.vm.x", ["one line"]),
    ("host: {sysctls: {vm.x: {value: \"1\\n2\"}}}", "host.sysctls.vm.x.value", ["one line"]),
    ("host: {sysctls: {vm.x: \"1\\r\"}}", "host.sysctls.vm.x", ["one line"]),
    ("host: {sysctls: {vm.x: \"|/x\\u001b[2J\"}}", "host.sysctls.vm.x", ["control"]),
    ("host: {sysctls: {vm.x: \"1\\n\"}}", "host.sysctls.vm.x", ["one line"]),
    ("host: {sysctls: {vm.x: ''}}", "host.sysctls.vm.x", ["empty"]),
    ("host: {sysctls: {vm.x: .nan}}", "host.sysctls.vm.x", ["finite"]),
    ("host: {sysctls: {vm.x: [1, [2]]}}", "host.sysctls.vm.x", ["list"]),
    ("host: {sysctls: {vm.x: [1, \"2\\n3\"]}}", "host.sysctls.vm.x", ["one line"]),
    ("host: {sysctls: {vm.x: []}}", "host.sysctls.vm.x", ["empty"]),
    (f"host: {{sysctls: {{vm.x: {2**64}}}}}", "host.sysctls.vm.x", ["64 bits"]),
    # -- strings that end in a path, an argv or an environment
    ("rootfs: {env: {A: \"x\\0y\"}}", "rootfs.env.A", ["control characters"]),
    ("rootfs: {env: {A: \"two\\nlines\"}}", "rootfs.env.A", ["one line", "/etc/environment"]),
    ("rootfs: {files: [{path: /etc/x, source: rel/file}]}", "rootfs.files[0].source",
     ["absolute"]),
    ("gpus: {count: 1, group: 'Bad Group'}", "gpus.group", ["numeric gid"]),
    ("gpus: {count: 1, toolkit: cuda}", "gpus.toolkit", ["absolute"]),
    ("runtime: {capabilities: [SYS_FLY]}", "runtime.capabilities[0]", ["not a Linux capability"]),
    ("runtime: {capabilities: [CHOWN, cap_chown]}", "runtime.capabilities[1]",
     ["listed twice"]),
    ("rootfs: {env: {A: null}}", "rootfs.env.A", ["text, a number"]),
    ("rootfs: {env: {A: [1]}}", "rootfs.env.A", ["text, a number"]),
    ("rootfs: {env: {1A: x}}", "rootfs.env.1A", ["letters, digits"]),
    ("service: {command: [\"a\\0b\"]}", "service.command[0]", ["NUL"]),
    ("mounts: [{source: a, target: \"/x\\ny\"}]", "mounts[0].target", ["control"]),
    ("mounts: [{source: \"a\\0\", target: /x}]", "mounts[0].source", ["control"]),
    ("rootfs: {path: \"/r\\0\"}", "rootfs.path", ["control"]),
    ("rootfs: {binaries: [\"py\\nthon\"]}", "rootfs.binaries[0]", ["control"]),
])
def test_bad_values_are_one_spec_error_naming_field_and_what_is_allowed(body, field, words):
    found = problems(body)
    assert len(found) == 1, [str(p) for p in found]
    (p,) = found
    assert p.file == "demo.yaml" and p.line == 3 and p.column is not None, str(p)
    assert p.field == field, str(p)
    assert "\n" not in p.message and "Input should" not in p.message, str(p)
    for w in words:
        assert w in p.message, str(p)


def test_the_quota_minimum_is_the_kernels_on_any_host():
    # 1% of the 100 ms default period is exactly the kernel's 1000 µs floor.
    assert accepted("resources: {cpu: {quota: 1%}}").resources.cpu.quota == 1.0
    # The period comes first in the check, wherever the keys stand in the file.
    assert accepted("resources: {cpu: {quota: 0.5%, period_us: 200000}}").resources.cpu.quota \
        == 0.5


def test_legitimate_edge_values_are_accepted():
    mem = accepted("resources: {memory: {max: 4K, high: {bytes: 4096}, swap_max: 0}}")\
        .resources.memory
    assert (mem.max.bytes, mem.high.bytes, mem.swap_max.bytes) == (4096, 4096, 0)
    assert accepted("resources: {memory: {max: {percent: 100}}}").resources.memory.max.percent \
        == 100
    assert accepted("resources: {pids: {max: 4194304}}").resources.pids.max == 4194304
    assert accepted("service: {command: x, restart: no}").service.restart == "no"
    assert accepted("rootfs: {files: [{path: /x, content: a, mode: '0640'}]}")\
        .rootfs.files[0].mode == 0o640
    assert accepted("rootfs: {env: {A: \"tab\\tand spaces\", B: 1.5, C: true}}").rootfs.env \
        == {"A": "tab\tand spaces", "B": "1.5", "C": "true"}
    assert accepted("runtime: {capabilities: [cap_sys_nice, KILL]}").runtime.capabilities \
        == ("SYS_NICE", "KILL")
    gpus = accepted("gpus: [MIG-GPU-5f2c/1/0, GPU-8e2a-11]").gpus
    assert gpus.uuids == ("MIG-GPU-5f2c/1/0", "GPU-8e2a-11")
    assert accepted("gpus: {indices: [0, 253]}").gpus.indices == (0, 253)


def test_module_options_and_sysctl_values_reach_the_plan_as_single_tokens():
    spec = accepted("host:\n  modules: [{name: nvidia, options: {NVreg_X: [1, 2], b: true, "
                    "c: -1, d: 'RmA=1;RmB=2'}}]\n  sysctls: {kernel.printk: [4, 4, 1, 7], "
                    "vm.x: false}")
    plan = plan_env(spec, FACTS)
    (mod,) = [r for r in plan.resources if isinstance(r, KernelModule)]
    assert mod.options == ("NVreg_X=1,2", "b=1", "c=-1", "d=RmA=1;RmB=2")
    values = {r.name: r.value for r in plan.resources if isinstance(r, Sysctl)}
    assert values == {"kernel.printk": "4\t4\t1\t7", "vm.x": "0"}


def test_a_percentage_that_rounds_to_no_page_is_a_plan_error():
    # 0.00001% of 8G is 858 bytes: 0 pages. Whether a percentage reaches a page depends on the
    # host, so the model cannot refuse it; the planner must, naming the field.
    spec = accepted("resources: {memory: {max: 0.00001%}}")
    with pytest.raises(PlanError) as exc:
        plan_env(spec, FACTS)
    assert "resources.memory.max" in str(exc.value)


@pytest.mark.parametrize(("text", "words"), [
    # Each level holds ten of the one below: a billion values from a few hundred bytes.
    ("x0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"x{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10)),
     ["more than", "aliases"]),
    ("x: &a [*a]\n", ["contains itself"]),
    ("x: &a {y: *a}\n", ["contains itself"]),
])
def test_yaml_that_expands_without_end_is_a_spec_error_not_a_crash(text, words):
    start = time.monotonic()
    with pytest.raises(SpecError) as exc:
        parse_spec("name: demo\nkind: cpu\n" + text, "demo.yaml")
    assert time.monotonic() - start < 30  # linear work, not a billion values
    messages = " ".join(p.message for p in exc.value.problems)
    for w in words:
        assert w in messages, messages


def test_units_never_overflow_or_expand_without_bound():
    # Exact, where a float would have been inf (OverflowError): the model bounds the result.
    assert parse_size("9" * 400 + ".5G") == (10**400 - 1) * 2**30 + 2**29
    assert parse_size("1.5K") == 1536 and parse_size(4096.0) == 4096
    with pytest.raises(ValueError, match="65535"):
        parse_cpu_list("0-4000000000", most=65535)
    # Host files parse without the spec's bound (nothing to bound there).
    assert parse_cpu_list("0-3") == (0, 1, 2, 3)


def test_the_cli_prints_one_line_per_problem_and_changes_nothing(capsys, tmp_path,
                                                                 monkeypatch):
    from envctl.cli import main
    from envctl.engine import engine as eng

    d = tmp_path / "specs"
    d.mkdir()
    (d / "demo.yaml").write_text("name: demo\nkind: gpu\nresources:\n  cpu:\n    quota: .nan\n"
                                 "host:\n  modules:\n    - name: nvidia\n"
                                 "      options: {NVreg_A: '1 evil=2'}\n")
    monkeypatch.setenv("ENVCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ENVCTL_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("ENVCTL_CONFIG_DIR", str(d))
    monkeypatch.setattr("os.geteuid", lambda: 0)
    called = []
    monkeypatch.setattr(eng.Engine, "up", lambda *a, **k: called.append(a))
    for argv in (["validate", str(d)], ["up", "demo"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [
            f"error: {d}/demo.yaml:5:5: resources.cpu.quota: quota must be a finite "
            "percentage of one CPU above 0% and at most 6553600% (65536 CPUs), like 150%, "
            "not .nan",
            f"error: {d}/demo.yaml:9:17: host.modules[0].options.NVreg_A: a module option's "
            "value is printable ASCII without spaces or quotes (modprobe would split it "
            "into more options), not '1 evil=2'",
            "2 problem(s); nothing was changed",
        ]
    assert called == [] and not (tmp_path / "state").exists()


@pytest.mark.parametrize("body, field, words", [
    ("description: yes\n", "description", "YAML read yes as the boolean true; quote it (\"yes\")"),
    ("description: off\n", "description", "YAML read off as the boolean false"),
    ("rootfs: {binaries: [sh, 3.10]}\n", "rootfs.binaries[1]",
     "YAML read 3.10 as the number 3.1; quote it (\"3.10\")"),
    # YAML 1.1's integers take underscores (and its floats need a dot: 1e3 stays text).
    ("rootfs: {binaries: [1_000]}\n", "rootfs.binaries[0]", "YAML read 1_000 as the number 1000"),
])
def test_yaml_1_1_booleans_and_numbers_where_text_was_meant_say_what_yaml_read(body, field,
                                                                                words):
    (p,) = problems(body)
    assert p.field == field and words in p.message, p


def test_a_quoted_value_is_taken_as_written_and_env_values_are_text_as_typed():
    spec = accepted('description: "yes"\nrootfs:\n  binaries: [sh]\n  env: {DEBUG: on, '
                    "V: 3.10, N: 1e3, T: True, Q: '007'}\n")
    assert spec.description == "yes"
    assert spec.rootfs.env == {"DEBUG": "on", "V": "3.10", "N": "1e3", "T": "True", "Q": "007"}


def test_a_tab_in_the_indentation_is_named():
    with pytest.raises(SpecError) as exc:
        parse_spec("name: a\nkind: cpu\nrootfs:\n\tbinaries: [sh]\n", "a.yaml")
    (p,) = exc.value.problems
    assert (p.line, p.column) == (4, 1) and "a tab in the indentation" in p.message
