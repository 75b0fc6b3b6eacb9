"""Queue deadlines (spec K4): when each waiting request stops being worth starting."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from kvserve.core.request import Request

_COMPACT_SLACK = 64  # entries beyond twice the live requests' that start a compaction


class QueueDeadlines:
    """A heap of (deadline, arrival order, request). A request scheduled or finished in the
    meantime is skipped by the caller when its entry expires; the entries of such requests
    are dropped together once they outnumber the live requests (``compact``), so a deadline
    of a day does not keep a day's requests (QA), and an expired entry names the request
    itself, never a later one that took its id (QA: that one was timed out)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._order = itertools.count()

    def add(self, request: Request, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), request))

    def expired(self, now: float) -> list[Request]:
        """The requests whose deadline is before ``now``, earliest first, removed."""
        heap = self._heap
        requests = []
        while heap and heap[0][0] < now:
            requests.append(heapq.heappop(heap)[2])
        return requests

    def compact(self, waits: Callable[[Request], bool], num_live: int) -> None:
        """Drop the entries of requests that no longer wait (``waits`` false), once there
        are more than twice the ``num_live`` requests' entries: amortised O(1) a call."""
        if len(self._heap) <= 2 * num_live + _COMPACT_SLACK:
            return
        self._heap = [entry for entry in self._heap if waits(entry[2])]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)
