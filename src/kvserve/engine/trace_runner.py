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

The run is also returned as a :class:`kvserve.sim.simulator.SimResult`, built with the
simulator's own definitions (a token's time is the end of the step that produced it), so
:func:`kvserve.sim.report.aggregate` computes the engine's figures exactly as it computes a
simulation's: the fidelity study compares like with like.
"""

from __future__ import annotations

import dataclasses
import json
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from kvserve.core import Clock, QueueFullError, RequestRejected
from kvserve.engine.engine import CompletionChunk, Engine
from kvserve.sim.executor import BatchView, batch_view
from kvserve.sim.simulator import RequestRecord, SimResult, StepSeries


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


class _Recorder:
    """Per-request records and ITL samples, with the simulator's definitions."""

    def __init__(self, arrivals: Sequence[Any]) -> None:
        self.records = {r.request_id: RequestRecord(r.request_id, r.arrival_time,
                                                     r.num_prompt_tokens, tenant=r.tenant)
                        for r in arrivals}
        self.itl = array("d")

    def refused(self, request_id: str, reason: str, message: str) -> None:
        record = self.records[request_id]
        record.finish_reason, record.stop_reason = reason, message

    def collect(self, chunks: Sequence[CompletionChunk], now: float) -> None:
        for chunk in chunks:
            record = self.records[chunk.request_id]
            if chunk.new_token_ids:
                if record.last_token_time is not None:
                    gap = now - record.last_token_time
                    self.itl.append(gap)
                    record.itl_sum += gap
                    record.itl_max = max(record.itl_max, gap)
                record.last_token_time = now
                record.num_output_tokens += len(chunk.new_token_ids)
            if chunk.finished:
                record.finish_reason = chunk.finish_reason or "error"
                record.stop_reason = None if chunk.stop_reason is None else str(chunk.stop_reason)
                record.metrics = chunk.metrics


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
    recorder = _Recorder(arrivals)
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
            recorder.collect(record.chunks, record.end)
            if record.num_scheduled_tokens:
                starts.append(record)
                _append_state(series, engine)
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
    stats = engine.scheduler.stats()
    result = SimResult(
        start_time=start, end_time=end,
        records=[recorder.records[r.request_id] for r in arrivals], steps=series,
        itl_samples=recorder.itl, num_preemptions=stats.num_preemptions,
        num_scheduled_tokens=stats.num_scheduled_tokens,
        num_recomputed_tokens=stats.num_recomputed_tokens,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_blocked_steps=stats.num_blocked_steps, events=events, wall_seconds=end - start)
    return TraceRun(steps, chunks, result)


def _submit(engine: Engine, request: Any, seed: int, max_model_len: int, greedy: bool,
            recorder: _Recorder) -> None:
    params = request.sampling_params(max_model_len)
    if greedy:
        params = dataclasses.replace(params, temperature=0.0)
    try:
        engine.add_request(request.request_id, request.synthesise_prompt(seed), params,
                           arrival_time=request.arrival_time)
    except RequestRejected as error:  # refused, as in the simulator
        recorder.refused(request.request_id, "rejected", str(error))
    except QueueFullError as error:
        recorder.refused(request.request_id, "queue_full", str(error))


def _append_state(series: StepSeries, engine: Engine) -> None:
    """The scheduler's state after a step, as the simulator records it."""
    scheduler = engine.scheduler
    series.num_running.append(len(scheduler.running))
    series.num_waiting.append(len(scheduler.waiting))
    series.kv_usage.append(scheduler.kv.usage())


def write_step_log(log: TextIO, steps: Sequence[TracedStep], events: Sequence[Any]) -> None:
    for index, step in enumerate(steps):
        log.write(json.dumps({"type": "step", "index": index, **dataclasses.asdict(step)})
                  + "\n")
    for event in events:  # in decision order
        log.write(json.dumps({"type": "event", **dataclasses.asdict(event)}) + "\n")
