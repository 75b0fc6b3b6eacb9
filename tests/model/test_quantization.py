"""--quantization int8 (issue 16, "AMX tiles where present (bf16 and int8) ... AVX2 as the
floor"): dynamic W8A8 projections. csrc/int8_linear.cpp matches the float64 reference within
float32 rounding (its sums are exact integers per group of 64), each row's result does not
depend on the other rows (bit for bit),
the model routes every projection but the LM head through it, and bad or impossible requests
are refused with the reason (docs/quantization.md)."""

from __future__ import annotations

import math
import platform
import random
import shutil
import subprocess

import pytest
import torch

from kvserve import flags
from kvserve.core import SamplingParams
from kvserve.engine.llm import LLM, build_engine
from kvserve.model import paged_kernel, quantization
from kvserve.model.kernel_info import boot_lines, kernel_report
from kvserve.model.llama import Linear, LlamaForCausalLM
from kvserve.model.loader import dummy_weights
from kvserve.model.quantization import (
    ACTIVATION_GROUP,
    check_quantization,
    int8_linear_available,
    int8_linear_reference,
    pack_int8,
    quantize_groups,
    quantize_int8,
)
from tests.model.reference import TINY

needs_kernel = pytest.mark.skipif(not int8_linear_available(),
                                  reason="int8_linear needs the C++ kernels on an AVX2 CPU")

# rows x n x k: one row (decode), 1-5 rows past a block of 6, columns past a panel of 16, odd
# k (padded to even), k past a group of 64 (a short last group), and SmolLM2-135M's fused QKV,
# gate/up and down shapes
SHAPES = [(1, 16, 2), (3, 5, 7), (6, 16, 64), (7, 17, 33), (13, 40, 64), (1, 1, 1),
          (6, 20, 65), (9, 33, 199), (11, 960, 576), (5, 3072, 576), (8, 576, 1536)]


def test_activation_quantization_is_symmetric_per_row_and_keeps_zero_rows():
    x = torch.tensor([[0.5, -2.0, 1.0], [0.0, 0.0, 0.0], [3.0, 1e-9, -3.0]])
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q[0].tolist() == [32, -127, 64]  # 0.5 * 63.5 = 31.75 -> 32; 63.5 -> 64 (half even)
    assert q[1].tolist() == [0, 0, 0] and scale[1] == 0  # zeros: scale 0, no NaN
    assert q[2].tolist() == [127, 0, -127]
    assert torch.equal(scale, torch.tensor([2.0, 0.0, 3.0]) / 127)
    assert int(q.abs().max()) <= 127  # never -128


def test_pack_int8_pads_columns_and_odd_k_with_zeros():
    weight = torch.randn(17, 5)
    panels, scales = pack_int8(weight, "pairs")
    assert panels.dtype == torch.int8 and tuple(panels.shape) == (2, 3, 16, 2)
    assert scales.shape == (32,) and torch.all(scales[17:] == 0)
    q, scale = quantize_int8(weight)
    assert torch.equal(scales[:17], scale)
    assert torch.equal(panels[0, :, 3, :].reshape(-1)[:5], q[3])  # column 3, k in order
    assert torch.all(panels[0, 2, :, 1] == 0)  # k = 5 padded
    assert torch.all(panels[1, :, 1:, :] == 0)  # columns 17-31 padded


