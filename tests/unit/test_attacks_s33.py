"""An attacker's review, session 33: what needs no root (see
tests/integration/test_attacks_s33.py for the rest)."""

from __future__ import annotations

import pytest

from envctl.errors import UsageError
from envctl.runtime import jobs as jb


@pytest.mark.xfail(strict=True, reason=(
    "runtime/jobs.py (another helper's now): parse_id takes str.isdigit(), which holds for "
    "'²' (int() refuses it: a traceback, exit 1) and for '１２' or Arabic-Indic digits (taken "
    "as job 12, 3); fix: `s.isascii() and s.isdigit()`"))
@pytest.mark.parametrize("text", ["²", "１２", "٣"])
def test_a_job_id_is_ascii_digits_or_bad_input(text):
    """`envctl logs ²` (or the same in a daemon request's `ids`) is bad input, exit 2 with
    the one line: not a traceback, and not another job's id spelt in other digits."""
    with pytest.raises(UsageError):
        jb.parse_id(text)


@pytest.mark.parametrize("text", ["²", "１２", "٣"])
def test_a_cpu_or_gpu_count_in_other_digits_is_not_a_count(text):
    """`submit-job --cpus ²` (a daemon request's `cpus` too) raised ValueError in int(): a
    traceback, exit 1; '１２' was a count of 12. Now neither is a count (the CPU or GPU list
    parser then refuses it, exit 2)."""
    from envctl.runtime import supervisor as sv

    assert sv._count(text, "--cpus", "0-0") == 0
    with pytest.raises(UsageError):
        jb.parse_cpus(text, "--cpus")
