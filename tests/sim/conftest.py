"""Fixtures shared by the simulator's tests."""

from __future__ import annotations

import pytest

from kvserve.cli import main


@pytest.fixture
def trace(tmp_path):
    """A small synthetic trace: 40 requests at 20 req/s, two shared-prefix groups."""
    path = tmp_path / "t.jsonl"
    assert main(["workload", "gen", "-n", "40", "--rate", "20", "--prompt-len",
                 "uniform:32,256", "--output-len", "uniform:8,64", "--prefix-groups", "2",
                 "--seed", "3", "-o", str(path)]) == 0
    return path
