"""Per-job slices: the pure allocation and the job's device rules (envctl.runtime.slices)."""

from __future__ import annotations

import re

import pytest

from envctl.errors import InputError
from envctl.runtime.slices import (
    Ask,
    Pool,
    Shortage,
    Slice,
    allocate,
    check_ask,
    job_device_rules,
)

POOL = Pool(cpus=(0, 1, 2, 3), gpus=("GPU-a", "GPU-b"), mem=4 << 30)


def test_a_count_takes_the_lowest_cpus_no_one_holds():
    held = [(5, Slice(cpus=(0, 1), cpus_exclusive=True))]
    got = allocate(POOL, held, Ask(cpus=2))
    assert got == Slice(cpus=(2, 3), cpus_exclusive=True, gpus=("GPU-a", "GPU-b"))
    # Shared holders (a list, or no --cpus) keep nobody out.
    shared = [(6, Slice(cpus=(0, 1, 2, 3)))]
    assert allocate(POOL, shared, Ask(cpus=4)).cpus == (0, 1, 2, 3)


def test_too_few_free_cpus_names_how_many_and_who_holds_them():
    held = [(5, Slice(cpus=(0, 1), cpus_exclusive=True)), (7, Slice(cpus=(3,),
                                                                   cpus_exclusive=True))]
    got = allocate(POOL, held, Ask(cpus=2))
    assert isinstance(got, Shortage)
    assert got.reason == ("2 CPU(s) asked, 1 free; held exclusively by job 5: 0,1; job 7: 3")


def test_a_list_or_no_request_avoids_what_others_hold_exclusively():
    held = [(5, Slice(cpus=(0, 1), cpus_exclusive=True, gpus=("GPU-b",),
                      gpus_exclusive=True))]
    assert allocate(POOL, held, Ask()) == Slice(cpus=(2, 3), gpus=("GPU-a",))
    got = allocate(POOL, held, Ask(cpu_list=(1, 2)))
    assert isinstance(got, Shortage) and "CPU(s) 1 asked" in got.reason and "job 5" in got.reason
    got = allocate(POOL, held, Ask(gpu_list=("GPU-b",)))
    assert isinstance(got, Shortage) and "GPU-b" in got.reason
    every = [(5, Slice(cpus=(0, 1, 2, 3), cpus_exclusive=True))]
    got = allocate(POOL, every, Ask())
    assert isinstance(got, Shortage) and got.reason.startswith("no CPU free")


def test_gpus_by_count_are_exclusive_and_run_out():
    first = allocate(POOL, [], Ask(gpus=1))
    assert first.gpus == ("GPU-a",) and first.gpus_exclusive and first.holds
    second = allocate(POOL, [(1, first)], Ask(gpus=1))
    assert second.gpus == ("GPU-b",)
    third = allocate(POOL, [(1, first), (2, second)], Ask(gpus=1))
    assert isinstance(third, Shortage) and "1 GPU(s) asked, 0 free" in third.reason


def test_memory_is_shared_out_of_the_environments_limit():
    one = allocate(POOL, [], Ask(mem=3 << 30))
    assert one.mem == 3 << 30 and one.holds and not one.cpus_exclusive
    got = allocate(POOL, [(9, one)], Ask(mem=2 << 30))
    assert isinstance(got, Shortage)
    assert got.reason == (f"{2 << 30} bytes of memory asked, {1 << 30} of {4 << 30} free "
                          f"(held by job(s) 9 ({3 << 30}))")
    assert allocate(POOL, [(9, one)], Ask(mem=1 << 30)).mem == 1 << 30
    # No limit on the environment: nothing to share out.
    assert allocate(Pool(cpus=(0,)), [(9, one)], Ask(mem=64 << 30)).mem == 64 << 30
    assert not allocate(POOL, [], Ask()).holds


def test_what_could_never_fit_is_bad_input():
    for ask, words in [(Ask(cpus=5), "has 4 CPU(s)"), (Ask(gpus=3), "has 2 GPU(s)"),
                       (Ask(mem=5 << 30), "more than environment 'e''s memory limit")]:
        with pytest.raises(InputError, match=re.escape(words)):
            check_ask(POOL, ask, "e")
    check_ask(POOL, Ask(cpus=4, gpus=2, mem=4 << 30), "e")


ENV_RULES = ("c 1:3 rwm", "c 195:0 rw", "c 195:1 rw", "c 195:255 rw", "c 511:0 rw",
             "c 511:1 rw", "c 195:254 rw")


def test_a_jobs_device_rules_drop_only_the_other_gpus_nodes():
    minors = {"GPU-a": 0, "GPU-b": 1}
    assert job_device_rules(ENV_RULES, minors, ("GPU-a",)) == (
        "c 1:3 rwm", "c 195:0 rw", "c 195:255 rw", "c 511:0 rw", "c 511:1 rw", "c 195:254 rw")
    assert job_device_rules(ENV_RULES, minors, ()) == (
        "c 1:3 rwm", "c 195:255 rw", "c 511:0 rw", "c 511:1 rw", "c 195:254 rw")
    assert job_device_rules(ENV_RULES, minors, ("GPU-a", "GPU-b")) is None


@pytest.mark.parametrize("wide", ["a", "c *:* rwm", "c 195:* rw"])
def test_a_wildcard_rule_cannot_be_narrowed(wide):
    with pytest.raises(ValueError, match="allows every"):
        job_device_rules(("c 1:3 rwm", wide), {"GPU-a": 0, "GPU-b": 1}, ("GPU-a",))


def test_a_gpu_count_never_takes_a_gpu_another_job_can_open():
    # A job without --gpus (every GPU, shared) or with a list: its device list has those
    # nodes for as long as it runs, so a count must not hand them out as exclusive.
    for shared in (Slice(cpus=(0,), gpus=("GPU-a", "GPU-b")), Slice(cpus=(0,), gpus=("GPU-a",))):
        got = allocate(POOL, [(6, shared)], Ask(gpus=2))
        assert isinstance(got, Shortage), got
        assert "in use by job 6: GPU-a" in got.reason, got.reason
    got = allocate(POOL, [(6, Slice(cpus=(0,), gpus=("GPU-a",)))], Ask(gpus=1))
    assert got.gpus == ("GPU-b",) and got.gpus_exclusive
