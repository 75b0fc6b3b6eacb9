"""Waiting queues: FCFS, priority and tenant fair share (VTC) behind one interface (spec
C1-C3, T1-T7).

Each keeps a running total of the tokens it holds and of its requests per tenant, so the K4
queue limits cost O(1). A waiting request's token count never changes while it waits (only
running requests grow).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from kvserve.core.config import SchedulerConfig
from kvserve.core.request import Request


class WaitingQueue(ABC):
    """push / push_front / pop / peek / remove / len / iter, in scheduling order."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.num_by_tenant: dict[str, int] = {}  # waiting requests of each tenant

    def _added(self, request: Request) -> None:
        self.num_tokens += request.num_tokens
        tenant = request.sampling_params.tenant
        self.num_by_tenant[tenant] = self.num_by_tenant.get(tenant, 0) + 1

    def _removed(self, request: Request) -> None:
        self.num_tokens -= request.num_tokens
        tenant = request.sampling_params.tenant
        left = self.num_by_tenant[tenant] - 1
        if left:
            self.num_by_tenant[tenant] = left
        else:
            del self.num_by_tenant[tenant]

    def record_step(self, running: list[Request], num_scheduled: dict[str, int]) -> None:
        """Told after every schedule() what ran: a fair-share order charges the service
        (T3); the others ignore it."""
        return None

    @abstractmethod
    def push(self, request: Request) -> None: ...

    @abstractmethod
    def push_front(self, request: Request) -> None:
        """Return a preempted request to the queue (C2, C3)."""

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be popped."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(WaitingQueue):
    def __init__(self) -> None:
        super().__init__()
        self._requests: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._requests.append(request)
        self._added(request)

    def push_front(self, request: Request) -> None:
        # Victims are preempted newest-first, so pushing each to the head keeps their FIFO
        # order: the last one preempted (the earliest admitted) ends up first (C2).
        self._requests.appendleft(request)
        self._added(request)

    def pop(self) -> Request:
        request = self._requests.popleft()
        self._removed(request)
        return request

    def peek(self) -> Request:
        return self._requests[0]

    def remove(self, request: Request) -> None:
        self._requests.remove(request)
        self._removed(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


class PriorityQueue(WaitingQueue):
    """A binary heap on (priority, arrival_time, request_id): there is no front (C3)."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[tuple[int, float, str], Request]] = []

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort_key(), request))
        self._added(request)

    def push_front(self, request: Request) -> None:
        self.push(request)

    def pop(self) -> Request:
        _, request = heapq.heappop(self._heap)
        self._removed(request)
        return request

    def peek(self) -> Request:
        return self._heap[0][1]

    def remove(self, request: Request) -> None:
        index = next((i for i, (_, queued) in enumerate(self._heap) if queued is request), -1)
        if index < 0:
            raise ValueError(f"request {request.request_id} is not in the waiting queue")
        last = self._heap.pop()
        if index < len(self._heap):
            self._heap[index] = last
            heapq.heapify(self._heap)
        self._removed(request)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in sorted(self._heap, key=lambda entry: entry[0]))


def make_waiting_queue(policy: str, config: SchedulerConfig | None = None) -> WaitingQueue:
    """The waiting queue of ``policy`` (fcfs or priority); with ``config.tenant_fairness``
    "vtc", tenants' fair share within each priority level (T1)."""
    if policy not in ("fcfs", "priority"):
        raise ValueError(f"unknown scheduling policy {policy!r}; expected fcfs or priority")
    if config is not None and config.tenant_fairness == "vtc":
        from kvserve.core.fairness import TenantFairQueue

        return TenantFairQueue(policy, config)
    return FCFSQueue() if policy == "fcfs" else PriorityQueue()
