"""Summary figures of a benchmark run, and their table."""

from __future__ import annotations

from typing import Any

from kvserve.bench.runner import RunResult

_QUANTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _latency(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}_ms": _ms(percentile(values, q)) for q in _QUANTILES}
    out["mean_ms"] = _ms(sum(values) / len(values)) if values else None
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _delta(run: RunResult, name: str) -> float | None:
    if run.metrics_before is None or run.metrics_after is None:
        return None
    if name not in run.metrics_after:
        return None
    return run.metrics_after[name] - run.metrics_before.get(name, 0.0)


def _tpot(result: Any) -> float | None:
    """vLLM's time per output token after the first: (E2E - TTFT) / (tokens - 1); None
    for an answer not streamed (its TTFT is its E2E: QA read a measured 0 ms)."""
    if not result.streamed or result.ttft is None or result.e2e is None \
            or result.num_output_tokens < 2:
        return None
    return (result.e2e - result.ttft) / (result.num_output_tokens - 1)


VLLM_METRICS = ("ttft", "tpot", "itl", "e2el")


def _vllm_flat(name: str, values: list[float],
               percentiles: tuple[float, ...]) -> dict[str, float | None]:
    """vLLM's bench keys for one metric: mean_, median_, std_ and p<P>_<name>_ms for each P
    of ``percentiles`` (vLLM's --metric-percentiles: 99.9 is "p99.9")."""
    keys = [f"p{p:g}_{name}_ms" for p in percentiles]
    if not values:
        return {key: None for key in (f"mean_{name}_ms", f"median_{name}_ms",
                                      f"std_{name}_ms", *keys)}
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    return {f"mean_{name}_ms": _ms(mean), f"median_{name}_ms": _ms(percentile(values, 50)),
            f"std_{name}_ms": _ms(std),
            **{key: _ms(percentile(values, p)) for key, p in zip(keys, percentiles,
                                                                  strict=True)}}


def summarize(run: RunResult, metrics: tuple[str, ...] = VLLM_METRICS,
              percentiles: tuple[float, ...] = (99,)) -> dict[str, Any]:
    """The run's figures; ``metrics`` and ``percentiles`` choose vLLM's flat keys (its
    --percentile-metrics and --metric-percentiles)."""
    results = run.results
    done = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:  # long enough to name the limit a 503 hit (QA)
            key = r.error if len(r.error) <= 240 else r.error[:237] + "..."
            errors[key] = errors.get(key, 0) + 1
    output_tokens = sum(r.num_output_tokens for r in done)
    prompt_tokens = sum(r.num_prompt_tokens for r in done)
    duration = max(run.duration, 1e-9)
    series = {"ttft": [r.ttft for r in done if r.ttft is not None],
              "tpot": [t for t in map(_tpot, done) if t is not None],
              "itl": [gap for r in done for gap in r.itls],
              "e2el": [r.e2e for r in done if r.e2e is not None]}
    return {
        "num_requests": len(results),
        "completed": len(done),
        "failed": sum(1 for r in results if r.error is not None),
        "disconnected": sum(1 for r in results if r.disconnected),
        "errors": errors,
        "error_counts": errors,  # kept by --save-detailed, whose "errors" is per request
        # completed answers that came with no usage: their output tokens are the streamed
        # text events counted (one per token on a server that sends one at a time), or 0
        "usage_missing": sum(1 for r in done if r.usage_missing),
        "duration_s": round(run.duration, 3),
        "request_throughput": round(len(done) / duration, 3),
        "output_throughput": round(output_tokens / duration, 2),
        "total_token_throughput": round((output_tokens + prompt_tokens) / duration, 2),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "ttft": _latency(series["ttft"]),
        "tpot": _latency(series["tpot"]),
        "itl": _latency(series["itl"]),
        "e2e": _latency(series["e2el"]),
        "preemptions": _delta(run, "vllm:num_preemptions_total"),
        "recomputed_tokens": _delta(run, "kvserve:recomputed_tokens_total"),
        "kv_cache_usage_after": (run.metrics_after or {}).get("vllm:kv_cache_usage_perc"),
        "requests_running_after": (run.metrics_after or {}).get("vllm:num_requests_running"),
        # vLLM's bench keys too, so its plotting and collection scripts read this file
        "duration": round(run.duration, 3), "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        **{key: value for name in metrics
           for key, value in _vllm_flat(name, series[name], percentiles).items()},
    }


def detailed(run: RunResult) -> dict[str, list[Any]]:
    """Per-request figures in request order, under vLLM's ``--save-detailed`` keys: prompt
    and output lengths, TTFT and the inter-token gaps (seconds), the generated text, and the
    error ("" when none)."""
    results = sorted(run.results, key=lambda r: r.index)
    return {"input_lens": [r.num_prompt_tokens for r in results],
            "output_lens": [r.num_output_tokens for r in results],
            "ttfts": [r.ttft for r in results],
            "itls": [r.itls for r in results],
            "generated_texts": [r.generated_text for r in results],
            "errors": [r.error or "" for r in results]}


def format_table(summary: dict[str, Any]) -> str:
    def fmt(value: Any) -> str:
        return "-" if value is None else f"{value:,}" if isinstance(value, int) else \
            f"{value:,.2f}" if isinstance(value, float) else str(value)
    lines = [
        f"requests: {summary['completed']} completed, {summary['failed']} failed, "
        f"{summary['disconnected']} disconnected"
        + (f", {summary['interrupted']} interrupted" if summary.get("interrupted") else "")
        + f", of {summary['num_requests']} "
        f"in {summary['duration_s']:.1f} s",
        f"throughput: {fmt(summary['request_throughput'])} req/s, "
        f"{fmt(summary['output_throughput'])} output tok/s, "
        f"{fmt(summary['total_token_throughput'])} total tok/s",
        f"{'':6} {'p50 ms':>10} {'p90 ms':>10} {'p99 ms':>10} {'mean ms':>10}"
        + (f"   (over the {summary['completed']} completed)" if summary["failed"] else "")]
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = summary[name]
        lines.append(f"{name.upper():6} " + " ".join(
            f"{fmt(row[k]):>10}" for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")))
    def count(value: Any) -> str:  # a Prometheus counter reads as a float: 4.0 -> 4
        return fmt(int(value) if isinstance(value, float) and value.is_integer() else value)
    lines.append(f"preemptions (from /metrics): {count(summary['preemptions'])}, recomputed "
                 f"tokens: {count(summary['recomputed_tokens'])}")
    for error, times in summary["error_counts"].items():
        lines.append(f"error x{times}: {error}")
    if summary["usage_missing"]:
        counted = "the text events counted (an event of several tokens reads low)" \
            if summary.get("stream", True) else "not counted"
        lines.append(f"warning: {summary['usage_missing']} answer(s) came with no usage: "
                     f"their output tokens are {counted}")
    return "\n".join(lines)
