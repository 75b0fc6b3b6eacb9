"""Spec F: preemption when a running request cannot grow, and what it costs (B3)."""

from kvserve.core import EventType, check_empty
from tests.conftest import FakeExecutor, make_request, make_scheduler, run_to_completion, step


def ids(requests):
    return [r.request_id for r in requests]


def test_golden_preemption_in_a_ten_block_pool():  # F1-F6, B3; vLLM O.8 (11 with null block)
    scheduler = make_scheduler(num_blocks=10, block_size=16)
    executor = FakeExecutor()
    for name in ("r0", "r1"):
        scheduler.add_request(make_request(name, 80, max_tokens=10, ignore_eos=True))

    # step 1: both 80-token prompts fit exactly: r0 -> blocks 0-4, r1 -> blocks 5-9
    out, _ = step(scheduler, executor, 0.0)
    assert dict(out.num_scheduled_tokens) == {"r0": 80, "r1": 80}
    assert scheduler.kv.get_block_ids("r1") == [5, 6, 7, 8, 9]

    # step 2: r0's 81st token needs a 6th block; the newest running request is preempted.
    # r1's full blocks go to the tail tail-first: [9, 8, 7, 6, 5]; r0 takes block 9.
    scheduler.add_request(make_request("r2", 4, arrival_time=1.0))
    out, _ = step(scheduler, executor, 1.0)
    assert dict(out.num_scheduled_tokens) == {"r0": 1}
    assert out.preempted_req_ids == ["r1"]
    assert scheduler.kv.get_block_ids("r0") == [0, 1, 2, 3, 4, 9]
    assert scheduler.kv.pool.free_queue.block_ids() == [8, 7, 6, 5]
    r1 = scheduler.requests["r1"]
    assert (r1.status.name, r1.num_computed_tokens, r1.num_preemptions) == ("PREEMPTED", 0, 1)
    assert r1.num_output_tokens == 1  # its sampled token is kept, to be recomputed
    # the step that preempted admits nothing, although r2 would fit (F6)
    assert ids(scheduler.waiting) == ["r1", "r2"]

    # step 3: r1 (81 tokens) hits 4 cached blocks but needs 2 new + 4 free hits > 4 free:
    # it blocks the head of the queue, and r2 waits behind it
    out, _ = step(scheduler, executor, 2.0)
    assert dict(out.num_scheduled_tokens) == {"r0": 1}
    assert scheduler.num_blocked_steps == {"preemption": 1, "kv_cache": 1}

    # r0 finishes after 10 tokens; then r1 resumes with a 64-token prefix hit and recomputes
    # only the 16 tokens of its evicted block (plus its one sampled token, new KV)
    now = 3.0
    while "r0" in scheduler.requests:
        step(scheduler, executor, now)
        now += 1.0
    out, _ = step(scheduler, executor, now)
    resumed = {new.request_id: new for new in out.scheduled_new_reqs}
    assert resumed["r1"].resumed and resumed["r1"].num_computed_tokens == 64
    assert len(resumed["r1"].token_ids) == 81
    assert out.num_scheduled_tokens["r1"] == 17
    assert r1.num_recomputed_tokens == 16 and scheduler.num_recomputed_tokens == 16
    assert [e.type for e in r1.events] == [EventType.ARRIVED, EventType.ADMITTED,
                                          EventType.PREEMPTED, EventType.RESUMED]


def test_preempted_output_equals_unpreempted_output():  # F4
    def requests():
        return [make_request(i, 40 + 9 * i, max_tokens=30, ignore_eos=True) for i in range(6)]
    roomy = run_to_completion(make_scheduler(num_blocks=500, block_size=4), requests())
    tight_scheduler = make_scheduler(num_blocks=40, block_size=4)
    tight = run_to_completion(tight_scheduler, requests())
    assert tight_scheduler.num_preemptions > 0
    assert {k: v.new_token_ids for k, v in tight.items()} == \
        {k: v.new_token_ids for k, v in roomy.items()}
    check_empty(tight_scheduler)


