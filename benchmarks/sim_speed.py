"""How fast the simulator replays a large trace (issue 3, "Show it").

10,000 requests, lognormal prompts (mean 1,000 tokens) and outputs (mean 250), Poisson
arrivals at a rate that keeps about 200 requests running, llama-3.1-8b on one H100 SXM
(roofline cost model, bf16, KV pool sized from memory), max_num_seqs 256, prefix caching on.

Targets: under 10 s of wall time on the 2-core development machine, and at least 1,000x
faster than the simulated duration. Run from the repository root:

    .venv/bin/python benchmarks/sim_speed.py            # the figures
    .venv/bin/python benchmarks/sim_speed.py --profile  # where the time goes, by layer

(The simulator against the real engine on this machine: benchmarks/fidelity.py.)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from kvserve.sim.deployment import Deployment
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=SPEC.num_requests)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
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
