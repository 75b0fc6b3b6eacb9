"""What a run of a trace leaves behind, in one shape whether the simulator ran it on a
virtual clock or the engine on a real one (``kvserve.engine.trace_runner``): per-request
records, ITL samples, the per-step series and the :class:`SimResult` the report functions
read. Both runners import this module; neither reaches into the other. Standard library and
the core only.

The definitions, shared so the fidelity study compares like with like:

- a token's time is the end of the step that produced it; a gap between two tokens of one
  request is one ITL sample (``itl_samples``; ``itl_sum``/``itl_max`` per request);
- a request the scheduler refuses at arrival ends ``rejected`` (RequestRejected) or
  ``queue_full`` (QueueFullError), its ``stop_reason`` the error's message;
- after each non-empty step the series samples the running and waiting counts (waiting
  includes arrivals a batching mode holds back) and the KV usage.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.core import (
    QueueFullError,
    RequestMetrics,
    RequestRejected,
    Scheduler,
    SchedulerEvent,
    SchedulerStats,
)

# (request_id, new_token_ids, finished, finish_reason, stop_reason, metrics): the order of
# a RequestOutput's fields, which the simulator unpacks as they come.
OutputRow = tuple[str, Sequence[int], bool, "str | None", "int | str | None",
                  "RequestMetrics | None"]


class Arrival(Protocol):
    """A trace request as far as the records need it (kvserve.sim.trace.TraceRequest)."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    deadline: float | None
    tenant: str


@dataclass(slots=True)
class RequestRecord:
    """One request's life in a run: a report row and a timeline bar."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    finish_reason: str = "unfinished"
    stop_reason: str | None = None
    metrics: RequestMetrics | None = None
    num_output_tokens: int = 0
    itl_max: float = 0.0
    itl_sum: float = 0.0
    last_token_time: float | None = None
    # (preempted, resumed or finished) spans: time out of the running set after a preemption.
    # Not a stall: a stall (RequestMetrics.longest_stall) runs on to the next token.
    preempted_spans: list[tuple[float, float]] = field(default_factory=list)
    deadline: float | None = None
    tenant: str = ""


@dataclass
class StepSeries:
    """Per step: start time, duration and the scheduler's state after the step."""

    time: array = field(default_factory=lambda: array("d"))
    duration: array = field(default_factory=lambda: array("d"))
    num_scheduled_tokens: array = field(default_factory=lambda: array("l"))
    num_running: array = field(default_factory=lambda: array("l"))
    num_waiting: array = field(default_factory=lambda: array("l"))
    kv_usage: array = field(default_factory=lambda: array("d"))

    def sample_state(self, scheduler: Scheduler, num_held: int = 0) -> None:
        """The scheduler's state after a step; swapped-out requests and ``num_held``
        arrivals not yet handed over count as waiting."""
        self.num_running.append(len(scheduler.running))
        self.num_waiting.append(len(scheduler.waiting) + len(scheduler.swapped) + num_held
                                + len(scheduler.held_waiting))
        self.kv_usage.append(scheduler.kv.usage())


@dataclass
class SimResult:
    start_time: float
    end_time: float
    records: list[RequestRecord]
    steps: StepSeries
    itl_samples: array
    num_preemptions: int
    num_scheduled_tokens: int
    num_recomputed_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_blocked_steps: dict[str, int]
    events: list[SchedulerEvent]
    wall_seconds: float
    # The host tier (K3): what was copied, and how each preemption went.
    preemption_mode: str = "recompute"
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    bytes_per_block: int = 0
    num_preemptions_by_mode: dict[str, int] = field(default_factory=dict)
    # Sessions (docs/scheduler.md, U): their counters when they are on, else empty.
    sessions: dict[str, Any] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.steps.time)


def refusal_reason(error: Exception) -> str | None:
    """The finish reason of a request refused at arrival with ``error``; None if ``error``
    is not a refusal."""
    if isinstance(error, RequestRejected):
        return "rejected"
    if isinstance(error, QueueFullError):
        return "queue_full"
    return None