def test_quad_panels_hold_each_group_as_a_tdpbssd_b_tile():
    """The AMX path's layout (csrc/int8_blocks.h): per panel of 16 columns and group of 64 k,
    16 rows of 64 bytes, row j holding each column's k = 64 g + 4 j .. 64 g + 4 j + 3."""
    weight = torch.randn(17, 70)
    panels, scales = pack_int8(weight, "quads")
    q, scale = quantize_int8(weight)
    assert panels.dtype == torch.int8 and tuple(panels.shape) == (2, 32, 16, 4)
    assert torch.equal(scales[:17], scale) and torch.all(scales[17:] == 0)
    for column, g, j in [(0, 0, 0), (3, 0, 15), (16, 1, 0), (9, 0, 7)]:
        assert torch.equal(panels[column // 16, 16 * g + j, column % 16],
                           q[column, 64 * g + 4 * j:64 * g + 4 * j + 4])
    assert torch.all(panels[:, 18:] == 0) and torch.all(panels[:, 17, :, 2:] == 0)  # k >= 70
    assert torch.all(panels[1, :, 1:] == 0)  # columns 17-31 padded
    with pytest.raises(ValueError, match="unknown int8 layout 'triples'"):
        pack_int8(weight, "triples")


def test_activations_are_quantized_per_group_of_64():
    x = torch.cat([torch.full((1, 64), 2.0), torch.full((1, 64), 0.01), torch.ones(1, 3)], 1)
    q, scales = quantize_groups(x)
    assert ACTIVATION_GROUP == 64 and scales.shape == (1, 3)  # the last group of 3 values
    assert torch.equal(scales[0], torch.tensor([2.0, 0.01, 1.0]) / 127)
    assert torch.all(q == 127)  # each group at full range: the small one keeps its precision


@needs_kernel
@pytest.mark.parametrize("rows,n,k", SHAPES)
def test_the_kernel_matches_the_reference_within_float32_rounding(rows, n, k):
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator) * torch.rand(rows, 1, generator=generator) * 8
    if rows > 2:
        x[1] = 0  # a row of zeros: scale 0, output 0
    weight = torch.randn(n, k, generator=generator)
    panels, scales = pack_int8(weight)
    got = paged_kernel.layer_ops().int8_linear(x, panels, scales, n)
    q_weight, w_scale = quantize_int8(weight)
    expected = int8_linear_reference(x, q_weight, w_scale)
    # float32 rounding of the group adds: a few ulps of the sum of the terms' magnitudes
    qx, x_scales = quantize_groups(x)
    magnitude = (qx.double().abs() @ q_weight.double().abs().T) * x_scales.double().max(1)[0][
        :, None] * w_scale.double()[None, :]
    assert torch.all((got.double() - expected).abs() <= 4 * 2.0**-24 * magnitude + 1e-30)
    if rows > 2:
        assert torch.all(got[1] == 0)
    exact = x @ weight.T
    if exact.norm() > 0:  # and int8 is close to the float product: ~1% of its norm
        assert float((got - exact).norm() / exact.norm()) < 0.03


@needs_kernel
def test_the_kernel_quantizes_activations_exactly_as_the_reference():
    """Through an identity weight each output is one quantized activation times its scales, so
    any difference in the rounding (e.g. 127 / amax computed as a reciprocal times 127, one
    ulp off in about a third of the groups) shows as a whole step. 24,000 groups."""
    k = 192
    x = torch.randn(8000, k, generator=torch.Generator().manual_seed(5)) * 3
    panels, scales = pack_int8(torch.eye(k))  # each column's amax is 1: q 127, scale 1 / 127
    got = paged_kernel.layer_ops().int8_linear(x, panels, scales, k)
    qx, x_scales = quantize_groups(x)
    expected = (qx.float() * 127) * \
        x_scales.repeat_interleave(ACTIVATION_GROUP, 1) * (1.0 / 127)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0)


@needs_kernel
def test_the_kernel_is_wrong_if_the_groups_are():
    """The tolerance above is far tighter than the difference a wrong group size makes."""
    x, weight = torch.randn(4, 256) * torch.linspace(0.01, 5, 256), torch.randn(8, 256)
    panels, scales = pack_int8(weight)
    got = paged_kernel.layer_ops().int8_linear(x, panels, scales, 8).double()
    q_weight, w_scale = quantize_int8(weight)
    per_row = (quantize_int8(x)[0].double() @ q_weight.double().T) * \
        quantize_int8(x)[1].double()[:, None] * w_scale.double()
    assert (got - per_row).abs().max() > 1e3 * (got - int8_linear_reference(
        x, q_weight, w_scale)).abs().max()


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows():
    x, weight = torch.randn(20, 96), torch.randn(50, 96)
    panels, scales = pack_int8(weight)
    batch = paged_kernel.layer_ops().int8_linear(x, panels, scales, 50)
    for row in (0, 5, 6, 19):  # in a block of 6, past it, in the tail
        alone = paged_kernel.layer_ops().int8_linear(x[row:row + 1].contiguous(), panels,
                                                     scales, 50)
        assert torch.equal(alone[0], batch[row])


@needs_kernel
def test_the_kernel_refuses_mismatched_panels():
    panels, scales = pack_int8(torch.randn(16, 8), "pairs")
    with pytest.raises(RuntimeError, match="int8_linear: panels"):
        paged_kernel.layer_ops().int8_linear(torch.randn(2, 10), panels, scales, 16)
    with pytest.raises(RuntimeError, match="int8_linear: scales"):
        paged_kernel.layer_ops().int8_linear(torch.randn(2, 8), panels, scales[:8], 16)
    with pytest.raises(RuntimeError, match="int8_linear: panels must be 4-D"):
        paged_kernel.layer_ops().int8_linear(torch.randn(2, 8), panels[0], scales, 16)


