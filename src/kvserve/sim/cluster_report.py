"""What a cluster simulation adds to the report (docs/scale-out.md, "The report"): each
request row's ``replica``, a ``replicas`` list (per-replica figures and time series) and
the ``router``'s decisions. A single-replica run's report has none of them."""

from __future__ import annotations

from html import escape
from typing import Any

from kvserve.sim import svg
from kvserve.sim.cluster import ClusterResult
from kvserve.sim.report import _round, aggregate, state_times, time_mean
from kvserve.sim.simulator import SimResult
from kvserve.sim.table import fmt_pct, fmt_s

REPLICA_FIGURES = ("num_requests", "num_finished", "num_steps", "num_preemptions",
                   "throughput_output_tok_s", "ttft_p50", "ttft_p99", "itl_p99",
                   "prefix_hit_rate", "kv_usage_peak", "kv_usage_mean")
MAX_CHART_REPLICAS = 8


def replica_summary(replica: int, result: SimResult) -> dict[str, Any]:
    figures = aggregate(result)
    steps = result.steps
    return {
        "replica": replica,
        **{name: figures[name] for name in REPLICA_FIGURES},
        "num_running_mean": _round(time_mean(steps.num_running, state_times(result),
                                             result.start_time, result.end_time)),
        "num_waiting_mean": _round(time_mean(steps.num_waiting, state_times(result),
                                             result.start_time, result.end_time)),
        "time_series": {
            "time": [_round(t) for t in steps.time],
            "kv_usage": [_round(u) for u in steps.kv_usage],
            "num_running": list(steps.num_running),
            "num_waiting": list(steps.num_waiting),
        },
    }


def add_cluster_sections(report: dict[str, Any], result: SimResult) -> dict[str, Any]:
    """``report`` (from build_report) with the cluster's parts, when ``result`` is one."""
    if not isinstance(result, ClusterResult):
        return report
    for row in report["requests"]:
        row["replica"] = result.replica_of.get(row["request_id"])
    report["replicas"] = [replica_summary(i, part) for i, part in enumerate(result.replicas)]
    routed = sum(result.route_reasons.values())
    report["router"] = {
        "decisions": result.route_reasons,
        "prefix_hit_share": _round(result.route_reasons.get("prefix_hit", 0) / routed
                                   if routed else 0.0),
    }
    return report


def print_replicas(report: dict[str, Any]) -> None:
    """The per-replica table on the terminal."""
    from rich.console import Console
    from rich.table import Table

    decisions = ", ".join(f"{k} {v}" for k, v in report["router"]["decisions"].items())
    table = Table(title=f"replicas (router decisions: {decisions})", title_justify="left")
    for column in ("replica", "requests", "steps", "preempt", "out tok/s", "TTFT p99",
                   "ITL p99", "prefix hits", "KV peak", "KV mean"):
        table.add_column(column, justify="right")
    for r in report["replicas"]:
        table.add_row(str(r["replica"]), f"{r['num_requests']:,}", f"{r['num_steps']:,}",
                      f"{r['num_preemptions']:,}", f"{r['throughput_output_tok_s']:,.1f}",
                      fmt_s(r["ttft_p99"]), fmt_s(r["itl_p99"]), fmt_pct(r["prefix_hit_rate"]),
                      fmt_pct(r["kv_usage_peak"]), fmt_pct(r["kv_usage_mean"]))
    Console(width=120, highlight=False).print(table)


def render_replicas(report: dict[str, Any]) -> list[str]:
    """The HTML section for a cluster report: a table and per-replica charts."""
    replicas = report.get("replicas")
    if not replicas:
        return []
    dp = report["config"].get("data_parallel", {})
    decisions = ", ".join(f"{k} {v}" for k, v in report["router"]["decisions"].items())
    body = [f"<h2>Replicas</h2><p class=\"muted\">{len(replicas)} replicas, router "
            f"{escape(str(dp.get('router')))}"
            f"{', lockstep' if dp.get('lockstep') else ''}; decisions: {escape(decisions)}</p>"]
    head = "".join(f"<th>{c}</th>" for c in (
        "replica", "requests", "steps", "preemptions", "out tok/s", "TTFT p99", "ITL p99",
        "prefix hit rate", "KV peak / mean", "running mean", "waiting mean"))
    rows = "".join(
        f"<tr><td>{r['replica']}</td><td>{r['num_requests']:,}</td><td>{r['num_steps']:,}</td>"
        f"<td>{r['num_preemptions']:,}</td><td>{r['throughput_output_tok_s']:,.1f}</td>"
        f"<td>{fmt_s(r['ttft_p99'])}</td><td>{fmt_s(r['itl_p99'])}</td>"
        f"<td>{fmt_pct(r['prefix_hit_rate'])}</td>"
        f"<td>{fmt_pct(r['kv_usage_peak'])} / {fmt_pct(r['kv_usage_mean'])}</td>"
        f"<td>{r['num_running_mean']:.1f}</td><td>{r['num_waiting_mean']:.1f}</td></tr>"
        for r in replicas)
    body.append(f"<table><tr>{head}</tr>{rows}</table>")
    shown = replicas[:MAX_CHART_REPLICAS]
    note = "" if len(shown) == len(replicas) else f" (first {len(shown)} replicas)"
    kv, load = [], []
    for r in shown:
        series = r["time_series"]
        t, usage = svg.downsample(series["time"], series["kv_usage"])
        kv.append((f"replica {r['replica']}", t, [100 * u for u in usage]))
        t, running = svg.downsample(series["time"], series["num_running"])
        load.append((f"replica {r['replica']}", t, running))
    body.append('<div class="grid2">')
    body.append(svg.line_chart(f"KV cache usage per replica{note}", kv, "simulated time (s)",
                               "% of blocks", y_max=100, step=True))
    body.append(svg.line_chart(f"Running requests per replica{note}", load,
                               "simulated time (s)", "requests", step=True))
    body.append("</div>")
    return body
