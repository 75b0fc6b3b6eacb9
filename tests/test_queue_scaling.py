"""benchmarks/queue_scaling.py's scenarios run (small), so its figures can be remade."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import queue_scaling


@pytest.mark.parametrize("name", sorted(queue_scaling.SCENARIOS))
def test_each_scenario_runs_the_scheduler_it_says(name):
    from kvserve.core.invariants import check_invariants

    _, run = queue_scaling.SCENARIOS[name]
    scheduler = run(40)
    check_invariants(scheduler)
    if name == "displacement":  # arrivals past the limit: K5 displaced some
        assert scheduler.num_finished.get("abort", 0) > 0
    else:
        assert scheduler.num_steps > 0
        assert sum(scheduler.num_finished.values()) + len(scheduler.requests) >= 40
