"""Issue 6, replay mode: step times measured on the engine, replayed by the simulator,
reproduce the engine's scheduling decisions exactly (admissions, preemptions, finishes)."""

from __future__ import annotations

import io
import json
import random

import pytest

from kvserve.core import CacheConfig, SchedulerConfig
from kvserve.engine.llm import build_engine
from kvserve.engine.trace_runner import run_trace
from kvserve.model.config import ModelConfig
from kvserve.sim.cost_models import CostModelError, ReplayCostModel
from kvserve.sim.simulator import Simulator
from kvserve.sim.workloads import WorkloadSpec, generate

TINY = ModelConfig(name="tiny", vocab_size=32000, hidden_size=32, intermediate_size=64,
                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                   max_position_embeddings=1024)
SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=1024)
NUM_BLOCKS = 40  # tight: the run preempts
TRACE = generate(WorkloadSpec(num_requests=16, rate=40.0, prompt_len="uniform:16,160",
                              output_len="uniform:4,32", ignore_eos=True, prefix_groups=2,
                              seed=3))


class SteppingClock:
    """A clock that moves by an irregular amount at every reading, like a real one, but in
    multiples of 1/1024 s so sums are exact."""

    def __init__(self) -> None:
        self.now = 0.0
        self.random = random.Random(5)

    def __call__(self) -> float:
        self.now += self.random.randint(1, 40) / 1024
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def decisions(events) -> list[tuple[str, str]]:
    return [(e["kind"], e["request_id"]) for e in events
            if e["kind"] in ("admitted", "resumed", "preempted", "finished")]


@pytest.fixture(scope="module")
def engine_log() -> str:
    clock = SteppingClock()
    engine = build_engine(TINY, num_kv_blocks=NUM_BLOCKS, record_events=True,
                          detokenize=False, **SETTINGS)
    log = io.StringIO()
    run_trace(engine, TRACE, clock=clock, sleep=clock.sleep, log=log)
    return log.getvalue()


