"""Property tests: whatever the validator accepts plans; whatever it rejects touches nothing."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envctl.errors import SpecError
from envctl.facts import HostFacts
from envctl.plan.builder import PlanError
from envctl.plan.planner import plan_env
from envctl.resources.base import Resource
from envctl.spec.loader import parse_spec

FACTS = HostFacts(cpus=(0, 1, 2, 3), memory_bytes=8 << 30, numa_nodes=(0,),
                  sysctls=frozenset({"net.ipv4.ip_forward", "vm.swappiness"}))

names = st.one_of(st.from_regex(r"[a-z][a-z0-9-]{0,12}[a-z0-9]", fullmatch=True),
                  st.text(max_size=40))
octet = st.integers(0, 255)
addresses = st.one_of(octet.map(lambda o: f"10.77.0.{o}"), st.just("bogus"),
                      st.builds(lambda a, b: f"10.{a}.{b}.9", octet, octet))
sizes = st.one_of(st.sampled_from(["512M", "1G", "50%", "100%", "101%", "0%", "2T", "x"]),
                  st.integers(-5, 1 << 34))
cpu_lists = st.one_of(st.sampled_from(["0-1", "2-3", "3", "1-0", "0,0", "0-9"]),
                      st.lists(st.integers(-1, 6), max_size=4),
                      st.fixed_dictionaries({"reserve_first": st.integers(0, 5),
                                             "small_host": st.sampled_from(["share", "error"])}))
sysctls = st.dictionaries(st.sampled_from(["net.ipv4.ip_forward", "vm.swappiness", "vm.nope"]),
                          st.one_of(st.integers(0, 100),
                                    st.fixed_dictionaries({"value": st.integers(0, 1),
                                                           "policy": st.sampled_from(
                                                               ["required", "best-effort"])})),
                          max_size=3)


@st.composite
def spec_dicts(draw):
    d = {"name": draw(names), "kind": draw(st.sampled_from(["cpu", "gpu", "tpu"]))}
    if draw(st.booleans()):
        d["network"] = {"bridge": draw(st.sampled_from(["br0", "compute-bridge", "x" * 16])),
                        "bridge_address": draw(st.sampled_from(
                            ["10.77.0.1/24", "10.77.0.1/31", "10.77.0.0/24"])),
                        "address": draw(addresses),
                        "ports": draw(st.lists(st.integers(0, 70000), max_size=3))}
    if draw(st.booleans()):
        d["resources"] = {"cpu": {"quota": draw(st.one_of(st.none(), st.sampled_from(
                              ["50%", "1500%", -1, "abc"]))),
                                  "dedicated": draw(st.one_of(st.none(), cpu_lists))},
                          "memory": {"max": draw(st.one_of(st.none(), sizes))}}
    if draw(st.booleans()):
        d["gpus"] = draw(st.one_of(st.integers(-1, 4), st.just("all"), st.just("none"),
                                   st.lists(st.integers(0, 3), max_size=3)))
    if draw(st.booleans()):
        d["host"] = {"sysctls": draw(sysctls)}
    if draw(st.booleans()):
        d[draw(st.sampled_from(["extra", "mounts"]))] = draw(st.sampled_from(
            [1, [{"source": "a", "target": "/a"}], [{"source": "a", "target": "rel"}]]))
    return d


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_dicts())
def test_accepted_specs_plan_and_rejected_ones_name_a_field(data):
    text = yaml.safe_dump(data)
    try:
        ls = parse_spec(text, "p.yaml")
    except SpecError as exc:
        assert exc.problems
        for p in exc.problems:
            assert p.file == "p.yaml" and p.message and p.line is not None
        return
    try:
        plan = plan_env(ls.spec, FACTS)
    except PlanError as exc:
        # Host-dependent refusals come with a field location the CLI turns into a line.
        assert exc.issues and all(loc for loc, _ in exc.issues)
        return
    keys = [r.key for r in plan.resources]
    assert len(keys) == len(set(keys))
    for r in plan.resources:
        assert Resource.from_dict(r.to_dict()) == r


@settings(max_examples=60, deadline=None)
@given(spec_dicts())
def test_rejected_specs_never_reach_the_host(tmp_path_factory, data):
    import pytest

    from envctl.cli import main
    from envctl.engine import engine as eng

    d = tmp_path_factory.mktemp("specs")
    (d / "p.yaml").write_text(yaml.safe_dump(data))
    state = d / "state"
    try:
        ls = parse_spec(yaml.safe_dump(data), "p.yaml")
        plan_env(ls.spec, FACTS)
        return  # accepted: not this property's business
    except (SpecError, PlanError):
        pass
    touched = []
    orig_up = eng.Engine.up
    eng.Engine.up = lambda *a, **k: touched.append(a)  # any call would be a bug
    try:
        mp = pytest.MonkeyPatch()
        mp.setenv("ENVCTL_STATE_DIR", str(state))
        mp.setenv("ENVCTL_CONFIG_DIR", str(d))
        mp.setattr("os.geteuid", lambda: 0)
        with pytest.raises(SystemExit) as exc:
            main(["up", str(d / "p.yaml")])
        mp.undo()
    finally:
        eng.Engine.up = orig_up
    assert exc.value.code == 2
    assert touched == [] and not state.exists()
