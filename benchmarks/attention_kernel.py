"""The C++ paged attention kernel against attention.py's torch path, on a W1-like decode batch.

128 decode requests with contexts uniform in [64, 640], SmolLM2-135M's attention shape (9 query
heads, 3 KV heads, head_dim 64), block size 16, shuffled block tables; float32 and bfloat16
caches. A = ``kvserve.model.attention._decode_attention`` (gather + masked SDPA), B = the kernel,
timed alternately (A B A B ...), medians (and minima: on a shared machine the minimum is the
steadier estimate of either side's own cost). ``--prefill`` adds prefill chunks against
``_prefill_attention`` (4-D SDPA: ATen's flash attention, which a bf16 chunk of 16+ rows runs
on an AMX CPU; ``KVSERVE_PREFILL_ATTENTION``, docs/kernels.md) and, where the build has
them, a table of bf16 chunks on kvserve's own AMX tiles (csrc/attention_amx.h) against flash
and the kernel, the three alternated. Run from the repository root:

    .venv/bin/python benchmarks/attention_kernel.py [--reps 15] [--prefill] [--threads N]
    .venv/bin/python benchmarks/attention_kernel.py --block-runs [--requests 64] [--context 512]

``--block-runs`` times the kernel instead on how the KV blocks lie (the layout term of the
calibrated cost model, docs/fidelity.md): one decode step over 30 layers of a 1 GiB bf16
pool, SmolLM2's shape, every request's blocks in runs of r consecutive ids at shuffled
places (r = 1: fully scattered), alternated; each row's share of the fully scattered
penalty, against the 1/r the per-scattered-token term charges.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from kvserve.model import paged_kernel
from kvserve.model.attention import _decode_attention, _prefill_attention
from kvserve.model.input_batch import ForwardBatch

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def decode_case(num_requests: int, dtype: torch.dtype, sort: bool,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(64, 641, (num_requests,), generator=gen)
    if sort:  # the runner orders decodes by context length
        lens = lens.sort(descending=True).values
    needed = (lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = int(needed.sum()) + 64
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros((num_requests, int(needed.max())), dtype=torch.long)
    start = 0
    for row, count in enumerate(needed.tolist()):
        tables[row, :count] = perm[start:start + count]
        start += count
    q = torch.randn((num_requests, HEADS, HEAD_DIM), generator=gen).to(dtype)
    positions = lens - 1
    slots = tables[torch.arange(num_requests), positions // BLOCK_SIZE] * BLOCK_SIZE \
        + positions % BLOCK_SIZE
    batch = ForwardBatch(
        input_ids=torch.zeros(num_requests, dtype=torch.long), positions=positions,
        slot_mapping=slots, num_decodes=num_requests, decode_block_tables=tables,
        decode_context_lens=lens, decode_context_lens_host=tuple(lens.tolist()), prefills=[],
        logits_indices=torch.arange(num_requests))
    return q, k_cache, v_cache, batch


def alternate(fns: list[Callable[[], torch.Tensor]], reps: int) -> list[tuple[float, float]]:
    """(median, min) seconds of each fn, run round-robin after one warm-up each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for index, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[index].append(time.perf_counter() - start)
    return [(statistics.median(t), min(t)) for t in times]


def row(label: str, torch_s: tuple[float, float], kernel_s: tuple[float, float],
        max_diff: float) -> None:
    print(f"| {label:<34} | {torch_s[0] * 1e3:8.2f} | {kernel_s[0] * 1e3:8.2f} | "
          f"{torch_s[0] / kernel_s[0]:6.1f}x | {torch_s[1] * 1e3:8.2f} | {kernel_s[1] * 1e3:8.2f} "
          f"| {torch_s[1] / kernel_s[1]:6.1f}x | {max_diff:.1e} |")


