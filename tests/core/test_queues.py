"""Spec C: FCFS and priority waiting queues behind one interface."""

import random

import pytest

from kvserve.core.queues import FCFSQueue, PriorityQueue, make_waiting_queue
from tests.conftest import make_request


def ids(queue):
    return [r.request_id for r in queue]


def test_fcfs_push_pop_peek_remove():  # C1
    queue = FCFSQueue()
    a, b, c = (make_request(x, 4) for x in "abc")
    for r in (a, b, c):
        queue.push(r)
    assert (len(queue), queue.peek().request_id, queue.num_tokens) == (3, "a", 12)
    queue.remove(b)
    assert ids(queue) == ["a", "c"] and queue.num_tokens == 8
    assert queue.pop() is a and ids(queue) == ["c"]


def test_fcfs_victims_keep_their_fifo_order():  # C2
    queue = FCFSQueue()
    queue.push(make_request("w"))
    # running = [a, b, c]; victims are taken newest first: c, then b
    for victim in ("c", "b"):
        queue.push_front(make_request(victim))
    assert ids(queue) == ["b", "c", "w"]


def test_priority_push_front_is_a_plain_push():  # C3
    queue = PriorityQueue()
    queue.push(make_request("urgent", priority=-1, arrival_time=9.0))
    queue.push(make_request("late", priority=0, arrival_time=2.0))
    queue.push_front(make_request("victim", priority=0, arrival_time=5.0))
    queue.push(make_request("early", priority=0, arrival_time=1.0))
    assert ids(queue) == ["urgent", "early", "late", "victim"]
    assert queue.peek().request_id == "urgent"
    assert [queue.pop().request_id for _ in range(4)] == ["urgent", "early", "late", "victim"]


def test_priority_remove_keeps_heap_order():  # C1
    queue = PriorityQueue()
    requests = [make_request(str(i), 2, priority=(i * 7) % 5, arrival_time=float(i))
                for i in range(20)]
    for r in requests:
        queue.push(r)
    for r in requests[::3]:
        queue.remove(r)
    kept = sorted((r for r in requests if r not in requests[::3]), key=lambda r: r.sort_key())
    assert [queue.pop() for _ in range(len(queue))] == kept
    assert queue.num_tokens == 0


def test_priority_removals_in_any_order_keep_the_heap_a_heap():  # C1
    """remove mends the heap around the removed entry (up or down) instead of rebuilding
    it: random pushes, removals and pops give the order of a sorted list."""
    rng = random.Random(4)
    queue, model = PriorityQueue(), []
    for step in range(3000):
        action = rng.random()
        if action < 0.5 or not model:
            request = make_request(f"r{step}", 2, priority=rng.randint(0, 6),
                                   arrival_time=rng.random())
            queue.push(request)
            model.append(request)
        elif action < 0.8:
            request = model.pop(rng.randrange(len(model)))
            queue.remove(request)
        else:
            model.sort(key=lambda r: r.sort_key())
            assert queue.pop() is model.pop(0)
        if step % 97 == 0:
            assert list(queue) == sorted(model, key=lambda r: r.sort_key())
    assert len(queue) == len(model)


def test_remove_of_a_stranger_raises():
    queue = PriorityQueue()
    with pytest.raises(ValueError, match="not in the waiting queue"):
        queue.remove(make_request("x"))


def test_factory_knows_both_policies():
    assert isinstance(make_waiting_queue("fcfs"), FCFSQueue)
    assert isinstance(make_waiting_queue("priority"), PriorityQueue)
    with pytest.raises(ValueError, match="unknown scheduling policy 'sjf'"):
        make_waiting_queue("sjf")


def test_emptied_entries_never_outnumber_the_queue_much():  # C1
    """Removals empty entries in place; both heaps are compacted once either holds more
    than twice the queue (QA: K5 kept the least-urgent heap small while the main heap kept
    every displaced request's entry, 2,560 for 10 requests)."""
    queue = PriorityQueue()
    for index in range(10):
        queue.push(make_request(f"keep{index}", 2, priority=0, arrival_time=index))
    for index in range(4000):
        request = make_request(f"r{index}", 2, priority=9, arrival_time=100 + index)
        queue.push(request)
        assert next(queue.least_urgent()) is request
        queue.remove(request)
        assert len(queue._heap) <= 2 * len(queue) + 65
        assert len(queue._reversed) <= 2 * len(queue) + 65
    assert ids(queue) == [f"keep{index}" for index in range(10)]
