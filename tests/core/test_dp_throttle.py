"""Spec N: the data-parallel prefill throttle. The three places it acts: the running pass
skips prefill chunks, the waiting pass admits nothing, and prefill_capacity_bound turns it
off when it would only idle the rank."""

from kvserve.core import check_invariants
from tests.conftest import FakeExecutor, make_request, make_scheduler


def throttled_step(scheduler, executor, throttle: bool):
    out = scheduler.schedule(0.0, throttle=throttle)
    scheduler.update(out, executor.execute(out), 0.0)
    check_invariants(scheduler)
    return dict(out.num_scheduled_tokens)


def decoding_plus_chunked_prefill():
    """"d" decodes; "p" is mid-prefill (64 of 200 tokens); the queue is drained."""
    scheduler = make_scheduler(max_num_batched_tokens=80, long_prefill_token_threshold=64)
    executor = FakeExecutor(block_size=16)
    scheduler.add_request(make_request("d", 16, max_tokens=50))
    assert throttled_step(scheduler, executor, False) == {"d": 16}
    scheduler.add_request(make_request("p", 200, max_tokens=50))
    assert throttled_step(scheduler, executor, False) == {"d": 1, "p": 64}
    assert scheduler.prefill_capacity_bound is False  # N3: the queue was drained
    return scheduler, executor


def test_throttled_running_pass_skips_prefill_chunks_n1_n2() -> None:
    scheduler, executor = decoding_plus_chunked_prefill()
    assert throttled_step(scheduler, executor, True) == {"d": 1}
    assert scheduler.requests["p"].num_computed_tokens == 64  # waited, still running
    assert [r.request_id for r in scheduler.running] == ["d", "p"]
    assert throttled_step(scheduler, executor, False) == {"d": 1, "p": 64}


def test_throttled_waiting_pass_admits_nothing_n2() -> None:
    scheduler, executor = decoding_plus_chunked_prefill()
    scheduler.add_request(make_request("w", 8))
    assert throttled_step(scheduler, executor, True) == {"d": 1}
    assert [r.request_id for r in scheduler.waiting] == ["w"]
    assert scheduler.num_blocked_steps == {"prefill_throttle": 1}
    # a deferring step leaves the flag as it was (N3 updates only unthrottled steps)
    assert scheduler.prefill_capacity_bound is False
    # the next unthrottled step admits it in the 15 tokens left after "d" and "p"
    assert throttled_step(scheduler, executor, False) == {"d": 1, "p": 64, "w": 8}


def test_capacity_bound_rank_is_not_throttled_n1_n3() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32)
    executor = FakeExecutor(block_size=16)
    for name in ("a", "b", "c"):
        scheduler.add_request(make_request(name, 24, max_tokens=50))
    # 32 tokens: "a" 24 + "b" 8; "c" still waits at the end of the step -> capacity bound
    assert throttled_step(scheduler, executor, False) == {"a": 24, "b": 8}
    assert scheduler.prefill_capacity_bound is True
    # throttle asked, "a" decodes, but the rank is capacity-bound: the step runs in full
    assert throttled_step(scheduler, executor, True) == {"a": 1, "b": 16, "c": 15}
    assert scheduler.prefill_capacity_bound is False  # queue drained by that step
    # now the throttle applies: "c" (9 prompt tokens left) waits, decodes run
    assert throttled_step(scheduler, executor, True) == {"a": 1, "b": 1}


def test_throttle_without_any_decode_does_not_idle_the_rank_n1() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    executor = FakeExecutor(block_size=16)
    scheduler.add_request(make_request("p", 100))
    # nothing decodes: deferring would leave the step empty, so the prefill runs
    assert throttled_step(scheduler, executor, True) == {"p": 64}
    assert throttled_step(scheduler, executor, True) == {"p": 36}
    assert scheduler.num_blocked_steps == {}
