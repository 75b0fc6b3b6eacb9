"""The C++ paged attention kernel against a plain gather + softmax computation."""

from __future__ import annotations

import logging
import math
import platform
import shutil
import subprocess
from typing import TYPE_CHECKING

import pytest
import torch

from kvserve.model import paged_kernel

if TYPE_CHECKING:
    from kvserve.model.input_batch import ForwardBatch

requires_kernel = pytest.mark.skipif(
    not paged_kernel.available(),
    reason=f"kernel unavailable: {paged_kernel.unavailable_reason()}")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _plain(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
           context_len: int) -> torch.Tensor:
    """q: [n, heads, dim], the last n positions of the context, causal. Float64 throughout."""
    n, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    positions = torch.arange(context_len)
    slots = table[positions // block_size] * block_size + positions % block_size
    group = heads // kv_heads
    keys = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [L, H, d]
    values = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), keys) / math.sqrt(dim)
    query_pos = context_len - n + torch.arange(n)
    scores = scores.masked_fill(positions[None, None, :] > query_pos[None, :, None],
                                float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), values)


def _caches(num_blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, kv_heads, dim)
    return (torch.randn(shape, generator=gen).to(dtype),
            torch.randn(shape, generator=gen).to(dtype))


def _tables(lens: list[int], block_size: int, num_blocks: int,
            gen: torch.Generator) -> torch.Tensor:
    """Shuffled, disjoint block tables, padded with 0."""
    needed = [-(-n // block_size) for n in lens]
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros((len(lens), max(needed)), dtype=torch.long)
    start = 0
    for row, count in enumerate(needed):
        tables[row, :count] = perm[start:start + count]
        start += count
    return tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [
    (9, 3, 64, 16),  # SmolLM2-135M
    (8, 2, 128, 16),
    (4, 4, 64, 32),  # no GQA
    (6, 1, 40, 8),  # head_dim not a multiple of 16: the generic (compiler-vectorised) path
    (12, 2, 32, 5),  # odd block size
    # The register-blocked AVX-512 loops for every row and vector count (with_constant 1-4):
    (10, 2, 48, 16),  # group 5 = 4 + 1 rows, 3 vectors of 16
    (2, 1, 16, 16),  # group 2, 1 vector
    (3, 1, 96, 16),  # group 3, 4 + 2 vectors
])
@requires_kernel
def test_decode_matches_plain(dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                              block_size: int) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + dim + block_size)
    lens = [1, 2, block_size - 1, block_size, block_size + 1, 17, 63, 64, 65, 100, 257, 640]
    lens += torch.randint(1, 300, (20,), generator=gen).tolist()
    num_blocks = sum(-(-n // block_size) for n in lens) + 7
    k_cache, v_cache = _caches(num_blocks, block_size, kv_heads, dim, dtype, gen)
    tables = _tables(lens, block_size, num_blocks, gen)
    q = torch.randn((len(lens), heads, dim), generator=gen).to(dtype)
    out = paged_kernel.decode_attention(q, k_cache, v_cache, tables,
                                        torch.tensor(lens, dtype=torch.long))
    assert out.shape == q.shape and out.dtype == dtype
    for row, n in enumerate(lens):
        want = _plain(q[row:row + 1], k_cache, v_cache, tables[row], n)[0]
        torch.testing.assert_close(out[row].double(), want, atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype], msg=f"row {row}, context {n}")


@requires_kernel
def test_decode_float32_query_on_bfloat16_cache() -> None:
    gen = torch.Generator().manual_seed(5)
    lens = [3, 40, 129]
    k_cache, v_cache = _caches(20, 16, 3, 64, torch.bfloat16, gen)
    tables = _tables(lens, 16, 20, gen)
    q = torch.randn((3, 9, 64), generator=gen)
    out = paged_kernel.decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens))
    assert out.dtype == torch.float32
    for row, n in enumerate(lens):
        want = _plain(q[row:row + 1], k_cache, v_cache, tables[row], n)[0]
        torch.testing.assert_close(out[row].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@requires_kernel
def test_decode_reads_queries_in_place_from_a_wider_row(dtype: torch.dtype) -> None:
    """A step's q is a view into its qkv rows (rows 15 heads apart, 9 of them read): the kernel
    scales and reads them in place and writes q's dtype, giving its contiguous copy's output."""
    gen = torch.Generator().manual_seed(8)
    lens = [5, 70, 300, 16]
    k_cache, v_cache = _caches(40, 16, 3, 64, dtype, gen)
    tables = _tables(lens, 16, 40, gen)
    qkv = torch.randn((len(lens), 15 * 64), generator=gen).to(dtype)
    q = qkv[:, :9 * 64].view(len(lens), 9, 64)
    assert not q.is_contiguous()
    context = torch.tensor(lens)
    out = paged_kernel.decode_attention(q, k_cache, v_cache, tables, context)
    assert out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, paged_kernel.decode_attention(q.contiguous(), k_cache, v_cache,
                                                          tables, context))
    for row, n in enumerate(lens):
        want = _plain(q[row:row + 1], k_cache, v_cache, tables[row], n)[0]
        torch.testing.assert_close(out[row].double(), want, atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])


