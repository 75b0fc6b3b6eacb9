#!/usr/bin/env python
"""CPU cost of kvserve's scheduler alone: microseconds per schedule() and update() step.

The same work as ../shared/bench/vllm_sched_overhead.py measures for vLLM V1: N running
requests with ~1,000-token prompts (uniform 900..1100, seeded) are prefilled until all are
decoding, then 1,000 more requests are added, which stay waiting (max_num_seqs is full).
Then --steps steady decode steps are timed with fake model outputs (one token per request),
with prefix caching off (as in vLLM's figure) and on.

    python benchmarks/sched_overhead.py [--running 256 1024] [--steps 300] [--write-docs]

``--waiting-order`` measures instead what a cache-aware waiting order (lpm, dfs-weight, spec
C4-C6) costs per waiting pass: --waiting requests (a quarter of them share each of four
cached 512-token system prompts) are sorted by ``start_pass`` alone, with the FCFS fallback
bound at its default (128) and lifted above the queue; the first pass also hashes every
prompt (which admission would do anyway), later passes reuse the hashes.

    python benchmarks/sched_overhead.py --waiting-order [--waiting 1000 128] [--write-docs]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

from docs_section import publish
from kvserve.core import (
    CacheConfig,
    ModelOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

VLLM_STEP_US = 2770  # vLLM V1 on this machine, 256 running + 1,000 waiting (WORKLOADS.md)


def make_requests(start: int, count: int, rng: random.Random) -> list[Request]:
    params = SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.0)
    return [Request(str(i), [rng.randrange(1000, 40000) for _ in range(rng.randint(900, 1100))],
                    params) for i in range(start, start + count)]


def fake_output(out: SchedulerOutput, scheduler: Scheduler) -> ModelOutput:
    sampled = {}
    for request_id in out.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens >= request.num_tokens:
            sampled[request_id] = [1234]
    return ModelOutput(sampled)


def measure(num_running: int, num_waiting: int, steps: int, caching: bool,
            freeze: bool = True, clock: str = "wall") -> dict:
    """``clock``: "wall" (perf_counter) or "cpu" (this process's CPU time, which other
    processes on a loaded machine disturb less; revision_ab.py compares with it)."""
    timer = time.perf_counter if clock == "wall" else time.process_time
    rng = random.Random(0)
    block_size = 16
    num_blocks = num_running * (1100 + steps + 64) // block_size + 1024
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=8192,
                        max_model_len=4096),
        CacheConfig(num_blocks=num_blocks, block_size=block_size,
                    enable_prefix_caching=caching))
    for request in make_requests(0, num_running, rng):
        scheduler.add_request(request)
    now = 0.0
    while not (len(scheduler.running) == num_running and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)):
        out = scheduler.schedule(now)
        scheduler.update(out, fake_output(out, scheduler), now)
        now += 1.0
    for request in make_requests(num_running, num_waiting, rng):
        scheduler.add_request(request)
    gc.unfreeze()
    schedule_us, update_us = [], []
    # Long-lived objects (the block pool, queued requests) move out of the collector's way,
    # as a serving engine does once after start-up; otherwise every full collection walks
    # ~100,000 blocks at 1,024 running (about 30 ms, in the p99 column).
    gc.collect()
    if freeze:
        gc.freeze()
    for i in range(10 + steps):
        t0 = timer()
        out = scheduler.schedule(now)
        t1 = timer()
        model_output = fake_output(out, scheduler)
        t2 = timer()
        scheduler.update(out, model_output, now)
        t3 = timer()
        now += 1.0
        assert out.total_num_scheduled_tokens == num_running, out.total_num_scheduled_tokens
        if i >= 10:  # warm-up steps are not counted
            schedule_us.append((t1 - t0) * 1e6)
            update_us.append((t3 - t2) * 1e6)
    step_us = [a + b for a, b in zip(schedule_us, update_us, strict=True)]
    return dict(running=num_running, waiting=len(scheduler.waiting), prefix_caching=caching,
                steps=steps, schedule_us=statistics.median(schedule_us),
                update_us=statistics.median(update_us), step_us=statistics.median(step_us),
                step_us_p99=sorted(step_us)[int(0.99 * (len(step_us) - 1))],
                us_per_running_request=statistics.median(step_us) / num_running,
                gc_freeze=freeze)


def measure_waiting_order(policy: str, num_waiting: int, max_queue: int, passes: int,
                          clock: str = "wall") -> dict:
    """Microseconds of one ``start_pass`` of a cache-aware queue over ``num_waiting``."""
    timer = time.perf_counter if clock == "wall" else time.process_time
    rng = random.Random(0)
    block_size = 16
    system_prompts = [[rng.randrange(1000, 40000) for _ in range(512)] for _ in range(4)]
    scheduler = Scheduler(
        SchedulerConfig(scheduling_policy=policy, lpm_max_queue=max_queue, max_num_seqs=256,
                        max_num_batched_tokens=8192, max_model_len=4096),
        CacheConfig(num_blocks=(num_waiting + 8) * 1200 // block_size, block_size=block_size))
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    for i, prompt in enumerate(system_prompts):  # run each system prompt once: it is cached
        scheduler.add_request(Request(f"warm{i}", [*prompt, 1], params))
    now = 0.0
    while scheduler.requests:
        out = scheduler.schedule(now)
        scheduler.update(out, fake_output(out, scheduler), now)
        now += 1.0
    queue = scheduler.waiting
    for i in range(num_waiting):
        prompt = system_prompts[i % 4] if i % 2 else []  # half share a cached prefix
        own = [rng.randrange(1000, 40000) for _ in range(rng.randint(400, 600))]
        queue.push(Request(str(i), [*prompt, *own], params))
    t0 = timer()
    queue.start_pass(scheduler.kv, now)
    first_us = (timer() - t0) * 1e6
    times = []
    for _ in range(passes):
        t0 = timer()
        queue.start_pass(scheduler.kv, now)
        times.append((timer() - t0) * 1e6)
    return dict(policy=policy, waiting=num_waiting, lpm_max_queue=max_queue,
                sorted=num_waiting <= max_queue, first_pass_us=first_us,
                pass_us=statistics.median(times))


def waiting_order_markdown(results: list[dict], command: str) -> str:
    from sched_ab import cpu_description

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "## What a cache-aware waiting order costs",
        "",
        f"`{command}` on {cpu_description()}, Python {platform.python_version()}, one thread,",
        f"1-minute load average {load:.1f} (2 cores shared with other sessions):",
        "one `start_pass` (the sort before a waiting pass, C4-C6) over the waiting queue, half",
        "of whose ~500-token prompts extend one of four cached 512-token system prompts;",
        "median of the later passes (hashes cached on the requests) and the first pass (which",
        "also hashes every prompt, as admission would). The sort runs only on a step that has",
        "a free seat and token budget; above `--lpm-max-queue` (default 128) the queue is",
        "served FCFS and the pass costs nothing.",
        "",
        "| order | waiting | lpm_max_queue | sorted | µs per pass | first pass µs |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['policy']} | {r['waiting']} | {r['lpm_max_queue']} "
                     f"| {'yes' if r['sorted'] else 'no (FCFS)'} | {r['pass_us']:.0f} "
                     f"| {r['first_pass_us']:.0f} |")
    return "\n".join(lines) + "\n"


def main_waiting_order(args: argparse.Namespace) -> int:
    results = []
    for num_waiting in args.waiting_counts:
        for policy in ("lpm", "dfs-weight"):
            for max_queue in sorted({128, num_waiting}):
                result = measure_waiting_order(policy, num_waiting, max_queue, args.passes,
                                               args.clock)
                print(json.dumps(result), flush=True)
                results.append(result)
    command = "python benchmarks/sched_overhead.py " + " ".join(sys.argv[1:])
    publish("waiting_order", waiting_order_markdown(results, command.strip()), results,
            args.json, args.write_docs)
    return 0


def _us(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def markdown(results: list[dict], command: str) -> str:
    lines = [
        "## Scheduler overhead",
        "",
        f"`{command}` on {platform.machine()}, Python {platform.python_version()}, one thread;",
        "medians of the timed steps (fake model outputs, KV pool large enough to never preempt).",
        "Long-lived objects are frozen out of the garbage collector before timing (`gc.freeze()`,",
        "as an engine does after start-up); the last column shows p99 without it, where full",
        "collections walking every KV block dominate the tail.",
        f"vLLM V1 on the same work: {VLLM_STEP_US:,} µs per step at 256 running "
        "(../shared/WORKLOADS.md).",
        "",
        "| running | waiting | prefix caching | schedule µs | update µs | step µs "
        "| µs per running request | vLLM / kvserve | step p99 µs | p99 without gc.freeze |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{VLLM_STEP_US / r['step_us']:.1f}x" if r["running"] == 256 else "—"
        lines.append(
            f"| {r['running']} | {r['waiting']} | {'on' if r['prefix_caching'] else 'off'} "
            f"| {r['schedule_us']:.0f} | {r['update_us']:.0f} | {r['step_us']:.0f} "
            f"| {r['us_per_running_request']:.2f} | {ratio} | {r['step_us_p99']:.0f} "
            f"| {_us(r.get('step_us_p99_without_gc_freeze'))} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--waiting", type=int, nargs="+", default=None,
                        help="waiting requests (default 1000; --waiting-order: 1000 128)")
    parser.add_argument("--waiting-order", action="store_true",
                        help="measure a cache-aware order's sort per waiting pass instead")
    parser.add_argument("--passes", type=int, default=50,
                        help="--waiting-order: timed passes per configuration")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time steps by wall clock (default) or by this process's CPU "
                             "time")
    parser.add_argument("--no-unfrozen", action="store_true",
                        help="skip the second run without gc.freeze (its p99 column)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--write-docs", action="store_true",
                        help="replace the 'Scheduler overhead' section of docs/benchmarks.md")
    args = parser.parse_args()
    if args.waiting_order:
        args.waiting_counts = args.waiting or [1000, 128]
        return main_waiting_order(args)
    args.waiting = (args.waiting or [1000])[0]
    results = []
    for num_running in args.running:
        for caching in (False, True):
            result = measure(num_running, args.waiting, args.steps, caching, clock=args.clock)
            if not args.no_unfrozen:
                unfrozen = measure(num_running, args.waiting, args.steps, caching,
                                   freeze=False, clock=args.clock)
                result["step_us_p99_without_gc_freeze"] = unfrozen["step_us_p99"]
            print(json.dumps(result), flush=True)
            results.append(result)
    command = "python benchmarks/sched_overhead.py " + " ".join(sys.argv[1:])
    publish("sched_overhead", markdown(results, command.strip()), results, args.json,
            args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
