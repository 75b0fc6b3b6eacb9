"""``kvserve plan --preemption-cost``: the swap-or-recompute economics of one victim, on
numbers worked by hand (docs/preemption.md's example)."""

import json

import pytest

from kvserve.cli import main
from kvserve.sim.preemption_cost import parse_bandwidth, preemption_cost, prefill_flop_count

KEYS = ("bytes_per_token", "swap_one_way_s", "swap_round_trip_s", "recompute_cold_s",
        "swap_advantage", "crossover_prefill_tok_s", "survival_threshold")


def test_llama8b_8k_on_pcie_gen5_by_hand():
    # KV: 2 x 32 layers x 8 KV heads x 128 x 2 B = 131,072 B/token; 8,192 tokens = 1 GiB.
    # One way at 64e9 B/s: 1,073,741,824 / 64e9 = 0.016777216 s; round trip 0.033554432 s.
    # F = 2 x 8,030,261,248 x 8,192 + 2 x 32 x 8,192^2 x 4,096
    #   = 131,567,800,287,232 + 17,592,186,044,416 = 149,159,986,331,648 FLOPs;
    # at 400e12 FLOP/s: 0.37289996582912 s -> 11.113285x the round trip; they tie at
    # 8,192 / 0.033554432 = 244,140.625 tok/s; recompute wins once f > 1 - 1/11.113285.
    cost = preemption_cost("llama-3.1-8b", 8192, hardware="h100-sxm",
                           link_bandwidth=64e9, prefill_flops=400e12)
    assert cost.bytes_per_token == 131_072
    assert cost.prefill_flop_count == 149_159_986_331_648
    assert cost.swap_one_way_s == pytest.approx(0.016777216, rel=1e-12)
    assert cost.swap_round_trip_s == pytest.approx(0.033554432, rel=1e-12)
    assert cost.recompute_cold_s == pytest.approx(0.37289996582912, rel=1e-12)
    assert cost.swap_advantage == pytest.approx(11.113285, rel=1e-9)
    assert cost.crossover_prefill_tok_s == pytest.approx(244_140.625, rel=1e-12)
    assert cost.survival_threshold == pytest.approx(1 - 1 / 11.113285, rel=1e-9)


def test_defaults_come_from_the_preset_link_and_a_stated_mfu():
    # h100-sxm: PCIe Gen5 64e9 B/s; 40% of 989e12 = 395.6e12 FLOP/s.
    cost = preemption_cost("llama-3.1-8b", 8192)
    assert (cost.link_bandwidth, cost.prefill_flops) == (64e9, pytest.approx(395.6e12))
    assert cost.link_bandwidth_source == "h100-sxm preset"
    assert cost.prefill_flops_source == "40% MFU of h100-sxm bf16 peak"
    # a100-80gb: PCIe Gen4 32e9 -> the round trip doubles.
    a100 = preemption_cost("llama-3.1-8b", 8192, hardware="a100-80gb")
    assert a100.swap_round_trip_s == pytest.approx(2 * 0.033554432)


def test_short_victims_favour_recompute_and_tp_scales_both_sides():
    # 128 tokens of SmolLM2 on cpu-local: F = 2 x 134,515,008 x 128 + 2 x 30 x 128^2 x 576
    # = 34,435,842,048 + 566,231,040 = 35,002,073,088; at 10e9 FLOP/s 3.5002 s against a
    # round trip of 2 x 128 x 23,040 / 48.6e9 = 121.36 us: swap is ~28,800x cheaper.
    assert prefill_flop_count(134_515_008, 30, 576, 128) == 35_002_073_088
    small = preemption_cost("smollm2-135m", 128, hardware="cpu-local", prefill_flops=10e9)
    assert small.swap_round_trip_s == pytest.approx(2 * 128 * 23_040 / 48.6e9)
    # A prefill fast enough to beat the link: 1e15 FLOP/s -> recompute 35 us < swap, f = 0.
    fast = preemption_cost("smollm2-135m", 128, hardware="cpu-local", prefill_flops=1e15)
    assert fast.swap_advantage < 1 and fast.survival_threshold == 0.0
    # tp=4: 70B KV stays 327,680 B/token over the replica, moved over four links.
    one = preemption_cost("llama-3.1-70b", 4096)
    four = preemption_cost("llama-3.1-70b", 4096, tensor_parallel_size=4)
    assert four.bytes_per_token == one.bytes_per_token == 327_680
    assert four.swap_one_way_s == pytest.approx(one.swap_one_way_s / 4)
    assert four.recompute_cold_s == pytest.approx(one.recompute_cold_s / 4)


@pytest.mark.parametrize(("text", "value"), [("64GB/s", 64e9), ("25GiB/s", 25 * 2**30),
                                              ("6.4e10", 6.4e10), ("32 GB", 32e9)])
def test_link_bandwidth_spellings(text, value):
    assert parse_bandwidth(text) == value


def test_cli_json_carries_the_issue_keys(capsys):
    assert main(["plan", "--preemption-cost", "--model", "llama-3.1-8b", "--seq-len", "8192",
                 "--hardware", "h100-sxm", "--link-bandwidth", "64GB/s",
                 "--prefill-flops", "400e12", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(KEYS) <= set(result)
    assert result["bytes_per_token"] == 131_072
    assert result["swap_round_trip_s"] == pytest.approx(0.033554432)
    assert result["swap_advantage"] == pytest.approx(11.113285)


def test_cli_table_names_each_figure(capsys):
    assert main(["plan", "--preemption-cost", "--seq-len", "8192"]) == 0
    out = capsys.readouterr().out
    for text in ("131,072 B", "16.78 ms", "33.55 ms", "377.05 ms", "11.24x", "244,141 tok/s",
                 "91.1% of the sequence", "40% MFU of h100-sxm bf16 peak"):
        assert text in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    ([], "--preemption-cost needs --seq-len"),
    (["--seq-len", "9", "--link-bandwidth", "fast"], "--link-bandwidth 'fast' is not a rate"),
    (["--seq-len", "9", "--link-bandwidth", "0GB/s"], "--link-bandwidth must be a finite rate > 0"),
    (["--seq-len", "9", "--link-bandwidth", "10"],
     "--link-bandwidth '10' is 10 bytes/s; write the unit"),
    (["--seq-len", "9", "--prefill-flops", "0"], "--prefill-flops must be > 0, got 0"),
    (["--seq-len", "9", "--prompt-len", "5"], "takes --seq-len, not --prompt-len"),
    (["--seq-len", "9", "--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["--seq-len", "9", "--dtype", "int3"], "unknown dtype 'int3'"),
])
def test_bad_flags_are_one_line_and_exit_2(argv, message, capsys):
    assert main(["plan", "--preemption-cost", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_preemption_flags_without_the_mode_are_refused(capsys):
    assert main(["plan", "--prompt-len", "9", "--output-len", "9", "--seq-len", "9"]) == 2
    assert "--seq-len is for --preemption-cost" in capsys.readouterr().err
