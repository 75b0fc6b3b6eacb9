"""What a new request must pass before it is queued (spec J1, K4). Each check raises or
returns None; none of them records anything."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvserve.core.config import CacheConfig, SchedulerConfig
from kvserve.core.errors import QueueFullError, RequestRejected
from kvserve.core.policies import idle_growth_blocks
from kvserve.core.queues import WaitingQueue
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


def check_queueable(prompt_lens: Sequence[int], config: SchedulerConfig,
                    request_id: str, pool: tuple[int, int] | None = None,
                    max_tokens: Sequence[int | None] | None = None,
                    order: Sequence[Any] | None = None) -> None:
    """K4: refuse (RequestRejected: the server answers 400, not 503) what could never be
    queued, even on an idle engine with an empty queue: a group (a prompt list, ``n``; one
    prompt length each) one of whose sequences, added in turn as the server adds them,
    :func:`_check_room` would refuse with only the group's earlier ones queued, less those
    an idle engine's next step admits (given its ``pool`` of blocks and block size, each
    prompt's ``max_tokens`` for an admission policy's reserve, and the queue's ``order`` of
    the group: a sort key each, the priority queue's ids; None: as given). Waiting cannot
    help it, so a client told to retry would retry forever."""
    growth = _idle_growth(prompt_lens, config, pool, max_tokens)
    keys = range(len(prompt_lens)) if order is None else order
    queued: list[tuple[Any, int, int]] = []  # the earlier ones: (key, length, growth)
    for key, length, kept in zip(keys, prompt_lens, growth, strict=True):
        admitted = _admitted_alone(((n, g) for _, n, g in queued), config, pool)
        _refuse_room(request_id, len(prompt_lens), length, len(queued),
                     [n for _, n, _ in queued[admitted:]], admitted, config)
        bisect.insort(queued, (key, length, kept))


def _refuse_room(request_id: str, num_requests: int, length: int, num_queued: int,
                 waiting: list[int], admitted: int, config: SchedulerConfig) -> None:
    """:func:`_check_room`'s refusals of one of a group's sequences (``length`` tokens) on
    an idle engine, its ``num_queued`` earlier ones queued, ``waiting`` their lengths past
    the ``admitted`` the next step takes, as a RequestRejected naming the group."""
    # the step admits at most max_num_seqs; fewer where its budget or the pool runs out (the
    # second review: seats alone made such a group a 503 on every retry)
    step = f"max_num_seqs={admitted}" if admitted == config.max_num_seqs else \
        f"the {admitted} an idle engine's next step admits"
    max_reqs = config.max_num_queued_reqs
    if max_reqs is not None and len(waiting) >= max_reqs:
        raise RequestRejected(
            f"request {request_id}: {num_requests} sequences at once exceed "
            f"max_num_queued_reqs={max_reqs} plus {step}, the most the "
            "waiting queue and one step ever take; send fewer prompts or a smaller n")
    per_tenant = config.max_num_queued_reqs_per_tenant
    if per_tenant is not None and len(waiting) >= per_tenant:
        raise RequestRejected(
            f"request {request_id}: {num_requests} sequences at once exceed "
            f"max_num_queued_reqs_per_tenant={per_tenant} plus {step}, the "
            "most one tenant may have waiting and one step takes; send fewer prompts or a "
            "smaller n")
    limit = config.max_num_queued_tokens
    alone = limit is not None and length > limit and not num_queued  # it waits alone
    if limit is not None and not alone and sum(waiting) + length > limit:
        raise RequestRejected(
            f"request {request_id}: its prompts past those the next step admits would "
            f"wait with more than max_num_queued_tokens={limit} tokens (one longer "
            "than that waits alone, as the first of a request), the most the waiting "
            "queue ever holds; send shorter or fewer prompts")


def _idle_growth(prompt_lens: Sequence[int], config: SchedulerConfig,
                 pool: tuple[int, int] | None,
                 max_tokens: Sequence[int | None] | None) -> list[int]:
    """The blocks the admission policy keeps for each prompt's growth on an idle engine
    (K2: its share of ``max_tokens``, one None being what the context leaves, J1; 0 without
    the pool or max_tokens)."""
    if pool is None or max_tokens is None:
        return [0] * len(prompt_lens)
    return [idle_growth_blocks(config, length, answer, *pool)
            for length, answer in zip(prompt_lens, max_tokens, strict=True)]


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
    """K4: refuse what could never be queued (400, see check_queueable), then (the server
    answers 503) what cannot be queued now because the waiting queue is at its limits.
    ``admissible``: the waiting requests the next step will admit as things stand, which
    are no backlog and do not count (a burst into free seats was refused).

    Under the priority policy a request the limits refuse takes the room of waiting
    requests less urgent than it instead (K5): the ones to displace are returned (none when
    it fits), least urgent first; the refusal stands when they would not make room."""
    check_queueable((request.num_tokens,), config, request.request_id)
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
