#!/usr/bin/env python
"""Preemption by recompute, swap and auto on W2 of ../shared/WORKLOADS.md, on the engine and
as the simulator predicts it, and this machine's swap-or-recompute crossover.

1. Crossover: the engine's own prices (kvserve.engine.preemption_prices): the host tier's
   copy bandwidth, timed on its copies, against the prefill rate, timed on two prefill
   steps. Swap wins for a victim when its round trip (2 x tokens x KV bytes per token /
   bandwidth) is shorter than recomputing the tokens the prefix cache lost; the prefill rate
   at which they tie is bandwidth / (2 x KV bytes per token).
2. Engine: W2 (W1's 128 requests at t=0, greedy, ignore_eos, 128 output tokens, the KV cache
   capped at 4,096 tokens, max_num_seqs 64) once per mode, with a host tier of --swap-space
   (the same tier in every mode, used only by swap and auto): wall time, preemptions by mode,
   recomputed tokens, swapped blocks and bytes, and whether each request's tokens equal the
   recompute run's.
3. Simulator: the same three configurations through kvserve.sim with the calibrated cost
   model fitted on the engine's recompute run (its steps, as ``kvserve calibrate --trace``
   fits) and the cpu-local preset's host link for the copies.

    python benchmarks/preemption.py [--n 128] [--modes recompute swap auto]
                                    [--swap-space 1GiB] [--dtype bfloat16] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import torch

from docs_section import publish
from kvserve.engine.llm import build_engine
from kvserve.engine.preemption_prices import measure_prices
from kvserve.engine.trace_runner import run_trace
from kvserve.flags import parse_bytes
from kvserve.sim.calibration import fit
from kvserve.sim.report import aggregate
from shared_workloads import w1_trace

BLOCK_SIZE = 16
SIM_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}
W2_SETTINGS: dict[str, Any] = {"max_num_seqs": 64, "max_num_batched_tokens": 2048,
                               "num_kv_blocks": 4096 // BLOCK_SIZE}


def engine_for(mode: str, dtype: str, swap_space: int) -> Any:
    return build_engine(None, dtype=dtype, block_size=BLOCK_SIZE, detokenize=False,
                        swap_space=swap_space, preemption_mode=mode, **W2_SETTINGS)


def crossover(dtype: str, swap_space: int) -> dict[str, Any]:
    engine = engine_for("recompute", dtype, swap_space)
    runner = engine.executor
    prices = measure_prices(runner, runner.host_kv_cache,
                            engine.scheduler.cache_config.num_blocks)
    per_token = prices.bytes_per_block / BLOCK_SIZE
    tie = prices.copy_bytes_per_s / (2 * per_token)
    return {"copy_gb_s": prices.copy_bytes_per_s / 1e9, "kv_bytes_per_token": per_token,
            "prefill_tok_s": prices.prefill_tok_s,
            "prefill_overhead_ms": prices.prefill_overhead_s * 1e3,
            "crossover_prefill_tok_s": tie,
            "swap_advantage": tie / prices.prefill_tok_s,
            "survival_threshold": max(0.0, 1 - prices.prefill_tok_s / tie),
            "round_trip_ms_per_1k_tokens": 2 * 1000 * per_token / prices.copy_bytes_per_s
            * 1e3,
            "recompute_ms_per_1k_tokens": prices.recompute_seconds(1000) * 1e3}


def engine_run(mode: str, dtype: str, swap_space: int, trace: list[Any]
               ) -> tuple[dict[str, Any], dict[str, list[int]], Any, Any]:
    engine = engine_for(mode, dtype, swap_space)
    start = time.perf_counter()
    run = run_trace(engine, trace, greedy=True)
    wall = time.perf_counter() - start
    stats = engine.scheduler.stats()
    tokens: dict[str, list[int]] = {}
    for chunk in run.chunks:
        tokens.setdefault(chunk.request_id, []).extend(chunk.new_token_ids)
    host = engine.executor.host_kv_cache
    report = aggregate(run.result)
    row = {"mode": mode, "side": "engine", "wall_s": wall,
           "duration_s": report["duration_s"],
           "output_tok_s": report["throughput_output_tok_s"],
           "preemptions": stats.num_preemptions,
           "by_mode": dict(stats.num_preemptions_by_mode),
           "recomputed_tokens": stats.num_recomputed_tokens,
           "swapped_out_blocks": stats.num_swapped_out_blocks,
           "swapped_in_blocks": stats.num_swapped_in_blocks,
           "swapped_bytes": (stats.num_swapped_out_blocks + stats.num_swapped_in_blocks)
           * host.bytes_per_block,
           "steps": stats.num_steps}
    configs = (engine.scheduler.config, engine.scheduler.cache_config)
    return row, tokens, run, configs


def simulated(mode: str, configs: Any, trace: list[Any], cost_model: Any, dtype: str
              ) -> dict[str, Any]:
    """``kvserve simulate``'s run of the same configuration: the calibrated model, and for
    swap and auto the copies priced over the cpu-local preset's host link."""
    from kvserve.sim.presets import get_hardware, get_model
    from kvserve.sim.simulator import Simulator
    from kvserve.sim.swap import SimPreemptionPrices, WithSwapCopies

    config, cache = configs
    prices = None
    if config.preemption_mode != "recompute":
        prices = SimPreemptionPrices(cost_model, get_model("smollm2-135m"),
                                     get_hardware("cpu-local"), SIM_DTYPES[dtype], 1,
                                     cache.block_size)
        cost_model = WithSwapCopies(cost_model, prices)
    result = Simulator(config, cache, cost_model, preemption_prices=prices).run(trace)
    report = aggregate(result)
    out_blocks, in_blocks = report.get("swapped_out_blocks"), report.get("swapped_in_blocks")
    return {"mode": mode, "side": "simulator", "wall_s": None,
            "duration_s": report["duration_s"],
            "output_tok_s": report["throughput_output_tok_s"],
            "preemptions": report["num_preemptions"],
            "by_mode": report.get("preemptions_by_mode"),
            "recomputed_tokens": report["recomputed_tokens"],
            "swapped_out_blocks": out_blocks, "swapped_in_blocks": in_blocks,
            "swapped_bytes": None if out_blocks is None else
            report["swapped_out_bytes"] + report["swapped_in_bytes"],
            "steps": report["num_steps"]}


