"""The host KV tier in the simulator (issue 12): prices, copy time, report figures, flags."""

import json

import pytest

from kvserve.cli import main
from kvserve.core import CachedRequestData, SchedulerOutput
from kvserve.sim.cost_models import RooflineCostModel
from kvserve.sim.executor import BatchView
from kvserve.sim.presets import get_hardware, get_model
from kvserve.sim.swap import SimPreemptionPrices, WithSwapCopies, prefill_view

# llama-3.1-8b bf16: 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes = 131,072 per token
BYTES_PER_BLOCK = 131_072 * 16


def roofline():
    return RooflineCostModel(get_model("llama-3.1-8b"), get_hardware("h100-sxm"))


def prices(model=None):
    return SimPreemptionPrices(model or roofline(), get_model("llama-3.1-8b"),
                               get_hardware("h100-sxm"), "bf16", 1, 16)


def test_prices_come_from_the_cost_model_and_the_host_link():  # S4
    p = prices()
    assert p.bytes_per_block == BYTES_PER_BLOCK
    # PCIe Gen5 x16 on the h100-sxm preset: 64 GB/s per direction
    assert p.swap_seconds(10) == pytest.approx(10 * BYTES_PER_BLOCK / 64e9)
    assert p.recompute_seconds(512) == roofline().step_time(None, prefill_view(512))
    assert prefill_view(4) == BatchView(1, 4, 1, 0, 0, 10)
    # GH200's host is across NVLink-C2C: 450 GB/s per direction, 7x PCIe Gen5
    gh200 = SimPreemptionPrices(roofline(), get_model("llama-3.1-8b"), get_hardware("gh200"),
                                "bf16", 1, 16)
    assert gh200.swap_seconds(10) == pytest.approx(10 * BYTES_PER_BLOCK / 450e9)


def test_a_step_pays_for_its_copies():  # S1, S2: copies run before the forward
    model = WithSwapCopies(roofline(), prices())
    view = BatchView(2, 2, 2, 2, 1000, 1002)
    plain = SchedulerOutput([], CachedRequestData(), {"a": 1, "b": 1}, 2, [], [])
    copying = SchedulerOutput([], CachedRequestData(), {"a": 1, "b": 1}, 2, ["c"], [],
                              blocks_to_swap_out=[(5, 0), (6, 1)],
                              blocks_to_swap_in=[(7, 2)])
    assert model.step_time(plain, view) == roofline().step_time(plain, view)
    assert model.step_time(copying, view) == pytest.approx(
        roofline().step_time(plain, view) + 3 * BYTES_PER_BLOCK / 64e9)
    assert model.describe()["swap"] == {"bytes_per_block": BYTES_PER_BLOCK,
                                        "host_link_bandwidth": 64e9,
                                        "copies_take_time": True, "swaps_priced": True}


def test_a_replay_prices_swaps_for_auto_but_adds_no_copy_time():  # S4, docs/recording.md
    """A replay's steps hold the engine's copies already, so they gain none; auto's choice
    still weighs the swap by --hardware's host link (the sim-agreement pass: it priced every
    swap at 0 s, and auto swapped every victim whatever the hardware). Unit time prices
    none."""
    from kvserve.sim.deployment import Deployment

    replay = Deployment(cost_model="replay", replay_log="steps.jsonl").preemption_prices(
        roofline(), 16)
    assert replay.swap_seconds(10) == pytest.approx(10 * BYTES_PER_BLOCK / 64e9)
    assert not replay.copies_take_time
    view = BatchView(2, 2, 2, 2, 1000, 1002)
    copying = SchedulerOutput([], CachedRequestData(), {"a": 1, "b": 1}, 2, ["c"], [],
                              blocks_to_swap_out=[(5, 0), (6, 1)])
    assert WithSwapCopies(roofline(), replay).step_time(copying, view) == \
        roofline().step_time(copying, view)
    unit = Deployment(cost_model="unit").preemption_prices(roofline(), 16)
    assert unit.swap_seconds(10) == 0.0 and not unit.copies_take_time


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    assert main(["workload", "gen", "-n", "40", "--rate", "50", "--prompt-len",
                 "uniform:256,1024", "--output-len", "uniform:64,256", "--seed", "3",
                 "-o", str(path)]) == 0
    return path


