"""Spec S (the host KV tier), M (urgent arrivals) and P (the progress guard): golden
scenarios with exact block ids in both tiers."""

import pytest

from kvserve.core import ConfigError, EventType, RequestStatus, Scheduler, check_empty
from kvserve.core.preemption import VictimGuard
from tests.conftest import (
    FakeExecutor,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
    token_for,
)


class Prices:
    """1 ms per recomputed token, 4 ms per block copied one way."""

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * 1e-3

    def swap_seconds(self, num_blocks: int) -> float:
        return num_blocks * 4e-3


def preempted_events(scheduler):
    return [(e.request_id, e.num_tokens, e.reason) for e in scheduler.take_events()
            if e.kind == "preempted"]


def test_golden_swap_out_and_swap_in():  # S1, S2, F6
    scheduler = make_scheduler(num_blocks=10, block_size=16, enable_prefix_caching=False,
                               num_host_blocks=8, preemption_mode="swap", record_events=True)
    executor = FakeExecutor()
    for name in ("r0", "r1"):
        scheduler.add_request(make_request(name, 80, max_tokens=10, ignore_eos=True))
    # step 1: r0 -> blocks 0-4, r1 -> blocks 5-9
    step(scheduler, executor, 0.0)
    assert scheduler.kv.get_block_ids("r1") == [5, 6, 7, 8, 9]

    # step 2: r0's 81st token needs a 6th block; r1 (newest) is the victim and its 80
    # computed tokens (5 blocks) go to host blocks 0-4. Its device blocks are freed tail
    # first to the head of the free queue (no hashes): [5, 6, 7, 8, 9]; r0 takes block 5.
    scheduler.add_request(make_request("r2", 4, arrival_time=1.0, max_tokens=2,
                                       ignore_eos=True))
    out, _ = step(scheduler, executor, 1.0)
    assert out.preempted_req_ids == ["r1"]
    assert out.blocks_to_swap_out == [(5, 0), (6, 1), (7, 2), (8, 3), (9, 4)]
    assert out.blocks_to_swap_in == []
    assert scheduler.kv.get_block_ids("r0") == [0, 1, 2, 3, 4, 5]
    assert scheduler.kv.req_to_host_blocks == {"r1": [0, 1, 2, 3, 4]}
    assert scheduler.kv.pool.free_queue.block_ids() == [6, 7, 8, 9]
    assert scheduler.kv.host_pool.free_block_ids() == [5, 6, 7]
    r1 = scheduler.requests["r1"]
    assert (r1.status, r1.num_computed_tokens, r1.num_preemptions, r1.num_swaps) == \
        (RequestStatus.SWAPPED, 80, 1, 1)
    assert [r.request_id for r in scheduler.swapped] == ["r1"]

    # steps 3-10: r1 needs 6 device blocks (80 tokens + its sampled one), 4 are free: it
    # stays swapped out, and r2, which would fit, waits behind it (S2)
    out, _ = step(scheduler, executor, 2.0)
    assert dict(out.num_scheduled_tokens) == {"r0": 1}
    assert scheduler.num_blocked_steps == {"preemption": 1, "swapped": 1}
    now = 3.0
    while "r0" in scheduler.requests:
        step(scheduler, executor, now)
        now += 1.0
    # r0 finished and freed [0..5] tail first to the head: the free queue is [0..9]

    # step 11: r1 swaps in first, to blocks 0-4 plus block 5 for its next token, with its
    # 80 tokens computed: nothing is recomputed. Then r2 is admitted in the same step.
    out, _ = step(scheduler, executor, now)
    assert out.blocks_to_swap_in == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]
    assert out.blocks_to_swap_out == []
    new = {n.request_id: n for n in out.scheduled_new_reqs}
    assert (new["r1"].block_ids, new["r1"].num_computed_tokens, new["r1"].resumed) == \
        ([0, 1, 2, 3, 4, 5], 80, True)
    assert dict(out.num_scheduled_tokens) == {"r1": 1, "r2": 4}
    assert scheduler.kv.get_block_ids("r2") == [6]
    assert scheduler.kv.req_to_host_blocks == {}
    assert scheduler.kv.host_pool.free_block_ids() == list(range(8))
    assert r1.status is RequestStatus.RUNNING
    final = run_to_completion(scheduler, executor=executor)
    assert final["r1"].metrics.num_recomputed_tokens == 0  # type: ignore[union-attr]
    assert final["r1"].metrics.num_swaps == 1  # type: ignore[union-attr]
    assert [e.type for e in r1.events] == [EventType.ARRIVED, EventType.ADMITTED,
                                          EventType.PREEMPTED, EventType.RESUMED,
                                          EventType.FINISHED]
    stats = scheduler.stats()
    assert (stats.num_swapped_out_blocks, stats.num_swapped_in_blocks, stats.num_preemptions,
            stats.num_preemptions_by_mode) == (5, 5, 1, {"recompute": 0, "swap": 1,
                                                         "priority": 0})
    assert preempted_events(scheduler) == [("r1", 80, "swap")]
    check_empty(scheduler)


