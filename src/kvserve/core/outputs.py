"""Plain data crossing the Executor seam and leaving the scheduler (docs/architecture.md, "The
one seam" and rule 2).

Frozen dataclasses of ints, strings and lists: printable, comparable in tests, serialisable
to the event log with :func:`dataclasses.asdict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from kvserve.core.request import EventType, SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner has no state for: newly admitted, or resumed after preemption.

    ``token_ids`` is the whole current sequence (the first ``num_prompt_tokens`` are the
    prompt; a resumed request's earlier output follows and is recomputed with it);
    ``num_computed_tokens`` counts the prefix-cache hit tokens whose KV is already in
    ``block_ids``.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    resumed: bool
    sampling_params: SamplingParams


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """Requests that kept running since the last step, as parallel columns.

    ``new_block_ids[i]`` lists the blocks added this step (often empty);
    ``num_computed_tokens[i]`` is the count before this step's tokens.
    """

    request_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What to run in one step: tokens per request, in batch order."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: list[str]
    # Requests finished or aborted since the previous step: runners drop their state.
    finished_req_ids: list[str]
    # KV block copies to run before this step's forward (S1, S2), as (device block id, host
    # block id) pairs: every swap-out (device -> host) first, then every swap-in (host ->
    # device), since a device block a swap-out frees may be reused in the same step.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class LogprobEntry(dict[int, float]):
    """One token's logprobs: token id -> logprob, the token's own (sampled, or the
    prompt's) first, then the top ones asked for; ``rank``: the token's own rank in the
    whole vocabulary, as vLLM counts it (1 + the tokens likelier; a tie counts before it),
    which the top ones alone cannot tell (QA: a rank-58 token read as 1)."""

    rank: int | None = None


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The logprobs of one request's prompt tokens ``first`` .. ``first + len(entries) - 1``
    that a step computed (``SamplingParams.prompt_logprobs``, G8): for each, the token's own
    logprob and the top ones (a dict, token id -> logprob) and the token's rank (1: the
    likeliest)."""

    first: int
    entries: list[dict[int, float]]
    ranks: list[int]


@dataclass(frozen=True, slots=True)
class ModelOutput:
    """Per request id, the token ids sampled this step (none for a mid-prompt chunk)."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, float]]] | None = None
    prompt_logprobs: dict[str, PromptLogprobs] | None = None


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """A finished request's timing and scheduling history (seconds on the caller's clock)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    num_recomputed_tokens: int
    longest_stall: float
    num_swaps: int = 0
    # A session turn: the tokens its session holds for the next turn (0: none held, e.g.
    # past --max-session-kv, aborted); None: not a session turn (U2)
    session_held_tokens: int | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


class RequestOutput(NamedTuple):
    """New tokens for one request from one step; ``metrics`` is set once it finishes.

    A NamedTuple rather than a frozen dataclass: one is built per running request per step,
    and a frozen dataclass costs about four times as much to construct (benchmarks/).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None


_tuple_new = tuple.__new__


def unfinished_output(request_id: str, new_token_ids: list[int]) -> RequestOutput:
    """``RequestOutput(request_id, new_token_ids)``, at about two thirds of the cost.

    The scheduler builds one per running request per step. ``tuple.__new__`` skips the
    NamedTuple's Python-level ``__new__``, so the fields are written here by position: the
    one place that must follow RequestOutput's field order (a test pins it).
    """
    return _tuple_new(RequestOutput, (request_id, new_token_ids, False, None, None, None))


@dataclass(frozen=True, slots=True)
class SchedulerEvent:
    """One line of the scheduling event log, the same in the engine and the simulator.

    ``kind``: an :class:`EventType` (written to the JSONL log as its value: arrived, admitted,
    resumed, blocked, preempted, finished).
    ``num_tokens``: tokens scheduled on admission, tokens of KV lost (recompute) or moved to
    the host tier (swap) on preemption, output tokens on finishing. ``reason``: why a
    request is blocked; the finish reason; for a preemption its mode, "recompute" or "swap",
    prefixed "priority:" for an urgent arrival (M1), with both prices under ``auto`` (S4),
    e.g. "swap (auto: recompute 0.0123 s, swap 0.004 s)"; "swap" for a swap-in resume.
    """

    time: float
    kind: EventType
    request_id: str
    num_tokens: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of the scheduler for metrics and logs."""

    num_running: int
    num_waiting: int
    num_queued_tokens: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    num_steps: int
    num_preemptions: int
    num_recomputed_tokens: int
    num_scheduled_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_finished: dict[str, int]
    num_blocked_steps: dict[str, int]
    # G6: lookups of requests back from a preemption, kept out of the two above
    prefix_cache_preempted_queries: int = 0
    prefix_cache_preempted_hits: int = 0
    # The host tier and preemption by mode (K3, M). ``num_preemptions_by_mode`` has
    # "recompute" + "swap" == num_preemptions, and "priority" counts, among those, the
    # preemptions made for an urgent arrival (M1).
    num_swapped: int = 0
    num_host_blocks: int = 0
    num_free_host_blocks: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_preemptions_by_mode: dict[str, int] = field(default_factory=dict)
    num_waiting_by_tenant: dict[str, int] = field(default_factory=dict)  # of num_waiting
    num_prefill_only_steps: int = 0  # steps that held the decodes back (Q2)
    num_guard_waits: int = 0  # running requests' steps without tokens: no victim (P2)
    # Sessions (U1-U8): held now, their blocks, turns admitted on held KV and the tokens
    # they did not prefill, and releases by reason (ttl, pressure, limit, deleted, aborted).
    num_sessions_held: int = 0
    num_session_blocks: int = 0
    num_session_hits: int = 0
    num_session_hit_tokens: int = 0
    session_releases: dict[str, int] = field(default_factory=dict)

    def after(self, earlier: SchedulerStats) -> SchedulerStats:
        """This snapshot with ``earlier``'s counters added (its gauges kept): the totals of
        an engine that was restarted, ``earlier`` being what its previous lives counted."""
        totals: dict[str, Any] = {}
        for name in COUNTER_FIELDS:
            mine, theirs = getattr(self, name), getattr(earlier, name)
            if isinstance(mine, dict):
                totals[name] = {key: mine.get(key, 0) + theirs.get(key, 0)
                                for key in {**theirs, **mine}}
            else:
                totals[name] = mine + theirs
        return replace(self, **totals)

    def at_rest(self) -> SchedulerStats:
        """This snapshot with nothing in flight (no request running, waiting or swapped,
        no session held, every block free) and its counters kept: what a dead engine's
        gauges read once its requests have failed."""
        return replace(self, num_running=0, num_waiting=0, num_queued_tokens=0,
                       kv_cache_usage=0.0, num_free_blocks=self.num_blocks, num_swapped=0,
                       num_free_host_blocks=self.num_host_blocks, num_waiting_by_tenant={},
                       num_sessions_held=0, num_session_blocks=0)


# The fields of SchedulerStats that only grow (Prometheus counters); the others are gauges.
COUNTER_FIELDS = (
    "num_steps", "num_preemptions", "num_recomputed_tokens", "num_scheduled_tokens",
    "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_preempted_queries",
    "prefix_cache_preempted_hits", "num_finished", "num_blocked_steps",
    "num_swapped_out_blocks", "num_swapped_in_blocks", "num_preemptions_by_mode",
    "num_prefill_only_steps", "num_session_hits", "num_session_hit_tokens",
    "session_releases", "num_guard_waits")
