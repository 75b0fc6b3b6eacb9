"""The model's building blocks against plain torch: packed projections and fused layer ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model import layer_ops, paged_kernel
from kvserve.model.kernel_info import (
    AMX_PANEL_ROWS,
    AMX_TILE_K,
    AMX_TILE_PANEL_ROWS,
    AMX_WIDE_PANEL_ROWS,
    HYBRID_PANEL_COLUMNS,
    HYBRID_PANEL_ROWS,
    HYBRID_WIDE_PANEL_ROWS,
    PROJECTIONS_ENV,
    hybrid_panel_rows,
    onednn_runs_bf16,
)
from kvserve.model.llama import (
    Linear,
    can_pack_weights,
    onednn_rows,
    pack_pair_panels,
    panel_linear_available,
    projection_kernel,
    uses_panels,
)


def amx_build() -> bool:
    """The extension compiled for AMX (the hybrid projections' row limits are AMX's)."""
    return paged_kernel.available() and "amx_bf16" in paged_kernel.compiled_isa()


def dpbf16_built() -> bool:
    return paged_kernel.available() and \
        bool(paged_kernel.layer_ops().panel_linear_bf16_compiled())


def spy_layer_ops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Route paged_kernel.layer_ops() through a spy; returns the list each call's name (the
    extension function asked for) is appended to."""
    ops, called = paged_kernel.layer_ops(), []

    class Spy:
        def __getattr__(self, name):
            called.append(name)
            return getattr(ops, name)

    monkeypatch.setattr(paged_kernel, "layer_ops", Spy)
    return called