def amx_runs() -> bool:
    return int8_linear_available() and paged_kernel.layer_ops().int8_linear_path() == "amx"


@needs_kernel
@pytest.mark.skipif(amx_runs(), reason="the AMX path runs here")
def test_quad_panels_are_refused_where_the_amx_path_cannot_run():
    panels, scales = pack_int8(torch.randn(16, 64), "quads")
    reason = paged_kernel.layer_ops().int8_amx_unavailable()
    assert reason  # why, in words
    with pytest.raises(RuntimeError, match="quad panels are the AMX-INT8 path's"):
        paged_kernel.layer_ops().int8_linear(torch.randn(2, 64), panels, scales, 16)


@pytest.mark.skipif(not amx_runs(), reason="needs a CPU with AMX-INT8 and Linux's grant")
@pytest.mark.parametrize("rows,n,k", [*SHAPES, (16, 16, 64), (17, 33, 130), (40, 100, 576)])
def test_the_amx_path_gives_the_bits_of_the_pairs_path(rows, n, k):
    """On an AMX CPU: TDPBSSD's exact group sums, added in the same order, give the AVX2 /
    VNNI path's result bit for bit (tools/avx512_check.py checks the same under emulation)."""
    x, weight = torch.randn(rows, k) * 4, torch.randn(n, k)
    ops = paged_kernel.layer_ops()
    amx = ops.int8_linear(x, *pack_int8(weight, "quads"), n)
    assert torch.equal(amx, ops.int8_linear(x, *pack_int8(weight, "pairs"), n))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_projection_but_the_lm_head_runs_int8(dtype):
    weights = dummy_weights(TINY, dtype, seed=3)
    float_model = LlamaForCausalLM.from_weights(TINY, dict(weights))
    model = LlamaForCausalLM.from_weights(TINY, dict(weights), quantization="int8")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all((m.int8 is not None) == (m is not model.lm_head) for m in linears)
    assert all(m.weight.device.type == "meta" for m in linears if m.int8 is not None)
    hidden = torch.randn(9, TINY.hidden_size).to(dtype)
    layer = model.layers[0].mlp.down_proj
    reference_layer = float_model.layers[0].mlp.down_proj
    x = torch.randn(9, layer.weight.shape[1]).to(dtype)
    got, exact = layer(x).float(), reference_layer(x).float()
    assert layer(x).dtype == dtype
    assert float((got - exact).norm() / exact.norm()) < 0.05
    assert torch.equal(model.compute_logits(hidden), float_model.compute_logits(hidden))


@needs_kernel
def test_greedy_tokens_under_int8_do_not_depend_on_the_batch():
    """int8_linear's sums are exact, so --batch-invariant holds with --quantization int8."""
    rng = random.Random(16)
    target = [rng.randrange(3, 500) for _ in range(40)]
    others = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))] for _ in range(7)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    engine = LLM(TINY, dtype="float32", batch_invariant=True, quantization="int8",
                 num_kv_blocks=256, enable_prefix_caching=False)
    alone = engine.generate([target], params, use_tqdm=False)[0]
    batch = engine.generate([*others[:3], target, *others[3:]], params, use_tqdm=False)[3]
    assert (batch.token_ids, batch.logprobs) == (alone.token_ids, alone.logprobs)
    assert len(alone.token_ids) == 10


def test_unknown_or_unavailable_quantization_is_refused_with_the_reason(monkeypatch):
    check_quantization(None)  # unquantized always runs
    with pytest.raises(ValueError, match="unknown quantization 'int4'; choose int8"):
        build_engine(TINY, quantization="int4", num_kv_blocks=8)
    monkeypatch.setattr(paged_kernel, "available", lambda: False)
    monkeypatch.setattr(paged_kernel, "unavailable_reason", lambda: "no compiler")
    with pytest.raises(ValueError, match=r"needs kvserve.s C\+\+ kernels.*no compiler"):
        check_quantization("int8")


def test_the_cli_offers_what_the_model_implements_and_passes_it_on():
    assert flags.QUANTIZATIONS == quantization.QUANTIZATIONS
    parser = flags.argparse.ArgumentParser()
    flags.add_model_flags(parser)
    for argv, expected in (([], None), (["-q", "int8"], "int8"),
                           (["--quantization", "int8"], "int8")):
        args = parser.parse_args(argv)
        assert flags.engine_args(args).get("quantization") == expected
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--quantization", "fp8"])
    assert exit_info.value.code == 2