def block_runs(num_requests: int, context_len: int, reps: int) -> None:
    layers = 30
    num_blocks = (1 << 30) // (BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2 * 2 * layers)
    needed = -(-context_len // BLOCK_SIZE)
    if num_requests * needed > num_blocks:
        raise SystemExit(f"{num_requests} x {context_len} tokens do not fit the 1 GiB pool "
                         f"({num_blocks} blocks of {BLOCK_SIZE})")
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, generator=gen).to(torch.bfloat16),
               torch.randn(shape, generator=gen).to(torch.bfloat16)) for _ in range(layers)]
    lens = torch.full((num_requests,), context_len)
    q = torch.randn((num_requests, HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16)

    def table(run: int) -> torch.Tensor:  # run 0: one consecutive stretch
        total = num_requests * needed
        if run == 0:
            return torch.arange(total).reshape(num_requests, needed)
        starts = torch.randperm(num_blocks // run, generator=gen)[:-(-total // run)] * run
        ids = (starts[:, None] + torch.arange(run)[None, :]).reshape(-1)[:total]
        return ids.reshape(num_requests, needed)

    runs = (1, 2, 4, 8, 16, 0)
    tables = [table(run) for run in runs]

    def step(t: torch.Tensor) -> torch.Tensor:
        for k, v in caches:
            out = paged_kernel.decode_attention(q, k, v, t, lens)
        return out

    steps = [lambda t=t: step(t) for t in tables]
    medians = [median for median, _ in alternate(steps, reps)]
    scattered, consecutive = medians[0], medians[-1]
    print(f"{num_requests} decode requests x {context_len} tokens, 30 layers, bf16, "
          f"{torch.get_num_threads()} threads, {reps} alternating reps, medians")
    print()
    print("| blocks | step ms | share of the scattered penalty | term charges (1/r) |")
    print("|---|---|---|---|")
    for run, median in zip(runs, medians, strict=True):
        share = (median - consecutive) / (scattered - consecutive)
        label = "consecutive" if run == 0 else f"runs of {run}"
        print(f"| {label} | {median * 1e3:.2f} | {share:.2f} | "
              f"{0 if run == 0 else 1 / run:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--requests", type=int, default=None,
                        help="decode requests (default 128; 64 with --block-runs, which "
                             "must fit them in a 1 GiB pool)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prefill", action="store_true", help="also time prefill chunks")
    parser.add_argument("--block-runs", action="store_true",
                        help="time one decode step by how its blocks lie instead")
    parser.add_argument("--context", type=int, default=512, help="--block-runs' context")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if not paged_kernel.available():
        raise SystemExit(f"kernel unavailable: {paged_kernel.unavailable_reason()}")
    if args.block_runs:
        block_runs(args.requests or 64, args.context, args.reps)
        return
    args.requests = args.requests or 128
    print(f"kernel ready in {time.perf_counter() - start:.1f} s; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.reps} alternating reps, medians")
    print()
    notes: list[str] = []
    print(f"{args.requests} decode requests, contexts uniform in [64, 640]; heads {HEADS}, "
          f"kv heads {KV_HEADS}, head_dim {HEAD_DIM}, block size {BLOCK_SIZE}")
    print()
    print("| case (ms: median, then min)        |    torch |   kernel |  ratio |    torch |"
          "   kernel |  ratio | max diff |")
    print("|------------------------------------|----------|----------|--------|----------|"
          "----------|--------|----------|")
    for dtype in (torch.float32, torch.bfloat16):
        for sort in (True, False):
            q, k_cache, v_cache, batch = decode_case(args.requests, dtype, sort)
            lens, tables = batch.decode_context_lens, batch.decode_block_tables

            def run_torch(q=q, k=k_cache, v=v_cache, b=batch) -> torch.Tensor:
                return _decode_attention(q, k, v, b)

            def run_kernel(q=q, k=k_cache, v=v_cache, t=tables, n=lens) -> torch.Tensor:
                return paged_kernel.decode_attention(q, k, v, t, n)

            diff = (run_torch().float() - run_kernel().float()).abs().max().item()
            torch_s, kernel_s = alternate([run_torch, run_kernel], args.reps)
            tokens = int(lens.sum())
            kv_bytes = 2 * tokens * KV_HEADS * HEAD_DIM * k_cache.element_size()
            order = "by length" if sort else "random order"
            row(f"decode {str(dtype)[6:]}, {order}", torch_s, kernel_s, diff)
            notes.append(f"decode {str(dtype)[6:]}, {order}: {tokens} context tokens, "
                         f"{kv_bytes / 1e6:.0f} MB of K+V read, kernel at "
                         f"{kv_bytes / kernel_s[0] / 1e9:.1f} GB/s (median)")
    if not args.prefill:
        print()
        print("\n".join(notes))
        return
    for dtype in (torch.float32, torch.bfloat16):
        for num_tokens, context_len in ((16, 512), (64, 64), (64, 512), (128, 128), (300, 300),
                                        (512, 512), (256, 640)):
            q, k_cache, v_cache, _ = decode_case(1, dtype, True, seed=num_tokens + context_len)
            gen = torch.Generator().manual_seed(1)
            num_blocks = k_cache.shape[0]
            needed = -(-context_len // BLOCK_SIZE)
            if num_blocks < needed:
                shape = (needed + 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
                k_cache = torch.randn(shape, generator=gen).to(dtype)
                v_cache = torch.randn(shape, generator=gen).to(dtype)
            table = torch.randperm(k_cache.shape[0], generator=gen)[:needed]
            q = torch.randn((num_tokens, HEADS, HEAD_DIM), generator=gen).to(dtype)

            def run_torch(q=q, k=k_cache, v=v_cache, t=table, n=context_len) -> torch.Tensor:
                return _prefill_attention(q, k, v, t, n)

            def run_kernel(q=q, k=k_cache, v=v_cache, t=table, n=context_len) -> torch.Tensor:
                return paged_kernel.prefill_attention(q, k, v, t, n)

            diff = (run_torch().float() - run_kernel().float()).abs().max().item()
            torch_s, kernel_s = alternate([run_torch, run_kernel], args.reps)
            row(f"prefill {str(dtype)[6:]} {num_tokens} q, context {context_len}", torch_s,
                kernel_s, diff)
    amx_table(args.reps)
    print()
    print("\n".join(notes))


AMX_SHAPES = ((16, 16), (17, 40), (64, 64), (16, 512), (64, 512), (128, 128), (300, 300),
              (512, 512), (256, 640), (33, 1000))


def amx_table(reps: int) -> None:
    """bf16 prefill chunks on the AMX tiles, flash and the C++ kernel, alternated (minima)."""
    status = paged_kernel.amx_bf16_status()
    if status:
        print(f"\n(no AMX prefill table: {status})")
        return
    print("\nbf16 prefill chunks, minima of the three alternated (ms):\n")
    print("| rows, context | AMX tiles | flash | C++ kernel | flash / AMX | kernel / AMX | "
          "max diff AMX vs flash |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(2)
    for num_tokens, context_len in AMX_SHAPES:
        needed = -(-context_len // BLOCK_SIZE)
        shape = (needed + 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
        v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
        table = torch.randperm(shape[0], generator=gen)[:needed]
        q = torch.randn((num_tokens, HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16)
        args = (q, k_cache, v_cache, table, context_len)
        fns = [functools.partial(fn, *args) for fn in (
            paged_kernel.amx_prefill_attention, _prefill_attention,
            paged_kernel.prefill_attention)]
        diff = (fns[0]().float() - fns[1]().float()).abs().max().item()
        (_, amx), (_, flash), (_, kernel) = alternate(fns, reps)
        print(f"| {num_tokens}, {context_len} | {amx * 1e3:.3f} | {flash * 1e3:.3f} | "
              f"{kernel * 1e3:.3f} | {flash / amx:.2f}x | {kernel / amx:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
