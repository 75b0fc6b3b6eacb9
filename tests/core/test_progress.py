"""The scheduler never livelocks, whatever the flags (issue 12, item 3; P3).

Adversarial pools: room for one max-length request plus one block, and arrivals far beyond
capacity. Progress is a request sampling a token or finishing; in every window of
``WINDOW`` steps some request makes progress, until every request has finished.
"""

from __future__ import annotations

import zlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.core import (
    CacheConfig,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    check_empty,
    check_invariants,
)
from tests.conftest import FakeExecutor

MAX_MODEL_LEN = 64
BLOCK_SIZE = 4
BUDGET = 16
# A request alone computes its whole sequence in ceil(64 / 16) = 4 steps and samples in the
# last; the first running request is never made to wait (P3), so a window of a few such
# spans always holds a sampled token.
WINDOW = 4 * (MAX_MODEL_LEN // BUDGET)


class Prices:
    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * 1e-3

    def swap_seconds(self, num_blocks: int) -> float:
        return 0.002 + num_blocks * 1e-3


def token_fn(request_id: str, position: int) -> int:
    return 100 + zlib.crc32(f"{request_id}@{position}".encode()) % 5000


@st.composite
def flags(draw: st.DrawFn) -> dict:
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    urgent = policy == "priority" and draw(st.booleans())
    return dict(
        max_num_seqs=draw(st.sampled_from([2, 4, 16])),
        max_num_batched_tokens=BUDGET,
        max_model_len=MAX_MODEL_LEN,
        scheduling_policy=policy,
        victim_policy=draw(st.sampled_from(["vllm", "sglang", "least-computed"])),
        admission_policy=draw(st.sampled_from(["optimistic", "reserve", "adaptive"])),
        reserve_full_sequence=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(["recompute", "swap", "auto"])),
        enable_priority_preemption=urgent,
        priority_preemption_threshold=draw(st.sampled_from([0, 10])),
        max_preemptions_per_request=draw(st.sampled_from([None, 1, 2])),
    )


@st.composite
def arrivals(draw: st.DrawFn) -> list[tuple[int, Request]]:
    """20-40 requests in the first 5 steps, each up to the model length; some share a
    prefix with others (one of two families), so prefix hits meet preemption."""
    out = []
    for i in range(draw(st.integers(20, 40))):
        prompt_len = draw(st.integers(1, MAX_MODEL_LEN - 2))
        max_tokens = draw(st.integers(1, MAX_MODEL_LEN - 1 - prompt_len))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                priority=draw(st.integers(0, 30)))
        family = draw(st.sampled_from([None, 0, 1]))
        shared = 0 if family is None else draw(st.integers(1, prompt_len))
        prompt = ([token_fn(f"family{family}", j) for j in range(shared)]
                  + [token_fn(f"p{i}", j) for j in range(shared, prompt_len)])
        out.append((draw(st.integers(0, 4)), Request(f"r{i}", prompt, params)))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=flags(), requests=arrivals(), caching=st.booleans(),
       num_host_blocks=st.sampled_from([1, 8, 64]))
def test_some_request_progresses_in_every_window(config, requests, caching, num_host_blocks):
    num_blocks = MAX_MODEL_LEN // BLOCK_SIZE + 1  # one max-length request's worth, plus one
    scheduler = Scheduler(SchedulerConfig(**config),
                          CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                      enable_prefix_caching=caching,
                                      num_host_blocks=num_host_blocks),
                          preemption_prices=Prices())
    executor = FakeExecutor(token_fn, BLOCK_SIZE)
    last_progress = 0
    num_finished = 0
    step = 0
    while num_finished < len(requests):
        for arrival, request in requests:
            if arrival == step:
                scheduler.add_request(request)
        out = scheduler.schedule(float(step))
        for output in scheduler.update(out, executor.execute(out), float(step)):
            if output.new_token_ids or output.finished:
                last_progress = step
            num_finished += output.finished
        check_invariants(scheduler)
        assert step - last_progress <= WINDOW, (
            f"no request progressed in steps {last_progress + 1}..{step}: "
            f"{scheduler.stats()}")
        step += 1
    check_empty(scheduler)
