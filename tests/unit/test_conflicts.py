"""Cross-environment checks: every conflict in a directory is listed at once."""

from __future__ import annotations

import pytest

from envctl.errors import SpecError
from envctl.facts import HostFacts
from envctl.spec.loader import load_specs

FACTS = HostFacts(cpus=tuple(range(8)), memory_bytes=16 << 30)


def spec(name: str, *, addr: str = "", extra: str = "", bridge: str = "br0",
         subnet: str = "10.50.0.1/24") -> str:
    text = f"name: {name}\nkind: gpu\n"
    if addr:
        text += (f"network:\n  bridge: {bridge}\n  bridge_address: {subnet}\n"
                 f"  address: {addr}\n")
    return text + extra


def load(tmp_path, files: dict[str, str], facts=FACTS):
    paths = []
    for fname, text in files.items():
        p = tmp_path / fname
        p.write_text(text)
        paths.append(p)
    return load_specs(paths, facts)


def problems(tmp_path, files, facts=FACTS):
    with pytest.raises(SpecError) as exc:
        load(tmp_path, files, facts)
    return exc.value.problems


def test_disjoint_specs_load(tmp_path):
    loaded = load(tmp_path, {"a.yaml": spec("a", addr="10.50.0.2"),
                             "b.yaml": spec("b", addr="10.50.0.3")})
    assert [ls.spec.name for ls in loaded] == ["a", "b"]


def test_every_conflict_is_reported_at_once(tmp_path):
    a = spec("a", addr="10.50.0.2", extra=(
        "  ports: [8080]\nresources:\n  cpu: {dedicated: 2-3}\n  memory: {max: 10G}\n"
        "gpus: [0]\nhost:\n  sysctls: {net.ipv4.ip_forward: 1}\n"))
    b = spec("a", addr="10.50.0.2", extra=(
        "  ports: [8080]\nresources:\n  cpu: {dedicated: 3-4}\n  memory: {max: 10G}\n"
        "gpus: [0]\nhost:\n  sysctls: {net.ipv4.ip_forward: 0}\n"))
    found = problems(tmp_path, {"a.yaml": a, "b.yaml": b})
    text = "\n".join(map(str, found))
    assert all(p.file.endswith("b.yaml") for p in found)
    for expected in ("name 'a' is already claimed", "dedicated CPU 3", "GPU 0",
                     "address 10.50.0.2", "host port 8080/tcp", "net.ipv4.ip_forward=0",
                     "memory limits add up to 20G"):
        assert expected in text, text
    assert "a.yaml" in text  # the first claimant is named


def test_bridge_address_must_agree_and_subnets_must_not_overlap(tmp_path):
    found = problems(tmp_path, {
        "a.yaml": spec("a", addr="10.50.0.2"),
        "b.yaml": spec("b", addr="10.50.0.3", subnet="10.50.0.254/24"),
        "c.yaml": spec("c", addr="10.50.1.3", bridge="br1", subnet="10.50.0.1/16"),
    })
    text = "\n".join(map(str, found))
    assert "must agree" in text and "overlaps" in text


def test_reserved_cpus_resolved_against_the_host(tmp_path):
    ded = "resources:\n  cpu:\n    dedicated: {reserve_first: 1}\n"
    found = problems(tmp_path, {"a.yaml": spec("a", extra=ded), "b.yaml": spec("b", extra=ded)})
    assert "dedicated CPU 1" in str(found[0])


def test_percent_memory_summed_against_host(tmp_path):
    files = {"a.yaml": spec("a", extra="resources:\n  memory: {max: 60%}\n"),
             "b.yaml": spec("b", extra="resources:\n  memory: {max: 50%}\n")}
    assert "more than the host" in str(problems(tmp_path, files)[0])
    files["b.yaml"] = spec("b", extra="resources:\n  memory: {max: 40%}\n")
    assert len(load(tmp_path, files)) == 2


def test_problems_from_several_files_and_conflicts_together(tmp_path):
    found = problems(tmp_path, {"a.yaml": "name: a\nkind: nope\n",
                                "b.yaml": spec("c", addr="10.50.0.2"),
                                "c.yaml": spec("c", addr="10.50.0.3")})
    files = {p.file.rsplit("/", 1)[-1] for p in found}
    assert files == {"a.yaml", "c.yaml"}


