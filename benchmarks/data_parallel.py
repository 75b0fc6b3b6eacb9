#!/usr/bin/env python
"""Data-parallel replicas in the simulator (issue 14, "Show it"; docs/scale-out.md).

Three simulated studies, llama-3.1-8b in bf16 on H100 SXM replicas (roofline cost model, KV
pool sized from memory, prefix caching on):

1. routers: one chat trace with 32 shared 1,024-token system prompts on 4 replicas, under
   each router policy: prefix hits, TTFT, ITL, and how evenly requests spread;
2. lockstep: 4 replicas stepping together (MoE data parallelism), with the prefill throttle
   off and at two intervals: what steadier decoding costs in time to first token;
3. a day at scale: a day-shaped arrival curve (trough at 04:00 at a fifth of the 16:00 peak),
   the day compressed to --seconds-per-hour, and the plan `kvserve plan --max-replicas`
   would give: the fewest replicas meeting the SLO, from candidates 8 to 64.

    python benchmarks/data_parallel.py [--write-docs] [--workers 2] [--peak-rate 300]

With ``--engine``, the engine half instead (benchmarks/data_parallel_engine.py): one
replica with 2 threads against two with one thread each, under each router, on a multi-turn
conversation trace and on W3, on this machine; and the simulator on the same traces with
the cost model calibrated on this engine (``--calibration``, ``--calibration-two-threads``:
``kvserve calibrate`` files). Run it under the bench lock (``flock
/tmp/kvserve-bench.lock``), in pieces of a round or two: ``--results FILE`` accumulates the
rounds, and each run writes the section from all of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from docs_section import publish, write_section
from kvserve.sim.cluster import ClusterOptions
from kvserve.sim.cluster_report import add_cluster_sections
from kvserve.sim.deployment import Deployment
from kvserve.sim.replica_plan import recommend_replicas, run_candidates
from kvserve.sim.report import build_report
from kvserve.sim.trace import TraceRequest
from kvserve.sim.workloads import WorkloadSpec, generate

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENT = Deployment(model="llama-3.1-8b", hardware="h100-sxm")
SETTINGS = {"max_model_len": 8192}
CHAT = dict(prefix_groups=32, prefix_len="fixed:1024", prefix_fraction=0.8,
            prompt_len="uniform:256,2048", output_len="lognormal:mean=128,sigma=0.7,max=1024")
CANDIDATES = (8, 12, 16, 24, 32, 64)


def run(trace: list[TraceRequest], options: ClusterOptions) -> dict[str, Any]:
    echo, result = DEPLOYMENT.simulate(trace, SETTINGS, cluster=options)
    return add_cluster_sections(build_report(echo, result), result)


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:,.1f}"


def routers_study(num_requests: int) -> tuple[str, list[dict[str, Any]]]:
    traces = {
        "system prompts": generate(WorkloadSpec(num_requests=num_requests, rate=80.0, seed=1,
                                                **CHAT)),
        "conversations": generate(WorkloadSpec(num_requests=num_requests, rate=16.0, seed=1,
                                               turns="uniform:2,8", think_time=3.0, **CHAT)),
    }
    rows = []
    for (name, trace), policy in itertools.product(
            traces.items(), ("round-robin", "least-loaded", "prefix-affinity")):
        report = run(trace, ClusterOptions(4, policy))
        a = report["aggregate"]
        shares = [r["num_requests"] / a["num_requests"] for r in report["replicas"]]
        rows.append({"trace": name, "router": policy, "prefix_hit_rate": a["prefix_hit_rate"],
                     "ttft_p50": a["ttft_p50"], "ttft_p99": a["ttft_p99"],
                     "itl_p99": a["itl_p99"], "e2e_p99": a["e2e_p99"],
                     "throughput_output_tok_s": a["throughput_output_tok_s"],
                     "busiest_replica_share": round(max(shares), 4),
                     "decisions": report["router"]["decisions"]})
    lines = [f"**Routers** on 4 replicas, two traces of {num_requests:,} chat requests: "
             "*system prompts*, 80 requests/s, 80% starting with one of 32 shared 1,024-token "
             "system prompts, new text 256-2,048 tokens, outputs lognormal mean 128; "
             "*conversations*, the same with 2-8 turns per conversation (16 conversations/s, "
             "3 s mean think time), each turn's prompt holding the previous turns:", "",
             "| trace | router | prefix hit rate | TTFT p50 ms | TTFT p99 ms | ITL p99 ms "
             "| E2E p99 ms | output tok/s | busiest replica's share | decisions |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['trace']} | {r['router']} | {r['prefix_hit_rate']:.1%} | "
                     f"{ms(r['ttft_p50'])} | "
                     f"{ms(r['ttft_p99'])} | {ms(r['itl_p99'])} | {ms(r['e2e_p99'])} | "
                     f"{r['throughput_output_tok_s']:,.0f} | {r['busiest_replica_share']:.1%} "
                     f"| {', '.join(f'{k} {v}' for k, v in r['decisions'].items())} |")
    return "\n".join(lines), rows


def lockstep_study(num_requests: int) -> tuple[str, list[dict[str, Any]]]:
    trace = generate(WorkloadSpec(num_requests=num_requests, rate=8.0, seed=5,
                                  prompt_len="lognormal:mean=2000,sigma=0.8,max=6000",
                                  output_len="uniform:60,200"))
    rows = []
    for interval in (1, 4, 8, 16):
        options = ClusterOptions(4, "least-loaded", lockstep=True,
                                 prefill_schedule_interval=interval)
        a = run(trace, options)["aggregate"]
        rows.append({"prefill_schedule_interval": interval, "itl_p50": a["itl_p50"],
                     "itl_p90": a["itl_p90"], "itl_p99": a["itl_p99"],
                     "itl_mean": a["itl_mean"], "ttft_p50": a["ttft_p50"],
                     "ttft_p99": a["ttft_p99"], "duration_s": a["duration_s"],
                     "throttled_steps": a["blocked_steps"].get("prefill_throttle", 0)})
    lines = [f"**Lockstep and the prefill throttle** ({num_requests} requests at 8/s on 4 "
             "replicas stepping together; prompts lognormal mean 2,000 tokens, outputs "
             "60-200):", "",
             "| prefill schedule interval | ITL mean ms | ITL p50 ms | ITL p90 ms | ITL p99 ms "
             "| TTFT p50 ms | TTFT p99 ms | throttled rank-steps |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prefill_schedule_interval']}"
                     f"{' (off)' if r['prefill_schedule_interval'] == 1 else ''} | "
                     f"{ms(r['itl_mean'])} | {ms(r['itl_p50'])} | {ms(r['itl_p90'])} | "
                     f"{ms(r['itl_p99'])} | {ms(r['ttft_p50'])} | {ms(r['ttft_p99'])} | "
                     f"{r['throttled_steps']:,} |")
    return "\n".join(lines), rows


def day_rate(hour: float, peak: float) -> float:
    """Requests per second at ``hour`` (0-24): a fifth of the peak at 04:00, the peak at
    16:00, a cosine in between."""
    return peak * (0.2 + 0.8 * (1 - math.cos(2 * math.pi * (hour - 4) / 24)) / 2)


def day_trace(peak: float, seconds_per_hour: float, seed: int = 11) -> list[TraceRequest]:
    """Arrivals of a non-homogeneous Poisson process following :func:`day_rate` (by
    thinning), the lengths of the chat mix."""
    rng = np.random.default_rng(seed)
    span = 24 * seconds_per_hour
    times, t = [], 0.0
    while True:
        t += rng.exponential(1 / peak)
        if t >= span:
            break
        if rng.random() * peak <= day_rate(t / seconds_per_hour, peak):
            times.append(t)
    lengths = generate(WorkloadSpec(num_requests=len(times), rate=1.0, seed=seed, **CHAT))
    return [dataclasses.replace(r, arrival_time=round(at, 6)) for r, at in
            zip(lengths, times, strict=True)]


def day_study(peak: float, seconds_per_hour: float, slo_ttft: float, slo_itl: float,
              workers: int) -> tuple[str, dict[str, Any]]:
    trace = day_trace(peak, seconds_per_hour)
    start = time.perf_counter()
    rows = run_candidates(DEPLOYMENT, trace, SETTINGS, ClusterOptions(router="prefix-affinity"),
                          CANDIDATES, workers=workers)
    wall = time.perf_counter() - start
    plan = recommend_replicas(rows, slo_ttft, slo_itl)
    lines = [f"**A day at scale**: {len(trace):,} requests; the arrival rate follows a day "
             f"(trough at 04:00, {day_rate(4, peak):.0f}/s; peak at 16:00, {peak:.0f}/s), the "
             f"day compressed to {24 * seconds_per_hour:.0f} s ({seconds_per_hour:g} s per hour, "
             "so each rate holds for a few request lifetimes); chat mix as above; "
             f"prefix-affinity router; SLO: TTFT p99 <= {slo_ttft} s, ITL p99 <= {slo_itl} s. "
             f"{len(CANDIDATES)} candidates simulated in {wall:.0f} s of wall time "
             f"({workers} worker processes).", "",
             "| replicas | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | queue p99 ms | output tok/s "
             "| prefix hit rate | KV usage mean | meets SLO |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['replicas']} | {ms(r['ttft_p50'])} | {ms(r['ttft_p99'])} | "
                     f"{ms(r['itl_p99'])} | {ms(r['queue_p99'])} | "
                     f"{r['throughput_output_tok_s']:,.0f} | {r['prefix_hit_rate']:.1%} | "
                     f"{r['kv_usage_mean']:.1%} | "
                     f"{'yes' if r['replicas'] in plan['replicas_meeting_slo'] else 'no'} |")
    lines += ["", f"Recommended: **{plan['replicas_recommended']} replicas** (the fewest "
              "candidates meeting both SLOs over the whole day, peak included)."]
    return "\n".join(lines), {"rows": rows, **plan, "num_requests": len(trace)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--router-requests", type=int, default=2000)
    parser.add_argument("--lockstep-requests", type=int, default=240)
    parser.add_argument("--peak-rate", type=float, default=300.0)
    parser.add_argument("--seconds-per-hour", type=float, default=2.0)
    parser.add_argument("--slo-ttft-p99", type=float, default=0.5)
    parser.add_argument("--slo-itl-p99", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--skip-day", action="store_true")
    parser.add_argument("--engine", action="store_true",
                        help="run the engine half on this machine instead")
    parser.add_argument("--engine-requests", type=int, default=48,
                        help="requests of the conversation trace")
    parser.add_argument("--engine-rate", type=float, default=0.25,
                        help="conversations started per second")
    parser.add_argument("--think-time", type=float, default=3.0,
                        help="mean seconds from a turn's arrival to the next turn's")
    parser.add_argument("--w3-requests", type=int, default=32,
                        help="the first W3 requests to replay (0: skip W3)")
    parser.add_argument("--w3-rate", type=float, default=1.0, help="W3's requests per second")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds to run now (each runs every configuration once)")
    parser.add_argument("--results", metavar="PATH.json",
                        help="rounds accumulate here, so the study can run in pieces; the "
                             "section is written from every round in it")
    parser.add_argument("--calibration", metavar="PATH.json",
                        help="kvserve calibrate's file for one replica with one thread (the "
                             "simulated 2 x 1 rows); without it, the cpu-local roofline")
    parser.add_argument("--calibration-two-threads", metavar="PATH.json",
                        help="the same for one replica with two threads (the 1 x 2 row)")
    parser.add_argument("--wait-policy", choices=("PASSIVE", "ACTIVE"), default="PASSIVE",
                        help="the replicas' OMP_WAIT_POLICY (PASSIVE: a 2-thread engine "
                             "does not spin while other jobs hold the cores)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--write-docs", action="store_true",
                        help="replace the simulated section of docs/benchmarks.md and "
                             "docs/scale-out.md")
    args = parser.parse_args()
    if args.engine:
        return engine_main(args)
    load = os.getloadavg()[0]
    parts, rows = [], {}
    text, rows["routers"] = routers_study(args.router_requests)
    parts.append(text)
    text, rows["lockstep"] = lockstep_study(args.lockstep_requests)
    parts.append(text)
    if not args.skip_day:
        text, rows["day"] = day_study(args.peak_rate, args.seconds_per_hour,
                                      args.slo_ttft_p99, args.slo_itl_p99, args.workers)
        parts.append(text)
    command = "python benchmarks/data_parallel.py " + " ".join(sys.argv[1:])
    section = "\n\n".join([
        "### Data parallel, simulated",
        f"`{command.strip()}`; llama-3.1-8b bf16 on H100 SXM replicas (roofline cost model, "
        "KV pool sized from memory, max_model_len 8192, other flags at their defaults). "
        f"Simulated figures: they do not depend on this machine (load average {load:.1f} "
        "when run only changes the wall time).", *parts])
    publish("data_parallel_sim", section, rows, args.json, args.write_docs)
    if args.write_docs:
        write_section("data_parallel_sim", section, ROOT / "docs" / "scale-out.md")
    return 0


def engine_main(args: argparse.Namespace) -> int:
    import json

    from data_parallel_engine import conversations, run_rounds, simulate_all, w3
    from data_parallel_engine_report import engine_section
    from kvserve.model.kernel_info import cpu_info

    params = {"engine_requests": args.engine_requests, "engine_rate": args.engine_rate,
              "think_time": args.think_time, "w3_requests": args.w3_requests,
              "w3_rate": args.w3_rate, "wait_policy": args.wait_policy}
    traces = {"conversations": conversations(args.engine_requests, args.engine_rate,
                                             args.think_time)}
    if args.w3_requests:
        traces["w3"] = w3(args.w3_requests, args.w3_rate)
    results: dict[str, Any] = {"params": params}
    if args.results and Path(args.results).exists():
        results = json.loads(Path(args.results).read_text())
        if results["params"] != params:
            print(f"error: {args.results} holds rounds of other traces ({results['params']}); "
                  "give the same flags or another file", file=sys.stderr)
            return 2
    if args.rounds:
        started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        before = os.getloadavg()[0]
        run_rounds(results, traces, args.rounds, args.wait_policy)
        results.setdefault("pieces", []).append({
            "command": "python benchmarks/data_parallel.py " + " ".join(sys.argv[1:]),
            "started": started, "rounds": args.rounds,
            "load_before": round(before, 1), "load_after": round(os.getloadavg()[0], 1)})
        if args.results:
            Path(args.results).write_text(json.dumps(results, indent=1))
    if not results.get("rounds_done"):
        print("error: no rounds to report: give --rounds or a --results file that has some",
              file=sys.stderr)
        return 2
    simulated = simulate_all(traces, args.calibration, args.calibration_two_threads)
    cpu = cpu_info()
    isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu.flags)
    machine = f"{cpu.name} ({os.cpu_count()} cores; {isa or 'no AVX flags read'})"
    section, rows = engine_section(results, simulated, traces, machine,
                                   args.calibration, args.calibration_two_threads)
    publish("data_parallel_engine", section, rows, args.json, args.write_docs)
    if args.write_docs:
        write_section("data_parallel_engine", section, ROOT / "docs" / "scale-out.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
