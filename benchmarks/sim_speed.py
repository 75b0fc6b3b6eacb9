"""How fast the simulator replays a large trace (issue 3, "Show it").

10,000 requests, lognormal prompts (mean 1,000 tokens) and outputs (mean 250), Poisson
arrivals at a rate that keeps about 200 requests running, llama-3.1-8b on one H100 SXM
(roofline cost model, bf16, KV pool sized from memory), max_num_seqs 256, prefix caching on.

Targets: under 10 s of wall time on the 2-core development machine, and at least 1,000x
faster than the simulated duration. Run from the repository root:

    .venv/bin/python benchmarks/sim_speed.py            # the figures
    .venv/bin/python benchmarks/sim_speed.py --profile  # where the time goes, by layer
    .venv/bin/python benchmarks/sim_speed.py --peers    # W1-W3 simulated on cpu-local, next
                                                        # to what vLLM CPU measured here
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from kvserve.sim.deployment import Deployment
from kvserve.sim.report import aggregate
from kvserve.sim.trace import TraceRequest
from kvserve.sim.workloads import WorkloadSpec, generate

SPEC = WorkloadSpec(
    num_requests=10_000,
    rate=26.0,  # ~200 running on average; the deployment saturates near 27 req/s
    prompt_len="lognormal:mean=1000,sigma=0.5,min=16,max=6000",
    output_len="lognormal:mean=250,sigma=0.5,min=4,max=2000",
    seed=2026,
)
SETTINGS = {"max_num_seqs": 256, "max_model_len": 8192, "enable_prefix_caching": True}
DEPLOYMENT = Deployment(model="llama-3.1-8b", hardware="h100-sxm", dtype="bf16")


def layer_shares(stats: pstats.Stats) -> dict[str, float]:
    """Share of profiled own-time spent in each kvserve layer (and everything else)."""
    totals: dict[str, float] = {}
    for (filename, _, _), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "/kvserve/core/" in filename:
            layer = "kvserve.core"
        elif "/kvserve/sim/" in filename:
            layer = "kvserve.sim"
        else:
            layer = "other (builtins, numpy)"
        totals[layer] = totals.get(layer, 0.0) + own
    whole = sum(totals.values())
    return {k: v / whole for k, v in sorted(totals.items())}


def peer_traces() -> dict[str, list[TraceRequest]]:
    """W1 and W3 of ../shared/WORKLOADS.md, drawn in the documented order (reimplemented,
    checked against the first ids the document gives). Greedy, ignore_eos, exact max_tokens."""
    rng = np.random.default_rng(0)
    lens = rng.integers(64, 513, size=128)
    w1 = [rng.integers(1000, 40000, size=int(n)).tolist() for n in lens]
    assert w1[0][:5] == [36058, 12649, 36180, 27207, 35725]
    rng = np.random.default_rng(1)
    lens, max_tokens = rng.integers(64, 513, size=200), rng.integers(32, 257, size=200)
    gaps = rng.exponential(1.0 / 4.0, size=200)
    arrivals = np.cumsum(gaps) - gaps[0]
    w3 = [rng.integers(1000, 40000, size=int(n)).tolist() for n in lens]
    assert w3[0][:5] == [33454, 26203, 39617, 11871, 7233]
    return {
        "W1": [TraceRequest(f"w1-{i}", 0.0, 128, prompt_token_ids=tuple(p), max_tokens=128,
                            ignore_eos=True) for i, p in enumerate(w1)],
        "W3": [TraceRequest(f"w3-{i}", float(a), int(m), prompt_token_ids=tuple(p),
                            max_tokens=int(m), ignore_eos=True)
               for i, (p, m, a) in enumerate(zip(w3, max_tokens, arrivals, strict=True))],
    }


def peers() -> None:
    """The cpu-local roofline against vLLM CPU 0.32's measurements (../shared/WORKLOADS.md)."""
    cpu = Deployment(model="smollm2-135m", hardware="cpu-local", dtype="bf16")
    traces = peer_traces()
    runs = (("W1", traces["W1"], {"num_kv_blocks": 20_000}),
            ("W2", traces["W1"], {"num_kv_blocks": 256, "max_num_seqs": 64}),
            ("W3", traces["W3"], {"num_kv_blocks": 20_000}))
    print("| workload | duration s | out tok/s | preemptions | TTFT p50 / p99 s | "
          "ITL p50 / p99 ms |")
    print("|---|---|---|---|---|---|")
    for name, trace, settings in runs:
        _, result = cpu.simulate(trace, settings)
        a = aggregate(result)
        print(f"| {name} | {a['duration_s']:.1f} | {a['throughput_output_tok_s']:.0f} | "
              f"{a['num_preemptions']} | {a['ttft_p50']:.2f} / {a['ttft_p99']:.2f} | "
              f"{1000 * a['itl_p50']:.0f} / {1000 * a['itl_p99']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=SPEC.num_requests)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--peers", action="store_true",
                        help="simulate W1-W3 on cpu-local instead (see docs/benchmarks.md)")
    args = parser.parse_args()
    if args.peers:
        peers()
        return
    spec = WorkloadSpec(**{**SPEC.__dict__, "num_requests": args.num_requests})

    start = time.perf_counter()
    trace = generate(spec)
    generate_s = time.perf_counter() - start

    start = time.perf_counter()
    if args.profile:
        profiler = cProfile.Profile()
        echo, result = profiler.runcall(DEPLOYMENT.simulate, trace, SETTINGS, seed=0)
    else:
        echo, result = DEPLOYMENT.simulate(trace, SETTINGS, seed=0)
    wall = time.perf_counter() - start

    simulated = result.end_time - result.start_time
    running = np.frombuffer(result.steps.num_running, dtype=np.int64)
    finished = sum(r.metrics is not None for r in result.records)
    print(f"requests            {len(trace):,} ({finished:,} finished)")
    print(f"KV pool             {echo['cache']['num_blocks']:,} blocks of "
          f"{echo['cache']['block_size']}")
    print(f"steps               {result.num_steps:,}")
    print(f"mean running        {running.mean():.1f} (max {running.max()})")
    print(f"preemptions         {result.num_preemptions:,}")
    print(f"trace generation    {generate_s:.2f} s")
    print(f"simulation wall     {wall:.2f} s" + (" (under the profiler)" if args.profile else ""))
    print(f"simulated duration  {simulated:.1f} s")
    print(f"speed-up            {simulated / wall:.1f}x simulated time")
    print(f"requests per CPU-s  {len(trace) / wall:,.0f}")
    print(f"steps per second    {result.num_steps / wall:,.0f}")
    print(f"per step            {wall / result.num_steps * 1e6:,.0f} us "
          f"({wall / result.num_steps / running.mean() * 1e6:.2f} us per running request)")
    if args.profile:
        stats = pstats.Stats(profiler)
        for layer, share in layer_shares(stats).items():
            print(f"  {layer:<24} {100 * share:5.1f}% of profiled time")
        stats.sort_stats("tottime").print_stats(12)
    else:
        print(f"targets             wall < 10 s: {'met' if wall < 10 else 'NOT met'}; "
              f">= 1,000x: {'met' if simulated / wall >= 1000 else 'NOT met'}")


if __name__ == "__main__":
    main()