def test_derived_interface_names_that_collide_are_refused(tmp_path, monkeypatch):
    import envctl.spec.conflicts as conflicts

    monkeypatch.setattr(conflicts, "host_veth", lambda name: "ve-same-00000")
    found = problems(tmp_path, {"a.yaml": spec("a", addr="10.50.0.2"),
                                "b.yaml": spec("b", addr="10.50.0.3")})
    assert "host interface name ve-same-00000" in str(found[0])


def test_implicit_ip_forward_of_nat_conflicts_with_an_explicit_zero(tmp_path):
    found = problems(tmp_path, {
        "a.yaml": spec("a", addr="10.50.0.2"),  # nat defaults to on: needs ip_forward=1
        "b.yaml": spec("b", extra="host:\n  sysctls: {net.ipv4.ip_forward: 0}\n"),
    })
    assert "net.ipv4.ip_forward=0" in str(found[0]) and "a.yaml" in str(found[0])


def test_shares_of_memory_over_100_percent_are_refused_on_any_machine(tmp_path):
    from envctl.spec.conflicts import find_conflicts
    from envctl.spec.loader import parse_spec

    specs = [parse_spec(f"name: {n}\nkind: cpu\nresources: {{memory: {{max: {pct}%}}}}\n",
                        f"{n}.yaml") for n, pct in (("a", 90), ("b", 70))]
    found = [str(p) for p in find_conflicts(specs, None)]
    assert found == ["b.yaml:3:22: resources.memory.max: memory limits add up to 160% of host "
                     "memory (a 90%, b 70%), more than all of it"]


def test_one_spec_asking_two_values_of_one_sysctl_is_refused():
    from envctl.spec.conflicts import find_conflicts
    from envctl.spec.loader import parse_spec

    both = parse_spec("name: a\nkind: cpu\nhost:\n  sysctls:\n    net.ipv4.ip_forward: 1\n"
                      "    net/ipv4/conf/all/forwarding: 0\n", "a.yaml")
    assert [p.message for p in find_conflicts([both], None)] == [
        "wants net/ipv4/conf/all/forwarding=0 but net.ipv4.ip_forward=1 in the same spec is "
        "the same kernel value"]
    nat = parse_spec("name: b\nkind: cpu\nnetwork: {address: 10.200.0.3}\nhost:\n  sysctls:\n"
                     "    net.ipv4.ip_forward: 0\n", "b.yaml")
    assert [p.message for p in find_conflicts([nat], None)] == [
        "wants net.ipv4.ip_forward=0, but network.nat or network.ports need "
        "net.ipv4.ip_forward=1"]


def test_sysctl_values_differing_only_in_white_space_are_one_value():
    from envctl.spec.conflicts import find_conflicts
    from envctl.spec.loader import parse_spec

    specs = [parse_spec(f"name: {n}\nkind: cpu\nhost:\n  sysctls:\n"
                        f"    net.ipv4.ip_local_port_range: {v}\n", f"{n}.yaml")
             for n, v in (("a", '"1024 65000"'), ("b", "[1024, 65000]"))]
    assert find_conflicts(specs, None) == []


def test_every_gpu_leaves_none_for_another_environment():
    from envctl.spec.conflicts import find_conflicts
    from envctl.spec.loader import parse_spec

    specs = [parse_spec("name: a\nkind: gpu\ngpus: all\n", "a.yaml"),
             parse_spec("name: b\nkind: gpu\ngpus: [0]\n", "b.yaml")]
    found = [p.message for p in find_conflicts(specs, None)]
    assert found == ["a GPU is wanted, but environment 'a' (a.yaml) has every GPU"]


def test_governors_and_module_options_of_an_environment_that_is_up_are_held():
    from envctl.plan.claims import held_conflicts, spec_claims
    from envctl.spec.loader import parse_spec

    facts = HostFacts(cpus=(0, 1), cpufreq_policies={0: (0, 1)})
    up = parse_spec("name: up1\nkind: cpu\nresources: {cpu: {dedicated: [0]}}\nhost:\n"
                    "  governor: {name: performance, cpus: dedicated}\n"
                    "  modules: [{name: dummy, options: {numdummies: 2}}]\n", "up1.yaml")
    held = {"up1": ("/j/up1.json", spec_claims(up.spec, facts))}
    new = parse_spec("name: new\nkind: cpu\nresources: {cpu: {dedicated: [1]}}\nhost:\n"
                     "  governor: {name: powersave, cpus: dedicated}\n"
                     "  modules: [{name: dummy, options: {numdummies: 3}}]\n", "new.yaml")
    found = [p.message for p in held_conflicts([new], held, facts)]
    assert any("cpufreq policy0 (governor performance; this spec wants powersave)" in m
               for m in found)
    assert any("kernel module dummy (loaded with options 'numdummies=2'" in m for m in found)


