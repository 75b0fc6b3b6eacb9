"""Tiny SVG charts for the HTML report: line charts, histograms, a request timeline.

Plain strings, no JavaScript and nothing fetched at view time, so a report opens offline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

import numpy as np

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2")
_M = {"left": 64, "right": 40, "top": 28, "bottom": 40}


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.4g}"
    return f"{value:.3g}"


class _Frame:
    """Maps data coordinates to pixels inside margins, and draws the axes."""

    def __init__(self, width: int, height: int, x_range: tuple[float, float],
                 y_range: tuple[float, float], log_x: bool = False) -> None:
        self.width, self.height = width, height
        self.log_x = log_x
        x0, x1 = x_range
        if log_x:
            x0, x1 = math.log10(max(x0, 1e-12)), math.log10(max(x1, 1e-12))
        self.x0, self.x1 = x0, x1 if x1 > x0 else x0 + 1
        self.y0, self.y1 = y_range[0], y_range[1] if y_range[1] > y_range[0] else y_range[0] + 1
        self.inner_w = width - _M["left"] - _M["right"]
        self.inner_h = height - _M["top"] - _M["bottom"]

    def x(self, value: float) -> float:
        if self.log_x:
            value = math.log10(max(value, 1e-12))
        return _M["left"] + (value - self.x0) / (self.x1 - self.x0) * self.inner_w

    def y(self, value: float) -> float:
        return _M["top"] + (1 - (value - self.y0) / (self.y1 - self.y0)) * self.inner_h

    def axes(self, title: str, x_label: str, y_label: str,
             x_ticks: Sequence[float] | None = None, y_fmt=fmt,  # type: ignore[no-untyped-def]
             x_tick_labels: Sequence[str] | None = None) -> list[str]:
        parts = [f'<text x="{_M["left"]}" y="16" class="title">{escape(title)}</text>']
        bottom = _M["top"] + self.inner_h
        for tick in nice_ticks(self.y0, self.y1):
            y = self.y(tick)
            parts.append(f'<line x1="{_M["left"]}" x2="{self.width - _M["right"]}" '
                         f'y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
            parts.append(f'<text x="{_M["left"] - 6}" y="{y + 4:.1f}" class="tick" '
                         f'text-anchor="end">{y_fmt(tick)}</text>')
        if x_ticks is None:
            if self.log_x:
                x_ticks = [10.0 ** e for e in range(math.floor(self.x0), math.ceil(self.x1) + 1)
                           if self.x0 <= e <= self.x1]
            else:
                x_ticks = nice_ticks(self.x0, self.x1)
        for index, tick in enumerate(x_ticks):
            x = self.x(tick)
            text = fmt(tick) if x_tick_labels is None else x_tick_labels[index]
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}" '
                         f'class="axis"/>')
            parts.append(f'<text x="{x:.1f}" y="{bottom + 16}" class="tick" '
                         f'text-anchor="middle">{escape(text)}</text>')
        parts.append(f'<line x1="{_M["left"]}" x2="{self.width - _M["right"]}" y1="{bottom}" '
                     f'y2="{bottom}" class="axis"/>')
        parts.append(f'<text x="{_M["left"] + self.inner_w / 2}" y="{self.height - 6}" '
                     f'class="label" text-anchor="middle">{escape(x_label)}</text>')
        parts.append(f'<text transform="translate(14,{_M["top"] + self.inner_h / 2}) '
                     f'rotate(-90)" class="label" text-anchor="middle">{escape(y_label)}</text>')
        return parts


def _svg(width: int, height: int, parts: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">' + "".join(parts) + "</svg>")


LEGEND_ROW = 16  # pixels per row of legend entries under a chart
_CHAR = 6.5  # pixels per character of a tick-sized label, a generous estimate


def _legend(names: Sequence[str], width: int, top: int) -> tuple[list[str], int]:
    """Entries under the chart from ``top``, flowing left to right and wrapping at the
    chart's width, each as wide as its name (long run labels no longer overlap each other
    or the title); the parts and the height they take."""
    parts, x, row = [], _M["left"], 0
    for index, name in enumerate(names):
        entry = 14 + _CHAR * len(name) + 16
        if x > _M["left"] and x + entry > width - _M["right"]:
            x, row = _M["left"], row + 1
        y = top + row * LEGEND_ROW
        color = PALETTE[index % len(PALETTE)]
        parts.append(f'<rect x="{x:.0f}" y="{y}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{x + 14:.0f}" y="{y + 9}" class="tick">{escape(name)}</text>')
        x += entry
    return parts, (row + 1) * LEGEND_ROW + 4


def downsample(xs: Sequence[float], ys: Sequence[float],
               points: int = 1200) -> tuple[list[float], list[float]]:
    """At most ``points`` points, keeping each bucket's maximum (peaks stay visible)."""
    if len(xs) <= points:
        return list(xs), list(ys)
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    edges = np.linspace(0, len(x), points + 1).astype(int)
    starts = edges[:-1]
    return x[starts].tolist(), np.maximum.reduceat(y, starts).tolist()


