"""The decode lane: steady decoders advanced in bulk, for a simulator (docs/simulator-speed.md).

A running request that decodes one token per step, at the front of ``running``, changes in a
way known in advance: its computed tokens grow by one a step, it appends the token its model
will sample, and nothing else happens to it until it needs a new KV block, fills one (the
prefix cache registers it), or stops. A model that can say which tokens it will sample (the
simulator's executor: :class:`LaneModel`) lets the scheduler keep such requests in a lane:
a prefix of ``running`` whose per-step work is one subtraction from the token budget. Each
member is brought up to date ("materialised") only at its own events, in running order at
the step they happen, exactly as the running pass and ``update`` would: a block grown or
filled (``grow_slots``), its last token (the stop checks and ``_finish``), or the lane
dissolving (anything else about to read it: a preemption that might pick it, an abort).

Every decision the scheduler takes is the one it takes without the lane, so a run's report is
byte-identical with the lane on or off (tests/sim/test_fast_forward.py). The lane only runs
where that is simple to keep: no invariant checks, the default admission policy, no urgent
preemption, no sessions holding KV, a queue whose step record is empty, no throttled or
prefills-only steps; before a step whose running pass could run out of blocks (and so
preempt) it dissolves and the step runs as usual.

The lane is part of the scheduler, in a file of its own: it takes the step's scratch state
(``_Step``) and reads the scheduler's private ``_now``, ``_length_limit``, ``_admission`` and
``_urgent`` and calls ``_finished_output``, on a path that runs every step. Renaming one of
those there means renaming it here (tests/sim/test_fast_forward.py fails otherwise).
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Protocol

from kvserve.core.request import Request, RequestStatus
from kvserve.core.stop import check_stop

if TYPE_CHECKING:
    from kvserve.core.outputs import RequestOutput
    from kvserve.core.scheduler import Scheduler, _Step

_RUNNING = RequestStatus.RUNNING


class LaneModel(Protocol):
    """What the lane needs from the model that samples a request's tokens."""

    def finish_count(self, request: Request, length_limit: int) -> int | None:
        """The output-token count at which the stop checks will finish ``request`` if it
        decodes on (None: the model cannot say; the request stays out of the lane)."""
        ...

    def tokens(self, request: Request, count: int) -> list[int]:
        """The next ``count`` tokens ``request`` samples after its current output."""
        ...

    def advance(self, request: Request, first_step: int, end_step: int) -> None:
        """``request`` decoded one token in each lane step in [first_step, end_step): bring
        the model's own per-request state up to date (the scheduler's is done)."""
        ...

    def can_join(self, request: Request, now: float) -> bool:
        """Whether the model's state of ``request`` is that of a steady decoder at ``now``."""
        ...


class _Member:
    __slots__ = ("end_step", "mark", "model_mark", "order", "request")

    def __init__(self, request: Request, order: int, mark: int, end_step: int) -> None:
        self.request = request
        self.order = order  # join order: running order among members
        self.mark = mark  # the lane step the request's state is current for (before it)
        self.model_mark = mark  # the same for the model's state of it
        self.end_step = end_step  # the lane step that samples its last token


