"""Priority scheduling (B2, C3, F2, F3): the vLLM priority test set, in our own words."""

from tests.conftest import FakeExecutor, make_request, make_scheduler, step


def new_ids(out):
    return [new.request_id for new in out.scheduled_new_reqs]


def priority_scheduler(**kwargs):
    return make_scheduler(scheduling_policy="priority", **kwargs)


def test_lower_priority_value_is_admitted_first(executor):  # B2
    scheduler = priority_scheduler(max_num_batched_tokens=64)
    for name, priority in (("p3", 3), ("p1", 1), ("p2", 2)):
        scheduler.add_request(make_request(name, 8, priority=priority))
    assert new_ids(step(scheduler, executor)[0]) == ["p1", "p2", "p3"]


def test_equal_priority_falls_back_to_arrival_then_id(executor):  # B2
    scheduler = priority_scheduler()
    scheduler.add_request(make_request("late", 8, arrival_time=2.0))
    scheduler.add_request(make_request("b-early", 8, arrival_time=1.0))
    scheduler.add_request(make_request("a-early", 8, arrival_time=1.0))
    scheduler.add_request(make_request("urgent-late", 8, priority=-5, arrival_time=9.0))
    assert new_ids(step(scheduler, executor)[0]) == ["urgent-late", "a-early", "b-early",
                                                     "late"]


def test_limited_seats_go_to_the_most_urgent(executor):  # D4 with priority
    scheduler = priority_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i, priority in enumerate((5, 0, 3, 1)):
        scheduler.add_request(make_request(f"r{i}", 4, priority=priority, arrival_time=i))
    assert new_ids(step(scheduler, executor)[0]) == ["r1", "r3"]
    assert [r.request_id for r in scheduler.waiting] == ["r2", "r0"]


def test_no_preemption_when_space_is_available(executor):
    scheduler = priority_scheduler(num_blocks=100, block_size=4)
    scheduler.add_request(make_request("low", 8, priority=9, max_tokens=5, ignore_eos=True))
    step(scheduler, executor)
    scheduler.add_request(make_request("high", 8, priority=0, max_tokens=5, ignore_eos=True))
    for _ in range(6):
        out, _ = step(scheduler, executor)
        assert out.preempted_req_ids == []
    assert scheduler.num_preemptions == 0


def test_low_priority_victim_admitted_first_is_unwound(executor):  # F2, F3
    scheduler = priority_scheduler(num_blocks=3, block_size=4)
    scheduler.add_request(make_request("low", 4, priority=1, max_tokens=20, ignore_eos=True,
                                       arrival_time=0.0))
    step(scheduler, executor)  # low: 1 block, 5 tokens
    scheduler.add_request(make_request("high", 4, priority=0, max_tokens=20, ignore_eos=True,
                                       arrival_time=1.0))
    step(scheduler, executor)  # low grows to 2 blocks, high takes the last one
    assert [r.request_id for r in scheduler.running] == ["low", "high"]
    out, _ = step(scheduler, executor)
    # low was scheduled first (1 token, no new block); high then needs a block: the victim
    # is low, which stands before it, so low's token goes back to the budget
    assert out.preempted_req_ids == ["low"]
    assert dict(out.num_scheduled_tokens) == {"high": 1}
    assert out.total_num_scheduled_tokens == 1
    assert [r.request_id for r in scheduler.running] == ["high"]


def test_same_situation_under_fcfs_preempts_the_newest(executor):  # F2
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    scheduler.add_request(make_request("low", 4, priority=0, max_tokens=20, ignore_eos=True))
    step(scheduler, executor)
    scheduler.add_request(make_request("high", 4, max_tokens=20, ignore_eos=True))
    step(scheduler, executor)
    out, _ = step(scheduler, executor)
    assert out.preempted_req_ids == ["high"] and dict(out.num_scheduled_tokens) == {"low": 1}


def test_preempted_request_resumes_with_its_generated_tokens():  # F4; vLLM O.15
    scheduler = priority_scheduler(num_blocks=4, block_size=16)
    executor = FakeExecutor()
    scheduler.add_request(make_request("low", 30, priority=1, max_tokens=50, ignore_eos=True))
    step(scheduler, executor, 0.0)
    step(scheduler, executor, 1.0)
    scheduler.add_request(make_request("high", 28, priority=0, max_tokens=3, ignore_eos=True,
                                       arrival_time=2.0))
    step(scheduler, executor, 2.0)  # low: 33 tokens in 2 blocks; high: 2 blocks
    out, _ = step(scheduler, executor, 3.0)
    # low's 33rd slot needs a third block; as the least urgent it preempts itself
    assert out.preempted_req_ids == ["low"] and out.is_empty
    now = 4.0
    while "high" in scheduler.requests:
        step(scheduler, executor, now)
        now += 1.0
    out, _ = step(scheduler, executor, now)
    [resumed] = out.scheduled_new_reqs
    assert resumed.resumed and len(resumed.token_ids) == 33  # 30 prompt + 3 generated
    assert resumed.num_computed_tokens == 32  # both full blocks were still cached
    assert out.num_scheduled_tokens == {"low": 1}
