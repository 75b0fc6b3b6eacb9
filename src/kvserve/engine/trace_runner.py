"""Run a trace through the real engine on its own clock, exactly as the simulator runs it on
a virtual one, and log every step for replay (``kvserve simulate --replay-step-times``).

The loop mirrors the simulator's: add the arrivals whose time has come, step, repeat; when
nothing is left to run, wait for the next arrival. Times are seconds since the run began, so
a trace's ``arrival_time`` means the same thing in both.

Step log (JSONL), one line per non-empty step, then one per scheduling event::

    {"type": "step", "index": 0, "start": 0.0, "duration": 0.041, "num_scheduled_tokens": 812,
     "num_seqs": 3, "num_preempted": 0}
    {"type": "event", "time": 0.0, "kind": "admitted", "request_id": "r1", ...}

``duration`` runs from this step's start to the next non-empty step's start (so the time the
loop spends between steps is counted, as the simulator's clock must count it), or to the
moment the loop found nothing to run and waited for an arrival: the wait is not the step's
cost. ``start`` is the time the step was decided at; a replay holds each step until then
(:class:`kvserve.sim.cost_models.ReplayCostModel`), so it admits what the engine admitted.

The run is also returned as a :class:`kvserve.runs.SimResult`, recorded by the same
:class:`kvserve.runs.RunRecorder` the simulator uses (a token's time is the end of the step
that produced it; refusals, state samples and the result built alike), so
:func:`kvserve.sim.report.aggregate` computes the engine's figures exactly as it computes a
simulation's: the fidelity study compares like with like.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from kvserve.core import Clock, QueueFullError, RequestRejected
from kvserve.engine.engine import CompletionChunk, Engine
from kvserve.runs import RunRecorder, SimResult, StepSeries, rows
from kvserve.sim.executor import BatchView, batch_view


@dataclasses.dataclass(frozen=True)
class TracedStep:
    start: float
    duration: float  # to the next step's start, or to an idle wait: what the clock advances by
    num_scheduled_tokens: int
    num_seqs: int
    num_preempted: int
    shape: BatchView | None = None  # the batch as the cost models see it


@dataclasses.dataclass
class TraceRun:
    """What :func:`run_trace` saw: the non-empty steps, every chunk, and the run as a
    SimResult (``result``) for the simulator's report functions."""

    steps: list[TracedStep]
    chunks: list[CompletionChunk]
    result: SimResult


def run_trace(engine: Engine, trace: Sequence[Any], *, seed: int = 0,
              clock: Clock = time.monotonic, sleep: Callable[[float], None] = time.sleep,
              log: TextIO | None = None, greedy: bool = False) -> TraceRun:
    """Submit each trace request (kvserve.sim.trace.TraceRequest) when its time comes and
    step the engine until everything has finished. Times are read from ``clock`` (and
    ``sleep`` waits on it), counted from the run's start; the engine's own clock is not used.
    ``greedy`` samples at temperature 0 (the shared workloads' setting) instead of the
    trace's default sampling."""
    origin = clock()

    def run_clock() -> float:
        return clock() - origin

    return _run(engine, sorted(trace, key=lambda r: (r.arrival_time, r.request_id)), seed,
                run_clock, sleep, log, greedy)


def _run(engine: Engine, arrivals: list[Any], seed: int, clock: Clock,
         sleep: Callable[[float], None], log: TextIO | None, greedy: bool) -> TraceRun:
    max_model_len = engine.scheduler.config.max_model_len
    recorder = RunRecorder(arrivals)
    series = StepSeries()
    starts: list[Any] = []  # non-empty steps' StepRecords
    idle_from: dict[int, float] = {}  # step index -> when the loop then found nothing to run
    chunks: list[CompletionChunk] = []
    events: list[Any] = []
    next_arrival = 0
    while True:
        now = clock()
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_time <= now:
            _submit(engine, arrivals[next_arrival], seed, max_model_len, greedy, recorder)
            next_arrival += 1
        if engine.has_unfinished_requests():
            record = engine.step(now, clock=clock)
            chunks += record.chunks
            events += engine.scheduler.take_events()
            recorder.collect(rows(record.chunks), record.end)
            if record.num_scheduled_tokens:
                starts.append(record)
                series.sample_state(engine.scheduler)
            continue
        if next_arrival == len(arrivals):
            break
        if starts:
            idle_from.setdefault(len(starts) - 1, now)
        sleep(max(0.0, arrivals[next_arrival].arrival_time - now))
    steps = [TracedStep(record.start,
                        idle_from.get(i, starts[i + 1].start if i + 1 < len(starts)
                                      else record.end) - record.start,
                        record.num_scheduled_tokens, record.num_seqs, record.num_preempted,
                        batch_view(record.scheduler_output, record.num_sampled))
             for i, record in enumerate(starts)]
    for step in steps:
        series.time.append(step.start)
        series.duration.append(step.duration)
        series.num_scheduled_tokens.append(step.num_scheduled_tokens)
    events += engine.scheduler.take_events()
    if log is not None:
        write_step_log(log, steps, events)
    start = arrivals[0].arrival_time if arrivals else 0.0
    end = starts[-1].end if starts else start
    result = recorder.result(arrivals, start, end, series, engine.scheduler.stats(), events,
                             end - start,
                             preemption_mode=engine.scheduler.config.preemption_mode)
    return TraceRun(steps, chunks, result)


def _submit(engine: Engine, request: Any, seed: int, max_model_len: int, greedy: bool,
            recorder: RunRecorder) -> None:
    params = request.sampling_params(max_model_len)
    if not request.ignore_eos:
        # output_len tokens and the EOS, whatever this model answers, as bench serve --trace
        # sends a line (docs/trace-format.md): the model rarely draws the simulated model's
        # EOS, so a line without max_tokens ran to the model length (QA: calibrate --trace
        # on a workload gen trace ran for minutes)
        params = dataclasses.replace(params, ignore_eos=True, max_tokens=min(
            params.max_tokens or max_model_len, request.output_len + 1))
    if greedy:
        params = dataclasses.replace(params, temperature=0.0)
    try:
        engine.add_request(request.request_id, request.synthesise_prompt(seed), params,
                           arrival_time=request.arrival_time)
    except (RequestRejected, QueueFullError) as error:  # refused, as in the simulator
        recorder.refuse(request.request_id, error)


def write_step_log(log: TextIO, steps: Sequence[TracedStep], events: Sequence[Any]) -> None:
    for index, step in enumerate(steps):
        log.write(json.dumps({"type": "step", "index": index, **dataclasses.asdict(step)})
                  + "\n")
    for event in events:  # in decision order
        log.write(json.dumps({"type": "event", **dataclasses.asdict(event)}) + "\n")