class DecodeLane:
    """A prefix of ``scheduler.running`` advanced in bulk (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, model: LaneModel) -> None:
        self.scheduler = scheduler
        self.model = model
        self.members: list[_Member] = []
        self.by_id: dict[str, _Member] = {}
        self.step = 0  # lane steps begun so far; the index of the next one
        self.context = 0  # computed tokens of the members before the current step
        # Per lane step: the clock when it was scheduled and at its update (its tokens' time).
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.in_step = False  # between a lane step's begin_step and its update
        self._joined = 0
        self._events: dict[int, list[_Member]] = {}  # lane step -> block events
        self._finishes: dict[int, list[_Member]] = {}  # lane step -> last tokens
        kv = scheduler.kv
        self._block_size = kv.block_size
        self._caching = kv.enable_caching

    @staticmethod
    def supported(scheduler: Scheduler) -> bool:
        """Whether the lane keeps this scheduler's decisions (the module docstring)."""
        from kvserve.core.policies import AdmissionPolicy
        from kvserve.core.queues import WaitingQueue

        return (type(scheduler._admission) is AdmissionPolicy
                and scheduler.config.step_mix == "mixed"
                and scheduler._urgent is None
                and scheduler.sessions is None
                and type(scheduler.waiting).record_step is WaitingQueue.record_step)

    def __len__(self) -> int:
        return len(self.members)

    # -- schedule() --------------------------------------------------------------------

    def begin_step(self, step: _Step) -> int:
        """Called before the running pass: admit new members, grow the members' blocks due
        this step, take their tokens from the budget. Returns the lane's length (the
        running pass starts after it); 0 when the lane dissolved."""
        self._join()
        members = self.members
        if not members:
            return 0
        j = self.step
        due = self._events.pop(j, None)
        if not self._room_for_step(due):
            self.flush()
            return 0
        if due:
            grow_slots = self.scheduler.kv.grow_slots
            block_size = self._block_size
            due.sort(key=_order)
            whole = self._caching and block_size == 1  # a new block also fills one
            # Each member's next event (what _schedule_event finds from the step after):
            # after a fill, the new block it needs next step; after a new block, the step
            # it fills (prefix caching) or needs the one after.
            after_fill = j + 1
            after_new = j + 1 if whole else j + block_size - (1 if self._caching else 0)
            events = self._events
            for member in due:
                request = member.request
                num_computed = request.num_computed_tokens + j - member.mark
                new_only = num_computed % block_size == 0 and not whole
                if new_only or len(request.block_hashes) * block_size > num_computed:
                    # A new block, or a block that fills and whose hash is known already
                    # (KVCacheManager.hash_ahead): grow_slots reads the request's computed
                    # tokens, held blocks and hashes, not its tokens, so nothing else needs
                    # bringing up to date.
                    behind = request.num_computed_tokens
                    request.num_computed_tokens = num_computed
                    grown = grow_slots(request, 1)
                    request.num_computed_tokens = behind
                else:  # the last block fills: the prefix cache hashes its tokens
                    grown = grow_slots(self._materialise(member, j, whole=False), 1)
                when = after_new if new_only else after_fill
                if grown is None:
                    raise AssertionError(f"decode lane: {request.request_id} found no block "
                                         "after the room check")
                if when <= member.end_step:
                    following = events.get(when)
                    if following is None:
                        events[when] = [member]
                    else:
                        following.append(member)
        step.token_budget -= len(members)
        self.step = j + 1
        self.starts.append(self.scheduler._now)
        self.in_step = True
        return len(members)

    def _room_for_step(self, due: list[_Member] | None) -> bool:
        """True when this step's running pass cannot run out of blocks: the members that
        may take a new block, plus every other running request's whole remainder, fit in
        the free blocks. Otherwise a preemption could pick a member."""
        kv = self.scheduler.kv
        block_size = self._block_size
        needed = 0
        if due:
            step = self.step
            for m in due:
                if (m.request.num_computed_tokens + step - m.mark) % block_size == 0:
                    needed += 1
        for request in self.scheduler.running[len(self.members):]:
            held = len(kv.req_to_blocks.get(request.request_id, ()))
            total = len(request.prompt_token_ids) + len(request.output_token_ids)
            needed += max(0, -(-total // block_size) - held)
        return needed <= kv.pool.free_queue.num_free

    def _join(self) -> None:
        """Take the steady decoders that follow the lane in ``running`` into it."""
        scheduler = self.scheduler
        running = scheduler.running
        index = len(self.members)
        if index >= len(running):
            return
        now = scheduler._now
        model = self.model
        length_limit = scheduler._length_limit
        block_size = self._block_size
        j = self.step
        while index < len(running):
            request = running[index]
            num_computed = request.num_computed_tokens
            if (len(request.prompt_token_ids) + len(request.output_token_ids)
                    - num_computed != 1
                    or num_computed < request.max_computed_tokens
                    or request.preempted_time is not None
                    or request.last_token_time != now
                    or not model.can_join(request, now)):
                return
            finish = model.finish_count(request, length_limit)
            if finish is None:
                return
            member = _Member(request, self._joined, j,
                             j + finish - len(request.output_token_ids) - 1)
            self._joined += 1
            self.members.append(member)
            self.by_id[request.request_id] = member
            self.context += num_computed
            self._finishes.setdefault(member.end_step, []).append(member)
            self._schedule_event(member, j, num_computed, block_size)
            index += 1

    def _schedule_event(self, member: _Member, step: int, num_computed: int,
                        block_size: int) -> None:
        """The next lane step, from ``step`` on, at which the running pass would call
        grow_slots for the member: its computed tokens at a block boundary (a new block) or
        one short of it (the block fills and, with prefix caching, is registered)."""
        offset = num_computed % block_size
        if offset == 0 or (self._caching and offset == block_size - 1):
            wait = 0
        elif self._caching:
            wait = block_size - 1 - offset
        else:
            wait = block_size - offset
        when = step + wait
        if when <= member.end_step:
            self._events.setdefault(when, []).append(member)

    # -- update() ----------------------------------------------------------------------

    def finish_due(self, now: float, outputs: list[RequestOutput]) -> bool:
        """Called first in update() of a lane step: the members whose last token this step
        sampled go through the stop checks and finish, in running order. Returns whether
        any did."""
        self.in_step = False
        j = self.step - 1
        done = self._finishes.pop(j, None)
        if done:
            scheduler = self.scheduler
            length_limit = scheduler._length_limit
            done.sort(key=_order)
            for member in done:
                request = self._materialise(member, j)
                self.context -= request.num_computed_tokens
                request.num_computed_tokens += 1  # this step's commit
                if request.num_computed_tokens > request.max_computed_tokens:
                    request.max_computed_tokens = request.num_computed_tokens
                token_id = self.model.tokens(request, 1)[0]
                request.output_token_ids.append(token_id)
                status, stop_reason = check_stop(request, token_id, length_limit)
                if status is None:
                    raise AssertionError(f"decode lane: {request.request_id} did not stop "
                                         "at its predicted last token")
                request.last_token_time = now
                outputs.append(scheduler._finished_output(request, [token_id], status,
                                                          stop_reason, now))
                self._remove(member)
        self.context += len(self.members)
        self.ends.append(now)
        return bool(done)

    # -- bringing members up to date -----------------------------------------------------

    def _materialise(self, member: _Member, step: int, whole: bool = True) -> Request:
        """The member's state as of just before lane step ``step``: the request's, and
        unless not ``whole`` (a block to hash needs only the request's tokens) the
        model's."""
        request = member.request
        count = step - member.mark
        if count > 0:
            request.output_token_ids.extend(self.model.tokens(request, count))
            request.num_computed_tokens += count
            if request.num_computed_tokens > request.max_computed_tokens:
                request.max_computed_tokens = request.num_computed_tokens
            request.last_token_time = self.ends[step - 1]
            member.mark = step
        if whole and step > member.model_mark:
            self.model.advance(request, member.model_mark, step)
            member.model_mark = step
        return request

    def flush(self) -> None:
        """Bring every member up to date and empty the lane: the scheduler's ordinary path
        takes over (members stay where they are in ``running``)."""
        step = self.step
        for member in self.members:
            self._materialise(member, step)
        self.members = []
        self.by_id = {}
        self._events = {}
        self._finishes = {}
        self.context = 0

    def _remove(self, member: _Member) -> None:
        self.members.remove(member)
        del self.by_id[member.request.request_id]


_order = attrgetter("order")  # a member's place in running among members

