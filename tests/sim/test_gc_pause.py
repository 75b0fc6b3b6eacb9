"""Simulator.run pauses Python's cyclic garbage collector for the run and gives it back, also
when the run fails (docs/simulator-speed.md, the fourth round)."""

import gc

import pytest

from kvserve.core import CacheConfig, SchedulerConfig
from kvserve.sim.cost_models import UnitCostModel
from kvserve.sim.simulator import Simulator
from tests.sim.helpers import req


def simulator():
    return Simulator(SchedulerConfig(), CacheConfig(num_blocks=64), UnitCostModel())


def test_the_collector_is_off_during_a_run_and_on_after():
    seen = []
    trace = [req(f"r{i}", 20, 300) for i in range(2)]  # > 256 steps: progress is called
    result = simulator().run(trace, progress=lambda *_: seen.append(gc.isenabled()))
    assert seen and not any(seen)
    assert gc.isenabled()
    assert [r.num_output_tokens for r in result.records] == [301, 301]  # 300, then EOS


def test_the_collector_is_back_when_a_run_fails():
    def fail(*_):
        raise RuntimeError("progress callback failed")

    with pytest.raises(RuntimeError, match="progress callback failed"):
        simulator().run([req("r0", 20, 300)], progress=fail)
    assert gc.isenabled()


def test_a_run_started_with_the_collector_off_leaves_it_off():
    gc.disable()
    try:
        simulator().run([req("r0", 20, 4)])
        assert not gc.isenabled()
    finally:
        gc.enable()