def test_several_victims_keep_fifo_order_in_the_queue(executor):  # F5, C2
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=20,
                               long_prefill_token_threshold=12)
    scheduler.add_request(make_request("a", 23))
    scheduler.add_request(make_request("b", 3, max_tokens=20, ignore_eos=True))
    scheduler.add_request(make_request("c", 3, max_tokens=20, ignore_eos=True))
    out, _ = step(scheduler, executor)
    assert dict(out.num_scheduled_tokens) == {"a": 12, "b": 3, "c": 3}
    # a's last 11 tokens need 3 more blocks with 1 free: c (newest), then b, are preempted
    out, _ = step(scheduler, executor)
    assert out.preempted_req_ids == ["c", "b"]
    assert dict(out.num_scheduled_tokens) == {"a": 11}
    assert ids(scheduler.waiting) == ["b", "c"]


def test_fcfs_request_that_is_itself_newest_preempts_itself(executor):  # F2, F5
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    scheduler.add_request(make_request("old", 4, max_tokens=20, ignore_eos=True))
    step(scheduler, executor)  # old: 5 tokens
    scheduler.add_request(make_request("new", 4, max_tokens=20, ignore_eos=True))
    step(scheduler, executor)  # old grows to 2 blocks, new takes 1: pool full
    out, _ = step(scheduler, executor)
    # old fits in its 2 blocks; new needs a second block and is itself the newest: it is
    # the victim, and pass 1 ends
    assert dict(out.num_scheduled_tokens) == {"old": 1}
    assert out.preempted_req_ids == ["new"]
    assert ids(scheduler.running) == ["old"]


def test_preemption_stall_is_measured():  # B3
    scheduler = make_scheduler(num_blocks=10, block_size=16)
    final = run_to_completion(scheduler, [make_request(n, 80, max_tokens=10, ignore_eos=True)
                                          for n in ("r0", "r1")])
    metrics = final["r1"].metrics
    assert metrics is not None and metrics.num_preemptions == 1
    # preempted at step 1 (t=1.0); r0 runs to t=9.0; r1 resumes and samples at t=10.0
    assert metrics.longest_stall == 9.0
    assert final["r0"].metrics is not None and final["r0"].metrics.longest_stall == 0.0


def test_event_stream_names_each_transition():  # issue item 10
    scheduler = make_scheduler(num_blocks=10, block_size=16, record_events=True)
    run_to_completion(scheduler, [make_request(n, 80, max_tokens=3, ignore_eos=True)
                                  for n in ("r0", "r1")])
    events = [(e.kind, e.request_id, e.num_tokens, e.reason) for e in scheduler.take_events()]
    assert events[:4] == [("arrived", "r0", 80, ""), ("arrived", "r1", 80, ""),
                          ("admitted", "r0", 80, ""), ("admitted", "r1", 80, "")]
    assert ("preempted", "r1", 80, "recompute") in events  # the 80 tokens of KV it lost
    assert ("blocked", "r1", 81, "preemption") in events
    assert ("blocked", "r1", 81, "kv_cache") in events
    assert ("resumed", "r1", 17, "") in events
    assert events[-1] == ("finished", "r1", 3, "length")
    assert scheduler.take_events() == []


def test_a_running_request_the_guard_holds_back_is_counted_and_logged_once_a_wait():  # P2
    """Operator pass: with --max-preemptions-per-request a running request waited 15 steps
    for tokens (P2) with nothing counted or logged, a frozen stream without a preemption."""
    scheduler = make_scheduler(num_blocks=22, block_size=16, max_num_batched_tokens=2048,
                               max_preemptions_per_request=1, record_events=True)
    requests = [make_request(f"r{i}", prompt_token_ids=[1000 + 100 * i + j for j in range(42)],
                             max_tokens=120, ignore_eos=True) for i in range(6)]
    run_to_completion(scheduler, requests)
    events = scheduler.take_events()
    waits = [(e.time, e.request_id) for e in events
             if e.kind == "blocked" and e.reason == "preemption_guard"]
    assert waits and scheduler.num_guard_waits > len(waits)  # a wait lasts several steps
    assert scheduler.stats().num_guard_waits == scheduler.num_guard_waits
    assert not scheduler._guard_waited  # forgotten as each finished
    check_empty(scheduler)
