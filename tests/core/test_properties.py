"""Property-based tests: random workloads against every policy (issue 2, "Show it") and
every preemption mode (issue 12) and step mix (spec Q).

A fake executor whose token at each position is a fixed function of the request and the
position drives the scheduler; it writes and reads KV through the block tables and runs the
swap copies, so a wrong block id or copy fails it. After every step the invariants hold in
both KV tiers; every request finishes; and each request's tokens are the same in a tiny pool
(preemptions, swaps) as in a huge one.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

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
from kvserve.core.config import AGING_POLICIES, SCHEDULING_POLICIES
from tests.conftest import EOS, FakeExecutor

MAX_MODEL_LEN = 256
MAX_STEPS = 5_000


def token_fn(request_id: str, position: int) -> int:
    """EOS now and then, so stop checks are exercised too."""
    value = zlib.crc32(f"{request_id}@{position}".encode())
    return EOS if value % 17 == 0 else 100 + value % 5000


@dataclass(frozen=True)
class Spec:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    priority: int
    arrival_step: int
    abort_step: int | None

    def make(self) -> Request:
        params = SamplingParams(max_tokens=self.max_tokens, min_tokens=self.min_tokens,
                                ignore_eos=self.ignore_eos, eos_token_id=EOS,
                                priority=self.priority)
        return Request(self.request_id, list(self.prompt), params,
                       arrival_time=float(self.arrival_step))


@st.composite
def workloads(draw: st.DrawFn) -> list[Spec]:
    prefixes = [tuple(draw(st.lists(st.integers(3, 60), min_size=0, max_size=40)))
                for _ in range(3)]
    specs = []
    for i in range(draw(st.integers(1, 12))):
        prefix = prefixes[draw(st.integers(0, 2))]
        suffix = tuple(draw(st.lists(st.integers(3, 60), min_size=1, max_size=50)))
        max_tokens = draw(st.integers(1, 30))
        specs.append(Spec(
            request_id=f"r{i}",
            prompt=prefix + suffix,
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens)),
            ignore_eos=draw(st.booleans()),
            priority=draw(st.integers(-2, 2)),
            arrival_step=draw(st.integers(0, 20)),
            abort_step=draw(st.none() | st.integers(0, 60)),
        ))
    return specs


class Prices:
    """Prices that make ``auto`` choose both ways: swap wins for long cold victims."""

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * 1e-3

    def swap_seconds(self, num_blocks: int) -> float:
        return 0.002 + num_blocks * 1e-3


@st.composite
def preemption(draw: st.DrawFn, policy: str) -> dict:
    """The preemption flags of issue 12: mode, urgent arrivals, the progress guard."""
    urgent = policy == "priority" and draw(st.booleans())
    return dict(
        preemption_mode=draw(st.sampled_from(["recompute", "swap", "auto"])),
        enable_priority_preemption=urgent,
        priority_preemption_threshold=draw(st.sampled_from([0, 1, 10])) if urgent else 10,
        max_preemptions_per_request=draw(st.sampled_from([None, 1, 3])),
    )


@st.composite
def configs(draw: st.DrawFn) -> dict:
    chunked = draw(st.booleans())
    budget = draw(st.sampled_from([16, 64, 256])) if chunked else MAX_MODEL_LEN
    policy = draw(st.sampled_from(SCHEDULING_POLICIES))  # a new order is fuzzed too
    preempting = draw(preemption(policy))
    aging = policy in AGING_POLICIES and not preempting["enable_priority_preemption"] and \
        draw(st.booleans())
    step_mix = draw(st.sampled_from(["mixed", "mixed", "prefill-first"]))  # Q1
    return dict(
        max_num_seqs=draw(st.integers(1, min(budget, 16))),
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 8, 40])) if chunked else 0,
        scheduling_policy=policy,
        watermark=draw(st.sampled_from([0.0, 0.05, 0.2])),
        reserve_full_sequence=draw(st.booleans()),
        victim_policy=draw(st.sampled_from(["vllm", "sglang", "least-computed"])),
        admission_policy=draw(st.sampled_from(["optimistic", "reserve", "adaptive"])),
        lpm_max_queue=draw(st.sampled_from([0, 2, 128])),  # C6: sorted or FCFS passes
        schedule_aging_s=3.0 if aging else None,  # C7
        step_mix=step_mix,
        max_prefill_only_steps=draw(st.sampled_from([0, 1, 3]))
        if step_mix == "prefill-first" else 0,
        **preempting,
    )


def simulate(specs: list[Spec], config: dict, num_blocks: int, block_size: int,
             caching: bool, num_host_blocks: int = 0,
             ) -> tuple[Scheduler, dict[str, list[int]], dict[str, str]]:
    if config.get("preemption_mode", "recompute") != "recompute":
        num_host_blocks = max(num_host_blocks, 1)
    scheduler = Scheduler(SchedulerConfig(**config),
                          CacheConfig(num_blocks=num_blocks, block_size=block_size,
                                      enable_prefix_caching=caching,
                                      num_host_blocks=num_host_blocks),
                          preemption_prices=Prices())
    executor = FakeExecutor(token_fn, block_size)
    tokens: dict[str, list[int]] = {s.request_id: [] for s in specs}
    reasons: dict[str, str] = {}
    for now in range(MAX_STEPS):
        for spec in specs:
            if spec.arrival_step == now:
                scheduler.add_request(spec.make())
            if spec.abort_step == now and scheduler.abort(spec.request_id):
                reasons[spec.request_id] = "abort"
        out = scheduler.schedule(float(now))
        for output in scheduler.update(out, executor.execute(out), float(now)):
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                assert output.finish_reason is not None
                reasons[output.request_id] = output.finish_reason
        check_invariants(scheduler)
        if now > 20 and not scheduler.has_unfinished_requests():
            break
    else:
        raise AssertionError(f"unfinished after {MAX_STEPS} steps: {scheduler.stats()}")
    return scheduler, tokens, reasons


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=workloads(), config=configs(), block_size=st.sampled_from([2, 4, 16]),
       caching=st.booleans(), spare_blocks=st.integers(0, 4),
       num_host_blocks=st.sampled_from([0, 3, 12, 200]))
def test_random_workloads_keep_invariants_finish_and_match(specs, config, block_size,
                                                           caching, spare_blocks,
                                                           num_host_blocks):
    # the tiny pool still holds the longest request alone (prompt + max_tokens tokens)
    longest = max(len(s.prompt) + s.max_tokens for s in specs)
    tiny_blocks = -(-longest // block_size) + spare_blocks
    tiny, tiny_tokens, tiny_reasons = simulate(specs, config, tiny_blocks, block_size, caching,
                                               num_host_blocks)
    # the huge pool holds every request at full length at once, twice over, so no watermark
    # or reservation ever waits on it; no bigger, since the checks walk the whole pool
    huge_blocks = 2 * sum(-(-(len(s.prompt) + s.max_tokens) // block_size) for s in specs) + 64
    huge, huge_tokens, huge_reasons = simulate(specs, config, huge_blocks, block_size, caching,
                                               num_host_blocks)

    check_empty(tiny)
    check_empty(huge)
    # every request finished, one way or another, in both runs
    assert len(tiny_reasons) == len(huge_reasons) == len(specs)
    for spec in specs:
        if "abort" in (tiny_reasons[spec.request_id], huge_reasons[spec.request_id]):
            continue  # an abort cuts the output wherever the request happened to be
        assert tiny_tokens[spec.request_id] == huge_tokens[spec.request_id], spec.request_id
        assert tiny_reasons[spec.request_id] == huge_reasons[spec.request_id]
        assert len(tiny_tokens[spec.request_id]) <= spec.max_tokens
