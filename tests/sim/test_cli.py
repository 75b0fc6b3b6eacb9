"""The command line: simulate, workload gen, plan; bad input is one line and exit 2."""

import json
import os
import subprocess
import sys

import pytest

from kvserve.cli import main

REQUIRED_AGGREGATE = [
    "num_steps", "duration_s", "num_requests", "num_preemptions", "scheduled_tokens",
    "recomputed_tokens", "wasted_fraction", "throughput_output_tok_s", "prefix_hit_rate",
    "kv_usage_peak", "kv_usage_mean",
] + [f"{m}_{q}" for m in ("ttft", "itl", "e2e", "queue") for q in ("p50", "p90", "p99", "max")]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_simulate_writes_report_with_every_aggregate_field(tmp_path, trace, capsys):
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(trace), "--report", str(report),
                 "--num-kv-blocks", "200", "--max-num-seqs", "16"]) == 0
    data = json.loads(report.read_text())
    assert set(REQUIRED_AGGREGATE) <= set(data["aggregate"])
    assert data["aggregate"]["num_requests"] == 40
    assert data["config"]["scheduler"]["max_num_seqs"] == 16
    assert data["config"]["cache"]["num_blocks"] == 200
    assert len(data["requests"]) == 40
    assert len(data["time_series"]["kv_usage"]) == data["aggregate"]["num_steps"]
    out = capsys.readouterr().out
    assert "TTFT" in out and "preemptions" in out


def test_simulate_is_byte_identical_across_runs(tmp_path, trace):
    outputs = []
    for run in range(2):
        report, events = tmp_path / f"r{run}.json", tmp_path / f"e{run}.jsonl"
        assert main(["simulate", "--trace", str(trace), "--report", str(report),
                     "--events", str(events), "--num-kv-blocks", "120", "--seed", "5",
                     "--quiet"]) == 0
        outputs.append((report.read_bytes(), events.read_bytes()))
    assert outputs[0] == outputs[1]
    events = [json.loads(line) for line in outputs[0][1].decode().splitlines()]
    kinds = {e["kind"] for e in events}
    assert {"arrived", "admitted", "finished"} <= kinds
    assert sum(e["kind"] == "finished" for e in events) == 40


def test_sweep_reports_one_row_per_value(tmp_path, trace, capsys):
    report = tmp_path / "s.json"
    assert main(["simulate", "--trace", str(trace), "--report", str(report),
                 "--num-kv-blocks", "100", "--sweep", "max-num-seqs=2,8,32"]) == 0
    sweep = json.loads(report.read_text())["sweep"]
    assert sweep["name"] == "max_num_seqs"
    assert [r["value"] for r in sweep["rows"]] == [2, 8, 32]
    throughput = [r["aggregate"]["throughput_output_tok_s"] for r in sweep["rows"]]
    assert throughput[0] < throughput[1]
    assert "max_num_seqs" in capsys.readouterr().out


def test_a_sweep_refuses_a_bad_value_before_any_run(trace, capsys, monkeypatch):
    """The simulator pass: each value was checked when its run began, so a bad last one was
    refused after the others had run (minutes on a long trace), their work lost."""
    from kvserve.sim.deployment import Deployment

    def ran(*args, **kwargs):
        raise AssertionError("a run began before every value was checked")

    monkeypatch.setattr(Deployment, "simulate", ran)
    assert main(["simulate", "--trace", str(trace), "--quiet", "--workers", "1",
                 "--num-kv-blocks", "100", "--sweep", "max_num_seqs=2,8,100000"]) == 2
    assert _error_line(capsys) == ("kvserve simulate: error: max_num_batched_tokens=2048 "
                                   "must be >= max_num_seqs=100000")
    assert main(["simulate", "--trace", str(trace), "--quiet", "--workers", "1",
                 "--sweep", "batching=continuous,bogus"]) == 2  # the review: it was missed
    assert _error_line(capsys) == ("kvserve simulate: error: batching 'bogus' is not one of "
                                   "continuous, static, serial")


def test_sweep_of_the_step_mix(tmp_path, trace):
    """Q1: the report of each step mix, by name, as an operator compares them."""
    report = tmp_path / "s.json"
    assert main(["simulate", "--trace", str(trace), "--report", str(report), "--quiet",
                 "--sweep", "step-mix=mixed,prefill-first"]) == 0
    rows = json.loads(report.read_text())["sweep"]["rows"]
    assert [r["value"] for r in rows] == ["mixed", "prefill-first"]
    assert all(r["aggregate"]["num_finished"] == 40 for r in rows)


def test_batching_modes_on_the_same_trace(tmp_path, trace):
    results = {}
    for mode in ("continuous", "static", "serial"):
        report = tmp_path / f"{mode}.json"
        assert main(["simulate", "--trace", str(trace), "--batching", mode, "--quiet",
                     "--report", str(report)]) == 0
        results[mode] = json.loads(report.read_text())["aggregate"]
    assert results["serial"]["duration_s"] > results["static"]["duration_s"] \
        > results["continuous"]["duration_s"]
    assert results["serial"]["queue_p99"] > results["continuous"]["queue_p99"]


def test_plan_json_has_the_worked_figures(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--hardware", "h100-sxm",
                 "--activation-reserve-gib", "1", "--prompt-len", "1000", "--output-len",
                 "250", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["kv_bytes_per_token"], data["max_live_tokens"], data["max_concurrency"]) \
        == (131_072, 453_200, 358)


