"""benchmarks/online_knob.py's run order and per-value table, without servers."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import online_knob


def test_each_value_leads_one_round_in_turn():
    values = ["2048", "1024", "512"]
    orders = [online_knob.run_order(values, index) for index in range(4)]
    assert orders[:3] == [["2048", "1024", "512"], ["1024", "512", "2048"],
                          ["512", "2048", "1024"]]
    assert orders[3] == orders[0]
    assert all(sorted(order) == sorted(values) for order in orders)


def run(tok_s: float, ttft_p99_s: float) -> dict:
    return {"output_tok_s": tok_s, "wall_s": 20000 / tok_s, "ttft_p50_s": 1.0,
            "ttft_p99_s": ttft_p99_s, "itl_p50_ms": 180.0, "itl_p99_ms": 500.0}


def test_value_rows_take_the_highest_rate_and_lowest_time_as_best():
    runs = {"2048": [run(380.0, 4.2), run(390.0, 3.9), run(370.0, 5.0)],
            "512": [run(400.0, 11.9)]}
    header, rule, first, second = online_knob.value_rows(["2048", "512"], runs)
    assert header.startswith("| value | output tok/s best / median | wall s best / median")
    assert rule.count("---") == 1 + len(online_knob.FIGURES)
    cells = [cell.strip() for cell in first.strip("|").split("|")]
    assert cells[0] == "2048"
    assert cells[1] == "390 / 380"  # tok/s: the highest, then the median
    assert cells[4] == "3.90 / 4.20"  # TTFT p99: the lowest, then the median
    assert second.startswith("| 512 | 400 / 400 |")


def aggregate(tok_s: float, itl_p99_s: float) -> dict:
    return {"throughput_output_tok_s": tok_s, "duration_s": 75.0, "ttft_p50": 1.25,
            "ttft_p99": 3.8, "itl_p50": 0.1728, "itl_p99": itl_p99_s}


def test_whatif_rows_put_each_run_in_the_runs_units():
    report = {"runs": [{"label": "recorded", "aggregate": aggregate(394.2, 1.4086)},
                       {"label": "max_num_batched_tokens=512",
                        "aggregate": {**aggregate(386.2, 0.4204), "off_record_share": 0.52}}]}
    header, _, recorded, changed = online_knob.whatif_rows(report)
    assert header == ("| run | output tok/s | wall s | TTFT p50 s | TTFT p99 s | ITL p50 ms | "
                      "ITL p99 ms | unrecorded shapes |")
    # ITL in ms; the replay has no share (only runs under the fitted model do)
    assert recorded == "| recorded | 394 | 75.0 | 1.25 | 3.80 | 173 | 1409 | - |"
    assert changed.startswith("| max_num_batched_tokens=512 | 386 |")
    assert changed.endswith("| 420 | 52% |")


def test_a_whatif_that_fails_gives_its_error_not_a_report(tmp_path):
    answer = online_knob.whatif(tmp_path / "missing", "max_num_batched_tokens", ["512"])
    assert isinstance(answer, str) and "missing" in answer


def test_change_rows_set_whatifs_change_beside_the_engines():
    # whatif's change is read against its own reading of the recorded settings, the
    # engine's as the value's median over the first value's
    report = {"runs": [{"label": "recorded", "aggregate": aggregate(397.0, 1.446)},
                       {"label": "recorded (calibrated model)",
                        "aggregate": aggregate(400.0, 1.4)},
                       {"label": "max_num_batched_tokens=512",
                        "aggregate": aggregate(384.0, 0.42)}]}
    runs = {"2048": [run(392.0, 3.8), run(371.0, 4.4), run(397.0, 3.5)],
            "512": [run(369.0, 13.2), run(337.0, 18.5), run(380.0, 11.3)]}
    header, _, predicted, measured = online_knob.change_rows(["2048", "512"], runs, report)
    assert header.startswith("| change from 2048 | output tok/s | wall s |")
    cells = [cell.strip() for cell in predicted.strip("|").split("|")]
    assert cells[0] == "512, whatif" and cells[1] == "0.96x"  # 384 / 400
    assert cells[-1] == "0.30x"  # ITL p99 0.42 / 1.4
    cells = [cell.strip() for cell in measured.strip("|").split("|")]
    assert cells[0] == "512, the engine"
    assert cells[1] == f"{369 / 392:.2f}x"  # medians, not bests
    assert cells[4] == f"{13.2 / 3.8:.2f}x"


def test_change_rows_skip_a_value_whatif_did_not_price():
    report = {"runs": [{"label": "recorded (calibrated model)",
                        "aggregate": aggregate(400.0, 1.4)}]}
    runs = {"2048": [run(392.0, 3.8)], "512": [run(369.0, 13.2)]}
    assert len(online_knob.change_rows(["2048", "512"], runs, report)) == 2  # header, rule
