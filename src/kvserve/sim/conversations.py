"""Closed-loop conversation turns in a simulated trace (docs/scheduler.md, U).

A chat client sends its next message only after it has read the answer. A trace turn that
names a session (``session_id``) is therefore sent no earlier than the previous turn of that
session (same tenant) finished: one arriving before that waits here and arrives the moment
the previous turn ends (its ``arrival_time`` moves there, and its TTFT counts from there).
This holds whether sessions are on or off, so the two runs of one trace compare the same
client behaviour. Traces without session ids never build a gate.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Container, Sequence
from typing import Any

from kvserve.sim.trace import TraceRequest

_Key = tuple[str, str]  # (tenant, session id)


class ConversationGate:
    def __init__(self) -> None:
        self._in_flight: dict[_Key, str] = {}  # session -> request id of its live turn
        self._turn_key: dict[str, _Key] = {}  # request id of a live turn -> its session
        self._deferred: dict[_Key, deque[TraceRequest]] = {}
        self._ready: list[_Key] = []  # sessions whose live turn just ended
        self.num_deferred = 0

    @staticmethod
    def for_trace(trace: Sequence[TraceRequest]) -> ConversationGate | None:
        return ConversationGate() if any(r.session_id is not None for r in trace) else None

    def admit(self, arrival: TraceRequest) -> bool:
        """True if ``arrival`` may arrive now; False: it waits for its session's live turn."""
        if arrival.session_id is None:
            return True
        key = (arrival.tenant, arrival.session_id)
        if key in self._in_flight or key in self._deferred:  # behind the turns before it
            self._deferred.setdefault(key, deque()).append(arrival)
            self.num_deferred += 1
            return False
        self._start(key, arrival.request_id)
        return True

    def _start(self, key: _Key, request_id: str) -> None:
        self._in_flight[key] = request_id
        self._turn_key[request_id] = key

    @property
    def has_ready(self) -> bool:
        """Deferred turns may arrive now (their previous turn ended): the loop must take them
        before it waits for the next event."""
        return bool(self._ready)

    def ended(self, request_id: str) -> None:
        """A turn finished (or was refused or cancelled): its session's next turn may come."""
        key = self._turn_key.pop(request_id, None)
        if key is not None:
            del self._in_flight[key]
            if key in self._deferred:
                self._ready.append(key)

    def ready(self, now: float) -> list[TraceRequest]:
        """Deferred turns that may arrive now, their arrival moved to ``now``."""
        out = []
        ready, self._ready = self._ready, []
        for key in ready:
            queue = self._deferred[key]
            turn = queue.popleft()
            if not queue:
                del self._deferred[key]
            if now > turn.arrival_time:  # sent now: a recorded receipt time is moot
                turn = dataclasses.replace(turn, arrival_time=now, received_time=None)
            self._start(key, turn.request_id)
            out.append(turn)
        return out


class SessionEnds:
    """The trace's session ends (``session_end_time``, U8: a client's ``DELETE
    /v1/sessions/{id}`` after a turn) in time order, handed out as they come due, each no
    earlier than its turn arrived in this run. One simulator's loop and a cluster's share
    it."""

    def __init__(self, arrivals: Sequence[TraceRequest]) -> None:
        self._ends = sorted((r.session_end_time, r.tenant, r.session_id, r.request_id)
                            for r in arrivals
                            if r.session_end_time is not None and r.session_id is not None)
        self._next = 0
        self._early: list[tuple[str, str, str]] = []  # due before their turn arrived

    @property
    def next_time(self) -> float | None:
        """When the next one comes (None: none is left; one waiting for its turn comes at
        the first due check after the turn arrived, an event of its own)."""
        return self._ends[self._next][0] if self._next < len(self._ends) else None

    def due(self, now: float, arrived: Callable[[str], bool]) -> list[tuple[float, str, str]]:
        """Those due by ``now`` (time, tenant, session id), in time order: one whose turn
        has not ``arrived`` in this run (a closed-loop gate holds it back in a slower run)
        waits for it and then comes at ``now`` (the review: it ended the turn before, and
        the recorded turn was then held on)."""
        out, early = [], []
        for tenant, session, turn in self._early:
            if arrived(turn):
                out.append((now, tenant, session))
            else:
                early.append((tenant, session, turn))
        while self._next < len(self._ends) and self._ends[self._next][0] <= now:
            when, tenant, session, turn = self._ends[self._next]
            self._next += 1
            if arrived(turn):
                out.append((when, tenant, session))  # type: ignore[arg-type]
            else:
                early.append((tenant, session, turn))  # type: ignore[arg-type]
        self._early = early
        return sorted(out)


def take_due(arrivals: Sequence[TraceRequest], next_arrival: int, now: float,
             gate: ConversationGate | None, gone: Container[str], records: dict[str, Any],
             take: Callable[[TraceRequest], None]) -> int:
    """Hand ``take`` the turns ``gate`` lets arrive at ``now`` (their records' arrival moved
    there) and then the arrivals due by ``now`` from index ``next_arrival`` that may come
    (not ``gone``: cancelled before they came; not waiting for their session's live turn);
    the index of the next arrival not yet due. One simulator's loop and a cluster's share it."""
    # Turns whose previous turn just ended arrive now, until none is left: one cancelled
    # while it waited (or refused by ``take``) lets its session's next turn come at once.
    while gate is not None and gate.has_ready:
        for turn in gate.ready(now):
            if turn.request_id in gone:
                gate.ended(turn.request_id)
                continue
            records[turn.request_id].arrival_time = turn.arrival_time
            take(turn)
    while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_time <= now:
        arrival = arrivals[next_arrival]
        if arrival.request_id not in gone and (gate is None or gate.admit(arrival)):
            take(arrival)
        next_arrival += 1
    return next_arrival
