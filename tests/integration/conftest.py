"""Fixtures for root integration tests: a sandbox per test, with a residue check at the end."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.integration.sandbox import Sandbox

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sandbox(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root")
    sb = Sandbox(tmp_path)
    yield sb
    sb.close()


@pytest.fixture
def shipped(sandbox):
    """The sandbox with the shipped configs copied into its config directory."""
    for f in (REPO / "configs").glob("*.yaml"):
        shutil.copy(f, sandbox.config_dir / f.name)
    return sandbox


@pytest.fixture
def clean(sandbox):
    """Use in tests that must end with nothing left behind: asserts an empty residue."""
    yield sandbox
    assert sandbox.residue() == {}, "residue left behind"
