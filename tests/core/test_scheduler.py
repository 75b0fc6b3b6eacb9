"""Spec D, H, J: the two passes, one token budget, update() and stop checks.

Golden scenarios follow vLLM V1's tests (reference/vllm_v1_semantics.md section O).
"""

import pytest

from kvserve.core import (
    ModelOutput,
    QueueFullError,
    RequestError,
    RequestRejected,
    RequestStatus,
    SchedulerConfig,
    check_empty,
)
from tests.conftest import (
    EOS,
    FakeExecutor,
    make_group,
    make_request,
    make_scheduler,
    occupy_every_seat,
    run_to_completion,
    step,
)


def scheduled(out):
    return dict(out.num_scheduled_tokens)


def test_add_and_count_requests():  # O.1
    scheduler = make_scheduler()
    for i in range(3):
        scheduler.add_request(make_request(i))
    assert scheduler.get_num_unfinished_requests() == 3
    assert [r.request_id for r in scheduler.waiting] == ["0", "1", "2"]
    assert scheduler.abort("1") and scheduler.get_num_unfinished_requests() == 2


def test_ten_small_requests_all_admitted_in_one_step(executor):  # O.2
    scheduler = make_scheduler()
    for i in range(10):
        scheduler.add_request(make_request(i, 16 + i))
    out, _ = step(scheduler, executor)
    assert scheduled(out) == {str(i): 16 + i for i in range(10)}
    assert [new.request_id for new in out.scheduled_new_reqs] == [str(i) for i in range(10)]
    assert len(scheduler.waiting) == 0 and len(scheduler.running) == 10


def test_concurrent_chunked_prefills_400_400_224(executor):  # D1, O.4
    scheduler = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    for i in range(3):
        scheduler.add_request(make_request(i, 800))
    expected = [[400, 400, 224], [400, 400, 224], [1, 1, 352]]
    for want in expected:
        out, _ = step(scheduler, executor)
        assert list(out.num_scheduled_tokens.values()) == want
        assert list(out.num_scheduled_tokens) == ["0", "1", "2"]


def test_running_request_with_nothing_left_is_skipped_not_blocking(executor):  # D2
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 8))
    out = scheduler.schedule(0.0)
    # schedule again before update: "a" has no tokens to compute, and nothing else runs
    again = scheduler.schedule(0.0)
    assert scheduled(out) == {"a": 8} and again.is_empty


def test_head_of_line_blocking_without_chunked_prefill(executor):  # D4, O.7
    on = make_scheduler(max_num_batched_tokens=1024, max_model_len=1024)
    off = make_scheduler(max_num_batched_tokens=1024, max_model_len=1024,
                         enable_chunked_prefill=False)
    for scheduler in (on, off):
        scheduler.add_request(make_request("long", 700))
        scheduler.add_request(make_request("longer", 800))
        scheduler.add_request(make_request("short", 10))
    assert scheduled(step(on, FakeExecutor())[0]) == {"long": 700, "longer": 324}
    # off: "longer" does not fit the 324 tokens left, and the pass stops there although
    # "short" would fit: head-of-line blocking, on purpose
    assert scheduled(step(off, FakeExecutor())[0]) == {"long": 700}
    assert off.num_blocked_steps == {"token_budget": 1}


def test_max_num_seqs_stops_admission(executor):  # D4
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(make_request(i, 4))
    out, _ = step(scheduler, executor)
    assert scheduled(out) == {"0": 4, "1": 4}
    assert scheduler.num_blocked_steps == {"max_num_seqs": 1}


def test_a_kv_blocked_head_blocks_the_queue(executor):  # D4 head-of-line on KV
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    scheduler.add_request(make_request("a", 8))
    scheduler.add_request(make_request("b", 12))  # 3 blocks: only 2 left after "a"
    scheduler.add_request(make_request("c", 4))  # would fit, but waits behind "b"
    out, _ = step(scheduler, executor)
    assert scheduled(out) == {"a": 8}
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.num_blocked_steps == {"kv_cache": 1}


