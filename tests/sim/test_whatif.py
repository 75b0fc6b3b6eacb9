"""Issue 18: ``kvserve whatif`` on a hand-built recording whose outcome is worked out by hand
(docs/recording.md).

Two requests, a and b, arrive together at t=0 with 16-token prompts; each answers 2 tokens
and then EOS (3 tokens). The server ran them with max_num_seqs 1 (A1: at most that many
running), every step taking 1 s: a prefills at step 0 and decodes at steps 1-2 (finished at
3 s), then b at steps 3-5 (finished at 6 s). With max_num_seqs 2 and the unit cost model
(1 s a step) both prefill at step 0 and finish at 3 s: b's latency moves from 6 s to 3 s,
a's does not move, and b's first differing decision is its admission, at step 3 in the
recording and at step 0 with the change.
"""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvserve.sim.recording import load_recording
from kvserve.sim.whatif import (
    SHAPE_SUPPORT,
    Decision,
    ShapeTally,
    describe_bin,
    first_difference,
    make_run,
    moved,
    off_record,
    recorded_shapes,
    shape_bin,
)


def build(directory):
    directory.mkdir()
    settings = {"max_num_seqs": 1, "max_num_batched_tokens": 64, "max_model_len": 128,
                "num_kv_blocks": 32, "block_size": 16, "enable_prefix_caching": True}
    (directory / "recording.json").write_text(json.dumps({
        "format": "kvserve-recording/1", "settings": settings, "record_prompts": "none",
        "segments": [{"start": 0.0, "stop": 6.5, "in_flight_at_start": 0}]}))
    (directory / "trace-00000.jsonl").write_text("".join(
        json.dumps({"request_id": rid, "arrival_time": 0.0, "prompt_len": 16,
                    "output_len": 2, "max_tokens": 8}) + "\n" for rid in ("a", "b")))
    steps = [{"type": "step", "start": float(i), "duration": 1.0, "num_scheduled_tokens": n}
             for i, n in enumerate((16, 1, 1, 16, 1, 1))]
    events = [{"type": "event", "time": 3.0, "kind": "finished", "request_id": "a"},
              {"type": "event", "time": 6.0, "kind": "finished", "request_id": "b"}]
    (directory / "steps-0-00000.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in steps + events))
    return directory


def test_the_worked_example_moves_b_by_three_seconds_from_its_admission(tmp_path, capsys):
    directory = build(tmp_path / "rec")
    report, html = tmp_path / "w.json", tmp_path / "w.html"
    assert main(["whatif", str(directory), "--set", "max_num_seqs=2", "--cost-model", "unit",
                 "--report", str(report), "--html", str(html)]) == 0
    printed = capsys.readouterr()
    assert f"wrote {report}\nwrote {html}" in printed.err  # QA: silent
    data = json.loads(report.read_text())
    runs = {run["label"]: run["aggregate"] for run in data["runs"]}
    assert list(runs) == ["recorded", "recorded (unit model)", "max_num_seqs=2"]
    assert runs["recorded"]["duration_s"] == 6.0 and runs["recorded"]["num_steps"] == 6
    assert runs["recorded (unit model)"]["duration_s"] == 6.0
    assert runs["max_num_seqs=2"]["duration_s"] == 3.0
    assert (runs["recorded"]["e2e_max"], runs["max_num_seqs=2"]["e2e_max"]) == (6.0, 3.0)
    [row] = data["moved"]["max_num_seqs=2"]  # a did not move
    assert (row["request_id"], row["e2e_before_s"], row["e2e_after_s"]) == ("b", 6.0, 3.0)
    # against the recorded settings under the same (unit) model: the change's own effect
    assert row["first_difference"] == {"recorded (unit model)": "admitted at step 3 (3.000 s)",
                                       "max_num_seqs=2": "admitted at step 0 (0.000 s)"}
    assert (row["ttft_before_s"], row["ttft_after_s"]) == (4.0, 1.0)  # the operator pass
    assert "b: e2e 6.000 s -> 3.000 s (-3.000 s), TTFT 4.000 s -> 1.000 s; recorded (unit " \
        "model): admitted at step 3" in printed.out
    page = html.read_text()
    assert page.count("<svg") == 4 and "max_num_seqs=2" in page and "<script" not in page


def test_the_recorded_run_replays_the_step_log(tmp_path):
    recording = load_recording(build(tmp_path / "rec"), warn=pytest.fail)
    model = recording.replay_cost_model()
    assert model.durations == [1.0] * 6 and model.starts == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_first_difference_names_the_first_decision_apart():
    base = [Decision("admitted", 0, 0.0), Decision("preempted", 4, 4.0)]
    assert first_difference(base, base) is None
    assert first_difference(base, base[:1]) == (base[1], None)
    other = [Decision("admitted", 0, 0.1), Decision("finished", 6, 6.0)]
    assert first_difference(base, other) == (base[1], other[1])
    # the same decision at the same moment, after fewer (larger) steps: the same (QA)
    renumbered = [Decision("admitted", 0, 0.0), Decision("preempted", 2, 4.0)]
    assert first_difference(base, renumbered) is None
    later = [Decision("admitted", 0, 0.0), Decision("preempted", 5, 4.5)]
    assert first_difference(base, later) == (base[1], later[1])


@pytest.mark.parametrize(("argv", "needle"), [
    (["--set", "max_num_seqs"], "write NAME=VALUE"),
    (["--set", "nonsense=1"], "cannot set 'nonsense'"),
    (["--set", "max_num_seqs=2", "--top", "0"], "--top must be >= 1"),
    # named as the user wrote it (it said "num_blocks must be >= 1"; QA)
    (["--set", "num_kv_blocks=-5"], "num_kv_blocks must be an integer in [1, "),
    (["--set", "max_num_seqs=2,x"], "max_num_seqs"),  # each value of a list is checked
    (["--set", "max_num_seqs=2 max_num_seqs=3"], "max_num_seqs is given twice"),
    (["--set", "max_num_seqs=2,3 num_kv_blocks=8"], "take one value each"),
    (["--set", "max_num_seqs=2", "--set", "max_num_seqs=3,2"],
     "--set asks for the run max_num_seqs=2 twice"),  # the report kept one of the two (QA)
    # QA (CLI fuzz): a note on what --model prices came first, then the error
    (["--set", "max_num_seqs=2", "--model", "gpt-9"], "unknown model 'gpt-9'"),
])
def test_bad_changes_are_one_line(tmp_path, capsys, argv, needle):
    directory = build(tmp_path / "rec")
    assert main(["whatif", str(directory), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_too_few_recorded_steps_to_fit_name_the_hardware_to_price_them_by(tmp_path, capsys):
    """Six recorded steps fit no model: the way out names the hardware too (operator pass:
    roofline alone priced a CPU server's steps as an H100's)."""
    assert main(["whatif", str(build(tmp_path / "rec")), "--set", "max_num_seqs=2"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "cannot fit a cost model on the recorded steps" in last
    assert "give --cost-model roofline with the --hardware it ran on (cpu-local" in last


def test_swap_on_a_recording_without_a_host_tier_runs_with_one(tmp_path, capsys):
    """One --set is one setting, so preemption_mode=swap on a recording made without a host
    tier could not run at all ("needs a host KV tier"; QA): it runs with one as large as the
    pool, and its label says so."""
    directory = build(tmp_path / "rec")
    report = tmp_path / "w.json"
    assert main(["whatif", str(directory), "--set", "preemption_mode=swap", "--cost-model",
                 "unit", "--report", str(report)]) == 0
    labels = [run["label"] for run in json.loads(report.read_text())["runs"]]
    assert labels[-1] == "preemption_mode=swap +num_host_blocks=32"


def test_a_block_size_on_a_recording_keeps_its_pools_memory(tmp_path, capsys):
    """The recording's pool is its blocks: block_size=32 alone kept the 32 blocks, doubled
    the pool's tokens and read as the block size's gain (the sim-agreement pass). It keeps
    the pool's memory (its tokens in blocks of the new size), and its label says so; given
    with a pool of its own, the pool is taken as given."""
    directory = build(tmp_path / "rec")
    report = tmp_path / "w.json"
    assert main(["whatif", str(directory), "--cost-model", "unit", "--report", str(report),
                 "--set", "block_size=32", "--set", "block_size=8",
                 "--set", "block_size=32 num_kv_blocks=32",
                 "--set", "block_size=32 preemption_mode=swap"]) == 0
    runs = json.loads(report.read_text())["runs"]
    assert [run["label"] for run in runs[2:]] == [
        "block_size=32 +num_kv_blocks=16", "block_size=8 +num_kv_blocks=64",
        "block_size=32 num_kv_blocks=32",
        "block_size=32 preemption_mode=swap +num_kv_blocks=16 +num_host_blocks=16"]
    capsys.readouterr()
    assert main(["simulate", "--trace", str(directory), "--block-size", "32", "--cost-model",
                 "unit", "--report", str(report), "--quiet"]) == 0
    assert json.loads(report.read_text())["config"]["cache"]["num_blocks"] == 16
    assert "note: --block-size 32 keeps the recorded pool's memory: 16 blocks of 32 (it " \
        "recorded 32 of 16); give --num-kv-blocks to size it otherwise" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(directory), "--block-size", "32", "--cost-model",
                 "unit", "--report", str(report), "--quiet", "--num-kv-blocks", "32"]) == 0
    assert json.loads(report.read_text())["config"]["cache"]["num_blocks"] == 32


def test_settings_change_together_or_a_run_per_value(tmp_path, capsys):
    """whatif ran one changed setting per --set: 'A=1 B=2' is now one run changing both,
    'A=1,2' a run per value (as --sweep); a swap change that names its host tier keeps it."""
    directory = build(tmp_path / "rec")
    report = tmp_path / "w.json"
    assert main(["whatif", str(directory), "--cost-model", "unit", "--report", str(report),
                 "--set", "max_num_seqs=2,1", "--set", "max_num_seqs=2 num_kv_blocks=2",
                 "--set", "preemption_mode=swap num_host_blocks=8"]) == 0
    runs = json.loads(report.read_text())["runs"]
    assert [run["label"] for run in runs[2:]] == [
        "max_num_seqs=2", "max_num_seqs=1", "max_num_seqs=2 num_kv_blocks=2",
        "preemption_mode=swap num_host_blocks=8"]
    assert [run["change"] for run in runs[1:3]] == [None, {"max_num_seqs": 2}]
    duration = {run["label"]: run["aggregate"]["duration_s"] for run in runs}
    assert duration["max_num_seqs=2"] == 3.0 and duration["max_num_seqs=1"] == 6.0
    # both admitted, but two blocks hold one request's answer: the pool forces preemptions
    squeezed = runs[4]["aggregate"]
    assert squeezed["num_preemptions"] >= 1 and duration["max_num_seqs=2"] < \
        squeezed["duration_s"] < 6.0


def test_a_directory_that_is_no_recording_is_named(tmp_path, capsys):
    assert main(["whatif", str(tmp_path), "--set", "max_num_seqs=2"]) == 2
    assert "cannot read recording.json" in capsys.readouterr().err


def test_moved_skips_requests_that_did_not_move(tmp_path):
    recording = load_recording(build(tmp_path / "rec"), warn=pytest.fail)
    from kvserve.sim.deployment import Deployment

    deployment = Deployment(cost_model="unit", recording=recording)
    result = deployment.simulate(recording.trace, recording.settings, record_events=True)[1]
    run = make_run("x", result)
    assert moved(run, run, 5) == []


def test_a_bad_line_inside_a_recording_is_an_error_naming_it(tmp_path):
    from kvserve.sim.trace import TraceError

    directory = build(tmp_path / "rec")
    steps = directory / "steps-0-00000.jsonl"
    rows = steps.read_text().splitlines()
    rows[2] = rows[2][:10]  # not the last line: not a write cut short
    steps.write_text("\n".join(rows) + "\n")
    with pytest.raises(TraceError, match=f"{steps}:3: not valid JSON"):
        load_recording(directory)
    (directory / "recording.json").write_text('{"format": "other"}')
    with pytest.raises(TraceError, match="format must be 'kvserve-recording/1'"):
        load_recording(directory)


def test_a_cut_short_last_line_is_skipped_with_a_warning(tmp_path):
    directory = build(tmp_path / "rec")
    trace = directory / "trace-00000.jsonl"
    trace.write_text(trace.read_text()[:-12])  # b's line, killed mid-write
    warnings: list[str] = []
    recording = load_recording(directory, warn=warnings.append)
    assert [r.request_id for r in recording.trace] == ["a"]
    assert warnings == [f"{trace}:2: the last line is cut short (the server stopped while "
                        "writing it); replaying up to the line before"]


@pytest.mark.parametrize(("recorded", "flags", "preset", "warned"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", [], "smollm2-135m", False),
    ("Llama-3.1-70B-Instruct", [], "llama-3.1-70b", False),
    ("SmolLM2-135M-Instruct", ["--model", "qwen2.5-7b"], "qwen2.5-7b", False),
    ("Mystery-7B", [], "llama-3.1-8b", True),
    ("", [], "llama-3.1-8b", False),  # a recording that names no model
])
def test_a_replay_prices_the_model_it_recorded(tmp_path, capsys, recorded, flags, preset,
                                               warned):
    """The model preset of a replay defaults to the recorded model's (it prices what the
    recorded steps cannot, a preemption's recompute against its swap), not to a preset of
    another model; a model no preset describes is said so."""
    directory = build(tmp_path / "rec")
    manifest = json.loads((directory / "recording.json").read_text())
    (directory / "recording.json").write_text(json.dumps({**manifest, "model": recorded}))
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(directory), "--quiet", "--report", str(report),
                 *flags]) == 0
    assert json.loads(report.read_text())["config"]["deployment"]["model"] == preset
    err = capsys.readouterr().err
    assert (f"recorded model '{recorded}', which no model preset describes" in err) == warned


@pytest.mark.parametrize(("flags", "replicas"), [([], 2), (["--data-parallel-size", "1"], 1),
                                                  (["--data-parallel-size", "3"], 3)])
def test_a_recording_of_replicas_replays_as_many_unless_told(tmp_path, flags, replicas):
    """The recorded number of replicas is the default; one given, 1 included, wins."""
    directory = build(tmp_path / "rec")
    manifest = json.loads((directory / "recording.json").read_text())
    manifest["settings"]["data_parallel_size"] = 2
    (directory / "recording.json").write_text(json.dumps(manifest))
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(directory), "--quiet", "--report", str(report),
                 "--cost-model", "unit", *flags]) == 0
    config = json.loads(report.read_text())["config"]
    assert config.get("data_parallel", {"size": 1})["size"] == replicas


