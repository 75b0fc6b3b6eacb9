"""The HTML page of ``kvserve whatif``: every run on the same axes (inline SVG, no script)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from kvserve.sim import svg
from kvserve.sim.html import _page
from kvserve.sim.report import request_latencies
from kvserve.sim.whatif import SAME_DECISIONS, Run, figure, latency_text, rows_for

WIDTH = 760


def render_whatif(title: str, runs: Sequence[Run],
                  movers: dict[str, list[dict[str, Any]]], still: dict[str, str]) -> str:
    """``still``: for each change whose movers are none, what to say instead
    (whatif.nothing_moved)."""
    body = [f"<h1>kvserve whatif: {escape(title)}</h1>",
            '<p class="muted">The recorded run is the replay of the server\'s own step '
            "times; every chart puts all runs on the same axes.</p>", _figures(runs),
            '<h2>Over time</h2><div class="grid2">']
    series = {"KV usage": "kv_usage", "running": "num_running", "waiting": "num_waiting"}
    for name, key in series.items():
        lines = []
        for run in runs:
            xs, ys = svg.downsample(list(run.result.steps.time),
                                    list(getattr(run.result.steps, key)))
            lines.append((run.label, xs, [100 * y for y in ys] if key == "kv_usage" else ys))
        body.append(svg.line_chart(name, lines, "time (s)",
                                   "% of blocks" if key == "kv_usage" else "requests",
                                   step=True, y_max=100 if key == "kv_usage" else None,
                                   width=WIDTH))
    latency = []
    for run in runs:
        points = sorted((r.arrival_time, request_latencies(r)["e2e"])
                        for r in run.result.records if request_latencies(r)["e2e"] is not None)
        latency.append((run.label, [p[0] for p in points], [p[1] for p in points]))
    body.append(svg.line_chart("E2E by arrival", latency, "arrival (s)", "seconds",
                               markers=True, width=WIDTH))
    body.append("</div>")
    for label, rows in movers.items():
        body.append(f"<h2>Requests that moved most: {escape(label)}</h2>")
        body.append(_movers(rows, still.get(label, "")))
    return _page("kvserve whatif", body)


def _figures(runs: Sequence[Run]) -> str:
    head = "<tr><th></th>" + "".join(f"<th>{escape(r.label)}</th>" for r in runs) + "</tr>"
    rows = "".join(f"<tr><td>{escape(label)}</td>" + "".join(
        f"<td>{escape(figure(r.aggregate, key, pattern))}</td>" for r in runs) + "</tr>"
        for label, key, pattern in rows_for(runs))
    return f"<table>{head}{rows}</table>"


def _movers(rows: list[dict[str, Any]], still: str) -> str:
    if not rows:
        return f'<p class="muted">{escape(still)}</p>'
    out = ["<table><tr><th>request</th><th>e2e before</th><th>after</th><th>change</th>"
           "<th>TTFT before</th><th>after</th><th>first decision that differed</th></tr>"]
    for row in rows:
        diff = row["first_difference"]
        text = "; ".join(f"{k}: {v}" for k, v in diff.items()) if diff else SAME_DECISIONS
        out.append(f"<tr><td>{escape(row['request_id'])}</td>"
                   f"<td>{row['e2e_before_s']:.3f} s</td><td>{row['e2e_after_s']:.3f} s</td>"
                   f"<td>{row['delta_s']:+.3f} s</td><td>{latency_text(row['ttft_before_s'])}</td>"
                   f"<td>{latency_text(row['ttft_after_s'])}</td><td>{escape(text)}</td></tr>")
    out.append("</table>")
    return "".join(out)