def test_plan_from_device_memory_by_hand(capsys):
    # SmolLM2 in bf16 on a 1 GiB device at 50%: 536,870,912 - 269,030,016 (weights)
    # - 107,374,182 (0.1 GiB reserve) = 160,466,714 B of KV; / (23,040 x 16 = 368,640 B)
    # = 435 blocks (435.3) = 6,960 tokens; 512 + 128 = 640 tokens = 40 blocks -> 10 at once.
    assert main(["plan", "--model", "smollm2-135m", "--gpu-memory-gib", "1",
                 "--gpu-memory-utilization", "0.5", "--activation-reserve-gib", "0.1",
                 "--prompt-len", "512", "--output-len", "128", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["pool_bytes"], data["num_blocks"], data["max_live_tokens"],
            data["max_concurrency"]) == (160_466_714, 435, 6_960, 10)


def test_plan_with_a_trace_recommends_and_finds_capacity(trace, capsys):
    assert main(["plan", "--trace", str(trace), "--cost-model", "unit", "--num-kv-blocks",
                 "60", "--candidates", "2,64", "--ttft-p99", "1000", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["num_blocks"], data["max_live_tokens"]) == (60, 960)  # the pool simulated
    assert [r["max_num_seqs"] for r in data["sweep"]] == [2, 64]
    assert data["max_num_seqs_no_preemption"] == 2
    assert data["max_num_seqs_best_throughput"] == 64
    assert data["capacity_qps"] is None or data["capacity_qps"] > 0
    assert data["capacity_probes"]
    if data["capacity_qps"] is not None:  # the floor: the p99 at a tenth of the capacity
        floor, bound = data["queue_p99_floor_s"], data["queue_delay_p99_bound_s"]
        assert floor is not None and floor >= 0
        assert ("capacity_note" in data) == (floor >= 0.5 * bound)


def test_plan_sweep_sizes_each_pool_as_simulate_does(tmp_path, trace, capsys):
    """The KV pool depends on max_num_seqs (the activation reserve holds a logits row per
    sequence, as vLLM's profiling run does), so each of plan's candidates runs on the pool
    `kvserve simulate --max-num-seqs N` would size for the same flags: the same blocks,
    preemptions and figures."""
    # 22.0 GiB x 0.70 leaves ~0.2 GiB of KV after 14.96 GiB of weights and the reserve: a
    # pool this trace fills, with 0.06 GiB more logits reserve at 128 sequences than at 8.
    memory = ["--model", "llama-3.1-8b", "--hardware", "l4", "--max-model-len", "4096",
              "--gpu-memory-utilization", "0.70"]
    assert main(["plan", "--trace", str(trace), *memory, "--candidates", "8,128",
                 "--no-capacity-search", "--json"]) == 0
    rows = {r["max_num_seqs"]: r for r in json.loads(capsys.readouterr().out)["sweep"]}
    assert rows[8]["num_kv_blocks"] > rows[128]["num_kv_blocks"]
    for value, row in rows.items():
        report = tmp_path / f"s{value}.json"
        assert main(["simulate", "--trace", str(trace), *memory, "--max-num-seqs",
                     str(value), "--quiet", "--report", str(report)]) == 0
        data = json.loads(report.read_text())
        assert data["config"]["cache"]["num_blocks"] == row["num_kv_blocks"]
        assert data["aggregate"]["num_preemptions"] == row["num_preemptions"]
        assert data["aggregate"]["ttft_p99"] == row["ttft_p99"]


def test_requests_cut_short_by_max_model_len_get_a_warning(tmp_path, capsys):
    """Their finish is "length", as at max_tokens: only a warning tells a run whose context
    ran out (QA: refusals got one, these only a count in the table)."""
    trace = tmp_path / "long.jsonl"
    assert main(["workload", "gen", "-n", "5", "--rate", "5", "--prompt-len", "fixed:1000",
                 "--output-len", "fixed:500", "--seed", "1", "-o", str(trace)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--trace", str(trace), "--max-model-len", "1200",
                 "--num-kv-blocks", "500", "--quiet"]) == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        "warning: 5 request(s) cut short by max_model_len 1200: their context ran out "
        "before their max_tokens or their end (finish_reason length); give a larger "
        "--max-model-len to let them finish"]
    assert main(["simulate", "--trace", str(trace), "--max-model-len", "2048",
                 "--num-kv-blocks", "500", "--quiet"]) == 0
    assert capsys.readouterr().err == ""  # 1,501 tokens fit: none cut short


def test_a_pool_given_outright_fits_per_device(capsys):
    """The pool and the weights split over the tensor-parallel devices: 100 GiB of KV for
    Llama-70B on 4 H100s is 25 GiB beside 32.9 GiB of weights on each, which fits; a device
    of another size is plan's --gpu-memory-gib."""
    assert main(["plan", "--model", "llama-3.1-70b", "--tensor-parallel-size", "4",
                 "--kv-pool-gib", "100", "--prompt-len", "9", "--output-len", "9",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pool_bytes"] == 100 << 30
    assert main(["plan", "--hardware", "l4", "--num-kv-blocks", "100000", "--gpu-memory-gib",
                 "300", "--prompt-len", "9", "--output-len", "9", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == 100_000


def test_plan_sweep_keeps_a_given_pool_and_marks_candidates_that_do_not_fit(trace, capsys):
    """A pool given outright (--kv-pool-gib) is every candidate's; sized from memory, a
    candidate whose activation reserve leaves no room gets a row saying so, and the
    recommendations come from the others."""
    assert main(["plan", "--trace", str(trace), "--kv-pool-gib", "0.05", "--candidates",
                 "8,1024", "--no-capacity-search", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["num_kv_blocks"] for r in data["sweep"]] == [data["num_blocks"]] * 2 == [25, 25]
    memory = ["--model", "llama-3.1-8b", "--hardware", "l4", "--max-model-len", "4096",
              "--gpu-memory-utilization", "0.70"]
    assert main(["plan", "--trace", str(trace), *memory, "--candidates", "8,1024",
                 "--no-capacity-search", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    fits, too_big = data["sweep"]
    assert fits["num_kv_blocks"] > 0 and "error" not in fits
    assert too_big["num_kv_blocks"] is None and "does not fit" in too_big["error"]
    assert data["max_num_seqs_best_throughput"] == 8


@pytest.mark.parametrize("argv, message", [
    # QA: accepted silently though the pool and the weights need more than an L4 holds
    (["simulate", "--hardware", "l4", "--max-model-len", "8192", "--max-num-seqs", "64",
      "--kv-cache-memory", "40GiB"],
     "a KV pool of 40.00 GiB does not fit in the l4 preset's 22.00 GiB: with 14.96 GiB of "
     "llama-3.1-8b weights (bf16) and 0.20 GiB of activations it needs 55.16 GiB; give a "
     "smaller pool, a larger --tensor-parallel-size or another --hardware (a device no "
     "preset describes: --gpu-memory-gib)"),
    (["simulate", "--hardware", "l4", "--num-kv-blocks", "100000"],
     "a KV pool of 195.31 GiB does not fit in the l4 preset's 22.00 GiB"),
    (["plan", "--hardware", "l4", "--kv-pool-gib", "100", "--prompt-len", "9",
      "--output-len", "9"], "a KV pool of 100.00 GiB does not fit in the l4 preset's"),
    # per device: each of 8 L4s holds 12.5 GiB of the pool and 16.43 of the weights
    (["plan", "--model", "llama-3.1-70b", "--hardware", "l4", "--tensor-parallel-size", "8",
      "--kv-pool-gib", "100", "--prompt-len", "9", "--output-len", "9"],
     "a KV pool of 12.50 GiB per device does not fit in the l4 preset's 22.00 GiB: with "
     "16.43 GiB of llama-3.1-70b weights (bf16) per device"),
    (["plan", "--num-kv-blocks", "100000", "--gpu-memory-gib", "100", "--prompt-len", "9",
      "--output-len", "9"], "does not fit in --gpu-memory-gib 100: with 14.96 GiB of "
     "llama-3.1-8b weights (bf16) and 0.29 GiB of activations it needs 210.56 GiB; give a "
     "smaller pool, a larger --tensor-parallel-size or a larger --gpu-memory-gib"),
    (["simulate", "--model", "gpt-9"], "unknown model 'gpt-9'; known: llama-3.1-8b, "
                                       "llama-3.1-70b, qwen2.5-7b, mistral-7b, smollm2-135m"),
    (["simulate", "--hardware", "tpu"], "unknown hardware 'tpu'; known: h100-sxm"),
    (["simulate", "--dtype", "int3"], "unknown dtype 'int3'; known: auto, half, float16, "
                                      "bfloat16, float, float32"),
    (["simulate", "--dtype", "fp8"], "--dtype fp8: fp8 is a KV cache dtype here; give "
                                     "--kv-cache-dtype fp8"),
    (["plan", "--kv-cache-dtype", "int4", "--prompt-len", "9", "--output-len", "9"],
     "unknown kv cache dtype 'int4'; known: auto, fp8, fp8_e4m3, fp8_e5m2"),
    (["simulate", "--max-num-seqs", "0"], "max_num_seqs=0 is out of range"),
    (["simulate", "--tensor-parallel-size", "0"],
     "--tensor-parallel-size must be an integer >= 1, got 0"),
    (["simulate", "--tensor-parallel-size", "1000"], "--tensor-parallel-size 1000: "
     "llama-3.1-8b's 32 attention heads do not divide evenly among the devices"),
    (["simulate", "--max-prefill-only-steps", "2"],
     "max_prefill_only_steps=2 bounds prefill-first steps: it needs step_mix='prefill-first'"),
    (["simulate", "--sweep", "colour=1,2"], "cannot sweep 'colour'"),
    (["simulate", "--sweep", "data_parallel_size=1,2"], "kvserve plan --max-replicas M"),
    (["simulate", "--sweep", "kv-cache-memory=1GiB,lots"], "'lots' is not a size"),
    (["simulate", "--cost-model", "calibrated"], "needs --calibration"),
    (["plan", "--prompt-len", "-5", "--output-len", "10"],
     "--prompt-len must be a finite number > 0"),
    (["plan"], "give --prompt-len and --output-len, or --trace"),
    (["plan", "--prompt-len", "9", "--output-len", "9", "--block-size", "0"],
     "block_size=0 is out of range"),
    (["workload", "gen", "--rate", "-2"], "rate must be a positive number"),
    (["workload", "gen", "--prompt-len", "banana:3"], "unknown distribution 'banana'"),
    (["workload", "gen", "--prompt-len", "fixed:0"],
     "'fixed:0': 0 is below the draws' minimum 1 (min=... lowers it)"),
    (["workload", "gen", "--turns", "fixed:0"], "'fixed:0': 0 is below the draws' minimum 1"),
    (["workload", "gen", "--prompt-len", "fixed:1e20"], "lengths are at most 1e+09 tokens"),
    (["workload", "gen", "--prompt-len", "uniform:64,512,1"],
     "uniform takes 2 bare value(s) (low, high); write the others as min=... or max=..."),
    (["plan", "--prompt-len", "10", "--output-len", "10", "--router", "round-robin"],
     "--router plans replicas: give --max-replicas M and --trace"),
    (["plan", "--prompt-len", "10", "--output-len", "10", "--ray"],
     "--ray plans replicas: give --max-replicas M and --trace"),
    (["plan", "--prompt-len", "3000", "--output-len", "200"],
     "--prompt-len + --output-len = 3200 tokens is longer than max_model_len 2048"),
    (["plan", "--preemption-cost", "--seq-len", "4096", "--max-model-len", "2048"],
     "--seq-len 4096 is longer than --max-model-len 2048"),
    (["simulate", "--num-kv-blocks", "64", "--kv-cache-memory", "1GiB"],
     "give --kv-cache-memory or --num-kv-blocks, not both"),
    (["simulate", "--calibration", "c.json", "--cost-model", "unit"],
     "--calibration gives --cost-model calibrated its coefficients; it cannot be used with "
     "--cost-model unit"),
    (["simulate", "--calibration", "/nonexistent/c.json"], "cannot read cost model"),
    (["simulate", "--workers", "0"], "--workers"),
    (["simulate", "--num-kv-blocks", "0"], "--num-kv-blocks must be in [1, 16777216], got 0"),
    # 10^12 blocks took the machine's memory and the process was killed, no message (QA)
    (["simulate", "--num-kv-blocks", "1000000000000"], "--num-kv-blocks must be in [1, "),
    (["workload", "gen", "--prompt-len", "uniform:1,5,max=inf"], "is not a finite number"),
    (["workload", "gen", "-n", "3", "--rate", "1e-300"], "past the 1e+10 s a trace may span"),
    (["workload", "gen", "--cv", "2"], "--cv shapes --arrival gamma, not poisson"),
    # the calibration pass: taken, and the replay ran without it
    (["simulate", "--replay-step-times", "x.jsonl", "--calibration", "c.json"],
     "--calibration gives --cost-model calibrated its coefficients; it cannot be used with "
     "--replay-step-times"),
    # the CLI pass: --output-len then shaped nothing (the model's length in simulate)
    (["workload", "gen", "-n", "3", "--ignore-eos"], "--ignore-eos runs every request to its "
     "max_tokens: give --max-tokens N"),
    (["workload", "gen", "--burst-size", "4", "--arrival", "gamma"],
     "--burst-size shapes --arrival burst, not gamma"),
    (["workload", "gen", "-n", "3", "--sessions"], "give --turns with more than one turn"),
    (["workload", "gen", "-n", "3", "--think-time", "2"],
     "--think-time shapes multi-turn conversations"),
    (["workload", "gen", "-n", "3", "--prefix-fraction", "0.5"],
     "--prefix-fraction shapes the shared system prompts: give --prefix-groups N"),
    (["plan", "--max-replicas", "2"], "--max-replicas plans replicas: give --trace"),
    (["plan", "--prompt-len", "10", "--output-len", "2", "--kv-pool-gib", "100",
      "--gpu-memory-gib", "10"], "--kv-pool-gib gives the pool directly, so "
                                 "--gpu-memory-gib would size nothing"),
    (["workload", "gen", "-n", "6", "--turns", "fixed:3", "--prefix-groups", "2"],
     "every request here is a turn of a conversation"),
    (["simulate", "--sweep", "max_num_seqs=2", "--sweep", "max_num_batched_tokens=16,4096"],
     "--sweep is given 2 times: a sweep varies one setting"),
    (["simulate", "--kv-cache-memory", "1KiB"], "kv cache memory of 1024 bytes holds no "
     "block: one block of 16 tokens needs 2097152 bytes per device"),
    # every row ran at the 100 blocks given, labelled with the swept sizes (QA)
    (["simulate", "--sweep", "kv_cache_memory=1GiB,2GiB", "--num-kv-blocks", "100"],
     "--sweep kv_cache_memory sizes the KV pool, which --num-kv-blocks also sizes"),
    (["simulate", "--sweep", "num_kv_blocks=10,20", "--kv-cache-memory", "1GiB"],
     "--sweep num_kv_blocks sizes the KV pool, which --kv-cache-memory also sizes"),
    # a context the model cannot serve, as vLLM refuses it (it planned one; QA)
    (["simulate", "--max-model-len", "1000000"], "max_model_len 1,000,000 is longer than "
     "llama-3.1-8b's context (131,072 tokens, its max_position_embeddings)"),
    (["plan", "--model", "smollm2-135m", "--prompt-len", "10", "--output-len", "2",
      "--max-model-len", "8193"], "longer than smollm2-135m's context (8,192 tokens"),
])
def test_bad_input_is_one_line_and_exit_2(trace, capsys, argv, message):
    if argv[0] == "simulate":
        argv = [*argv, "--trace", str(trace)]
    assert main(argv) == 2
    line = _error_line(capsys)
    name = " ".join(argv[:2]) if argv[0] == "workload" else argv[0]  # (QA: `workload`)
    assert line.startswith(f"kvserve {name}: error: ")
    assert message in line


def test_plans_candidates_are_checked_before_its_trace_is_read(tmp_path, capsys):
    """QA: the trace's warning came first, so the error was not one line."""
    trace = tmp_path / "long.jsonl"
    trace.write_text('{"request_id": "a", "arrival_time": 0, "prompt_len": 999999, '
                     '"output_len": 2}\n')
    assert main(["plan", "--trace", str(trace), "--candidates", "8,x"]) == 2
    assert "write integers, e.g. 64,128,256" in _error_line(capsys)


def test_a_size_split_by_a_space_is_named_not_taken_as_the_model(capsys):
    assert main(["serve", "--kv-cache-memory", "1", "GiB"]) == 2
    assert "model path 'GiB' looks like a size's unit left over from a flag" in \
        _error_line(capsys)



@pytest.mark.parametrize("command", ["serve", "generate", "calibrate"])
@pytest.mark.parametrize("given", [[""], ["--model", ""]])
def test_an_empty_model_path_is_refused_not_read_as_here(capsys, command, given):
    """The model pass: "" ("$MODEL" unset) loaded the current directory."""
    prompt = ["--prompt", "hi"] if command == "generate" else []
    assert main([command, *given, *prompt]) == 2
    assert "the model path is empty" in _error_line(capsys)


def test_generate_says_when_standard_input_held_no_prompt(capsys, monkeypatch):
    """The CLI pass: `--prompt -` with empty input said "give at least one --prompt"."""
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["generate", "--prompt", "-"]) == 2
    assert _error_line(capsys) == "kvserve generate: error: standard input held no prompt " \
        "(one per line)"


def test_malformed_trace_line_is_named(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"request_id": "a", "arrival_time": 0, "prompt_len": 4, "output_len": 1}\n'
                    '{"request_id": "b", "arrival_time": 0, "prompt_len": 4}\n')
    assert main(["simulate", "--trace", str(path)]) == 2
    assert f"{path}:2: missing output_len" in _error_line(capsys)
    assert main(["simulate", "--trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read trace" in _error_line(capsys)
    # a byte-order mark some editors write is not the trace's business (it was "not valid
    # JSON: Unexpected UTF-8 BOM (decode using utf-8-sig)"; QA)
    path.write_text('\ufeff{"request_id": "a", "arrival_time": 0, "prompt_len": 4, '
                    '"output_len": 1}\n', encoding="utf-8")
    assert main(["simulate", "--trace", str(path)]) == 0
    # a step log that is not text names its file (it said only "'utf-8' codec can't ...")
    path.write_bytes(b"\xff\xfe{}\n")
    assert main(["calibrate", "--step-logs", str(path)]) == 2
    assert f"{path}: not a step log: it is not UTF-8 text" in _error_line(capsys)
    # and given to simulate (the simulator pass: the codec's words, no file named)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"request_id": "a", "arrival_time": 0, "prompt_len": 4, '
                     '"output_len": 1}\n', encoding="utf-8")
    assert main(["simulate", "--trace", str(trace), "--replay-step-times", str(path)]) == 2
    assert f"{path}: not a step log: it is not UTF-8 text" in _error_line(capsys)
    assert main(["simulate", "--trace", str(trace), "--calibration", str(path)]) == 2
    assert f"{path}: not a cost model: it is not UTF-8 text" in _error_line(capsys)


def test_absurd_lengths_in_a_trace_are_refused_or_cut_before_their_ids_are_drawn(
        tmp_path, capsys):
    """J1 on the length alone: a 10^12-token prompt is refused without drawing its ids (that
    would need 8 TB), and a 10^12-token answer is drawn only as far as max_model_len lets
    it run (J2), so the run ends by length."""
    path = tmp_path / "huge.jsonl"
    rows = [{"request_id": "long-prompt", "arrival_time": 0, "prompt_len": 10**12,
             "output_len": 4},
            {"request_id": "long-answer", "arrival_time": 0, "prompt_len": 16,
             "output_len": 10**12},
            {"request_id": "shared", "arrival_time": 0, "prompt_len": 10**12,
             "prefix_id": "p", "prefix_len": 8, "output_len": 1}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(path), "--model", "smollm2-135m", "--quiet",
                 "--max-model-len", "512", "--report", str(report)]) == 0
    assert "2 request(s) refused, e.g. request long-prompt: prompt of 1000000000000 tokens " \
           "leaves no room to generate: max_model_len is 512" in capsys.readouterr().err
    requests = {r["request_id"]: r for r in json.loads(report.read_text())["requests"]}
    assert requests["long-answer"]["finish_reason"] == "length"
    assert requests["long-answer"]["output_tokens"] == 512 - 16


def test_sweep_of_batching_and_of_the_pool(tmp_path, trace):
    report = tmp_path / "b.json"
    assert main(["simulate", "--trace", str(trace), "--quiet", "--report", str(report),
                 "--num-kv-blocks", "100", "--sweep", "batching=serial,continuous"]) == 0
    data = json.loads(report.read_text())
    assert "batching" not in data["config"]
    serial, continuous = (r["aggregate"] for r in data["sweep"]["rows"])
    assert serial["duration_s"] > continuous["duration_s"]
    assert main(["simulate", "--trace", str(trace), "--quiet", "--report", str(report),
                 "--sweep", "num_kv_blocks=40,400"]) == 0
    rows = json.loads(report.read_text())["sweep"]["rows"]
    assert [r["num_kv_blocks"] for r in rows] == [40, 400]
    assert rows[0]["aggregate"]["num_preemptions"] > rows[1]["aggregate"]["num_preemptions"]


def test_calibrated_cost_model_from_a_file(tmp_path, trace):
    # Every step costs 10 ms + 1 us per scheduled token, which the time series shows exactly.
    coefficients = tmp_path / "cm.json"
    coefficients.write_text(json.dumps({"format": "kvserve-cost-model/1", "coefficients": {
        "fixed_s": 0.01, "per_token_s": 1e-6}}))
    report = tmp_path / "c.json"
    assert main(["simulate", "--trace", str(trace), "--quiet", "--report", str(report),
                 "--cost-model", "calibrated", "--calibration", str(coefficients)]) == 0
    data = json.loads(report.read_text())
    a = data["aggregate"]
    assert data["config"]["cost_model"]["name"] == "calibrated"
    durations = data["time_series"]["step_duration"]
    tokens = data["time_series"]["num_scheduled_tokens"]
    assert durations == [round(0.01 + 1e-6 * n, 9) for n in tokens]
    assert a["num_steps"] == len(durations)


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--trace", "t.jsonl", "--max-num-seqz", "4"],
     "unrecognized arguments: --max-num-seqz"),
    (["workload", "gen", "--rate", "fast"], "argument --rate: invalid float value: 'fast'"),
    (["simulate", "--batching", "dynamic", "--trace", "t.jsonl"], "invalid choice: 'dynamic'"),
    # one rule for every command's seed (simulate took -1 where workload gen refused it)
    (["simulate", "--trace", "t.jsonl", "--seed", "-1"], "argument --seed: must be >= 0"),
    (["plan", "--trace", "t.jsonl", "--seed", "-1"], "argument --seed: must be >= 0"),
    (["workload", "gen", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["whatif", "rec", "--seed", "x"], "argument --seed: 'x' is not an integer"),
    # named by the subcommand (it said "kvserve: error"), with what a vLLM flag is here
    # (all of them: tests/server/test_vllm_compat.py)
    (["generate", "--prompt", "x", "-tp=2"],
     "kvserve generate: error: vLLM's -tp 2 is not taken here: there is no tensor "
     "parallelism; --data-parallel-size runs replicas (see kvserve generate --help)"),
    (["serve", "--gpu-memory-utilization=0.9"], "kvserve serve: error: vLLM's "
     "--gpu-memory-utilization 0.9 is not taken here: the KV cache is sized by "
     "--kv-cache-memory"),
    # a nested command's own parser names it and its help (it said "kvserve bench")
    (["bench", "serve", "--bogus"], "kvserve bench serve: error: unrecognized arguments: "
     "--bogus (see kvserve bench serve --help)"),
    (["workload", "gen", "--bogus"], "kvserve workload gen: error: unrecognized"),
    # a flag is never taken from a prefix of its name (--max-num meant --max-num-seqs)
    (["simulate", "--trace", "t.jsonl", "--max-num", "4"], "unrecognized arguments: "
     "--max-num 4"),
])
def test_usage_errors_are_one_line_and_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in _error_line(capsys)


def test_flags_take_underscores_as_vllms_do(tmp_path, trace):
    """``--max_num_seqs`` is ``--max-num-seqs`` (vLLM's parser takes both); a value keeps its
    underscores."""
    reports = []
    for flags in (["--max-num-seqs", "4", "--scheduling-policy=fcfs"],
                  ["--max_num_seqs", "4", "--scheduling_policy=fcfs"]):
        report = tmp_path / f"r{len(reports)}.json"
        assert main(["simulate", "--trace", str(trace), *flags, "--report", str(report)]) == 0
        reports.append(json.loads(report.read_text()))
    assert reports[0]["config"]["scheduler"]["max_num_seqs"] == 4
    assert reports[0]["aggregate"] == reports[1]["aggregate"]


def test_reports_are_identical_across_processes_and_hash_seeds(tmp_path, trace):
    outputs = []
    for hash_seed in ("1", "2"):
        report = tmp_path / f"p{hash_seed}.json"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-m", "kvserve.cli", "simulate", "--trace", str(trace),
             "--num-kv-blocks", "120", "--report", str(report), "--quiet"],
            env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        outputs.append(report.read_bytes())
    assert outputs[0] == outputs[1]


def test_progress_bar_appears_only_after_a_second_on_a_terminal():
    from kvserve.sim.table import Progress

    progress = Progress(total=10, label="simulating")
    progress._enabled = True  # as on a terminal
    progress(1.0, 1, 10)
    assert progress._bar is None  # under a second: nothing shown
    progress._start -= 2.0
    progress(2.0, 5, 10)
    assert progress._bar is not None
    assert progress._bar.tasks[0].completed == 5
    progress.close()
    assert progress._bar is None


def test_trace_from_standard_input(monkeypatch, tmp_path, capsys):
    import io

    assert main(["workload", "gen", "-n", "5", "--rate", "5"]) == 0
    text = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", "-", "--quiet", "--report", str(report)]) == 0
    assert json.loads(report.read_text())["aggregate"]["num_requests"] == 5
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO('{"request_id": "a"}\n'))
    assert main(["simulate", "--trace", "-"]) == 2
    assert "<stdin>:1:" in _error_line(capsys)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_full_standard_output_is_named():
    """'error: : No space left on device' named no file (QA)."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "kvserve", "workload", "gen", "-n", "3"],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().endswith("error: writing the output: No space left on device")


def test_simulate_names_the_requests_a_full_priority_queue_displaced(tmp_path, capsys):
    """K5's displaced requests end under abort in the report; simulate says how many."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({
        "request_id": name, "arrival_time": at, "prompt_len": 16, "output_len": 2,
        "priority": priority}) + "\n" for name, at, priority in (
            ("a", 0.0, 0), ("b", 0.001, 50), ("c", 0.002, 0))))
    assert main(["simulate", "--trace", str(trace), "--quiet", "--cost-model", "unit",
                 "--scheduling-policy", "priority", "--max-num-seqs", "1",
                 "--max-num-queued-reqs", "1"]) == 0
    assert "warning: 1 waiting request(s) displaced by more urgent arrivals" in \
        capsys.readouterr().err