def test_up_records_the_description_with_the_claims_and_it_clashes_with_nothing():
    from envctl.plan.claims import _clashes, spec_claims
    from envctl.spec.loader import parse_spec

    a = parse_spec("name: a\nkind: cpu\ndescription: team A's batch work\n", "a.yaml").spec
    b = parse_spec("name: b\nkind: cpu\ndescription: team A's batch work\n", "b.yaml").spec
    assert spec_claims(a, None)["description"] == "team A's batch work"
    assert _clashes(spec_claims(a, None), spec_claims(b, None)) == []
    assert "description" not in spec_claims(
        parse_spec("name: c\nkind: cpu\n", "c.yaml").spec, None)


# ---------------------------------------------------------------- every error in one run


def where(found) -> list[tuple[str, int | None, str]]:
    return [(p.file.rsplit("/", 1)[-1], p.line, p.field) for p in found]


def test_field_errors_and_conflicts_come_together_each_at_the_entry_at_fault(tmp_path):
    # a: a field error (memory.max), the address outside its subnet, a port forwarded twice,
    # and a port and a GPU that b claims too; c repeats b's address.
    a = ("name: a\nkind: gpu\n"
         "network:\n"
         "  bridge_address: 10.60.0.1/24\n"
         "  address: 10.61.0.5\n"           # 5: outside 10.60.0.0/24
         "  ports:\n"
         "    - 8080\n"
         "    - 9090\n"                      # 8: b has it too
         "    - 8080\n"                      # 9: twice in a
         "resources:\n"
         "  memory: {max: lots}\n"           # 11: field error
         "gpus:\n"
         "  indices: [3, 1]\n")              # 13: b has GPU 1
    b = ("name: b\nkind: gpu\n"
         "network:\n"
         "  bridge_address: 10.60.0.1/24\n"
         "  address: 10.60.0.7\n"
         "  ports: [7000, 9090]\n"           # 6: a's
         "gpus: [1]\n")                      # 7: a's
    c = ("name: c\nkind: cpu\n"
         "network:\n"
         "  bridge_address: 10.60.0.1/24\n"
         "  address: 10.60.0.7\n")           # 5: b's
    found = problems(tmp_path, {"a.yaml": a, "b.yaml": b, "c.yaml": c})
    assert where(found) == [
        ("a.yaml", 5, "network.address"),
        ("a.yaml", 9, "network.ports[2]"),
        ("a.yaml", 11, "resources.memory.max"),
        ("b.yaml", 6, "network.ports[1]"),
        ("b.yaml", 7, "gpus[0]"),
        ("c.yaml", 5, "network.address"),
    ], "\n".join(map(str, found))
    text = {p.field + "@" + p.file.rsplit("/", 1)[-1]: p.message for p in found}
    assert "outside the bridge subnet 10.60.0.0/24" in text["network.address@a.yaml"]
    assert "entry 2 repeats entry 0" in text["network.ports[2]@a.yaml"]
    assert f"host port 9090/tcp is already claimed by environment 'a' ({tmp_path}/a.yaml:8)" \
        in text["network.ports[1]@b.yaml"]
    assert f"GPU 1 is already claimed by environment 'a' ({tmp_path}/a.yaml:13)" \
        in text["gpus[0]@b.yaml"]
    assert "environment 'b'" in text["network.address@c.yaml"]


def test_the_long_gpu_form_is_reported_at_the_index(tmp_path):
    found = problems(tmp_path, {"a.yaml": "name: a\nkind: gpu\ngpus: [0, 2]\n",
                                "b.yaml": "name: b\nkind: gpu\ngpus:\n  indices: [1, 2]\n"})
    assert where(found) == [("b.yaml", 4, "gpus.indices[1]")]


def test_list_entries_after_one_in_error_keep_their_lines(tmp_path):
    # ports[1] has an error, so the spec is checked without it: ports[2] is still ports[2].
    a = "name: a\nkind: cpu\nnetwork:\n  address: 10.200.0.2\n  ports: [1, 0, 3]\n"
    b = ("name: b\nkind: cpu\nnetwork:\n  address: 10.200.0.3\n  ports:\n    - 1\n"
         "    - 3\n")
    found = problems(tmp_path, {"a.yaml": a, "b.yaml": b})
    assert where(found) == [("a.yaml", 5, "network.ports[1]"), ("b.yaml", 6, "network.ports[0]"),
                            ("b.yaml", 7, "network.ports[1]")]
    assert "1 to 65535" in found[0].message


