"""Capacity planning: how much KV fits, how many sequences run at once, which max_num_seqs
to pick for a trace, and how many requests per second a deployment sustains.

The recommendations come from simulating the trace (the real scheduler, a cost model),
never from a formula for the scheduler's behaviour.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kvserve.core import SchedulerConfig
from kvserve.core.stop import ended_in_queue
from kvserve.sim.capacity import CapacityError, KVPool
from kvserve.sim.parallel import Workers, next_questions
from kvserve.sim.report import aggregate
from kvserve.sim.trace import TraceRequest
from kvserve.sim.whatif import ShapeTally, off_record

DEFAULT_BUDGET = SchedulerConfig().max_num_batched_tokens


def generated_tokens(request: TraceRequest) -> int:
    """Tokens the simulated model will produce: output_len and EOS, or up to max_tokens
    with ignore_eos; capped by max_tokens."""
    if request.ignore_eos:
        return request.max_tokens or request.output_len
    produced = request.output_len + 1
    return min(produced, request.max_tokens) if request.max_tokens else produced


def trace_seq_len_p95(trace: Sequence[TraceRequest], max_model_len: int | None = None) -> int:
    """95th percentile of prompt + generated tokens, rounded up; with ``max_model_len``, of
    the requests served as a run serves them (a prompt of max_model_len or more is refused,
    J1; a sequence stops at max_model_len), so the headline sizes what the run holds (QA:
    refused 5,000-token prompts raised the p95)."""
    if max_model_len is None:
        lengths = [r.num_prompt_tokens + generated_tokens(r) for r in trace]
    else:
        lengths = [min(r.num_prompt_tokens + generated_tokens(r), max_model_len)
                   for r in trace if r.num_prompt_tokens < max_model_len]
    return math.ceil(float(np.percentile(lengths, 95))) if lengths else 0


def scale_rate(trace: Sequence[TraceRequest], qps: float) -> list[TraceRequest]:
    """The same requests with the gaps between their sending stretched or squeezed to a mean
    rate of ``qps``: each request moves whole (its arrival, receipt, cancel time and
    deadline by one shift, so their offsets stay). A recording's requests are placed by
    their receipt times, when the clients sent them (QA: placed by the times the busy
    recorded engine took them, which fall on its step boundaries, its bursts stayed bursts at
    every rate, and a plan found a capacity of 0.005 req/s)."""
    first = min(r.received for r in trace)
    span = max(r.received for r in trace) - first
    factor = (len(trace) - 1) / span / qps

    def shifted(t: float | None, shift: float) -> float | None:
        return None if t is None else t + shift

    out = []
    for r in trace:
        shift = (r.received - first) * (factor - 1)
        out.append(replace(r, arrival_time=r.arrival_time + shift,
                           cancel_time=shifted(r.cancel_time, shift),
                           deadline=shifted(r.deadline, shift),
                           received_time=shifted(r.received_time, shift)))
    return out


def trace_rate(trace: Sequence[TraceRequest]) -> float | None:
    """The rate the requests were sent at (a recording's: by their receipt times)."""
    times = [r.received for r in trace]
    span = max(times) - min(times)
    return (len(trace) - 1) / span if span > 0 and len(trace) > 1 else None


class BudgetError(ValueError):
    """A max_num_seqs above the token budget the user gave."""


def with_max_num_seqs(settings: dict[str, Any], value: int) -> dict[str, Any]:
    """``settings`` with max_num_seqs = value, raising the default token budget to value if
    it is smaller (the core requires max_num_batched_tokens >= max_num_seqs). A budget the
    user gave is theirs: a value above it is a ValueError (QA: the row ran with a larger
    budget than asked and matched no ``simulate`` run with the user's flags)."""
    out = {**settings, "max_num_seqs": value}
    given = settings.get("max_num_batched_tokens")
    if given is not None and value > given:
        raise BudgetError(f"max_num_seqs {value} is above the --max-num-batched-tokens "
                         f"{given} given or recorded (a step schedules a token per sequence "
                         "at least)")
    if value > DEFAULT_BUDGET:
        out["max_num_batched_tokens"] = value
    return out


def shed(record: Any) -> bool:
    """A request the waiting queue shed under load (refused as full, timed out, displaced:
    ``--max-num-queued-*``, ``--max-queue-delay``), not one refused at any rate."""
    return record.finish_reason == "queue_full" or ended_in_queue(record.finish_reason,
                                                                  record.stop_reason)


SWEEP_FIGURES = ("num_finished", "num_rejected", "num_shed", "num_preemptions",
                 "wasted_fraction", "throughput_output_tok_s", "ttft_p99", "itl_p99",
                 "queue_p99", "longest_stall_s")


def sweep_max_num_seqs(deployment: Any, trace: Sequence[TraceRequest],
                       settings: dict[str, Any], candidates: Sequence[int],
                       seed: int = 0, pool: Workers | None = None,
                       shapes: Counter[tuple[bool, int]] | None = None
                       ) -> list[dict[str, Any]]:
    """Simulate ``trace`` once per candidate on ``deployment`` (a Deployment, or anything
    with its ``simulate``; it must pickle when ``pool`` has more than one worker) and keep
    each run's pool and headline figures, in candidate order. ``shapes``: a recording's
    step shapes, under the model fitted on them: each row says how much of its time went
    to shapes the recording barely has (``off_record``, as simulate and whatif say)."""
    jobs = [(deployment, trace, settings, value, seed, shapes) for value in candidates]
    if pool is None:
        return [sweep_row(*job) for job in jobs]
    return pool.map(sweep_row, jobs)


def sweep_row(deployment: Any, trace: Sequence[TraceRequest], settings: dict[str, Any],
              value: int, seed: int, shapes: Counter[tuple[bool, int]] | None = None
              ) -> dict[str, Any]:
    """One candidate of the max_num_seqs sweep, with the token budget it ran with (above
    the default where the candidate is: serve and simulate refuse such a max_num_seqs
    without that --max-num-batched-tokens, so the row says it; the simulator pass)."""
    budget = settings.get("max_num_batched_tokens") or max(DEFAULT_BUDGET, value)
    try:
        run_settings = with_max_num_seqs(settings, value)
        tally = None if shapes is None else ShapeTally()
        echo, result = deployment.simulate(trace, run_settings, seed=seed, **(
            {} if tally is None else {"observe": tally.add}))
    except (CapacityError, BudgetError) as error:
        # its activation reserve leaves no KV pool, or it is above the token budget given
        return {"max_num_seqs": value, "num_kv_blocks": None, "error": str(error),
                "max_num_batched_tokens": budget, **dict.fromkeys(SWEEP_FIGURES)}
    figures = aggregate(result)
    figures["num_rejected"] = figures["finish_reasons"].get("rejected", 0)
    figures["num_shed"] = sum(1 for record in result.records if shed(record))
    row = {"max_num_seqs": value, "num_kv_blocks": echo["cache"]["num_blocks"],
           "max_num_batched_tokens": budget, **{k: figures[k] for k in SWEEP_FIGURES}}
    if tally is not None and shapes is not None:
        row["off_record"] = off_record(tally, shapes).to_json()
    return row


# Throughputs this close (relative) to the best are a tie: at the trace's rate every candidate
# that keeps up serves it alike, and only the run's tail end tells them apart.
TIE_TOLERANCE = 0.01


def recommend(rows: list[dict[str, Any]], ttft_p99_target: float | None) -> dict[str, Any]:
    """The largest max_num_seqs that never preempts, and the best-throughput one whose p99
    TTFT meets the target (ties, throughputs within TIE_TOLERANCE of the best: the larger
    max_num_seqs: equal at the trace's rate, it has the headroom above it, where the
    capacity search runs; the smaller one made plan report a capacity a third too low when
    every candidate served the trace alike, and a tie by exact equality missed 246.0708
    against 246.0715 tok/s, QA)."""
    rows = [r for r in rows if r.get("error") is None]  # candidates that fit
    num_fitting = len(rows)
    # A run that served the trace: nothing shed by a queue limit or deadline, and no more
    # requests refused than the candidate that refused fewest (a smaller pool refuses the
    # prompts it cannot hold at any rate); its p99s cover only what it served (QA: a run that
    # shed 148 of 200 requests "met" the TTFT target, one that refused 59 of 60 was chosen).
    fewest_rejected = min((r["num_rejected"] for r in rows), default=0)
    rows = [r for r in rows if r["num_shed"] == 0 and r["num_finished"] > 0
            and r["num_rejected"] == fewest_rejected]
    calm = [r["max_num_seqs"] for r in rows if r["num_preemptions"] == 0]
    eligible = [r for r in rows if ttft_p99_target is None
                or (r["ttft_p99"] is not None and r["ttft_p99"] <= ttft_p99_target)]
    top = max((r["throughput_output_tok_s"] for r in eligible), default=0.0)
    best = max((r for r in eligible
                if r["throughput_output_tok_s"] >= top * (1 - TIE_TOLERANCE)),
               key=lambda r: r["max_num_seqs"], default=None)
    return {"max_num_seqs_no_preemption": max(calm) if calm else None,
            "max_num_seqs_best_throughput": best["max_num_seqs"] if best else None,
            "ttft_p99_target_s": ttft_p99_target,
            "num_candidates_fitting": num_fitting}


def capacity_qps(run_queue_p99: Callable[[float], float | None], start_qps: float,
                 queue_p99_bound: float, *, rel_tol: float = 0.02, max_probes: int = 24,
                 run_many: Callable[[list[float]], list[float | None]] | None = None,
                 workers: int = 1,
                 ) -> tuple[float | None, list[dict[str, float | None]]]:
    """The largest rate whose p99 queue delay stays within the bound, by doubling to
    bracket it and then bisection. Returns (qps or None, probes).

    With ``run_many`` (``run_queue_p99`` over a list of rates, at once) and ``workers`` > 1
    the search runs ahead (kvserve.sim.parallel): the probes are the same."""
    p99s: dict[float, float | None] = {}
    probes: list[dict[str, float | None]] = []

    def within(p99: float | None) -> bool:
        return p99 is not None and p99 <= queue_p99_bound

    def search(ok: Callable[[float], bool]) -> float | None:
        lo, hi, asked = 0.0, start_qps, 0

        def probe(qps: float) -> bool:
            nonlocal asked
            asked += 1
            return ok(qps)

        while probe(hi):
            lo, hi = hi, hi * 2
            if asked >= max_probes // 2:
                return lo  # still within bound: report the largest rate tried
        while lo == 0.0 and asked < max_probes // 2:
            hi /= 2
            if probe(hi):
                lo = hi
                hi *= 2
        if lo == 0.0:
            return None
        while (hi - lo) > rel_tol * lo and asked < max_probes:
            mid = (lo + hi) / 2
            if probe(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def ok(qps: float) -> bool:
        if qps not in p99s:
            if run_many is not None and workers > 1:
                # The search asks qps first; the rest are its possible next questions.
                known = {q: within(p) for q, p in p99s.items()}
                ahead = next_questions(search, known, workers)
                p99s.update(zip(ahead, run_many(ahead), strict=True))
            if qps not in p99s:  # the search asked something the replay did not
                p99s[qps] = run_queue_p99(qps)
        p99 = p99s[qps]
        probes.append({"qps": round(qps, 6), "queue_p99": p99})
        return within(p99)

    return search(ok), probes


FLOOR_SHARE = 0.1  # of the capacity: a load at which requests rarely meet one another
FRAGILE_FLOOR = 0.5  # of the bound: a floor this high leaves the queue little to decide


def capacity_floor(run_queue_p99: Callable[[float], float | None], capacity: float,
                   queue_p99_bound: float) -> tuple[float | None, str | None]:
    """The p99 queue delay at a tenth of ``capacity`` (the floor: what one long step makes an
    arrival wait, with almost no queue), and a note when the floor is at least half the
    bound. Then the bound is crossed where the longest steps pile up, not where the queue
    starts to grow: p99 queueing sits near the bound over a wide range of rates, and the
    capacity moves far with small changes in step time (on the engine: run-to-run noise)."""
    floor = run_queue_p99(FLOOR_SHARE * capacity)
    if floor is None or floor < FRAGILE_FLOOR * queue_p99_bound:
        return floor, None
    return floor, (f"at {FLOOR_SHARE:.0%} of this capacity the p99 queue delay is already "
                   f"{floor:.2f} s, {floor / queue_p99_bound:.0%} of the {queue_p99_bound:g} s "
                   "bound: it is set by the longest steps more than by queueing, so the "
                   "capacity is fragile; a smaller --max-num-batched-tokens shortens those "
                   "steps, a larger --queue-delay-p99 moves the bound to where the queue grows")


def kv_summary(pool: KVPool, seq_len: int) -> dict[str, Any]:
    return {**pool.to_json(), "seq_len": seq_len,
            "max_concurrency": pool.max_concurrency(seq_len)}