def test_simulate_takes_a_devices_memory_as_plan_does(tmp_path, trace, capsys):
    """QA (session 28): simulate had no flag for a device no preset names; plan's
    --gpu-memory-gib sizes its pool here too."""
    sizes = {}
    for memory in (None, "40"):
        report = tmp_path / f"r{memory}.json"
        flags = ["--gpu-memory-gib", memory] if memory else []
        assert main(["simulate", "--trace", str(trace), "--hardware", "h100-sxm",
                     "--report", str(report), "--quiet", *flags]) == 0
        sizes[memory] = json.loads(report.read_text())["config"]["cache"]["num_blocks"]
    assert 0 < sizes["40"] < sizes[None] / 2  # 40 GiB less the weights, of 79.2 less them
    capsys.readouterr()
    assert main(["simulate", "--trace", str(trace), "--gpu-memory-gib", "0"]) == 2
    assert "--gpu-memory-gib must be > 0" in _error_line(capsys)


def test_an_output_that_is_an_input_or_another_output_is_refused(tmp_path, trace, capsys):
    """QA (CLI fuzz): ``--report`` naming the trace replaced the trace with the report
    (exit 0); two outputs on one path kept the last; "" wrote nothing, and ``-`` a file
    named "-". Each is one line and exit 2, the inputs untouched; ``workload gen -o -``
    writes to standard output."""
    from pathlib import Path

    before = Path(trace).read_text()
    trace = str(trace)
    cases = [
        (["--report", trace], "is a file this command reads"),
        (["--events", trace], "is a file this command reads"),
        (["--report", str(tmp_path / "a"), "--html", str(tmp_path / "a")],
         "--html and --report are both"),
        (["--report", ""], "--report needs a file name, got ''"),
        (["--html", "-"], "--html needs a file name, got '-'"),
    ]
    for flags, needle in cases:
        assert main(["simulate", "--trace", trace, "--quiet", *flags]) == 2
        assert needle in _error_line(capsys)
    assert Path(trace).read_text() == before and not (tmp_path / "a").exists()
    assert main(["calibrate", "--step-logs", trace, "-o", trace]) == 2
    assert "is a file this command reads" in _error_line(capsys)
    assert main(["calibrate", "--step-logs", trace, trace, "-o", str(tmp_path / "c")]) == 2
    assert f"--step-logs names {trace} twice" in _error_line(capsys)  # QA: counted twice
    # under another spelling too (the calibration pass)
    assert main(["calibrate", "--step-logs", trace, os.path.join(
        os.path.dirname(trace), ".", os.path.basename(trace)), "-o", str(tmp_path / "c")]) == 2
    assert f"--step-logs names {os.path.realpath(trace)} twice" in _error_line(capsys)
    assert Path(trace).read_text() == before
    assert main(["workload", "gen", "-n", "2", "-o", "-"]) == 0
    assert capsys.readouterr().out.count('"request_id"') == 2
    assert not os.path.exists("-")


