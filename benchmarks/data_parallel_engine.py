"""The engine half of benchmarks/data_parallel.py: data-parallel replicas on this machine.

Two traces are replayed on the wall clock against engine replicas in processes of their own
(the server's ``DataParallelEngine``, without HTTP): one replica with 2 torch threads, and
two replicas with one thread each under each router.

- *conversations*: multi-turn chat, each turn's prompt the conversation so far, so only the
  replica that served a conversation's last turn holds its history;
- *w3*: the first requests of W3 (../shared/WORKLOADS.md) at a lower rate: no shared
  prefixes, so the routers differ only in how they spread load.

Then ``kvserve simulate`` runs the same trace files, with the cost model calibrated on this
engine (``kvserve calibrate``: one replica with one thread for the 2 x 1 rows, with two
threads for the 1 x 2 row), to check that the simulator orders the configurations as the
engine does.

Requests are added when their arrival time comes; TTFT is measured in this process (add to
first token chunk), so it includes the pipe to the replica. The prefix hit rate is the
replicas' own prefix-cache counters (tokens hit / tokens looked up) over the trace, after one
warm-up request per replica. Each request's record (replica, queue time on the replica,
cached prompt tokens) comes from the metrics its replica returns with its last chunk.

Rounds accumulate in a results file, so the study can run in pieces that each hold the bench
lock briefly; each piece reverses the order of the one before, so drift in the machine's
load falls on every configuration alike.
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
CONVERSATION_SHAPE = dict(turns="uniform:3,6", prompt_len="uniform:64,160",
                          output_len="uniform:16,32")


def conversations(num_requests: int, rate: float, think_time: float = 3.0,
                  seed: int = 1) -> list[TraceRequest]:
    """Multi-turn chat: conversations start at ``rate``/s, 3-6 turns ``think_time`` s apart on
    average (from one turn's arrival to the next's), 64-160 new tokens a turn, 16-32 tokens
    out; prompt ids written out."""
    spec = WorkloadSpec(num_requests=num_requests, rate=rate, think_time=think_time,
                        ignore_eos=True, seed=seed, **CONVERSATION_SHAPE)
    return [dataclasses.replace(r, prompt_token_ids=tuple(r.synthesise_prompt(SEED)),
                                prompt_len=None, prefix_id=None, prefix_len=0,
                                max_tokens=r.output_len)
            for r in generate(spec)]


def w3(num_requests: int, rate: float) -> list[TraceRequest]:
    from shared_workloads import w3_trace
    return w3_trace(num_requests, rate)


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
    records: list[dict[str, Any]] = []
    start = time.monotonic()

    async def one(request: TraceRequest) -> None:
        await asyncio.sleep(max(0.0, start + request.arrival_time - time.monotonic()))
        sent = time.monotonic()
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0,
                                ignore_eos=True)
        stream = await engine.add_requests(
            [(request.request_id, list(request.prompt_token_ids), params)], sent)
        first, tokens, metrics = None, 0, None
        async for chunk in stream:
            if chunk.new_token_ids and first is None:
                first = time.monotonic()
            tokens += len(chunk.new_token_ids)
            metrics = chunk.metrics or metrics
        end = time.monotonic()
        queue = None if metrics is None or metrics.first_scheduled_time is None \
            else metrics.first_scheduled_time - metrics.arrival_time
        records.append({"request_id": request.request_id, "replica": stream.replica,
                        "arrival_time": round(sent - start, 4),
                        "ttft_s": round((first or end) - sent, 4),
                        "e2e_s": round(end - sent, 4),
                        "queue_s": None if queue is None else round(queue, 4),
                        "prompt_tokens": len(request.prompt_token_ids),
                        "cached_tokens": metrics.num_cached_tokens if metrics else 0,
                        "output_tokens": tokens})
    await asyncio.gather(*(one(r) for r in trace))
    duration = time.monotonic() - start
    after = [(f.stats.prefix_cache_hits, f.stats.prefix_cache_queries)
             for f in engine.engine_figures()]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    reasons: dict[str, int] = {}
    for (_, reason), count in engine.router_figures().decisions.items():
        reasons[reason] = reasons.get(reason, 0) + count
    await engine.stop()
    records.sort(key=lambda r: r["request_id"])
    return {**summary(records, duration), "prefix_hit_rate": hits / queries if queries else 0.0,
            "decisions": dict(sorted(reasons.items())), "requests": records}


def summary(records: list[dict[str, Any]], duration: float) -> dict[str, Any]:
    """One run's figures from its request records (the engine's or the simulator's)."""
    def pct(key: str, q: float) -> float:
        return float(np.percentile([r[key] for r in records if r[key] is not None], q))

    replicas = [r["replica"] for r in records]
    return {"ttft_p50": pct("ttft_s", 50), "ttft_p90": pct("ttft_s", 90),
            "e2e_p50": pct("e2e_s", 50), "e2e_p90": pct("e2e_s", 90),
            "queue_p50": pct("queue_s", 50), "queue_p90": pct("queue_s", 90),
            "computed_prompt_tokens": float(np.mean([r["prompt_tokens"] - r["cached_tokens"]
                                                     for r in records])),
            "duration_s": duration,
            "output_tok_s": sum(r["output_tokens"] for r in records) / duration,
            "busiest_replica_share": max(map(replicas.count, set(replicas))) / len(records)}


