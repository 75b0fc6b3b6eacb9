"""The engine half of benchmarks/data_parallel.py: data-parallel replicas on this machine.

One short multi-turn conversation trace (each turn's prompt holds the conversation so far, so
only the replica that served the last turn holds its history) is replayed on the wall clock
against engine replicas in processes of their own (the server's ``DataParallelEngine``,
without HTTP): one replica with 2 torch threads, and two replicas with one thread each under
each router. Then ``kvserve simulate --data-parallel-size 2`` runs the same trace file under
each router, to check that the simulator orders the routers as the engine does.

Requests are added when their arrival time comes; TTFT is measured in this process (add to
first token chunk), so it includes the pipe to the replica. The prefix hit rate is the
replicas' own prefix-cache counters (tokens hit / tokens looked up) over the trace, after one
warm-up request per replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.core import SamplingParams
from kvserve.sim.trace import TraceRequest, write_trace
from kvserve.sim.workloads import WorkloadSpec, generate

ROOT = Path(__file__).resolve().parents[1]
SEED = 0  # the simulator's default --seed: the same synthetic prompt ids
CONFIGS = ((1, 2, "least-loaded"), (2, 1, "round-robin"), (2, 1, "least-loaded"),
           (2, 1, "prefix-affinity"))
SIM_FLAGS = ["--model", "smollm2-135m", "--hardware", "cpu-local", "--dtype", "bfloat16",
             "--kv-cache-memory", "1GiB"]


def conversations(num_requests: int, rate: float, seed: int = 1) -> list[TraceRequest]:
    """Multi-turn chat: conversations start at ``rate``/s, 3-6 turns 1.5 s apart on average,
    64-160 new tokens a turn, 16-32 tokens out; prompt ids written out."""
    spec = WorkloadSpec(num_requests=num_requests, rate=rate, turns="uniform:3,6",
                        think_time=1.5, prompt_len="uniform:64,160",
                        output_len="uniform:16,32", ignore_eos=True, seed=seed)
    return [dataclasses.replace(r, prompt_token_ids=tuple(r.synthesise_prompt(SEED)),
                                prompt_len=None, prefix_id=None, prefix_len=0,
                                max_tokens=r.output_len)
            for r in generate(spec)]


def replicas(size: int, threads: int, router: str, wait_policy: str) -> Any:
    from kvserve.core.router import make_router
    from kvserve.engine.data_parallel import DataParallelEngine, replica_launchers
    from kvserve.engine.engine_process import EngineSpec
    from kvserve.engine.llm import build_engine

    spec = EngineSpec(functools.partial(build_engine, None, dtype="bfloat16"), threads=threads,
                      wait_policy=wait_policy)
    return DataParallelEngine(spec, None, replica_launchers(size, "mp"),
                              make_router(router, size))


async def _replay(engine: Any, trace: list[TraceRequest]) -> dict[str, Any]:
    engine.start()
    for index, replica in enumerate(engine.replicas):  # warm-up, apart from the trace
        stream = await replica.add_requests([(f"warm-{index}", [5 + index] * 48,
                                              SamplingParams(max_tokens=4, ignore_eos=True))])
        async for _ in stream:
            pass
    before = [(f.stats.prefix_cache_hits, f.stats.prefix_cache_queries)
              for f in engine.engine_figures()]
    ttfts: list[float] = []
    e2es: list[float] = []
    tokens = 0
    start = time.monotonic()

    async def one(request: TraceRequest) -> None:
        nonlocal tokens
        await asyncio.sleep(max(0.0, start + request.arrival_time - time.monotonic()))
        sent = time.monotonic()
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0,
                                ignore_eos=True)
        stream = await engine.add_requests(
            [(request.request_id, list(request.prompt_token_ids), params)], sent)
        first = None
        async for chunk in stream:
            if chunk.new_token_ids and first is None:
                first = time.monotonic()
            tokens += len(chunk.new_token_ids)
        ttfts.append((first or time.monotonic()) - sent)
        e2es.append(time.monotonic() - sent)
    await asyncio.gather(*(one(r) for r in trace))
    duration = time.monotonic() - start
    after = [(f.stats.prefix_cache_hits, f.stats.prefix_cache_queries)
             for f in engine.engine_figures()]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    decisions = engine.router_figures().decisions
    per_replica = [sum(c for (i, _), c in decisions.items() if i == r)
                   for r in range(engine.num_replicas)]
    reasons: dict[str, int] = {}
    for (_, reason), count in decisions.items():
        reasons[reason] = reasons.get(reason, 0) + count
    await engine.stop()
    return {"prefix_hit_rate": hits / queries if queries else 0.0,
            "ttft_p50": float(np.percentile(ttfts, 50)),
            "ttft_p90": float(np.percentile(ttfts, 90)),
            "e2e_p50": float(np.percentile(e2es, 50)),
            "e2e_p90": float(np.percentile(e2es, 90)),
            "duration_s": duration, "output_tok_s": tokens / duration,
            "busiest_replica_share": max(per_replica) / max(1, sum(per_replica)),
            "decisions": dict(sorted(reasons.items()))}


def run_engine(trace: list[TraceRequest], size: int, threads: int, router: str,
               wait_policy: str) -> dict[str, Any]:
    engine = replicas(size, threads, router, wait_policy)
    return asyncio.run(_replay(engine, trace))


def simulate(trace_path: Path, size: int, router: str) -> tuple[dict[str, Any], str]:
    """``kvserve simulate`` on the trace file: its aggregate figures, and the command."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        argv = ["simulate", "--trace", str(trace_path), *SIM_FLAGS,
                "--data-parallel-size", str(size), "--router", router]
        subprocess.run([sys.executable, "-m", "kvserve", *argv, "--report", str(report)],
                       check=True, capture_output=True, env={**os.environ,
                                                             "PYTHONPATH": str(ROOT / "src")})
        aggregate = json.loads(report.read_text())["aggregate"]
    return aggregate, "kvserve " + " ".join(argv).replace(str(trace_path), "TRACE")