def test_a_value_in_error_claims_nothing_nor_does_the_default_standing_in_for_it(tmp_path):
    # a's bridge_address is wrong: the default (10.200.0.1/24) must not be compared with b's
    # address for compute-bridge, nor a's address (a stand-in) with b's, nor a's name.
    a = ("name: a\nkind: cpu\nnetwork:\n  bridge_address: 10.0.0.1/33\n  address: 10.9.0.9\n"
         "  nat: maybe\n")
    # (a's nat is wrong: its default, true, must not want ip_forward=1 against e's 0.)
    b = ("name: b\nkind: cpu\nnetwork:\n  bridge_address: 10.9.0.1/24\n  address: 10.9.0.9\n"
         "  nat: false\nhost:\n  governor: {name: performance, cpus: dedicated}\n")
    # A name in error claims nothing either; d's valid one still meets b's.
    c = "name: B\nkind: cpu\nresources: {memory: {max: 60%}}\n"
    d = "name: b\nkind: cpu\nresources: {memory: {max: 30%}}\n"
    e = "name: e\nkind: cpu\nhost:\n  sysctls: {net.ipv4.ip_forward: 0}\n"
    found = problems(tmp_path, {"a.yaml": a, "b.yaml": b, "c.yaml": c, "d.yaml": d,
                                "e.yaml": e}, None)
    assert where(found) == [
        ("a.yaml", 4, "network.bridge_address"),
        ("a.yaml", 6, "network.nat"),
        ("b.yaml", 8, "host.governor.cpus"),
        ("c.yaml", 1, "name"),
        ("d.yaml", 1, "name"),
    ], "\n".join(map(str, found))
    assert "already claimed by environment 'b'" in found[-1].message


def test_a_field_error_does_not_hide_the_cross_field_errors_of_other_fields(tmp_path):
    text = ("name: a\nkind: cpu\n"
            "network:\n  address: 10.1.2.3\n  interface: 'bad name'\n"
            "gpus: 1\n"
            "mounts:\n  - {source: x, target: /m}\n  - {source: y, target: /m/}\n"
            "resources: {cpu: {weight: 0}}\n")
    found = problems(tmp_path, {"a.yaml": text})
    assert where(found) == [
        ("a.yaml", 4, "network.address"),
        ("a.yaml", 5, "network.interface"),
        ("a.yaml", 6, "gpus"),
        ("a.yaml", 9, "mounts[1].target"),
        ("a.yaml", 10, "resources.cpu.weight"),
    ], "\n".join(map(str, found))


def test_what_an_environment_that_is_up_holds_is_checked_on_an_invalid_spec_too():
    from envctl.plan.claims import held_conflicts, spec_claims
    from envctl.spec.loader import parse_spec

    up = parse_spec("name: up1\nkind: cpu\nnetwork:\n  bridge_address: 10.200.0.1/16\n"
                    "  address: 10.200.0.9\n  ports: [8080]\n  nat: false\n"
                    "host: {sysctls: {net.ipv4.ip_forward: 0}}\n", "up1.yaml")
    held = {"up1": ("/j/up1.json", spec_claims(up.spec, None))}
    with pytest.raises(SpecError) as exc:
        parse_spec("name: new\nkind: cpu\nnetwork:\n  bridge_address: 10.1.0.1/40\n"
                   "  address: 10.200.0.9\n  ports: [9, 8080]\n  nat: maybe\n"
                   "resources: {pids: {max: 0}}\n", "new.yaml")
    partial = exc.value.partial
    assert partial.partial and partial.dropped == {("network", "bridge_address"),
                                                   ("network", "nat"),
                                                   ("resources", "pids", "max")}
    found = held_conflicts([partial], held, None)
    # The address and the port are the file's own; the bridge's address and nat (in error)
    # are not compared, nor the defaults standing in for them (nat's would want forwarding).
    assert [(p.line, p.field) for p in found] == [(5, "network.address"),
                                                  (6, "network.ports[1]")]
    assert "host port tcp/8080 is held by environment 'up1'" in found[1].message
