"""Spec I: check_invariants catches every kind of broken state it promises to."""

import pytest

from kvserve.core import InvariantError, check_empty, check_invariants
from tests.conftest import FakeExecutor, make_request, make_scheduler, step


def busy_scheduler():
    scheduler = make_scheduler(num_blocks=20, block_size=4)
    executor = FakeExecutor()
    for i in range(3):
        scheduler.add_request(make_request(i, 6, max_tokens=5))
    step(scheduler, executor)
    scheduler.add_request(make_request("w", 4))
    check_invariants(scheduler)
    return scheduler


def test_ref_count_drift_is_i1():
    scheduler = busy_scheduler()
    scheduler.kv.pool.blocks[0].ref_cnt += 1
    with pytest.raises(InvariantError, match="I1: block 0 has ref 2 but 1 holders"):
        check_invariants(scheduler)


def test_referenced_block_in_free_queue_is_i1():
    scheduler = busy_scheduler()
    scheduler.kv.pool.free_queue.append(scheduler.kv.pool.blocks[0])
    with pytest.raises(InvariantError, match="I1"):
        check_invariants(scheduler)


def test_running_request_without_its_blocks_is_i2():
    scheduler = busy_scheduler()
    blocks = scheduler.kv.req_to_blocks["0"]
    scheduler.kv.pool.free([blocks.pop()])
    with pytest.raises(InvariantError, match="I2: 0 computed 6 tokens but holds 1 blocks"):
        check_invariants(scheduler)


def test_request_in_two_queues_is_i3():
    scheduler = busy_scheduler()
    scheduler.waiting.push(scheduler.running[0])
    with pytest.raises(InvariantError, match=r"I3: requests both running and waiting: \['0'\]"):
        check_invariants(scheduler)


def test_lost_request_is_i3():
    scheduler = busy_scheduler()
    scheduler.waiting.remove(scheduler.requests["w"])
    with pytest.raises(InvariantError, match=r"I3: unfinished requests outside the queues: "
                                             r"\['w'\]"):
        check_invariants(scheduler)


def test_leftovers_are_i4():
    scheduler = busy_scheduler()
    with pytest.raises(InvariantError, match="I4: 4 requests left"):
        check_empty(scheduler)
