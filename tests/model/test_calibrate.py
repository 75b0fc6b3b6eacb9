"""Issue 6: kvserve calibrate measures real steps and writes a loadable cost model."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from kvserve.engine import calibrate
from kvserve.engine.llm import build_engine
from kvserve.model.config import ModelConfig
from kvserve.sim.cost_models import CalibratedCostModel
from kvserve.sim.layout import BlockLayout
from kvserve.sim.machine import cpu_identity
from kvserve.sim.trace import TraceRequest

TINY = ModelConfig(name="tiny", vocab_size=2048, hidden_size=32, intermediate_size=64,
                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                   max_position_embeddings=1024)


def test_shape_views_count_tokens_context_and_attention_pairs():
    shape = calibrate.StepShape(decode_contexts=(10, 20), prefills=((4, 3),))
    view = shape.view()
    assert (view.num_seqs, view.num_tokens, view.num_decode_seqs) == (3, 5, 2)
    assert view.context_tokens == 34
    # decodes: 1 x 10 + 1 + 1 x 20 + 1; prefill: 3 x 4 + 3 x 4 / 2
    assert view.attention_pairs == 11 + 21 + 12 + 6


def test_shape_views_count_the_context_in_scattered_blocks():
    shape = calibrate.StepShape(decode_contexts=(40, 10), prefills=((20, 5),), block_size=16)
    # scattered: every block after a sequence's first, so 40 - 16, 10 - 10, 20 - 16
    assert shape.view().scattered_context_tokens == 24 + 0 + 4
    assert replace(shape, scattered=False).view().scattered_context_tokens == 0


def test_the_dealt_blocks_have_the_layout_the_view_claims():
    # The simulator's own tracker, run on the step calibration hands the runner.
    shape = calibrate.StepShape(decode_contexts=(100, 300), prefills=((64, 32),))
    for layout in (shape, replace(shape, scattered=False)):
        out = calibrate._scheduler_output(layout, num_blocks=4096)
        assert BlockLayout(16).observe(out) == layout.view().scattered_context_tokens


def test_the_grid_measures_each_shape_that_reads_context_on_both_layouts():
    assert all(s.scattered for s in calibrate.grid(quick=True))  # the default: no twins
    shapes = calibrate.grid(quick=True, block_size=16, layout_twins=True)
    consecutive = [i for i, s in enumerate(shapes) if not s.scattered]
    # the twin follows its scattered shape directly, so machine drift hits both alike
    assert all(shapes[i - 1] == replace(shapes[i], scattered=True) for i in consecutive)
    # quick grid: decodes at context 64 (3 batch sizes) and the mixed step at 32 have twins;
    # prefills from 0 and decodes within their first block (16) read no other block
    assert len(consecutive) == 4 and len(shapes) == 14
    assert len([s for s in calibrate.grid(layout_twins=True) if not s.scattered]) == 23


def test_calibration_on_a_real_runner_writes_a_usable_model(tmp_path):
    engine = build_engine(TINY, num_kv_blocks=64, detokenize=False)
    shapes = calibrate.grid(quick=True, layout_twins=True)
    model, seconds = calibrate.calibrate(engine.executor, 64, shapes, warmup=1, repeats=2)
    assert len(seconds) == len(shapes) and all(s > 0 for s in seconds)
    assert engine.executor.requests == {}  # nothing left behind in the runner
    path = tmp_path / "cost.json"
    path.write_text(calibrate.to_json(model, shapes, seconds, {"model": "tiny"}))
    data = json.loads(path.read_text())
    assert data["meta"]["model"] == "tiny" and len(data["samples"]) == len(shapes)
    assert {sample["scattered"] for sample in data["samples"]} == {True, False}
    assert {"mean_abs_error", "r2", "machine", "torch"} <= set(data["meta"])
    # the CPU it ran on, which the simulator checks a run's CPU against (issue 15)
    assert data["meta"]["cpu"] == cpu_identity()
    loaded = CalibratedCostModel.load(path)
    assert loaded.coefficients == model.coefficients
    calibrate.plot(tmp_path / "fit.svg", shapes, seconds, model)
    assert (tmp_path / "fit.svg").read_text().startswith("<svg")


def test_the_file_names_the_model_by_the_shape_the_simulator_checks():
    """meta.model_shape holds what the simulator compares with --model's preset: the
    bundled SmolLM2's is the smollm2-135m preset's, key for key."""
    from kvserve.model.config import SMOLLM2_135M
    from kvserve.sim.presets import get_model

    meta = calibrate.model_meta(SMOLLM2_135M)
    assert meta == {"model": "SmolLM2-135M-Instruct",
                    "model_shape": get_model("smollm2-135m").shape()}
    assert meta["model_shape"]["num_layers"] == 30
    assert calibrate.model_meta(TINY)["model_shape"]["hidden_size"] == 32


def test_a_shape_for_another_block_size_is_refused():
    engine = build_engine(TINY, num_kv_blocks=64, block_size=16, detokenize=False)
    with pytest.raises(ValueError, match="shape has block size 32, the runner 16"):
        calibrate.measure(engine.executor, calibrate.StepShape(decode_contexts=(8,),
                                                               block_size=32), 64)


def test_calibration_in_service_fits_on_every_step_the_engine_ran():
    """kvserve calibrate --trace: the trace runs on the engine, which records each step's
    shape, and the model is fitted on those steps and their times."""
    engine = build_engine(TINY, num_kv_blocks=64, detokenize=False, max_num_seqs=4,
                          max_num_batched_tokens=64)
    trace = [TraceRequest(f"r{i}", 0.0, output_len=6 + i, ignore_eos=True,
                          prompt_token_ids=tuple(range(1 + i, 40 + 9 * i)))
             for i in range(8)]
    model, seen = calibrate.calibrate_in_service(engine, trace)
    assert seen["num_steps"] == engine.scheduler.num_steps
    assert seen["num_steps"] >= 10  # 8 prompts through a 4-seat, 64-token batch
    assert model.source.startswith(f"in service: {seen['num_steps']} steps")
    assert model.coefficients["fixed_s"] + model.coefficients["per_token_s"] > 0
    assert CalibratedCostModel.from_dict(json.loads(calibrate.in_service_json(model, seen)))


def test_calibration_in_service_fits_the_kind_term_relative_to_the_price(monkeypatch):
    """In service the fit has the step-kind term unless told otherwise, and its error is
    relative to the model's price (docs/fidelity.md, "Step kinds")."""
    options = []

    def recording_fit(views, seconds, source="", **kwargs):
        options.append(kwargs)  # a few noisy steps of a tiny model: what is fitted is moot
        return CalibratedCostModel.from_dict({"format": "kvserve-cost-model/1",
                                              "coefficients": {"fixed_s": 0.01}})

    monkeypatch.setattr(calibrate, "fit", recording_fit)
    engine = build_engine(TINY, num_kv_blocks=64, detokenize=False, max_num_seqs=4,
                          max_num_batched_tokens=64)
    trace = [TraceRequest(f"r{i}", 0.0, output_len=4, ignore_eos=True,
                          prompt_token_ids=tuple(range(1, 30 + 9 * i))) for i in range(4)]
    calibrate.calibrate_in_service(engine, trace)
    calibrate.calibrate_in_service(engine, trace, kind_term=False)
    assert options == [{"kind_term": True, "relative_to": "priced"},
                       {"kind_term": False, "relative_to": "priced"}]


