"""Shared test configuration: root-only tests skip cleanly when not root."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root and the real kernel")
    for item in items:
        if "root" in item.keywords or "vm" in item.keywords:
            item.add_marker(skip)