def test_replayed_simulation_makes_the_engines_decisions(engine_log, tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text(engine_log)
    rows = [json.loads(line) for line in engine_log.splitlines()]
    engine_events = [row for row in rows if row["type"] == "event"]
    assert any(e["kind"] == "preempted" for e in engine_events)
    result = Simulator(SchedulerConfig(**SETTINGS), CacheConfig(num_blocks=NUM_BLOCKS),
                       ReplayCostModel.load(path), record_events=True).run(TRACE)
    simulated = [{"kind": e.kind, "request_id": e.request_id} for e in result.events]
    assert decisions(simulated) == decisions(engine_events)
    steps = [row for row in rows if row["type"] == "step"]
    assert list(result.steps.num_scheduled_tokens) == [s["num_scheduled_tokens"] for s in steps]


def test_a_different_configuration_is_caught_as_divergence(engine_log, tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text(engine_log)
    other = SchedulerConfig(**{**SETTINGS, "max_num_batched_tokens": 64})
    with pytest.raises(CostModelError, match="replay diverged at step 0: the engine scheduled"):
        Simulator(other, CacheConfig(num_blocks=NUM_BLOCKS),
                  ReplayCostModel.load(path)).run(TRACE)


def test_a_log_without_steps_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text('{"type": "event", "kind": "arrived"}\n')
    with pytest.raises(CostModelError, match="no step lines"):
        ReplayCostModel.load(path)


def test_a_log_with_starts_on_some_steps_only_is_refused(tmp_path):
    path = tmp_path / "partial.jsonl"
    path.write_text('{"type": "step", "start": 0.0, "duration": 0.1, '
                    '"num_scheduled_tokens": 4}\n'
                    '{"type": "step", "duration": 0.1, "num_scheduled_tokens": 4}\n')
    with pytest.raises(CostModelError, match="1 of 2 steps have a start"):
        ReplayCostModel.load(path)


def test_the_engine_run_reads_as_a_simulation_report():
    """run_trace returns the engine's run as a SimResult, so report.aggregate measures the
    engine with the simulator's definitions; a replay of its step times agrees on every
    count, and on the times to within the clock's ticks (the engine's token time is its
    step's end, the simulator's the next step's start; after an idle wait the engine's
    clock has moved on from the arrival it waited for, the simulator's has not)."""
    from kvserve.sim.report import aggregate

    clock = SteppingClock()
    engine = build_engine(TINY, num_kv_blocks=NUM_BLOCKS, detokenize=False, **SETTINGS)
    log = io.StringIO()
    run = run_trace(engine, TRACE, clock=clock, sleep=clock.sleep, log=log)
    measured = aggregate(run.result)
    path_text = log.getvalue()
    replay = ReplayCostModel([json.loads(line)["duration"] for line in path_text.splitlines()
                              if '"type": "step"' in line],
                             [s.num_scheduled_tokens for s in run.steps])
    simulated = aggregate(Simulator(SchedulerConfig(**SETTINGS),
                                    CacheConfig(num_blocks=NUM_BLOCKS), replay).run(TRACE))
    assert measured["num_preemptions"] > 0
    for key in ("num_requests", "num_finished", "num_steps", "num_preemptions",
                "scheduled_tokens", "recomputed_tokens", "output_tokens", "prompt_tokens"):
        assert measured[key] == simulated[key], key
    tick = 40 / 1024  # the SteppingClock's largest move
    assert measured["duration_s"] == pytest.approx(simulated["duration_s"], abs=4 * tick)
    for key in ("ttft_p50", "ttft_max", "e2e_p50", "e2e_p99", "itl_p50", "queue_p99"):
        assert measured[key] == pytest.approx(simulated[key], abs=4 * tick), key
    assert len(run.result.itl_samples) == measured["output_tokens"] - measured["num_finished"]


class LateClock(SteppingClock):
    """A SteppingClock whose readings lag: the engine decides every step a little after the
    arrival that woke it, as a real loop does (sleep overshoot, submission time)."""

    def __call__(self) -> float:
        self.now += self.random.randint(20, 60) / 1024
        return self.now


DENSE = generate(WorkloadSpec(num_requests=24, rate=60.0, prompt_len="uniform:16,96",
                             output_len="fixed:12", max_tokens=12, ignore_eos=True, seed=11))
SPARSE = generate(WorkloadSpec(num_requests=6, rate=0.2, prompt_len="uniform:16,64",
                               output_len="fixed:6", max_tokens=6, ignore_eos=True, seed=4))


def traced(trace, clock):
    """The engine's run of ``trace`` on ``clock``, and its step log's rows."""
    engine = build_engine(TINY, num_kv_blocks=NUM_BLOCKS, record_events=True,
                          detokenize=False, **SETTINGS)
    log = io.StringIO()
    run = run_trace(engine, trace, clock=clock, sleep=clock.sleep, log=log)
    return run, [json.loads(line) for line in log.getvalue().splitlines()]


def replayed(trace, run, with_starts=True):
    replay = ReplayCostModel([s.duration for s in run.steps],
                             [s.num_scheduled_tokens for s in run.steps],
                             starts=[s.start for s in run.steps] if with_starts else None)
    return Simulator(SchedulerConfig(**SETTINGS), CacheConfig(num_blocks=NUM_BLOCKS), replay,
                     record_events=True).run(trace)


def assert_the_replay_follows(trace, run, rows):
    result = replayed(trace, run)
    simulated = [{"kind": e.kind, "request_id": e.request_id} for e in result.events]
    assert decisions(simulated) == decisions([r for r in rows if r["type"] == "event"])
    assert list(result.steps.time) == pytest.approx([s.start for s in run.steps], abs=1e-9)


def test_a_replay_follows_the_engine_when_arrivals_fall_between_its_clock_and_the_logs():
    """Arrivals denser than the clock's readings land between a step's logged start and
    where a replay would otherwise begin its step (the first arrival, or the end of an idle
    wait): the replay holds each step until the engine's logged start, so it admits what the
    engine admitted and follows it to the end."""
    assert_the_replay_follows(DENSE, *traced(DENSE, LateClock()))


def test_without_the_logged_starts_that_replay_diverges():
    """The same run replayed from durations alone (a log without starts) begins at the first
    arrival rather than at the engine's first step, and parts from it: the case the
    logged starts exist for."""
    run, _ = traced(DENSE, LateClock())
    with pytest.raises(CostModelError, match="replay diverged"):
        replayed(DENSE, run, with_starts=False)


def test_an_idle_wait_is_not_counted_in_the_step_before_it():
    """Requests far apart leave the engine idle between them: each step's logged duration
    ends where the loop found nothing to run (what calibration in service fits), and the
    replay, held to the logged starts, still sees every gap and makes the same decisions."""
    run, rows = traced(SPARSE, SteppingClock())
    busiest = max(step.duration for step in run.steps)
    assert busiest < 0.5  # a few clock readings; the gaps between requests are seconds
    span = run.steps[-1].start - run.steps[0].start
    assert sum(step.duration for step in run.steps[:-1]) < span / 4
    assert_the_replay_follows(SPARSE, run, rows)


def test_a_line_without_ignore_eos_runs_output_len_and_its_eos_on_the_engine():
    """As bench serve --trace sends a line (docs/trace-format.md): output_len tokens and
    the EOS, whatever this model draws. QA: a model that never draws the simulated model's
    EOS ran each line to max_model_len (calibrate --trace on a workload gen trace, minutes)."""
    engine = build_engine(TINY, num_kv_blocks=NUM_BLOCKS, detokenize=False, **SETTINGS)
    trace = generate(WorkloadSpec(num_requests=4, rate=100.0, prompt_len="fixed:16",
                                  output_len="uniform:2,9", seed=4))
    assert not any(r.ignore_eos or r.max_tokens for r in trace)
    clock = SteppingClock()
    run = run_trace(engine, trace, clock=clock, sleep=clock.sleep)
    produced = {r.request_id: r.num_output_tokens for r in run.result.records}
    assert produced == {r.request_id: r.output_len + 1 for r in trace}


def test_a_delete_goes_to_the_turn_that_held_the_session_when_ids_are_reused():  # U8
    """The review: a reused id's ``released`` event went to the id's latest finished
    request, so a DELETE after a session turn ``x`` and a later ordinary request ``x`` was
    put on the ordinary one and dropped: the replay never ended the session."""
    from kvserve.sim.recording import EngineLog, _reused_ids_apart, _session_ends
    from kvserve.sim.trace import TraceRequest

    trace = [TraceRequest("x", 0.0, 4, prompt_len=20, session_id="s"),
             TraceRequest("x", 5.0, 4, prompt_len=20)]
    log = EngineLog(events=[
        {"kind": kind, "request_id": "x", "time": time, "reason": reason}
        for kind, time, reason in (("arrived", 0.0, ""), ("finished", 1.0, "length"),
                                   ("held", 1.0, ""), ("arrived", 5.0, ""),
                                   ("finished", 6.0, "length"), ("released", 7.0, "deleted"))])
    apart = _session_ends(_reused_ids_apart(trace, {0: log}, lambda message: None), {0: log})
    assert [(r.request_id, r.session_end_time) for r in apart] == [("x", 7.0), ("x#2", None)]