def test_full_host_tier_falls_back_to_recompute():  # S3
    scheduler = make_scheduler(num_blocks=10, block_size=16, num_host_blocks=4,
                               preemption_mode="swap", record_events=True)
    executor = FakeExecutor()
    for name in ("r0", "r1"):
        scheduler.add_request(make_request(name, 80, max_tokens=10, ignore_eos=True))
    step(scheduler, executor, 0.0)
    out, _ = step(scheduler, executor, 1.0)
    # r1's 5 blocks do not fit the 4 host blocks: it recomputes, as in F4
    assert out.preempted_req_ids == ["r1"] and out.blocks_to_swap_out == []
    assert scheduler.requests["r1"].status is RequestStatus.PREEMPTED
    assert scheduler.kv.host_pool.free_block_ids() == [0, 1, 2, 3]
    assert preempted_events(scheduler) == [("r1", 80, "recompute (host tier full)")]
    assert scheduler.stats().num_preemptions_by_mode == {"recompute": 1, "swap": 0,
                                                         "priority": 0}


def auto_scheduler(shared_prefix: bool, num_blocks: int):
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=16, num_host_blocks=8,
                               preemption_mode="auto", preemption_prices=Prices(),
                               record_events=True)
    prefix = [token_for("shared", i) for i in range(64)]
    other = prefix if shared_prefix else [token_for("other", i) for i in range(64)]
    scheduler.add_request(make_request(
        "r0", prompt_token_ids=prefix + [token_for("a", i) for i in range(16)], max_tokens=4,
        ignore_eos=True))
    scheduler.add_request(make_request(
        "r1", prompt_token_ids=other + [token_for("b", i) for i in range(16)], max_tokens=4,
        ignore_eos=True))
    return scheduler


def test_auto_swaps_a_cold_victim():  # S4
    scheduler = auto_scheduler(shared_prefix=False, num_blocks=10)
    executor = FakeExecutor()
    step(scheduler, executor, 0.0)  # r0 -> 0-4, r1 -> 5-9
    out, _ = step(scheduler, executor, 1.0)
    # nothing of r1 survives: recompute 80 tokens = 80 ms > swap 2 x 5 blocks x 4 ms = 40 ms.
    # Its hashed blocks go to the tail, tail first: [9, 8, 7, 6, 5]; r0 takes 9.
    assert out.blocks_to_swap_out == [(5, 0), (6, 1), (7, 2), (8, 3), (9, 4)]
    assert scheduler.kv.get_block_ids("r0") == [0, 1, 2, 3, 4, 9]
    assert scheduler.kv.pool.free_queue.block_ids() == [8, 7, 6, 5]
    assert scheduler.kv.req_to_host_blocks == {"r1": [0, 1, 2, 3, 4]}
    assert preempted_events(scheduler) == [
        ("r1", 80, "swap (auto: recompute 0.08 s, swap 0.04 s)")]
    run_to_completion(scheduler, executor=executor)
    check_empty(scheduler)


