"""Issue 4: the paged, batched engine equals a dense reference, whatever the scheduling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvserve.core import CacheConfig, SamplingParams, Scheduler, SchedulerConfig, check_empty
from kvserve.engine.engine import Engine
from kvserve.model import llama, paged_kernel
from kvserve.model.attention import reference_attention, torch_paged_attention
from kvserve.model.kernel_info import PROJECTIONS_ENV, cpu_info
from kvserve.model.kv_cache import allocate_kv_cache
from kvserve.model.llama import Linear, LlamaForCausalLM
from kvserve.model.runner import ModelRunner
from tests.model.reference import TINY, dense_greedy, dense_logits, random_weights

WEIGHTS = random_weights(TINY, seed=0)
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in
           enumerate((5, 17, 33, 64, 40, 3))]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def network() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_weights(TINY, dict(WEIGHTS))


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [dense_greedy(WEIGHTS, TINY, p, MAX_TOKENS) for p in PROMPTS]


def make_engine(network, num_blocks=200, block_size=16, caching=True, attention=None,
                **config) -> Engine:
    config.setdefault("max_model_len", 512)
    config.setdefault("max_num_seqs", min(256, config.get("max_num_batched_tokens", 2048)))
    scheduler = Scheduler(SchedulerConfig(**config),
                          CacheConfig(num_blocks=num_blocks, block_size=block_size,
                                      enable_prefix_caching=caching))
    kwargs = {} if attention is None else {"attention": attention}
    runner = ModelRunner(network, allocate_kv_cache(TINY, num_blocks, block_size,
                                                    torch.float32), block_size, **kwargs)
    return Engine(scheduler, runner, None)


def generate(engine: Engine, prompts=PROMPTS, stagger=False) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:  # staggered: one arrival per step, so batches mix prefill and decode
            for i, prompt in (pending[:1] if stagger else pending):
                engine.add_request(str(i), prompt, params)
            pending = pending[1:] if stagger else []
        for chunk in engine.step().chunks:
            tokens[chunk.request_id] += chunk.new_token_ids
    check_empty(engine.scheduler)
    return [tokens[str(i)] for i in range(len(prompts))]


def test_one_request_at_a_time_matches_dense(network, expected):
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert generate(make_engine(network), [prompt]) == [want]


@pytest.mark.parametrize("chunk", [16, 64, 2048])
@pytest.mark.parametrize("caching", [True, False])
def test_batched_chunked_prefill_matches_dense(network, expected, chunk, caching):
    engine = make_engine(network, caching=caching, max_num_batched_tokens=chunk,
                         max_num_seqs=16)
    assert generate(engine, stagger=True) == expected


def test_prefix_cache_hits_do_not_change_outputs(network):
    shared = PROMPTS[3][:48]  # three full blocks
    prompts = [[*shared, 11, 12, 13], [*shared, 21, 22], [*shared, 31]]
    want = [dense_greedy(WEIGHTS, TINY, p, MAX_TOKENS) for p in prompts]
    engine = make_engine(network)
    assert generate(engine, prompts, stagger=True) == want
    assert engine.scheduler.stats().prefix_cache_hits >= 2 * 48


def test_forced_preemption_is_invisible(network, expected):
    engine = make_engine(network, num_blocks=20, block_size=4)
    assert generate(engine) == expected
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("attention", [reference_attention, torch_paged_attention])
def test_every_attention_path_agrees(network, expected, attention):
    engine = make_engine(network, attention=attention, max_num_batched_tokens=64,
                         max_num_seqs=16)
    assert generate(engine, stagger=True) == expected


def test_paged_logits_match_the_dense_forward(network):
    engine = make_engine(network, max_num_batched_tokens=32)
    prompt = PROMPTS[3]
    engine.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                   logprobs=5, ignore_eos=True))
    logprobs = None
    while engine.has_unfinished_requests():
        for chunk in engine.step().chunks:
            logprobs = chunk.logprobs
    reference = torch.log_softmax(dense_logits(WEIGHTS, TINY, prompt)[-1], dim=-1)
    assert logprobs is not None
    for token_id, value in logprobs[0].items():
        assert value == pytest.approx(float(reference[token_id]), abs=1e-4)


def test_the_default_attention_uses_the_kernel_here():
    # The project's machines have a compiler and ninja: a broken kernel build must fail CI
    # rather than fall back silently to the torch path.
    assert paged_kernel.available(), paged_kernel.unavailable_reason()


PACKABLE = [torch.bfloat16, torch.float32]  # oneDNN's float32 GEMM runs on any x86 CPU


@pytest.mark.parametrize("dtype", PACKABLE)
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("kernel", ["panels-avx2", "panels-dpbf16", "onednn"])
def test_packed_projections_generate_what_plain_ones_do(monkeypatch, tied, dtype, kernel):
    """Projections run through packed copies (the panel GEMMs' panels or oneDNN's layout,
    KVSERVE_PROJECTIONS picking), whose plain weights are then released (except a tied LM
    head, which is the embedding table, and a bf16 head, kept to break rounding ties): greedy
    tokens must be those of the same network left unpacked."""
    monkeypatch.setenv(PROJECTIONS_ENV, "panels" if kernel == "panels-dpbf16" else kernel)
    try:
        if llama.projection_kernel(dtype) != kernel:
            pytest.skip(f"{kernel} does not run {dtype} here")
    except ValueError as error:
        pytest.skip(str(error))
    config = replace(TINY, tie_word_embeddings=tied)
    weights = {k: v.to(dtype) for k, v in random_weights(config, seed=1).items()}
    if not tied:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].flip(0).clone()

    def run(network: LlamaForCausalLM) -> list[list[int]]:
        scheduler = Scheduler(SchedulerConfig(max_model_len=512, max_num_batched_tokens=64,
                                              max_num_seqs=16),
                              CacheConfig(num_blocks=200, block_size=16))
        runner = ModelRunner(network, allocate_kv_cache(config, 200, 16, dtype), 16)
        return generate(Engine(scheduler, runner, None), stagger=True)

    monkeypatch.setattr(llama, "can_pack_weights", lambda dtype: True)
    packed = LlamaForCausalLM.from_weights(config, dict(weights))
    projections = [m for m in packed.modules() if isinstance(m, Linear)]
    copy = {"panels-avx2": "panels", "panels-dpbf16": "pair_panels", "onednn": "packed"}[kernel]
    assert all(getattr(m, copy) is not None for m in projections)
    released = [m for m in projections if m.weight.is_meta]
    head_kept = tied or dtype == torch.bfloat16
    assert len(released) == len(projections) - head_kept
    assert packed.lm_head.weight.is_meta != head_kept
    assert packed.embed_tokens.weight.device.type == "cpu"
    monkeypatch.setattr(llama, "can_pack_weights", lambda dtype: False)
    plain = LlamaForCausalLM.from_weights(config, dict(weights))
    assert all(m.packed is None and m.panels is None and m.pair_panels is None
               for m in plain.modules() if isinstance(m, Linear))
    if dtype == torch.bfloat16 and kernel != "onednn" and "amx_bf16" in cpu_info().flags:
        # The plain network's bf16 matmuls are torch's, summed on AMX tiles here in another
        # order than the panels': a bf16 ulp flipped sends this random net's greedy path
        # elsewhere. The first token's logprobs must agree within bf16 rounding instead.
        first, reference = first_logprobs(packed, config), first_logprobs(plain, config)
        assert len(first) == len(PROMPTS)
        assert [list(d) for d in first] == [list(d) for d in reference]
        for got, want in zip(first, reference, strict=True):
            assert list(got.values()) == pytest.approx(list(want.values()), abs=0.05)
        return
    assert run(packed) == run(plain)


def first_logprobs(network: LlamaForCausalLM, config) -> list[dict[int, float]]:
    """Each prompt's first token's top-5 logprobs, a request at a time."""
    results = []
    for prompt in PROMPTS:
        scheduler = Scheduler(SchedulerConfig(max_model_len=512), CacheConfig(200, 16))
        runner = ModelRunner(network, allocate_kv_cache(config, 200, 16, torch.bfloat16), 16)
        engine = Engine(scheduler, runner, None)
        engine.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                       logprobs=5, ignore_eos=True))
        while engine.has_unfinished_requests():
            for chunk in engine.step().chunks:
                if chunk.logprobs:
                    results.append(chunk.logprobs[0])
    return results


@pytest.mark.parametrize(("chunk", "num_blocks", "block_size"), [(2048, 200, 16),
                                                                  (16, 200, 16), (64, 36, 4)])
def test_prompt_logprobs_match_the_dense_forward(network, chunk, num_blocks, block_size,
                                                  monkeypatch):
    """vLLM's prompt_logprobs (G8): every prompt token after the first, its logprob from the
    raw logits, its rank and the top k, whole on the first chunk; computed in chunks, past a
    cached prefix (never a hit) and through preemptions (the small pool) alike, the head
    run over a few rows at a time."""
    from kvserve.model import runner

    monkeypatch.setattr(runner, "PROMPT_ROWS_AT_ONCE", 7)
    engine = make_engine(network, num_blocks=num_blocks, block_size=block_size,
                         max_num_batched_tokens=chunk, max_num_seqs=4)
    prompt = PROMPTS[3]
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("warm", prompt, plain)  # the prompt's blocks in the cache
    while engine.has_unfinished_requests():
        engine.step()
    asked = replace(plain, prompt_logprobs=3)
    for name in ("a", "b"):  # b and a compete for the small pool
        engine.add_request(name, prompt, asked)
    firsts: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step().chunks:
            if out.prompt_logprobs is not None:
                assert out.new_token_ids and out.request_id not in firsts  # the first chunk
                firsts[out.request_id] = out.prompt_logprobs
    check_empty(engine.scheduler)
    stats = engine.scheduler.stats()
    assert stats.prefix_cache_hits == 0  # G8: the warm prefix is never hit
    reference = torch.log_softmax(dense_logits(WEIGHTS, TINY, prompt), dim=-1)
    for name in ("a", "b"):
        entries = firsts[name]
        assert len(entries) == len(prompt) and entries[0] is None
        for position, (entry, rank) in enumerate(entries[1:], 1):
            row, token = reference[position - 1], prompt[position]
            assert entry[token] == pytest.approx(float(row[token]), abs=1e-4)
            assert rank == int((row > row[token]).sum()) + 1
            top = row.topk(3).indices.tolist()
            assert set(top) <= set(entry) and len(entry) <= 4
    if block_size == 4:
        assert engine.scheduler.num_preemptions > 0


def test_plain_greedy_steps_take_the_models_greedy_tokens_and_others_the_logits(
        network, expected, monkeypatch):
    """A step whose sampling rows are all plain greedy (Sampler.plain_greedy) asks the model
    for its greedy tokens (no float32 logits); a step with a logprobs row samples from the
    logits as before. Both give the dense reference's tokens."""
    calls = []
    original = network.greedy_tokens
    monkeypatch.setattr(network, "greedy_tokens",
                        lambda hidden: calls.append(hidden.shape[0]) or original(hidden))
    assert generate(make_engine(network)) == expected
    assert calls and sum(calls) == len(PROMPTS) * MAX_TOKENS
    calls.clear()
    engine = make_engine(network)
    engine.add_request("0", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0,
                                                       ignore_eos=True, logprobs=2))
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        for chunk in engine.step().chunks:
            tokens += chunk.new_token_ids
            logprobs += chunk.logprobs or []
    assert calls == [] and tokens == expected[0][:3] and len(logprobs) == 3
