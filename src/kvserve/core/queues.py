"""Waiting queues: FCFS, priority, the cache-aware orders (lpm, dfs-weight) and tenant fair
share (VTC) behind one interface (spec C1-C7, T1-T7).

Each keeps a running total of the tokens it holds and of its requests per tenant, so the K4
queue limits cost O(1). A waiting request's token count never changes while it waits (only
running requests grow).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from kvserve.core.config import (
    CACHE_AWARE_POLICIES,
    DEFAULT_LPM_MAX_QUEUE,
    SCHEDULING_POLICIES,
    SchedulerConfig,
)
from kvserve.core.prefix_cache import BlockHash
from kvserve.core.request import Request


class PrefixView(Protocol):
    """What a cache-aware order may ask of the KV cache: a read-only query (C4)."""

    def cached_prefix_hashes(self, request: Request) -> list[BlockHash]: ...


class WaitingQueue(ABC):
    """push / push_front / pop / peek / remove / len / iter, in scheduling order.

    The scheduler pushes requests it has taken (``Scheduler.add_request``): their
    ``sampling_params.max_tokens`` is a number by then (None became what the context leaves)
    and their block hashes may be read from the prefix cache's ``start_pass`` view. A
    request comes back by ``push_front`` when it was preempted, or set aside by the waiting
    pass while not ready (L2); ``pop`` is the admission.
    """

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

    def forget_idle(self, live_tenants: Callable[[], set[str]]) -> None:
        """Told after every schedule(), with the tenants of the scheduler's live requests:
        a fair-share order forgets accounts no order can read again; the others keep none."""
        return None

    def charge_admission(self, request: Request) -> None:
        """Told when a request admitted from elsewhere (a held session turn) starts: a
        fair-share order charges it as one it popped (T8); the others ignore it."""
        return None

    def arrived_elsewhere(self, request: Request) -> None:
        """Told when a new request waits elsewhere (a held session turn, L1) whose tenant
        has nothing waiting: a fair-share order lifts the tenant as for one pushed here
        (T2); the others ignore it."""
        return None

    def served_less(self, tenant: str, than: str) -> bool:
        """Whether this order owes ``tenant`` service before ``than`` (T8): only a fair-share
        order keeps the account."""
        return False

    def start_pass(self, cache: PrefixView, now: float) -> list[Request]:
        """Told before every waiting pass: an order that depends on the prefix cache or on
        the clock sorts itself here (C4-C7); the others ignore it. Returns the requests that
        aging lifted for the first time on this pass (C7), for the event log."""
        return []

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

    def unordered(self) -> Iterator[Request]:
        """Every request, in no promised order: for a reader that orders them its own way
        or not at all, without paying for this queue's order."""
        return iter(self)

    def least_urgent(self) -> Iterator[Request]:
        """Every request, least urgent first: the largest priority value, then the latest
        arrival, then the id (K5's order of victims), lazily."""
        keyed = [(_displacement_key(request), request) for request in self.unordered()]
        heapq.heapify(keyed)
        while keyed:
            yield heapq.heappop(keyed)[1]

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
    """A binary heap on (priority, arrival_time, request_id): there is no front (C3).

    A removal empties its entry where it stands (the request is forgotten at once); empty
    entries are skipped as they reach the top and dropped together once they are as many as
    the queue, so a removal costs O(1), not a search and a re-heapify of the whole heap (QA:
    a queue timing out k of its n requests paid O(k n)). A second heap holds the same
    entries least urgent first, for K5's victims (QA: two sorts of the whole queue on each
    arrival into a full one).
    """

    def __init__(self) -> None:
        super().__init__()
        # [sort key, push count, request or None once gone]: the count parts a request's
        # emptied entry from its entry pushed again (preempted), whose key is the same
        self._heap: list[list[Any]] = []
        self._pushes = itertools.count()
        self._entries: dict[str, list[Any]] = {}  # request id -> its live entry
        # the same entries least urgent first: built at K5's first call (a queue limit under
        # priority), kept from then on; None until then, so a push costs one heap only
        self._reversed: list[tuple[tuple[int, float, str], list[Any]]] | None = None

    def push(self, request: Request) -> None:
        entry = [request.sort_key(), next(self._pushes), request]
        heapq.heappush(self._heap, entry)
        if self._reversed is not None:
            heapq.heappush(self._reversed, (_displacement_key(request), entry))
        self._entries[request.request_id] = entry
        self._added(request)

    def push_front(self, request: Request) -> None:
        self.push(request)

    def _clean_top(self) -> list[Any]:
        heap = self._heap
        while heap[0][2] is None:
            heapq.heappop(heap)
        return heap[0]

    def pop(self) -> Request:
        if not self._entries:
            raise IndexError("pop from an empty waiting queue")
        self._clean_top()
        entry = heapq.heappop(self._heap)
        request, entry[2] = entry[2], None  # gone from the reversed heap too
        del self._entries[request.request_id]
        self._removed(request)
        self._compact()
        return request

    def peek(self) -> Request:
        if not self._entries:
            raise IndexError("peek from an empty waiting queue")
        return self._clean_top()[2]

    def remove(self, request: Request) -> None:
        entry = self._entries.get(request.request_id)
        if entry is None or entry[2] is not request:
            raise ValueError(f"request {request.request_id} is not in the waiting queue")
        del self._entries[request.request_id]
        entry[2] = None
        self._removed(request)
        self._compact()

    def _compact(self) -> None:
        """Drop the emptied entries once they are as many as the queue."""
        bound = 2 * len(self._entries) + 64
        if len(self._heap) > bound:
            self._heap = [entry for entry in self._heap if entry[2] is not None]
            heapq.heapify(self._heap)
        if self._reversed is not None and len(self._reversed) > bound:
            self._reversed = [pair for pair in self._reversed if pair[1][2] is not None]
            heapq.heapify(self._reversed)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        """In order, lazily: a copy of the heap popped as far as it is read (K4's estimate
        reads a few heads of a long queue on each arrival: it sorted all of it, QA)."""
        heap = self._heap[:]  # removed entries keep their keys: still a heap
        while heap:
            request = heapq.heappop(heap)[2]
            if request is not None:
                yield request

    def unordered(self) -> Iterator[Request]:
        return (entry[2] for entry in self._heap if entry[2] is not None)

    def least_urgent(self) -> Iterator[Request]:
        if self._reversed is None:
            self._reversed = [(_displacement_key(entry[2]), entry) for entry in self._heap
                              if entry[2] is not None]
            heapq.heapify(self._reversed)
        reversed_heap = self._reversed
        while reversed_heap and reversed_heap[0][1][2] is None:  # K5 empties the top most
            heapq.heappop(reversed_heap)
        reversed_heap = reversed_heap[:]  # emptied entries keep their keys: still a heap
        while reversed_heap:
            request = heapq.heappop(reversed_heap)[1][2]
            if request is not None:
                yield request


