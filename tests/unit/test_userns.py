"""User namespace ids (pure): the host ids in use, the block each environment gets, what is
refused, the claims the journal records and their conflicts, and what `plan` says."""

from __future__ import annotations

import pytest

from envctl.facts import HostFacts, RootfsFacts
from envctl.host.idranges import host_id_ranges
from envctl.plan.builder import PlanError
from envctl.plan.claims import _clashes, spec_claims
from envctl.plan.planner import plan_env
from envctl.plan.userns import (
    POOL_END,
    POOL_FIRST,
    USERNS_SIZE,
    assign_userns,
    preferred_block,
    wants_userns,
)
from envctl.spec.loader import parse_spec


def spec(name: str, body: str = "rootfs: {binaries: [sh]}\n"):
    return parse_spec(f"name: {name}\nkind: cpu\n{body}", f"{name}.yaml").spec


def test_host_ids_are_users_groups_and_subordinate_ranges(tmp_path):
    (tmp_path / "passwd").write_text("root:x:0:0::/root:/bin/sh\n# x\nalice:x:1000:1000::/:/\n")
    (tmp_path / "group").write_text("root:x:0:\nvideo:x:44:alice\n")
    (tmp_path / "subuid").write_text("alice:100000:65536\n")
    # /etc/subgid missing: a host without subordinate gids.
    got = host_id_ranges(tmp_path)
    assert got == ((0, 1, "gid 0 (root)"), (0, 1, "uid 0 (root)"), (44, 45, "gid 44 (video)"),
                   (1000, 1001, "uid 1000 (alice)"),
                   (100000, 165536, "/etc/subuid range of alice"))


def test_each_environment_gets_its_preferred_block_in_the_pool():
    a, b = spec("a"), spec("b")
    got, why = assign_userns([b, a], HostFacts())
    assert why == {}
    assert got == {"a": preferred_block("a") * USERNS_SIZE, "b": preferred_block("b") * USERNS_SIZE}
    for base in got.values():
        assert POOL_FIRST * USERNS_SIZE <= base < POOL_END * USERNS_SIZE
        assert base % USERNS_SIZE == 0 and base + USERNS_SIZE <= 0x7FFE0000


def test_a_taken_block_moves_to_the_next_free_one():
    a = spec("a")
    first = preferred_block("a") * USERNS_SIZE
    # A host user inside the preferred block, and another environment that is up in the next.
    facts = HostFacts(host_ids=((first + 5, first + 6, "uid 7 (odd)"),),
                      userns_held={"z": first + USERNS_SIZE})
    got, why = assign_userns([a], facts)
    assert why == {} and got == {"a": first + 2 * USERNS_SIZE}


def test_an_environment_that_is_up_keeps_its_block_or_is_refused():
    a = spec("a")
    held = POOL_FIRST * USERNS_SIZE
    got, why = assign_userns([a], HostFacts(userns_held={"a": held}))
    assert got == {"a": held} and why == {}
    # A host user created since inside its block: refused, never moved while it is up.
    facts = HostFacts(userns_held={"a": held}, host_ids=((held + 9, held + 10, "uid 9 (bob)"),))
    got, why = assign_userns([a], facts)
    assert got == {} and "uid 9 (bob)" in why["a"]
    with pytest.raises(PlanError) as exc:
        plan_env(a, HostFacts(cpus=(0, 1), userns_held={"a": held}, userns_refused=why,
                              rootfs={"a": RootfsFacts()}))
    assert any(loc == ("runtime", "userns") and "uid 9 (bob)" in msg
               for loc, msg in exc.value.issues)


def test_only_native_environments_with_a_rootfs_want_one():
    assert wants_userns(spec("a"))
    assert not wants_userns(spec("a", "rootfs: {binaries: [sh]}\nruntime: {userns: false}\n"))
    assert not wants_userns(spec("a", "description: no rootfs\n"))
    assert not wants_userns(spec("a", "rootfs: {binaries: [sh]}\nruntime: {isolation: gvisor}\n"))
    got, _ = assign_userns([spec("a", "rootfs: {binaries: [sh]}\nruntime: {userns: false}\n")],
                           HostFacts())
    assert got == {}


def test_claims_record_the_block_and_overlaps_clash():
    a, b = spec("a"), spec("b")
    facts = HostFacts(userns_assigned={"a": 0x70000000, "b": 0x70010000})
    ca, cb = spec_claims(a, facts), spec_claims(b, facts)
    assert ca["userns"] == {"base": 0x70000000, "size": USERNS_SIZE}
    assert _clashes(ca, cb) == []
    cb["userns"]["base"] = 0x70000000 + 10
    assert _clashes(ca, cb) == [(("runtime", "userns"),
                                 f"user namespace host ids {0x7000000A}-{0x7000000A + 65535}")]