def test_a_head_only_the_watermark_keeps_out_is_blocked_by_the_watermark(executor):  # E2
    """Operator pass: the pass stopped with "kv_cache" while most of the pool was free,
    and nothing said the watermark (E2) held the blocks back."""
    scheduler = make_scheduler(num_blocks=10, block_size=4, watermark=0.5, record_events=True)
    scheduler.add_request(make_request("a", 8))  # nothing runs yet: no watermark
    scheduler.add_request(make_request("b", 16))  # 4 blocks + 5 held back > 8 free
    out, _ = step(scheduler, executor)
    assert scheduled(out) == {"a": 8} and scheduler.kv.num_free_blocks == 8
    assert scheduler.num_blocked_steps == {"watermark": 1}
    assert [(e.request_id, e.reason) for e in scheduler.take_events()
            if e.kind == "blocked"] == [("b", "watermark")]


def test_admission_takes_the_prefix_hit_and_schedules_the_rest(executor):  # D5, D6
    scheduler = make_scheduler(block_size=4)
    shared = list(range(100, 112))
    scheduler.add_request(make_request("a", prompt_token_ids=[*shared, 1]))
    step(scheduler, executor)
    scheduler.add_request(make_request("b", prompt_token_ids=[*shared, 2, 3]))
    out, _ = step(scheduler, executor)
    assert scheduled(out) == {"a": 1, "b": 2}
    new = out.scheduled_new_reqs[0]
    assert (new.request_id, new.num_computed_tokens, new.resumed) == ("b", 12, False)
    assert new.block_ids[:3] == scheduler.kv.get_block_ids("a")[:3]
    assert scheduler.requests["b"].num_cached_tokens == 12
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (13 + 14, 12)  # G6


def test_computed_tokens_advance_before_the_model_runs():  # D7
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 100))
    scheduler.schedule(0.0)
    assert scheduler.requests["a"].num_computed_tokens == 64


def test_mid_prompt_chunks_return_no_token_then_the_last_chunk_does(executor):  # H1
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 100, max_tokens=5))
    _, first = step(scheduler, executor)
    _, second = step(scheduler, executor)
    assert first == [] and [len(o.new_token_ids) for o in second] == [1]


def test_update_enforces_the_executor_contract():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 100))
    out = scheduler.schedule(0.0)
    with pytest.raises(ValueError, match="in the middle of its prompt"):
        scheduler.update(out, ModelOutput({"a": [5]}), 0.0)
    scheduler.add_request(make_request("b", 4))
    out = scheduler.schedule(1.0)
    with pytest.raises(ValueError, match="returned no token for request a, whose"):
        scheduler.update(out, ModelOutput({}), 1.0)