def _run(argv: list[str]) -> int:
    """main's exit status, where argparse's own refusals exit rather than return."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)


@pytest.mark.parametrize(("argv", "needle"), [
    # QA (CLI fuzz): tracebacks (exit 1) each
    (["plan", "--prompt-len", "512", "--output-len", "128", "--gpu-memory-gib", "inf"],
     "argument --gpu-memory-gib: must be a finite number, got 'inf'"),
    (["plan", "--prompt-len", "512", "--output-len", "128", "--kv-pool-gib", "nan"],
     "argument --kv-pool-gib: must be a finite number, got 'nan'"),
    (["plan", "--preemption-cost", "--seq-len", "1000", "--prefill-flops", "1e309"],
     "argument --prefill-flops: must be a finite number"),
    (["plan", "--preemption-cost", "--seq-len", "1000", "--link-bandwidth", "inf"],
     "--link-bandwidth must be a finite rate > 0"),
    (["workload", "gen", "-n", "10", "--arrival", "gamma", "--cv", "1e-300"],
     "cv must be in [0.001, 1000], got 1e-300"),
    (["workload", "gen", "-n", "1000000000000"], "num_requests must be in [1, 10,000,000]"),
    (["workload", "gen", "-n", "10", "--prefix-groups", "99999999999"],
     "prefix_groups must be in [0, num_requests]"),
    (["record", "start", "--url", "http://[::1"], "--url 'http://[::1' is not a URL"),
    (["workload", "gen", "-n", "5", "--priorities", "0:nan"],
     "weights must be finite numbers >= 0"),  # QA: numpy's "Probabilities contain NaN"
    (["workload", "gen", "-n", "5", "--priorities", "0:1,0:1"], "a class is given twice"),
    (["plan", "--prompt-len", "100", "--output-len", "100", "--ttft-p99", "1"],
     "--ttft-p99 is for the max_num_seqs sweep over a trace: it needs --trace"),  # QA: ignored
    # the simulator pass: taken and ignored, exit 0
    (["plan", "--prompt-len", "100", "--output-len", "100", "--candidates", "8"],
     "--candidates is for the max_num_seqs sweep over a trace: it needs --trace"),
    (["plan", "--trace", "-", "--max-replicas", "2", "--no-capacity-search"],
     "--no-capacity-search is for the max_num_seqs sweep, which --max-replicas replaces"),
    # taken, and silently wrong or ignored
    (["plan", "--prompt-len", "100", "--output-len", "100", "--kv-pool-gib", "1",
      "--kv-cache-memory", "20GiB"], "so --kv-cache-memory would size nothing"),
    (["plan", "--prompt-len", "100", "--output-len", "100", "--kv-pool-gib", "1",
      "--num-kv-blocks", "100"], "so --num-kv-blocks would size nothing"),
    # silently wrong (exit 0): nan think time as 0, 64Gb/s (bits) read as bytes
    (["workload", "gen", "-n", "6", "--turns", "fixed:3", "--think-time", "nan"],
     "argument --think-time: must be a finite number, got 'nan'"),
    (["plan", "--preemption-cost", "--seq-len", "1000", "--link-bandwidth", "64Gb/s"],
     "a lowercase b is bits; write the rate in bytes, e.g. 8GB/s for 64Gb/s"),
])
def test_bad_numbers_and_urls_are_one_line_and_exit_2(argv, needle, capsys):
    assert _run(argv) == 2
    assert needle in _error_line(capsys)


def test_an_output_the_os_refuses_is_one_line(tmp_path, capsys):
    """QA (CLI fuzz): as root, a path under /proc passed the folder check and the work's end
    was a traceback; /dev/full likewise; a full standard output was a traceback too."""
    log = tmp_path / "steps.jsonl"
    log.write_text("")
    for path, needle in (("/proc/kvserve-x", "--output /proc/kvserve-x: "),
                         ("/dev/full", "--output /dev/full: is not a regular file")):
        assert _run(["calibrate", "--step-logs", str(log), "-o", path]) == 2
        assert needle in _error_line(capsys)
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "kvserve", "plan", "--preemption-cost",
                               "--seq-len", "100"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "kvserve plan: error: writing the output: No space left " \
        "on device"


def test_workload_gen_names_a_bad_output_before_the_work(capsys, monkeypatch):
    """The CLI pass: -o into a missing folder was refused after the trace was made (97 s for
    a million requests)."""
    import kvserve.sim.workloads as workloads

    def generate(spec):
        raise AssertionError("generated before the output was checked")
    monkeypatch.setattr(workloads, "generate", generate)
    assert main(["workload", "gen", "-n", "5", "-o", "/nonexistent/x.jsonl"]) == 2
    assert "--output /nonexistent/x.jsonl: no such directory" in _error_line(capsys)


def test_ctrl_c_and_a_closed_standard_output_are_no_traceback(capsys, monkeypatch):
    """The CLI pass: Ctrl-C in workload gen or generate, and a reader of standard output
    that left (| head), ended in a Python traceback."""
    import kvserve.sim.workloads as workloads

    for error, status, said in ((KeyboardInterrupt(), 130, "kvserve workload gen: "
                                 "interrupted\n"), (BrokenPipeError(32, "Broken pipe"), 1, "")):
        def generate(spec, error=error):
            raise error
        monkeypatch.setattr(workloads, "generate", generate)
        monkeypatch.setattr("kvserve.cli._stdout_to_devnull", lambda: None)
        assert main(["workload", "gen", "-n", "5"]) == status
        assert capsys.readouterr().err == said


@pytest.mark.parametrize(("flags", "needle"), [
    (["--sweep", "num_host_blocks=abc,-5"], "num_host_blocks must be an integer >= 0, got 'abc'"),
    (["--sweep", "swap_space=-1,-2"], "swap_space must be a size >= 0"),
    (["--max-num-seqs", "8", "--sweep", "max_num_seqs=16,32"],
     "--sweep max_num_seqs sets what --max-num-seqs sets: give one (drop --max-num-seqs)"),
    # named as the engine's setting, not the flag (QA)
    (["--sweep", "num_kv_blocks=100,0"], "num_kv_blocks values must be integers in [1, "),
    (["--sweep", ""], "--sweep '': write NAME=V1,V2,..."),  # QA: one plain run, exit 0
    (["--gpu-memory-gib", "1e23"], "gpu_memory_gib makes a KV pool of "),
])
def test_sweep_values_are_checked_under_any_mode(trace, flags, needle, capsys):
    """QA (CLI fuzz): host-tier values were checked only under swap (``abc`` and ``-5`` ran
    as two rows), and a flag the sweep also set was dropped without a word."""
    assert _run(["simulate", "--trace", str(trace), "--quiet", "--workers", "1", *flags]) == 2
    assert needle in _error_line(capsys)


def test_only_serve_reads_a_config_file(tmp_path, capsys):
    """QA (CLI fuzz): the word serve anywhere (``bench serve``, a trace named serve) made
    the command line read --config as kvserve serve's, and its errors said "kvserve serve"."""
    config = tmp_path / "c.yaml"
    config.write_text("max-model-len: 0\n")
    assert _run(["bench", "serve", "--config", str(config)]) == 2
    line = _error_line(capsys)
    assert "kvserve serve" not in line and "--max-model-len" not in line