@requires_kernel
def test_decode_large_scores_are_stable() -> None:
    """Scores in the hundreds: the online softmax must not overflow."""
    gen = torch.Generator().manual_seed(6)
    lens = [200, 33]
    k_cache, v_cache = _caches(20, 16, 1, 64, torch.float32, gen)
    k_cache *= 30
    tables = _tables(lens, 16, 20, gen)
    q = torch.randn((2, 2, 64), generator=gen) * 30
    out = paged_kernel.decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens))
    for row, n in enumerate(lens):
        want = _plain(q[row:row + 1], k_cache, v_cache, tables[row], n)[0]
        torch.testing.assert_close(out[row].double(), want, atol=1e-4, rtol=1e-4)


@requires_kernel
def test_decode_empty_batch() -> None:
    k_cache = torch.zeros((4, 16, 3, 64))
    q = torch.zeros((0, 9, 64))
    out = paged_kernel.decode_attention(q, k_cache, k_cache, torch.zeros((0, 1), dtype=torch.long),
                                        torch.zeros(0, dtype=torch.long))
    assert out.shape == (0, 9, 64)


@requires_kernel
def test_decode_rejects_a_context_longer_than_its_table() -> None:
    k_cache = torch.zeros((4, 16, 3, 64))
    with pytest.raises(RuntimeError, match="does not fit"):
        paged_kernel.decode_attention(torch.zeros((1, 9, 64)), k_cache, k_cache,
                                      torch.zeros((1, 2), dtype=torch.long), torch.tensor([33]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "context_len"), [
    (1, 1), (5, 5), (16, 16), (37, 37), (100, 100),  # whole prompts
    (1, 50), (7, 40), (33, 97), (64, 300),  # later chunks of a longer context
])
@requires_kernel
def test_prefill_matches_plain(dtype: torch.dtype, num_tokens: int, context_len: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 7 + context_len)
    block_size, num_blocks = 16, 40
    k_cache, v_cache = _caches(num_blocks, block_size, 3, 64, dtype, gen)
    table = _tables([context_len], block_size, num_blocks, gen)[0]
    q = torch.randn((num_tokens, 9, 64), generator=gen).to(dtype)
    out = paged_kernel.prefill_attention(q, k_cache, v_cache, table, context_len)
    assert out.shape == q.shape and out.dtype == dtype
    want = _plain(q, k_cache, v_cache, table, context_len)
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size", "num_tokens", "context_len"), [
    (9, 3, 64, 16, 200, 200),  # SmolLM2's shape, a whole prompt over several query tiles
    (8, 2, 128, 16, 70, 150),  # head_dim 128, a later chunk
    (4, 4, 64, 5, 45, 61),     # tiles of 60 keys (12 blocks of 5): scores rows padded to 64
    (12, 2, 64, 32, 100, 100),  # groups of 6 rows; tiles of 64 keys in two blocks
    (6, 3, 128, 128, 17, 300),  # one block per tile of 128 keys
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@requires_kernel
def test_prefill_tile_shapes(heads: int, kv_heads: int, dim: int, block_size: int,
                             num_tokens: int, context_len: int, dtype: torch.dtype) -> None:
    """Prefill repacks each key tile where the build can (csrc/attention_gemm.h: pairs order
    for a bf16 model on AVX512-BF16, transposed float32 on AVX2), else runs per query: either
    way the plain result, over query and key tiles of every shape (row blocks of 6 and their
    remainders, groups of 8 keys and a partial one)."""
    gen = torch.Generator().manual_seed(num_tokens + context_len + block_size)
    num_blocks = -(-context_len // block_size) + 4
    k_cache, v_cache = _caches(num_blocks, block_size, kv_heads, dim, dtype, gen)
    table = _tables([context_len], block_size, num_blocks, gen)[0]
    q = torch.randn((num_tokens, heads, dim), generator=gen).to(dtype)
    out = paged_kernel.prefill_attention(q, k_cache, v_cache, table, context_len)
    want = _plain(q, k_cache, v_cache, table, context_len)
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128)])
@requires_kernel
def test_prefill_match_decode_is_bit_identical_to_decode(dtype: torch.dtype, heads: int,
                                                         kv_heads: int, dim: int) -> None:
    """--batch-invariant's prefill (match_decode): every row's output is the one a decode step
    gives that token, bit for bit (a token recomputed after a preemption is the token its
    decode made). Without it the repacked tiles may differ in the last bits, within tolerance."""
    gen = torch.Generator().manual_seed(dim + heads)
    context_len, block_size, num_blocks = 150, 16, 14
    k_cache, v_cache = _caches(num_blocks, block_size, kv_heads, dim, dtype, gen)
    table = _tables([context_len], block_size, num_blocks, gen)[0]
    q = torch.randn((context_len, heads, dim), generator=gen).to(dtype)
    matched = paged_kernel.prefill_attention(q, k_cache, v_cache, table, context_len,
                                             match_decode=True)
    fast = paged_kernel.prefill_attention(q, k_cache, v_cache, table, context_len)
    positions = [0, 5, 63, 64, 100, 149]
    decoded = paged_kernel.decode_attention(
        q[positions], k_cache, v_cache, table.repeat(len(positions), 1),
        torch.tensor([p + 1 for p in positions]))
    assert torch.equal(matched[positions], decoded)
    torch.testing.assert_close(fast.double(), matched.double(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@requires_kernel
def test_prefill_generic_head_dim() -> None:
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache = _caches(12, 8, 2, 24, torch.float32, gen)
    table = _tables([70], 8, 12, gen)[0]
    q = torch.randn((30, 6, 24), generator=gen)
    out = paged_kernel.prefill_attention(q, k_cache, v_cache, table, 70)
    torch.testing.assert_close(out.double(), _plain(q, k_cache, v_cache, table, 70),
                               atol=1e-5, rtol=1e-5)


@requires_kernel
def test_rejects_block_ids_outside_the_cache() -> None:
    k_cache = torch.zeros((4, 16, 3, 64))
    with pytest.raises(RuntimeError, match="out of range"):
        paged_kernel.decode_attention(torch.zeros((1, 9, 64)), k_cache, k_cache,
                                      torch.tensor([[1, 4]]), torch.tensor([20]))
    with pytest.raises(RuntimeError, match="out of range"):
        paged_kernel.prefill_attention(torch.zeros((3, 9, 64)), k_cache, k_cache,
                                       torch.tensor([-1]), 3)
    # Padding past the context is never read, whatever it holds.
    out = paged_kernel.decode_attention(torch.zeros((1, 9, 64)), k_cache, k_cache,
                                        torch.tensor([[1, 99]]), torch.tensor([16]))
    assert out.shape == (1, 9, 64)


def test_a_failed_build_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise RuntimeError("ninja is not installed (pip install ninja)")

    monkeypatch.setattr(paged_kernel, "_build", fail)
    monkeypatch.setattr(paged_kernel, "_tried", False)
    monkeypatch.setattr(paged_kernel, "_module", None)
    monkeypatch.setattr(paged_kernel, "_error", None)
    assert paged_kernel.available() is False
    assert "ninja" in (paged_kernel.unavailable_reason() or "")
    with pytest.raises(RuntimeError, match="unavailable"):
        paged_kernel.decode_attention(torch.zeros((1, 1, 8)), torch.zeros((1, 4, 1, 8)),
                                      torch.zeros((1, 4, 1, 8)), torch.zeros((1, 1)),
                                      torch.ones(1))


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_few_requests_split_by_kv_head(dtype: torch.dtype) -> None:
    """Fewer requests than 4 per thread: work items are (request, kv head) pairs."""
    gen = torch.Generator().manual_seed(11)
    lens = [700, 1]
    k_cache, v_cache = _caches(60, 16, 3, 64, dtype, gen)
    tables = _tables(lens, 16, 60, gen)
    q = torch.randn((2, 9, 64), generator=gen).to(dtype)
    out = paged_kernel.decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens))
    for row, n in enumerate(lens):
        want = _plain(q[row:row + 1], k_cache, v_cache, tables[row], n)[0]
        torch.testing.assert_close(out[row].double(), want, atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])


