"""What a new request must pass before it is queued (spec J1, K4). Each check raises or
returns None; none of them records anything."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

from kvserve.core.config import CacheConfig, SchedulerConfig
from kvserve.core.errors import QueueFullError, RequestRejected
from kvserve.core.policies import idle_growth_blocks
from kvserve.core.queues import WaitingQueue, make_waiting_queue
from kvserve.core.request import Request


def check_servable(request: Request, config: SchedulerConfig, cache: CacheConfig) -> None:
    """J1: refuse a prompt that leaves no room to generate, or that with one generated
    token outgrows the whole KV pool; queued, it could only wedge the head of the line."""
    check_servable_length(request.request_id, request.num_tokens, config, cache)


def check_servable_length(request_id: str, num_tokens: int, config: SchedulerConfig,
                          cache: CacheConfig) -> None:
    """:func:`check_servable` on a prompt's length alone (the simulator asks before it draws
    a prompt's ids, which a trace line may make absurdly long)."""
    if num_tokens >= config.max_model_len:
        raise RequestRejected(
            f"request {request_id}: prompt of {num_tokens} tokens leaves no room "
            f"to generate: max_model_len is {config.max_model_len}")
    if num_tokens + 1 > cache.num_token_slots:
        num_blocks = -(-(num_tokens + 1) // cache.block_size)
        raise RequestRejected(
            f"request {request_id}: prompt of {num_tokens} tokens plus one "
            f"generated token needs {num_blocks} KV blocks, but the whole pool has "
            f"{cache.num_blocks} blocks of {cache.block_size} tokens "
            f"({cache.num_token_slots} tokens)")


def check_queueable(group: Sequence[Request], config: SchedulerConfig, group_id: str,
                    pool: tuple[int, int] | None = None) -> None:
    """K4: refuse (RequestRejected: the server answers 400, not 503) what could never be
    queued, even on an idle engine with an empty queue: a group (a prompt list, ``n``) one
    of whose sequences, pushed in turn as the server adds them into an empty queue of the
    configured policy, :func:`_check_room` refuses beside the group's earlier ones, less
    those an idle engine's next step admits (given its ``pool`` of blocks and block size,
    with the reserve an admission policy keeps from each sequence's max_tokens), or one the
    pool can never hold (J1, named as such). Waiting cannot help it, so a client told to
    retry would retry forever.

    The same rule as the 503's, asked of a scratch queue, so the two cannot drift apart and
    any queue's order (the priority queue's ids among equals, B2) is the order counted."""
    if not config.bounds_queue:
        return
    if pool is not None:  # J1 first: a prompt the pool never holds is refused for that
        cache = CacheConfig(pool[0], pool[1])  # (the chaos pass: named the queue's limit)
        for request in group:
            check_servable(request, config, cache)
    queue = make_waiting_queue(config.scheduling_policy, config)
    growth = {r.request_id: _idle_growth(r, config, pool) for r in group}
    for request in group:
        head = list(itertools.islice(queue, config.max_num_seqs))  # the most a step admits
        admitted = _admitted_alone([(r.num_tokens, growth[r.request_id]) for r in head],
                                   config, pool)
        try:
            _check_room(request, queue, config, head[:admitted])
        except QueueFullError as error:
            raise _never_queued(error.limit, group_id, len(group), admitted, config) from None
        queue.push(request)


def _never_queued(limit: str, group_id: str, num_requests: int, admitted: int,
                  config: SchedulerConfig) -> RequestRejected:
    """The 400 for a group of ``num_requests`` sequences whose ``limit`` refuses one though
    an idle engine's next step admits ``admitted`` of those before it."""
    # the step admits at most max_num_seqs; fewer where its budget or the pool runs out (the
    # second review: seats alone made such a group a 503 on every retry)
    step = f"max_num_seqs={admitted}" if admitted == config.max_num_seqs else \
        f"the {admitted} an idle engine's next step admits"
    if limit == "max_num_queued_reqs":
        return RequestRejected(
            f"request {group_id}: {num_requests} sequences at once exceed "
            f"max_num_queued_reqs={config.max_num_queued_reqs} plus {step}, the most the "
            "waiting queue and one step ever take; send fewer prompts or a smaller n")
    if limit == "max_num_queued_reqs_per_tenant":
        return RequestRejected(
            f"request {group_id}: {num_requests} sequences at once exceed "
            f"max_num_queued_reqs_per_tenant={config.max_num_queued_reqs_per_tenant} plus "
            f"{step}, the most one tenant may have waiting and one step takes; send fewer "
            "prompts or a smaller n")
    return RequestRejected(
        f"request {group_id}: its prompts past those the next step admits would wait with "
        f"more than max_num_queued_tokens={config.max_num_queued_tokens} tokens (one longer "
        "than that waits alone, as the first of a request), the most the waiting queue ever "
        "holds; send shorter or fewer prompts")


def _idle_growth(request: Request, config: SchedulerConfig,
                 pool: tuple[int, int] | None) -> int:
    """The blocks the admission policy keeps for ``request``'s growth on an idle engine
    with this ``pool`` (K2: its share of max_tokens, None being what the context leaves,
    J1; 0 without the pool)."""
    if pool is None:
        return 0
    return idle_growth_blocks(config, request.num_tokens, request.sampling_params.max_tokens,
                              *pool)


def _admitted_alone(prompts: Iterable[tuple[int, int]], config: SchedulerConfig,
                    pool: tuple[int, int] | None) -> int:
    """How many of these prompts (length, growth), in the queue's order, an idle engine's
    next step admits (given its ``pool``: blocks, block size; None: blocks not counted).
    Those are no backlog."""
    blocks, block_size = pool if pool is not None else (None, 1)
    watermark = 0 if blocks is None else int(config.watermark * blocks)
    return next_step_admits(prompts, config.max_num_seqs, config.max_num_batched_tokens,
                            blocks, block_size, watermark, False,
                            config.enable_chunked_prefill)


def next_step_admits(prompts: Iterable[tuple[int, int]], seats: int, budget: int,
                     blocks: int | None, block_size: int, watermark: int, running: bool,
                     chunked: bool, reserved: int = 0) -> int:
    """K4: how many of these waiting prompts (length, the blocks an admission policy keeps
    for its growth once admitted), from the first, the next step admits as things stand:
    while the ``seats``, the token ``budget`` (a prompt's whole length with chunked prefill
    off) and the free ``blocks`` (None: not counted) last, a block past each prompt's end,
    the watermark's blocks held back once something runs (E2, as allocate_slots: from the
    second admission of an idle engine's step on), and the policy's blocks kept for the
    growth of what runs (``reserved``) and of each admitted (K2). Prefix hits are not
    counted (an estimate on the safe side). The scheduler's backlog and the 400 rules both
    count by it, so they agree."""
    count, held_back = 0, watermark if running else 0
    for length, growth in prompts:
        taken, kept = admission_blocks(length, growth, block_size)
        if seats <= 0 or budget <= 0 or (not chunked and length > budget) or \
                (blocks is not None and taken + kept + held_back + reserved > blocks):
            break
        count, seats, budget, held_back = count + 1, seats - 1, budget - length, watermark
        reserved += kept
        if blocks is not None:
            blocks -= taken
    return count


def admission_blocks(length: int, growth: int, block_size: int) -> tuple[int, int]:
    """K4: the blocks a request of ``length`` tokens takes when admitted, and those kept
    free for it after: a block past its end, or the ``growth`` an admission policy keeps for
    it (K2: counted from its prompt's blocks, so that block is among them; the review: both
    counted made a prompt of a whole number of blocks a 400 an idle engine served)."""
    taken = -(-length // block_size)
    return taken, max(-(-(length + 1) // block_size) - taken, growth)


def check_queue_limits(request: Request, waiting: WaitingQueue, config: SchedulerConfig,
                       admissible: Sequence[Request] = ()) -> list[Request]:
    """K4: refuse (the server answers 503) what cannot be queued now because the waiting
    queue is at its limits (one request alone always can be: check_queueable's 400 is for a
    group the server adds at once). ``admissible``: the waiting requests the next step will
    admit as things stand, which are no backlog and do not count (a burst into free seats
    was refused).

    Under the priority policy a request the limits refuse takes the room of waiting
    requests less urgent than it instead (K5): the ones to displace are returned (none when
    it fits), least urgent first; the refusal stands when they would not make room."""
    try:
        _check_room(request, waiting, config, admissible)
        return []
    except QueueFullError:
        if config.scheduling_policy != "priority":
            raise
        return _displaced_for(request, waiting, config, admissible)


def _displaced_for(request: Request, waiting: WaitingQueue, config: SchedulerConfig,
                   admissible: Sequence[Request]) -> list[Request]:
    """K5: waiting requests less urgent than ``request`` (a larger priority value), never
    scheduled (a preempted one has shown its client tokens), least urgent first (largest
    priority value, then latest arrival), each taken while it frees room under a limit
    ``request`` breaks, until it fits; QueueFullError when they cannot make room."""
    tenant = request.sampling_params.tenant
    running_next = {r.request_id for r in admissible}
    victims: list[Request] = []
    # The tenant's own limit first, by its own requests (each frees a place under the
    # queue's limits too); then the queue's limits, by anyone's.
    per_tenant = config.max_num_queued_reqs_per_tenant
    if per_tenant is not None:
        excess = waiting.num_by_tenant.get(tenant, 0) + 1 - per_tenant - \
            sum(1 for r in admissible if r.sampling_params.tenant == tenant)
        own = (r for r in _candidates(request, waiting, running_next)
               if r.sampling_params.tenant == tenant)
        victims.extend(itertools.islice(own, max(0, excess)))
    for candidate in _candidates(request, waiting, running_next):
        try:
            _check_room(request, waiting, config, admissible, victims)
            return victims
        except QueueFullError:
            if candidate not in victims:
                victims.append(candidate)
    _check_room(request, waiting, config, admissible, victims)
    return victims


def _candidates(request: Request, waiting: WaitingQueue,
                running_next: set[str]) -> Iterator[Request]:
    """K5's candidates for ``request``, least urgent first, read as far as needed: a sort
    of the whole queue on each arrival into a full one made a run quadratic (QA)."""
    priority = request.sampling_params.priority
    for candidate in waiting.least_urgent():
        if candidate.sampling_params.priority <= priority:
            return  # the rest are as urgent or more
        if candidate.first_scheduled_time is None and \
                candidate.request_id not in running_next:
            yield candidate


def _check_room(request: Request, waiting: WaitingQueue, config: SchedulerConfig,
                admissible: Sequence[Request], displaced: Sequence[Request] = ()) -> None:
    """QueueFullError when ``request`` cannot join ``waiting`` once the requests the next
    step admits (``admissible``) and those it displaces (K5) have left."""
    leaving = [*admissible, *displaced]
    max_reqs = config.max_num_queued_reqs
    num_waiting = len(waiting) - len(leaving)
    if max_reqs is not None and num_waiting >= max_reqs:
        raise QueueFullError(
            f"request {request.request_id}: the waiting queue is full "
            f"({num_waiting} requests, max_num_queued_reqs={max_reqs})",
            "max_num_queued_reqs")
    per_tenant = config.max_num_queued_reqs_per_tenant
    tenant = request.sampling_params.tenant
    if per_tenant is not None:
        num_tenant = waiting.num_by_tenant.get(tenant, 0) - \
            sum(1 for r in leaving if r.sampling_params.tenant == tenant)
        if num_tenant >= per_tenant:
            raise QueueFullError(
                f"request {request.request_id}: tenant {tenant!r} has {per_tenant} requests "
                f"waiting (max_num_queued_reqs_per_tenant={per_tenant})",
                "max_num_queued_reqs_per_tenant")
    # a request of more tokens than the limit waits alone: taken where nothing else waits,
    # admissible or not (QA: it was refused for good, a hidden prompt-length cap; then,
    # taken where the queue seemed to empty at the next step, several could wait at once)
    max_tokens = config.max_num_queued_tokens
    num_tokens = waiting.num_tokens - sum(r.num_tokens for r in leaving)
    alone = request.num_tokens > (max_tokens or 0) and len(waiting) == len(displaced)
    if max_tokens is not None and not alone and \
            num_tokens + request.num_tokens > max_tokens:
        raise QueueFullError(
            f"request {request.request_id}: {request.num_tokens} more tokens would exceed "
            f"max_num_queued_tokens={max_tokens} ({num_tokens} queued)",
            "max_num_queued_tokens")
