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