def test_float16_caches_take_the_torch_path() -> None:
    """The kernels compute on float32 and bfloat16 only; a float16 model (LLM(dtype=
    "float16")) runs attention through torch instead of failing in the kernel's dtype check."""
    from kvserve.model.attention import paged_attention, torch_paged_attention
    from kvserve.model.input_batch import ForwardBatch, PrefillChunk

    gen = torch.Generator().manual_seed(12)
    lens = [5, 40]
    k_cache, v_cache = _caches(12, 16, 3, 64, torch.float16, gen)
    tables = _tables([*lens, 20], 16, 12, gen)
    q = torch.randn((2 + 4, 9, 64), generator=gen).to(torch.float16)
    batch = ForwardBatch(
        input_ids=torch.zeros(6, dtype=torch.long), positions=torch.zeros(6, dtype=torch.long),
        slot_mapping=torch.zeros(6, dtype=torch.long), num_decodes=2,
        decode_block_tables=tables[:2], decode_context_lens=torch.tensor(lens),
        decode_context_lens_host=tuple(lens),
        prefills=[PrefillChunk(2, 4, 20, tables[2])], logits_indices=torch.tensor([0, 1, 5]))
    assert paged_kernel.handles(torch.float16) is False
    assert torch.equal(paged_attention(q, k_cache, v_cache, batch),
                       torch_paged_attention(q, k_cache, v_cache, batch))