def cpu_line() -> str:
    from kvserve.model.kernel_info import cpu_info

    cpu = cpu_info()
    flags = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
                      if f in cpu.flags)
    return f"{cpu.name} ({flags or 'no AVX flags read'})"


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def markdown(cross: dict[str, Any], rows: list[dict[str, Any]], command: str, load: str,
             same: dict[str, str], swap_space: int) -> str:
    lines = [
        "## Preemption: recompute, swap, auto (W2)", "",
        f"`{command}` on {cpu_line()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; load before the run: {load}. SmolLM2-135M-Instruct, "
        f"block size {BLOCK_SIZE}, host tier {swap_space / (1 << 30):g} GiB in every mode "
        "(used by swap and auto only); model load excluded.", "",
        "**This machine's crossover** (the engine's measured prices): host-tier copy "
        f"{cross['copy_gb_s']:.1f} GB/s per direction for {cross['kv_bytes_per_token']:,.0f} B "
        f"of KV per token, so a round trip costs {cross['round_trip_ms_per_1k_tokens']:.2f} ms "
        f"per 1,000 tokens; a prefill runs {cross['prefill_tok_s']:,.0f} tok/s (+ "
        f"{cross['prefill_overhead_ms']:.1f} ms a step), {cross['recompute_ms_per_1k_tokens']:.0f}"
        " ms per 1,000 tokens. They would tie at a prefill rate of "
        f"{cross['crossover_prefill_tok_s']:,.0f} tok/s: swap is "
        f"{cross['swap_advantage']:,.0f}x cheaper for a cold victim, and recompute wins only "
        f"when more than {cross['survival_threshold']:.2%} of the victim survives in the "
        "prefix cache.", "",
        "| mode | side | wall s | duration s | output tok/s | preemptions | recomputed tokens "
        "| swapped blocks out / in | swapped bytes | steps | tokens = recompute run's |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same_tokens = same.get(r["mode"], "") if r["side"] == "engine" else ""
        by_mode = r.get("by_mode")
        preempt = fmt(r["preemptions"])
        if by_mode:
            preempt += f" ({by_mode.get('recompute', 0)} recompute, {by_mode.get('swap', 0)} swap)"
        blocks = "—" if r["swapped_out_blocks"] is None else \
            f"{r['swapped_out_blocks']:,} / {r['swapped_in_blocks']:,}"
        swapped = "—" if r["swapped_bytes"] is None else f"{r['swapped_bytes'] / 1e6:,.1f} MB"
        lines.append(f"| {r['mode']} | {r['side']} | {fmt(r['wall_s'])} | "
                     f"{fmt(r['duration_s'])} | {fmt(r['output_tok_s'], 0)} | {preempt} | "
                     f"{fmt(r['recomputed_tokens'])} | {blocks} | {swapped} | "
                     f"{fmt(r['steps'])} | {same_tokens} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=128, help="first N requests of W1/W2")
    parser.add_argument("--modes", nargs="+", default=["recompute", "swap", "auto"],
                        choices=("recompute", "swap", "auto"))
    parser.add_argument("--swap-space", type=parse_bytes, default=parse_bytes("1GiB"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    load = load.split("load average:")[-1].strip() if "load average" in load else load
    load = f"load average {load} (2 cores)"
    trace = w1_trace(args.n)
    cross = crossover(args.dtype, args.swap_space)
    print(json.dumps(cross), flush=True)
    rows: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    tokens: dict[str, dict[str, list[int]]] = {}
    for mode in args.modes:
        row, tokens[mode], run, configs = engine_run(mode, args.dtype, args.swap_space, trace)
        runs[mode] = (run, configs)
        print(json.dumps(row), flush=True)
        rows.append(row)
    base = args.modes[0]
    same = {mode: f"{sum(tokens[mode][rid] == tokens[base][rid] for rid in tokens[base])}"
                  f" / {len(tokens[base])}" for mode in args.modes}
    # The simulator, with the calibrated model fitted on the first mode's engine steps.
    steps = [s for s in runs[base][0].steps if s.shape is not None]
    cost_model = fit([s.shape for s in steps], [s.duration for s in steps],
                     source=f"W2 {base} engine run: {len(steps)} steps")
    for mode in args.modes:
        row = simulated(mode, runs[mode][1], trace, cost_model, args.dtype)
        print(json.dumps(row), flush=True)
        rows.append(row)
    rows.sort(key=lambda r: (args.modes.index(r["mode"]), r["side"]))
    command = "python benchmarks/preemption.py " + " ".join(sys.argv[1:])
    section = markdown(cross, rows, command, load, same, args.swap_space)
    publish("preemption", section, [cross, *rows], args.json, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
