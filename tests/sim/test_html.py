"""The HTML report is self-contained and carries every view the issue asks for (rendering
itself is checked by eye in headless Chromium, not here)."""

import re

from kvserve.cli import main


def _assert_offline(page: str) -> None:
    assert "<script" not in page
    urls = set(re.findall(r"https?://[^\"' )]+", page))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls


def test_run_report_has_time_series_distributions_and_timeline(tmp_path):
    trace, page = tmp_path / "t.jsonl", tmp_path / "r.html"
    assert main(["workload", "gen", "-n", "30", "--rate", "50", "-o", str(trace)]) == 0
    assert main(["simulate", "--trace", str(trace), "--num-kv-blocks", "60", "--html",
                 str(page), "--quiet"]) == 0
    html = page.read_text()
    _assert_offline(html)
    for title in ("KV cache usage", "Running and waiting requests", "TTFT",
                  "Inter-token latency", "Per-request timeline"):
        assert title in html
    assert html.count("<svg") == 5
    # 60 blocks for 30 requests preempt: preempted spans are drawn in their colour.
    assert 'fill="#dc2626"' in html
    assert html.count("<g><title>") == 30  # one timeline bar per request


def test_sweep_report_has_the_trade_off_curves(tmp_path):
    trace, page = tmp_path / "t.jsonl", tmp_path / "s.html"
    assert main(["workload", "gen", "-n", "20", "--rate", "50", "-o", str(trace)]) == 0
    assert main(["simulate", "--trace", str(trace), "--num-kv-blocks", "80", "--sweep",
                 "max_num_seqs=2,8,32", "--html", str(page), "--quiet"]) == 0
    html = page.read_text()
    _assert_offline(html)
    for title in ("Preemptions vs max_num_seqs", "Wasted work", "Output throughput",
                  "Longest preemption stall"):
        assert title in html
    assert html.count("<circle") == 6 * 3  # six curves, three swept values


def test_a_request_scheduled_at_time_zero_is_drawn_prefilling_not_queued():
    """QA (HTML pass): a first-scheduled time of 0.0 was taken for none, and the first row
    of every generated trace was drawn queued for its whole life, with no prefill."""
    from kvserve.sim.svg import TIMELINE_COLORS, timeline

    row = {"request_id": "a", "arrival_time": 0.0, "first_scheduled_time": 0.0,
           "first_token_time": 0.5, "finished_time": 2.0, "prompt_tokens": 8,
           "output_tokens": 4, "ttft_s": None, "num_preemptions": 0, "stalls": []}
    chart = timeline("t", [row])
    bars = chart.split("<g><title>", 1)[1].split("</g>", 1)[0]  # the row, not the legend
    assert TIMELINE_COLORS["prefill"] in bars and TIMELINE_COLORS["queue"] not in bars
    assert "TTFT -," in bars  # none known: not "0 s"


def test_an_all_zero_series_gets_a_zero_to_one_axis_and_a_lone_chart_its_style():
    """QA (HTML pass): ticks of 2e-10 preemptions; calibrate --plot's file of its own drew
    no grid, axis or tick lines (their stroke is CSS the report page carries)."""
    import xml.etree.ElementTree as ElementTree

    from kvserve.sim.svg import line_chart, standalone

    chart = line_chart("p", [("run", [0.0, 1.0, 2.0], [0.0, 0.0, 0.0])], "x", "preemptions")
    assert "e-10" not in chart and "e-09" not in chart and ">1<" in chart
    lone = standalone(chart)
    assert "<style>" in lone and "svg .grid { stroke" in lone
    ElementTree.fromstring(lone)  # still one well-formed SVG
