#!/usr/bin/env python
"""What ``--batch-invariant`` costs: the engine with and without it, alternated, on W1 and
W3 of ../shared/WORKLOADS.md (the bundled SmolLM2-135M in ``--dtype``, default bf16).

W1: the first ``--w1-n`` requests (default 32, the documented quick form), offline, all at
once; wall seconds (model load excluded) and output tok/s. W3: the first ``--w3-n`` requests
of W3 (Poisson 4 req/s, max_tokens 32-256) replayed in-process on the wall clock
(kvserve.engine.trace_runner, as benchmarks/fidelity.py drives the engine): TTFT p50, ITL
p50, output tok/s. Every run is a fresh process; each pair runs both modes, which one first
alternating. Ratios are invariant / default (above 1: the mode costs that much). Also counts
the W1 requests whose greedy tokens are the same in both modes (the invariant kernel rounds
its sums in another order than oneDNN, so bf16 texts may part). With --write-docs the
section for this CPU and dtype in docs/benchmarks.md is replaced (one per CPU tier, as the
projection kernel the mode uses depends on it: docs/kernels.md).

    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/batch_invariant.py \\
        [--pairs 2] [--w1-n 32] [--w3-n 30] [--threads N] [--dtype float32] [--write-docs]

``--threads`` sets torch's intra-op threads of the runs (default: torch's own, the cores).
On a machine shared with other jobs one thread measures the kernels more steadily: with two
threads every parallel region's barrier waits for whichever thread the OS has descheduled.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ab_protocol as ab

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
MODES = ("default", "invariant")


def w1_worker(mode: str, n: int, dtype: str) -> dict[str, Any]:
    from kvserve.core import SamplingParams
    from kvserve.engine.llm import LLM
    from offline_throughput import w1_prompts

    llm = LLM(None, dtype=dtype, detokenize=False, max_num_seqs=256,
              max_num_batched_tokens=2048, kv_cache_memory=2 << 30,
              batch_invariant=mode == "invariant")
    prompts = w1_prompts(n)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    output = sum(len(r.token_ids) for r in results)
    return {"wall_s": wall, "output_tok_s": output / wall,
            "digests": [hashlib.sha256(str(r.token_ids).encode()).hexdigest()[:16]
                        for r in results]}


def w3_worker(mode: str, n: int, dtype: str) -> dict[str, Any]:
    from kvserve.engine.llm import build_engine
    from kvserve.engine.trace_runner import run_trace
    from kvserve.sim.report import aggregate
    from shared_workloads import w3_trace

    engine = build_engine(None, dtype=dtype, detokenize=False,
                          batch_invariant=mode == "invariant")
    figures = aggregate(run_trace(engine, w3_trace(n), greedy=True).result)
    return {key: figures[key] for key in ("ttft_p50", "itl_p50", "throughput_output_tok_s",
                                          "duration_s")}


def run(workload: str, mode: str, n: int, threads: int | None, dtype: str) -> dict[str, Any]:
    """One run in a fresh process (this script as its own worker)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{BENCHMARKS}")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run([sys.executable, __file__, "--worker", workload, "--mode", mode,
                          "--n", str(n), "--dtype", dtype],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{workload} {mode} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def load() -> str:
    return " / ".join(Path("/proc/loadavg").read_text().split()[:3])


def ratio_row(name: str, pairs: list[dict[str, dict[str, Any]]], key: str, unit: str,
              scale: float = 1.0) -> str:
    default = [p["default"][key] * scale for p in pairs]
    invariant = [p["invariant"][key] * scale for p in pairs]
    ratios = [i / d for d, i in zip(default, invariant, strict=True)]
    return (f"| {name} | {' / '.join(f'{v:.1f}' for v in default)} {unit} "
            f"| {' / '.join(f'{v:.1f}' for v in invariant)} {unit} "
            f"| {' / '.join(f'{r:.2f}' for r in ratios)} | **{statistics.median(ratios):.2f}** |")


