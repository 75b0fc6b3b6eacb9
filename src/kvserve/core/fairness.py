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

    # -- the counters ----------------------------------------------------------------------

    def _charge(self, tenant: str, amount: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + \
            amount / self._weights.get(tenant, 1.0)

    def _lift(self, tenant: str) -> None:
        """T2: a tenant with nothing waiting starts from the least backlogged counter."""
        backlogged = [self.counters.get(t, 0.0) for t in self.num_by_tenant]
        if backlogged:
            floor = min(backlogged)
        elif self._last_served is not None:
            floor = self.counters.get(self._last_served, 0.0)
        else:
            return
        if self.counters.get(tenant, 0.0) < floor:
            self.counters[tenant] = floor

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
        """A cache-aware or aging order sorts each tenant's bucket (C4-C7)."""
        lifted: list[Request] = []
        for tenants in self._levels.values():
            for bucket in tenants.values():
                lifted += bucket.start_pass(cache, now)
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

    def push_front(self, request: Request) -> None:
        """A preempted request goes back to the head of its tenant's bucket (C2, C3); its
        tenant was being served, so its counter is not lifted."""
        self._bucket_of(request).push_front(request)
        self._added(request)
        self._len += 1

    def _select(self, counters: dict[str, float]) -> tuple[dict[str, WaitingQueue], str]:
        tenants = self._levels[min(self._levels)]
        chosen = min(tenants, key=lambda t: (counters.get(t, 0.0),
                                             tenants[t].peek().sort_key(), t))
        return tenants, chosen

    def peek(self) -> Request:
        if not self._len:
            raise IndexError("peek from an empty waiting queue")
        tenants, tenant = self._select(self.counters)
        return tenants[tenant].peek()

    def pop(self) -> Request:
        if not self._len:
            raise IndexError("pop from an empty waiting queue")
        tenants, tenant = self._select(self.counters)
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
        level = request.sampling_params.priority if self._by_priority else 0
        tenants = self._levels[level]
        tenant = request.sampling_params.tenant
        if not tenants[tenant]:
            del tenants[tenant]
            if not tenants:
                del self._levels[level]

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
