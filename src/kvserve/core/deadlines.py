"""Queue deadlines (spec K4): when each waiting request stops being worth starting."""

from __future__ import annotations

import heapq


class QueueDeadlines:
    """A heap of (deadline, request id). Entries are never removed early: a request that was
    scheduled or finished in the meantime is skipped by the caller when its entry expires."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []

    def add(self, request_id: str, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, request_id))

    def expired(self, now: float) -> list[str]:
        """Ids whose deadline is before ``now``, earliest first, removed from the heap."""
        heap = self._heap
        ids = []
        while heap and heap[0][0] < now:
            ids.append(heapq.heappop(heap)[1])
        return ids

    def __len__(self) -> int:
        return len(self._heap)