def run_one(tokens, **params):
    """Feed ``tokens`` one per step to a single request; return its final output."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 4, eos_token_id=EOS, **params))
    outputs = []
    for now, token in enumerate(tokens):
        out = scheduler.schedule(float(now))
        outputs += scheduler.update(out, ModelOutput({"r": [token]}), float(now))
        if outputs[-1].finished:
            break
    check_empty(scheduler)
    return outputs[-1], [t for o in outputs for t in o.new_token_ids]


@pytest.mark.parametrize(("tokens", "params", "reason", "stop_reason", "num_out"), [
    ([7, 8, EOS, 9], {}, "stop", None, 3),
    ([7, EOS, 8, 9], {"ignore_eos": True, "max_tokens": 4}, "length", None, 4),
    ([7, 42, 8], {"stop_token_ids": [42]}, "stop", 42, 2),
    ([7, 8, 9, 10], {"max_tokens": 3}, "length", None, 3),
    ([EOS, 42, EOS, 11], {"min_tokens": 3, "stop_token_ids": [42]}, "stop", None, 3),
    ([EOS, 42, EOS, 11], {"min_tokens": 2, "stop_token_ids": [42]}, "stop", 42, 2),
    ([EOS, EOS, 7, 8], {"min_tokens": 3, "max_tokens": 3}, "length", None, 3),
])
def test_stop_conditions_in_order(tokens, params, reason, stop_reason, num_out):  # H2, O.5
    params.setdefault("max_tokens", 16)
    final, out_tokens = run_one(tokens, **params)
    assert (final.finish_reason, final.stop_reason, len(out_tokens)) == (reason, stop_reason,
                                                                         num_out)
    assert final.metrics is not None and final.metrics.num_output_tokens == num_out


def test_tokens_after_a_stop_in_the_same_step_are_dropped():  # H2
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 4, eos_token_id=EOS))
    out = scheduler.schedule(0.0)
    [final] = scheduler.update(out, ModelOutput({"r": [7, EOS, 8]}), 0.0)
    assert final.new_token_ids == [7, EOS] and final.finish_reason == "stop"


def test_max_model_len_caps_the_sequence():  # H2
    scheduler = make_scheduler(max_model_len=20)
    final = run_to_completion(scheduler, [make_request("r", 16, max_tokens=100)])["r"]
    assert (final.finish_reason, len(final.new_token_ids)) == ("length", 4)


def test_finished_request_frees_at_once_and_leaves_running(executor):  # H3
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 20, max_tokens=1))
    scheduler.add_request(make_request("b", 20, max_tokens=5))
    _, outputs = step(scheduler, executor)
    assert [o.finished for o in outputs] == [True, False]
    assert [r.request_id for r in scheduler.running] == ["b"]
    assert scheduler.kv.num_held_blocks("a") == 0
    out, _ = step(scheduler, executor)
    assert out.finished_req_ids == ["a"]


@pytest.mark.parametrize("state", ["waiting", "running", "preempted", "mid_prefill"])
def test_abort_in_any_state_frees_everything(state, executor):  # H4
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 4, max_tokens=50, ignore_eos=True))
    if state == "mid_prefill":
        scheduler.add_request(make_request("b", 20))
        step(scheduler, executor)
        assert scheduler.requests["b"].num_computed_tokens == 4
    elif state == "running":
        scheduler.add_request(make_request("b", 4))
        step(scheduler, executor)
    elif state == "preempted":
        scheduler.add_request(make_request("b", 16, max_tokens=50, ignore_eos=True))
        while scheduler.requests["b"].status is not RequestStatus.PREEMPTED:
            step(scheduler, executor)
    else:
        scheduler.add_request(make_request("b", 4))
    assert scheduler.abort("b", now=1.0)
    assert not scheduler.abort("b") and not scheduler.abort("never-seen")
    assert "b" not in scheduler.requests and scheduler.kv.num_held_blocks("b") == 0
    scheduler.abort("a")
    check_empty(scheduler)


def test_abort_between_schedule_and_update_drops_the_token():  # H4
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4))
    out = scheduler.schedule(0.0)
    scheduler.abort("a")
    assert scheduler.update(out, ModelOutput({"a": [7]}), 0.0) == []
    assert scheduler.schedule(1.0).finished_req_ids == ["a"]
    check_empty(scheduler)


def test_prompt_that_leaves_no_room_is_rejected_untouched():  # J1
    scheduler = make_scheduler(max_model_len=64)
    with pytest.raises(RequestRejected, match="prompt of 64 tokens leaves no room to generate: "
                                              "max_model_len is 64"):
        scheduler.add_request(make_request("a", 64))
    check_empty(scheduler)


def test_prompt_larger_than_the_pool_is_rejected_untouched():  # J1
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(RequestRejected, match=r"needs 5 KV blocks, but the whole pool has 4 "
                                              r"blocks of 4 tokens \(16 tokens\)"):
        scheduler.add_request(make_request("a", 16))
    scheduler.add_request(make_request("b", 15))  # 15 + 1 tokens fit exactly
    assert list(scheduler.requests) == ["b"]


def test_growth_past_the_pool_stops_with_length_instead_of_preempting():  # J2
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    final = run_to_completion(scheduler, [make_request("a", 10, max_tokens=100,
                                                       ignore_eos=True)])["a"]
    # 16 slots: the sequence may reach 17 tokens (the last one is never fed back)
    assert (final.finish_reason, len(final.new_token_ids)) == ("length", 7)
    assert final.stop_reason == "kv_capacity"  # said plainly, not just "length"
    assert final.metrics is not None and final.metrics.num_preemptions == 0


@pytest.mark.parametrize(("max_tokens", "max_model_len", "stop_reason"), [
    (7, 64, None),            # max_tokens reached on the same token as the pool's limit
    (100, 17, None),          # max_model_len (17) is the limit, not the pool
    (100, 64, "kv_capacity"),
])
def test_only_the_pool_limit_says_kv_capacity(max_tokens, max_model_len, stop_reason):  # J2
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=max_model_len)
    final = run_to_completion(scheduler, [make_request("a", 10, max_tokens=max_tokens,
                                                       ignore_eos=True)])["a"]
    assert (final.finish_reason, len(final.new_token_ids)) == ("length", 7)
    assert final.stop_reason == stop_reason


def test_duplicate_or_reused_request_is_refused():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    with pytest.raises(RequestError, match="request id 'a' is already in use"):
        scheduler.add_request(make_request("a"))
    used = make_request("b")
    used.output_token_ids.append(3)
    with pytest.raises(RequestError, match="request b is not a fresh request"):
        scheduler.add_request(used)


def test_queue_limits_refuse_without_a_trace():  # K4
    scheduler = make_scheduler(max_num_queued_reqs=2, max_num_queued_tokens=30, max_num_seqs=1)
    occupy_every_seat(scheduler)
    scheduler.add_request(make_request("a", 10))
    with pytest.raises(QueueFullError, match=r"max_num_queued_tokens=30 \(10 queued\)"):
        scheduler.add_request(make_request("b", 21))
    scheduler.add_request(make_request("c", 20))
    with pytest.raises(QueueFullError, match=r"waiting queue is full \(2 requests, "
                                             r"max_num_queued_reqs=2"):
        scheduler.add_request(make_request("d", 1))
    assert [r.request_id for r in scheduler.waiting] == ["a", "c"]
    assert set(scheduler.requests) == {"busy", "a", "c"}


def test_a_prompt_over_the_token_limit_waits_alone():  # K4
    """Operator pass: a prompt longer than max_num_queued_tokens was refused for good (a
    400), a hidden prompt-length cap. It is taken where nothing else waits, idle engine or
    busy, and refused for now behind a backlog; while it waits, it is the backlog. (The
    review: taken instead where the next step seemed to admit it, it could stay behind a
    more urgent arrival, or a watermark made that guess a 503 for good.)"""
    idle = make_scheduler(max_num_queued_tokens=30, max_num_seqs=1, watermark=0.5)
    idle.add_request(make_request("long", 100))
    assert [r.request_id for r in idle.waiting] == ["long"]
    busy = make_scheduler(max_num_queued_tokens=30, max_num_seqs=1)
    occupy_every_seat(busy)
    busy.add_request(make_request("a", 10))
    with pytest.raises(QueueFullError, match=r"max_num_queued_tokens=30 \(10 queued\)"):
        busy.add_request(make_request("long", 100))
    busy.abort("a")
    busy.add_request(make_request("long", 100))  # alone
    with pytest.raises(QueueFullError, match=r"max_num_queued_tokens=30 \(100 queued\)"):
        busy.add_request(make_request("b", 1))


def test_a_prompt_over_the_token_limit_waits_alone_even_beside_one_that_looks_admissible():
    """K4, the second review: "alone" counted only the requests the next step would not
    admit as things stand, an estimate the step need not keep (a running prefill's next
    chunk takes the blocks): two prompts over the limit could wait together."""
    scheduler = make_scheduler(80, 4, max_num_seqs=4, max_num_batched_tokens=128,
                               max_num_queued_tokens=40)
    scheduler.add_request(make_request("r", 240, max_tokens=4))
    step(scheduler, FakeExecutor(), 0.0)  # r's first chunk of 128
    scheduler.add_request(make_request("big1", 100))  # nothing waits: alone
    with pytest.raises(QueueFullError, match=r"max_num_queued_tokens=40"):
        scheduler.add_request(make_request("big2", 100))


def test_a_group_the_idle_pool_cannot_take_past_the_token_limit_is_refused_for_good():  # K4
    """The second review: the 400 rule counted seats and budget only, so a group whose
    later prompts the pool (with its watermark) cannot hold beside the first was a 503 on
    every retry of an idle server."""
    from kvserve.core.limits import check_queueable

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096,
                             max_num_queued_tokens=800, watermark=0.3)
    check_queueable(make_group([600] * 3), config, "g")  # without the pool: all admitted
    with pytest.raises(RequestRejected, match="past those the next step admits would wait"):
        check_queueable(make_group([600] * 3), config, "g", pool=(100, 16))
    check_queueable(make_group([600] * 2), config, "g", pool=(100, 16))  # the second waits


@pytest.mark.parametrize(("lengths", "settings", "queueable"), [
    ([5] * 10 + [41, 5], {"max_num_seqs": 16, "max_num_batched_tokens": 51,
                          "max_num_queued_tokens": 41}, False),
    ([2, 2, 20] + [2] * 8, {"max_num_seqs": 3, "max_num_queued_tokens": 20}, True),
    ([2] * 10 + [10], {"max_num_seqs": 5, "max_num_queued_tokens": 12}, False),
])
def test_the_400_rules_replay_a_group_s_adds_in_the_priority_queue_s_order(
        lengths, settings, queueable):  # K4 B2
    """The reviews: the priority queue orders a group's sequences by id among equals
    (``g-10`` before ``g-2``, as vLLM's) while the server adds them by index; the 400 rules,
    counting them in index order, or in id order as if added so, disagreed with an idle
    scheduler (a 503 on every retry, or a 400 for a group it serves). They replay the adds."""
    from kvserve.core.limits import check_queueable

    config = SchedulerConfig(scheduling_policy="priority", max_model_len=4096, **settings)
    refused = None
    try:
        check_queueable(make_group(lengths), config, "g")
    except RequestRejected as error:
        refused = error
    assert (refused is None) == queueable
    scheduler = make_scheduler(scheduling_policy="priority", **settings)
    try:
        for request in make_group(lengths):
            scheduler.add_request(request)
    except QueueFullError:
        assert not queueable  # what the 400 refused, an idle scheduler refuses too
    else:
        assert queueable, "a 400 for a group an idle scheduler queues"


def test_without_chunked_prefill_a_prompt_needs_the_whole_budget_to_be_no_backlog():  # K4
    """The review: the next step's admissions were counted while any budget was left, but
    with chunked prefill off a prompt needs all its tokens in it (D4): the second of two
    200-token prompts waits, so a third is past a queue limit of one."""
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                               enable_chunked_prefill=False, max_num_queued_reqs=1)
    scheduler.add_request(make_request("r0", 200))
    scheduler.add_request(make_request("r1", 200))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        scheduler.add_request(make_request("r2", 200))


def test_the_queue_limits_count_a_backlog_not_a_burst_into_free_seats():  # K4
    """What the next step admits is no backlog: a burst of 7 on an idle engine of 4 seats
    and a queue limit of 2 is 4 admitted and 2 waiting, the 7th refused (a burst arriving
    within one step was refused past the limit, free seats or not; QA). A pool short of
    blocks admits fewer, so the limit still bounds what waits on memory."""
    for num_blocks, accepted in ((1000, 6), (6, 5)):  # 6 blocks: 3 admitted, of 2 each
        scheduler = make_scheduler(num_blocks, max_num_seqs=4, max_num_queued_reqs=2)
        taken = 0
        for index in range(7):
            try:
                scheduler.add_request(make_request(f"r{index}", 20))
                taken += 1
            except QueueFullError:
                break
        assert taken == accepted, num_blocks


@pytest.mark.parametrize("admission_policy", ["reserve", "adaptive"])
def test_the_queue_limits_count_the_blocks_an_admission_policy_reserves(admission_policy):
    """K4 with K2: what the next step admits keeps the blocks the admission policy holds for
    each admitted request's growth. Counted without them, four of five 50-token prompts
    (max_tokens 200) were taken for the next step's on a pool of 20 blocks, where the
    policy admits one: four waited past a queue limit of one."""
    scheduler = make_scheduler(20, 16, max_num_seqs=8, max_num_queued_reqs=1,
                               admission_policy=admission_policy, adaptive_init_ratio=1.0)
    scheduler.add_request(make_request("a", 50, max_tokens=200))
    scheduler.add_request(make_request("b", 50, max_tokens=200))  # a is the next step's
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        scheduler.add_request(make_request("c", 50, max_tokens=200))
    scheduler.schedule(0.0)
    assert [r.request_id for r in scheduler.running] == ["a"]
    assert len(scheduler.waiting) == 1


@pytest.mark.parametrize("admission_policy", ["reserve", "adaptive"])
def test_a_busy_engine_counts_each_running_request_s_growth_once(admission_policy):  # K4 K2
    """The review: a block kept for each running request's next token and the policy's
    reserve for its growth, which holds that block, were both counted, so the head of the
    queue the next step admits was taken for backlog and an arrival refused."""
    scheduler = make_scheduler(10, 16, max_num_seqs=8, max_num_queued_reqs=1,
                               admission_policy=admission_policy, adaptive_init_ratio=1.0)
    for index in range(4):
        scheduler.add_request(make_request(f"r{index}", 8, max_tokens=24, ignore_eos=True))
    executor = FakeExecutor()
    for now in range(3):
        step(scheduler, executor, float(now))
    scheduler.add_request(make_request("w", 8, max_tokens=24, arrival_time=3.0))
    scheduler.add_request(make_request("x", 8, max_tokens=24, arrival_time=3.0))  # w is not
    step(scheduler, executor, 3.0)  # backlog: the step admits it
    assert [r.request_id for r in scheduler.running][-1] == "w"
    assert [r.request_id for r in scheduler.waiting] == ["x"]


def test_a_group_the_pool_can_never_hold_is_refused_for_the_pool_not_the_queue():  # J1 K4
    """The chaos pass: two prompts each longer than the whole pool were refused for
    max_num_queued_tokens (the group's rule asked first), sending the user after the wrong
    flag; one alone was refused for the pool."""
    from kvserve.core.limits import check_queueable

    config = SchedulerConfig(max_num_queued_tokens=600, max_model_len=512)
    with pytest.raises(RequestRejected, match=r"request g-0: prompt of 400 tokens plus one "
                                              r"generated token needs 26 KV blocks, but the "
                                              r"whole pool has 24 blocks"):
        check_queueable(make_group([400, 400]), config, "g", pool=(24, 16))


def test_a_prompt_of_whole_blocks_is_not_counted_a_block_too_many():  # K4 K2
    """The review: the block past a prompt's end and the reserve counted from the prompt's
    blocks, which holds it, were both counted: two 16-token prompts on 8 blocks of 16 were a
    400, though an idle engine admits the first (growing to 8 blocks) and queues the other."""
    from kvserve.core.limits import check_queueable

    config = SchedulerConfig(max_num_queued_reqs=1, admission_policy="reserve")
    check_queueable(make_group([16, 16], max_tokens=112), config, "g", pool=(8, 16))
    scheduler = make_scheduler(8, 16, max_num_queued_reqs=1, admission_policy="reserve")
    for name in "ab":
        scheduler.add_request(make_request(name, 16, max_tokens=112))
    scheduler.schedule(0.0)
    assert [r.request_id for r in scheduler.running] == ["a"]


def test_a_group_the_admission_policy_keeps_apart_is_refused_for_good():  # K4 K2
    """The 400 rules count the reserve too: under ``reserve`` an idle pool of 20 blocks
    admits one of these prompts (each may grow to 16 blocks), so three more wait with 150
    tokens, past a limit of 100, on every retry."""
    from kvserve.core.limits import check_queueable

    config = SchedulerConfig(max_num_queued_tokens=100, admission_policy="reserve")
    check_queueable(make_group([50] * 4, max_tokens=20), config, "g", pool=(20, 16))  # all
    with pytest.raises(RequestRejected, match="past those the next step admits would wait"):
        check_queueable(make_group([50] * 4, max_tokens=200), config, "g", pool=(20, 16))
    optimistic = SchedulerConfig(max_num_queued_tokens=100)
    check_queueable(make_group([50] * 4, max_tokens=200), optimistic, "g", pool=(20, 16))


def test_a_running_prefill_leaves_no_budget_to_admit_past_the_limit(executor):  # K4 D1
    """QA (spec pass): what the next step admits took one token per running request, so a
    long prompt mid-prefill, whose next chunk takes the whole budget, let 6 requests past a
    queue limit of 1; the next step admitted none of them."""
    scheduler = make_scheduler(1000, 16, max_model_len=8192, max_num_batched_tokens=512,
                               max_num_seqs=8, max_num_queued_reqs=1)
    scheduler.add_request(make_request("long", 4000, max_tokens=5))
    step(scheduler, executor, 0.0)  # 512 of 4000 computed: the next chunk takes the budget
    scheduler.add_request(make_request("w0", 16, arrival_time=0.5))  # the one allowed
    with pytest.raises(QueueFullError):
        scheduler.add_request(make_request("w1", 16, arrival_time=0.5))


def test_an_urgent_arrival_takes_the_place_of_the_least_urgent_waiting(executor):  # K5
    """Under the priority policy a full queue makes room for a more urgent arrival by
    ending its least urgent never-scheduled requests; without room, nothing moves."""
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1,
                               max_num_queued_reqs=3, max_num_queued_tokens=100)
    scheduler.add_request(make_request("run", 4, priority=50, max_tokens=50, arrival_time=0))
    step(scheduler, executor, 0.0)  # "run" is scheduled: never displaced
    for name, priority, arrival in (("p50", 50, 1.0), ("p50-late", 50, 2.0), ("p10", 10, 3.0)):
        scheduler.add_request(make_request(name, 10, priority=priority, arrival_time=arrival))
    with pytest.raises(QueueFullError, match="waiting queue is full"):  # not more urgent
        scheduler.add_request(make_request("p50-new", 4, priority=50, arrival_time=4.0))
    scheduler.add_request(make_request("p0", 4, priority=0, arrival_time=5.0))
    assert [r.request_id for r in scheduler.waiting] == ["p0", "p10", "p50"]
    # 90 tokens at priority 10: p50 (the only one less urgent) would free a place and 10
    # tokens, not the 14 more the token limit needs: nothing moves
    with pytest.raises(QueueFullError, match="max_num_queued_tokens"):
        scheduler.add_request(make_request("big", 90, priority=10, arrival_time=6.0))
    assert [r.request_id for r in scheduler.waiting] == ["p0", "p10", "p50"]
    outputs = step(scheduler, executor, 7.0)[1]
    assert [(o.request_id, o.finish_reason, o.stop_reason) for o in outputs
            if o.finished] == [("p50-late", "abort", "displaced")]
    assert "p50-late" not in scheduler.requests


def test_a_tenants_urgent_arrival_displaces_its_own_tenant_first():  # K5
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1,
                               max_num_queued_reqs=3, max_num_queued_reqs_per_tenant=2)
    occupy_every_seat(scheduler)
    for name, tenant, priority in (("a1", "A", 50), ("a2", "A", 40), ("b1", "B", 90)):
        scheduler.add_request(make_request(name, 4, priority=priority, tenant=tenant))
    # A is at its own limit and the queue at its limit: A's least urgent makes room under
    # both; B's, though less urgent, frees nothing under A's limit
    scheduler.add_request(make_request("a0", 4, priority=0, tenant="A"))
    assert sorted(r.request_id for r in scheduler.waiting) == ["a0", "a2", "b1"]
    # B's urgent arrival: B is under its limit, the queue is full: the least urgent goes
    scheduler.add_request(make_request("b0", 4, priority=0, tenant="B"))
    assert sorted(r.request_id for r in scheduler.waiting) == ["a0", "a2", "b0"]


def test_fcfs_queue_limits_displace_nothing():  # K4, K5
    scheduler = make_scheduler(max_num_queued_reqs=1, max_num_seqs=1)
    occupy_every_seat(scheduler)
    scheduler.add_request(make_request("a", 4, priority=50))
    with pytest.raises(QueueFullError):
        scheduler.add_request(make_request("b", 4, priority=0))
    assert [r.request_id for r in scheduler.waiting] == ["a"]


def test_queue_deadline_times_out_only_never_scheduled_requests(executor):  # K4
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, max_queue_delay=2.0)
    scheduler.add_request(make_request("a", 4, max_tokens=10, arrival_time=0.0))
    scheduler.add_request(make_request("b", 4, arrival_time=0.0))
    scheduler.add_request(make_request("c", 4, arrival_time=0.0, max_queue_delay=100.0))
    outputs = []
    for now in (0.0, 1.0, 2.0, 3.0):
        outputs += step(scheduler, executor, now)[1]
    timeouts = [o for o in outputs if o.stop_reason == "queue_timeout"]
    assert [(o.request_id, o.finish_reason) for o in timeouts] == [("b", "abort")]
    assert "a" in scheduler.requests and "c" in scheduler.requests  # a ran; c has 100 s


def test_a_queue_deadline_is_its_own_requests_and_goes_with_it(executor):  # K4
    """An expired entry named its request by id: a later request that reused the id, with
    no deadline of its own, was timed out at the old one's (QA); and the entries of
    finished requests stayed until their deadline, a day where a client asked for one."""
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    scheduler.add_request(make_request("job", 4, max_tokens=1, max_queue_delay=5.0))
    step(scheduler, executor, 0.0)
    step(scheduler, executor, 0.1)
    assert "job" not in scheduler.requests
    scheduler.add_request(make_request("long", 4, max_tokens=1000, ignore_eos=True,
                                       arrival_time=3.0))
    step(scheduler, executor, 3.0)
    scheduler.add_request(make_request("job", 4, max_tokens=1, arrival_time=4.0))
    outputs = step(scheduler, executor, 4.0)[1] + step(scheduler, executor, 5.5)[1]
    assert not [o for o in outputs if o.stop_reason == "queue_timeout"]
    assert "job" in scheduler.requests  # waiting behind "long", as it asked no deadline
    scheduler.abort("long")
    for index in range(1000):
        scheduler.add_request(make_request(f"r{index}", 4, max_tokens=1,
                                           arrival_time=6.0, max_queue_delay=86400.0))
    now = 6.0
    while scheduler.requests:
        step(scheduler, executor, now)
        now += 0.001
    assert len(scheduler._queue_deadlines) <= 64 + 2


def test_leak_check_after_everything_finishes():  # I4, O.14
    scheduler = make_scheduler(num_blocks=30, block_size=4, max_num_seqs=4,
                               max_num_batched_tokens=32)
    requests = [make_request(i, 5 + 3 * i, max_tokens=4 + i, ignore_eos=True)
                for i in range(12)]
    final = run_to_completion(scheduler, requests)
    assert sorted(final, key=int) == [str(i) for i in range(12)]
    check_empty(scheduler)


def test_prefix_stats_count_once_for_a_request_retried_many_steps(executor):  # G6, O.9
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    scheduler.add_request(make_request("big", 20, max_tokens=3, ignore_eos=True))
    scheduler.add_request(make_request("next", 8))
    for now in range(3):  # "next" fails to allocate while "big" holds 6 blocks
        step(scheduler, executor, float(now))
        assert scheduler.stats().prefix_cache_queries == 20
    while "next" in scheduler.requests:
        step(scheduler, executor)
    assert scheduler.stats().prefix_cache_queries == 28


def test_a_resumed_victims_lookup_is_counted_apart():  # G6, O.9
    """A preempted request re-hitting its own blocks read as a caching benefit: a storm of
    preemptions on traffic sharing nothing showed a high hit rate (vLLM PR 25787)."""
    scheduler = make_scheduler(num_blocks=10, block_size=16)
    run_to_completion(scheduler, [make_request(n, 80, max_tokens=10, ignore_eos=True)
                                  for n in ("r0", "r1")])
    stats = scheduler.stats()
    # r0 and r1 once each (80 + 80, no hit); r1 again with its 81 tokens and a 64-token hit
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (160, 0)
    assert (stats.prefix_cache_preempted_queries, stats.prefix_cache_preempted_hits) == \
        (81, 64)


def test_prefix_stats_stay_zero_without_caching():  # G6, O.9
    scheduler = make_scheduler(enable_prefix_caching=False)
    run_to_completion(scheduler, [make_request("a", 40), make_request("b", 40)])
    assert (scheduler.stats().prefix_cache_queries, scheduler.stats().prefix_cache_hits) == (0,
                                                                                           0)


def test_watermark_spares_a_lone_request_but_not_a_second_one(executor):  # E2
    scheduler = make_scheduler(num_blocks=10, block_size=4, watermark=0.3)  # 3 blocks
    scheduler.add_request(make_request("alone", 36))  # 9 blocks > 10 - 3, admitted anyway
    assert dict(step(scheduler, executor)[0].num_scheduled_tokens) == {"alone": 36}
    scheduler.abort("alone")
    scheduler.add_request(make_request("first", 16))  # 4 blocks
    scheduler.add_request(make_request("second", 12))  # 3 blocks: 4 + 3 + 3 watermark = 10
    scheduler.add_request(make_request("third", 4))  # 1 more would eat into the watermark
    out, _ = step(scheduler, executor)
    assert dict(out.num_scheduled_tokens) == {"first": 16, "second": 12}
    assert scheduler.kv.num_free_blocks == 3


def test_without_the_full_sequence_gate_a_first_chunk_is_admitted():  # E3, A1
    def admitted(**config):
        scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=8,
                                   max_num_seqs=8, **config)
        fake = FakeExecutor()
        scheduler.add_request(make_request("held", 8, max_tokens=50, ignore_eos=True))
        step(scheduler, fake)  # holds 2 blocks, then a third for its 9th token: 3 free
        scheduler.add_request(make_request("long", 20))  # 5 blocks in all
        return dict(step(scheduler, fake)[0].num_scheduled_tokens)
    assert admitted() == {"held": 1}
    assert admitted(reserve_full_sequence=False) == {"held": 1, "long": 7}


def test_max_tokens_none_is_what_the_context_leaves():  # J1, vLLM's max_tokens=None
    scheduler = make_scheduler(max_model_len=64)
    request = make_request("a", 40, max_tokens=None, ignore_eos=True)
    final = run_to_completion(scheduler, [request])
    assert request.sampling_params.max_tokens == 24
    assert len(final["a"].new_token_ids) == 24 and final["a"].finish_reason == "length"
    with pytest.raises(RequestRejected, match="max_model_len"):
        scheduler.add_request(make_request("b", 64, max_tokens=None))
    assert "b" not in scheduler.requests
