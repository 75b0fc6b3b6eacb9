"""Fair share between tenants: the Virtual Token Counter (Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024) as a waiting-queue order (spec T1-T7).

Every tenant has a counter of the weighted service it has received::

    counter[t] += (prompt_price x tokens admitted + output_price x tokens generated) / weight[t]

and the waiting pass admits next from the *backlogged* tenant (one with waiting requests)
whose counter is least. A tenant returning from idle is lifted to the least counter of the
backlogged tenants (or, when nobody waits, to that of the tenant served last), so it cannot
bank service it did not ask for. Under the priority policy the order is priority first, the
counters within one priority level; within one tenant the inner order (FCFS, or priority and
arrival) is kept.

Service is charged where the scheduler decides it: the whole sequence a request (re)computes
when it is admitted (its prompt; after a preemption, prompt and output so far: the engine
does that work again for this tenant), and one output token each step a request reaches the
end of its sequence (it samples one). The gap this leaves is bounded (docs/tenants.md): while
two tenants are both backlogged, neither's counter can lead the other's by more than one
request's prompt charge plus the output charge of the requests it has running.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator

from kvserve.core.config import SchedulerConfig
from kvserve.core.queues import PrefixView, WaitingQueue, make_plain_queue
from kvserve.core.request import Request

_FORGET_FROM = 64  # counters kept before forget_idle looks at them


class TenantFairQueue(WaitingQueue):
    """Buckets by (priority level, tenant), each an FCFS or priority queue; pop takes the
    lowest level, then the tenant with the least counter (ties: the earlier head request,
    then the tenant's name)."""

    def __init__(self, policy: str, config: SchedulerConfig) -> None:
        super().__init__()
        self._by_priority = policy == "priority"
        self._policy, self._config = policy, config  # each bucket's order (C1-C7)
        self._levels: dict[int, dict[str, WaitingQueue]] = {}
        self._prompt_price = config.vtc_prompt_token_price
        self._output_price = config.vtc_output_token_price
        self._weights = dict(config.tenant_weights)
        self.counters: dict[str, float] = {}
        self._last_served: str | None = None
        self._len = 0
        self._forget_at = _FORGET_FROM  # the number of counters that starts a forget_idle pass
        # per level, a heap of (counter, head's sort key, tenant, stamp): the next tenant is
        # the top whose stamp is still its (level, tenant)'s, so a pick is O(log tenants)
        # (QA: a scan of every backlogged tenant on each peek made a run quadratic)
        self._heaps: dict[int, list[tuple[float, tuple[int, float, str], str, int]]] = {}
        self._stamps: dict[tuple[int, str], int] = {}
        self._next_stamp = itertools.count()
        self._sorts_buckets = type(make_plain_queue(policy, config)).start_pass \
            is not WaitingQueue.start_pass

    # -- the counters ----------------------------------------------------------------------

    def _charge(self, tenant: str, amount: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + \
            amount / self._weights.get(tenant, 1.0)

    def _lift(self, tenant: str) -> None:
        """T2: a tenant with nothing waiting starts from the least backlogged counter."""
        floor = min((self._top(level)[0] for level in self._levels), default=None)
        if floor is None:
            if self._last_served is None:
                return
            floor = self.counters.get(self._last_served, 0.0)
        if self.counters.get(tenant, 0.0) < floor:
            self.counters[tenant] = floor

    # -- the heaps of backlogged tenants ---------------------------------------------------

    def _restamp(self, level: int, tenant: str) -> None:
        """(level, tenant)'s bucket's entry made anew: its head changed (a charge is caught
        up lazily, in :meth:`_top`)."""
        bucket = self._levels.get(level, {}).get(tenant)
        if not bucket:
            self._stamps.pop((level, tenant), None)
            return
        stamp = self._stamps[(level, tenant)] = next(self._next_stamp)
        heap = self._heaps.setdefault(level, [])
        heapq.heappush(heap, (self.counters.get(tenant, 0.0), bucket.peek().sort_key(),
                              tenant, stamp))
        if len(heap) > 2 * len(self._levels[level]) + 64:  # stale entries: drop them
            self._heaps[level] = [entry for entry in heap
                                  if self._stamps.get((level, entry[2])) == entry[3]]
            heapq.heapify(self._heaps[level])

    def _top(self, level: int) -> tuple[float, tuple[int, float, str], str, int]:
        """The entry of the tenant ``level`` serves next: stale ones (their head or bucket
        changed) dropped, one whose tenant was charged since put back with its counter.
        A counter only grows while its tenant waits, so an entry can only sit too early,
        never too late: the top, once current, is the least (QA: renewing every level's
        entry on each charge cost a tenant waiting at many priorities each step)."""
        heap = self._heaps[level]
        while True:
            counter, key, tenant, stamp = heap[0]
            if self._stamps.get((level, tenant)) != stamp:
                heapq.heappop(heap)
            elif counter != (current := self.counters.get(tenant, 0.0)):
                heapq.heapreplace(heap, (current, key, tenant, stamp))
            else:
                return heap[0]

    def forget_idle(self, live_tenants: Callable[[], set[str]]) -> None:
        """Drop the counters of tenants with no live request (none waiting, running,
        swapped or held) that sit at or below every counter T2 could lift a tenant to: the
        least backlogged or live counter, and the last-served tenant's. Such a tenant,
        returning, is lifted to the floor then whether its counter was kept or not, so no
        order changes; what it saves is a counter per client-chosen tenant name for the life
        of the server (QA: 2 MB ``user`` values held 2 MB each). A pass runs once the
        counters have doubled since the last, so its cost is amortised."""
        if len(self.counters) < self._forget_at:
            return
        live = live_tenants() | set(self.num_by_tenant)
        if self._last_served is not None:
            live.add(self._last_served)
        floor = min((self.counters.get(t, 0.0) for t in live), default=None)
        if floor is not None:
            self.counters = {t: c for t, c in self.counters.items() if t in live or c > floor}
        self._forget_at = max(_FORGET_FROM, 2 * len(self.counters))

    def record_step(self, running: list[Request], num_scheduled: dict[str, int]) -> None:
        """T3: one output token for each scheduled request that reached the end of its
        sequence (it samples a token in this step)."""
        price = self._output_price
        for request in running:
            if request.request_id in num_scheduled and \
                    request.num_computed_tokens >= request.num_tokens:
                self._charge(request.sampling_params.tenant, price)

    def start_pass(self, cache: PrefixView, now: float) -> list[Request]:
        """A cache-aware or aging order sorts each tenant's bucket (C4-C7), which may give
        it another head; FCFS and priority buckets have nothing to do."""
        lifted: list[Request] = []
        if not self._sorts_buckets:
            return lifted
        for level, tenants in self._levels.items():
            for tenant, bucket in tenants.items():
                lifted += bucket.start_pass(cache, now)
                self._restamp(level, tenant)
        return lifted

    # -- the queue -------------------------------------------------------------------------

    def _bucket_of(self, request: Request) -> WaitingQueue:
        level = request.sampling_params.priority if self._by_priority else 0
        tenants = self._levels.setdefault(level, {})
        tenant = request.sampling_params.tenant
        bucket = tenants.get(tenant)
        if bucket is None:
            bucket = tenants[tenant] = make_plain_queue(self._policy, self._config)
        return bucket

    def push(self, request: Request) -> None:
        tenant = request.sampling_params.tenant
        if tenant not in self.num_by_tenant:
            self._lift(tenant)
        self._bucket_of(request).push(request)
        self._added(request)
        self._len += 1
        self._restamp(self._level_of(request), tenant)

    def push_front(self, request: Request) -> None:
        """A preempted request goes back to the head of its tenant's bucket (C2, C3); its
        tenant was being served, so its counter is not lifted."""
        self._bucket_of(request).push_front(request)
        self._added(request)
        self._len += 1
        self._restamp(self._level_of(request), request.sampling_params.tenant)

    def _level_of(self, request: Request) -> int:
        return request.sampling_params.priority if self._by_priority else 0

    def _select(self) -> tuple[dict[str, WaitingQueue], str]:
        """The lowest level, and in it the tenant with the least counter (ties: the earlier
        head request, then the tenant's name)."""
        level = min(self._levels)
        return self._levels[level], self._top(level)[2]

    def peek(self) -> Request:
        if not self._len:
            raise IndexError("peek from an empty waiting queue")
        tenants, tenant = self._select()
        return tenants[tenant].peek()

    def pop(self) -> Request:
        if not self._len:
            raise IndexError("pop from an empty waiting queue")
        tenants, tenant = self._select()
        request = tenants[tenant].pop()
        self._forget_if_empty(request)
        self._removed(request)
        self._len -= 1
        self.charge_admission(request)
        return request

    def arrived_elsewhere(self, request: Request) -> None:
        """T2 for a held session turn (QA: it never passed push, so a tenant back from idle
        with held turns went ahead of the others on service it banked while idle)."""
        tenant = request.sampling_params.tenant
        if tenant not in self.num_by_tenant:
            self._lift(tenant)

    def charge_admission(self, request: Request) -> None:
        """T3: an admitted request's whole sequence, at the prompt price (a held session
        turn's too, T8, though it never was in this queue)."""
        tenant = request.sampling_params.tenant
        self._charge(tenant, self._prompt_price * request.num_tokens)
        self._last_served = tenant

    def served_less(self, tenant: str, than: str) -> bool:
        """T8: whether ``tenant``'s counter is below ``than``'s."""
        return self.counters.get(tenant, 0.0) < self.counters.get(than, 0.0)

    def remove(self, request: Request) -> None:
        level = request.sampling_params.priority if self._by_priority else 0
        bucket = self._levels.get(level, {}).get(request.sampling_params.tenant)
        if bucket is None:
            raise ValueError(f"request {request.request_id} is not in the waiting queue")
        bucket.remove(request)
        self._forget_if_empty(request)
        self._removed(request)
        self._len -= 1

    def _forget_if_empty(self, request: Request) -> None:
        """After a request left its bucket: an empty bucket goes, and the level with its
        last; else the bucket's entry is made anew (its head changed)."""
        level = self._level_of(request)
        tenants = self._levels[level]
        tenant = request.sampling_params.tenant
        if not tenants[tenant]:
            del tenants[tenant]
            self._stamps.pop((level, tenant), None)
            if not tenants:
                del self._levels[level]
                del self._heaps[level]
        else:
            self._restamp(level, tenant)

    def __len__(self) -> int:
        return self._len

    def unordered(self) -> Iterator[Request]:
        return (request for tenants in self._levels.values() for bucket in tenants.values()
                for request in bucket.unordered())

    def __iter__(self) -> Iterator[Request]:
        """The order of successive pops if no output token were charged in between."""
        counters = dict(self.counters)
        pending = {level: {t: deque(bucket) for t, bucket in tenants.items()}
                   for level, tenants in self._levels.items()}
        while pending:
            tenants = pending[min(pending)]
            tenant = min(tenants, key=lambda t: (counters.get(t, 0.0),
                                                 tenants[t][0].sort_key(), t))
            request = tenants[tenant].popleft()
            counters[tenant] = counters.get(tenant, 0.0) + self._prompt_price * \
                request.num_tokens / self._weights.get(tenant, 1.0)
            if not tenants[tenant]:
                del tenants[tenant]
                if not tenants:
                    del pending[min(pending)]
            yield request