def line_chart(title: str, series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
               x_label: str, y_label: str, *, width: int = 640, height: int = 240,
               y_min: float = 0.0, y_max: float | None = None, step: bool = False,
               markers: bool = False, log_x: bool = False,
               x_ticks: Sequence[float] | None = None,
               x_tick_labels: Sequence[str] | None = None,
               y_fmt=fmt) -> str:  # type: ignore[no-untyped-def]
    all_x = [x for _, xs, _ in series for x in xs]
    all_y = [y for _, _, ys in series for y in ys if y is not None]
    if not all_x:
        return _svg(width, 40, [f'<text x="4" y="20" class="title">{escape(title)}: '
                                'no data</text>'])
    top = y_max if y_max is not None else max(all_y, default=1.0) * 1.05
    if top <= y_min:  # every value 0: a 0..1 axis (QA: ticks of 2e-10 preemptions)
        top = y_min + 1.0
    frame = _Frame(width, height, (min(all_x), max(all_x)), (y_min, top), log_x=log_x)
    parts = frame.axes(title, x_label, y_label, x_ticks, y_fmt=y_fmt,
                       x_tick_labels=x_tick_labels)
    for index, (_, xs, ys) in enumerate(series):
        color = PALETTE[index % len(PALETTE)]
        points = []
        previous_y = None
        for x, y in zip(xs, ys, strict=True):
            if y is None:
                continue
            px, py = frame.x(x), frame.y(y)
            if step and previous_y is not None:
                points.append(f"{px:.1f},{previous_y:.1f}")
            points.append(f"{px:.1f},{py:.1f}")
            previous_y = py
        parts.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="{color}" '
                     f'stroke-width="1.6"/>')
        if markers:
            for x, y in zip(xs, ys, strict=True):
                if y is not None:
                    parts.append(f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="3.5" '
                                 f'fill="{color}"><title>{fmt(x)}: {fmt(y)}</title></circle>')
    if len(series) > 1:
        legend, extra = _legend([name for name, _, _ in series], width, height)
        parts += legend
        height += extra
    return _svg(width, height, parts)


