"""The A/B statistics of benchmarks/ab_protocol.py (issue 16's protocol), without servers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ab_protocol as ab

WALL = ab.Figure("wall_s", "wall s", higher_is_better=False)
RATE = ab.Figure("tok_s", "tok/s", higher_is_better=True, fmt="{:.0f}")


def test_times_take_minima_and_ratios_are_peer_over_kvserve():
    # the AMX Xeon W1 figures: vLLM first in each pair
    s = ab.Summary(WALL, [27.2, 42.7, 28.2, 32.4, 44.0], [40.9, 42.9, 47.6, 36.7, 41.6])
    assert (s.peer_best, s.ours_best) == (27.2, 36.7)
    assert s.peer_median == 32.4 and s.ours_median == 41.6
    assert s.ratio_of_bests == pytest.approx(27.2 / 36.7)  # 0.74x, as the issue says
    assert s.median_pair_ratio == pytest.approx(32.4 / 36.7)  # pair 4's 0.88x is the median


def test_rates_take_maxima_and_ratios_are_kvserve_over_peer():
    s = ab.Summary(RATE, [415.0, 400.0, 300.0], [304.0, 440.0, 330.0])
    assert (s.peer_best, s.ours_best) == (415.0, 440.0)
    assert s.ratio_of_bests == pytest.approx(440 / 415)
    assert s.median_pair_ratio == pytest.approx(1.1)  # 304/415, 1.1, 1.1


def test_unequal_or_empty_runs_are_refused():
    with pytest.raises(ValueError, match="equal, non-empty"):
        ab.Summary(WALL, [1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="equal, non-empty"):
        ab.Summary(WALL, [], [])


def test_summary_table_rows():
    runs_peer = [{"wall_s": 50.0, "tok_s": 300.0}, {"wall_s": 40.0, "tok_s": 400.0}]
    runs_ours = [{"wall_s": 40.0, "tok_s": 330.0}, {"wall_s": 50.0, "tok_s": 380.0}]
    lines = ab.summary_table(ab.summarize([WALL, RATE], runs_peer, runs_ours))
    assert lines[0].startswith("| figure | vLLM best | vLLM median | kvserve best |")
    assert lines[2] == "| wall s | 40.0 | 45.0 | 40.0 | 45.0 | 1.00x | 1.02x |"
    assert lines[3] == "| tok/s | 400 | 350 | 380 | 355 | 0.95x | 1.02x |"


def test_roofline_floor_uses_smollm2_matmul_work():
    # WORKLOADS.md: 269 MFLOP per token with the LM head, which only a sampled token needs
    # (bench tools pass: counted for every prompt token, the floor was 1.17x W1's work)
    assert ab.MATMUL_FLOPS_PER_TOKEN == 268_959_744
    assert ab.LAYER_FLOPS_PER_TOKEN == 212_336_640
    # W1: 37,477 prompt and 16,384 output tokens at 410 GFLOP/s bf16
    assert ab.roofline_floor_s(37_477, 16_384, 410e9) == pytest.approx(30.2, abs=0.1)


def test_cpu_slug_and_machine_facts():
    assert ab.cpu_slug("AMD EPYC 9R14 96-Core Processor") == "amd-epyc-9r14-96-core-processor"
    assert ab.cpu_slug("???") == "unknown-cpu"
    zen3, zen4 = "avx avx2 fma", "avx avx2 avx512f avx512_bf16 avx512_vnni fma"
    assert ab.cpu_slug("AMD EPYC", zen3) == "amd-epyc-avx2"  # one name, two CPUs
    assert ab.cpu_slug("AMD EPYC", zen4) == "amd-epyc-avx512-bf16"
    assert ab.cpu_slug("Intel Xeon", zen4 + " amx_bf16 amx_tile") == "intel-xeon-amx"
    assert ab.cpu_title("AMD EPYC", zen3) == "AMD EPYC (AVX2)"
    assert (ab.fast_dtype(zen3), ab.fast_dtype(zen4)) == ("float32", "bfloat16")
    # a bare AMD name gets its generation, so a Zen 4 and a Zen 5 do not share a table
    assert ab.with_generation("AMD EPYC", 25, zen3) == "AMD EPYC Zen 3"
    assert ab.with_generation("AMD EPYC", 25, zen4) == "AMD EPYC Zen 4"
    assert ab.with_generation("AMD EPYC", 26, zen4) == "AMD EPYC Zen 5"
    assert ab.cpu_slug(ab.with_generation("AMD EPYC", 26, zen4), zen4) == \
        "amd-epyc-zen-5-avx512-bf16"
    assert ab.with_generation("AMD EPYC 9R14 96-Core Processor", 25, zen4) == \
        "AMD EPYC 9R14 96-Core Processor"  # a full name says it already
    assert ab.with_generation("Intel Xeon", 6, zen4) == "Intel Xeon"
    # a bare Xeon name gets its generation from the model number: a Sapphire Rapids and an
    # Emerald Rapids (both AMX) do not share a table either
    amx = zen4 + " amx_bf16 amx_tile"
    xeon = "Intel(R) Xeon(R) Processor"
    assert ab.with_generation(xeon, 6, amx, 143) == f"{xeon} Sapphire Rapids"
    assert ab.cpu_slug(ab.with_generation(xeon, 6, amx, 207), amx) == \
        "intel-r-xeon-r-processor-emerald-rapids-amx"
    assert ab.with_generation(xeon, 6, amx, 85) == xeon  # Skylake to Cooper Lake: one number
    assert ab.with_generation(xeon, 6, amx) == xeon
    assert ab.with_generation("Intel(R) Xeon(R) Platinum 8480+", 6, amx, 143) == \
        "Intel(R) Xeon(R) Platinum 8480+"
    model, flags = ab.cpu()
    assert model and all(f.startswith(ab.ISA_PREFIXES) for f in flags.split())
    steal, total = ab.cpu_times()
    assert 0 <= steal <= total


def test_measured_records_load_and_steal():
    result, conditions = ab.measured(lambda: {"x": 1}, probe=lambda: None)
    assert result == {"x": 1}
    assert conditions.load_before >= 0 and 0 <= conditions.steal_pct <= 100
    assert conditions.bf16_gflops is None
    assert str(ab.Conditions(1.25, 0.5)) == "1.2 / 0.5%"


def test_each_run_is_preceded_by_a_matmul_probe(monkeypatch):
    """The matrix units' rate before each run (one hour on the AMX Xeon ran them at half
    speed with load and steal as usual): probed before the run starts, shown in the row."""
    import machine_peaks

    order = []
    monkeypatch.setattr(machine_peaks, "matmul_flops",
                        lambda dtype, sizes, budget_s: order.append(("probe", sizes)) or 1126e9)
    result, conditions = ab.measured(lambda: order.append("run") or {"x": 2})
    assert result == {"x": 2}
    assert order == [("probe", (ab.PROBE_SIZE,)), "run"]
    assert conditions.bf16_gflops == pytest.approx(1126.0)
    assert str(ab.Conditions(2.4, 3.04, 1126.4)) == "2.4 / 3.0% / 1,126"


def test_the_probe_measures_a_bf16_matmul():
    gflops = ab.matmul_probe()
    assert gflops is not None and gflops > 0


def test_profile_buckets_py_spy_samples_by_their_innermost_named_frame(tmp_path):
    import profile_online

    raw = tmp_path / "raw.txt"
    engine = "thread (7): kvserve-engine;Thread.run (threading.py:982);step (kvserve/engine/"
    raw.write_text("\n".join([
        f"{engine}engine.py:1);execute (kvserve/model/runner.py:5);Linear.forward "
        "(kvserve/model/llama.py:60) 6",
        f"{engine}engine.py:1);paged_attention (kvserve/model/attention.py:72) 3",
        f"{engine}engine.py:1);schedule (kvserve/core/scheduler.py:250) 1",
        "thread (8): MainThread;run (asyncio/base_events.py:1);select (selectors.py:468) 9",
        "thread (8): MainThread;run (asyncio/base_events.py:1);dumps (json/__init__.py:2) 1"]))
    threads = profile_online.parse(raw)
    assert threads["kvserve-engine"] == {"projections": 6, "attention": 3, "scheduler": 1}
    assert threads["MainThread"] == {"waiting": 9, "HTTP, SSE, JSON (event loop)": 1}
    assert profile_online.table(threads)[2] == \
        "| kvserve-engine | 10 | projections 60%, attention 30%, scheduler 10% |"
    # py-spy 0.4 with --subprocesses starts each line with its process: the server's threads
    # and the engine process's (both have a MainThread) stay apart (all were "unnamed" before)
    raw.write_text("\n".join([
        'process 40:"python -m kvserve serve";thread (40): MainThread;run (asyncio/'
        'base_events.py:1);select (selectors.py:468) 5',
        'process 41:"";thread (41): MainThread;_serve (kvserve/engine/engine_process.py:3);'
        'paged_attention (kvserve/model/attention.py:72) 4']))
    threads = profile_online.parse(raw, {40: "server"})
    assert threads == {"server: MainThread": {"waiting": 5},
                       "engine process: MainThread": {"attention": 4}}


def test_offline_sections_are_one_per_workload(tmp_path, monkeypatch):
    """A run of W1 alone rewrites W1's section for the CPU and leaves W2's table standing."""
    import argparse

    import docs_section
    import offline_ab

    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    args = argparse.Namespace(pairs=1, requests=16, dtype="float32")
    result = {"wall_s": 10.0, "output_tok_s": 100.0}

    def write(workload: str, wall: float) -> None:
        sides = {"vLLM": [result], "kvserve": [dict(result, wall_s=wall)]}
        text = offline_ab.section(args, "AMD EPYC", "avx2", None, workload, sides,
                                  [f"| {workload.upper()} | 1 | kvserve | {wall} |"])
        monkeypatch.setattr(sys, "argv", ["offline_ab.py", "--workload", workload])
        docs_section.write_section(f"offline_ab:amd-epyc-avx2:{workload}", text, docs,
                                   "# Benchmarks")

    write("w1", 8.0)
    write("w2", 9.0)
    write("w1", 5.0)  # a later W1 run
    text = docs.read_text()
    assert text.count("against vLLM on AMD EPYC (AVX2): W1") == 1
    assert "vLLM CPU 0.32.0 (float32" in text and "kvserve (float32" in text
    assert "| W1 | 1 | kvserve | 5.0 |" in text and "| W1 | 1 | kvserve | 8.0 |" not in text
    assert "| W2 | 1 | kvserve | 9.0 |" in text  # W2's table survives W1's rerun


def test_a_recorded_command_names_the_projection_kernel_it_was_told(monkeypatch):
    monkeypatch.delenv("KVSERVE_PROJECTIONS", raising=False)
    assert ab.kernel_env() == ""
    monkeypatch.setenv("KVSERVE_PROJECTIONS", "panels")
    assert ab.kernel_env() == "KVSERVE_PROJECTIONS=panels "


def test_each_peak_is_the_best_of_its_tries(monkeypatch):
    """A peak read low once (721 GFLOP/s against 2,300 on the AMX Xeon) made one sitting's
    roofline fractions 3x too high: each peak is the best of PEAK_TRIES measurements."""
    import machine_peaks

    readings = iter([721e9, 2300e9, 300e9, 410e9])
    monkeypatch.setattr(machine_peaks, "matmul_flops", lambda dtype, sizes: next(readings))
    copies = iter([20e9, 26e9])
    monkeypatch.setattr(machine_peaks, "copy_bandwidth", lambda: next(copies))
    assert ab.PEAK_TRIES == 2
    assert ab.measure_peaks() == {"bf16_flops": 2300e9, "fp32_flops": 410e9,
                                  "copy_bytes": 26e9}