def simulate(tmp_path, trace, *flags):
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(trace), "--report", str(report), "--quiet",
                 "--num-kv-blocks", "120", "--max-num-seqs", "32", "--check", *flags]) == 0
    return json.loads(report.read_text())


def test_swap_mode_reports_the_host_tier(tmp_path, trace, capsys):  # S1-S3, report
    data = simulate(tmp_path, trace, "--preemption-mode", "swap", "--swap-space", "1")
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(trace), "--report", str(report),
                 "--num-kv-blocks", "120", "--max-num-seqs", "32", "--preemption-mode", "swap",
                 "--swap-space", "1"]) == 0
    assert json.loads(report.read_text()) == data  # --check changes nothing
    out = capsys.readouterr().out
    assert "swapped out / in" in out and "preemptions: swap / recompute / for urgent" in out
    aggregate = data["aggregate"]
    assert aggregate["num_preemptions"] > 0
    assert aggregate["preemptions_by_mode"]["swap"] == aggregate["num_preemptions"]
    assert aggregate["recomputed_tokens"] == 0
    assert aggregate["swapped_out_blocks"] == aggregate["swapped_in_blocks"] > 0
    assert aggregate["swapped_out_bytes"] == aggregate["swapped_out_blocks"] * BYTES_PER_BLOCK
    assert sum(r["num_swaps"] for r in data["requests"]) == aggregate["num_preemptions"]
    # 1 GiB per device over 2 MiB blocks
    assert data["config"]["cache"]["num_host_blocks"] == 512
    assert data["config"]["scheduler"]["preemption_mode"] == "swap"


@pytest.mark.parametrize("host", [(), ("--swap-space", "1"), ("--num-host-blocks", "64")])
def test_recompute_reports_carry_no_host_tier_fields(tmp_path, trace, host):  # byte-identical
    """A host tier given under recompute, which never swaps, is none, as in the engine
    (vLLM V1 ignores --swap-space): the report is the one without it."""
    data = simulate(tmp_path, trace, *host)
    assert data["aggregate"]["num_preemptions"] > 0
    assert "swapped_out_blocks" not in data["aggregate"]
    assert "num_swaps" not in data["requests"][0]
    assert "num_host_blocks" not in data["config"]["cache"]
    assert "max_preemptions_per_request" not in data["config"]["scheduler"]


def test_a_full_host_tier_recomputes(tmp_path, trace):  # S3
    data = simulate(tmp_path, trace, "--preemption-mode", "swap", "--num-host-blocks", "40")
    by_mode = data["aggregate"]["preemptions_by_mode"]
    assert by_mode["swap"] > 0 and by_mode["recompute"] > 0
    assert data["aggregate"]["recomputed_tokens"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--preemption-mode", "swap"], "--preemption-mode swap needs a host KV tier: give "
                                    "--swap-space GiB"),
    (["--preemption-mode", "auto", "--swap-space", "0"], "--preemption-mode auto needs a "
                                                         "host KV tier"),
    (["--swap-space", "-1"], "--swap-space -1 GiB is out of range"),
    (["--swap-space", "2000000"], "--swap-space 2e+06 GiB is out of range"),
    (["--swap-space", "1", "--num-host-blocks", "4"], "give --swap-space or "
                                                      "--num-host-blocks, not both"),
    (["--num-host-blocks", "-3"], "--num-host-blocks -3 is out of range"),
    (["--preemption-mode", "swap", "--swap-space", "1KiB"], "--swap-space 1024 bytes holds "
                                                            "no KV block"),
    (["--priority-scheduling-preemption-threshold", "5"],
     "--priority-scheduling-preemption-threshold needs --enable-priority-preemption"),
    (["--enable-priority-preemption"], "--enable-priority-preemption needs "
                                       "--scheduling-policy priority"),
    (["--max-preemptions-per-request", "0"], "--max-preemptions-per-request must be >= 1"),
])
def test_bad_preemption_flags_are_one_line_and_exit_2(tmp_path, trace, capsys, flags,
                                                     message):  # item 6
    code = main(["simulate", "--trace", str(trace), "--quiet", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert message in err[0]
