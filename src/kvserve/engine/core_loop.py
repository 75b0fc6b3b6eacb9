"""EngineCore: the engine's side of serving, whichever thread or process runs it.

Between steps it applies the adds and aborts it was sent (an add of several requests is all or
nothing); each step it reports what ran (a :class:`StepReport`); each time it falls idle it
checks the scheduler's invariants. :class:`~kvserve.engine.async_engine.AsyncEngine` runs one
on a thread of the server's process, :mod:`kvserve.engine.engine_process` in a process of its
own. Everything it returns is plain data that pickles.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.core import (
    InvariantError,
    SamplingParams,
    SchedulerEvent,
    SchedulerStats,
    check_invariants,
)
from kvserve.core.sessions import SessionNotFound
from kvserve.engine.engine import CompletionChunk, Engine, Prompt
from kvserve.sim.executor import BatchView, batch_view

logger = logging.getLogger("kvserve.engine")

ABORTED = "aborted"  # stop_reason of a request aborted from outside (client, operator)

AddItem = tuple[str, Prompt, SamplingParams, float | None]  # id, prompt, params, arrival


@dataclass(frozen=True)
class StepReport:
    """What one engine step did, handed to observers (metrics, logs). Aborts applied between
    steps are reported too, with no tokens and no events."""

    time: float  # the step's start on the engine's clock (time + seconds: its end)
    num_scheduled_tokens: int
    seconds: float
    chunks: list[CompletionChunk]
    events: list[SchedulerEvent]
    stats: SchedulerStats
    engine: int = 0  # the replica that ran it (data parallel), as vLLM's engine="i" label
    # Requests the engine took since its last report, each with the time it took it (the
    # moment its scheduler first saw it: a recording's arrival time, docs/recording.md).
    arrivals: tuple[tuple[str, float], ...] = ()
    shape: BatchView | None = None  # the batch as the cost models see it (steps only)
    # The chunks as the engine made them, where the server's process cut some short (a stop
    # string it matched: engine_process.py); ``chunks`` are then what the clients got. A
    # recording keeps these: its replay redoes the engine's work, token for token.
    engine_chunks: list[CompletionChunk] | None = None


class EngineCore:
    """One :class:`Engine` driven between commands. Not thread-safe: one owner calls it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stats: SchedulerStats = engine.scheduler.stats()
        # The scheduler's invariants (I1-I4: no leaked or doubly held block, ...) are checked
        # each time the engine falls idle, where they are cheapest; a failure is logged and
        # counted (kvserve:invariant_violations), not raised, so serving goes on.
        self.idle_checks = self.invariant_violations = 0
        self._checked_since_busy = True
        self._arrivals: list[tuple[str, float]] = []

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def add(self, items: Sequence[AddItem]) -> Exception | None:
        """Queue every item or none; the error of the first that failed (the others are
        undone), or None."""
        added: list[str] = []
        try:
            for request_id, prompt, params, arrival_time in items:
                self.engine.add_request(request_id, prompt, params, arrival_time)
                added.append(request_id)
        except Exception as error:
            for request_id in added:
                self.engine.abort(request_id)
            self.engine.scheduler.withdraw_events(added)  # never taken: in no log either
            return error
        finally:
            self.stats = self.engine.scheduler.stats()  # an add the caller saw is in the stats
        now = time.monotonic()
        self._arrivals += [(request_id, now) for request_id in added]
        return None

    def _take_arrivals(self) -> tuple[tuple[str, float], ...]:
        arrivals = tuple(self._arrivals)
        self._arrivals.clear()
        return arrivals

    def abort(self, request_ids: Sequence[str]) -> StepReport | None:
        """Abort requests in any state; a report with one ``abort`` chunk per request that was
        live, or None if none was."""
        chunks = []
        for request_id in request_ids:
            metrics = self.engine.abort(request_id)  # its queue time, preemptions, ...
            if metrics is not None:
                chunks.append(CompletionChunk(request_id, [], "", True, "abort", ABORTED,
                                              metrics))
        if not chunks:
            return None
        self.stats = self.engine.scheduler.stats()
        return StepReport(time.monotonic(), 0, 0.0, chunks, [], self.stats,
                          arrivals=self._take_arrivals())

    def finish_stopped(self, items: Sequence[tuple[str, str]]) -> StepReport | None:
        """Finish requests whose text reached a stop string, as (request id, stop string)
        pairs matched by the server's process: a report with one ``stop`` chunk (with the
        request's metrics) per request still live, or None if none was."""
        chunks = []
        for request_id, stop in items:
            metrics = self.engine.finish_stopped(request_id, stop)
            if metrics is not None:
                chunks.append(CompletionChunk(request_id, [], "", True, "stop", stop, metrics))
        if not chunks:
            return None
        self.stats = self.engine.scheduler.stats()
        return StepReport(time.monotonic(), 0, 0.0, chunks, [], self.stats)

    def release_session(self, session_id: str, tenant: str | None
                        ) -> tuple[Exception | None, StepReport | None]:
        """End a session (U8): None, or SessionNotFound when none of that id is live; and a
        report (no tokens: the release events and the stats) when one ended, as the idle
        engine's ttl expiry makes (the record -> replay pass: with no step after it, a
        recording never logged the release)."""
        scheduler = self.engine.scheduler
        if not scheduler.release_session(session_id, tenant, now=self.engine.clock()):
            return SessionNotFound(f"no session {session_id!r} is live"
                                   + (" for your tenant" if tenant is not None else "")), None
        self.stats = scheduler.stats()
        return None, StepReport(time.monotonic(), 0, 0.0, [], scheduler.take_events(),
                                self.stats, arrivals=self._take_arrivals())

    def step(self) -> StepReport:
        record = self.engine.step()
        chunks, num_tokens = record.chunks, record.num_scheduled_tokens
        seconds = record.end - record.start
        events = self.engine.scheduler.take_events()
        self.stats = self.engine.scheduler.stats()
        self._checked_since_busy = False
        shape = batch_view(record.scheduler_output, record.num_sampled) \
            if num_tokens and record.scheduler_output is not None else None
        # the step's own times, so time + seconds is when its requests finished (the engine
        # process ends a request a stop string ended then)
        return StepReport(record.start, num_tokens, seconds, chunks, events, self.stats,
                          arrivals=self._take_arrivals(), shape=shape)

    def idle(self) -> StepReport | None:
        """The engine has nothing to do: release the sessions whose ttl ran out (U6; a step
        does it otherwise, so an idle server held them, its KV usage never back to 0), and
        check its state once per busy spell. A report (no tokens: the release events and
        the stats) when sessions were released, else None."""
        scheduler = self.engine.scheduler
        report = None
        if scheduler.expire_sessions(self.engine.clock()):
            self.stats = scheduler.stats()
            report = StepReport(time.monotonic(), 0, 0.0, [], scheduler.take_events(),
                                self.stats)
        if not self._checked_since_busy:
            self._checked_since_busy = True
            self.idle_checks += 1
            try:
                check_invariants(self.engine.scheduler)
            except InvariantError as error:
                self.invariant_violations += 1
                logger.error("scheduler state check failed with the engine idle: %s", error)
        self.stats = self.engine.scheduler.stats()
        return report


def stalled(report: StepReport) -> bool:
    """Nothing could run (every waiting request blocked): the loop should wait for an arrival
    or an abort instead of spinning; queue deadlines are checked again after the wait."""
    return report.num_scheduled_tokens == 0 and not report.chunks
