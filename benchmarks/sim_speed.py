"""How fast the simulator replays a large trace (issue 3, "Show it").

10,000 requests, lognormal prompts (mean 1,000 tokens) and outputs (mean 250), Poisson
arrivals at a rate that keeps about 200 requests running, llama-3.1-8b on one H100 SXM
(roofline cost model, bf16, KV pool sized from memory), max_num_seqs 256, prefix caching on.

Targets: under 10 s of wall time on the 2-core development machine, and at least 1,000x
faster than the simulated duration. Run from the repository root:

    .venv/bin/python benchmarks/sim_speed.py            # the figures
    .venv/bin/python benchmarks/sim_speed.py --profile  # where the time goes, by layer
    .venv/bin/python benchmarks/sim_speed.py --events   # scheduler events per step
    .venv/bin/python benchmarks/sim_speed.py --floor    # per-request work before any step
    .venv/bin/python benchmarks/sim_speed.py --no-fast-forward  # every decoder stepped alone
    .venv/bin/python benchmarks/sim_speed.py --digest   # + a digest of the whole result
    .venv/bin/python benchmarks/sim_speed.py --model llama-3.1-70b --hardware h100-sxm \
        --tp 4 --rate 14                                # the same trace elsewhere

The last form replays the trace's lengths on another deployment; pick the rate that keeps
~200 requests running there (the run prints the mean). The speed-up over simulated time is
about a step's price on the simulated hardware over the scheduler's cost per step here.

(The simulator against the real engine on this machine: benchmarks/fidelity.py.)
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import time
from typing import Any

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


class EventCounter:
    """Counts, per step, what an event-driven scheduler could not skip: blocks a running
    request grows into, prompts admitted, requests finished (patched around the sim)."""

    def __init__(self) -> None:
        self.steps = self.new_blocks = self.admitted = self.finished = 0
        self.decode_request_steps = 0

    def install(self) -> None:
        from kvserve.sim import simulator

        run_step = simulator.SimRun._run_step
        counter = self

        def counting_run_step(run, out, now):  # type: ignore[no-untyped-def]
            counter.steps += 1
            counter.admitted += len(out.scheduled_new_reqs)
            counter.new_blocks += sum(len(ids) for ids in
                                      out.scheduled_cached_reqs.new_block_ids)
            counter.decode_request_steps += sum(1 for n in out.num_scheduled_tokens.values()
                                                if n == 1)
            now = run_step(run, out, now)
            counter.finished += len(out.finished_req_ids)
            return now

        simulator.SimRun._run_step = counting_run_step  # type: ignore[method-assign]

    def print(self) -> None:
        per_step = self.steps or 1
        print(f"per step            {self.decode_request_steps / per_step:.1f} decodes; "
              f"{self.new_blocks / per_step:.1f} blocks grown into by running requests, "
              f"{self.admitted / per_step:.2f} prompts admitted, "
              f"{self.finished / per_step:.2f} finished")


def per_request_floor(trace: list[Any], block_size: int = 16) -> dict[str, float]:
    """Seconds the trace's requests cost before any step, by the simulator's own code paths:
    synthesising each prompt's ids, building its Request, hashing its full prompt blocks
    (prefix caching, with the simulator's hash algorithm). Any design that keeps the engine's
    requests and prefix cache pays them, however its steps are run."""
    from kvserve.core.prefix_cache import BLOCK_HASHERS
    from kvserve.core.request import Request
    from kvserve.flags import SIM_HASH_ALGO

    extend_block_hashes = BLOCK_HASHERS[SIM_HASH_ALGO]

    start = time.perf_counter()
    prompts = [r.synthesise_prompt(0) for r in trace]
    ids = time.perf_counter()
    max_model_len = SETTINGS["max_model_len"]
    requests = [Request(r.request_id, p, r.sampling_params(max_model_len),
                        arrival_time=r.arrival_time) for r, p in zip(trace, prompts, strict=True)]
    built = time.perf_counter()
    blocks = sum(len(extend_block_hashes(q, block_size, q.num_prompt_tokens, False))
                 for q in requests)
    hashed = time.perf_counter()
    return {"prompt ids": ids - start, "Request objects": built - ids,
            "prompt block hashes": hashed - built, "blocks": blocks}


def result_digest(echo: dict[str, Any], result: Any) -> str:
    """SHA-256 of the run as a report reads it: the report's bytes, every ITL sample, the
    step series and every record's raw fields (floats by repr). Two revisions, or the lane
    on and off, gave the same run when their digests are equal."""
    from kvserve.sim import report as reports

    digest = hashlib.sha256(reports.dumps(reports.build_report(echo, result)).encode())
    digest.update(bytes(result.itl_samples))
    steps = result.steps
    for name in ("time", "duration", "num_scheduled_tokens", "num_running", "num_waiting",
                 "kv_usage"):
        digest.update(bytes(getattr(steps, name)))
    for r in result.records:
        digest.update(repr((r.request_id, r.finish_reason, r.stop_reason, r.metrics,
                            r.num_output_tokens, r.itl_sum, r.itl_max, r.last_token_time,
                            r.preempted_spans)).encode())
    return digest.hexdigest()


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
    parser.add_argument("--events", action="store_true",
                        help="count scheduler events per step (slows the run a little; "
                             "runs without the decode lane)")
    parser.add_argument("--floor", action="store_true",
                        help="also time the per-request work any step design must pay, and "
                             "the speed-up it leaves at most")
    parser.add_argument("--no-fast-forward", action="store_true",
                        help="run without the decode lane (docs/simulator-speed.md): the "
                             "same result, stepping every decoder one at a time")
    parser.add_argument("--digest", action="store_true",
                        help="also print a SHA-256 of the whole result (report, ITL samples, "
                             "steps, records), to compare revisions")
    parser.add_argument("--model", default=DEPLOYMENT.model)
    parser.add_argument("--hardware", default=DEPLOYMENT.hardware)
    parser.add_argument("--tp", type=int, default=DEPLOYMENT.tensor_parallel_size)
    parser.add_argument("--rate", type=float, default=SPEC.rate,
                        help="arrivals per second (26 keeps ~200 running on the default "
                             "deployment)")
    args = parser.parse_args()
    deployment = Deployment(model=args.model, hardware=args.hardware, dtype="bf16",
                            tensor_parallel_size=args.tp)
    spec = WorkloadSpec(**{**SPEC.__dict__, "num_requests": args.num_requests,
                           "rate": args.rate})
    counter = EventCounter() if args.events else None
    if counter is not None:
        counter.install()

    start = time.perf_counter()
    trace = generate(spec)
    generate_s = time.perf_counter() - start

    # Only when asked: a revision before the lane takes no such argument (sim_speed_ab.py).
    # The event counter reads each decoder's step, which the lane does not build.
    options = {"fast_forward": False} if args.no_fast_forward or args.events else {}
    start, cpu_start = time.perf_counter(), time.process_time()
    if args.profile:
        profiler = cProfile.Profile()
        echo, result = profiler.runcall(deployment.simulate, trace, SETTINGS, seed=0,
                                        **options)
    else:
        echo, result = deployment.simulate(trace, SETTINGS, seed=0, **options)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start

    simulated = result.end_time - result.start_time
    running = np.frombuffer(result.steps.num_running, dtype=np.int64)
    finished = sum(r.metrics is not None for r in result.records)
    print(f"deployment          {deployment.model} on {deployment.tensor_parallel_size} x "
          f"{deployment.hardware}, bf16; {args.rate:g} req/s")
    print(f"requests            {len(trace):,} ({finished:,} finished)")
    print(f"KV pool             {echo['cache']['num_blocks']:,} blocks of "
          f"{echo['cache']['block_size']}")
    print(f"steps               {result.num_steps:,}")
    print(f"mean running        {running.mean():.1f} (max {running.max()})")
    print(f"preemptions         {result.num_preemptions:,}")
    print(f"trace generation    {generate_s:.2f} s")
    print(f"simulation wall     {wall:.2f} s" + (" (under the profiler)" if args.profile else ""))
    # CPU time of this process: what an A/B on a loaded machine compares (revision_ab.py).
    print(f"simulation CPU      {cpu:.2f} s")
    print(f"simulated duration  {simulated:.1f} s")
    print(f"speed-up            {simulated / wall:.1f}x simulated time")
    print(f"requests per CPU-s  {len(trace) / wall:,.0f}")
    print(f"steps per second    {result.num_steps / wall:,.0f}")
    print(f"per step            {wall / result.num_steps * 1e6:,.0f} us "
          f"({wall / result.num_steps / running.mean() * 1e6:.2f} us per running request)")
    if counter is not None:
        counter.print()
    if args.digest:
        print(f"result digest       {result_digest(echo, result)}")
    if args.floor:
        parts = per_request_floor(trace, echo["cache"]["block_size"])
        blocks = parts.pop("blocks")
        floor = sum(parts.values())
        print("per-request floor   " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())
              + f" ({blocks:,.0f} blocks)")
        print(f"                    {floor:.2f} s before any step: {simulated / floor:.0f}x at "
              "most, with steps that cost nothing")
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