def run_engine(trace: list[TraceRequest], size: int, threads: int, router: str,
               wait_policy: str) -> dict[str, Any]:
    engine = replicas(size, threads, router, wait_policy)
    return asyncio.run(_replay(engine, trace))


def simulate(trace_path: Path, size: int, router: str, calibration: str | None,
             ) -> tuple[dict[str, Any], str]:
    """``kvserve simulate`` on the trace file (calibrated when a file is given): the run's
    figures as :func:`summary` gives the engine's, and the command."""
    model = ["--cost-model", "calibrated", "--calibration", calibration] if calibration else []
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        argv = ["simulate", "--trace", str(trace_path), *SIM_FLAGS, *model,
                "--data-parallel-size", str(size), "--router", router]
        subprocess.run([sys.executable, "-m", "kvserve", *argv, "--report", str(report_path)],
                       check=True, capture_output=True, env={**os.environ,
                                                             "PYTHONPATH": str(ROOT / "src")})
        report = json.loads(report_path.read_text())
    records = [{**r, "replica": r.get("replica", 0)} for r in report["requests"]]
    a = report["aggregate"]
    decisions = report.get("router", {}).get("decisions", {"least_loaded": len(records)})
    command = "kvserve " + " ".join(argv).replace(str(trace_path), "TRACE")
    if calibration:
        command = command.replace(calibration, Path(calibration).name)
    return {**summary(records, a["duration_s"]), "prefix_hit_rate": a["prefix_hit_rate"],
            "output_tok_s": a["throughput_output_tok_s"],
            "decisions": dict(sorted(decisions.items()))}, command


def key(config: tuple[int, int, str]) -> str:
    return f"{config[0]}x{config[1]} {config[2]}"


def run_rounds(results: dict[str, Any], traces: dict[str, list[TraceRequest]], rounds: int,
               wait_policy: str) -> None:
    """``rounds`` more rounds of every configuration on every trace, appended to
    ``results``; the order reverses from one round to the next, across pieces too."""
    for _ in range(rounds):
        done = results.setdefault("rounds_done", 0)
        order = CONFIGS if done % 2 == 0 else CONFIGS[::-1]
        load = os.getloadavg()[0]
        for name, trace in traces.items():
            runs = results.setdefault("runs", {}).setdefault(name, {})
            for config in order:
                run = run_engine(trace, *config, wait_policy)
                run["round"], run["load_before"] = done, load
                runs.setdefault(key(config), []).append(run)
                print(f"round {done} {name} {key(config)}: TTFT p50 {run['ttft_p50']:.3f} s, "
                      f"hits {run['prefix_hit_rate']:.1%}", file=sys.stderr, flush=True)
        results.setdefault("loads", []).append([load, os.getloadavg()[0]])
        results["rounds_done"] = done + 1


def simulate_all(traces: dict[str, list[TraceRequest]], calibration: str | None,
                 calibration_two_threads: str | None) -> dict[str, Any]:
    """Each trace in the simulator: 1 replica (the two-thread calibration) and 2 replicas
    (the one-thread calibration) under each router."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, trace in traces.items():
            path = Path(tmp) / f"{name}.jsonl"
            write_trace(path, trace)
            rows = out[name] = {}
            for config in CONFIGS:
                cal = calibration_two_threads if config[1] == 2 else calibration
                rows[key(config)], command = simulate(path, config[0], config[2], cal)
                rows[key(config)]["command"] = command
    return out
