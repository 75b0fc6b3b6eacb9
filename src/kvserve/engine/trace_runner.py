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
loop spends between steps is counted, as the simulator's clock must count it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from kvserve.core import QueueFullError, RequestRejected
from kvserve.engine.engine import CompletionChunk, Engine


@dataclasses.dataclass(frozen=True)
class TracedStep:
    start: float
    duration: float
    num_scheduled_tokens: int
    num_seqs: int
    num_preempted: int


def run_trace(engine: Engine, trace: Sequence[Any], *, seed: int = 0,
              sleep: Callable[[float], None] = time.sleep,
              log: TextIO | None = None) -> tuple[list[TracedStep], list[CompletionChunk]]:
    """Submit each trace request (kvserve.sim.trace.TraceRequest) when its time comes and
    step the engine until everything has finished. Returns the steps and every chunk."""
    clock = engine.clock
    origin = clock()
    engine.clock = lambda: clock() - origin
    try:
        return _run(engine, sorted(trace, key=lambda r: (r.arrival_time, r.request_id)), seed,
                    sleep, log)
    finally:
        engine.clock = clock


def _run(engine: Engine, arrivals: list[Any], seed: int, sleep: Callable[[float], None],
         log: TextIO | None) -> tuple[list[TracedStep], list[CompletionChunk]]:
    max_model_len = engine.scheduler.config.max_model_len
    starts: list[Any] = []  # non-empty steps' StepRecords
    chunks: list[CompletionChunk] = []
    events: list[Any] = []
    next_arrival = 0
    while True:
        now = engine.clock()
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_time <= now:
            request = arrivals[next_arrival]
            with contextlib.suppress(RequestRejected, QueueFullError):  # refused, as in
                engine.add_request(request.request_id,                  # the simulator
                                   request.synthesise_prompt(seed),
                                   request.sampling_params(max_model_len),
                                   arrival_time=request.arrival_time)
            next_arrival += 1
        if engine.has_unfinished_requests():
            chunks += engine.step(now)
            events += engine.scheduler.take_events()
            record = engine.last_step
            if record is not None and record.num_scheduled_tokens:
                starts.append(record)
            continue
        if next_arrival == len(arrivals):
            break
        sleep(max(0.0, arrivals[next_arrival].arrival_time - now))
    steps = [TracedStep(record.start, (starts[i + 1].start if i + 1 < len(starts)
                                       else record.end) - record.start,
                        record.num_scheduled_tokens, record.num_seqs, record.num_preempted)
             for i, record in enumerate(starts)]
    if log is not None:
        write_step_log(log, steps, events + engine.scheduler.take_events())
    return steps, chunks


def write_step_log(log: TextIO, steps: Sequence[TracedStep], events: Sequence[Any]) -> None:
    for index, step in enumerate(steps):
        log.write(json.dumps({"type": "step", "index": index, **dataclasses.asdict(step)})
                  + "\n")
    for event in events:  # in decision order
        log.write(json.dumps({"type": "event", **dataclasses.asdict(event)}) + "\n")