def test_auto_recomputes_a_victim_whose_prefix_survives():  # S4
    scheduler = auto_scheduler(shared_prefix=True, num_blocks=6)
    executor = FakeExecutor()
    # step 1: r0 -> 0-4; r1 hits r0's first 4 blocks (its 64-token prefix) and adds block 5
    out, _ = step(scheduler, executor, 0.0)
    assert dict(out.num_scheduled_tokens) == {"r0": 80, "r1": 16}
    assert scheduler.kv.get_block_ids("r1") == [0, 1, 2, 3, 5]
    out, _ = step(scheduler, executor, 1.0)
    # r0 holds blocks 0-3 too, so they survive r1's preemption: recompute 16 tokens = 16 ms
    # < swap 2 x 5 blocks x 4 ms = 40 ms. r1 recomputes; r0 takes its freed block 5.
    assert out.preempted_req_ids == ["r1"] and out.blocks_to_swap_out == []
    assert scheduler.kv.get_block_ids("r0") == [0, 1, 2, 3, 4, 5]
    assert scheduler.kv.host_pool.free_block_ids() == list(range(8))
    assert preempted_events(scheduler) == [
        ("r1", 80, "recompute (auto: recompute 0.016 s, swap 0.04 s)")]
    run_to_completion(scheduler, executor=executor)
    check_empty(scheduler)


def urgent_scheduler(**config):
    scheduler = make_scheduler(num_blocks=10, block_size=16, scheduling_policy="priority",
                               enable_priority_preemption=True, record_events=True, **config)
    scheduler.add_request(make_request("a", 60, priority=20, max_tokens=8, ignore_eos=True))
    scheduler.add_request(make_request("b", 60, priority=5, max_tokens=8, ignore_eos=True))
    return scheduler


def test_urgent_arrival_preempts_exactly_one_victim_above_the_threshold():  # M1-M3
    scheduler = urgent_scheduler()
    executor = FakeExecutor()
    step(scheduler, executor, 0.0)  # b (more urgent) -> 0-3, a -> 4-7; free [8, 9]
    assert scheduler.kv.get_block_ids("a") == [4, 5, 6, 7]
    # u (priority 0, 40 tokens = 3 blocks) does not fit in 2 free blocks. Only a qualifies
    # (20 > 0 + 10; b's 5 does not): a is preempted. Its partial block 7 goes to the head,
    # its full blocks 6, 5, 4 to the tail: [7, 8, 9, 6, 5, 4]; u takes 7, 8, 9.
    scheduler.add_request(make_request("u", 40, priority=0, arrival_time=1.0, max_tokens=2,
                                       ignore_eos=True))
    out, _ = step(scheduler, executor, 1.0)
    assert out.preempted_req_ids == ["a"]
    assert dict(out.num_scheduled_tokens) == {"b": 1, "u": 40}  # a's token given back
    assert scheduler.kv.get_block_ids("u") == [7, 8, 9]
    assert scheduler.kv.pool.free_queue.block_ids() == [6, 5, 4]
    assert preempted_events(scheduler) == [("a", 60, "priority:recompute")]
    assert scheduler.stats().num_preemptions_by_mode == {"recompute": 1, "swap": 0,
                                                         "priority": 1}
    run_to_completion(scheduler, executor=executor)
    check_empty(scheduler)