def test_a_model_served_under_an_alias_is_priced_as_itself(tmp_path, capsys):
    """`serve --served-model-name my-chat` records the alias and the model's own name
    (``model_id``): the replay's preset comes from the latter."""
    directory = build(tmp_path / "rec")
    manifest = json.loads((directory / "recording.json").read_text())
    (directory / "recording.json").write_text(json.dumps(
        {**manifest, "model": "my-chat", "model_id": "SmolLM2-135M-Instruct"}))
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(directory), "--quiet", "--report",
                 str(report)]) == 0
    assert json.loads(report.read_text())["config"]["deployment"]["model"] == "smollm2-135m"
    assert "no model preset describes" not in capsys.readouterr().err


def test_requests_a_change_refuses_are_shown(tmp_path, capsys):
    directory = build(tmp_path / "rec")
    assert main(["whatif", str(directory), "--set", "max_model_len=16", "--cost-model",
                 "unit"]) == 0
    rows = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert rows["not finished"].split()[-2:] == ["2", "rejected"]
    assert rows["requests finished"].split()[-1] == "0"
    # no TTFT or queue figure counts them (the dashboard pass: a change that stranded
    # requests in the queue read as one that removed queueing); the row says how many
    assert rows["no first token"].split()[-3:] == ["0", "0", "2"]


