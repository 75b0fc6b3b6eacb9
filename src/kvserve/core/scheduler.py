"""The scheduler: continuous batching over a paged KV cache (spec D, F, H, J, K4).

One step is ``schedule(now)`` then ``update(output, model_output, now)``::

    schedule:  begin (expire queue deadlines and session holds; the decode lane's requests)
               -> running pass (grow each running request; preempt when the pool is short;
                  a throttled step's prefill chunks and a prefills-only step's decodes wait)
               -> admissions: swap-in pass (swapped requests come back, oldest swap first),
                  else waiting pass (held session turns, then the queue, while budget, seats
                  and blocks last; an urgent head may preempt), skipped after a preemption,
                  on a throttled step or while a request stays swapped out
               -> a prefills-only step that ran nothing runs the decodes after all
               -> end (the admission policy's step, commit: advance computed tokens, build
                  the plain-data output; fair share's charges)
    update:    append sampled tokens -> stop checks -> free finished requests

Everything is deterministic: time comes in as an argument, containers are lists and dicts,
and hashes are stable digests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvserve.core import outputs as core_outputs
from kvserve.core.block_pool import KVBlock
from kvserve.core.config import CacheConfig, SchedulerConfig
from kvserve.core.deadlines import QueueDeadlines
from kvserve.core.errors import ConfigError, InvariantError, RequestError
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.limits import (
    admission_blocks,
    check_queue_limits,
    check_servable,
    next_step_admits,
)
from kvserve.core.outputs import (
    CachedRequestData,
    NewRequestData,
    RequestMetrics,
    RequestOutput,
    SchedulerOutput,
    unfinished_output,
)
from kvserve.core.policies import VictimPolicy, make_admission_policy, make_victim_policy
from kvserve.core.preemption import (
    PRIORITY,
    RECOMPUTE,
    SWAP,
    PreemptionPrices,
    VictimGuard,
    make_preemption_mode,
    make_urgent_preemption,
)
from kvserve.core.queues import WaitingQueue, make_waiting_queue
from kvserve.core.request import EventType, Request, RequestStatus
from kvserve.core.sessions import DELETED, SessionStore
from kvserve.core.stop import DISPLACED, QUEUE_TIMEOUT, check_stop, length_stop_reason

if TYPE_CHECKING:
    from kvserve.core.decode_lane import DecodeLane
    from kvserve.core.outputs import ModelOutput

# The step outputs are imported by name; the observation types (events, stats) through the
# module, so this list is not core/__init__.py's export list over again.

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_SWAPPED = RequestStatus.SWAPPED
_NO_BLOCKS: list[KVBlock] = []  # shared, never stored: step.new_blocks keeps only non-empty
_NO_CAP = 1 << 62  # no request has this many tokens to compute
_NOTHING_IN_FLIGHT: dict[str, int] = {}  # read only: update() ran the step
_NO_SWAP_INS: set[str] = set()  # read only, shared: a step that swapped nothing in


def _checked_select(policy: VictimPolicy) -> Callable[[Sequence[Request]], int]:
    """A user's VictimPolicy.select, given a copy of ``running`` (QA: a policy that sorted
    the list in place reordered the scheduler's) and held to an index into it: None, -1, a
    float or one past the end was a livelock, a victim preempted twice over or a bare
    IndexError naming no policy (core fuzz)."""
    name = type(policy).__name__

    def select(running: Sequence[Request]) -> int:
        index = policy.select(tuple(running))
        if type(index) is not int or not 0 <= index < len(running):
            raise InvariantError(f"{name}.select() must return an index into running "
                                 f"(0 to {len(running) - 1}), got {index!r}")
        return index
    return select


def tokens_to_schedule(num_tokens: int, num_computed: int, long_prefill_threshold: int,
                       max_model_len: int) -> int:
    """D1 and D5: how many of a request's tokens one step computes, before the budget.

    The tokens still to compute (``num_tokens - num_computed``), capped by the long-prefill
    threshold (when > 0) and by ``max_model_len - num_computed - 1``. The token budget is
    the last cap, applied by each pass: the running pass cuts to it, the waiting pass cuts
    to it with chunked prefill on and stops otherwise (D4).

    With one token to compute (a decode) no cap can bind: a threshold that is on is >= 1,
    and an unfinished request has num_tokens < max_model_len (J1, J2). The running pass
    relies on this to skip the call for decodes.
    """
    num_new = num_tokens - num_computed
    if 0 < long_prefill_threshold < num_new:
        num_new = long_prefill_threshold
    if num_new > max_model_len - 1 - num_computed:
        num_new = max_model_len - 1 - num_computed
    return num_new


class _Step:
    """Scratch state of one schedule() call."""

    __slots__ = ("blocks_to_swap_in", "blocks_to_swap_out", "new_blocks", "new_request_ids",
                 "num_scheduled", "preempted", "swapped_in_ids", "token_budget")

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.num_scheduled: dict[str, int] = {}
        self.new_blocks: dict[str, list[KVBlock]] = {}
        self.new_request_ids: set[str] = set()  # admitted or swapped in: NewRequestData
        # (membership only, never iterated)
        self.preempted: list[Request] = []
        self.blocks_to_swap_out: list[tuple[int, int]] = []
        self.blocks_to_swap_in: list[tuple[int, int]] = []
        self.swapped_in_ids: set[str] = _NO_SWAP_INS  # whose blocks blocks_to_swap_in
        # copies (made on the first: a set a step is too many for the simulator's steps,
        # which rarely swap)

    def schedule(self, request: Request, num_tokens: int, new_blocks: list[KVBlock]) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        if new_blocks:
            self.new_blocks[request.request_id] = new_blocks
        self.token_budget -= num_tokens

    def unschedule(self, request: Request) -> None:
        """Give an already scheduled preemption victim's tokens back to the budget (F3)."""
        num_tokens = self.num_scheduled.pop(request.request_id, 0)
        self.new_blocks.pop(request.request_id, None)
        self.token_budget += num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, *,
                 record_events: bool = False,
                 preemption_prices: PreemptionPrices | None = None,
                 waiting_queue: WaitingQueue | None = None,
                 victim_policy: VictimPolicy | None = None) -> None:
        """``preemption_prices`` (the executor's recompute and copy costs) is needed by
        ``preemption_mode='auto'`` only (S4). ``waiting_queue`` and ``victim_policy``: a
        policy of your own in place of the one ``config`` names (an empty queue; docs/
        scheduler.md, "Your own policy"). Both are read here, once: assigning another
        afterwards changes nothing."""
        self.config = config
        self.cache_config = cache_config
        self.kv = KVCacheManager(cache_config, config.max_model_len, config.watermark,
                                 tenant_scoped=config.prefix_cache_scope == "tenant")
        for name, given, kind in (("waiting_queue", waiting_queue, WaitingQueue),
                                  ("victim_policy", victim_policy, VictimPolicy)):
            if given is not None and not isinstance(given, kind):
                what = f"the class {given.__name__}" if isinstance(given, type) else \
                    type(given).__name__
                raise ConfigError(f"{name} must be a {kind.__name__} object (an instance of "
                                  f"a subclass of kvserve.core.{kind.__name__}), got {what}")
        if waiting_queue is not None and len(waiting_queue):
            raise ConfigError("waiting_queue must be empty: requests enter through "
                              "add_request")
        self.waiting = waiting_queue if waiting_queue is not None else \
            make_waiting_queue(config.scheduling_policy, config)
        # Only an order that reads the cache or the clock is told of each pass (C4-C7).
        self._waiting_sorts = type(self.waiting).start_pass is not WaitingQueue.start_pass
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # oldest swap first (S2)
        # L1: waiting requests that hold KV (a session's next turn), drained first, in order
        self.held_waiting: deque[Request] = deque()
        self._held_ahead = 0  # held turns admitted ahead of the ordinary head since (L6)
        self.sessions = SessionStore(self.kv, config.max_session_kv, config.session_ttl_s,
                                     self._emit_session) if config.max_session_kv > 0 else None
        self.requests: dict[str, Request] = {}
        select = make_victim_policy(config).select if victim_policy is None else \
            _checked_select(victim_policy)
        self._victims = VictimGuard(config.max_preemptions_per_request, select)
        self._preemption_mode = make_preemption_mode(config, cache_config, preemption_prices)
        # _urgent, _admission, _length_limit and _now are read by the decode lane too
        # (core/decode_lane.py, a part of the scheduler in a file of its own)
        self._urgent = make_urgent_preemption(config, self.kv)
        self._admission = make_admission_policy(config, self.kv)
        self._length_limit = self.kv.max_sequence_tokens  # J2
        self._max_model_len = config.max_model_len
        self._long_prefill_threshold = config.long_prefill_token_threshold
        self._queue_deadlines = QueueDeadlines()
        self._finished_since_last_step: list[str] = []
        self._pending_outputs: list[RequestOutput] = []
        # the last schedule()'s tokens per request until its update(): computed on paper,
        # not yet written (what a request ended in between, by a failed step, never wrote)
        self._in_flight: dict[str, int] = {}
        self._swapped_ids_in_flight: set[str] = _NO_SWAP_INS  # whose blocks its copy fills
        self._events: list[core_outputs.SchedulerEvent] | None = [] if record_events else None
        self._blocked_reason: dict[str, str] = {}
        self._now = 0.0
        self.prefill_capacity_bound = False  # N3
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_preemptions_by_mode = {RECOMPUTE: 0, SWAP: 0, PRIORITY: 0}
        self.num_recomputed_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_finished: dict[str, int] = {}
        self.num_blocked_steps: dict[str, int] = {}
        # P2: running requests' steps without tokens because no victim qualified, and the
        # step each such request last waited (a wait is logged on its first step)
        self.num_guard_waits = 0
        self._guard_waited: dict[str, int] = {}
        # Steady decoders advanced in bulk: a simulator's option (core/decode_lane.py).
        self.lane: DecodeLane | None = None
        # Q2: prefills-only steps (step_mix "prefill-first"), in all and in a row now.
        self.num_prefill_only_steps = 0
        self.num_prefill_only_in_a_row = 0

    # -- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request, or raise and record nothing (J1, K4)."""
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.output_token_ids:
            raise RequestError(f"request {request.request_id} is not a fresh request")
        if request.sampling_params.n != 1:
            raise RequestError(f"request {request.request_id}: n={request.sampling_params.n}; "
                               "a request is one sequence (LLM.generate and the server add "
                               "one request per sample)")
        sessions, session = self.sessions, None
        self.expire_sessions(request.arrival_time)  # U6: no turn takes a hold past its ttl
        if request.sampling_params.session_id is not None:
            if sessions is None:
                raise RequestError(f"request {request.request_id}: sessions are off on this "
                                   "server (max_session_kv is 0, flag --max-session-kv)")
            session = sessions.check_turn(request)  # U3, U4
        if request.sampling_params.max_tokens is None:  # J1: what the context leaves
            room = max(1, self.config.max_model_len - request.num_prompt_tokens)
            request.sampling_params = dataclasses.replace(request.sampling_params,
                                                          max_tokens=room)
        check_servable(request, self.config, self.cache_config)
        if not self.requests:
            self._admission.idle()  # K2: an adaptive reserve starts over, as SGLang's
        admissible = self._admissible_next() if self.config.bounds_queue else ()
        for victim in check_queue_limits(request, self.waiting, self.config,
                                         admissible):  # K4, K5
            self._displace(victim, request)
        self.requests[request.request_id] = request
        reason = ""
        if sessions is not None and request.sampling_params.session_id is not None:
            with self._between_steps(request.arrival_time):  # a replaced hold's release (U3)
                held = sessions.start_turn(request, session)
        else:
            held = False
        if held:
            tenant = request.sampling_params.tenant
            if not any(r.sampling_params.tenant == tenant for r in self.held_waiting):
                self.waiting.arrived_elsewhere(request)  # T2: a returning tenant is lifted
            self.held_waiting.append(request)  # L1
            reason = f"held by a session ({request.num_computed_tokens} tokens)"
        else:
            self.waiting.push(request)
        request.record(EventType.ARRIVED, request.arrival_time)
        delay = request.sampling_params.max_queue_delay
        if delay is None:
            delay = self.config.max_queue_delay
        if delay is not None:
            self._queue_deadlines.add(request, request.arrival_time + delay)
        self._emit(request.arrival_time, EventType.ARRIVED, request, request.num_tokens, reason)

    def abort(self, request_id: str, now: float | None = None) -> bool:
        """Abort a request in any state and free everything it holds (H4).

        Idempotent: an unknown or already finished id is a no-op that returns False.
        """
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED, now=now) \
            is not None

    def finish_request(self, request_id: str, status: RequestStatus, *,
                       stop_reason: int | str | None = None,
                       now: float | None = None) -> RequestMetrics | None:
        """Finish a request from outside the stop checks (abort, a matched stop string)."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        if self.lane is not None:
            self.lane.flush()
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is _RUNNING:
            self.running.remove(request)
        elif request.status is _SWAPPED:
            self.swapped.remove(request)
        else:
            self._remove_waiting(request)
        return self._finish(request, status, self._now if now is None else now, stop_reason)

    def _finish(self, request: Request, status: RequestStatus, now: float,
                stop_reason: int | str | None = None) -> RequestMetrics:
        """Mark finished and free its blocks; the caller has taken it out of its queue."""
        request.status = status
        request.stop_reason = stop_reason
        # ended in the step that scheduled it (an abort after a failed step): what that step
        # registered was never written (QA: the next request with its prompt read it)
        in_flight = self._in_flight.get(request.request_id)
        if in_flight:
            # swapped in by that step: its host-to-device copy never ran either (QA)
            written = 0 if request.request_id in self._swapped_ids_in_flight else \
                request.num_computed_tokens - in_flight
            self.kv.forget_uncomputed(request, written)
            request.num_computed_tokens = written  # all a session may hold of it (U2; QA)
        held = None
        if self.sessions is not None and request.sampling_params.session_id is not None:
            held = self.sessions.end_turn(request, now)  # U2: a completed turn's KV stays
        self.kv.free(request)
        request.record(EventType.FINISHED, now)
        del self.requests[request.request_id]
        self._blocked_reason.pop(request.request_id, None)
        if self._guard_waited:
            self._guard_waited.pop(request.request_id, None)
        self._finished_since_last_step.append(request.request_id)
        reason = status.finish_reason or "error"
        self.num_finished[reason] = self.num_finished.get(reason, 0) + 1
        self._emit(now, EventType.FINISHED, request, request.num_output_tokens,
                   str(stop_reason) if stop_reason is not None else reason)
        return RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finished_time=now,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions,
            num_recomputed_tokens=request.num_recomputed_tokens,
            longest_stall=request.longest_stall,
            num_swaps=request.num_swaps,
            session_held_tokens=held,
        )

    # -- schedule() ------------------------------------------------------------------------

    def schedule(self, now: float, throttle: bool = False) -> SchedulerOutput:
        """Choose this step's work under one token budget (D1-D8).

        ``throttle`` comes from a data-parallel coordinator whose ranks step in lockstep:
        when this step defers prefills (N1), running prefill chunks and admissions wait and
        decodes fill the step (N2).
        """
        step, num_lane = self._begin_step(now)
        defer_prefills = throttle and self._should_defer_prefills()
        prefills_only = not defer_prefills and self._prefills_only_step()
        self._schedule_running(step, 1 if defer_prefills else _NO_CAP, num_lane, prefills_only)
        self._schedule_admissions(step, defer_prefills)
        if prefills_only:
            self._end_prefills_only(step, num_lane)
        else:
            self.num_prefill_only_in_a_row = 0  # Q1: the decodes ran
        if not defer_prefills:
            self.prefill_capacity_bound = bool(self.waiting) or bool(self.held_waiting)  # N3
        return self._end_step(step, num_lane)

    def _begin_step(self, now: float) -> tuple[_Step, int]:
        """The step's clock, the deadlines and session holds past it (K4, U6), and its
        token budget with the decode lane's requests scheduled (their count)."""
        self._now = now
        self._expire_queue_deadlines(now)
        self.expire_sessions(now)  # U6
        step = _Step(self.config.max_num_batched_tokens)
        return step, self.lane.begin_step(step) if self.lane is not None else 0

    def _schedule_admissions(self, step: _Step, defer_prefills: bool) -> None:
        """Pass 2: swapped requests back (S2), else the waiting queues; none after a
        preemption (D4) or on a step deferring prefills (N2)."""
        if step.preempted:
            self._note_blocked("preemption")
        elif defer_prefills:
            self._note_blocked("prefill_throttle")
        elif self.swapped and self._schedule_swapped(step) and not self._swaps_outranked():
            self._note_blocked("swapped")  # S2: a swapped request goes before any admission
        else:
            self._schedule_waiting(step)

    def _end_step(self, step: _Step, num_lane: int) -> SchedulerOutput:
        """The admission policy's step (K2), the plain-data output, and fair share's charges
        for it (T3)."""
        self._admission.end_step(len(step.preempted), self.running)
        output = self._commit(step, num_lane)
        self.waiting.record_step(self.running, output.num_scheduled_tokens)  # T3
        self.waiting.forget_idle(self._live_tenants)  # T2's unreadable accounts
        if step.blocks_to_swap_in:
            self.kv.end_step()  # S2: only now may a swap-out reuse the host blocks read
        return output

    def _prefills_only_step(self) -> bool:
        """Q1: under prefill-first, a step runs prefills only while some are pending (a
        request waits, or a running one is mid-prefill) and some running request decodes,
        unless the bound on such steps in a row is reached."""
        config = self.config
        if config.step_mix != "prefill-first":
            return False
        limit = config.max_prefill_only_steps
        if limit and self.num_prefill_only_in_a_row >= limit:
            return False
        decoding = False
        prefilling = bool(self.waiting) or bool(self.held_waiting)
        for request in self.running:
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new == 1:
                decoding = True
            elif num_new > 1:
                prefilling = True
            if decoding and prefilling:
                return True
        return False

    def _end_prefills_only(self, step: _Step, num_lane: int) -> None:
        """Q3: a prefills-only step that found nothing to run (no room to admit, the queue's
        head not ready, its one chunk preempted) runs as a mixed step: the decodes go after
        all. Otherwise it is counted (Q1's bound, Q2's metric)."""
        if not step.num_scheduled:
            self._schedule_running(step, _NO_CAP, num_lane)
            self.num_prefill_only_in_a_row = 0
        else:
            self.num_prefill_only_in_a_row += 1
            self.num_prefill_only_steps += 1

    def _should_defer_prefills(self) -> bool:
        """N1: defer unless capacity-bound or nothing is decoding (it would idle the rank)."""
        return not self.prefill_capacity_bound and any(
            request.num_tokens - request.num_computed_tokens == 1 for request in self.running)

    def _schedule_running(self, step: _Step, max_new: int = _NO_CAP, start: int = 0,
                          skip_decodes: bool = False) -> None:
        """Pass 1 (D2, D3): grow every running request, preempting when the pool is short.
        A request with more than ``max_new`` tokens to compute (a prefill chunk on a throttled
        step, N2) waits for a later step, and so does a decode with ``skip_decodes`` (a
        prefills-only step, Q2). The first ``start`` requests are the decode lane, already
        scheduled."""
        running = self.running
        threshold = self._long_prefill_threshold
        max_model_len = self._max_model_len
        grow_slots, block_size = self.kv.grow_slots, self.kv.block_size
        num_scheduled, new_blocks_of = step.num_scheduled, step.new_blocks
        # This loop runs for every running request every step, so step.schedule() is written
        # inline, a decode skips the tokens_to_schedule() call and the caps (it returns 1 for
        # one token; the budget and max_new are >= 1), and the budget and running count live
        # in locals, brought up to date around the preemption path, which reads and changes
        # them.
        budget = step.token_budget
        num_running = len(running)
        index = start
        while index < num_running and budget > 0:
            request = running[index]
            num_computed = request.num_computed_tokens
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            num_new = num_tokens - num_computed
            if num_new != 1:
                if num_new > max_new:
                    index += 1
                    continue
                num_new = tokens_to_schedule(num_tokens, num_computed, threshold,
                                             max_model_len)
                if num_new > budget:
                    num_new = budget
            elif skip_decodes:
                index += 1
                continue
            if num_new <= 0:
                index += 1
                continue
            offset = num_computed % block_size
            if offset and offset + num_new < block_size:
                # The tokens stay inside the request's last, partly filled block, which it
                # holds (I2), without filling it: grow_slots would allocate nothing and
                # register nothing (E5). Most decode steps end here, without the call.
                new_blocks = _NO_BLOCKS
            else:
                new_blocks = grow_slots(request, num_new)
            if new_blocks is None:
                step.token_budget = budget
                new_blocks, index = self._preempt_until_fits(request, num_new, index, step)
                budget, num_running = step.token_budget, len(running)
                if new_blocks is None:
                    if request.status is _RUNNING:
                        self._guard_wait(request)  # P2: no victim qualifies; it waits,
                        index += 1  # holding its blocks
                        continue
                    break  # the request preempted itself: nothing later runs this step
            num_scheduled[request.request_id] = num_new
            if new_blocks:
                new_blocks_of[request.request_id] = new_blocks
            budget -= num_new
            index += 1
        step.token_budget = budget

    def _guard_wait(self, request: Request) -> None:
        """P2 holds ``request`` back this step: counted, and logged ``blocked`` with reason
        ``preemption_guard`` on the first step of each wait (QA: a stream froze with nothing
        counted or logged)."""
        self.num_guard_waits += 1
        last = self._guard_waited.get(request.request_id)
        self._guard_waited[request.request_id] = self.num_steps
        if self._events is not None and last != self.num_steps - 1:
            self._emit(self._now, EventType.BLOCKED, request, request.num_tokens,
                       "preemption_guard")

    def _preempt_until_fits(self, request: Request, num_new: int, index: int,
                            step: _Step) -> tuple[list[KVBlock] | None, int]:
        """Preempt victims until ``request`` fits or is itself the victim (F1-F5), or no
        victim qualifies (P2).

        Returns the new blocks (None if the request preempted itself or must wait) and the
        loop index, moved back when a victim stood before it in ``running``. Held sessions'
        KV goes first (U7): nobody is preempted while a session holds blocks.
        """
        if self.lane is not None and len(self.lane):
            raise AssertionError("a preemption with the decode lane formed")
        while self._release_session_kv():
            new_blocks = self.kv.grow_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks, index
        while True:
            victim_index = self._victims.victim_index(self.running, request)
            if victim_index is None:
                return None, index
            victim = self.running.pop(victim_index)
            if victim_index < index:
                index -= 1
                step.unschedule(victim)
            self._preempt(victim, step)
            if victim is request:
                return None, index
            new_blocks = self.kv.grow_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks, index

    def _preempt(self, request: Request, step: _Step, cause: str = "") -> None:
        """Move its KV to the host tier (S1) or free all its blocks and send it back to the
        waiting queue (F4), as the preemption mode chooses; ``cause`` is "priority" for an
        urgent arrival (M1)."""
        num_tokens = request.num_computed_tokens
        self.kv.forget_uncomputed(request)  # scheduled this step: its blocks are not written
        mode, reason = self._preemption_mode.choose(request, self.kv)
        pairs = self.kv.swap_out(request) if mode == SWAP else None
        if pairs is not None:
            request.status = _SWAPPED
            request.num_swaps += 1
            self.swapped.append(request)
            step.blocks_to_swap_out += pairs
        else:
            if mode == SWAP:
                mode, reason = RECOMPUTE, f"{RECOMPUTE} (host tier full)"  # S3
            self.kv.free(request)
            request.status = _PREEMPTED
            request.num_computed_tokens = 0
            self.waiting.push_front(request)
        request.num_preemptions += 1
        if request.preempted_time is None:
            request.preempted_time = self._now
        request.record(EventType.PREEMPTED, self._now)
        step.preempted.append(request)
        self.num_preemptions += 1
        self.num_preemptions_by_mode[mode] += 1
        if cause:
            self.num_preemptions_by_mode[cause] += 1
            reason = f"{cause}:{reason}"
        self._emit(self._now, EventType.PREEMPTED, request, num_tokens, reason)

    def _schedule_swapped(self, step: _Step) -> bool:
        """Swap-in pass (S2): bring swapped requests back, oldest swap first, into newly
        allocated device blocks. Returns True if one is left, which blocks admission."""
        swapped = self.swapped
        config = self.config
        while swapped:
            if step.token_budget <= 0 or len(self.running) >= config.max_num_seqs:
                return True
            request = swapped[0]
            num_new = min(step.token_budget, tokens_to_schedule(
                request.num_tokens, request.num_computed_tokens, self._long_prefill_threshold,
                config.max_model_len))
            swapped_in = self.kv.swap_in(request, num_new)
            while swapped_in is None and self._release_session_kv():  # U7
                swapped_in = self.kv.swap_in(request, num_new)
            if swapped_in is None:
                return True
            pairs, blocks = swapped_in
            swapped.popleft()
            request.status = _RUNNING
            self.running.append(request)
            step.schedule(request, num_new, blocks)
            step.new_request_ids.add(request.request_id)
            step.blocks_to_swap_in += pairs
            if step.swapped_in_ids is _NO_SWAP_INS:
                step.swapped_in_ids = set()
            step.swapped_in_ids.add(request.request_id)
            self._blocked_reason.pop(request.request_id, None)
            request.record(EventType.RESUMED, self._now)
            self._emit(self._now, EventType.RESUMED, request, num_new, SWAP)
        return False

    def set_not_ready(self, request_id: str, reason: str | None) -> None:
        """Mark a waiting request not ready (``reason``: what it waits for) or ready again
        (None): the waiting pass skips it without blocking the queue (L2)."""
        request = self.requests.get(request_id)
        if request is None:
            raise RequestError(f"request {request_id!r} is not waiting in the queue")
        if reason is None:  # ready: always taken (QA: refused once the request ran)
            request.not_ready_reason = None
            return
        if not isinstance(reason, str) or not reason:
            raise RequestError(f"set_not_ready: reason must be a non-empty string (what the "
                               f"request waits for) or None, got {reason!r}")
        if request.status in (_RUNNING, RequestStatus.SWAPPED):
            raise RequestError(f"request {request_id!r} is not waiting in the queue")
        if request in self.held_waiting:  # QA: it was admitted regardless (L2 ignored)
            raise RequestError(f"request {request_id!r} is a session turn waiting with its "
                               "session's KV (L1): it is admitted as soon as it fits and "
                               "cannot wait not ready")
        request.not_ready_reason = reason

    def _schedule_waiting(self, step: _Step) -> None:
        """Pass 2 (D4-D6, L2): admit from the head of the queue until something stops us;
        requests not ready yet are set aside for the pass and put back in their places."""
        if not self.held_waiting and not self.waiting:
            return
        # K2's reservation for what runs now, before either queue admits (QA: the held pass
        # read the one of a step long gone, refused a turn that fit on every step, and the
        # ordinary queue behind it waited for ever)
        self._admission.start_pass(self.running)
        if self.held_waiting and not self._admit_held(step):
            return  # L1: the ordinary queue waits behind a held turn that does not fit
        if not self.waiting:
            return
        skipped: list[Request] = []
        self._admit_waiting(step, skipped)
        if skipped:
            self.num_blocked_steps["not_ready"] = self.num_blocked_steps.get("not_ready", 0) + 1
            push_front = self.waiting.push_front
            for request in reversed(skipped):  # L2: back at the front, in their order
                push_front(request)

    def _admit_waiting(self, step: _Step, skipped: list[Request]) -> None:
        """Stopping at the first ready request that does not fit is head-of-line blocking,
        on purpose: skipping ahead would starve long prompts."""
        config = self.config
        if self._waiting_sorts and step.token_budget > 0 and \
                len(self.running) < config.max_num_seqs:
            lifted = self.waiting.start_pass(self.kv, self._now)  # only when it may admit
            if lifted and self._events is not None:  # C7
                for request in lifted:
                    self._emit(self._now, EventType.PROMOTED, request, request.num_tokens,
                               "aging")
        while self.waiting:
            request = self.waiting.peek()
            if request.not_ready_reason is not None:
                self.waiting.remove(request)  # not pop: a fair-share queue charges a pop (T3)
                self._skip_not_ready(request, skipped)
                continue
            if step.token_budget <= 0:
                self._note_blocked("token_budget")
                return
            if len(self.running) >= config.max_num_seqs:
                if self._urgent is None or not self._admit_urgent(step):
                    self._note_blocked("max_num_seqs")
                return
            hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = self._admission_tokens(request, num_hit_tokens, step.token_budget)
            if num_new is None:
                self._note_blocked("token_budget")
                return
            demoted: list[Request] = []  # U7's, queued again once the head is out
            new_blocks = self._allocate_admission(request, num_new, hit_blocks, demoted)
            if new_blocks is None:
                self._requeue_demoted(demoted)
                if self._urgent is None or not self._admit_urgent(step):
                    self._note_blocked(self._refused_room(request, num_new, hit_blocks))
                return
            popped = self.waiting.pop()
            self._requeue_demoted(demoted)
            if popped is not request:
                raise InvariantError(f"{type(self.waiting).__name__}.pop() took request "
                                     f"{getattr(popped, 'request_id', popped)!r}, not "
                                     f"{request.request_id!r}, the head its peek() gave")
            self._held_ahead = 0  # L6: the ordinary queue served
            self._admit(request, num_new, num_hit_tokens, new_blocks, step)

    def _allocate_admission(self, request: Request, num_new: int,
                            hit_blocks: list[KVBlock],
                            demoted: list[Request] | None = None) -> list[KVBlock] | None:
        """allocate_slots for an admission (E1-E5, K2), releasing held sessions' KV oldest
        first while it does not fit (U7); held turns it demotes go to ``demoted`` where
        given, else back to the ordinary queue's front."""
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new, hit_blocks,
                                                **self._admission_limits(request))
            if new_blocks is not None or \
                    not self._release_session_kv(keep=request, demoted=demoted):
                return new_blocks

    def _admission_limits(self, request: Request) -> dict[str, Any]:
        """What an admission keeps free beyond its own blocks (E2, E3, K2)."""
        return {"apply_watermark": bool(self.running),
                "full_sequence_must_fit": self.config.reserve_full_sequence,
                "reserved_blocks": self._admission.reserved_blocks(request)}

    def _refused_room(self, request: Request, num_new: int,
                      hit_blocks: Sequence[KVBlock]) -> str:
        """The ``blocked`` reason of an admission the pool refused: ``kv_cache``, or the
        watermark or admission reserve alone that stood in the way."""
        return self.kv.refusal_reason(request, num_new, hit_blocks,
                                      **self._admission_limits(request))

    def _requeue_demoted(self, demoted: list[Request]) -> None:
        for request in demoted:
            self.waiting.push_front(request)

    def _release_session_kv(self, keep: Request | None = None,
                            demoted: list[Request] | None = None) -> bool:
        """U7, under memory pressure: release the oldest held session, or else turn the
        newest held waiting turn (other than ``keep``) back into an ordinary request whose
        blocks go back to the pool, still cached: to the ordinary queue's front, or to
        ``demoted`` for the caller to queue once it has taken the head it is admitting
        (QA: pushed in front of it, the turn was popped in its place and lost)."""
        sessions = self.sessions
        if sessions is None:
            return False
        if sessions.release_oldest():
            return True
        for request in reversed(self.held_waiting):
            if request is not keep:
                self.held_waiting.remove(request)
                sessions.demoted(request)
                self.kv.free(request)
                request.num_computed_tokens = 0
                if demoted is None:
                    self.waiting.push_front(request)
                else:
                    demoted.append(request)
                return True
        return False

    def _admit_held(self, step: _Step) -> bool:
        """L1: admit the waiting requests that hold KV, in arrival order, before the
        ordinary queue; each prefills only the tokens its held KV lacks (U3). False if one
        does not fit: the pass stops there. A held turn goes first only while the ordinary
        queue's head does not outrank it (:meth:`_outranked`: L5, T8)."""
        config, held = self.config, self.held_waiting
        while held:
            request = held[0]
            if self._outranked(request):
                return True  # L5: the more urgent ordinary request first
            if step.token_budget <= 0 or len(self.running) >= config.max_num_seqs:
                self._note_blocked("token_budget" if step.token_budget <= 0
                                   else "max_num_seqs", request)
                return False
            num_held = request.num_computed_tokens
            num_new = self._admission_tokens(request, num_held, step.token_budget)
            if num_new is None:
                self._note_blocked("token_budget", request)
                return False
            new_blocks = self._allocate_admission(request, num_new, _NO_BLOCKS)
            if new_blocks is None:
                self._note_blocked(self._refused_room(request, num_new, _NO_BLOCKS), request)
                return False
            if held and held[0] is request:  # still the head: nothing demoted it
                held.popleft()
                # L6: one more admitted ahead of the ordinary queue's head, if one waits
                self._held_ahead = self._held_ahead + 1 if self.waiting else 0
                assert self.sessions is not None
                self.sessions.note_hit(num_held)
                self.waiting.charge_admission(request)  # T8
                self._admit(request, num_new, num_held, new_blocks, step)
        return True

    def _swaps_outranked(self) -> bool:
        """S2, as L5: under the priority policy a waiting head more urgent than every
        request still swapped out is admitted (or preempts, M1) without waiting for them;
        a swapped victim of an urgent arrival held the next urgent one back."""
        return self.config.scheduling_policy == "priority" and bool(self.waiting) and \
            self.waiting.peek().priority < min(r.priority for r in self.swapped)

    def _outranked(self, request: Request) -> bool:
        """Whether the ordinary queue's head goes before ``request`` (a held turn), which
        then waits behind it: once max_held_first held turns went ahead of it, unless it is
        less urgent (L6); under the priority policy when the head is more urgent (L5);
        under fair share, at one priority, when the head's tenant was served less (T8)."""
        if not self.waiting:
            return False
        head = self.waiting.peek()
        limit = self.config.max_held_first
        if limit and self._held_ahead >= limit and not (  # L6, never against urgency (QA)
                self.config.scheduling_policy == "priority" and head.priority > request.priority):
            return True
        if self.config.scheduling_policy == "priority" and head.priority != request.priority:
            return head.priority < request.priority
        return self.waiting.served_less(head.sampling_params.tenant,
                                        request.sampling_params.tenant)

    def _skip_not_ready(self, request: Request, skipped: list[Request]) -> None:
        """L2: set aside for this pass; logged once per reason, as a blocked head is."""
        skipped.append(request)
        self._log_blocked(request, f"not_ready: {request.not_ready_reason}")

    def _admission_tokens(self, request: Request, num_computed: int,
                          token_budget: int) -> int | None:
        """D4, for the passes that admit (waiting, held, urgent): the tokens of
        ``request``'s first step from ``num_computed`` on (D1, D5), cut to the budget with
        chunked prefill on; None when they do not fit and chunked prefill is off."""
        num_new = tokens_to_schedule(request.num_tokens, num_computed,
                                     self._long_prefill_threshold, self._max_model_len)
        if num_new <= token_budget:
            return num_new
        return token_budget if self.config.enable_chunked_prefill else None

    def _admit_urgent(self, step: _Step) -> bool:
        """M1-M3: preempt the least urgent running requests that qualify until the head of
        the waiting queue fits, and admit it; False (and nothing preempted) if they cannot
        make room. The waiting pass then ends: the step admits nothing else."""
        request = self.waiting.peek()
        hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
        num_new = self._admission_tokens(request, num_hit_tokens, step.token_budget)
        if num_new is None:
            return False
        assert self._urgent is not None
        limits = self._admission_limits(request)  # for the victims' choice; asked again below

        def find_victims(also_released: dict[int, int] | None = None) -> list[Request]:
            assert self._urgent is not None
            return self._urgent.victims(
                request, self.running, num_new, hit_blocks,
                full_sequence_must_fit=limits["full_sequence_must_fit"],
                reserved_blocks=limits["reserved_blocks"], admitted=step.new_request_ids,
                also_released=also_released)

        def held_kv_helps(victims: list[Request]) -> bool:
            """U7 before M1's second victim (the seat needs one; QA: two preempted while an
            idle session kept 4 blocks), and where no victim set makes room now but one
            would with every held block released too (a dry run: QA, the holds were
            released where even that left no room, and the KV was lost for nothing)."""
            if len(victims) > 1:
                return True
            if victims or self.sessions is None or not self.sessions.held:
                return False
            held: dict[int, int] = {}
            for session in self.sessions.held.values():
                for block in session.blocks:
                    held[block.block_id] = held.get(block.block_id, 0) + 1
            return bool(find_victims(held))

        victims = find_victims()
        while held_kv_helps(victims) and self.sessions is not None and \
                self.sessions.release_oldest():
            victims = find_victims()
        if not victims:
            return False
        for victim in victims:
            self.running.remove(victim)
            step.unschedule(victim)
            self._preempt(victim, step, PRIORITY)
        new_blocks = self.kv.allocate_slots(  # the watermark by what runs once they left
            request, num_new, hit_blocks, **self._admission_limits(request))
        if new_blocks is None:
            raise AssertionError(f"M2: {request.request_id} does not fit after preempting "
                                 f"{[v.request_id for v in victims]}")
        self.waiting.pop()
        self._admit(request, num_new, num_hit_tokens, new_blocks, step)
        return True

    def _admit(self, request: Request, num_new: int, num_hit_tokens: int,
               new_blocks: list[KVBlock], step: _Step) -> None:
        """Move an allocated request from waiting to the tail of running (D6)."""
        self.kv.record_prefix_cache_stats(request, num_hit_tokens)
        self._admission.admitted(request)
        resumed = request.status is _PREEMPTED
        request.status = _RUNNING
        request.num_computed_tokens = num_hit_tokens
        self.running.append(request)
        step.schedule(request, num_new, new_blocks)
        step.new_request_ids.add(request.request_id)
        self._blocked_reason.pop(request.request_id, None)
        if resumed:
            kind = EventType.RESUMED
        else:
            kind = EventType.ADMITTED
            request.num_cached_tokens = num_hit_tokens
            request.first_scheduled_time = self._now
        request.record(kind, self._now)
        self._emit(self._now, kind, request, num_new)

    def _note_blocked(self, reason: str, head: Request | None = None) -> None:
        """The waiting pass stopped with requests left: count it, and log the head request
        (the held queue's first, L1, or ``head``) once per reason."""
        if head is None:
            if self.held_waiting:
                head = self.held_waiting[0]  # L1: the real head of the line
            elif self.waiting:
                head = self.waiting.peek()
            else:
                return
        self.num_blocked_steps[reason] = self.num_blocked_steps.get(reason, 0) + 1
        self._log_blocked(head, reason)

    def _log_blocked(self, request: Request, reason: str) -> None:
        """A BLOCKED event for ``request``, once per reason while it stays blocked by it."""
        if self._events is not None and self._blocked_reason.get(request.request_id) != reason:
            self._blocked_reason[request.request_id] = reason
            self._emit(self._now, EventType.BLOCKED, request, request.num_tokens, reason)

    def expire_sessions(self, now: float) -> int:
        """U6 at each step and between steps (an idle engine, an arrival): release the held
        sessions whose ttl ran out by ``now``, their events at ``now`` (the last step's
        time, which they carried, was before a recording began: QA); how many."""
        sessions = self.sessions
        if sessions is None or now < sessions.next_expiry:
            return 0
        before = len(sessions.held)
        with self._between_steps(now):
            sessions.expire(now)
        return before - len(sessions.held)

    @contextlib.contextmanager
    def _between_steps(self, now: float | None) -> Iterator[None]:
        """Events made between steps are stamped ``now`` (None: the last step's time), and
        the step's own time is kept for it."""
        decided = self._now
        if now is not None:
            self._now = now
        try:
            yield
        finally:
            self._now = decided

    def _expire_queue_deadlines(self, now: float) -> None:
        """Abort requests that waited past their queue deadline before first running (K4)."""
        deadlines = self._queue_deadlines
        for request in deadlines.expired(now):
            if self._waits_for_first_run(request):
                self._abort_waiting(request, now, QUEUE_TIMEOUT)
        deadlines.compact(self._waits_for_first_run, len(self.requests))

    def _waits_for_first_run(self, request: Request) -> bool:
        """Whether ``request`` is live and was never scheduled (not a later request that
        reused its id)."""
        return self.requests.get(request.request_id) is request and \
            request.first_scheduled_time is None

    def _admissible_next(self) -> list[Request]:
        """K4: the waiting requests the next step would admit as things stand: the seats,
        token budget and free blocks left once the running requests take their next tokens
        (a decode's one, a prefill's next chunk: QA, counted as one, a long prompt's chunk
        that took the whole budget let 6 requests past a limit of 1) with a block each kept
        back, or what the admission policy keeps for their growth (K2), and the held and
        swapped ones resume, taken from the head of the queue until one does not fit (D4;
        :func:`~kvserve.core.limits.next_step_admits`). These are not a backlog, so the
        queue limits do not count them."""
        config, kv, admission = self.config, self.kv, self._admission
        seats = config.max_num_seqs - len(self.running) - len(self.held_waiting) - \
            len(self.swapped)
        admissible: list[Request] = []
        if seats <= 0:
            return admissible  # a busy engine, the common case: no walk of the queue
        # at least one token each: a decode whose step is under way has none left to compute
        threshold, max_model_len = self._long_prefill_threshold, self._max_model_len
        budget = config.max_num_batched_tokens - sum(
            max(1, tokens_to_schedule(r.num_tokens, r.num_computed_tokens, threshold,
                                      max_model_len)) for r in self.running)
        # a block each for the running requests' next tokens, or what the admission policy
        # keeps for their growth (the review: both counted, a busy engine's queue head was
        # taken for backlog); the held and swapped ones' blocks as a new prompt's
        blocks, reserved = kv.num_free_blocks, sum(
            max(1, admission.held_growth(r)) for r in self.running)
        for request in (*self.held_waiting, *self.swapped):
            taken, kept = admission_blocks(request.num_tokens, admission.growth_blocks(request),
                                           kv.block_size)
            blocks, reserved = blocks - taken, reserved + kept
        if budget <= 0 or blocks - reserved <= 0:
            return admissible
        count = next_step_admits(((r.num_tokens, admission.growth_blocks(r))
                                  for r in self.waiting), seats, budget, blocks,
                                 kv.block_size, kv.watermark_blocks, bool(self.running),
                                 config.enable_chunked_prefill, reserved)
        return list(itertools.islice(self.waiting, count))

    def _displace(self, victim: Request, by: Request) -> None:
        """K5: end a waiting request a more urgent arrival takes the place of (the server
        answers it 503, as if the queue had been full when it came)."""
        self._abort_waiting(victim, max(by.arrival_time, victim.arrival_time), DISPLACED)

    def _abort_waiting(self, request: Request, now: float, stop_reason: str) -> None:
        """End a request that never left the queue; its output says why (``stop_reason``)."""
        self._remove_waiting(request)
        metrics = self._finish(request, RequestStatus.FINISHED_ABORTED, now, stop_reason)
        self._pending_outputs.append(RequestOutput(
            request.request_id, [], finished=True, finish_reason="abort",
            stop_reason=stop_reason, metrics=metrics))

    def _remove_waiting(self, request: Request) -> None:
        if self.held_waiting and request in self.held_waiting:
            self.held_waiting.remove(request)
        else:
            self.waiting.remove(request)

    def release_session(self, session_id: str, tenant: str | None = None,
                        now: float | None = None) -> int:
        """End sessions early (U8, ``DELETE /v1/sessions/{id}``): ``tenant``'s session of
        that id, or every tenant's (None: an operator). A held one's KV goes back to the
        pool; a turn in flight runs on but its KV is not held. Returns how many ended.
        ``now``: the time its events carry (None: the last step's; the record -> replay
        pass: a recording placed a DELETE on an idle engine at the turn's hold)."""
        sessions = self.sessions
        if sessions is None:
            return 0
        keys = [(tenant, session_id)] if tenant is not None else \
            [key for key in sessions.sessions if key[1] == session_id]
        with self._between_steps(now):
            return sum(sessions.release(key, DELETED) for key in keys)

    def _emit_session(self, kind: str, request_id: str, num_tokens: int, reason: str) -> None:
        if self._events is not None:
            self._events.append(core_outputs.SchedulerEvent(
                self._now, EventType(kind), request_id, num_tokens, reason))

    def _commit(self, step: _Step, num_lane: int = 0) -> SchedulerOutput:
        """Advance num_computed_tokens of every scheduled request (D7) and build the output,
        in running order, which is batch order. The first ``num_lane`` running requests are
        the decode lane: counted in the total, advanced by the lane itself."""
        num_scheduled = step.num_scheduled
        total = sum(num_scheduled.values()) + num_lane
        if total > self.config.max_num_batched_tokens or \
                len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"step over its limits (D8): {total} tokens, "
                                 f"{len(self.running)} running")
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        block_ids = self.kv.get_block_ids
        new_ids, new_blocks_of = step.new_request_ids, step.new_blocks
        # Bound appends: this loop runs for every running request every step.
        append_id = cached.request_ids.append
        append_new_block_ids = cached.new_block_ids.append
        append_num_computed = cached.num_computed_tokens.append
        for request in (self.running[num_lane:] if num_lane else self.running):
            request_id = request.request_id
            num_new = num_scheduled.get(request_id)
            if num_new is None:
                continue
            num_computed = request.num_computed_tokens
            if request_id in new_ids:
                new_reqs.append(NewRequestData(
                    request_id, request.all_token_ids, request.num_prompt_tokens,
                    block_ids(request_id), num_computed, request.num_preemptions > 0,
                    request.sampling_params))
            else:
                append_id(request_id)
                blocks = new_blocks_of.get(request_id)
                append_new_block_ids([b.block_id for b in blocks] if blocks else [])
                append_num_computed(num_computed)
            # D7, counting tokens whose KV had been computed before a preemption (B3)
            end = num_computed + num_new
            high_water = request.max_computed_tokens
            if num_computed < high_water:
                self._count_recomputed(request, min(end, high_water) - num_computed)
            if end > high_water:
                request.max_computed_tokens = end
            request.num_computed_tokens = end
        self.num_steps += 1
        self.num_scheduled_tokens += total
        self._in_flight = num_scheduled
        self._swapped_ids_in_flight = step.swapped_in_ids
        finished_ids, self._finished_since_last_step = self._finished_since_last_step, []
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            preempted_req_ids=[r.request_id for r in step.preempted],
            finished_req_ids=finished_ids,
            blocks_to_swap_out=step.blocks_to_swap_out,
            blocks_to_swap_in=step.blocks_to_swap_in,
        )

    def _count_recomputed(self, request: Request, num_tokens: int) -> None:
        request.num_recomputed_tokens += num_tokens
        self.num_recomputed_tokens += num_tokens

    # -- update() --------------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput, model_output: ModelOutput,
               now: float) -> list[RequestOutput]:
        """Append sampled tokens, run stop checks and free what finished (H1-H3, J2)."""
        self._now = now
        self._in_flight = _NOTHING_IN_FLIGHT
        outputs, self._pending_outputs = self._pending_outputs, []
        sampled = model_output.sampled_token_ids
        requests = self.requests
        length_limit = self._length_limit
        append_output = outputs.append
        any_finished = False
        if self.lane is not None and self.lane.in_step:
            any_finished = self.lane.finish_due(now, outputs)
        for request_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(request_id)
            if request is None or request.status is not _RUNNING:
                continue  # aborted after this step was scheduled
            token_ids = sampled.get(request_id)
            if request.num_computed_tokens < len(request.prompt_token_ids) + \
                    len(request.output_token_ids):
                if token_ids:
                    raise ValueError(f"executor sampled {token_ids} for request {request_id} "
                                     "in the middle of its prompt")
                continue
            if not token_ids:
                raise ValueError(f"executor returned no token for request {request_id}, "
                                 "whose scheduled tokens reached the end of its sequence")
            if request.first_token_time is None or request.preempted_time is not None:
                self._note_token_after_gap(request, now)
            # H2: append, then the stop checks. One token is the usual step of a decoding
            # request and is written inline: this loop runs for every running request every
            # step, where a call was about 2% of the simulator's time.
            if len(token_ids) == 1:
                request.output_token_ids.append(token_ids[0])
                status, stop_reason = check_stop(request, token_ids[0], length_limit)
            else:
                token_ids, status, stop_reason = self._append_tokens(request, token_ids)
            request.last_token_time = now
            if status is None:
                append_output(unfinished_output(request_id, token_ids))
            else:
                append_output(self._finished_output(request, token_ids, status, stop_reason,
                                                    now))
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    @staticmethod
    def _note_token_after_gap(request: Request, now: float) -> None:
        """A request's first token, or its first since a preemption: close the stall (B3)."""
        if request.first_token_time is None:
            request.first_token_time = now
        if request.preempted_time is not None:
            request.longest_stall = max(request.longest_stall, now - request.preempted_time)
            request.preempted_time = None

    def _append_tokens(self, request: Request, token_ids: list[int],
                       ) -> tuple[list[int], RequestStatus | None, int | None]:
        """Several tokens in one step (H2): append until one stops the request; the tokens
        after a stop are dropped. Returns the tokens kept and check_stop()'s verdict."""
        output_token_ids = request.output_token_ids
        kept: list[int] = []
        status, stop_reason = None, None
        for token_id in token_ids:
            output_token_ids.append(token_id)
            kept.append(token_id)
            status, stop_reason = check_stop(request, token_id, self._length_limit)
            if status is not None:
                break
        return kept, status, stop_reason

    def _finished_output(self, request: Request, new_token_ids: list[int],
                         status: RequestStatus, stop_reason: int | str | None,
                         now: float) -> RequestOutput:
        if status is RequestStatus.FINISHED_LENGTH_CAPPED:
            stop_reason = length_stop_reason(request, self._length_limit, self._max_model_len)
        metrics = self._finish(request, status, now, stop_reason)
        return RequestOutput(request.request_id, new_token_ids, True, status.finish_reason,
                             stop_reason, metrics)

    # -- observation -----------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash; refused (False) while any request holds blocks."""
        return self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def _live_tenants(self) -> set[str]:
        """The tenants of the requests not finished: waiting, running, swapped or held."""
        return {request.sampling_params.tenant for request in self.requests.values()}

    def _emit(self, time: float, kind: EventType, request: Request, num_tokens: int = 0,
              reason: str = "") -> None:
        if self._events is not None:
            self._events.append(core_outputs.SchedulerEvent(time, kind, request.request_id,
                                                            num_tokens, reason))

    def withdraw_events(self, request_ids: Iterable[str]) -> None:
        """Take back the events not yet taken of requests the caller added and undid at once
        (a group of ``n`` the queue refused part of): in no event log, as they are in no
        trace (QA: a recording's replay read such an arrival as one still in flight at its
        end, and stopped there)."""
        if self._events:
            ids = set(request_ids)
            self._events = [e for e in self._events if e.request_id not in ids]

    def take_events(self) -> list[core_outputs.SchedulerEvent]:
        """Scheduling events since the last call (empty unless ``record_events``)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def _waiting_by_tenant(self) -> dict[str, int]:
        counts = dict(self.waiting.num_by_tenant)
        for request in self.held_waiting:  # L1: session turns wait too
            tenant = request.sampling_params.tenant
            counts[tenant] = counts.get(tenant, 0) + 1
        return counts

    def stats(self) -> core_outputs.SchedulerStats:
        return core_outputs.SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.held_waiting),
            num_queued_tokens=self.waiting.num_tokens,
            kv_cache_usage=self.kv.usage(),
            num_free_blocks=self.kv.num_free_blocks,
            num_blocks=self.kv.num_blocks,
            num_steps=self.num_steps,
            num_preemptions=self.num_preemptions,
            num_recomputed_tokens=self.num_recomputed_tokens,
            num_scheduled_tokens=self.num_scheduled_tokens,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            prefix_cache_preempted_queries=self.kv.prefix_cache_preempted_queries,
            prefix_cache_preempted_hits=self.kv.prefix_cache_preempted_hits,
            num_finished=dict(self.num_finished),
            num_blocked_steps=dict(self.num_blocked_steps),
            num_guard_waits=self.num_guard_waits,
            num_swapped=len(self.swapped),
            num_host_blocks=self.kv.host_pool.num_blocks,
            num_free_host_blocks=self.kv.host_pool.num_free_blocks,
            num_swapped_out_blocks=self.kv.num_swapped_out_blocks,
            num_swapped_in_blocks=self.kv.num_swapped_in_blocks,
            num_preemptions_by_mode=dict(self.num_preemptions_by_mode),
            num_prefill_only_steps=self.num_prefill_only_steps,
            num_waiting_by_tenant=self._waiting_by_tenant(),
            **(self.sessions.stats() if self.sessions is not None else {}),
        )