@pytest.fixture
def avx2_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Projections on csrc/panel_linear.cpp whatever this CPU's default (it builds wherever
    AVX2 and FMA do, AVX-512 CPUs included)."""
    if not panel_linear_available():
        pytest.skip("panel_linear: a build with AVX2 and FMA")
    monkeypatch.setenv(PROJECTIONS_ENV, "panels-avx2")


@pytest.mark.skipif(not onednn_runs_bf16(), reason="no oneDNN bf16 on this CPU")
@pytest.mark.parametrize("num_tokens", [1, 11, 64, 300])
def test_a_packed_bf16_projection_equals_f_linear(monkeypatch, num_tokens):
    monkeypatch.setenv(PROJECTIONS_ENV, "onednn")
    gen = torch.Generator().manual_seed(num_tokens)
    linear = Linear(576, 960)
    linear.weight.data = torch.randn(960, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_tokens, 576, generator=gen).to(torch.bfloat16)
    expected = F.linear(x, linear.weight)
    linear.pack()
    assert linear.packed is not None
    with torch.inference_mode():
        assert torch.equal(linear(x), expected)


def test_onednn_row_counts_are_sixteen_an_octave_and_never_fewer_rows():
    """oneDNN builds a kernel per row count: the projections' calls are rounded up to one of
    16 row counts an octave, at most a sixteenth more rows; below 32 rows as they are."""
    assert [onednn_rows(m) for m in (1, 17, 31, 32, 33, 513, 1000, 1024, 1025, 2047)] == \
        [1, 17, 31, 32, 34, 544, 1024, 1024, 1088, 2048]
    for m in range(1, 4100):
        assert m <= onednn_rows(m) <= m + m // 16
    assert len({onednn_rows(m) for m in range(513, 2049)}) == 32  # two octaves


@pytest.mark.skipif(not onednn_runs_bf16(), reason="no oneDNN bf16 on this CPU")
@pytest.mark.parametrize("num_tokens", [33, 513, 1000, 1024])
def test_a_padded_onednn_projection_gives_the_unpadded_bits(monkeypatch, num_tokens):
    """A oneDNN projection runs at onednn_rows(rows) rows, zero rows added, and returns the
    first rows: the same bits as the call at the rows themselves."""
    monkeypatch.setenv(PROJECTIONS_ENV, "onednn")
    gen = torch.Generator().manual_seed(num_tokens)
    linear = Linear(576, 960)
    linear.weight.data = torch.randn(960, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_tokens, 576, generator=gen).to(torch.bfloat16)
    linear.pack()
    with torch.inference_mode():
        padded = linear(x)
        assert torch.equal(linear(x.view(1, num_tokens, 576))[0], padded)
        plain = torch.ops.mkldnn._linear_pointwise(x, linear.packed, None, "none", [], "")
        assert torch.equal(padded, plain) and padded.shape == (num_tokens, 960)
        # computed at the padded row count: the output is a view of that many rows
        assert padded.untyped_storage().nbytes() == onednn_rows(num_tokens) * 960 * 2


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("bf16_values", [False, True])
def test_a_packed_float32_projection_matches_f_linear(num_tokens, bf16_values):
    """Packed float32 (panel_linear's panels where built, else oneDNN's layout) sums in another
    order than MKL's: equal within rounding. 970 outputs: a last panel of 10 columns. A weight
    of bf16 numbers is stored as bf16 in its panels, the same values."""
    gen = torch.Generator().manual_seed(num_tokens)
    linear = Linear(576, 970)
    weight = torch.randn(970, 576, generator=gen)
    linear.weight.data = weight.to(torch.bfloat16).float() if bf16_values else weight
    x = torch.randn(num_tokens, 576, generator=gen)
    expected = F.linear(x, linear.weight)
    linear.pack()
    if uses_panels(torch.float32):
        assert linear.panels is not None and linear.panels.shape == (61, 576, 16)
        assert linear.panels.dtype == (torch.bfloat16 if bf16_values else torch.float32)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-4)
        assert linear(x.view(1, num_tokens, 576)).shape == (1, num_tokens, 970)


@pytest.mark.usefixtures("avx2_panels")
@pytest.mark.parametrize("bf16_values", [False, True])
def test_panel_linear_rows_do_not_depend_on_the_batch(bf16_values):
    """Each output is one FMA chain over k: a row alone, in a block of 6 or a remainder gives
    the same bits."""
    gen = torch.Generator().manual_seed(3)
    linear = Linear(1536, 100)
    weight = torch.randn(100, 1536, generator=gen)
    linear.weight.data = weight.to(torch.bfloat16).float() if bf16_values else weight
    linear.pack()
    x = torch.randn(23, 1536, generator=gen)
    with torch.inference_mode():
        batch = linear(x)
        assert torch.equal(torch.cat([linear(x[i:i + 1]) for i in range(23)]), batch)
        assert torch.equal(torch.cat([linear(x[:4]), linear(x[4:])]), batch)


@pytest.mark.usefixtures("avx2_panels")
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_a_bf16_projection_runs_on_bf16_panels(num_tokens):
    """Where oneDNN has no bf16 (an AVX2 CPU), a bf16 weight goes into bf16 panels: the
    activations widen to float32, the sums are float32, the output is rounded to bf16 once,
    so it is the float32 product of the same numbers rounded (within one bf16 step where the
    two sum orders straddle a rounding boundary)."""
    gen = torch.Generator().manual_seed(num_tokens)
    linear = Linear(576, 970)
    linear.weight.data = torch.randn(970, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_tokens, 576, generator=gen).to(torch.bfloat16)
    assert can_pack_weights(torch.bfloat16)
    linear.pack()
    assert linear.panels is not None and linear.panels.dtype == torch.bfloat16
    with torch.inference_mode():
        out = linear(x)
    expected = F.linear(x.float(), linear.weight.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, 970)
    torch.testing.assert_close(out, expected, rtol=1 / 128, atol=1e-3)
    assert (out == expected).float().mean() > 0.95


@pytest.mark.skipif(not panel_linear_available(), reason="panel_linear: AVX2 and FMA builds")
def test_panel_linear_refuses_mismatched_panels():
    kernel = paged_kernel.layer_ops().panel_linear
    panels = torch.zeros(4, 64, 16)
    with pytest.raises(RuntimeError, match="panels must be contiguous"):
        kernel(torch.zeros(3, 32), panels, 64)  # in_features differ
    with pytest.raises(RuntimeError, match="panels must be contiguous"):
        kernel(torch.zeros(3, 64), panels, 80)  # 80 outputs need 5 panels
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        kernel(torch.zeros(3, 64, dtype=torch.bfloat16), panels, 64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel(torch.zeros(3, 64), panels.half(), 64)


def test_pair_panels_hold_each_column_s_pairs_of_k_side_by_side():
    """csrc/panel_dpbf16.h's layout: [ceil(n / 16), k / 2, 16, 2], zero columns past n."""
    weight = torch.randn(37, 10).to(torch.bfloat16)
    panels = pack_pair_panels(weight)
    assert panels.shape == (3, 5, 16, 2) and panels.is_contiguous()
    for column in range(48):
        for k in range(10):
            value = panels[column // 16, k // 2, column % 16, k % 2]
            assert value == (weight[column, k] if column < 37 else 0)


@pytest.mark.skipif(not dpbf16_built(), reason="panel_linear_bf16: an AVX512-BF16 build")
@pytest.mark.parametrize("num_tokens", [1, 7, 12, 13, 300])
def test_the_avx512_bf16_panels_match_float32_sums_of_the_bf16_values(monkeypatch, num_tokens):
    """vdpbf16ps sums bf16 products in float32: the float32 product of the same numbers,
    rounded to bf16 once (within one bf16 step where the orders straddle a boundary); rows
    alone or in blocks of 12 give the same bits. 970 outputs: a last panel of 10 columns."""
    monkeypatch.setenv(PROJECTIONS_ENV, "panels")
    gen = torch.Generator().manual_seed(num_tokens)
    linear = Linear(576, 970)
    linear.weight.data = torch.randn(970, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_tokens, 576, generator=gen).to(torch.bfloat16)
    assert projection_kernel(torch.bfloat16) == "panels-dpbf16"
    linear.pack()
    assert linear.pair_panels is not None and linear.pair_panels.shape == (61, 288, 16, 2)
    with torch.inference_mode():
        out = linear(x)
        alone = torch.cat([linear(x[i:i + 1]) for i in range(num_tokens)])
    expected = F.linear(x.float(), linear.weight.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, 970)
    torch.testing.assert_close(out, expected, rtol=1 / 128, atol=1e-3)
    assert (out == expected).float().mean() > 0.95
    assert torch.equal(alone, out)


@pytest.mark.skipif(not dpbf16_built() or not onednn_runs_bf16(),
                    reason="hybrid-dpbf16: an AVX512-BF16 build where oneDNN runs bf16")
@pytest.mark.parametrize("num_tokens", [1, AMX_PANEL_ROWS, AMX_PANEL_ROWS + 1, 12,
                                        HYBRID_PANEL_ROWS, HYBRID_PANEL_ROWS + 1, 300])
def test_hybrid_projections_run_small_calls_on_the_panels_and_large_ones_on_onednn(
        monkeypatch, num_tokens):
    """hybrid-dpbf16 (KVSERVE_PROJECTIONS=hybrid anywhere it builds) keeps both packings: up
    to HYBRID_PANEL_ROWS rows (AMX_PANEL_ROWS on an AMX build) a call's output is the
    panels' (bit for bit), above it oneDNN's."""
    gen = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(200, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_tokens, 576, generator=gen).to(torch.bfloat16)
    called = spy_layer_ops(monkeypatch)
    outputs = {}
    for choice in ("panels", "onednn", "hybrid"):
        monkeypatch.setenv(PROJECTIONS_ENV, choice)
        assert choice != "hybrid" or projection_kernel(torch.bfloat16) == "hybrid-dpbf16"
        linear = Linear(576, 200)
        linear.weight.data = weight.clone()
        linear.pack()
        assert choice != "hybrid" or (
            linear.packed is not None and linear.pair_panels is not None)
        called.clear()
        with torch.inference_mode():
            outputs[choice] = linear(x)
    small = num_tokens <= (AMX_PANEL_ROWS if amx_build() else HYBRID_PANEL_ROWS)
    assert called == (["panel_linear_bf16"] if small else [])
    assert torch.equal(outputs["hybrid"], outputs["panels" if small else "onednn"])
    monkeypatch.setenv(PROJECTIONS_ENV, "auto")
    assert projection_kernel(torch.bfloat16) == ("hybrid-amx" if amx_build() else
                                                 "panels-dpbf16")


@pytest.mark.skipif(not dpbf16_built() or not onednn_runs_bf16(),
                    reason="hybrid-dpbf16: an AVX512-BF16 build where oneDNN runs bf16")
@pytest.mark.parametrize("num_tokens", [1, HYBRID_WIDE_PANEL_ROWS, HYBRID_WIDE_PANEL_ROWS + 1])
def test_hybrid_projections_run_an_lm_head_sized_weight_on_the_panels_only_for_few_rows(
        monkeypatch, num_tokens):
    """A weight of more than HYBRID_PANEL_COLUMNS outputs (an LM head) runs on the panels up to
    HYBRID_WIDE_PANEL_ROWS rows, on oneDNN above (bit for bit each kernel's own output); on an
    AMX build always on oneDNN, with no panels packed for it (hybrid-amx too)."""
    gen = torch.Generator().manual_seed(0)
    n = HYBRID_PANEL_COLUMNS + 16
    weight = torch.randn(n, 576, generator=gen).to(torch.bfloat16)
    # eight calls of num_tokens rows: the panels and oneDNN round ~1 output in 50,000 apart
    # (on the Zen 4), so one call of one row may not tell them apart
    xs = [torch.randn(num_tokens, 576, generator=gen).to(torch.bfloat16) for _ in range(8)]
    outputs = {}
    for choice in ("panels", "onednn", "hybrid", "auto"):
        monkeypatch.setenv(PROJECTIONS_ENV, choice)
        assert choice != "hybrid" or projection_kernel(torch.bfloat16) == "hybrid-dpbf16"
        linear = Linear(576, n)
        linear.weight.data = weight.clone()
        linear.pack()
        assert choice not in ("hybrid", "auto") or (linear.pair_panels is None) == amx_build()
        with torch.inference_mode():
            outputs[choice] = torch.cat([linear(x) for x in xs])
    assert hybrid_panel_rows(n) == HYBRID_WIDE_PANEL_ROWS < hybrid_panel_rows(n - 16)
    assert hybrid_panel_rows(n, amx=True) == AMX_WIDE_PANEL_ROWS == 0
    assert hybrid_panel_rows(n, amx=True, tiles=True) == AMX_WIDE_PANEL_ROWS
    assert hybrid_panel_rows(n - 16, amx=True) == AMX_PANEL_ROWS
    small = not amx_build() and num_tokens <= HYBRID_WIDE_PANEL_ROWS
    assert torch.equal(outputs["hybrid"], outputs["panels" if small else "onednn"])
    # auto: hybrid-amx's oneDNN alone for a head on AMX, else panels-dpbf16 at every size
    assert torch.equal(outputs["auto"], outputs["onednn" if amx_build() else "panels"])
    assert not torch.equal(outputs["panels"], outputs["onednn"])  # the check can tell them apart


@pytest.mark.skipif(not dpbf16_built(), reason="panel_linear_bf16: an AVX512-BF16 build")
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_panel_linear_bf16_rounds_its_bf16_output_as_torch_rounds_the_float32_one(num_tokens):
    """bf16_out rounds each float32 sum to bf16 in the kernel (vcvtneps2bf16): the same bits
    as the float32 output converted by torch, a last panel of 10 columns included."""
    gen = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(970, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_tokens, 576, generator=gen).to(torch.bfloat16)
    panels = pack_pair_panels(weight)
    kernel = paged_kernel.layer_ops().panel_linear_bf16
    wide, narrow = kernel(x, panels, 970), kernel(x, panels, 970, True)
    assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
    assert narrow.shape == (num_tokens, 970)
    assert torch.equal(narrow, wide.to(torch.bfloat16))


@pytest.mark.skipif(not dpbf16_built(), reason="panel_linear_bf16: an AVX512-BF16 build")
def test_panel_linear_bf16_refuses_mismatched_panels():
    kernel = paged_kernel.layer_ops().panel_linear_bf16
    panels = torch.zeros(4, 32, 16, 2, dtype=torch.bfloat16)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="panels must be contiguous bfloat16"):
        kernel(x[:, :32].contiguous(), panels, 64)  # in_features differ
    with pytest.raises(RuntimeError, match="panels must be contiguous bfloat16"):
        kernel(x, panels, 80)  # 80 outputs need 5 panels
    with pytest.raises(RuntimeError, match="x must be contiguous bfloat16"):
        kernel(x.float(), panels, 64)