def test_a_calibration_file_prices_the_changes(tmp_path):
    """--calibration FILE is the changes' model (it implies calibrated), while the recorded
    run still replays; it was refused once --calibration came to imply its model."""
    from kvserve.sim import calibration
    from kvserve.sim.cost_models import CalibratedCostModel

    directory = build(tmp_path / "rec")
    path = tmp_path / "c.json"
    calibration.save(CalibratedCostModel({"fixed_s": 0.5}, "by hand"), path)
    report = tmp_path / "w.json"
    assert main(["whatif", str(directory), "--set", "max_num_seqs=2", "--calibration",
                 str(path), "--report", str(report)]) == 0
    runs = {run["label"]: run["aggregate"] for run in json.loads(report.read_text())["runs"]}
    assert runs["recorded"]["duration_s"] == 6.0  # the log's 1 s steps
    assert runs["recorded (calibrated model)"]["duration_s"] == 3.0  # 6 steps of 0.5 s
    assert runs["max_num_seqs=2"]["duration_s"] == 1.5  # 3 steps of 0.5 s


def test_a_change_that_moved_nothing_says_why(tmp_path, capsys):
    """A change under which no request finished (max_model_len 8 refuses both 16-token
    prompts) has nothing to compare: whatif said "no request's latency moved", as if the
    change were harmless. A change that leaves every latency as it was says so, with the
    count it compared."""
    directory = build(tmp_path / "rec")
    html = tmp_path / "w.html"
    assert main(["whatif", str(directory), "--cost-model", "unit", "--set", "max_model_len=8",
                 "--set", "max_num_seqs=1", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "moved most with max_model_len=8:\n  no request finished in both runs, so none " \
        "to compare (see 'not finished')" in out
    assert "moved most with max_num_seqs=1:\n  no request's latency moved (of 2 that " \
        "finished in both runs)" in out
    assert "no request finished in both runs" in html.read_text()


def test_deployment_flags_that_price_little_say_so(tmp_path, capsys):
    """--model and --hardware changed nothing under the fitted model and said nothing (QA):
    they price only a preemption's recompute against its swap there."""
    directory = build(tmp_path / "rec")
    assert main(["whatif", str(directory), "--cost-model", "unit", "--hardware", "h100-sxm",
                 "--set", "max_num_seqs=2"]) == 0
    assert "note: --hardware prices only what the recorded steps cannot" in \
        capsys.readouterr().err


def test_a_router_for_a_lone_replica_says_it_changes_nothing(tmp_path, capsys):
    """The simulator pass: --set router=... on a one-replica recording printed a column
    equal to the recorded one without a word (simulate notes it)."""
    directory = build(tmp_path / "rec")
    assert main(["whatif", str(directory), "--cost-model", "unit",
                 "--set", "router=round-robin"]) == 0
    assert "note: router=round-robin spreads arrivals over replicas; with one replica it " \
        "changes nothing" in capsys.readouterr().err
    assert main(["whatif", str(directory), "--cost-model", "unit",
                 "--set", "router=round-robin data_parallel_size=2"]) == 0
    assert "changes nothing" not in capsys.readouterr().err


def test_a_recordings_lines_may_start_with_a_byte_order_mark(tmp_path):
    """A hand-edited recording's file saved with a BOM was "not valid JSON" (QA)."""
    directory = build(tmp_path / "rec")
    trace = directory / "trace-00000.jsonl"
    trace.write_text("\ufeff" + trace.read_text(encoding="utf-8"), encoding="utf-8")
    assert [r.request_id for r in load_recording(directory).trace] == ["a", "b"]


def test_a_model_check_far_from_the_recording_is_said(tmp_path, capsys):
    """The changes are priced by a model whose run of the recorded settings may sit far from
    the recording (QA: 15 s against 36 s on a busy machine, said nowhere): a note says so and
    which column to read the changes against; the unit model's 6 s says nothing."""
    directory = build(tmp_path / "rec")
    assert main(["whatif", str(directory), "--set", "max_num_seqs=2", "--cost-model",
                 "unit"]) == 0
    assert "note: the unit model" not in capsys.readouterr().out
    assert main(["whatif", str(directory), "--set", "max_num_seqs=2", "--cost-model",
                 "roofline", "--model", "smollm2-135m", "--hardware", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "note: the roofline model runs the recorded settings in" in out
    assert 'against the "recorded (roofline model)" column' in out
    # the cause said is the model's (the calibration pass: always a quiet machine's
    # calibration pricing a busy one's steps low)
    assert "(the roofline model prices steps from a preset's figures" in out
    from kvserve.sim.cli_whatif import model_gap_cause
    assert model_gap_cause("calibrated", 2.1, None).startswith("the model is fitted on this "
                                                                "recording's steps")
    assert model_gap_cause("calibrated", 0.3, "c.json") == \
        "a calibration measured on a busy machine pricing a quiet one's steps high"


def test_a_model_check_whose_latencies_alone_are_off_is_said(capsys):
    """QA: TTFT p50 79% above the recording's with the duration within 3%: no note."""
    from types import SimpleNamespace

    from kvserve.sim.cli_whatif import model_check_gap

    recorded = SimpleNamespace(aggregate={"duration_s": 10.0, "ttft_p50": 0.2,
                                          "itl_p50": 0.05})
    check = SimpleNamespace(aggregate={"duration_s": 10.3, "ttft_p50": 0.358,
                                       "itl_p50": 0.06})
    words, off = model_check_gap(recorded, check)
    assert words == "gives the recorded settings a TTFT p50 of 358 ms against the " \
        "recording's 200 ms" and off == pytest.approx(0.79)
    close = SimpleNamespace(aggregate={"duration_s": 10.3, "ttft_p50": 0.21, "itl_p50": 0.05})
    assert model_check_gap(recorded, close) is None
    slow = SimpleNamespace(aggregate={"duration_s": 10.3, "ttft_p50": 0.2, "itl_p50": 0.15})
    assert model_check_gap(recorded, slow)[0].startswith("gives the recorded settings an ITL")


def build_shaped(directory, requests=6):
    """A recording whose steps carry their shapes: ``requests`` 16-token prompts at t=0,
    each answering 2 tokens then EOS, served one at a time (max_num_seqs 1): per request a
    prefill step of one request (0.5 s), then two decode-only steps of one (0.1 s)."""
    directory.mkdir()
    settings = {"max_num_seqs": 1, "max_num_batched_tokens": 64, "max_model_len": 128,
                "num_kv_blocks": 64, "block_size": 16, "enable_prefix_caching": False}
    ids = [f"r{i}" for i in range(requests)]
    (directory / "recording.json").write_text(json.dumps({
        "format": "kvserve-recording/1", "settings": settings, "record_prompts": "none",
        "segments": [{"start": 0.0, "stop": 0.7 * requests + 1, "in_flight_at_start": 0}]}))
    (directory / "trace-00000.jsonl").write_text("".join(
        json.dumps({"request_id": rid, "arrival_time": 0.0, "prompt_len": 16,
                    "output_len": 2, "max_tokens": 8}) + "\n" for rid in ids))
    rows, now = [], 0.0
    for _ in ids:
        for context, tokens, seconds in ((0, 16, 0.5), (16, 1, 0.1), (17, 1, 0.1)):
            shape = {"num_seqs": 1, "num_tokens": tokens, "num_sampled": 1,
                     "num_decode_seqs": 1 if tokens == 1 else 0, "context_tokens": context,
                     "attention_pairs": tokens * context + tokens * (tokens + 1) // 2,
                     "scattered_context_tokens": 0}
            rows.append({"type": "step", "start": now, "duration": seconds,
                         "num_scheduled_tokens": tokens, "shape": shape})
            now += seconds
    (directory / "steps-0-00000.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows))
    return directory


def test_time_in_shapes_the_recording_lacks_is_counted_and_said(tmp_path, capsys):
    """Priced by the model fitted on the recorded steps, a change that runs steps of more
    requests than any recorded one spends its time in shapes the recording has none of: the
    table's "unrecorded shapes" row and a note say how much and which (docs/fidelity.md,
    "Shapes the recording lacks"). The recorded settings spend none there."""
    directory = build_shaped(tmp_path / "rec")
    report = tmp_path / "w.json"
    assert main(["whatif", str(directory), "--set", "max_num_seqs=4", "--set",
                 "max_num_seqs=1", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    runs = {run["label"]: run["aggregate"] for run in json.loads(report.read_text())["runs"]}
    assert runs["recorded (calibrated model)"]["off_record_share"] == 0.0
    assert runs["max_num_seqs=1"]["off_record_share"] == 0.0
    wide = runs["max_num_seqs=4"]["off_record"]
    assert wide["share"] > 0.5 and wide["support_steps"] == SHAPE_SUPPORT
    shapes = {row["shape"]: row["recorded_steps"] for row in wide["shapes"]}
    assert shapes["steps with prefill of 4-7 requests"] == 0
    assert "unrecorded shapes" in out
    assert "note: " in out and "of max_num_seqs=4's step time went to step shapes the " \
        "recording has fewer than 5 steps of (" in out
    assert "max_num_seqs=1's step time" not in out
    # another model than the one fitted here: nothing to count against
    assert main(["whatif", str(directory), "--set", "max_num_seqs=4", "--cost-model",
                 "unit"]) == 0
    assert "unrecorded shapes" not in capsys.readouterr().out


def test_a_shape_is_its_kind_and_its_requests_octave():
    from kvserve.sim.executor import BatchView

    def view(seqs, tokens, decode):
        return BatchView(seqs, tokens, seqs, decode, 0, 0)

    assert shape_bin(view(1, 16, 0)) == (True, 1)
    assert shape_bin(view(3, 3, 3)) == (False, 2)
    assert shape_bin(view(200, 2048, 199)) == (True, 8)
    assert describe_bin((True, 1)) == "steps with prefill of 1 request"
    assert describe_bin((False, 8)) == "decode-only steps of 128-255 requests"
    tally = ShapeTally()
    tally.add(view(1, 1, 1), 1.0)
    tally.add(view(4, 40, 3), 3.0)
    result = off_record(tally, recorded_shapes([view(1, 1, 1)] * SHAPE_SUPPORT))
    assert result.share == 0.75
    assert result.shapes == (("steps with prefill of 4-7 requests", 3.0, 0),)
    assert result.note("x").startswith("75% of x's step time")
    tally.add(view(4, 40, 3), 6.0)  # now 1 s of 10 in the shape recorded too rarely
    result = off_record(tally, recorded_shapes([view(4, 40, 3)] * SHAPE_SUPPORT +
                                               [view(1, 1, 1)] * (SHAPE_SUPPORT - 1)))
    assert result.share == 0.1 and result.shapes[0][2] == SHAPE_SUPPORT - 1
    assert result.note("x") is None  # under OFF_RECORD_NOTE


def test_simulate_on_a_recording_warns_of_its_unrecorded_shapes(tmp_path, capsys):
    """``kvserve simulate --trace REC`` with a setting changed runs on the same fitted model
    as whatif's changes, and warns the same way; with the recorded settings (the replay)
    nothing is counted."""
    directory = build_shaped(tmp_path / "rec")
    assert main(["simulate", "--trace", str(directory), "--max-num-seqs", "4",
                 "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "of this run's step time went to step shapes the " \
        "recording has fewer than 5 steps of (" in err
    assert main(["simulate", "--trace", str(directory), "--quiet"]) == 0
    assert "step shapes" not in capsys.readouterr().err


def test_a_step_shape_that_counts_below_zero_and_replay_step_times_are_refused(tmp_path,
                                                                                capsys):
    """QA (CLI fuzz): a shape of num_tokens -5 was fitted on; --replay-step-times was taken
    by whatif and changed nothing."""
    directory = build_shaped(tmp_path / "rec")
    assert main(["whatif", str(directory), "--set", "max_num_seqs=2", "--replay-step-times",
                 str(directory / "steps-0-00000.jsonl")]) == 2
    assert "--replay-step-times is for simulate" in capsys.readouterr().err
    log = directory / "steps-0-00000.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    rows[3]["shape"]["num_tokens"] = -5
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["whatif", str(directory), "--set", "max_num_seqs=2"]) == 2
    assert "a step's shape has num_tokens -5" in capsys.readouterr().err


def test_a_recording_whose_steps_all_took_no_time_is_named(tmp_path, capsys):
    """QA (CLI fuzz): "replay log has N steps; the simulation scheduled more" (whatif),
    "got 0 and 0" (plan), where every step's duration was 0."""
    directory = build_shaped(tmp_path / "rec")
    log = directory / "steps-0-00000.jsonl"
    rows = [{**json.loads(line), "duration": 0} for line in log.read_text().splitlines()]
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for argv in (["whatif", str(directory), "--set", "max_num_seqs=2"],
                 ["plan", "--trace", str(directory)]):
        assert main(argv) == 2
        assert "every logged step has duration 0" in capsys.readouterr().err