def histogram(title: str, values: Sequence[float] | np.ndarray, x_label: str, *,
              bins: int = 40, width: int = 640, height: int = 240,
              marks: Sequence[tuple[str, float | None]] = ()) -> str:
    """Counts per bin; log-spaced bins on a log axis when the values span over 20x."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return _svg(width, 40, [f'<text x="4" y="20" class="title">{escape(title)}: '
                                'no data</text>'])
    lo, hi = float(data.min()), float(data.max())
    if hi <= lo:
        hi = lo + max(abs(lo) * 0.01, 1e-6)
    log_x = lo > 0 and hi / lo > 20
    edges = np.geomspace(lo, hi, bins + 1) if log_x else np.linspace(lo, hi, bins + 1)
    counts, edges = np.histogram(data, bins=edges)
    frame = _Frame(width, height, (lo, hi), (0, float(counts.max()) * 1.08), log_x=log_x)
    parts = frame.axes(title, x_label, "requests" if "TTFT" in title else "count")
    for count, left, right in zip(counts, edges[:-1], edges[1:], strict=True):
        if count:
            x0, x1, y = frame.x(left), frame.x(right), frame.y(count)
            parts.append(f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0 - 1, 1):.1f}" '
                         f'height="{frame.y(0) - y:.1f}" fill="{PALETTE[0]}" opacity="0.8">'
                         f'<title>{fmt(left)}-{fmt(right)}: {count}</title></rect>')
    for index, (name, value) in enumerate(marks):
        if value is None:
            continue
        x = frame.x(value)
        # Labels right of the line, or left of it near the right edge.
        anchor, dx = ("end", -3) if x > width - 120 else ("start", 3)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_M["top"]}" y2="{frame.y(0):.1f}" '
                     f'stroke="{PALETTE[1 + index]}" stroke-dasharray="4 3"/>'
                     f'<text x="{x + dx:.1f}" y="{_M["top"] + 12 + 12 * index}" class="tick" '
                     f'text-anchor="{anchor}" fill="{PALETTE[1 + index]}">'
                     f'{escape(name)} {fmt(value)}</text>')
    return _svg(width, height, parts)


TIMELINE_COLORS = {"queue": "#cbd5e1", "prefill": "#f59e0b", "decode": "#2563eb",
                   "preempted": "#dc2626"}


def timeline(title: str, rows: Sequence[dict], *, width: int = 1280,
             row_height: int = 7) -> str:
    """One bar per request: queued (arrival -> first scheduled), prefill (-> first token),
    decode (-> finished); preempted spans (preemption -> resume, the report's ``stalls``)
    drawn over it in red."""
    rows = [r for r in rows if r.get("finished_time") is not None]
    if not rows:
        return _svg(width, 40, [f'<text x="4" y="20" class="title">{escape(title)}: '
                                'no finished requests</text>'])
    height = _M["top"] + _M["bottom"] + row_height * len(rows)
    t0 = min(r["arrival_time"] for r in rows)
    t1 = max(r["finished_time"] for r in rows)
    frame = _Frame(width, height, (t0, t1), (0, len(rows)))
    parts = [f'<text x="{_M["left"]}" y="16" class="title">{escape(title)}</text>']
    bottom = _M["top"] + frame.inner_h
    for tick in nice_ticks(t0, t1):
        x = frame.x(tick)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_M["top"]}" y2="{bottom}" '
                     f'class="grid"/><text x="{x:.1f}" y="{bottom + 16}" class="tick" '
                     f'text-anchor="middle">{fmt(tick)}</text>')
    parts.append(f'<text x="{_M["left"] + frame.inner_w / 2}" y="{height - 6}" class="label" '
                 f'text-anchor="middle">simulated time (s)</text>')
    for index, row in enumerate(rows):
        y = _M["top"] + index * row_height
        finished = row["finished_time"]  # a time of 0.0 is one (QA: `or` took it for none,
        first_scheduled = _or(row["first_scheduled_time"], finished)  # and drew the first
        first_token = _or(row["first_token_time"], finished)  # row as queued throughout)
        spans = (("queue", row["arrival_time"], first_scheduled),
                 ("prefill", first_scheduled, first_token),
                 ("decode", first_token, row["finished_time"]))
        tip = (f'{escape(row["request_id"])}: prompt {row["prompt_tokens"]}, output '
               f'{row["output_tokens"]}, TTFT '
               f'{"-" if row["ttft_s"] is None else fmt(row["ttft_s"]) + " s"}, '
               f'{row["num_preemptions"]} preemptions')
        parts.append(f"<g><title>{tip}</title>")
        for kind, start, end in spans + tuple(("preempted", a, b) for a, b in row["stalls"]):
            if end is None or start is None or end <= start:
                continue
            x0, x1 = frame.x(start), frame.x(end)
            parts.append(f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0, 0.6):.1f}" '
                         f'height="{row_height - 1}" fill="{TIMELINE_COLORS[kind]}"/>')
        parts.append("</g>")
    x = width - _M["right"] - 4 * 90
    for kind, color in TIMELINE_COLORS.items():
        parts.append(f'<rect x="{x}" y="6" width="10" height="10" fill="{color}"/>'
                     f'<text x="{x + 14}" y="15" class="tick">{kind}</text>')
        x += 90
    return _svg(width, height, parts)


def _or(value: float | None, default: float) -> float:
    """``value``, or ``default`` where it is None (0.0 is a time)."""
    return default if value is None else value


# The charts' own rules (a report's page carries them in REPORT_CSS; a chart written as a
# file of its own, in its <style>: QA, calibrate --plot drew no grid, axis or tick lines).
SVG_CSS = """svg .title { font-weight: 600; font-size: 13px; }
svg .tick { font-size: 11px; fill: #475569; }
svg .label { font-size: 12px; fill: #334155; } svg .grid { stroke: #e2e8f0; }
svg .axis { stroke: #94a3b8; } svg text { font-family: system-ui, sans-serif; }
"""


def standalone(svg: str) -> str:
    """A chart as a file of its own: its style inside it."""
    head, _, rest = svg.partition(">")
    return f"{head}><style>{SVG_CSS}</style>{rest}"
