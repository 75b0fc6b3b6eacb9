#!/usr/bin/env python
"""Offline throughput on W1 and W2 of ../shared/WORKLOADS.md with the real model.

W1: 128 requests, prompt lengths uniform in [64, 512] (token ids), greedy, ignore_eos,
max_tokens 128, all submitted at once. W2: the same requests with the KV cache capped at
4,096 tokens and max_num_seqs 64. Wall time excludes model loading.

    python benchmarks/offline_throughput.py [--workload w1 w2] [--dtype auto] [--n 128]
                                            [--quantization int8] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

# A dedicated offline run: spinning OpenMP threads are ~20% faster in decode on an idle
# machine (kvserve defaults to passive waiting, which is safe when anything else runs).
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import numpy as np
import torch

from docs_section import publish
from kvserve.core import SamplingParams
from kvserve.engine.llm import LLM
from kvserve.flags import parse_bytes
from kvserve.model.dtype import auto_dtype_name

W1_FIRST_IDS = [36058, 12649, 36180, 27207, 35725]  # ../shared/WORKLOADS.md
PEERS = {"w1": "vLLM CPU 0.32.0 (bf16, torch.compile): 49.5 s, 331 output tok/s; "
               "58-60 s with 29 preemptions in a 1 GiB KV cache",
         "w2": "vLLM CPU 0.32.0: 84.2 s, 48-49 preemptions"}


def w1_prompts(n: int = 128, seed: int = 0) -> list[list[int]]:
    """The exact W1 draw: numpy default_rng(0), lengths first, then each prompt in order."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 513, size=128)
    prompts = [rng.integers(1000, 40000, size=int(n_tokens)).tolist() for n_tokens in lengths]
    assert prompts[0][:5] == W1_FIRST_IDS, "W1 generator drifted from WORKLOADS.md"
    return prompts[:n]


def run(workload: str, n: int, dtype: str, block_size: int, kv_cache_memory: int,
        max_num_batched_tokens: int = 2048, quantization: str | None = None) -> dict:
    settings: dict = {"max_num_seqs": 256, "max_num_batched_tokens": max_num_batched_tokens,
                      "kv_cache_memory": kv_cache_memory}
    if workload == "w2":
        settings.update(max_num_seqs=64, num_kv_blocks=4096 // block_size)
    if dtype == "auto":  # named as resolved, so a row says what ran
        dtype = auto_dtype_name()
    llm = LLM(None, dtype=dtype, block_size=block_size, detokenize=False,
              quantization=quantization, **settings)
    prompts = w1_prompts(n)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = llm.engine.scheduler.stats()
    num_prompt = sum(len(p) for p in prompts)
    num_output = sum(len(r.token_ids) for r in results)
    assert num_output == 128 * len(prompts)
    return dict(workload=workload, n=len(prompts), dtype=dtype, quantization=quantization,
                block_size=block_size,
                kv_cache=f"{llm.engine.scheduler.cache_config.num_token_slots} tokens",
                wall_s=wall, output_tok_s=num_output / wall,
                total_tok_s=(num_prompt + num_output) / wall, prompt_tokens=num_prompt,
                output_tokens=num_output, preemptions=stats.num_preemptions,
                recomputed_tokens=stats.num_recomputed_tokens, steps=stats.num_steps,
                threads=torch.get_num_threads())


def markdown(rows: list[dict], command: str) -> str:
    lines = ["## Offline throughput (W1, W2)", "",
             f"`{command}` on {platform.machine()}, {torch.get_num_threads()} threads, "
             f"torch {torch.__version__}; model load excluded.", "",
             "| workload | requests | dtype | KV cache | wall s | output tok/s | total tok/s "
             "| preemptions | recomputed tokens | peer on this machine |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dtype = r["dtype"] + (f" + {r['quantization']}" if r.get("quantization") else "")
        lines.append(f"| {r['workload'].upper()} | {r['n']} | {dtype} | {r['kv_cache']} "
                     f"| {r['wall_s']:.1f} "
                     f"| {r['output_tok_s']:.0f} | {r['total_tok_s']:.0f} | {r['preemptions']} "
                     f"| {r['recomputed_tokens']} | {PEERS[r['workload']]} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", nargs="+", default=["w1", "w2"], choices=("w1", "w2"))
    parser.add_argument("--n", type=int, default=128, help="first N requests (32: quick)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="auto (the default): bf16 where the CPU computes it natively "
                             "(AMX or AVX512-BF16), else float32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("1GiB"),
                        help="W1's KV cache (W2 always holds 4,096 tokens)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the step's token budget (vLLM's CPU LLM class defaults to 4096)")
    parser.add_argument("--quantization", "-q", choices=("int8",), default=None,
                        help="int8: W8A8 projections (docs/quantization.md)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    rows = []
    for workload in args.workload:
        row = run(workload, args.n, args.dtype, args.block_size, args.kv_cache_memory,
                  args.max_num_batched_tokens, args.quantization)
        print(json.dumps(row), flush=True)
        rows.append(row)
    section = markdown(rows, "python benchmarks/offline_throughput.py " + " ".join(sys.argv[1:]))
    publish("offline_throughput", section, rows, args.json, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