def test_an_urgent_arrival_is_not_held_back_by_a_swapped_victim():  # S2 M1
    """The first urgent arrival swapped a out; a could not come back (no room), and S2 let
    the waiting pass admit nothing while it stayed out, so the second urgent arrival waited
    for the whole first one (QA: 0.91 s queued under swap, 0.03 s under recompute). A
    waiting head more urgent than every swapped request now goes on, as L5 lets it past held
    turns: u2 preempts c at once."""
    scheduler = make_scheduler(num_blocks=10, block_size=16, scheduling_policy="priority",
                               enable_priority_preemption=True, preemption_mode="swap",
                               num_host_blocks=16)
    executor = FakeExecutor()
    for name in ("a", "c"):
        scheduler.add_request(make_request(name, 60, priority=20, max_tokens=30,
                                           ignore_eos=True))
    step(scheduler, executor, 0.0)  # a and c: 8 of 10 blocks
    scheduler.add_request(make_request("u1", 40, priority=0, arrival_time=1.0, max_tokens=20,
                                       ignore_eos=True))
    out, _ = step(scheduler, executor, 1.0)
    assert out.preempted_req_ids == ["a"] and [r.request_id for r in scheduler.swapped] == ["a"]
    scheduler.add_request(make_request("u2", 60, priority=0, arrival_time=2.0, max_tokens=20,
                                       ignore_eos=True))
    out, _ = step(scheduler, executor, 2.0)
    assert out.preempted_req_ids == ["c"] and dict(out.num_scheduled_tokens) == \
        {"u1": 1, "u2": 60}
    assert scheduler.num_blocked_steps == {}  # not "swapped"
    run_to_completion(scheduler, executor=executor)
    check_empty(scheduler)


def test_urgent_arrival_within_the_threshold_preempts_none():  # M2
    scheduler = urgent_scheduler()
    executor = FakeExecutor()
    step(scheduler, executor, 0.0)
    # u has priority 15: a (20) does not exceed 15 + 10, so nobody qualifies; u waits
    scheduler.add_request(make_request("u", 40, priority=15, arrival_time=1.0, max_tokens=2,
                                       ignore_eos=True))
    out, _ = step(scheduler, executor, 1.0)
    assert out.preempted_req_ids == []
    assert dict(out.num_scheduled_tokens) == {"b": 1, "a": 1}
    assert scheduler.num_blocked_steps == {"kv_cache": 1}
    assert scheduler.num_preemptions == 0


def test_urgent_arrival_needs_room_from_qualifying_victims_only():  # M2
    scheduler = urgent_scheduler(priority_preemption_threshold=0)
    executor = FakeExecutor()
    step(scheduler, executor, 0.0)
    # 130 tokens need 9 blocks: a's 4 + 2 free are not enough and b (5) does not qualify
    # for an arrival of priority 5: nobody is preempted
    scheduler.add_request(make_request("u", 130, priority=5, arrival_time=1.0))
    out, _ = step(scheduler, executor, 1.0)
    assert out.preempted_req_ids == [] and scheduler.num_preemptions == 0
    assert scheduler.num_blocked_steps == {"kv_cache": 1}


def test_urgent_arrival_takes_a_seat():  # M1: seats as well as blocks
    scheduler = urgent_scheduler(max_num_seqs=2, max_num_batched_tokens=256)
    executor = FakeExecutor()
    step(scheduler, executor, 0.0)
    scheduler.add_request(make_request("u", 8, priority=0, arrival_time=1.0, max_tokens=2,
                                       ignore_eos=True))
    out, _ = step(scheduler, executor, 1.0)
    assert out.preempted_req_ids == ["a"]
    assert [r.request_id for r in scheduler.running] == ["b", "u"]


def guard_scheduler(limit):
    scheduler = make_scheduler(num_blocks=10, block_size=16, record_events=True,
                               max_preemptions_per_request=limit)
    scheduler.add_request(make_request("r0", 48, max_tokens=3, ignore_eos=True))
    scheduler.add_request(make_request("r1", 48, max_tokens=40, ignore_eos=True))
    scheduler.add_request(make_request("r2", 48, max_tokens=40, ignore_eos=True))
    return scheduler