@needs_kernel
def test_the_boot_log_names_the_int8_kernel():
    lines = boot_lines(kernel_report(), torch.float32, "int8")
    assert "projections int8_linear [--quantization int8]" in lines[1]
    assert "projections int8_linear" not in boot_lines(kernel_report(), torch.float32)[1]


@needs_kernel
def test_the_bundled_model_in_int8_still_answers():
    """On the real weights (not a random TINY model) int8 keeps the model's knowledge: the
    greedy answer, and the float model's first tokens (docs/quantization.md: 95% top-1
    agreement over 4,432 positions)."""
    params = SamplingParams(max_tokens=6, temperature=0)
    prompt = "The capital of France is"
    int8 = LLM(dtype="float32", quantization="int8", num_kv_blocks=64).generate(
        [prompt], params, use_tqdm=False)[0]
    assert "Paris" in int8.text
    float_model = LLM(dtype="float32", num_kv_blocks=64).generate([prompt], params,
                                                                  use_tqdm=False)[0]
    assert int8.token_ids[:2] == float_model.token_ids[:2]


AMX_UNIT = """
#include "int8_blocks.h"
extern "C" const char* status() { return kvserve::amx_status(); }
extern "C" void rows(const int8_t* qa, int64_t n_rows, int64_t ldqa, const float* sx,
                     const int8_t* panel, const float* sw, float* out, int64_t ldo, int ncols) {
  KVSERVE_TILE_LOADCONFIG(kvserve::int8::kAmxConfig.bytes);
  kvserve::int8::amx_panel_rows(qa, n_rows, ldqa, sx, panel, sw, out, ldo, ncols);
  KVSERVE_TILE_RELEASE();
}
"""


@pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64",
                    reason="needs g++ on x86-64")
def test_the_amx_path_compiles_to_tile_instructions_for_a_sapphire_rapids(tmp_path):
    """No CPU here may have AMX, and the emulator has none: tools/avx512_check.py runs the AMX
    path through amx_tiles.h's software model. This pins the other half: built for a Sapphire
    Rapids, the same source is the CPU's tile instructions (and asks Linux for the tiles)."""
    from torch.utils.cpp_extension import include_paths

    source = tmp_path / "amx.cpp"
    source.write_text(AMX_UNIT)
    includes = [f"-I{path}" for path in [*include_paths(), str(paged_kernel.CSRC)]]

    def assembly(*defines: str) -> str:
        subprocess.run(["g++", "-std=c++17", "-O2", "-march=sapphirerapids", "-w", *defines,
                        *includes, "-S", "-o", str(tmp_path / "amx.s"), str(source)],
                       check=True, timeout=300)
        return (tmp_path / "amx.s").read_text()

    real = assembly()
    for instruction in ("ldtilecfg", "tilezero", "tileloadd", "tdpbssd", "tilestored",
                        "tilerelease", "syscall"):
        assert instruction in real, instruction
    assert "tdpbssd" not in assembly("-DKVSERVE_AMX_MODEL")  # the model: plain code


@needs_kernel
@pytest.mark.parametrize("where", [0, 10, 63, 64, 97, 99])  # lanes of chunks, the tail
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_group_that_is_not_finite_gives_nan_as_the_float_product_does(where, value):
    """QA (numerics pass): a NaN came out finite (max_ps drops it unless it sits in the last
    chunk), an inf came out inf with the wrong sign, where the reference said NaN."""
    weight = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    x[1, where] = value
    got = paged_kernel.layer_ops().int8_linear(x, *pack_int8(weight), 16)
    assert torch.isnan(got[1]).all() and torch.isfinite(got[[0, 2]]).all()
    assert torch.isnan(int8_linear_reference(x, *quantize_int8(weight))[1]).all()


@needs_kernel
def test_a_group_of_tiny_values_counts_as_zeros_and_keeps_its_neighbours():
    """QA (numerics pass): under ~3.7e-37 127 / amax overflowed, and every value of the
    group, zeros included, came out as -amax; such a group adds nothing now."""
    x = torch.zeros(1, 128)
    x[0, :4] = torch.tensor([3e-37, -1.5e-37, 7.5e-38, 0.0])
    x[0, 64:] = 1.0
    weight = torch.eye(128)
    got = paged_kernel.layer_ops().int8_linear(x, *pack_int8(weight), 128)
    assert torch.equal(got[0, :64], torch.zeros(64)) and torch.allclose(got[0, 64:], x[0, 64:])
    assert torch.equal(int8_linear_reference(x, *quantize_int8(weight)).float(), got)