def test_build_lock_clears_a_killed_builds_lock_and_excludes_others(tmp_path) -> None:
    """torch waits forever on a ``lock`` file a killed build left; under build_lock it goes,
    and a second process could not take build_lock meanwhile."""
    import fcntl

    (tmp_path / "lock").touch()
    with paged_kernel.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / "kvserve-build.lock", "a") as other, \
                pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "kvserve-build.lock", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on leaving


PREFETCH_UNIT = """
#include <c10/util/BFloat16.h>
#include "attention_tile.h"
using Ahead = kvserve::Ahead<c10::BFloat16>;
void keys(const float* q, const c10::BFloat16* const* rows, int count, float* scores,
          const c10::BFloat16* const* window) {
  kvserve::dots<c10::BFloat16, 64>(q, nullptr, 3, 64, rows, 0, count, scores, 64,
                                   Ahead{window, count, 0, 3, 64, 2});
}
void values(float* acc, const c10::BFloat16* const* rows, int count, const float* probs,
            const c10::BFloat16* const* window) {
  kvserve::accumulate_values<c10::BFloat16, 64>(acc, 3, 64, rows, 0, count, probs, 64,
                                                Ahead{window, count, 0, 3, 64, 2});
}
"""


@pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64",
                    reason="needs g++ on x86-64")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "x86-64-v4", "sapphirerapids"])
def test_decode_tiles_prefetch_the_next_tile_on_every_tier(tmp_path, march: str) -> None:
    """Decode's speed on a big batch rests on the next tile's prefetches (Ahead in
    attention_tile.h); outputs cannot show whether they are there, and GCC has dropped calls
    whose only effect was a prefetch. The dot products and the value sums, built for each
    tier (generic loops, AVX2, AVX-512, AVX512-BF16), must hold prefetcht1 instructions."""
    from torch.utils.cpp_extension import include_paths

    source = tmp_path / "prefetch.cpp"
    source.write_text(PREFETCH_UNIT)
    includes = [f"-I{path}" for path in [*include_paths(), str(paged_kernel.CSRC)]]
    out = tmp_path / "prefetch.s"
    subprocess.run(["g++", "-std=c++17", "-O3", f"-march={march}", "-w", *includes, "-S",
                    "-o", str(out), str(source)], check=True, timeout=300)
    functions = out.read_text().split("@function")  # each piece starts with one's body
    for names in (("keys", "dots"), ("values", "accumulate")):  # the entry, or what it calls
        bodies = [body for body in functions[1:]
                  if any(name in body.split(":", 1)[0] for name in names)]
        assert bodies and any("prefetcht1" in body for body in bodies), (march, names)


