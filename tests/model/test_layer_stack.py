"""A step's layers in one C++ call (csrc/layer_stack.cpp, llama.build_layer_stack): the
same bits as the modules' loop, and only for the steps whose every kernel it runs."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.model import paged_kernel
from kvserve.model.attention import (
    kernel_prefill_route,
    paged_attention,
    torch_paged_attention,
)
from kvserve.model.config import ModelConfig
from kvserve.model.input_batch import SequenceSlice, build_batch
from kvserve.model.kernel_info import (
    FLASH_PREFILL_ROWS,
    PREFILL_ATTENTION_ENV,
    PROJECTIONS_ENV,
    onednn_runs_bf16,
)
from kvserve.model.kv_cache import allocate_kv_cache
from kvserve.model.llama import LlamaForCausalLM, build_layer_stack, projection_kernel

from .reference import random_weights
from .test_layers import dpbf16_built, spy_layer_ops

# head_dim 64: the AMX tiles' prefill attention runs it (reference.TINY's 16 goes to flash)
TINY = ModelConfig(name="tiny64", vocab_size=512, hidden_size=128, intermediate_size=256,
                   num_layers=3, num_heads=2, num_kv_heads=1, head_dim=64,
                   max_position_embeddings=1024, rope_theta=10000.0, eos_token_id=None)
BLOCK = 16
NUM_BLOCKS = 600
STACK_ENV = "KVSERVE_LAYER_STACK"

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


def decode_batch(rows: int, prefills: tuple[tuple[int, int], ...] = (), seed: int = 0):
    """``rows`` decodes of contexts 1 to ~90 tokens on their own blocks, then a prefill chunk
    of ``tokens`` after ``computed`` tokens for each (computed, tokens) of ``prefills``."""
    rng = random.Random(seed)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)

    def take(tokens: int) -> list[int]:
        return [free.pop() for _ in range(-(-tokens // BLOCK))]

    def tokens(count: int) -> list[int]:
        return [rng.randrange(TINY.vocab_size) for _ in range(count)]

    decodes = []
    for _ in range(rows):
        computed = rng.randint(0, 90)
        decodes.append(SequenceSlice(tokens(1), computed, take(computed + 1), True))
    chunks = [SequenceSlice(tokens(count), computed, take(computed + count), True)
              for computed, count in prefills]
    return build_batch(decodes, chunks, BLOCK)


STEPS = {"1 decode": (1, ()), "5 decodes": (5, ()), "16 decodes": (16, ()),
         "33 decodes": (33, ()), "8 decodes and a 40-token prompt": (8, ((0, 40),)),
         "a 3-token chunk after 50": (0, ((50, 3),)),
         "6 decodes and two chunks": (6, ((0, 20), (33, 17)))}


@pytest.mark.parametrize("choice", ["amx", "hybrid", "panels"])
@pytest.mark.parametrize("step", list(STEPS))
def test_a_step_through_the_stack_is_the_modules_bit_for_bit(monkeypatch, choice, step):
    """Decodes, prefill chunks (on the AMX tiles where they run, else the C++ kernel; below
    FLASH_PREFILL_ROWS rows the kernel) or both: the same output and K/V as the modules."""
    monkeypatch.setenv(PROJECTIONS_ENV, choice)
    projections(choice)
    rows, prefills = STEPS[step]
    model, batch = tiny_model(), decode_batch(rows, prefills, seed=len(step))
    stacked = filled_caches()
    looped = copy_of(stacked)
    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        called = spy_layer_ops(patch)
        out = model(batch, stacked)
        assert model._stack is not None and model._stack.num_layers == TINY.num_layers
        if batch.num_tokens > model._stack_rows:  # hybrid-dpbf16 on an AMX build: 8 rows
            pytest.skip(f"{batch.num_tokens} rows are oneDNN's for {choice} here")
        assert [name for name in called if name != "LayerStack"] == ["add_rms_norm_"]
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


def test_the_stack_runs_steps_whose_kernels_it_calls_and_the_modules_the_rest(monkeypatch):
    """Through the stack a forward asks for nothing but the final norm, with prefill chunks
    too; the torch attention, or a chunk that torch's flash attention would take
    (KVSERVE_PREFILL_ATTENTION=flash, FLASH_PREFILL_ROWS rows or more), runs the modules."""
    monkeypatch.setenv(PROJECTIONS_ENV, "panels")  # the pair panels at any rows
    projections("panels")
    model, caches = tiny_model(), filled_caches()
    assert layer_calls(model, decode_batch(8), caches) == ["add_rms_norm_"]
    assert layer_calls(model, decode_batch(8, ((0, 20),)), caches) == ["add_rms_norm_"]
    called = layer_calls(model, decode_batch(8), caches, torch_paged_attention)
    assert called.count("rope_and_write_kv") == TINY.num_layers
    big = decode_batch(8, ((0, FLASH_PREFILL_ROWS),))
    assert kernel_prefill_route(big, torch.bfloat16, 64) in ("amx", "kernel")  # this CPU's
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "flash")
    small = decode_batch(8, ((0, FLASH_PREFILL_ROWS - 1),))
    assert layer_calls(model, small, caches) == ["add_rms_norm_"]  # the kernel's rows
    assert kernel_prefill_route(big, torch.bfloat16, 64) is None
    flash = layer_calls(model, big, caches)
    assert flash.count("rope_and_write_kv") == TINY.num_layers


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
    """float32, --batch-invariant, int8 and KVSERVE_LAYER_STACK=0 keep the modules."""
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


def test_a_step_whose_chunks_do_not_tile_its_rows_is_refused(monkeypatch):
    """LayerStack.run checks what the batch says: chunks after the decodes, one after the
    other, covering every row (a wrong batch is an error, never a silent partial step)."""
    monkeypatch.setenv(PROJECTIONS_ENV, "panels")
    projections("panels")
    model, caches = tiny_model(), filled_caches()
    stack, _ = build_layer_stack(model, caches)
    batch = decode_batch(2, ((0, 5),))
    x = model.embed_tokens(batch.input_ids)
    chunk = batch.prefills[0]

    def run(starts, rows):
        stack.run(x, batch.positions, batch.slot_mapping, 2, batch.decode_block_tables,
                  batch.decode_context_lens, starts, rows, [chunk.context_len],
                  [chunk.block_table], False, FLASH_PREFILL_ROWS)

    with torch.inference_mode():
        run([2], [5])  # as the batch says
        with pytest.raises(RuntimeError, match="chunks must follow the decodes"):
            run([3], [5])
        with pytest.raises(RuntimeError, match="must cover the step's rows"):
            run([2], [4])
        with pytest.raises(RuntimeError, match="one start, row count"):
            run([2, 7], [5])


def test_the_stack_refuses_lists_that_do_not_match_per_layer():
    ops = paged_kernel.layer_ops()
    cos = sin = torch.zeros(8, 8)
    cache = torch.zeros(2, BLOCK, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="per layer 2 norms, 4 panels"):
        ops.LayerStack([cos], [], [], [], [cache, cache], cos, sin, 1e-5, 4, 2, 0.25)


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
