"""Planning the MIG instances a spec asks `up` to make (`gpus.mig`): where each goes on its
GPU (placements, as `nvidia-smi mig -lgipp` numbers memory slices), which slots other
environments and instances envctl did not make already hold, and the resources that make
them. Pure.

A placement is sticky: an environment that is up keeps the slots its journal claims, so a
second `up` finds its instances where they are. Instances envctl did not make are never
taken: their slots are simply not free."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from envctl.resources.mig import MigInstance, MigMode, slots
from envctl.spec.migprofiles import KNOWN_MODELS, model_profiles

if TYPE_CHECKING:
    from envctl.facts import GpuFact, HostFacts
    from envctl.plan.builder import Plan
    from envctl.spec.models import EnvSpec

SLOTS = 8  # memory slices of an A100/H100/H200
PENDING_KEY = "mig.pending"  # plan.resolved: how many of its instances `up` has yet to make
Placement = tuple[int, str, str, int, int, str]  # index, GPU UUID, profile, start, size, MIG


def _free_text(used: dict[int, str], mine: list[Placement], uuid: str, env: str) -> str:
    """The memory slices of GPU `uuid` free for `env` as ranges ("4-7"; "none"): held by no
    one else and not yet given to one of its own instances (`mine`)."""
    free = [s for s in range(SLOTS)
            if used.get(s, env) == env and not _mine_at(mine, uuid, s)]
    runs: list[list[int]] = []
    for s in free:
        if runs and runs[-1][-1] == s - 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(slots(r[0], len(r)) for r in runs) or "none"


def _existing(gpu: GpuFact) -> dict[tuple[int, int, str], str]:
    """(start, size, profile) -> the MIG UUID of each GPU instance on `gpu` (its first CI)."""
    out: dict[tuple[int, int, str], str] = {}
    for m in sorted(gpu.mig_devices, key=lambda m: (m.gi, m.ci)):
        out.setdefault((m.start, m.size, m.profile), m.uuid)
    return out


def assign_mig(specs: Sequence[EnvSpec], facts: HostFacts
               ) -> tuple[dict[str, tuple[Placement, ...]], dict[str, str]]:
    """The MIG placements of each spec with `gpus.mig`, in name order, and why a spec gets
    none. Occupied: instances that exist and no environment claims (not envctl's), other
    environments' claims (up, or planned before it in this run), whole GPUs others hold."""
    by_index = {g.index: g for g in facts.gpu.gpus}
    # GPU UUID -> slot -> who holds it ("" an instance envctl did not make).
    used: dict[str, dict[int, str]] = {}
    held = {(uuid, start, size, profile): env for env, uuid, profile, start, size
            in facts.mig_held}
    for g in facts.gpu.gpus:
        for (start, size, profile) in _existing(g):
            owner = held.get((g.uuid, start, size, profile), "")
            for s in range(start, start + size):
                used.setdefault(g.uuid, {})[s] = owner
    for env, uuid, _profile, start, size in facts.mig_held:
        for s in range(start, start + size):
            used.setdefault(uuid, {}).setdefault(s, env)
    out: dict[str, tuple[Placement, ...]] = {}
    why: dict[str, str] = {}
    for spec in sorted((s for s in specs if s.gpus.mig), key=lambda s: s.name):
        mine: list[Placement] = []
        problem = ""
        taken = {u: dict(d) for u, d in used.items()}
        for n, req in enumerate(spec.gpus.mig):
            gpu = by_index.get(req.gpu)
            if gpu is None:
                problem = f"mig.{n}: no GPU with index {req.gpu} here"
                break
            found = model_profiles(gpu.name)
            if found is None:
                problem = (f"mig.{n}: GPU {gpu.index} ({gpu.name or 'unnamed'}) is not a model "
                           f"envctl knows the MIG profiles of ({', '.join(KNOWN_MODELS)})")
                break
            model, table = found
            prof = table.get(req.profile)
            if prof is None:
                problem = (f"mig.{n}: GPU {gpu.index} is an {model}: its MIG profiles are "
                           f"{', '.join(table)}, not {req.profile}")
                break
            other = facts.gpu_held.get(gpu.uuid)
            if other and other != spec.name:
                problem = f"mig.{n}: GPU {gpu.index} is held whole by environment '{other}'"
                break
            if gpu.uuid in facts.gpu_quarantined:
                problem = (f"mig.{n}: GPU {gpu.index} is quarantined "
                           f"({facts.gpu_quarantined[gpu.uuid]})")
                break
            if req.start is not None and req.start not in prof.starts:
                problem = (f"mig.{n}: {req.profile} starts at slot "
                           f"{' or '.join(map(str, prof.starts))}, not {req.start}")
                break
            have = taken.setdefault(gpu.uuid, {})
            for _ in range(req.count):
                same = sum(1 for p in mine if p[1] == gpu.uuid and p[2] == req.profile)
                if same >= prof.most:
                    problem = (f"mig.{n}: a GPU holds at most {prof.most} {req.profile} "
                               "instance" + ("s" if prof.most > 1 else ""))
                    break
                starts = [req.start] if req.start is not None else list(prof.starts)
                # Slots this environment already holds with this profile first: sticky.
                starts.sort(key=lambda s: held.get((gpu.uuid, s, prof.size, req.profile))
                            != spec.name)
                pick = next((s for s in starts if all(
                    have.get(x, spec.name) == spec.name and not _mine_at(mine, gpu.uuid, x)
                    for x in range(s, s + prof.size))), None)
                if pick is None:
                    holders = sorted({w for s in starts for x in range(s, s + prof.size)
                                      if (w := have.get(x)) and w != spec.name})
                    problem = (f"mig.{n}: no room on GPU {gpu.index} for {req.profile} (it "
                               f"needs slots {' or '.join(slots(s, prof.size) for s in starts)}"
                               f"; free slots: {_free_text(have, mine, gpu.uuid, spec.name)}"
                               + (f"; its instances before it take slots {', '.join(ours)}"
                                  if (ours := [slots(p[3], p[4]) for p in mine
                                               if p[1] == gpu.uuid]) else "")
                               + (f"; held by environment {', '.join(map(repr, holders))}"
                                  if holders else "")
                               + ("; an instance envctl did not make holds some" if any(
                                   have.get(x) == "" for s in starts
                                   for x in range(s, s + prof.size)) else "") + ")")
                    break
                uuid = _existing(gpu).get((pick, prof.size, req.profile), "") \
                    if held.get((gpu.uuid, pick, prof.size, req.profile)) == spec.name else ""
                mine.append((gpu.index, gpu.uuid, req.profile, pick, prof.size, uuid))
            if problem:
                break
        if problem:
            why[spec.name] = problem
            continue
        for _, uuid, _, start, size, _ in mine:
            for s in range(start, start + size):
                used.setdefault(uuid, {})[s] = spec.name
        out[spec.name] = tuple(mine)
    return out, why


def _mine_at(mine: list[Placement], uuid: str, slot: int) -> bool:
    return any(p[1] == uuid and p[3] <= slot < p[3] + p[4] for p in mine)


def plan_mig(spec: EnvSpec, facts: HostFacts, plan: Plan) -> tuple[str, ...] | None:
    """Add the MIG mode and instance resources of `spec`; the MIG UUIDs of its instances that
    exist already (those `up` makes are planned again once made), None after an error."""
    placed = facts.mig_assigned.get(spec.name)
    why = facts.mig_refused.get(spec.name, "")
    if placed is None and not why:
        alone, refused = assign_mig([spec], facts)
        placed, why = alone.get(spec.name), refused.get(spec.name, "")
    if why or placed is None:
        loc, _, msg = why.partition(": ")
        plan.error(("gpus", *[int(x) if x.isdigit() else x for x in loc.split(".")]), msg)
        return None
    for index, gpu_uuid, _, _, _, _ in placed:
        plan.add(MigMode(gpu_uuid, index), ("gpus", "mig"))
    for index, gpu_uuid, profile, start, size, _ in placed:
        plan.add(MigInstance(gpu_uuid, index, profile, start, size), ("gpus", "mig"))
    plan.resolved["mig"] = "; ".join(
        f"GPU {index}: {profile} at slot{'s' if size > 1 else ''} {slots(start, size)} "
        f"({uuid or 'new'})"
        for index, _, profile, start, size, uuid in placed)
    pending = sum(1 for p in placed if not p[5])
    plan.resolved[PENDING_KEY] = pending
    return tuple(p[5] for p in placed if p[5])
