"""Issue 12: a request swapped to the host KV tier and back produces exactly the tokens it
produces unpreempted, and recomputes nothing (contract: a swapped request's resume leaves
``num_recomputed_tokens`` unchanged; docs/preemption.md)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvserve.core import CacheConfig, SamplingParams, Scheduler, SchedulerConfig, check_empty
from kvserve.engine.engine import Engine
from kvserve.engine.llm import build_engine
from kvserve.engine.preemption_prices import MeasuredPreemptionPrices
from kvserve.model.kv_cache import allocate_kv_cache
from kvserve.model.kv_swap import HostKVCache
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.runner import ModelRunner
from tests.model.reference import TINY, random_weights

WEIGHTS = random_weights(TINY, seed=0)
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in
           enumerate((5, 17, 33, 64, 40, 3))]
MAX_TOKENS = 12


@dataclass
class Run:
    tokens: list[list[int]]
    metrics: dict[str, object]
    engine: Engine


def make_engine(network, dtype, num_blocks, num_host_blocks=0, mode="recompute",
                prices=None) -> Engine:
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=512, max_num_seqs=16, preemption_mode=mode),
        CacheConfig(num_blocks=num_blocks, block_size=4, num_host_blocks=num_host_blocks),
        preemption_prices=prices)
    caches = allocate_kv_cache(TINY, num_blocks, 4, dtype)
    host = HostKVCache(caches, num_host_blocks) if num_host_blocks else None
    return Engine(scheduler, ModelRunner(network, caches, 4, host_kv_cache=host), None)


def generate(engine: Engine) -> Run:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    metrics = {}
    while engine.has_unfinished_requests():
        for chunk in engine.step().chunks:
            tokens[chunk.request_id] += chunk.new_token_ids
            if chunk.finished:
                metrics[chunk.request_id] = chunk.metrics
    check_empty(engine.scheduler)
    return Run([tokens[str(i)] for i in range(len(PROMPTS))], metrics, engine)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def setup(request):
    dtype = request.param
    weights = {k: v.to(dtype) for k, v in WEIGHTS.items()}
    network = LlamaForCausalLM.from_weights(TINY, weights)
    unpreempted = generate(make_engine(network, dtype, num_blocks=200))
    assert unpreempted.engine.scheduler.num_preemptions == 0
    return network, dtype, unpreempted.tokens


def test_swapped_requests_answer_exactly_and_recompute_nothing(setup):
    network, dtype, expected = setup
    # 20 blocks of 4 tokens hold 80 of the ~220 tokens the six requests need at once.
    run = generate(make_engine(network, dtype, num_blocks=20, num_host_blocks=64,
                               mode="swap"))
    stats = run.engine.scheduler.stats()
    assert run.tokens == expected
    swapped = [m for m in run.metrics.values() if m.num_swaps]
    assert swapped and stats.num_preemptions_by_mode["swap"] == stats.num_preemptions > 0
    assert all(m.num_recomputed_tokens == 0 for m in swapped)
    assert stats.num_recomputed_tokens == 0
    assert stats.num_swapped_out_blocks == stats.num_swapped_in_blocks > 0
    host = run.engine.executor.host_kv_cache
    assert (host.num_swapped_out, host.num_swapped_in) == \
        (stats.num_swapped_out_blocks, stats.num_swapped_in_blocks)
    assert stats.num_free_host_blocks == stats.num_host_blocks == 64


def test_a_full_host_tier_falls_back_to_recompute_with_the_same_answers(setup):
    network, dtype, expected = setup
    run = generate(make_engine(network, dtype, num_blocks=20, num_host_blocks=4,
                               mode="swap"))
    by_mode = run.engine.scheduler.stats().num_preemptions_by_mode
    assert run.tokens == expected or dtype == torch.bfloat16  # bf16 recompute may differ
    assert by_mode["recompute"] > 0


@pytest.mark.parametrize(("prices", "mode"), [
    # A copy that costs nothing: auto swaps every victim.
    (MeasuredPreemptionPrices(1e30, 1, 1e-3, 0.0), "swap"),
    # A copy far dearer than any recompute: auto recomputes every victim.
    (MeasuredPreemptionPrices(1.0, 10**9, 1e-9, 0.0), "recompute"),
])
def test_auto_follows_the_engine_prices(setup, prices, mode):
    network, dtype, expected = setup
    if dtype == torch.bfloat16 and mode == "recompute":
        pytest.skip("bf16 recompute is not bit-exact with decode")
    run = generate(make_engine(network, dtype, num_blocks=20, num_host_blocks=64,
                               mode="auto", prices=prices))
    stats = run.engine.scheduler.stats()
    assert run.tokens == expected
    assert stats.num_preemptions_by_mode[mode] == stats.num_preemptions > 0


def test_build_engine_sizes_the_host_tier_and_measures_prices_for_auto():
    # 3 layers x 2 (K, V) x 4 tokens x 2 heads x 16 x 4 B = 3,072 B per block: 30,720 B
    # of swap space hold 10 blocks.
    engine = build_engine(TINY, block_size=4, num_kv_blocks=32, swap_space=30_720,
                          preemption_mode="auto", max_model_len=128)
    assert engine.scheduler.cache_config.num_host_blocks == 10
    assert engine.executor.host_kv_cache.num_blocks == 10
    prices = engine.scheduler._preemption_mode.prices
    assert prices.bytes_per_block == 3072
    assert prices.copy_bytes_per_s > 0 and prices.prefill_seconds_per_token > 0
    assert prices.swap_seconds(10) == pytest.approx(30_720 / prices.copy_bytes_per_s)
    with pytest.raises(ValueError, match="swap space of 100 bytes holds no block"):
        build_engine(TINY, block_size=4, num_kv_blocks=32, swap_space=100,
                     preemption_mode="swap")


@pytest.mark.parametrize("host", [{"swap_space": 30_720}, {"num_host_blocks": 10}])
def test_recompute_allocates_no_host_tier_and_says_so(host, caplog):
    """Only a swapping preemption uses the host tier (sessions and the prefix cache keep
    their blocks on the device): under recompute, the default, --swap-space held host RAM
    for nothing (QA: RSS 4 GB against 1.9 with --swap-space 2). vLLM V1 ignores it."""
    import logging

    with caplog.at_level(logging.INFO, logger="kvserve"):
        engine = build_engine(TINY, block_size=4, num_kv_blocks=32, max_model_len=128,
                              **host)
    assert engine.scheduler.cache_config.num_host_blocks == 0
    assert engine.executor.host_kv_cache is None
    assert engine.info.num_host_blocks == 0
    assert [r.getMessage() for r in caplog.records if "swap" in r.getMessage()] == [
        "--swap-space is unused under --preemption-mode recompute, which never swaps (vLLM "
        "V1 ignores it too): no host KV tier allocated"]
