"""--batch-invariant (issue 19, item 5): a greedy or seeded request gives the same tokens, and
bit-identical logprobs, alone, in batches of 1-32, with its prompt chunked, after a
prefix-cache hit and after a preemption (recompute), in bfloat16 as in float32
(docs/tenants.md, "Outputs that do not depend on other traffic")."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.core import SamplingParams
from kvserve.engine.llm import LLM, GenerationResult
from kvserve.model import paged_kernel
from kvserve.model.kernel_info import PROJECTIONS_ENV
from kvserve.model.llama import Linear, invariant_projections, panel_linear_available
from tests.model.reference import TINY

pytestmark = pytest.mark.skipif(not paged_kernel.available(),
                                reason="--batch-invariant needs the C++ kernels")

DTYPES = ["bfloat16", "float32"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True,
                        logprobs=3)
RNG = random.Random(19)
TARGET = [RNG.randrange(3, 500) for _ in range(70)]  # 4 full blocks of 16 and 6 tokens
OTHERS = [[RNG.randrange(3, 500) for _ in range(RNG.randrange(5, 120))] for _ in range(31)]


def llm(dtype: str, **settings: object) -> LLM:
    settings.setdefault("num_kv_blocks", 512)
    return LLM(TINY, dtype=dtype, batch_invariant=True, **settings)


def output(result: GenerationResult) -> tuple[list[int], list[dict[int, float]]]:
    """Tokens and logprobs (exact floats: bit-identical or not equal)."""
    return result.token_ids, result.logprobs


@pytest.fixture(scope="module", params=DTYPES)
def alone(request) -> tuple[str, dict[str, tuple]]:
    """The target request alone on a fresh engine, its prompt in one chunk, no cache hit."""
    dtype = request.param
    engine = llm(dtype, enable_prefix_caching=False)
    return dtype, {name: output(engine.generate([TARGET], params, use_tqdm=False)[0])
                   for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


def test_same_tokens_in_batches_of_2_to_32(alone):
    """The greedy and the seeded target together among others' prompts (the batch is all of
    them: prefills and decodes of 2, 8 and 32 requests)."""
    dtype, expected = alone
    for size in (2, 8, 32):
        others = OTHERS[:size - 2]
        middle = len(others) // 2  # the targets sit among the others, not first or last
        prompts = [*others[:middle], TARGET, TARGET, *others[middle:]]
        params = [GREEDY] * middle + [GREEDY, SEEDED] + [GREEDY] * (len(others) - middle)
        results = llm(dtype, enable_prefix_caching=False).generate(prompts, params,
                                                                    use_tqdm=False)
        assert output(results[middle]) == expected["greedy"], (dtype, size)
        assert output(results[middle + 1]) == expected["seeded"], (dtype, size)
        assert len(results[middle].token_ids) == GREEDY.max_tokens


def test_same_tokens_with_the_prompt_chunked(alone):
    dtype, expected = alone
    # 70 prompt tokens at most 16 per step, beside 3 other requests' prefills and decodes
    engine = llm(dtype, max_num_batched_tokens=32, long_prefill_token_threshold=16,
                 max_num_seqs=4)
    results = engine.generate([*OTHERS[:3], TARGET], GREEDY, use_tqdm=False)
    assert output(results[-1]) == expected["greedy"]


def test_same_tokens_after_a_prefix_cache_hit(alone):  # G4
    """The first 48 tokens' KV was computed in another request's batch and chunking; the
    target attends over it and its own 22 new tokens."""
    dtype, expected = alone
    engine = llm(dtype)
    sharer = TARGET[:48] + [RNG.randrange(3, 500) for _ in range(30)]
    engine.generate([*OTHERS[:5], sharer], GREEDY, use_tqdm=False)
    for params_name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        [result] = engine.generate([TARGET], params, use_tqdm=False)
        assert result.metrics is not None
        assert result.metrics.num_cached_tokens == 48 if params_name == "greedy" else 64
        assert output(result) == expected[params_name], params_name


def test_same_tokens_after_a_preemption(alone):  # F4
    """12 blocks of 16 hold two 40-token requests and the 70-token target at admission, not
    once they grow: the last admitted, the target, is preempted after 8 tokens and its prompt
    and output so far recomputed in one prefill (78 tokens), whose KV must equal what its
    decodes wrote."""
    dtype, expected = alone
    engine = llm(dtype, num_kv_blocks=12, enable_prefix_caching=False)
    prompts = [OTHERS[i][:40] + [5] * max(0, 40 - len(OTHERS[i])) for i in range(2)]
    for params_name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        results = engine.generate([*prompts, TARGET], params, use_tqdm=False)
        metrics = results[-1].metrics
        assert metrics is not None, params_name
        assert (metrics.num_preemptions, metrics.num_recomputed_tokens) == (1, 78), params_name
        assert output(results[-1]) == expected[params_name], params_name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(64, 192), (100, 37), (33, 5), (576, 130)])
def test_invariant_linear_rows_do_not_depend_on_the_batch(dtype, k, n):
    generator = torch.Generator().manual_seed(k * n)
    x = torch.randn(37, k, generator=generator).to(dtype)
    w = torch.randn(n, k, generator=generator).to(dtype)
    kernel = paged_kernel.layer_ops().invariant_linear
    batch = kernel(x, w)
    assert batch.dtype == dtype and batch.shape == (37, n)
    alone = torch.cat([kernel(x[i:i + 1].contiguous(), w) for i in range(37)])
    split = torch.cat([kernel(x[:5].contiguous(), w), kernel(x[5:].contiguous(), w)])
    assert torch.equal(alone, batch) and torch.equal(split, batch)
    exact = x.double() @ w.double().T
    tolerance = 4e-3 if dtype == torch.bfloat16 else 1e-6  # bf16: the output's rounding
    assert (batch.double() - exact).abs().max() <= tolerance * exact.abs().max()


@pytest.mark.skipif(not panel_linear_available(), reason="a build with AVX2 and FMA")
def test_the_panels_serve_batch_invariant_where_the_build_has_them(monkeypatch):
    """panel_linear sums each output in one chain whatever the rows (tests/model/test_layers.py
    pins that), so --batch-invariant keeps it in both dtypes where it projects (by default on
    an AVX2 CPU; here asked for, so that AVX-512 CPUs run this too)."""
    monkeypatch.setenv(PROJECTIONS_ENV, "panels-avx2")
    for dtype in DTYPES:
        assert invariant_projections(getattr(torch, dtype)) == "panel_linear"
        model = llm(dtype, num_kv_blocks=8).engine.executor.model
        projections = [m for m in model.modules() if isinstance(m, Linear)]
        assert all(m.panels is not None and not m.invariant for m in projections), dtype
    monkeypatch.delenv(PROJECTIONS_ENV)
    assert invariant_projections(torch.float16) == "invariant_linear"


def test_batch_invariant_refuses_float16():
    with pytest.raises(ValueError, match="--batch-invariant supports float32 and bfloat16, "
                                         "not float16"):
        LLM(TINY, dtype="float16", batch_invariant=True, num_kv_blocks=8)


def test_the_flag_reaches_every_model_command():
    from kvserve.cli import build_parser
    from kvserve.flags import engine_args

    parser = build_parser()
    for command in ("generate", "serve"):
        args = parser.parse_args([command, "--batch-invariant"])
        assert engine_args(args)["batch_invariant"] is True
        assert "batch_invariant" not in engine_args(parser.parse_args([command]))


def test_prefill_attention_sums_as_decode_does():
    """The engine's attention under --batch-invariant asks the prefill kernel for decode's
    order (match_decode; tests/model/test_paged_kernel.py pins what that gives)."""
    from kvserve.model.attention import invariant_paged_attention
    engine = llm("float32", num_kv_blocks=8)
    assert engine.engine.executor.attention is invariant_paged_attention
    assert LLM(TINY, dtype="float32", num_kv_blocks=8).engine.executor.attention \
        is not invariant_paged_attention


def test_prefill_first_steps_give_the_same_tokens_q2():
    """--step-mix prefill-first changes which steps a request's tokens come from (its decodes
    wait while others prefill, Q2), not the tokens: under --batch-invariant the greedy and
    seeded outputs of a staggered batch (64-token steps chunk the longer prompts while the
    shorter ones decode) equal the mixed steps' ones."""
    prompts = [TARGET, *OTHERS[:7]]
    params = [GREEDY, SEEDED, *[GREEDY] * 6]
    outputs, prefill_only_steps = {}, {}
    for step_mix in ("mixed", "prefill-first"):
        engine = llm("float32", enable_prefix_caching=False, max_num_batched_tokens=64,
                     max_num_seqs=8, step_mix=step_mix)
        results = engine.generate(prompts, params, use_tqdm=False)
        outputs[step_mix] = [output(r) for r in results]
        prefill_only_steps[step_mix] = engine.engine.scheduler.num_prefill_only_steps
    assert outputs["prefill-first"] == outputs["mixed"]
    assert prefill_only_steps["mixed"] == 0 and prefill_only_steps["prefill-first"] > 0