@pytest.mark.parametrize("content, message", [
    (None, "does not exist|No such file|cannot read"),
    ("", "the trace has no requests"),
    ('{"request_id": "a"}\n', r"trace.jsonl:1: "),
])
def test_calibrate_in_service_refuses_a_bad_trace_before_loading_a_model(
        tmp_path, capsys, content, message):
    from kvserve.cli import main

    path = tmp_path / "trace.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["calibrate", "--trace", str(path), "-o", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "c.json").exists()


def test_calibrate_in_service_refuses_grid_options(tmp_path, capsys):
    from kvserve.cli import main

    path = tmp_path / "trace.jsonl"
    path.write_text('{"request_id": "a", "arrival_time": 0, "prompt_len": 8, "output_len": 4}\n')
    assert main(["calibrate", "--trace", str(path), "--quick"]) == 2
    assert "--trace fits on the steps the trace runs" in capsys.readouterr().err


def _write_step_log(path, views, seconds):
    with path.open("w") as log:
        for index, (view, second) in enumerate(zip(views, seconds, strict=True)):
            log.write(json.dumps({"type": "step", "index": index, "duration": second,
                                  "num_scheduled_tokens": view.num_tokens,
                                  "shape": dataclasses.asdict(view)}) + "\n")
        log.write(json.dumps({"type": "event", "what": "not a step"}) + "\n")