@pytest.mark.parametrize("limit", [None, 1])
def test_guard_stops_a_victim_at_its_limit(limit):  # P1
    scheduler = guard_scheduler(limit)
    executor = FakeExecutor()
    # step 1: r0 -> 0-2, r1 -> 3-5, r2 -> 6-8. Step 2: r1's 4th block preempts r2 (newest).
    # r0 finishes at step 3; step 4 readmits r2 (2 hits, blocks 6, 7 + 9, 2).
    for now in range(4):
        step(scheduler, executor, float(now))
    assert scheduler.requests["r2"].num_preemptions == 1
    assert scheduler.kv.get_block_ids("r2") == [6, 7, 9, 2]
    # at step 34 r1 (82 tokens) needs a 6th block and none is free
    for now in range(4, 33):
        out, _ = step(scheduler, executor, float(now))
        assert out.preempted_req_ids == []
    out, _ = step(scheduler, executor, 33.0)
    if limit is None:  # F2: the newest request, r2, a second time
        assert out.preempted_req_ids == ["r2"]
        assert scheduler.requests["r2"].num_preemptions == 2
    else:  # P1: r2 was preempted once, its limit: r1 is the only victim left, itself
        assert out.preempted_req_ids == ["r1"]
        assert scheduler.requests["r2"].num_preemptions == 1
        assert scheduler.kv.get_block_ids("r2") == [6, 7, 9, 2, 0]
    run_to_completion(scheduler, executor=executor)
    check_empty(scheduler)


class Req:
    def __init__(self, name: str, num_preemptions: int) -> None:
        self.request_id = name
        self.num_preemptions = num_preemptions


def test_guard_makes_the_requester_wait_unless_it_runs_first():  # P2, P3
    guard = VictimGuard(2, lambda running: len(running) - 1)  # newest first, as F2
    a, b, c = Req("a", 2), Req("b", 0), Req("c", 2)
    assert guard.victim_index([a, b, c], a) == 1  # only b qualifies (P1)
    b.num_preemptions = 2
    assert guard.victim_index([a, b, c], b) is None  # P2: b waits, keeping its blocks
    assert guard.victim_index([a, b, c], a) == 2  # P3: a runs first; the guard lifts
    assert guard.victim_index([a], a) == 0  # alone it can only be its own victim
    assert VictimGuard(None, lambda running: 0).victim_index([a, b], b) == 0


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_modes_need_a_host_tier(mode):  # S1
    with pytest.raises(ConfigError, match="needs a host KV tier: num_host_blocks"):
        make_scheduler(preemption_mode=mode, preemption_prices=Prices())


def test_auto_needs_prices():  # S4
    with pytest.raises(ConfigError, match="'auto' needs preemption_prices"):
        make_scheduler(preemption_mode="auto", num_host_blocks=4)


def test_priority_preemption_needs_the_priority_policy():  # M1
    with pytest.raises(ConfigError, match="enable_priority_preemption=True needs "
                                          "scheduling_policy='priority'"):
        make_scheduler(enable_priority_preemption=True)


def _two_of_80_tokens_with_swap() -> tuple[Scheduler, FakeExecutor]:
    """Two 80-token prompts in 10 blocks of 16 with a host tier, after their first step:
    the next step swaps r1 out."""
    scheduler = make_scheduler(num_blocks=10, block_size=16, num_host_blocks=8,
                               preemption_mode="swap")
    executor = FakeExecutor()
    for name in ("r0", "r1"):
        scheduler.add_request(make_request(name, 80, max_tokens=10, ignore_eos=True))
    step(scheduler, executor, 0.0)
    return scheduler, executor


def test_abort_frees_a_swapped_request_host_blocks():  # H4, S1
    scheduler, executor = _two_of_80_tokens_with_swap()
    step(scheduler, executor, 1.0)
    assert scheduler.kv.req_to_host_blocks == {"r1": [0, 1, 2, 3, 4]}
    assert scheduler.abort("r1")
    assert scheduler.kv.req_to_host_blocks == {} and list(scheduler.swapped) == []
    assert scheduler.kv.host_pool.free_block_ids() == list(range(8))
    run_to_completion(scheduler, executor=executor)
    check_empty(scheduler)


