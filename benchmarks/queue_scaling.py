#!/usr/bin/env python
"""Whether the scheduler's waiting side stays linear as the queue grows: each scenario runs
with n and with 4n requests in one process, on a virtual clock with a fake model (one token
per finished chunk), and the ratio of the two times is reported: ~4x is linear, ~16x
quadratic.

The scenarios are the paths a scaling pass found quadratic (docs/benchmarks.md, "How the
waiting side scales"): queue deadlines timing out a long priority queue (K4), arrivals under
a queue limit (K4's estimate), arrivals into a full priority queue (K5 displacement),
priority with aging (C7), fair share with a tenant per request (T1), and held sessions
released by ttl (U6) and by the held-KV limit (U5).

    python benchmarks/queue_scaling.py [--n 2000] [--only NAME ...] [--write-docs]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import random
import sys
import time
from collections.abc import Callable

from docs_section import publish
from kvserve.core import (
    CacheConfig,
    ModelOutput,
    QueueFullError,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)


def scheduler(num_blocks: int = 100_000, **config: object) -> Scheduler:
    config.setdefault("max_model_len", 4096)
    return Scheduler(SchedulerConfig(**config),  # type: ignore[arg-type]
                     CacheConfig(num_blocks=num_blocks, block_size=16,
                                 enable_prefix_caching=False))


def request(index: int, num_prompt: int, arrival: float = 0.0, **params: object) -> Request:
    prompt = [100 + (index * 7 + k) % 30000 for k in range(num_prompt)]
    return Request(f"r{index}", prompt, SamplingParams(**params),  # type: ignore[arg-type]
                   arrival_time=arrival)


def step(sched: Scheduler, now: float) -> None:
    """One step: a token for each request whose scheduled chunk reached its end."""
    out = sched.schedule(now)
    requests = sched.requests
    sampled = {rid: [5] for rid in out.num_scheduled_tokens
               if (r := requests.get(rid)) is not None and r.num_computed_tokens >= r.num_tokens}
    sched.update(out, ModelOutput(sampled), now)


def deadlines(n: int) -> Scheduler:
    """n requests behind 4 seats, each with a queue deadline in [0, 10) s: all time out."""
    sched = scheduler(max_num_seqs=4, scheduling_policy="priority")
    rng = random.Random(1)
    for i in range(n):
        sched.add_request(request(i, 16, max_tokens=10_000, ignore_eos=True,
                                  priority=rng.randint(0, 3),
                                  max_queue_delay=rng.uniform(0.0, 10.0)))
    for tick in range(1100):
        step(sched, 0.01 * (tick + 1))
    return sched


def arrivals(n: int, **config: object) -> Scheduler:
    """1,500-token prompts, two arrivals a step: the queue grows to a third of n."""
    sched = scheduler(max_num_seqs=256, max_num_batched_tokens=2048, **config)
    now = 0.0
    for i in range(n):
        tenant = f"u{i}" if config.get("tenant_fairness") else "t"
        sched.add_request(request(i, 1500, now, max_tokens=4, priority=i % 3, tenant=tenant))
        if i % 2:
            now += 0.01
            step(sched, now)
    return sched


def displacement(n: int) -> Scheduler:
    """Every seat taken, a queue limit of n/2, random priorities: each arrival past the
    limit displaces a less urgent request or is refused (K5)."""
    sched = scheduler(max_num_seqs=1, scheduling_policy="priority",
                      max_num_queued_reqs=n // 2)
    sched.add_request(request(-1, 16, max_tokens=10_000, ignore_eos=True))
    step(sched, 0.0)
    rng = random.Random(1)
    for i in range(n):
        with contextlib.suppress(QueueFullError):  # refused: no less urgent one waits
            sched.add_request(request(i, 16, 0.001 * i, max_tokens=16,
                                      priority=rng.randint(0, 9)))
    return sched


def sessions(n: int, by: str) -> Scheduler:
    """One-turn sessions, two a step, held until their ttl (a quarter of the run) or
    released oldest first under a held-KV limit of n/4 sessions."""
    held = dict(max_session_kv=0.9, session_ttl_s=n * 0.01 / 4) if by == "ttl" else \
        dict(max_session_kv=(n // 4) * 3 / 100_000, session_ttl_s=86400.0)
    sched = scheduler(max_num_seqs=256, max_num_batched_tokens=2048, **held)
    now = 0.0
    for i in range(n):
        sched.add_request(request(i, 32, now, max_tokens=4, ignore_eos=True,
                                  session_id=f"s{i}"))
        if i % 2:
            now += 0.01
            step(sched, now)
    return sched


SCENARIOS: dict[str, tuple[str, Callable[[int], Scheduler]]] = {
    "deadlines": ("queue deadlines time out a priority queue (K4)", deadlines),
    "queue-limit": ("arrivals under a queue limit, priority (K4's estimate)",
                    lambda n: arrivals(n, scheduling_policy="priority",
                                       max_num_queued_reqs=10 * n)),
    "displacement": ("arrivals into a full priority queue (K5)", displacement),
    "aging": ("priority with aging, 5 s (C7)",
              lambda n: arrivals(n, scheduling_policy="priority", schedule_aging_s=5.0)),
    "vtc-tenants": ("fair share, a tenant per request (T1)",
                    lambda n: arrivals(n, tenant_fairness="vtc")),
    "sessions-ttl": ("held sessions released by ttl (U6)", lambda n: sessions(n, "ttl")),
    "sessions-limit": ("held sessions released at the held-KV limit (U5)",
                       lambda n: sessions(n, "limit")),
}


def timed(run: Callable[[int], Scheduler], n: int) -> float:
    gc.collect()
    start = time.process_time()
    run(n)
    return time.process_time() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="the smaller run's requests")
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if args.n < 1:
        parser.error("--n must be >= 1")
    from sched_ab import cpu_description

    rows = []
    for name in args.only or SCENARIOS:
        what, run = SCENARIOS[name]
        small, large = timed(run, args.n), timed(run, 4 * args.n)
        rows.append(dict(scenario=name, what=what, n=args.n, small_s=small, large_s=large,
                         ratio=large / small))
        print(f"{name}: {small:.2f} s, {large:.2f} s, {large / small:.1f}x", file=sys.stderr)
    command = "python benchmarks/queue_scaling.py " + " ".join(sys.argv[1:])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "## How the waiting side scales",
        "",
        f"`{command.strip()}` on {cpu_description()}, Python {platform.python_version()}, "
        f"one thread, 1-minute load average {load:.1f}: each scenario's CPU time with n and "
        f"with 4n requests in one process (fake model, virtual clock); ~4x is linear, ~16x "
        "quadratic. Before the scaling pass of 6 December (same machine, its scripts): "
        "deadlines 12.3x, queue-limit 6.9x, displacement 29.3x, aging 7.7x, vtc-tenants "
        "29.3x, sessions-ttl 11.6x, sessions-limit 8.8x.",
        "",
        "| scenario | what | n | s at n | s at 4n | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['what']} | {r['n']} | {r['small_s']:.2f} "
                     f"| {r['large_s']:.2f} | {r['ratio']:.1f}x |")
    publish("queue_scaling", "\n".join(lines) + "\n", rows, args.json, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