def markdown(w1: list[dict[str, Any]], w3: list[dict[str, Any]], args: argparse.Namespace,
             command: str, loads: list[str]) -> str:
    from kvserve.model.kernel_info import cpu_info, isa_line

    cpu = cpu_info()
    lines = [f"## The cost of --batch-invariant on {ab.cpu_title(*ab.cpu())}, {args.dtype}", "",
             f"`{command}`: CPU {cpu.name}, {cpu.logical_cpus} logical CPUs; ISA: "
             f"{isa_line(cpu)}. Load average (1, 5, 15 min) at the start and at the end: "
             f"{loads[0]}; {loads[-1]} (a machine shared with other jobs, so the absolute "
             "figures are slow; the ratios come from runs alternated on the same machine).",
             "", f"{args.dtype}, the bundled SmolLM2-135M, {args.threads or 'all'} torch "
             f"thread(s) per run; {max(len(w1), len(w3))} pairs of fresh processes, which "
             "mode first alternating. Ratio = invariant / default: above 1, --batch-invariant "
             "costs that much (for output tok/s, below 1).", "",
             "| figure | default (per pair) | --batch-invariant (per pair) | ratio per pair "
             "| median ratio |", "|---|---|---|---|---|"]
    if w1:
        lines.append(ratio_row(f"W1 first {args.w1_n}, wall", w1, "wall_s", "s"))
        lines.append(ratio_row(f"W1 first {args.w1_n}, output tok/s", w1, "output_tok_s", ""))
    if w3:
        lines.append(ratio_row(f"W3 first {args.w3_n}, TTFT p50", w3, "ttft_p50", "ms", 1e3))
        lines.append(ratio_row(f"W3 first {args.w3_n}, ITL p50", w3, "itl_p50", "ms", 1e3))
        lines.append(ratio_row(f"W3 first {args.w3_n}, output tok/s", w3,
                               "throughput_output_tok_s", ""))
    if w1:
        same = sum(a == b for a, b in zip(w1[0]["default"]["digests"],
                                          w1[0]["invariant"]["digests"], strict=True))
        stable = all(p[m]["digests"] == w1[0][m]["digests"] for p in w1 for m in MODES)
        lines += ["", f"W1's greedy tokens: {same} of {args.w1_n} requests the same in both "
                  "modes (the mode sums attention in decode's order, and where it "
                  "changes the projection kernel that rounds differently too); each mode "
                  "gave the same tokens in every pair: "
                  f"{'yes' if stable else 'no'}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--w1-n", type=int, default=32, help="W1 requests (0: skip)")
    parser.add_argument("--w3-n", type=int, default=30, help="W3 requests (0: skip)")
    parser.add_argument("--threads", type=int, help="torch threads per run")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--json", help="write the runs as JSON")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--worker", choices=("w1", "w3"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker = w1_worker if args.worker == "w1" else w3_worker
        print(json.dumps(worker(args.mode, args.n, args.dtype)))
        return 0
    sys.path.insert(0, str(ROOT / "src"))
    from docs_section import publish

    command = "python benchmarks/batch_invariant.py " + " ".join(sys.argv[1:])
    loads = [load()]
    runs: dict[str, list[dict[str, Any]]] = {"w1": [], "w3": []}
    for index in range(args.pairs):
        order = MODES if index % 2 == 0 else MODES[::-1]
        for workload, n in (("w1", args.w1_n), ("w3", args.w3_n)):
            if not n:
                continue
            pair = {}
            for mode in order:
                pair[mode] = run(workload, mode, n, args.threads, args.dtype)
                shown = {k: v for k, v in pair[mode].items() if k != "digests"}
                print(f"pair {index + 1} {workload} {mode}: {shown}", flush=True)
            runs[workload].append(pair)
    loads.append(load())
    section = markdown(runs["w1"], runs["w3"], args, command.strip(), loads)
    name = f"batch_invariant:{ab.cpu_slug(*ab.cpu())}:{args.dtype}"
    publish(name, section, runs, args.json, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