def test_plan_shows_root_inside_and_warns_without_a_user_namespace():
    a = spec("a")
    facts = HostFacts(cpus=(0, 1), userns_assigned={"a": 0x70000000},
                      rootfs={"a": RootfsFacts()})
    plan = plan_env(a, facts)
    assert plan.resolved["userns"].startswith(f"root inside is host uid/gid {0x70000000}")
    off = spec("a", "rootfs: {binaries: [sh]}\nruntime: {userns: false}\n")
    plan = plan_env(off, facts)
    assert any("root inside this environment is root on the host" in w for w in plan.warnings)


def test_a_launch_maps_root_and_the_jobs_own_ids_alone():
    from envctl.runtime.launch import User, id_maps

    base = 0x7000000A
    # Root: 0 alone, to the environment's own host id; no host id is reachable from inside.
    assert id_maps(base, User(0, 0, (0,))) == (f"0 {base} 1\n".encode(),) * 2
    # Its supplementary groups (a GPU node's video, /etc/group memberships) are held as
    # unmapped host gids, never mapped: root inside could chgrp a set-gid file to them.
    assert id_maps(base, User(0, 0, (44, 2000001))) == (f"0 {base} 1\n".encode(),) * 2
    # An explicit primary group (--user root:44) is its identity: mapped.
    assert id_maps(base, User(0, 44, (45,)))[1] == f"0 {base} 1\n44 44 1\n".encode()
    # alice keeps her ids and groups (video for a GPU node, a large LDAP gid too), and
    # nobody else's: root inside her launch cannot become or chown to another host user.
    uid_map, gid_map = id_maps(base, User(1000, 1000, (1000, 44, 2000001)))
    assert uid_map == f"0 {base} 1\n1000 1000 1\n".encode()
    assert gid_map == f"0 {base} 1\n44 44 1\n1000 1000 1\n2000001 2000001 1\n".encode()
    # Root among alice's groups maps to the environment's id, never to the host's gid 0.
    assert id_maps(base, User(1000, 1000, (0, 1000)))[1] == f"0 {base} 1\n1000 1000 1\n".encode()


def test_plan_warns_that_an_environment_without_network_is_in_the_hosts():
    facts = HostFacts(cpus=(0, 1), userns_assigned={"a": 0x70000000},
                      rootfs={"a": RootfsFacts()})
    warned = [w for w in plan_env(spec("a"), facts).warnings if "no network: section" in w]
    assert len(warned) == 1 and "host's network namespace" in warned[0]
    isolated = spec("a", "rootfs: {binaries: [sh]}\n"
                    "network: {address: 10.231.0.2, bridge_address: 10.231.0.1/24}\n")
    assert not [w for w in plan_env(isolated, facts).warnings if "no network" in w]


def test_a_block_whose_root_id_the_name_service_knows_moves_on(monkeypatch):
    """An SSSD/LDAP user is in no /etc/passwd: the id root inside would be is also looked up
    through NSS, and a block whose first id a directory user or group holds is skipped."""
    import envctl.host.idranges as idranges
    from envctl.workspace import _assign_userns

    a = spec("a")
    first = preferred_block("a") * USERNS_SIZE
    asked = []

    def nss(n):
        asked.append(n)
        return "uid (dave, from the name service)" if n == first else None

    monkeypatch.setattr(idranges, "nss_holder", nss)
    facts = _assign_userns([a], HostFacts(), {})
    assert facts.userns_assigned == {"a": first + USERNS_SIZE} and facts.userns_refused == {}
    assert asked == [first, first + USERNS_SIZE]
    # One that is up keeps its block, whatever the directory says now (it is never asked).
    asked.clear()
    facts = _assign_userns([a], HostFacts(userns_held={"a": first}), {"a": first})
    assert facts.userns_assigned == {"a": first} and asked == []


def test_nss_holder_names_a_known_id_and_none_for_a_free_one():
    from envctl.host.idranges import nss_holder

    assert nss_holder(0) == "uid 0 (root, from the name service)"
    assert nss_holder(0x7FFDFFF0) is None  # in envctl's pool: no user on this machine


def test_a_name_service_holding_every_block_tried_refuses_the_environment(monkeypatch):
    import envctl.host.idranges as idranges
    from envctl.workspace import _assign_userns

    monkeypatch.setattr(idranges, "nss_holder", lambda n: f"uid {n} (dir, from the name service)")
    facts = _assign_userns([spec("a")], HostFacts(), {})
    assert facts.userns_assigned == {} and "held (uid" in facts.userns_refused["a"]