def test_calibrate_pools_step_logs_and_shows_each_runs_speed(tmp_path, capsys):
    """Two runs of one machine, the second 20% slower throughout: the pooled fit prices
    their sum, and the report shows each run on its own side of it (the machine's
    run-to-run spread, which a fit on one run would carry into every plan)."""
    from kvserve.cli import main
    from kvserve.sim.cost_models import CalibratedCostModel
    from kvserve.sim.executor import BatchView

    truth = CalibratedCostModel.from_dict({
        "format": "kvserve-cost-model/1", "min_tokens": 0,
        "coefficients": {"fixed_s": 0.004, "per_token_s": 2e-4, "per_seq_s": 1e-4,
                         "per_sampled_s": 0.0, "per_context_token_s": 1e-7,
                         "per_attention_pair_s": 0.0}})
    views = [BatchView(seqs, seqs + chunk, seqs, seqs, 300 * seqs, 300 * seqs + chunk * chunk)
             for seqs in range(1, 17) for chunk in (0, 64, 256)]
    fast, slow = tmp_path / "fast.jsonl", tmp_path / "slow.jsonl"
    _write_step_log(fast, views, [truth.step_time(None, v) for v in views])
    _write_step_log(slow, views, [1.2 * truth.step_time(None, v) for v in views])
    out = tmp_path / "pooled.json"
    assert main(["calibrate", "--step-logs", str(fast), str(slow), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    data = json.loads(out.read_text())
    per_log = {Path(row["path"]).name: row for row in data["meta"]["step_logs"]}
    assert per_log["fast.jsonl"]["num_steps"] == per_log["slow.jsonl"]["num_steps"] == 48
    assert per_log["fast.jsonl"]["error_of_the_sum"] > 0.05   # priced above the fast run
    assert per_log["slow.jsonl"]["error_of_the_sum"] < -0.05  # and below the slow one
    spread = per_log["fast.jsonl"]["error_of_the_sum"] - per_log["slow.jsonl"]["error_of_the_sum"]
    assert spread == pytest.approx(0.2 / 1.1, abs=0.03)
    assert abs(data["meta"]["error_of_the_sum"]) < 0.02
    assert "96 steps of 2 logs" in printed and "run-to-run spread" in printed
    assert data["meta"]["cpu"] is None  # the logs' machine, not this one
    assert "warning" not in captured.err  # 96 steps, prefills among them
    CalibratedCostModel.load(out)  # a model file the simulator takes
    # a few decode steps make a fit that says little (the calibration pass: written as a
    # model with "mean error 13.5%" and no word)
    decode = [v for v in views if v.num_tokens == v.num_decode_seqs][:10]
    thin = tmp_path / "thin.jsonl"
    _write_step_log(thin, decode, [truth.step_time(None, v) for v in decode])
    assert main(["calibrate", "--step-logs", str(thin), "-o", str(tmp_path / "t.json")]) == 0
    err = capsys.readouterr().err
    assert "warning: fitted on 10 steps, fewer than 50" in err
    assert "warning: no step fitted on prefilled a prompt" in err


@pytest.mark.parametrize(("extra", "content", "message"), [
    ([], None, "cannot read step log"),
    ([], '{"type": "step", "duration": 0.1}\n', "no step with a shape"),
    ([], "{nope\n", r"log.jsonl:1: not valid JSON"),
    (["--quick"], '{"type": "step"}\n', "not with --trace, --quick"),
    # QA (CLI fuzz): taken and ignored, as if they shaped the fit
    (["--block-size", "0", "--no-greedy"], '{"type": "step"}\n',
     r"runs no model: --greedy/--no-greedy, --block-size would change nothing; leave them"),
    (["--dtype", "float32"], '{"type": "step"}\n', r"runs no model: --dtype would change"),
    # the calibration pass: Infinity blamed the fit, 1e300 wrote "r2": NaN, 10^30 tokens fit
    ([], '{"type": "step", "duration": Infinity, "shape": {}}\n',
     r"a step's duration is inf s; a step takes at most 3600 s"),
    ([], '{"type": "step", "duration": 1e300, "shape": {}}\n', r"a step's duration is 1e\+300"),
    ([], '{"type": "step", "duration": 0.1, "shape": {"num_seqs": 1, "num_tokens": ' +
     "1" * 31 + ', "num_sampled": 1, "num_decode_seqs": 0, "context_tokens": 0, '
     '"attention_pairs": 1}}\n', r"a step's shape has num_tokens 1111111111111111111111111"),
])
def test_calibrate_refuses_bad_step_logs_in_one_line(tmp_path, capsys, extra, content,
                                                      message):
    from kvserve.cli import main

    path = tmp_path / "log.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["calibrate", "--step-logs", str(path), *extra,
                 "-o", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["-o", "/nonexistent-dir/c.json"], "--output /nonexistent-dir/c.json: no such directory"),
    (["--plot", "/nonexistent-dir/p.svg"], "--plot /nonexistent-dir/p.svg: no such directory"),
    (["--block-size", "0"], "block_size=0 is out of range"),
])
def test_calibrate_refuses_a_bad_path_or_size_before_measuring(tmp_path, capsys, argv,
                                                                message):
    """Checked before the model loads: a bad output path used to fail after the whole
    measurement, its result lost."""
    from kvserve.cli import main

    argv = argv if "-o" in argv else [*argv, "-o", str(tmp_path / "c.json")]
    assert main(["calibrate", "--quick", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert "step shapes" not in err


def _recording(directory: Path, model: str, views, seconds) -> Path:
    """A recording directory (docs/recording.md) of ``model`` whose step log is ``views``
    at ``seconds``."""
    directory.mkdir()
    (directory / "recording.json").write_text(json.dumps({
        "format": "kvserve-recording/1", "model": model, "record_prompts": "none",
        "settings": {"max_num_seqs": 16, "max_num_batched_tokens": 2048, "max_model_len": 1024,
                     "num_kv_blocks": 64, "block_size": 16, "enable_prefix_caching": True},
        "segments": [{"start": 0.0, "stop": 100.0, "in_flight_at_start": 0}]}))
    (directory / "trace-00000.jsonl").write_text(json.dumps({
        "request_id": "a", "arrival_time": 0.0, "prompt_len": 16, "output_len": 2,
        "max_tokens": 8}) + "\n")
    rows = [{"type": "step", "start": float(index), "duration": second,
             "num_scheduled_tokens": view.num_tokens, "shape": dataclasses.asdict(view)}
            for index, (view, second) in enumerate(zip(views, seconds, strict=True))]
    rows.append({"type": "event", "time": 3.0, "kind": "finished", "request_id": "a"})
    (directory / "steps-0-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def test_a_fit_on_recordings_names_their_model_and_refuses_two(tmp_path, capsys):
    """The recordings' model goes into the file, so simulate warns where it prices another;
    recordings of two models are not pooled into one price."""
    from kvserve.cli import main
    from kvserve.sim.executor import BatchView

    views = [BatchView(seqs, seqs + chunk, seqs, seqs, 300 * seqs, 300 * seqs + chunk * chunk)
             for seqs in range(1, 17) for chunk in (0, 64, 256)]
    seconds = [0.004 + 2e-4 * v.num_tokens + 1e-4 * v.num_seqs for v in views]
    small = _recording(tmp_path / "small", "SmolLM2-135M-Instruct", views, seconds)
    other = _recording(tmp_path / "other", "Llama-3.1-8B-Instruct", views, seconds)
    out = tmp_path / "fit.json"
    assert main(["calibrate", "--step-logs", str(small), "-o", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["model"] == "SmolLM2-135M-Instruct"
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"request_id": "a", "arrival_time": 0, "prompt_len": 16, '
                     '"output_len": 2}\n')
    capsys.readouterr()
    assert main(["simulate", "--trace", str(trace), "--calibration", str(out), "--model",
                 "llama-3.1-8b", "--quiet"]) == 0
    assert "was calibrated on model SmolLM2-135M-Instruct, not this run's llama-3.1-8b" in \
        capsys.readouterr().err
    assert main(["calibrate", "--step-logs", str(small), str(other), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--step-logs are of different models" in err[0]
    # a bare step log names no model: a fit pooling one names none (QA: labelled with the
    # recording's, though half its steps were another model's)
    bare = tmp_path / "bare.jsonl"
    _write_step_log(bare, views, seconds)
    assert main(["calibrate", "--step-logs", str(small), str(bare), "-o", str(out)]) == 0
    assert "model" not in json.loads(out.read_text())["meta"]


def test_a_model_file_is_written_whole_or_not_at_all(tmp_path):
    """The calibration pass: a write that failed at its end (a full disk, a file-size limit)
    left a half-written model where the good one had been."""
    from kvserve.flags import write_file_atomically

    path = tmp_path / "model.json"
    path.write_text('{"good": true}\n')
    with pytest.raises(UnicodeEncodeError):  # fails part-way through the write
        write_file_atomically(path, '{"new": "' + "x" * 100_000 + '\udc80"}')
    assert path.read_text() == '{"good": true}\n' and os.listdir(tmp_path) == ["model.json"]
    path.chmod(0o600)
    write_file_atomically(path, '{"new": 1}\n')
    assert path.read_text() == '{"new": 1}\n'
    assert path.stat().st_mode & 0o777 == 0o600  # its permissions kept (the review)
    link = tmp_path / "link.json"  # a link is written through (/dev/stdout is one)
    link.symlink_to(path)
    write_file_atomically(link, '{"through": 1}\n')
    assert link.is_symlink() and path.read_text() == '{"through": 1}\n'


def test_a_long_context_chunk_s_attention_pairs_are_a_step_s():
    """The second review: a 32,768-token chunk at a 98,304-token context has 3.76e9
    attention pairs, which a bound of 2^31 refused as corrupt (and with it the recording)."""
    from kvserve.sim.calibration import shaped_steps

    shape = {"num_seqs": 1, "num_tokens": 32768, "num_sampled": 1, "num_decode_seqs": 0,
             "context_tokens": 98304, "attention_pairs": 3_758_112_768}
    views, seconds = shaped_steps([{"shape": shape, "duration": 9.5}], "rec")
    assert views[0].attention_pairs == 3_758_112_768 and seconds == [9.5]


def test_a_trace_fit_on_few_steps_is_warned(tmp_path, capsys):
    """The second review: the thin-fit warning was --step-logs' only; a trace of a few
    requests fits a model on ten steps as well."""
    from kvserve.cli import main

    trace = tmp_path / "t.jsonl"
    assert main(["workload", "gen", "-n", "6", "--rate", "100", "--prompt-len", "fixed:40",
                 "--output-len", "fixed:8", "-o", str(trace)]) == 0
    assert main(["calibrate", "--trace", str(trace), "--load-format", "dummy", "-o",
                 str(tmp_path / "c.json")]) == 0
    # (about ten steps: arrivals are real time, so one more or less)
    assert re.search(r"warning: fitted on \d+ steps, fewer than 50", capsys.readouterr().err)