def _displacement_key(request: Request) -> tuple[int, float, str]:
    """K5's order: the least urgent first (largest priority value, latest arrival)."""
    return (-request.sampling_params.priority, -request.arrival_time, request.request_id)


class AgingPriorityQueue(WaitingQueue):
    """Priority with aging (C7): the effective priority is the priority value minus one per
    ``aging_s`` seconds waited since arrival, ties to the earlier arrival, then the id.

    Within one priority value the earlier arrival has waited longer, so it is never less
    urgent: each value's requests keep arrival order, and the order across values is decided
    among their heads at the pass's time. A pass costs a look at each value's head, and one
    at each request that crosses its first ``aging_s`` (to report it lifted), not a sort of
    the whole queue (QA: a sort with a Python key every step made a run quadratic).
    """

    def __init__(self, aging_s: float) -> None:
        super().__init__()
        self._aging_s = aging_s
        self._levels: dict[int, list[Request]] = {}  # priority value -> by (arrival, id)
        self._len = 0
        self._now = -math.inf  # until the first pass, nobody has aged
        # a heap by arrival of the requests pushed, until their first aging_s has passed,
        # one entry a request (QA: a not-ready request set aside and pushed back each step
        # added one each time); the count parts entries of equal arrival and id
        self._unreported: list[tuple[float, int, Request]] = []
        # id() of each request with an entry there (its entry holds it, so no other object
        # takes its id() meanwhile; QA: by request id, a request reusing a gone one's id
        # was never reported)
        self._unreported_ids: set[int] = set()
        self._pushes = itertools.count()

    def effective_priority(self, request: Request, now: float) -> int:
        waited = now - request.arrival_time
        steps = int(waited // self._aging_s) if waited > 0 else 0
        return request.sampling_params.priority - steps

    def _key(self, request: Request) -> tuple[int, float, str]:
        return (self.effective_priority(request, self._now), request.arrival_time,
                request.request_id)

    def start_pass(self, cache: PrefixView, now: float) -> list[Request]:
        self._now = now
        limit = now - self._aging_s
        lifted = []
        unreported = self._unreported
        while unreported and unreported[0][0] <= limit:
            request = heapq.heappop(unreported)[2]
            self._unreported_ids.discard(id(request))
            if not request.aging_reported and self._holds(request):
                request.aging_reported = True
                lifted.append(request)
        return sorted(lifted, key=self._key)

    def _holds(self, request: Request) -> bool:
        level = self._levels.get(request.sampling_params.priority, [])
        index = bisect.bisect_left(level, _arrival_order(request), key=_arrival_order)
        return index < len(level) and level[index] is request

    def _head_level(self) -> list[Request]:
        return min(self._levels.values(), key=lambda level: self._key(level[0]))

    def push(self, request: Request) -> None:
        level = self._levels.setdefault(request.sampling_params.priority, [])
        bisect.insort(level, request, key=_arrival_order)
        if not request.aging_reported and id(request) not in self._unreported_ids:
            self._unreported_ids.add(id(request))
            heapq.heappush(self._unreported,
                           (request.arrival_time, next(self._pushes), request))
        if len(self._unreported) > 2 * self._len + 64:  # entries of requests gone meanwhile
            self._unreported = [entry for entry in self._unreported if self._holds(entry[2])]
            heapq.heapify(self._unreported)
            self._unreported_ids = {id(entry[2]) for entry in self._unreported}
        self._len += 1
        self._added(request)

    def push_front(self, request: Request) -> None:
        self.push(request)  # no front under priority (C3)

    def pop(self) -> Request:
        if not self._len:
            raise IndexError("pop from an empty waiting queue")
        request = self._head_level().pop(0)
        request.aging_reported = False  # admitted: its wait is over
        self._forget(request)
        return request

    def peek(self) -> Request:
        if not self._len:
            raise IndexError("peek from an empty waiting queue")
        return self._head_level()[0]

    def remove(self, request: Request) -> None:
        level = self._levels.get(request.sampling_params.priority, [])
        index = bisect.bisect_left(level, _arrival_order(request), key=_arrival_order)
        if index >= len(level) or level[index] is not request:
            raise ValueError(f"request {request.request_id} is not in the waiting queue")
        del level[index]
        self._forget(request)

    def _forget(self, request: Request) -> None:
        priority = request.sampling_params.priority
        if not self._levels[priority]:
            del self._levels[priority]
        self._len -= 1
        self._removed(request)
        if not self._len:  # what is left there names requests gone
            self._unreported.clear()
            self._unreported_ids.clear()

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return heapq.merge(*[list(level) for level in self._levels.values()], key=self._key)

    def unordered(self) -> Iterator[Request]:
        return (request for level in self._levels.values() for request in level)


def _arrival_order(request: Request) -> tuple[float, str]:
    return (request.arrival_time, request.request_id)


def make_plain_queue(policy: str, config: SchedulerConfig | None = None) -> WaitingQueue:
    """One queue in ``policy``'s order, without tenants (the VTC queue's buckets are these)."""
    aging_s = config.schedule_aging_s if config is not None else None
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue() if aging_s is None else AgingPriorityQueue(aging_s)
    if policy not in CACHE_AWARE_POLICIES:  # a name with no queue class (QA: built as lpm's)
        raise ValueError(f"scheduling_policy={policy!r} has no queue class in "
                         "kvserve.core.queues (make_plain_queue)")
    from kvserve.core.cache_order import CacheAwareQueue

    max_queue = config.lpm_max_queue if config is not None else DEFAULT_LPM_MAX_QUEUE
    return CacheAwareQueue(policy, max_queue, aging_s)


def make_waiting_queue(policy: str, config: SchedulerConfig | None = None) -> WaitingQueue:
    """The waiting queue of ``policy`` (fcfs, priority, lpm or dfs-weight); with
    ``config.tenant_fairness`` "vtc", tenants' fair share within each priority level (T1),
    each tenant's requests in ``policy``'s order."""
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"unknown scheduling policy {policy!r}; expected one of "
                         f"{', '.join(SCHEDULING_POLICIES)}")
    if config is not None and config.tenant_fairness == "vtc":
        from kvserve.core.fairness import TenantFairQueue

        return TenantFairQueue(policy, config)
    return make_plain_queue(policy, config)