def ms(value: float) -> str:
    return f"{value * 1000:,.0f}"


def engine_study(num_requests: int, rate: float, rounds: int,
                 wait_policy: str) -> tuple[str, dict[str, Any]]:
    """Each configuration ``rounds`` times, the order reversed every other round (so drift
    in the machine's load falls on all alike); the median run of each is reported."""
    trace = conversations(num_requests, rate)
    runs: dict[tuple[int, int, str], list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for round_index in range(rounds):
        for config in CONFIGS if round_index % 2 == 0 else CONFIGS[::-1]:
            runs[config].append(run_engine(trace, *config, wait_policy))
            print(f"round {round_index}: {config}: {runs[config][-1]}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "conversations.jsonl"
        write_trace(path, trace)
        simulated = {(1, "least-loaded"): simulate(path, 1, "least-loaded")}
        for router in ("round-robin", "least-loaded", "prefix-affinity"):
            simulated[(2, router)] = simulate(path, 2, router)
    engine = {c: sorted(r, key=lambda x: x["ttft_p50"])[len(r) // 2] for c, r in runs.items()}
    prompt_tokens = sum(r.num_prompt_tokens for r in trace)
    lines = [
        f"**On this machine** (the engine half): {len(trace)} requests of "
        f"{len({r.request_id.split('-')[0] for r in trace})} conversations starting at "
        f"{rate:g}/s, 3-6 turns 1.5 s apart on average, each turn's prompt the conversation "
        f"so far plus 64-160 new tokens ({prompt_tokens / len(trace):,.0f} prompt tokens a "
        "request on average), 16-32 tokens out (greedy, ignore_eos); the bundled "
        "SmolLM2-135M in bf16, each replica an engine process with a 1 GiB KV pool and "
        f"OMP_WAIT_POLICY={wait_policy}, other flags at their defaults. Each configuration "
        f"ran {rounds} time(s), alternated; the run ranked rounds // 2 by TTFT p50 is shown "
        "(of two, the slower). TTFT and "
        "E2E are measured in the calling process (the replica's pipe included); the prefix "
        "hit rate is the replicas' own counters.",
        "",
        "| replicas x threads | router | prefix hit rate | TTFT p50 ms | TTFT p90 ms | "
        "E2E p50 ms | E2E p90 ms | output tok/s | busiest replica's share | decisions |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for (size, threads, router), r in engine.items():
        lines.append(
            f"| {size} x {threads} | {router if size > 1 else '—'} | "
            f"{r['prefix_hit_rate']:.1%} | {ms(r['ttft_p50'])} | {ms(r['ttft_p90'])} | "
            f"{ms(r['e2e_p50'])} | {ms(r['e2e_p90'])} | {r['output_tok_s']:,.0f} | "
            f"{r['busiest_replica_share']:.0%} | "
            f"{', '.join(f'{k} {v}' for k, v in r['decisions'].items())} |")
    lines += ["", "The simulator on the same trace file (`" + simulated[(2, "round-robin")][1]
              + "`, the router varied; uncalibrated cpu-local roofline, so its absolute "
              "times are this machine's peak rates, not the engine's):", "",
              "| replicas | router | prefix hit rate | TTFT p50 ms | TTFT p99 ms | "
              "E2E p50 ms |", "|---|---|---|---|---|---|"]
    for (size, router), (a, _) in simulated.items():
        lines.append(f"| {size} | {router if size > 1 else '—'} | {a['prefix_hit_rate']:.1%} | "
                     f"{ms(a['ttft_p50'])} | {ms(a['ttft_p99'])} | {ms(a['e2e_p50'])} |")
    rr, pa = engine[(2, 1, "round-robin")], engine[(2, 1, "prefix-affinity")]
    srr, spa = simulated[(2, "round-robin")][0], simulated[(2, "prefix-affinity")][0]
    agree_hits = (pa["prefix_hit_rate"] > rr["prefix_hit_rate"]) == \
        (spa["prefix_hit_rate"] > srr["prefix_hit_rate"])
    agree_ttft = (pa["ttft_p50"] < rr["ttft_p50"]) == (spa["ttft_p50"] < srr["ttft_p50"])
    lines += ["", f"Prefix affinity against round robin on two replicas: prefix hit rate "
              f"{pa['prefix_hit_rate']:.1%} vs {rr['prefix_hit_rate']:.1%} on the engine, "
              f"{spa['prefix_hit_rate']:.1%} vs {srr['prefix_hit_rate']:.1%} simulated "
              f"({'same' if agree_hits else 'opposite'} direction); TTFT p50 "
              f"{ms(pa['ttft_p50'])} vs {ms(rr['ttft_p50'])} ms on the engine, "
              f"{ms(spa['ttft_p50'])} vs {ms(srr['ttft_p50'])} ms simulated "
              f"({'same' if agree_ttft else 'opposite'} direction)."]
    rows = {"engine": [{"replicas": c[0], "threads": c[1], "router": c[2], "runs": runs[c],
                        **engine[c]} for c in CONFIGS],
            "simulated": [{"replicas": s, "router": r, **a}
                          for (s, r), (a, _) in simulated.items()],
            "agree_hit_rate": agree_hits, "agree_ttft_p50": agree_ttft}
    return "\n".join(lines), rows