TILE_SUMS_PROGRAM = r"""
#include <c10/util/BFloat16.h>
#include "attention_tile.h"
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>
// dots (scores) and accumulate_values of a GQA group of 3 over `count` keys, head_dim 64,
// against double sums; prints the largest relative error of each.
int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  const int group = 3, dim = 64, stride = 64;
  double worst_dot = 0, worst_acc = 0;
  for (int count : {1, 5, 8, 15, 16, 23, 64}) {
    std::vector<c10::BFloat16> keys(count * dim);
    for (auto& k : keys) k = c10::BFloat16(normal(rng));
    std::vector<const c10::BFloat16*> rows(count);
    for (int t = 0; t < count; ++t) rows[t] = keys.data() + t * dim;
    std::vector<float> q(group * dim), scores(group * stride, -1.0f), acc(group * dim, 0.0f);
    for (auto& x : q) x = normal(rng);
    kvserve::dots<c10::BFloat16, 64>(q.data(), nullptr, group, dim, rows.data(), 0, count,
                                     scores.data(), stride);
    std::vector<float> probs(group * stride, 0.0f);
    for (int g = 0; g < group; ++g)
      for (int t = 0; t < count; ++t) probs[g * stride + t] = 0.5f + 0.01f * t;
    kvserve::accumulate_values<c10::BFloat16, 64>(acc.data(), group, dim, rows.data(), 0, count,
                                                  probs.data(), stride);
    for (int g = 0; g < group; ++g) {
      for (int t = 0; t < count; ++t) {
        double want = 0;
        for (int d = 0; d < dim; ++d) want += double(q[g * dim + d]) * float(keys[t * dim + d]);
        worst_dot = std::max(worst_dot, std::fabs(scores[g * stride + t] - want) / 8.0);
      }
      for (int d = 0; d < dim; ++d) {
        double want = 0;
        for (int t = 0; t < count; ++t) want += probs[g * stride + t] * float(keys[t * dim + d]);
        worst_acc = std::max(worst_acc, std::fabs(acc[g * dim + d] - want) / (1.0 + count));
      }
    }
  }
  std::printf("%g %g\n", worst_dot, worst_acc);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64",
                    reason="needs g++ on x86-64")
@pytest.mark.parametrize(("march", "flags"), [("x86-64-v3", {"avx2", "fma"}),
                                              ("x86-64-v4", {"avx512f", "avx512bw"})])
def test_decode_tiles_sum_each_key_on_the_avx2_and_avx512_tiers(tmp_path, march: str,
                                                                 flags: set[str]) -> None:
    """dots_simd sums each key's partial vector by the transpose-and-add's tree, folded as the
    keys arrive (KeySums in attention_tile.h); a lane out of place gives another key's score.
    The extension runs only the host's best tier, so the AVX2 tier (Vec8's three levels) and
    the AVX-512 float tier (Vec16's four) are built here and run against double sums, with
    tiles shorter than a vector's lanes among them."""
    from kvserve.model.kernel_info import cpu_info

    cpu_flags = cpu_info().flags
    if not flags <= cpu_flags:
        pytest.skip(f"this CPU lacks {sorted(flags - cpu_flags)}")
    from torch.utils.cpp_extension import include_paths, library_paths

    source = tmp_path / "sums.cpp"
    source.write_text(TILE_SUMS_PROGRAM)
    binary = tmp_path / "sums"
    lib = library_paths()[0]
    subprocess.run(["g++", "-std=c++17", "-O2", f"-march={march}", "-w",
                    *[f"-I{path}" for path in [*include_paths(), str(paged_kernel.CSRC)]],
                    "-o", str(binary), str(source), f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10"],
                   check=True, timeout=300)
    worst_dot, worst_acc = map(float, subprocess.run([str(binary)], capture_output=True,
                                                     text=True, check=True,
                                                     timeout=60).stdout.split())
    assert worst_dot < 1e-5 and worst_acc < 1e-5, (march, worst_dot, worst_acc)


PANEL_PREFETCH_UNIT = """
#include "panel_dpbf16.h"
void panels(const uint16_t* x, long rows, const uint16_t* panels, long k_pairs, float* out,
            long ncols) {
  kvserve::dpbf16::panel_rows<kvserve::dpbf16::NativeDot>(x, rows, panels, k_pairs, out, ncols,
                                                          ncols);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64",
                    reason="needs g++ on x86-64")
def test_bf16_panels_prefetch_the_next_group_of_panels(tmp_path) -> None:
    """The bf16 panels' speed at decode's few rows rests on prefetching the next group of
    panels (block's ahead in panel_dpbf16.h: 1.19-1.27x at 12-16 rows); the built kernel must
    hold prefetcht1 instructions, for a CPU with AVX512-BF16 and one with AMX too."""
    source = tmp_path / "panels.cpp"
    source.write_text(PANEL_PREFETCH_UNIT)
    for march in ("cooperlake", "sapphirerapids"):  # AVX512-BF16 without AMX, with it
        out = tmp_path / f"panels-{march}.s"
        subprocess.run(["g++", "-std=c++17", "-O3", f"-march={march}", "-w",
                        f"-I{paged_kernel.CSRC}", "-S", "-o", str(out), str(source)],
                       check=True, timeout=300)
        text = out.read_text()
        assert "vdpbf16ps" in text and "prefetcht1" in text, march


AMX_PANEL_UNIT = """
#include "panel_amx.h"
void tiles(const uint16_t* x, long rows, const uint16_t* panels, long k_steps, long count,
           uint16_t* out, long ldo) {
  kvserve::panel_amx::panel_rows(x, rows, (rows + 15) / 16 * 16, panels, k_steps, count, 16,
                                 out, ldo);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64",
                    reason="needs g++ on x86-64")
def test_the_projection_tiles_build_for_amx_and_prefetch_the_next_group(tmp_path) -> None:
    """panel_amx.h (hybrid-amx's kernel) streams the panels at decode's few rows only as fast
    as its prefetch of the next group lets it; built for a Sapphire Rapids on any x86 machine,
    it must hold the tile products and prefetcht1, and build to nothing for a CPU without
    AMX-BF16 (the binding then reports why)."""
    source = tmp_path / "tiles.cpp"
    source.write_text(AMX_PANEL_UNIT)
    out = tmp_path / "tiles.s"
    subprocess.run(["g++", "-std=c++17", "-O3", "-march=sapphirerapids", "-w",
                    f"-I{paged_kernel.CSRC}", "-S", "-o", str(out), str(source)],
                   check=True, timeout=300)
    text = out.read_text()
    assert "tdpbf16ps" in text and "prefetcht1" in text
    # AVX512-BF16 without AMX: the kernel is compiled out (KVSERVE_AMX_BF16 unset), which the
    # unit asserts at compile time: g++ fails on the #error where it is set
    absent = tmp_path / "absent.cpp"
    absent.write_text('#include "panel_amx.h"\n#ifdef KVSERVE_AMX_BF16\n#error tiles\n#endif\n'
                      "#ifdef KVSERVE_AMX_TILES\n#error tile macros\n#endif\n")
    result = subprocess.run(["g++", "-std=c++17", "-march=cooperlake", "-w",
                             f"-I{paged_kernel.CSRC}", "-fsyntax-only", str(absent)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_the_build_key_covers_every_kernel_source_and_header() -> None:
    """The extension's name hashes SOURCES and HEADERS: a header left out of them could be
    edited without a rebuild, and a stale kernel would load."""
    on_disk = set(paged_kernel.CSRC.glob("*.cpp")) | set(paged_kernel.CSRC.glob("*.h"))
    assert set(paged_kernel.SOURCES) | set(paged_kernel.HEADERS) == on_disk


def test_a_build_says_so_before_the_minute_it_takes(monkeypatch, tmp_path, caplog) -> None:
    """The first start compiles the kernels (about a minute) and said nothing meanwhile
    (QA); a start that finds the build loads it without the line."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: tmp_path)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: kwargs["name"])
    with caplog.at_level(logging.INFO, logger="kvserve.model.paged_kernel"):
        name = paged_kernel._build()
    assert any(m.startswith("building kvserve's C++ kernels for this CPU in " + str(tmp_path))
               for m in caplog.messages)
    (tmp_path / f"{name}.so").touch()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvserve.model.paged_kernel"):
        paged_kernel._build()
    assert not any("building" in m for m in caplog.messages)


def _chunks(dtype: torch.dtype, seed: int, short: tuple[int, ...]) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch]:
    """q, caches and a prefill-only ForwardBatch of chunks (rows, context): a whole prompt, a
    chunk after a prefix, then one of each ``short`` row count over 40 tokens of context."""
    from kvserve.model.input_batch import ForwardBatch, PrefillChunk

    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = _caches(80, 16, 3, 64, dtype, gen)
    shapes = [(300, 300), (64, 200), *((n, 40) for n in short)]
    tables = _tables([context for _, context in shapes], 16, 80, gen)
    q = torch.randn((sum(n for n, _ in shapes), 9, 64), generator=gen).to(dtype)
    chunks, start = [], 0
    for (n, context), table in zip(shapes, tables, strict=True):
        chunks.append(PrefillChunk(start, n, context, table[:-(-context // 16)]))
        start += n
    none = torch.zeros(0, dtype=torch.long)
    batch = ForwardBatch(none, none, none, 0, torch.zeros((0, 1), dtype=torch.long), none, (),
                         chunks, none)
    return q, k_cache, v_cache, batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@requires_kernel
def test_flash_prefill_chunks_match_plain_and_short_or_invariant_ones_keep_the_kernel(
        monkeypatch, dtype: torch.dtype) -> None:
    """KVSERVE_PREFILL_ATTENTION=flash (auto on an AMX CPU in bf16): chunks of
    FLASH_PREFILL_ROWS+ rows, whole prompts and chunks after a prefix alike, go to torch's
    flash attention and match the plain attention; shorter chunks, decodes and
    --batch-invariant's prefill rows stay on the C++ kernel."""
    from kvserve.model import attention
    from kvserve.model.kernel_info import FLASH_PREFILL_ROWS, PREFILL_ATTENTION_ENV

    q, k_cache, v_cache, batch = _chunks(dtype, 11, (FLASH_PREFILL_ROWS - 1,))
    chunks = batch.prefills
    calls = []
    kernel_prefill = paged_kernel.prefill_attention
    monkeypatch.setattr(paged_kernel, "prefill_attention",
                        lambda q, *a, **k: calls.append(q.shape[0]) or kernel_prefill(q, *a, **k))
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "flash")
    out = attention.paged_attention(q, k_cache, v_cache, batch)
    assert calls == [FLASH_PREFILL_ROWS - 1]
    for chunk in chunks:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        want = _plain(q[rows], k_cache, v_cache, chunk.block_table, chunk.context_len)
        torch.testing.assert_close(out[rows].double(), want, atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])
    # every chunk on the C++ kernel (one step_attention call): each the kernel's own bits
    invariant = attention.invariant_paged_attention(q, k_cache, v_cache, batch)
    _assert_chunks_ran(invariant, q, k_cache, v_cache, batch, kernel_prefill, match_decode=True)
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "kernel")
    kernel = attention.paged_attention(q, k_cache, v_cache, batch)
    torch.testing.assert_close(kernel.double(), out.double(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])
    _assert_chunks_ran(kernel, q, k_cache, v_cache, batch, kernel_prefill)


def _assert_chunks_ran(out, q, k_cache, v_cache, batch, route, **options) -> None:
    """Each prefill chunk's rows of ``out`` are what ``route(chunk)`` gives, bit for bit (a
    route is a kernel with its own summation order, so the bits name it)."""
    for chunk in batch.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        want = route(q[rows], k_cache, v_cache, chunk.block_table, chunk.context_len, **options)
        assert torch.equal(out[rows], want), chunk.num_tokens


def _amx_reason() -> str:
    return paged_kernel.amx_bf16_status() if paged_kernel.available() \
        else f"kernel unavailable: {paged_kernel.unavailable_reason()}"


requires_amx = pytest.mark.skipif(bool(_amx_reason()), reason=_amx_reason() or "AMX")


@requires_amx
@pytest.mark.parametrize("block_size,heads,kv_heads", [(16, 9, 3), (32, 4, 4), (16, 8, 1)])
def test_amx_prefill_attention_matches_plain(block_size: int, heads: int,
                                             kv_heads: int) -> None:
    """csrc/attention_amx.h against float64 attention: whole prompts and chunks after a
    prefix, rows and contexts on and off the tiles' 16 rows and 64 keys (a last partial tile
    of queries, keys past the context masked), GQA groups of 1-8, shuffled block tables;
    within bf16's rounding, as flash and the kernel are."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(1, 1), (5, 5), (16, 16), (17, 40), (63, 64), (64, 65), (100, 300),
              (300, 300), (16, 512), (33, 1000)]
    num_blocks = sum(-(-context // block_size) for _, context in shapes) + 7
    k_cache, v_cache = _caches(num_blocks, block_size, kv_heads, 64, torch.bfloat16, gen)
    tables = _tables([context for _, context in shapes], block_size, num_blocks, gen)
    for (n, context), table in zip(shapes, tables, strict=True):
        q = torch.randn((n, heads, 64), generator=gen).to(torch.bfloat16)
        got = paged_kernel.amx_prefill_attention(q, k_cache, v_cache, table, context)
        assert got.dtype == torch.bfloat16 and got.shape == q.shape
        want = _plain(q, k_cache, v_cache, table, context)
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2,
                                   msg=lambda m, n=n, c=context: f"{n} rows, context {c}: {m}")


@requires_amx
@pytest.mark.parametrize("growth", ["rising", "falling", "sharp"])
def test_amx_prefill_attention_rescales_when_later_keys_score_higher(growth: str) -> None:
    """The tiles' running max moves lazily (only past 2^8 in log2 units), storing and
    rescaling the output tiles mid-walk when it does: keys whose scores rise along the
    context (the max moves several times mid-walk), fall (the first step's max mostly
    holds), or spread over tens of log2 units (most probabilities underflow to 0) all match
    float64 attention. With the rescale removed from the kernel these fail; the tests
    above pass."""
    gen = torch.Generator().manual_seed(8)
    block_size, kv_heads, heads, context = 16, 3, 9, 400
    num_blocks = context // block_size + 9
    k_cache, v_cache = _caches(num_blocks, block_size, kv_heads, 64, torch.float32, gen)
    table = _tables([context], block_size, num_blocks, gen)[0]
    slots = table[torch.arange(context) // block_size] * block_size + \
        torch.arange(context) % block_size
    ramp = torch.linspace(0.2, 3.0, context)  # per position
    weight = {"rising": ramp, "falling": ramp.flip(0),
              "sharp": torch.full((context,), 12.0)}[growth]
    flat = k_cache.flatten(0, 1)
    flat[slots] = flat[slots] * weight[:, None, None]
    k_cache, v_cache = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    q = (torch.randn((context, heads, 64), generator=gen) * 2).to(torch.bfloat16)
    for n in (context, 70):  # the whole prompt; a chunk after a prefix
        got = paged_kernel.amx_prefill_attention(q[-n:], k_cache, v_cache, table, context)
        want = _plain(q[-n:], k_cache, v_cache, table, context)
        assert torch.isfinite(got.float()).all()
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2,
                                   msg=lambda m, n=n: f"{growth}, {n} rows: {m}")


@requires_amx
def test_amx_prefill_attention_refuses_what_it_does_not_compute() -> None:
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache = _caches(8, 16, 3, 64, torch.bfloat16, gen)
    table = torch.arange(8)
    q = torch.randn((20, 9, 64), generator=gen).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        paged_kernel.amx_prefill_attention(q.float(), k_cache.float(), v_cache.float(), table,
                                           20)
    wide_k, wide_v = _caches(8, 16, 3, 128, torch.bfloat16, gen)
    with pytest.raises(RuntimeError, match="head_dim 64"):
        paged_kernel.amx_prefill_attention(torch.zeros((20, 9, 128), dtype=torch.bfloat16),
                                           wide_k, wide_v, table, 20)
    with pytest.raises(RuntimeError, match="context length does not fit"):
        paged_kernel.amx_prefill_attention(q, k_cache, v_cache, table[:1], 20)
    with pytest.raises(RuntimeError, match="out of range"):
        paged_kernel.amx_prefill_attention(q, k_cache, v_cache, table + 8, 20)


@requires_kernel
def test_a_build_without_amx_says_why_it_has_no_amx_prefill() -> None:
    status = paged_kernel.amx_bf16_status()
    if "amx_bf16" in paged_kernel.compiled_isa():
        assert status == "" or "Linux" in status
    else:
        assert "no AMX-BF16 path" in status
        with pytest.raises(RuntimeError, match="no AMX-BF16 path"):
            paged_kernel.amx_prefill_attention(torch.zeros((1, 9, 64), dtype=torch.bfloat16),
                                               *_caches(1, 16, 3, 64, torch.bfloat16,
                                                        torch.Generator()),
                                               torch.zeros(1, dtype=torch.long), 1)


@requires_amx
def test_amx_prefill_chunks_route_by_rows_and_match_plain(monkeypatch) -> None:
    """KVSERVE_PREFILL_ATTENTION=amx (auto on an AMX build in bf16): chunks of
    AMX_PREFILL_ROWS+ rows go to the AMX tiles (FLASH_PREFILL_ROWS - 1 rows too), shorter
    ones and --batch-invariant's rows to the C++ kernel (all in one step_attention call: the
    bits say which kernel ran each); every chunk matches the plain attention."""
    from kvserve.model import attention
    from kvserve.model.kernel_info import (
        AMX_PREFILL_ROWS,
        FLASH_PREFILL_ROWS,
        PREFILL_ATTENTION_ENV,
    )

    q, k_cache, v_cache, batch = _chunks(torch.bfloat16, 12,
                                         (AMX_PREFILL_ROWS - 1, FLASH_PREFILL_ROWS - 1))
    chunks = batch.prefills
    kernel_rows, amx_rows = [], []
    kernel_prefill, amx_prefill = paged_kernel.prefill_attention, \
        paged_kernel.amx_prefill_attention
    monkeypatch.setattr(paged_kernel, "prefill_attention", lambda q, *a, **k:
                        kernel_rows.append(q.shape[0]) or kernel_prefill(q, *a, **k))
    monkeypatch.setattr(paged_kernel, "amx_prefill_attention", lambda q, *a, **k:
                        amx_rows.append(q.shape[0]) or amx_prefill(q, *a, **k))

    def by_rows(q, *args):  # the route the rule names: tiles from AMX_PREFILL_ROWS rows
        return (amx_prefill if q.shape[0] >= AMX_PREFILL_ROWS else kernel_prefill)(q, *args)

    for chunk in chunks:  # the two kernels sum in other orders: their bits differ
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        assert not torch.equal(*(f(q[rows], k_cache, v_cache, chunk.block_table,
                                   chunk.context_len) for f in (amx_prefill, kernel_prefill)))
    for choice in ("amx", "auto"):
        monkeypatch.setenv(PREFILL_ATTENTION_ENV, choice)
        out = attention.paged_attention(q, k_cache, v_cache, batch)
        _assert_chunks_ran(out, q, k_cache, v_cache, batch, by_rows)
        for chunk in chunks:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            want = _plain(q[rows], k_cache, v_cache, chunk.block_table, chunk.context_len)
            torch.testing.assert_close(out[rows].double(), want, atol=2e-2, rtol=2e-2)
    invariant = attention.invariant_paged_attention(q, k_cache, v_cache, batch)
    _assert_chunks_ran(invariant, q, k_cache, v_cache, batch, kernel_prefill, match_decode=True)
    # float32 asked for amx: the tiles take bf16 only, so flash runs its long chunks (the
    # Python path: the spies see its calls)
    kernel_rows.clear(), amx_rows.clear()
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "amx")
    q32, k32, v32 = q.float(), k_cache.float(), v_cache.float()
    out = attention.paged_attention(q32, k32, v32, batch)
    assert (kernel_rows, amx_rows) == ([AMX_PREFILL_ROWS - 1, FLASH_PREFILL_ROWS - 1], [])
    for chunk in chunks:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        want = _plain(q32[rows], k32, v32, chunk.block_table, chunk.context_len)
        torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=1e-5)