class RunRecorder:
    """The records of one run's requests and its ITL samples."""

    def __init__(self, arrivals: Iterable[Arrival]) -> None:
        self.records = {r.request_id: RequestRecord(r.request_id,
                                                    getattr(r, "received", r.arrival_time),
                                                    r.num_prompt_tokens, deadline=r.deadline,
                                                    tenant=r.tenant)
                        for r in arrivals}
        self.itl = array("d")

    def collect(self, outputs: Iterable[OutputRow], now: float) -> list[str]:
        """Record one step's outputs, produced at ``now``; the ids that finished."""
        records, append_itl = self.records, self.itl.append
        finished_ids: list[str] = []
        # Unpacked rather than read field by field: one output per running request per step.
        for request_id, new_token_ids, finished, finish_reason, stop, metrics in outputs:
            record = records[request_id]
            if new_token_ids:
                last = record.last_token_time
                if last is not None:
                    gap = now - last
                    append_itl(gap)
                    record.itl_sum += gap
                    if gap > record.itl_max:
                        record.itl_max = gap
                record.last_token_time = now
                record.num_output_tokens += len(new_token_ids)
            if finished:
                self.finish(request_id, finish_reason or "error",
                            None if stop is None else str(stop), metrics)
                finished_ids.append(request_id)
        return finished_ids

    def finish(self, request_id: str, reason: str, stop_reason: str | None,
               metrics: RequestMetrics | None = None) -> None:
        record = self.records[request_id]
        record.finish_reason, record.stop_reason, record.metrics = reason, stop_reason, metrics

    def refuse(self, request_id: str, error: Exception) -> None:
        """A refusal at arrival (``refusal_reason(error)`` must not be None)."""
        reason = refusal_reason(error)
        assert reason is not None, error
        self.finish(request_id, reason, str(error))

    def result(self, arrivals: Sequence[Arrival], start: float, end: float,
               steps: StepSeries, stats: SchedulerStats, events: list[SchedulerEvent],
               wall_seconds: float, *, preemption_mode: str = "recompute",
               bytes_per_block: int = 0, sessions_on: bool = False) -> SimResult:
        """The run as the report functions read it, records in ``arrivals``' order;
        ``bytes_per_block`` prices the host tier's copies (0: not priced)."""
        return SimResult(
            start_time=start, end_time=end,
            records=[self.records[r.request_id] for r in arrivals], steps=steps,
            itl_samples=self.itl, num_preemptions=stats.num_preemptions,
            num_scheduled_tokens=stats.num_scheduled_tokens,
            num_recomputed_tokens=stats.num_recomputed_tokens,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_blocked_steps=stats.num_blocked_steps, events=events,
            wall_seconds=wall_seconds, preemption_mode=preemption_mode,
            num_swapped_out_blocks=stats.num_swapped_out_blocks,
            num_swapped_in_blocks=stats.num_swapped_in_blocks, bytes_per_block=bytes_per_block,
            num_preemptions_by_mode=stats.num_preemptions_by_mode,
            sessions=session_figures(stats) if sessions_on else {})


def session_figures(stats: SchedulerStats) -> dict[str, Any]:
    """What sessions did (U1-U8): turns admitted on held KV, the prompt tokens they did not
    prefill again, the holds left at the end and the releases by reason."""
    return {"session_hits": stats.num_session_hits,
            "session_hit_tokens": stats.num_session_hit_tokens,
            "sessions_held_at_end": stats.num_sessions_held,
            "session_releases": dict(sorted(stats.session_releases.items()))}


def rows(chunks: Iterable[Any]) -> list[OutputRow]:
    """Engine chunks (request_id, new_token_ids, finished, finish_reason, stop_reason,
    metrics attributes) as output rows."""
    return [(c.request_id, c.new_token_ids, c.finished, c.finish_reason, c.stop_reason,
             c.metrics) for c in chunks]
