"""A decode step's layers in one C++ call (csrc/decode_stack.cpp, llama.build_decode_stack):
the same bits as the modules' loop, and only for the steps whose every kernel it runs."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.model import paged_kernel
from kvserve.model.attention import paged_attention, torch_paged_attention
from kvserve.model.input_batch import SequenceSlice, build_batch
from kvserve.model.kernel_info import PROJECTIONS_ENV, onednn_runs_bf16
from kvserve.model.kv_cache import allocate_kv_cache
from kvserve.model.llama import LlamaForCausalLM, projection_kernel

from .reference import TINY, random_weights
from .test_layers import dpbf16_built, spy_layer_ops

BLOCK = 16
NUM_BLOCKS = 600
STACK_ENV = "KVSERVE_DECODE_STACK"

pytestmark = pytest.mark.skipif(not dpbf16_built(),
                                reason="the stack runs the AVX512-BF16 pair panels")


def projections(choice: str) -> str:
    """The kernel ``choice`` gives here, skipping where it is not the one the test wants."""
    wanted = {"hybrid": "hybrid-dpbf16", "amx": "hybrid-amx", "panels": "panels-dpbf16"}
    try:
        kernel = projection_kernel(torch.bfloat16)
    except ValueError:
        kernel = ""
    if kernel != wanted[choice] or (choice != "panels" and not onednn_runs_bf16()):
        pytest.skip(f"{PROJECTIONS_ENV}={choice} does not give {wanted[choice]} here")
    if choice == "amx" and not paged_kernel.panel_amx_runs():
        pytest.skip("the AMX tiles do not run here")
    return kernel


def tiny_model(dtype: torch.dtype = torch.bfloat16, **options) -> LlamaForCausalLM:
    weights = {name: w.to(dtype) for name, w in random_weights(TINY, seed=3).items()}
    return LlamaForCausalLM.from_weights(TINY, weights, **options)


def filled_caches(dtype: torch.dtype = torch.bfloat16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Caches holding random keys and values, so attention reads real contexts."""
    caches = allocate_kv_cache(TINY, NUM_BLOCKS, BLOCK, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(11)
    for k_cache, v_cache in caches:
        k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
        v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    return caches


def copy_of(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def decode_batch(rows: int, prefill: int = 0, seed: int = 0):
    """``rows`` decodes of contexts 1 to ~90 tokens on their own blocks, then a prefill chunk
    of ``prefill`` tokens if asked."""
    rng = random.Random(seed)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)

    def take(tokens: int) -> list[int]:
        return [free.pop() for _ in range(-(-tokens // BLOCK))]

    decodes = []
    for _ in range(rows):
        computed = rng.randint(0, 90)
        decodes.append(SequenceSlice([rng.randrange(TINY.vocab_size)], computed,
                                     take(computed + 1), True))
    prefills = [SequenceSlice([rng.randrange(TINY.vocab_size) for _ in range(prefill)], 0,
                              take(prefill), True)] if prefill else []
    return build_batch(decodes, prefills, BLOCK)


@pytest.mark.parametrize("choice", ["amx", "hybrid", "panels"])
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
def test_a_decode_step_through_the_stack_is_the_modules_bit_for_bit(monkeypatch, choice, rows):
    monkeypatch.setenv(PROJECTIONS_ENV, choice)
    projections(choice)
    model, batch = tiny_model(), decode_batch(rows, seed=rows)
    stacked = filled_caches()
    looped = copy_of(stacked)
    with torch.inference_mode():
        out = model(batch, stacked)
        assert model._stack is not None and model._stack.num_layers == TINY.num_layers
        monkeypatch.setenv(STACK_ENV, "0")  # rebuilt for the other caches: off
        expected = model(batch, looped)
        assert model._stack is None
    assert torch.equal(out, expected)
    for (k, v), (k_expected, v_expected) in zip(stacked, looped, strict=True):
        assert torch.equal(k, k_expected) and torch.equal(v, v_expected)  # this step's K/V


def layer_calls(model, batch, caches, attention=paged_attention) -> list[str]:
    """The layer ops a forward asks paged_kernel.layer_ops() for, after a first forward
    (which builds the stack where it runs)."""
    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        model(batch, caches, attention)
        called = spy_layer_ops(patch)
        model(batch, caches, attention)
    return called


def test_the_stack_runs_decode_only_steps_and_the_modules_the_rest(monkeypatch):
    """Through the stack a forward asks for nothing but the final norm; a step with a
    prefill chunk, or the torch attention, runs the modules."""
    monkeypatch.setenv(PROJECTIONS_ENV, "hybrid")
    projections("hybrid")
    model, caches = tiny_model(), filled_caches()
    assert layer_calls(model, decode_batch(8), caches) == ["add_rms_norm_"]
    mixed = layer_calls(model, decode_batch(8, prefill=20), caches)
    assert mixed.count("rope_and_write_kv") == TINY.num_layers
    called = layer_calls(model, decode_batch(8), caches, torch_paged_attention)
    assert called.count("rope_and_write_kv") == TINY.num_layers


def test_a_step_with_more_rows_than_the_panels_take_runs_the_modules(monkeypatch):
    """hybrid-*: above a projection's panel_rows oneDNN runs it, so the stack does not."""
    monkeypatch.setenv(PROJECTIONS_ENV, "hybrid")
    projections("hybrid")
    model, caches = tiny_model(), filled_caches()
    limit = model.layers[0].mlp.down_proj.panel_rows
    with torch.inference_mode():
        model(decode_batch(limit), caches)
        assert model._stack is not None and model._stack_rows == limit
    called = layer_calls(model, decode_batch(limit + 1), caches)
    assert called.count("add_rms_norm_") == 2 * TINY.num_layers


@pytest.mark.parametrize("options", [{"dtype": torch.float32}, {"batch_invariant": True},
                                     {"quantization": "int8"}, {"env": "0"}])
def test_the_stack_is_not_built_for_what_it_does_not_run(monkeypatch, options):
    """float32, --batch-invariant, int8 and KVSERVE_DECODE_STACK=0 keep the modules."""
    monkeypatch.setenv(PROJECTIONS_ENV, "hybrid")
    projections("hybrid")
    if "env" in options:
        monkeypatch.setenv(STACK_ENV, options.pop("env"))
    dtype = options.pop("dtype", torch.bfloat16)
    if dtype == torch.float32:
        monkeypatch.setenv(PROJECTIONS_ENV, "auto")  # hybrid is bf16's only
    model = tiny_model(dtype, **options)
    with torch.inference_mode():
        model(decode_batch(4), filled_caches(dtype))
    assert model._stack is None and model._stack_key is not None


def test_the_stack_refuses_lists_that_do_not_match_per_layer():
    ops = paged_kernel.layer_ops()
    cos = sin = torch.zeros(8, 8)
    cache = torch.zeros(2, BLOCK, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="per layer 2 norms, 4 panels"):
        ops.DecodeStack([cos], [], [], [], [cache, cache], cos, sin, 1e-5, 4, 2, 0.25)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_an_engine_generates_the_same_tokens_and_logprobs_with_the_stack_on_or_off(
        monkeypatch, preemption_mode):
    """End to end through LLM: greedy and seeded requests in a pool tight enough to preempt
    (recompute, or swap to host blocks and back), the stack on (default) and off."""
    from kvserve.core import SamplingParams
    from kvserve.engine.llm import LLM

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))] for _ in range(12)]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True,
                             logprobs=2)] * 6
    settings = dict(dtype="bfloat16", num_kv_blocks=24, max_num_seqs=8,
                    preemption_mode=preemption_mode,
                    num_host_blocks=48 if preemption_mode == "swap" else 0)
    runs = {}
    for stack in ("1", "0"):
        monkeypatch.setenv(STACK_ENV, stack)
        llm = LLM(TINY, **settings)
        results = llm.generate(prompts, params, use_tqdm=False)
        model = llm.engine.executor.model
        assert (model._stack is not None) == (stack == "1")
        runs[stack] = ([(r.token_ids, r.logprobs) for r in results],
                       llm.engine.scheduler.num_preemptions)
    assert runs["1"] == runs["0"]
    assert runs["1"][1] > 0  # the pool was tight enough to preempt