requires_tiles = pytest.mark.skipif(
    not paged_kernel.available() or not paged_kernel.panel_amx_runs(),
    reason="panel_linear_amx: an AMX-BF16 build whose process Linux grants the tiles")


@requires_tiles
@pytest.mark.parametrize(("num_tokens", "n", "k"), [
    (1, 576, 576), (15, 200, 576), (16, 960, 1536), (17, 970, 32), (33, 48, 64),
    (100, 3072, 576), (AMX_TILE_PANEL_ROWS, 40, 96)])
def test_panel_linear_amx_sums_as_the_dpbf16_panels_within_float32_rounding(num_tokens, n, k):
    """The AMX tiles read the dpbf16 panels as they lie: float32 sums within rounding of
    panel_linear_bf16's (another order), bf16 output the float32 one rounded, and each row's
    result the same bits alone as beside any other rows (a row's sums never see another)."""
    gen = torch.Generator().manual_seed(num_tokens + n)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_tokens, k, generator=gen).to(torch.bfloat16)
    panels = pack_pair_panels(weight)
    ops = paged_kernel.layer_ops()
    wide, narrow = ops.panel_linear_amx(x, panels, n), ops.panel_linear_amx(x, panels, n, True)
    assert wide.shape == narrow.shape == (num_tokens, n)
    assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
    torch.testing.assert_close(wide, ops.panel_linear_bf16(x, panels, n), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(wide, x.double() @ weight.double().T, rtol=1e-5, atol=1e-3,
                               check_dtype=False)
    assert torch.equal(narrow, wide.to(torch.bfloat16))
    for row in {0, num_tokens // 2, num_tokens - 1}:
        assert torch.equal(ops.panel_linear_amx(x[row:row + 1], panels, n), wide[row:row + 1])


@requires_tiles
def test_panel_linear_amx_refuses_what_its_tiles_cannot_read():
    kernel = paged_kernel.layer_ops().panel_linear_amx
    x = torch.zeros(3, 48, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="in_features must be a multiple of 32"):
        kernel(x, pack_pair_panels(torch.zeros(16, 48, dtype=torch.bfloat16)), 16)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    panels = pack_pair_panels(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="panels must be contiguous bfloat16"):
        kernel(x, panels, 80)  # 80 outputs need 5 panels
    with pytest.raises(RuntimeError, match="x must be contiguous bfloat16"):
        kernel(x.float(), panels, 64)
    assert kernel(x[:0], panels, 64).shape == (0, 64)


@requires_tiles
@pytest.mark.skipif(not onednn_runs_bf16(), reason="hybrid-amx: oneDNN runs bf16")
@pytest.mark.parametrize("num_tokens", [1, AMX_PANEL_ROWS + 1, 20, AMX_TILE_PANEL_ROWS,
                                        AMX_TILE_PANEL_ROWS + 1])
def test_hybrid_amx_projections_run_calls_up_to_its_rows_on_the_tiles(monkeypatch, num_tokens):
    """hybrid-amx (auto on an AMX-BF16 build) keeps the panels and oneDNN's copy: up to
    AMX_TILE_PANEL_ROWS rows a call is panel_linear_amx's (bit for bit), above oneDNN's; a
    weight whose in_features is not a multiple of AMX_TILE_K runs hybrid-dpbf16's rows."""
    gen = torch.Generator().manual_seed(num_tokens)
    ops, called = paged_kernel.layer_ops(), spy_layer_ops(monkeypatch)
    monkeypatch.setenv(PROJECTIONS_ENV, "auto")
    assert projection_kernel(torch.bfloat16) == "hybrid-amx"
    for k in (576, 2 * AMX_TILE_K + 2):
        weight = torch.randn(200, k, generator=gen).to(torch.bfloat16)
        x = torch.randn(num_tokens, k, generator=gen).to(torch.bfloat16)
        linear = Linear(k, 200)
        linear.weight.data = weight.clone()
        linear.pack()
        assert linear.packed is not None and linear.pair_panels is not None
        assert linear.panel_amx == (k % AMX_TILE_K == 0)
        called.clear()
        with torch.inference_mode():
            out = linear(x)
        rows = AMX_TILE_PANEL_ROWS if linear.panel_amx else AMX_PANEL_ROWS
        kernel = "panel_linear_amx" if linear.panel_amx else "panel_linear_bf16"
        assert called == ([kernel] if num_tokens <= rows else [])
        if num_tokens <= rows:
            assert torch.equal(out, getattr(ops, kernel)(x, linear.pair_panels, 200, True))
        else:
            assert torch.equal(out, F.linear(x, weight))  # oneDNN's, as an unpacked F.linear


@pytest.mark.skipif(not amx_build() or not dpbf16_built() or not onednn_runs_bf16(),
                    reason="hybrid-amx: an AMX-BF16 build where oneDNN runs bf16")
def test_hybrid_amx_without_the_tile_state_keeps_the_dpbf16_split(monkeypatch):
    """Where Linux refuses the tile state (panel_amx_runs False), an AMX build's auto still
    names hybrid-amx (what the build has) but each weight runs hybrid-dpbf16's rows: the
    AVX512-BF16 panels up to AMX_PANEL_ROWS, oneDNN above; no call reaches the tiles."""
    monkeypatch.setenv(PROJECTIONS_ENV, "auto")
    monkeypatch.setattr(paged_kernel, "panel_amx_runs", lambda: False)
    linear = Linear(576, 200)
    linear.weight.data = torch.randn(200, 576).to(torch.bfloat16)
    linear.pack()
    assert projection_kernel(torch.bfloat16) == "hybrid-amx"
    assert not linear.panel_amx and linear.panel_rows == AMX_PANEL_ROWS
    x = torch.randn(AMX_PANEL_ROWS, 576).to(torch.bfloat16)
    with torch.inference_mode():
        out = linear(x)
    assert torch.equal(out, paged_kernel.layer_ops().panel_linear_bf16(
        x, linear.pair_panels, 200, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("choice", ["amx", "hybrid", "panels", "panels-avx2", "onednn", "torch"])
def test_kvserve_projections_picks_the_kernel(monkeypatch, dtype, choice):
    """KVSERVE_PROJECTIONS runs a projection on the kernel it names where this machine has it
    (else the weights cannot be packed: ValueError naming the variable); each kernel's output
    is F.linear's within rounding."""
    monkeypatch.setenv(PROJECTIONS_ENV, choice)
    try:
        kernel = projection_kernel(dtype)
    except ValueError as error:
        assert str(error).startswith(f"{PROJECTIONS_ENV}={choice} cannot project")
        with pytest.raises(ValueError, match=PROJECTIONS_ENV):
            can_pack_weights(dtype)
        return
    assert kernel == choice or (choice == "panels" and kernel.startswith("panels")) or \
        (choice, kernel) in (("hybrid", "hybrid-dpbf16"), ("amx", "hybrid-amx"))
    gen = torch.Generator().manual_seed(5)
    linear = Linear(576, 200)
    linear.weight.data = torch.randn(200, 576, generator=gen).to(dtype)
    x = torch.randn(9, 576, generator=gen).to(dtype)
    expected = F.linear(x.float(), linear.weight.float()).to(dtype)
    if can_pack_weights(dtype):
        linear.pack()
    held = {"panels-avx2": linear.panels, "panels-dpbf16": linear.pair_panels,
            "onednn": linear.packed, "torch": None}
    expected_copies = {"torch": [], "hybrid-dpbf16": ["panels-dpbf16", "onednn"],
                       "hybrid-amx": ["panels-dpbf16", "onednn"]}
    assert [name for name, copy in held.items() if copy is not None] == \
        expected_copies.get(kernel, [kernel])
    with torch.inference_mode():
        out = linear(x)
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 1 / 64}[dtype]
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


def test_an_unknown_kvserve_projections_names_the_values_it_takes(monkeypatch):
    monkeypatch.setenv(PROJECTIONS_ENV, "mkl")
    with pytest.raises(ValueError, match="KVSERVE_PROJECTIONS='mkl' is not one of auto, "
                                         "amx, hybrid, panels, panels-avx2, onednn, torch"):
        can_pack_weights(torch.float32)


def test_float32_is_packed_where_avx2_is_the_best_vector_tier():
    zen3 = frozenset({"avx", "avx2", "fma"})
    assert can_pack_weights(torch.float32, zen3) == torch.backends.mkldnn.is_available()
    assert not can_pack_weights(torch.float32, zen3 | {"avx512f", "avx512_bf16"})
    assert not can_pack_weights(torch.float32, frozenset({"sse4_2"}))
    assert not can_pack_weights(torch.float16, zen3)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(params=["fused", "torch"], autouse=False)
def path(request, monkeypatch) -> str:
    """Run a layer_ops test through the C++ ops and again through the torch fallback."""
    if request.param == "fused" and not paged_kernel.available():
        pytest.skip("no C++ extension")
    if request.param == "torch":
        monkeypatch.setattr(layer_ops, "_fused", lambda dtype: False)
    return request.param


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 300])
def test_norms_with_and_without_residual(path, dtype, num_tokens):
    x = _randn(num_tokens, 96, dtype=dtype, seed=1)
    residual = _randn(num_tokens, 96, dtype=dtype, seed=2)
    weight = _randn(96, dtype=dtype, seed=3)
    tol = TOLERANCE[dtype]
    expected = F.rms_norm(x.float(), (96,), weight.float(), 1e-5)
    torch.testing.assert_close(layer_ops.rms_norm(x, weight, 1e-5).float(), expected,
                               atol=tol, rtol=tol)
    summed = residual + x  # rounded to dtype, as the fused op rounds its residual
    expected = F.rms_norm(summed.float(), (96,), weight.float(), 1e-5)
    out = layer_ops.add_rms_norm_(x, residual, weight, 1e-5)
    assert torch.equal(residual, summed)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(path, dtype):
    gate_up = _randn(33, 2 * 40, dtype=dtype) * 30  # reaches silu's saturated tails
    gate, up = gate_up.float().chunk(2, dim=-1)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(layer_ops.silu_and_mul(gate_up).float(), F.silu(gate) * up,
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_q_and_k_and_stores_k_and_v_at_their_slots(path, dtype):
    heads, kv_heads, dim, block_size = 4, 2, 8, 4
    positions = torch.tensor([0, 5, 6, 17])
    slots = torch.tensor([3, 9, 0, 14])  # any distinct slots of the 4 x 4 cache
    angles = torch.outer(torch.arange(32, dtype=torch.float32),
                          torch.rand(dim // 2, generator=torch.Generator().manual_seed(4)) + 0.1)
    cos, sin = angles.cos(), angles.sin()
    qkv = _randn(4, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = qkv.float().clone().split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)

    def rotate(x: torch.Tensor, num_heads: int) -> torch.Tensor:
        x = x.view(4, num_heads, dim)
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]
        first, second = x.chunk(2, dim=-1)
        return torch.cat((first * c - second * s, second * c + first * s), dim=-1)

    k_cache = torch.zeros(4, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    out = layer_ops.rope_and_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots,
                                      heads, kv_heads)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), rotate(q, heads), atol=tol, rtol=tol)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    torch.testing.assert_close(flat_k[slots].float(), rotate(k, kv_heads), atol=tol, rtol=tol)
    assert torch.equal(flat_v[slots].float(), v.view(4, kv_heads, dim))
    untouched = [i for i in range(16) if i not in slots.tolist()]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
