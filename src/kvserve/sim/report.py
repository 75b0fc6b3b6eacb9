"""The simulation report (docs/architecture.md, "Files and formats"): config echo, aggregate
figures, per-request rows and per-step time series, as one JSON object.

Determinism: the report holds simulated quantities only (never wall time), floats are
rounded to microseconds, keys keep a fixed order, so the same trace + flags + seed give the
same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from itertools import repeat
from typing import Any

import numpy as np

from kvserve.sim import indented_json
from kvserve.sim.simulator import RequestRecord, SimResult

REPORT_VERSION = 1
PERCENTILES = (("p50", 50), ("p90", 90), ("p99", 99))
LATENCIES = ("ttft", "itl", "e2e", "queue")


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(float(value), digits)


def summarise(name: str, values: Iterable[float] | np.ndarray) -> dict[str, float | None]:
    """``{name}_mean, _p50, _p90, _p99, _max`` (None when there are no values)."""
    data = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=float)
    if data.size == 0:
        return {f"{name}_{key}": None for key in ("mean", "p50", "p90", "p99", "max")}
    points = np.percentile(data, [q for _, q in PERCENTILES])
    out = {f"{name}_mean": _round(data.mean())}
    for (key, _), value in zip(PERCENTILES, points, strict=True):
        out[f"{name}_{key}"] = _round(value)
    out[f"{name}_max"] = _round(data.max())
    return out


def request_latencies(record: RequestRecord) -> dict[str, float | None]:
    m = record.metrics
    if m is None:
        return {"ttft": None, "e2e": None, "queue": None}
    ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
    # An aborted request (cancelled, timed out in the queue, displaced) has no end-to-end
    # latency, as a benchmark client counts none for a failed request: its end is the abort
    # (timeouts at the deadline made the E2E p50 the deadline).
    e2e = None if record.finish_reason == "abort" else m.finished_time - m.arrival_time
    return {"ttft": ttft, "e2e": e2e, "queue": m.queue_time}


def time_mean(values: Any, times: Any, start: float, end: float) -> float:
    """The time-average over the run, ``start`` (its first arrival) to ``end``, of a series
    whose value ``values[i]`` holds from ``times[i]`` until the next point (the last one
    until ``end``; before the first, nothing ran: 0). Idle time counts at what the last step
    left, so a mean means the same for one replica as for a cluster's average over them
    (QA: one replica's KV mean was over its busy steps only, ten times a cluster's)."""
    data = np.asarray(values, dtype=float)
    if end <= start or not len(data):
        return 0.0
    points = np.asarray(times, dtype=float)
    following = np.append(points[1:], end)
    return float((data * np.clip(following - points, 0.0, None)).sum() / (end - start))


def state_times(result: SimResult) -> Any:
    """When each point's state (sampled after a step) begins: a replica's step's end (its
    series has each step's start); a cluster's series is sampled at its steps' ends
    already. So one replica's means and a cluster's average of them agree exactly (QA: by
    0.1%)."""
    steps = result.steps
    if getattr(result, "replicas", None):
        return steps.time
    return np.asarray(steps.time, dtype=float) + np.asarray(steps.duration, dtype=float)


def aggregate(result: SimResult) -> dict[str, Any]:
    """The run's headline figures. Definitions:

    duration_s: first arrival to the end of the last step. output_tokens: every sampled
    token (EOS included). scheduled_tokens: every token computed, recomputation included;
    throughput_total_tok_s is that per second. wasted_fraction: recomputed / scheduled.
    ttft: first token - arrival; itl: every gap between a request's consecutive tokens
    (preemption stalls included); e2e: finish - arrival, of requests not aborted; queue:
    first scheduled - arrival.
    kv_usage_mean is the time-average over the run (time_mean). Percentiles interpolate
    linearly.
    With a host tier in use (preemption mode swap or auto), also: preemptions_by_mode
    ("recompute" + "swap" = num_preemptions; "priority": those for an urgent arrival), and
    swapped_{out,in}_{blocks,bytes}, the KV copied to and from the host tier.
    """
    records = result.records
    steps = result.steps
    duration = result.end_time - result.start_time
    finished = [r for r in records if r.metrics is not None and r.finish_reason != "abort"]
    latencies = [request_latencies(r) for r in records]
    num_output = sum(r.num_output_tokens for r in records)
    num_prompt = sum(r.num_prompt_tokens for r in finished)
    usage = np.frombuffer(steps.kv_usage, dtype=float) if len(steps.kv_usage) else None
    reasons: dict[str, int] = {}
    for record in records:
        reasons[record.finish_reason] = reasons.get(record.finish_reason, 0) + 1
    out: dict[str, Any] = {
        "num_requests": len(records),
        "num_finished": len(finished),
        "finish_reasons": dict(sorted(reasons.items())),
        "num_steps": result.num_steps,
        "duration_s": _round(duration),
        "num_preemptions": result.num_preemptions,
        "num_preempted_requests": sum(
            1 for r in records if r.metrics is not None and r.metrics.num_preemptions > 0),
        "scheduled_tokens": result.num_scheduled_tokens,
        "recomputed_tokens": result.num_recomputed_tokens,
        **_swap_figures(result),
        **({"sessions": result.sessions} if result.sessions else {}),
        "wasted_fraction": _round(result.num_recomputed_tokens / result.num_scheduled_tokens
                                  if result.num_scheduled_tokens else 0.0),
        "prompt_tokens": num_prompt,
        "output_tokens": num_output,
        "throughput_output_tok_s": _round(num_output / duration if duration > 0 else 0.0),
        "throughput_total_tok_s": _round(result.num_scheduled_tokens / duration
                                         if duration > 0 else 0.0),
        "throughput_req_s": _round(len(finished) / duration if duration > 0 else 0.0),
    }
    for name in LATENCIES:
        if name == "itl":
            values: Any = np.frombuffer(result.itl_samples, dtype=float)
        else:
            values = [lat[name] for lat in latencies if lat[name] is not None]
        out.update(summarise(name, values))
    stalls = [r.metrics.longest_stall for r in records if r.metrics is not None]
    out["longest_stall_s"] = _round(max(stalls, default=0.0))
    queries = result.prefix_cache_queries
    out["prefix_hit_rate"] = _round(result.prefix_cache_hits / queries if queries else 0.0)
    # a cluster's: the fullest replica's pool at its fullest (the replicas' average hid
    # one replica at 100% behind idle ones, QA); its mean is of the average, as the load
    parts = getattr(result, "replicas", None)
    out["kv_usage_peak"] = _round(
        max((max(part.steps.kv_usage, default=0.0) for part in parts), default=0.0) if parts
        else usage.max() if usage is not None else 0.0)
    out["kv_usage_mean"] = _round(time_mean(steps.kv_usage, state_times(result),
                                            result.start_time, result.end_time))
    out["deadline_misses"] = sum(
        1 for r in records if r.deadline is not None
        and (r.metrics is None or r.metrics.finished_time > r.deadline))
    out["blocked_steps"] = dict(sorted(result.num_blocked_steps.items()))
    if any(r.tenant for r in records):
        out["tenants"] = tenant_service(records)
        out["jain_fairness_index"] = _round(jain_index(
            [t["service"] for t in out["tenants"].values()]))
    return out


def tenant_service(records: list[RequestRecord], prompt_price: float = 1.0,
                   output_price: float = 2.0) -> dict[str, dict[str, Any]]:
    """Per tenant: tokens served (the prompts of requests that were scheduled, every output
    token), service = prompt_price x prompt + output_price x output (VTC's default prices),
    its share of all service, and TTFT p50/p99."""
    by_tenant: dict[str, list[RequestRecord]] = {}
    for record in records:
        by_tenant.setdefault(record.tenant, []).append(record)
    rows: dict[str, dict[str, Any]] = {}
    for tenant, mine in sorted(by_tenant.items()):
        prompt = sum(r.num_prompt_tokens for r in mine if r.metrics is not None
                     and r.metrics.first_scheduled_time is not None)
        output = sum(r.num_output_tokens for r in mine)
        ttfts = [lat for lat in (request_latencies(r)["ttft"] for r in mine)
                 if lat is not None]
        rows[tenant] = {"num_requests": len(mine), "prompt_tokens": prompt,
                        "output_tokens": output,
                        "service": prompt_price * prompt + output_price * output,
                        **summarise("ttft", ttfts)}
    total = sum(row["service"] for row in rows.values())
    for row in rows.values():
        row["service_share"] = _round(row["service"] / total if total else 0.0)
    return rows


def jain_index(values: list[float]) -> float:
    """Jain's fairness index, (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one
    tenant has everything."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 1.0


def _swap_figures(result: SimResult) -> dict[str, Any]:
    """The host tier's figures; none in recompute mode, whose reports stay as they were."""
    if result.preemption_mode == "recompute":
        return {}
    return {
        "preemptions_by_mode": dict(result.num_preemptions_by_mode),
        "swapped_out_blocks": result.num_swapped_out_blocks,
        "swapped_in_blocks": result.num_swapped_in_blocks,
        "swapped_out_bytes": result.num_swapped_out_blocks * result.bytes_per_block,
        "swapped_in_bytes": result.num_swapped_in_blocks * result.bytes_per_block,
    }


def request_rows(result: SimResult) -> list[dict[str, Any]]:
    rows = []
    for record in result.records:
        m = record.metrics
        lat = request_latencies(record)
        gaps = record.num_output_tokens - 1
        rows.append({
            "request_id": record.request_id,
            "arrival_time": _round(record.arrival_time),
            "first_scheduled_time": _round(m.first_scheduled_time if m else None),
            "first_token_time": _round(m.first_token_time if m else None),
            "finished_time": _round(m.finished_time if m else None),
            "finish_reason": record.finish_reason,
            "stop_reason": record.stop_reason,
            "prompt_tokens": record.num_prompt_tokens,
            "output_tokens": record.num_output_tokens,
            "cached_tokens": m.num_cached_tokens if m else 0,
            "num_preemptions": m.num_preemptions if m else 0,
            "recomputed_tokens": m.num_recomputed_tokens if m else 0,
            **({} if result.preemption_mode == "recompute"
               else {"num_swaps": m.num_swaps if m else 0}),
            "ttft_s": _round(lat["ttft"]),
            "e2e_s": _round(lat["e2e"]),
            "queue_s": _round(lat["queue"]),
            "itl_mean_s": _round(record.itl_sum / gaps if gaps > 0 else None),
            "itl_max_s": _round(record.itl_max if gaps > 0 else None),
            "longest_stall_s": _round(m.longest_stall if m else 0.0),
            # Key kept from report version 1: the preempted spans, preemption -> resume.
            "stalls": [[_round(a), _round(b)] for a, b in record.preempted_spans],
        })
        if record.tenant:
            rows[-1]["tenant"] = record.tenant
    return rows


def time_series(result: SimResult) -> dict[str, list[Any]]:
    steps = result.steps
    # The series are arrays of doubles: round() of each is _round() of each, without a
    # Python call per step.
    return {
        "time": list(map(round, steps.time, repeat(6))),
        "step_duration": list(map(round, steps.duration, repeat(9))),
        "num_scheduled_tokens": list(steps.num_scheduled_tokens),
        "num_running": list(steps.num_running),
        "num_waiting": list(steps.num_waiting),
        "kv_usage": list(map(round, steps.kv_usage, repeat(6))),
    }


def build_report(config: dict[str, Any], result: SimResult) -> dict[str, Any]:
    return {
        "kvserve_report": REPORT_VERSION,
        "config": config,
        "aggregate": aggregate(result),
        "requests": request_rows(result),
        "time_series": time_series(result),
    }


def build_sweep_report(config: dict[str, Any], name: str,
                       runs: list[tuple[Any, int, dict[str, Any]]]) -> dict[str, Any]:
    """One row per swept value: the value, that run's KV blocks (sized from memory, the pool
    can depend on the swept value) and its aggregate."""
    rows = [{"value": v, "num_kv_blocks": n, "aggregate": a} for v, n, a in runs]
    return {
        "kvserve_report": REPORT_VERSION,
        "config": config,
        "sweep": {"name": name, "rows": rows},
    }


def dumps(report: dict[str, Any]) -> str:
    """The report as JSON, indented by one space (``json.dumps(report, indent=1)``, written
    faster: kvserve.sim.indented_json)."""
    return indented_json.dumps(report, indent=1) + "\n"


def events_jsonl(result: SimResult) -> str:
    """One JSON line per scheduler event; a cluster's lines name the replica that held the
    request (``replica``)."""
    replica_of = getattr(result, "replica_of", None)
    lines = []
    for event in result.events:
        row = {"time": _round(event.time), "kind": event.kind, "request_id": event.request_id,
               "num_tokens": event.num_tokens, "reason": event.reason}
        if replica_of is not None and event.request_id in replica_of:
            row["replica"] = replica_of[event.request_id]
        lines.append(json.dumps(row, separators=(",", ":")))
    return "".join(line + "\n" for line in lines)
