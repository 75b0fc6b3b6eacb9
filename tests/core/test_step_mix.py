"""Spec Q: prefill-first steps (step_mix="prefill-first", SGLang's default). While prefill work
is pending a step runs prefills only (Q1, Q2), bounded by max_prefill_only_steps in a row, and
a prefills-only step that finds nothing to run decodes instead (Q3)."""

import pytest

from kvserve.core import ConfigError, SchedulerConfig, check_invariants
from tests.conftest import FakeExecutor, make_request, make_scheduler


def step(scheduler, executor) -> dict[str, int]:
    out = scheduler.schedule(0.0)
    scheduler.update(out, executor.execute(out), 0.0)
    check_invariants(scheduler)
    return dict(out.num_scheduled_tokens)


def one_decoding(**config):
    """"d" has finished its prefill and decodes from the next step on."""
    scheduler = make_scheduler(step_mix="prefill-first", **config)
    executor = FakeExecutor(block_size=16)
    scheduler.add_request(make_request("d", 16, max_tokens=50))
    assert step(scheduler, executor) == {"d": 16}
    return scheduler, executor


def test_a_waiting_request_gets_a_step_of_its_own_q1_q2() -> None:
    scheduler, executor = one_decoding()
    scheduler.add_request(make_request("w", 40, max_tokens=50))
    assert step(scheduler, executor) == {"w": 40}  # "d" waits
    assert scheduler.requests["d"].num_computed_tokens == 16
    assert scheduler.num_prefill_only_steps == 1
    assert step(scheduler, executor) == {"d": 1, "w": 1}  # nothing pending: both decode
    assert scheduler.stats().num_prefill_only_steps == 1


def test_mixed_steps_are_the_default_q1() -> None:
    scheduler = make_scheduler()
    executor = FakeExecutor(block_size=16)
    scheduler.add_request(make_request("d", 16, max_tokens=50))
    step(scheduler, executor)
    scheduler.add_request(make_request("w", 40))
    assert step(scheduler, executor) == {"d": 1, "w": 40}
    assert scheduler.num_prefill_only_steps == 0


def test_a_chunked_prefill_keeps_its_steps_until_it_ends_q1() -> None:
    scheduler, executor = one_decoding(max_num_batched_tokens=64)
    scheduler.add_request(make_request("p", 150, max_tokens=50))
    # the whole budget goes to the prefill, chunk after chunk; "d" waits for its end
    assert step(scheduler, executor) == {"p": 64}
    assert step(scheduler, executor) == {"p": 64}
    assert step(scheduler, executor) == {"p": 22}
    assert step(scheduler, executor) == {"d": 1, "p": 1}
    assert scheduler.num_prefill_only_steps == 3


def test_the_bound_lets_the_decodes_run_after_k_steps_q1() -> None:
    scheduler, executor = one_decoding(max_num_batched_tokens=64, max_prefill_only_steps=2)
    scheduler.add_request(make_request("p", 200, max_tokens=50))
    assert step(scheduler, executor) == {"p": 64}
    assert step(scheduler, executor) == {"p": 64}
    assert scheduler.num_prefill_only_in_a_row == 2
    # the bound: this step is mixed, "d" first, "p" in what is left
    assert step(scheduler, executor) == {"d": 1, "p": 63}
    assert scheduler.num_prefill_only_in_a_row == 0
    assert step(scheduler, executor) == {"p": 9}  # a new row begins
    assert scheduler.num_prefill_only_steps == 3


def test_a_queue_that_cannot_start_does_not_stall_the_decodes_q3() -> None:
    scheduler, executor = one_decoding(max_num_seqs=1, max_num_batched_tokens=64)
    scheduler.add_request(make_request("w", 8))
    # no seat for "w": the prefills-only step would be empty, so it decodes "d"
    for _ in range(3):
        assert step(scheduler, executor) == {"d": 1}
    assert [r.request_id for r in scheduler.waiting] == ["w"]
    assert scheduler.num_prefill_only_steps == 0
    assert scheduler.num_blocked_steps["max_num_seqs"] == 3


def test_a_head_not_ready_does_not_stall_the_decodes_q3() -> None:
    scheduler, executor = one_decoding()
    scheduler.add_request(make_request("w", 8))
    scheduler.set_not_ready("w", "grammar")
    assert step(scheduler, executor) == {"d": 1}
    scheduler.set_not_ready("w", None)
    assert step(scheduler, executor) == {"w": 8}


def test_a_throttled_step_still_defers_prefills_n1_q1() -> None:
    scheduler, executor = one_decoding(max_num_batched_tokens=80,
                                       long_prefill_token_threshold=64)
    scheduler.add_request(make_request("p", 200, max_tokens=50))
    assert step(scheduler, executor) == {"p": 64}
    assert scheduler.prefill_capacity_bound is False
    out = scheduler.schedule(0.0, throttle=True)  # N1 wins over Q1: decodes only
    assert dict(out.num_scheduled_tokens) == {"d": 1}
    scheduler.update(out, executor.execute(out), 0.0)
    assert scheduler.num_prefill_only_in_a_row == 0


@pytest.mark.parametrize("settings, message", [
    ({"step_mix": "decode-first"}, "step_mix='decode-first' is not one of mixed, prefill-first"),
    ({"step_mix": "prefill-first", "max_prefill_only_steps": -1},
     "max_prefill_only_steps=-1 is out of range"),
    ({"max_prefill_only_steps": 2}, "needs step_mix='prefill-first', not 'mixed'"),
])
def test_bad_settings_are_refused_q1(settings, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SchedulerConfig(**settings)
