"""Paged attention: K and V live in blocks, read through each request's block table.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V,
so one block is one contiguous slab and gathering a request's context is one index_select over
whole blocks.

Three implementations with one signature:
- :func:`reference_attention`: per request, gather its context token by token and compute
  softmax(q k^T / sqrt(d)) v with explicit masks. Plain, slow, the yardstick in tests.
- :func:`torch_paged_attention`: decodes in groups through scaled_dot_product_attention over
  block-gathered contexts (each group padded to its longest, masked), each prefill chunk in
  one call. Pure torch: always available.
- :func:`paged_attention` (the default): decodes and prefill chunks through the C++ kernel
  of :mod:`kvserve.model.paged_kernel`, which reads K and V in place through the block
  tables, when it could be built and the cache is float32 or bfloat16 on the CPU; otherwise
  (a GPU's cache too, ``--device cuda``) exactly :func:`torch_paged_attention`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from kvserve.model import kernel_info, paged_kernel
from kvserve.model.input_batch import ForwardBatch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's K and V ([T, kv_heads, head_dim]) at their slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[num_blocks_in_table * block_size, kv_heads, head_dim] for one request."""
    return cache.index_select(0, block_table).flatten(0, 1)


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        batch: ForwardBatch) -> torch.Tensor:
    """q: [T, heads, head_dim] (K/V of this step already written). Returns [T, heads, dim]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    positions = batch.positions.tolist()
    slots = batch.slot_mapping.tolist()
    # Recover each token's block table from the batch: decode rows, then prefill chunks.
    tables: list[torch.Tensor] = [batch.decode_block_tables[i] for i in range(batch.num_decodes)]
    for chunk in batch.prefills:
        tables += [chunk.block_table] * chunk.num_tokens
    for index in range(q.shape[0]):
        context_len = positions[index] + 1
        table = tables[index]
        token_slots = [int(table[p // block_size]) * block_size + p % block_size
                       for p in range(context_len)]
        assert token_slots[-1] == slots[index]
        slot_index = torch.tensor(token_slots, dtype=torch.long, device=q.device)
        keys = k_cache.flatten(0, 1)[slot_index].repeat_interleave(group, dim=1)
        values = v_cache.flatten(0, 1)[slot_index].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[index].float(), keys.float()) / math.sqrt(head_dim)
        weights = torch.softmax(scores, dim=-1)
        out[index] = torch.einsum("hl,lhd->hd", weights, values.float()).to(q.dtype)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: ForwardBatch) -> torch.Tensor:
    """q: [T, heads, head_dim] (K/V of this step already written). Returns [T, heads, dim]."""
    return _paged_attention(q, k_cache, v_cache, batch, paged_kernel.runs(k_cache))


def invariant_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              batch: ForwardBatch) -> torch.Tensor:
    """:func:`paged_attention` for --batch-invariant: a prefill row's sums in the order a
    decode step adds them (``match_decode``), so a token recomputed after a preemption gets
    the output its decode gave."""
    return _paged_attention(q, k_cache, v_cache, batch, paged_kernel.runs(k_cache),
                            match_decode=True)


def torch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          batch: ForwardBatch) -> torch.Tensor:
    """:func:`paged_attention` without the C++ kernel."""
    return _paged_attention(q, k_cache, v_cache, batch, False)


@functools.cache
def _prefill_kernel(dtype: torch.dtype, head_dim: int, choice: str) -> str:
    """What prefill chunks of FLASH_PREFILL_ROWS+ rows (amx: AMX_PREFILL_ROWS+) run on:
    ``kernel``, ``flash`` or ``amx`` (kernel_info.prefill_attention_kernel has the rule); amx
    where this head_dim or this process cannot run it (Linux refused the tile state) is
    flash."""
    kind = kernel_info.prefill_attention_kernel(dtype, kernel_info.cpu_info().flags, choice,
                                                tuple(paged_kernel.compiled_isa()))
    if kind == "amx" and (head_dim != kernel_info.AMX_PREFILL_HEAD_DIM or
                          paged_kernel.amx_bf16_status()):
        return "flash"
    return kind


def kernel_prefill_route(batch: ForwardBatch, dtype: torch.dtype, head_dim: int,
                         match_decode: bool = False) -> str | None:
    """What this step's prefill chunks of FLASH_PREFILL_ROWS+ rows (AMX_PREFILL_ROWS+ for the
    tiles) run on when the C++ kernels run its attention
    (:func:`paged_kernel.step_attention`): ``kernel`` or ``amx``; None where one of them is
    torch's flash attention's (:func:`_prefill_kernel`), which only the Python path calls.
    --batch-invariant's rows (``match_decode``) keep the kernel: only it sums as a decode
    does."""
    if not batch.prefills or match_decode:
        return "kernel"
    kind = _prefill_kernel(dtype, head_dim, kernel_info.prefill_attention_choice())
    if kind != "flash":
        return kind
    if any(chunk.num_tokens >= kernel_info.FLASH_PREFILL_ROWS for chunk in batch.prefills):
        return None
    return "kernel"  # every chunk is shorter than flash takes


def _paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: ForwardBatch, use_kernel: bool,
                     match_decode: bool = False) -> torch.Tensor:
    if use_kernel:
        route = kernel_prefill_route(batch, q.dtype, q.shape[-1], match_decode)
        if route is not None:  # every row on the C++ kernels: one call
            return paged_kernel.step_attention(q, k_cache, v_cache, batch, route == "amx",
                                               kernel_info.AMX_PREFILL_ROWS, match_decode)
    # torch's paths: the torch decodes, or prefill chunks for flash attention
    num_decodes = batch.num_decodes
    out = torch.empty_like(q)
    if num_decodes and use_kernel:
        out[:num_decodes] = paged_kernel.decode_attention(
            q[:num_decodes], k_cache, v_cache, batch.decode_block_tables,
            batch.decode_context_lens)
    elif num_decodes:
        out[:num_decodes] = _decode_attention(q[:num_decodes], k_cache, v_cache, batch)
    for chunk in batch.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        if use_kernel and chunk.num_tokens < kernel_info.FLASH_PREFILL_ROWS:
            out[rows] = paged_kernel.prefill_attention(q[rows], k_cache, v_cache,
                                                       chunk.block_table, chunk.context_len)
        else:
            out[rows] = _prefill_attention(q[rows], k_cache, v_cache, chunk.block_table,
                                           chunk.context_len)
    return out


DECODE_GROUP = 32


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      batch: ForwardBatch) -> torch.Tensor:
    """Decodes in groups of DECODE_GROUP, each padded only to its own longest context (the
    runner orders decodes by context length, so padding stays small). A group's size comes
    from the host's copy of the lengths: nothing here waits for the device."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    lens = batch.decode_context_lens
    for start in range(0, batch.num_decodes, DECODE_GROUP):
        rows = slice(start, min(start + DECODE_GROUP, batch.num_decodes))
        num_blocks = -(-max(batch.decode_context_lens_host[rows]) // block_size)
        out[rows] = _padded_decode(q[rows], k_cache, v_cache,
                                   batch.decode_block_tables[rows, :num_blocks], lens[rows])
    return out


def _padded_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    num_decodes, num_blocks = tables.shape
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    max_len = num_blocks * block_size
    shape = (num_decodes, max_len, num_kv_heads, head_dim)
    keys = k_cache.index_select(0, tables.flatten()).view(shape).transpose(1, 2)
    values = v_cache.index_select(0, tables.flatten()).view(shape).transpose(1, 2)
    # [D, 1, 1, L]: True where the key position is inside the request's context
    mask = (torch.arange(max_len, device=context_lens.device)
            < context_lens[:, None])[:, None, None, :]
    attended = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask,
                                              enable_gqa=True)
    return attended[:, :, 0, :]


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """q: [n, heads, dim], the last n tokens of a context of ``context_len`` tokens."""
    num_tokens = q.shape[0]
    # 4-D [1, heads, tokens, dim]: ATen's CPU flash attention takes no 3-D input (3-5x slower)
    keys = _gather_blocks(k_cache, block_table)[:context_len].transpose(0, 1)[None]
    values = _gather_blocks(v_cache, block_table)[:context_len].transpose(0, 1)[None]
    query = q.transpose(0, 1)[None]
    if num_tokens == context_len:
        attended = F.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                                  enable_gqa=True)
    else:
        # query i sits at position context_len - n + i and sees keys up to there
        first = context_len - num_tokens
        mask = torch.arange(context_len, device=q.device)[None, :] <= \
            (first + torch.arange(num_tokens, device=q.device))[:, None]
        attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                  enable_gqa=True)
    return attended[0].transpose(0, 1)