def test_plan_with_no_candidate_that_fits_says_so(trace, capsys):
    """QA (CLI fuzz): with no candidate that fits, the summary said "every candidate
    preempts" and "no candidate meets the TTFT target" (none was given), and searched the
    capacity at max_num_seqs 256, no candidate."""
    assert main(["plan", "--trace", str(trace), "--candidates", "1000000"]) == 0
    out = capsys.readouterr()
    rows = [line for line in out.out.splitlines()
            if "without preemption" in line or "best-throughput" in line]
    assert len(rows) == 2 and all("no candidate fits" in row for row in rows)
    assert "no candidate max_num_seqs fits: no capacity to search" in out.out + out.err
    assert "capacity QPS at max_num_seqs" not in out.out


def test_a_bad_calibration_file_is_one_line_naming_it(tmp_path, trace, capsys):
    """QA (CLI fuzz): a warning that the file was fitted on another model came first, then
    an error naming the coefficient but not the file."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"format": "kvserve-cost-model/1",
                                "coefficients": {"fixed_s": 0.01, "per_token_s": -1},
                                "meta": {"model": "smollm2-135m", "device": "elsewhere"}}))
    assert _run(["simulate", "--trace", str(trace), "--calibration", str(path),
                 "--quiet"]) == 2
    assert f"{path}: coefficient per_token_s must be" in _error_line(capsys)


def test_token_counts_in_a_sweep_read_as_their_flags_read_them():
    """QA (CLI fuzz): --max-model-len 4k worked, --sweep max_model_len=4k was refused."""
    from kvserve.flags import parse_sweep
    from kvserve.sim.cli_whatif import parse_setting

    assert parse_sweep("max_model_len=4k,2K") == ("max_model_len", [4000, 2048])
    assert parse_setting("max_num_batched_tokens=1k", "max_num_batched_tokens=1k") == \
        ("max_num_batched_tokens", 1000)
    with pytest.raises(ValueError, match="is not a count of tokens"):
        parse_sweep("max_num_batched_tokens=lots")


@pytest.mark.parametrize(("command", "argv", "flag"), [
    ("simulate", ["--sweep", "max_num_seqs=8,,16", "--quiet"], "--sweep 'max_num_seqs=8,,16'"),
    ("plan", ["--candidates", "8,16,"], "--candidates '8,16,'"),
])
def test_an_empty_list_value_is_refused(trace, capsys, command, argv, flag):
    """The simulator pass: 8,,16 ran 8 and 16 and said nothing of the empty value."""
    assert main([command, "--trace", str(trace), *argv]) == 2
    assert _error_line(capsys) == (f"kvserve {command}: error: {flag}: an empty value (two "
                                   "commas together, or one at an end)")



def test_an_empty_candidate_list_is_refused_not_the_default(trace, capsys):  # the review
    assert main(["plan", "--trace", str(trace), "--candidates", ""]) == 2
    assert _error_line(capsys) == ("kvserve plan: error: --candidates '': give at least one "
                                   "value, e.g. 64,128,256")
