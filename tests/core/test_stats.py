"""SchedulerStats across an engine's death and restart: at rest, nothing is in flight and the
counters stay; after a restart the new life's counters add to the earlier lives'."""

from __future__ import annotations

import dataclasses

from kvserve.core import SchedulerStats
from kvserve.core.outputs import COUNTER_FIELDS


def stats(running: int, steps: int, finished: dict[str, int]) -> SchedulerStats:
    return SchedulerStats(running, 2, 30, 0.5, 50, 100, steps, 1, 7, 400, 9, 4, finished,
                          {"kv_capacity": 1}, num_swapped=1, num_host_blocks=8,
                          num_free_host_blocks=3, num_sessions_held=2, num_session_blocks=5)


def test_every_counter_is_a_field_and_the_rest_are_gauges():
    names = {f.name for f in dataclasses.fields(SchedulerStats)}
    assert set(COUNTER_FIELDS) <= names
    assert "num_running" not in COUNTER_FIELDS and "kv_cache_usage" not in COUNTER_FIELDS


def test_at_rest_keeps_counters_and_empties_gauges():
    rested = stats(3, 10, {"length": 2}).at_rest()
    assert (rested.num_running, rested.num_waiting, rested.num_queued_tokens,
            rested.kv_cache_usage, rested.num_swapped, rested.num_sessions_held) == \
        (0, 0, 0, 0.0, 0, 0)
    assert rested.num_free_blocks == rested.num_blocks == 100
    assert rested.num_free_host_blocks == 8
    assert (rested.num_steps, rested.num_finished) == (10, {"length": 2})


def test_after_adds_earlier_lives_counters_and_keeps_the_gauges():
    earlier = stats(3, 10, {"length": 2, "abort": 1}).at_rest()
    now = stats(1, 4, {"length": 1, "stop": 5}).after(earlier)
    assert now.num_steps == 14 and now.num_preemptions == 2
    assert now.num_finished == {"length": 3, "abort": 1, "stop": 5}
    assert now.num_blocked_steps == {"kv_capacity": 2}
    assert (now.num_running, now.num_free_blocks, now.kv_cache_usage) == (1, 50, 0.5)
