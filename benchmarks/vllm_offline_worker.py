"""vLLM's side of benchmarks/offline_ab.py: run by the vLLM venv's Python, it builds one
``vllm.LLM`` (as ../shared/bench/bench_vllm_offline.py does: bf16 unless ``--dtype`` says
float32, max model length 1024,
prefix caching off, seed 0; warmed up on two short requests), then runs the first N requests
of W1 once per line read from stdin and prints one JSON line per run (wall seconds, tokens,
preemptions). One start serves every pair: vLLM compiles for minutes at start-up.

    $PEERS_DIR/venvs/vllm/bin/python benchmarks/vllm_offline_worker.py BENCH_DIR [flags]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bench_dir", help="../shared/bench (workload.py, the model's path)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--kv-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    args = parser.parse_args()
    sys.path.insert(0, args.bench_dir)
    import workload
    from bench_vllm_offline import PEERS_DIR, metric_value
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings: dict = dict(model=args.model or os.path.join(PEERS_DIR, "smollm2-hf"),
                          dtype=args.dtype, max_model_len=1024, disable_log_stats=False,
                          enable_prefix_caching=False, seed=0,
                          kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)))
    if args.block_size:
        settings["block_size"] = args.block_size
    if args.kv_blocks:
        settings["num_gpu_blocks_override"] = args.kv_blocks
    if args.max_num_seqs:
        settings["max_num_seqs"] = args.max_num_seqs
    llm = LLM(**settings)
    requests = workload.w1(n=args.n)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=list(range(1000, 1064)))] * 2,
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        before = metric_value(llm.get_metrics(), "vllm:num_preemptions") or 0.0
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = metric_value(llm.get_metrics(), "vllm:num_preemptions")
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        num_in = sum(len(r["prompt_token_ids"]) for r in requests)
        print(json.dumps({"wall_s": wall, "output_tok_s": num_out / wall,
                          "prompt_tokens": num_in, "output_tokens": num_out,
                          "preemptions": None if after is None else after - before}),
              flush=True)


if __name__ == "__main__":
    main()