def test_host_blocks_a_swap_in_reads_are_not_reused_in_the_same_step():  # S2
    # The executor copies every swap-out before every swap-in: a swap-out in the step of a
    # swap-in must not overwrite the host blocks that swap-in reads.
    scheduler = make_scheduler(num_blocks=8, block_size=4, num_host_blocks=2,
                               preemption_mode="swap")
    kv = scheduler.kv
    a, b = make_request("a", 8), make_request("b", 8)
    for request in (a, b):
        assert kv.allocate_slots(request, 8) is not None
        request.num_computed_tokens = 8
    assert kv.swap_out(a) == [(0, 0), (1, 1)]
    # a's full blocks go to the tail: free [4, 5, 6, 7, 1, 0]; 8 tokens + 1 take 3 blocks
    pairs, blocks = kv.swap_in(a, 1)  # type: ignore[misc]
    assert pairs == [(4, 0), (5, 1)] and [blk.block_id for blk in blocks] == [4, 5, 6]
    assert kv.host_pool.free_block_ids() == []  # 0 and 1 are being read this step
    assert kv.swap_out(b) is None  # so b could not be swapped out now
    kv.end_step()
    assert kv.host_pool.free_block_ids() == [0, 1]
    assert kv.swap_out(b) == [(2, 0), (3, 1)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_urgent_arrival_preempting_a_chunk_scheduled_this_step_caches_nothing_unwritten(
        mode):  # M1, G3
    """a's second chunk (positions 16-29) is scheduled in the running pass, which registers
    blocks 4-6 in the prefix cache as it allocates them (as vLLM's); the urgent u then
    preempts a in the waiting pass, before that chunk runs. The registrations stayed, and a,
    resumed, hit 28 tokens of which 16 had been written (found by the progress property
    test: KV read back as None). Its unwritten blocks leave the cache with it."""
    scheduler = make_scheduler(num_blocks=16, block_size=4, scheduling_policy="priority",
                               enable_priority_preemption=True, priority_preemption_threshold=0,
                               max_num_seqs=1, max_num_batched_tokens=16,
                               preemption_mode=mode, num_host_blocks=16 if mode == "swap" else 0,
                               preemption_prices=Prices() if mode != "recompute" else None)
    executor = FakeExecutor(block_size=4)
    scheduler.add_request(make_request("a", 30, priority=5, max_tokens=4, ignore_eos=True))
    step(scheduler, executor, 0.0)  # a: positions 0-15 written, blocks 0-3 registered
    scheduler.add_request(make_request("u", 4, priority=0, arrival_time=1.0, max_tokens=2,
                                       ignore_eos=True))
    out, _ = step(scheduler, executor, 1.0)
    assert out.preempted_req_ids == ["a"] and "a" not in out.num_scheduled_tokens
    assert sum(1 for block in scheduler.kv.pool.cached.values()
               if block.block_id in range(4, 8)) == 0  # a's chunk never ran
    final = run_to_completion(scheduler, executor=executor)  # the read-back checks a's KV
    assert len(final["a"].new_token_ids) == 4
    check_empty(scheduler)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("sharer", ["newcomer", "admitted_before"])
def test_a_running_request_whose_unwritten_blocks_another_holds_is_no_urgent_victim(
        mode, sharer):  # M1, G3
    """a's second chunk (positions 20-29) is scheduled in the running pass and registers
    blocks 5-6 as it allocates them. A prompt sharing a's first 28 tokens hits those blocks
    in the same step, which is sound while a's chunk runs in that step. Preempting a for an
    urgent arrival would leave them unwritten under the sharer: the urgent arrival itself
    (``newcomer``), or a request the same waiting pass admitted just before it
    (``admitted_before``). a does not qualify in that step; the next step, its blocks
    written, it does."""
    shared = [token_for("a/prompt", i) for i in range(30)]
    scheduler = make_scheduler(num_blocks=32, block_size=4, scheduling_policy="priority",
                               enable_priority_preemption=True, priority_preemption_threshold=0,
                               max_num_seqs=1 if sharer == "newcomer" else 2,
                               max_num_batched_tokens=20, preemption_mode=mode,
                               num_host_blocks=32 if mode == "swap" else 0,
                               preemption_prices=Prices() if mode != "recompute" else None)
    executor = FakeExecutor(block_size=4)
    scheduler.add_request(make_request("a", prompt_token_ids=shared, priority=5,
                                       max_tokens=4, ignore_eos=True))
    step(scheduler, executor, 0.0)  # a: positions 0-19 written, blocks 0-4 registered
    if sharer == "admitted_before":
        scheduler.add_request(make_request("b", prompt_token_ids=[*shared[:28], 7, 8],
                                           priority=0, arrival_time=1.0, max_tokens=2,
                                           ignore_eos=True))
        urgent = make_request("u", 4, priority=0, arrival_time=1.5, max_tokens=2,
                              ignore_eos=True)
    else:
        urgent = make_request("u", prompt_token_ids=[*shared[:28], 7, 8, 9, 10], priority=0,
                              arrival_time=1.0, max_tokens=2, ignore_eos=True)
    scheduler.add_request(urgent)
    out, outputs = step(scheduler, executor, 1.0)
    assert out.preempted_req_ids == [] and out.num_scheduled_tokens["a"] == 10
    assert "u" not in out.num_scheduled_tokens
    num_a_tokens = sum(len(o.new_token_ids) for o in outputs if o.request_id == "a")
    out, outputs = step(scheduler, executor, 2.0)  # a's blocks 5-6 written: a qualifies
    assert out.preempted_req_ids == ["a"] and "u" in out.num_scheduled_tokens
    num_a_tokens += sum(len(o.new_token_ids) for o in outputs if o.request_id == "a")
    final = run_to_completion(scheduler, executor=executor)  # the read-back checks the KV
    assert num_a_tokens + len(final["a"].new_token_ids) == 4
    assert final["u"].finish_reason == "length"
    check_empty(scheduler)


def test_a_request_aborted_in_the_step_that_scheduled_it_caches_nothing_unwritten():  # G3, H4
    """QA (offline API fuzz): a step that failed before the model wrote the KV (an
    interrupt, an error in the forward) ended its requests by abort, and the blocks their
    chunks registered at allocation stayed in the prefix cache unwritten; the next request
    with that prompt hit them and generated other text, silently. What it wrote stays."""
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=16)
    executor = FakeExecutor(block_size=4)
    scheduler.add_request(make_request("a", 30, max_tokens=4, ignore_eos=True))
    step(scheduler, executor, 0.0)  # positions 0-15 written, blocks 0-3 registered
    written = {block.block_id for block in scheduler.kv.pool.cached.values()}
    scheduler.schedule(1.0)  # the next chunk registers blocks 4-6 ...
    assert len(scheduler.kv.pool.cached) > len(written)
    assert scheduler.abort("a", 1.0)  # ... and the step fails before writing them
    assert {block.block_id for block in scheduler.kv.pool.cached.values()} == written
    check_empty(scheduler)


def test_a_request_swapped_in_by_a_step_that_failed_caches_nothing_of_it():  # S2 G3 H4
    """QA (review): the swap-in registers the fresh device blocks' hashes at schedule time,
    before the step's host-to-device copy; a step that failed, its requests aborted, left
    them cached, and the next request with that prompt read 64 tokens never copied."""
    scheduler, executor = _two_of_80_tokens_with_swap()
    scheduler.add_request(make_request("r2", 4, arrival_time=1.0, max_tokens=2,
                                       ignore_eos=True))
    out, _ = step(scheduler, executor, 1.0)
    assert out.blocks_to_swap_out  # r1 went to the host tier
    now = 2.0
    while "r0" in scheduler.requests:
        step(scheduler, executor, now)
        now += 1
    out = scheduler.schedule(now)  # r1 swapped back in; the step then fails
    targets = {device for device, _ in out.blocks_to_swap_in}
    assert targets
    for request_id in list(out.num_scheduled_tokens):
        scheduler.abort(request_id, now)
    cached = {block.block_id for block in scheduler.kv.pool.cached.values()}
    assert not cached & targets
    check_empty(scheduler)
