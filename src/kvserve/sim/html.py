"""The HTML rendering of a simulation report: one self-contained page (inline SVG and CSS,
no scripts, nothing fetched), for people. The JSON report stays the source of truth."""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from typing import Any

import numpy as np

from kvserve.sim import svg
from kvserve.sim.cluster_report import render_replicas
from kvserve.sim.table import SWEEP_COLUMNS, fmt_pct, fmt_s

REPORT_CSS = """
body { font: 14px system-ui, sans-serif; margin: 24px; color: #0f172a; max-width: 1320px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; }
.grid2 { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 480px), 1fr));
         gap: 12px; }
svg { max-width: 100%; height: auto; } .grid2 svg { width: 100%; max-width: 650px; }
table { border-collapse: collapse; margin: 6px 0; }
td, th { padding: 3px 10px; border-bottom: 1px solid #e2e8f0; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.figures { display: grid; grid-template-columns: repeat(5, 1fr); gap: 8px; margin: 12px 0; }
.figure { background: #f1f5f9; border-radius: 6px; padding: 8px 10px; }
.figure b { display: block; font-size: 18px; }
.muted { color: #64748b; } pre { background: #f8fafc; padding: 8px; font-size: 12px; }
""" + svg.SVG_CSS

MAX_TIMELINE_ROWS = 200


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{REPORT_CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")


def _figures(a: dict[str, Any]) -> str:
    cells = [
        ("requests", f"{a['num_requests']:,}"), ("simulated time", f"{a['duration_s']:.2f} s"),
        ("output tok/s", f"{a['throughput_output_tok_s']:,.1f}"),
        ("TTFT p99", fmt_s(a["ttft_p99"])), ("ITL p99", fmt_s(a["itl_p99"])),
        ("preemptions", f"{a['num_preemptions']:,}"),
        ("wasted work", fmt_pct(a["wasted_fraction"])),
        ("longest stall", fmt_s(a["longest_stall_s"])),
        ("prefix hit rate", fmt_pct(a["prefix_hit_rate"])),
        ("KV peak / mean", f"{fmt_pct(a['kv_usage_peak'])} / {fmt_pct(a['kv_usage_mean'])}"),
    ]
    return '<div class="figures">' + "".join(
        f'<div class="figure"><span class="muted">{escape(k)}</span><b>{escape(v)}</b></div>'
        for k, v in cells) + "</div>"


def _latency_table(a: dict[str, Any]) -> str:
    head = "".join(f"<th>{c}</th>" for c in ("", "mean", "p50", "p90", "p99", "max"))
    rows = "".join(
        f"<tr><td>{label}</td>" + "".join(f"<td>{fmt_s(a[f'{name}_{c}'])}</td>"
                                          for c in ("mean", "p50", "p90", "p99", "max"))
        + "</tr>"
        for name, label in (("ttft", "TTFT"), ("itl", "inter-token"), ("e2e", "end to end"),
                            ("queue", "queue")))
    return f"<table><tr>{head}</tr>{rows}</table>"


def _config(config: dict[str, Any]) -> str:
    return ("<details><summary>configuration</summary><pre>"
            + escape(json.dumps(config, indent=1)) + "</pre></details>")


def _title(config: dict[str, Any]) -> str:
    cost = config.get("cost_model", {})
    model = f"{cost.get('model')} on {cost.get('hardware')}" if "model" in cost else \
        cost.get("name", "")
    return (f"{model}, {config.get('batching', 'continuous')} batching, "
            f"{config['cache']['num_blocks']:,} KV blocks of {config['cache']['block_size']}")


def _timeline_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    if len(rows) <= MAX_TIMELINE_ROWS:
        return rows, f"all {len(rows)} requests"
    picks = np.linspace(0, len(rows) - 1, MAX_TIMELINE_ROWS).astype(int)
    return [rows[i] for i in picks], (f"{MAX_TIMELINE_ROWS} of {len(rows)} requests, evenly "
                                      "spaced in arrival order")


def render_report(report: dict[str, Any], itl_samples: Sequence[float] | None = None) -> str:
    """The page for one run. ``itl_samples`` (every inter-token gap) gives the ITL
    histogram; without them it shows each request's mean gap."""
    a, config, series = report["aggregate"], report["config"], report["time_series"]
    rows = report["requests"]
    body = [f"<h1>kvserve simulation: {escape(_title(config))}</h1>",
            f'<p class="muted">{a["num_steps"]:,} steps; finish reasons: '
            + escape(", ".join(f"{k} {v}" for k, v in a["finish_reasons"].items())) + "</p>",
            _figures(a), _latency_table(a), *render_replicas(report)]
    t, kv = svg.downsample(series["time"], series["kv_usage"])
    t2, running = svg.downsample(series["time"], series["num_running"])
    t3, waiting = svg.downsample(series["time"], series["num_waiting"])
    body.append("<h2>Over time</h2><div class=\"grid2\">")
    body.append(svg.line_chart("KV cache usage", [("KV usage", t, [100 * u for u in kv])],
                               "simulated time (s)", "% of blocks", y_max=100, step=True))
    body.append(svg.line_chart("Running and waiting requests",
                               [("running", t2, running), ("waiting", t3, waiting)],
                               "simulated time (s)", "requests", step=True))
    body.append("</div><h2>Latency distributions</h2><div class=\"grid2\">")
    ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    body.append(svg.histogram("TTFT", ttft, "seconds",
                              marks=[("p50", a["ttft_p50"]), ("p99", a["ttft_p99"])]))
    if itl_samples is not None:
        itl = np.asarray(itl_samples, dtype=float)
        title = "Inter-token latency (every gap)"
    else:
        itl = np.asarray([r["itl_mean_s"] for r in rows if r["itl_mean_s"] is not None])
        title = "Inter-token latency (mean per request)"
    cut = float(np.percentile(itl, 99.5)) if itl.size else 0.0
    shown = itl[itl <= cut] if itl.size else itl
    if itl.size > shown.size:
        title += f"; {itl.size - shown.size:,} gaps above p99.5 not drawn"
    body.append(svg.histogram(title, shown, "seconds",
                              marks=[("p50", a["itl_p50"]), ("p99", a["itl_p99"])]))
    body.append("</div>")
    picked, note = _timeline_rows(rows)
    body.append(f"<h2>Requests over time</h2><p class=\"muted\">{escape(note)}; grey: queued, "
                "amber: prefill (first scheduled to first token), blue: decode, red: "
                "preempted and waiting to resume. Hover a bar for its figures.</p>")
    body.append(svg.timeline("Per-request timeline", picked))
    body.append(_config(config))
    return _page("kvserve simulation", body)


SWEEP_CURVES = (
    ("Preemptions", "num_preemptions", "preemptions", 1.0),
    ("Wasted work (recomputed tokens)", "wasted_fraction", "% of scheduled tokens", 100.0),
    ("Output throughput", "throughput_output_tok_s", "tokens/s", 1.0),
    ("Longest preemption stall", "longest_stall_s", "seconds", 1.0),
    ("TTFT p99", "ttft_p99", "seconds", 1.0),
    ("ITL p99", "itl_p99", "seconds", 1.0),
)


def render_sweep(report: dict[str, Any]) -> str:
    sweep, config = report["sweep"], report["config"]
    name, rows = sweep["name"], sweep["rows"]
    values = [r["value"] for r in rows]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    xs = values if numeric else list(range(len(values)))
    # Swept sizes usually double (64, 128, 256): a log axis spaces them evenly.
    log_x = numeric and min(values) > 0 and max(values) / min(values) >= 8
    body = [f"<h1>kvserve sweep of {escape(name)}</h1>",
            f'<p class="muted">{escape(", ".join(map(str, values)))}</p>',
            "<h2>Trade-offs</h2><div class=\"grid2\">"]
    for title, key, unit, scale in SWEEP_CURVES:
        ys = [None if r["aggregate"][key] is None else r["aggregate"][key] * scale
              for r in rows]
        body.append(svg.line_chart(f"{title} vs {name}", [(title, xs, ys)],
                                   name, unit, markers=True, log_x=log_x, x_ticks=xs,
                                   x_tick_labels=None if numeric else [str(v) for v in values]))
    body.append("</div><h2>Figures</h2>")
    head = f"<th>{escape(name)}</th>" + "".join(f"<th>{c}</th>" for c, _ in SWEEP_COLUMNS)
    lines = "".join(
        f"<tr><td>{escape(str(r['value']))}</td>"
        + "".join(f"<td>{escape(fn(r['aggregate']))}</td>" for _, fn in SWEEP_COLUMNS)
        + "</tr>" for r in rows)
    body.append(f"<table><tr>{head}</tr>{lines}</table>")
    body.append(_config(config))
    return _page(f"kvserve sweep of {name}", body)
