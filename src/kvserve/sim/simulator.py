"""The event loop: the real Scheduler, a SimExecutor and a cost model on a virtual clock.

One step, exactly as in the engine (docs/architecture.md, "The one seam")::

    add arrivals whose time has come; abort cancellations whose time has come
    out = scheduler.schedule(now)
    model_output = executor.execute(out)          # tokens, and the batch's shape
    now += cost_model.step_time(out, executor.view)
    outputs = scheduler.update(out, model_output, now)

When nothing can run the clock jumps to the next arrival or cancellation. Batching modes:
``continuous`` hands every arrival to the scheduler at once; ``static`` holds arrivals in
the loop until the scheduler is empty, then hands over up to max_num_seqs of them (a batch
run to completion); ``serial`` does the same one request at a time. The scheduler itself is
never copied or bypassed: the modes only decide when a request reaches it.
"""

from __future__ import annotations

import gc
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence

from kvserve.core import (
    CacheConfig,
    ConfigError,
    QueueFullError,
    Request,
    RequestOutput,
    RequestRejected,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerEvent,
    SchedulerOutput,
    VictimPolicy,
    WaitingQueue,
    check_invariants,
)
from kvserve.core.decode_lane import DecodeLane
from kvserve.core.limits import check_servable_length
from kvserve.core.preemption import PreemptionPrices
from kvserve.core.request import EventType
from kvserve.core.sessions import SessionError
from kvserve.runs import RequestRecord, RunRecorder, SimResult, StepSeries
from kvserve.sim.conversations import ConversationGate, SessionEnds, take_due
from kvserve.sim.cost_models import CostModel, holds_recorded_steps, needs_block_layout
from kvserve.sim.executor import SimExecutor
from kvserve.sim.fast_forward import SimLaneModel
from kvserve.sim.layout import BlockLayout
from kvserve.sim.prompt_draws import PromptDraws, servable_answer
from kvserve.sim.trace import TraceRequest, check_trace

__all__ = ["BATCHING_MODES", "ProgressFn", "RequestRecord", "SimResult", "Simulator",
           "StepSeries"]

BATCHING_MODES = ("continuous", "static", "serial")
ProgressFn = Callable[[float, int, int], None]


class Simulator:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 cost_model: CostModel, *, seed: int = 0, batching: str = "continuous",
                 record_events: bool = False, check: bool = False,
                 preemption_prices: PreemptionPrices | None = None,
                 fast_forward: bool = True,
                 waiting_queue: Callable[[], WaitingQueue] | None = None,
                 victim_policy: Callable[[], VictimPolicy] | None = None) -> None:
        """``fast_forward``: advance steady decoders in bulk (the decode lane,
        docs/simulator-speed.md); the result is the same either way, only slower without.
        ``waiting_queue``, ``victim_policy``: makers (a class will do) of a policy of your
        own, called once per run, in place of the one ``scheduler_config`` names
        (docs/scheduler.md, "Your own policy")."""
        if batching not in BATCHING_MODES:
            raise ValueError(f"batching {batching!r} is not one of {', '.join(BATCHING_MODES)}")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.cost_model = cost_model
        self.seed = seed
        self.batching = batching
        self.record_events = record_events
        self.check = check
        self.preemption_prices = preemption_prices
        self.fast_forward = fast_forward
        for name, maker, kind in (("waiting_queue", waiting_queue, WaitingQueue),
                                  ("victim_policy", victim_policy, VictimPolicy)):
            if isinstance(maker, kind) or (maker is not None and not callable(maker)):
                raise ConfigError(f"{name} takes a maker of a {kind.__name__}, called once per "
                                  f"run (a fresh one each time): the class itself, or a "
                                  f"function returning one; got {type(maker).__name__}")
        self.waiting_queue = waiting_queue
        self.victim_policy = victim_policy

    def run(self, trace: Sequence[TraceRequest],
            progress: ProgressFn | None = None) -> SimResult:
        """Run ``trace`` with Python's cyclic garbage collector paused. A run makes no
        garbage cycles (its cycles, the free queue's linked blocks, live as long as it),
        yet the collector, triggered by allocations, kept traversing the young lists of
        token ids: about 100 passes, ~8% of sim_speed.py's run (docs/simulator-speed.md).
        Reference counting frees everything as before; the collector is back afterwards."""
        check_trace(trace)
        enabled = gc.isenabled()
        gc.disable()
        try:
            return SimRun(self, trace, progress).run()
        finally:
            if enabled:
                gc.enable()


class SimRun:
    """The state of one simulation: its scheduler, simulated executor and records.

    ``Simulator.run`` drives one over a whole trace. The cluster simulation
    (sim/cluster.py) makes one per replica, with no trace of its own, and drives it from
    outside: it hands requests to its scheduler and calls :meth:`refuse`, :meth:`cancel`,
    :meth:`collect` and :meth:`close_preempted_spans`, the methods public for that use."""

    def __init__(self, sim: Simulator, trace: Sequence[TraceRequest],
                 progress: ProgressFn | None) -> None:
        self.sim = sim
        self.scheduler = Scheduler(
            sim.scheduler_config, sim.cache_config, record_events=sim.record_events,
            preemption_prices=sim.preemption_prices,
            waiting_queue=None if sim.waiting_queue is None else sim.waiting_queue(),
            victim_policy=None if sim.victim_policy is None else sim.victim_policy())
        # The layout tracker costs a pass over the batch per step: only for a model using it.
        self.executor = SimExecutor(BlockLayout(sim.cache_config.block_size)
                                    if needs_block_layout(sim.cost_model) else None)
        if not holds_recorded_steps(sim.cost_model):
            trace = [r.at_receipt() for r in trace]
        self.arrivals = sorted(trace, key=lambda r: (r.arrival_time, r.request_id))
        # The prompt's bytes serve BLAKE2b's hashes (hash_prompt); builtin hashes the ids.
        self.draws = PromptDraws(self.arrivals, sim.seed,
                                 with_bytes=sim.cache_config.enable_prefix_caching
                                 and sim.cache_config.prefix_caching_hash_algo == "blake2b",
                                 max_model_len=sim.scheduler_config.max_model_len)
        self.recorder = RunRecorder(self.arrivals)
        self.cancels = sorted((r.cancel_time, r.request_id) for r in self.arrivals
                              if r.cancel_time is not None)
        self.next_arrival = self.next_cancel = 0  # indices of the next due event
        self.session_ends = SessionEnds(self.arrivals)
        self.arrived: set[str] = set()  # taken from the trace (a session end waits for it)
        self.held: deque[TraceRequest] = deque()  # arrived, not yet handed over (static)
        self.live: dict[str, Request] = {}
        self.session_fallbacks = 0  # session turns run as ordinary requests (see _submit)
        self.conversations = ConversationGate.for_trace(self.arrivals)  # None: no sessions
        self.finished: set[str] = set()  # membership only
        self.steps = StepSeries()
        self.events: list[SchedulerEvent] = []
        self.progress = progress

    @property
    def records(self) -> dict[str, RequestRecord]:
        return self.recorder.records

    @records.setter
    def records(self, records: dict[str, RequestRecord]) -> None:
        self.recorder.records = records  # a cluster's replicas share one table

    @property
    def itl(self) -> array:
        return self.recorder.itl

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> SimResult:
        wall_start = time.perf_counter()
        scheduler = self.scheduler
        now = start = end = self.arrivals[0].arrival_time if self.arrivals else 0.0
        num_empty = 0
        # A replayed engine log may hold a step until the time the engine decided it.
        step_start = getattr(self.sim.cost_model, "step_start", None)
        if step_start is None:
            self._start_lane()
        while True:
            if step_start is not None:
                now = step_start(now)
            self._take_due(now)
            self._hand_over()
            if scheduler.has_unfinished_requests():
                out = scheduler.schedule(now)
                if out.total_num_scheduled_tokens:
                    now = end = self._run_step(out, now)
                    num_empty = 0
                    continue
                # An empty step runs no model and takes no time. With requests running it
                # happens when a request preempted itself ahead of others (D3 ends the running
                # pass); the next schedule() goes on without it.
                self.collect(scheduler.update(out, self.executor.execute(out), now), now)
                if scheduler.running:
                    num_empty += 1
                    if num_empty > len(scheduler.running) + 1:
                        raise AssertionError(f"t={now}: {num_empty} empty steps in a row with "
                                             f"{len(scheduler.running)} requests running")
                    continue
                if not scheduler.has_unfinished_requests():
                    continue  # held arrivals may be handed over now
            upcoming = self._next_event_time(now)
            if upcoming is None:
                break  # done, or nothing can ever run again: those stay "unfinished"
            now = max(now, upcoming)
        # to the end of the last step: a refusal or a cancellation after it adds no time
        return self._result(start, end, wall_start)

    def _start_lane(self) -> None:
        """The decode lane, where it keeps every decision (core/decode_lane.py): not with
        per-step invariant checks, nor with a block layout to observe per request."""
        sim, scheduler = self.sim, self.scheduler
        if not sim.fast_forward or sim.check or self.executor.layout is not None or \
                not DecodeLane.supported(scheduler):
            return
        self.lane_model = SimLaneModel(self.executor, self.recorder)
        lane = DecodeLane(scheduler, self.lane_model)
        self.lane_model.lane = lane
        scheduler.lane = self.executor.lane = lane

    def _take_due(self, now: float) -> None:
        """Arrivals, cancellations and session ends whose time has come, in time order (a
        session end after the arrivals before it are handed over, as the engine applies an
        add and then a DELETE between its steps: the review, a turn in flight then was
        released before it came)."""
        for when, tenant, session_id in self.session_ends.due(now, self._arrived):
            self._take_arrivals(when)
            self._hand_over()
            self.end_session(tenant, session_id, when)
        self._take_arrivals(now)
        cancels = self.cancels
        while self.next_cancel < len(cancels) and cancels[self.next_cancel][0] <= now:
            self.cancel(cancels[self.next_cancel][1], now)
            self.next_cancel += 1

    def _take_arrivals(self, now: float) -> None:
        self.next_arrival = take_due(self.arrivals, self.next_arrival, now, self.conversations,
                                     self.finished, self.recorder.records, self._arrive)

    def _arrived(self, request_id: str) -> bool:
        """Taken from the trace, or gone before it came (cancelled)."""
        return request_id in self.arrived or request_id in self.finished

    def _arrive(self, request: TraceRequest) -> None:
        self.arrived.add(request.request_id)
        self.held.append(request)

    def _run_step(self, out: SchedulerOutput, now: float) -> float:
        """Execute, price and update one non-empty step; returns the clock after it."""
        scheduler, steps = self.scheduler, self.steps
        model_output = self.executor.execute(out)
        duration = self.sim.cost_model.step_time(out, self.executor.view)
        steps.time.append(now)
        start = now
        now += duration
        lane = scheduler.lane
        if lane is not None and lane.in_step:
            outputs = scheduler.update(out, model_output, now)
            self.lane_model.end_step(start, now, len(lane))
            self.collect(outputs, now)
        else:
            self.collect(scheduler.update(out, model_output, now), now)
        steps.duration.append(duration)
        steps.num_scheduled_tokens.append(out.total_num_scheduled_tokens)
        steps.sample_state(scheduler, len(self.held))
        if self.sim.check:
            check_invariants(scheduler)
        if self.sim.record_events:
            self.events.extend(scheduler.take_events())
        if self.progress is not None and len(steps.time) % 256 == 0:
            self.progress(now, len(self.finished), len(self.arrivals))
        return now

    def _result(self, start: float, end: float, wall_start: float) -> SimResult:
        if self.scheduler.lane is not None:
            self.scheduler.lane.flush()
        if self.sim.record_events:
            self.events.extend(self.scheduler.take_events())
        for request in self.live.values():
            self.close_preempted_spans(request)  # still running or waiting when the loop gave up
        result = self.recorder.result(
            self.arrivals, start, end, self.steps, self.scheduler.stats(), self.events,
            time.perf_counter() - wall_start,
            preemption_mode=self.sim.scheduler_config.preemption_mode,
            bytes_per_block=getattr(self.sim.preemption_prices, "bytes_per_block", 0),
            sessions_on=self.scheduler.sessions is not None)
        if result.sessions:
            result.sessions["session_fallbacks"] = self.session_fallbacks
            gate = self.conversations
            result.sessions["turns_deferred"] = gate.num_deferred if gate is not None else 0
        return result

    def _next_event_time(self, now: float) -> float | None:
        if self.conversations is not None and self.conversations.has_ready:
            return now  # a turn refused or cancelled: its session's next one comes now
        times = []
        if self.next_arrival < len(self.arrivals):
            times.append(self.arrivals[self.next_arrival].arrival_time)
        cancels, finished = self.cancels, self.finished
        while self.next_cancel < len(cancels) and cancels[self.next_cancel][1] in finished:
            self.next_cancel += 1  # a client timeout of a request already done never fires
        if self.next_cancel < len(cancels):
            times.append(cancels[self.next_cancel][0])
        if self.session_ends.next_time is not None:
            times.append(self.session_ends.next_time)
        return min(times) if times else None

    # -- requests in -----------------------------------------------------------------------

    def _hand_over(self) -> None:
        """Give held arrivals to the scheduler, as the batching mode allows."""
        mode = self.sim.batching
        if mode == "continuous":
            limit = len(self.held)
        elif self.scheduler.has_unfinished_requests():
            return
        else:
            limit = 1 if mode == "serial" else self.sim.scheduler_config.max_num_seqs
        while self.held and limit > 0:
            if self._submit(self.held.popleft()):
                limit -= 1  # a refused request takes no seat

    def _submit(self, trace_request: TraceRequest) -> bool:
        """Hand one request to the scheduler; False if it refused it."""
        seed = self.sim.seed
        request_id = trace_request.request_id
        config = self.sim.scheduler_config
        try:  # J1 on the length alone: a refused prompt's ids are never drawn
            check_servable_length(request_id, trace_request.num_prompt_tokens, config,
                                  self.sim.cache_config)
        except RequestRejected as error:
            self.refuse(request_id, error)
            return False
        trace_request = servable_answer(trace_request, config.max_model_len)
        sessions = self.scheduler.sessions is not None  # off: a trace's session ids are moot
        prompt, answer, prompt_bytes = self.draws.take(trace_request)
        request = Request(
            request_id, prompt,
            trace_request.sampling_params(self.sim.scheduler_config.max_model_len, sessions),
            arrival_time=trace_request.received)
        if prompt_bytes is not None:
            self.scheduler.kv.hash_prompt(request, prompt_bytes)
        answer = self.executor.register(request_id, request.num_prompt_tokens,
                                        trace_request.output_len, trace_request.ignore_eos,
                                        trace_request.continuation_key(seed), answer)
        # The blocks of the prompt and the answer hashed in one pass, not one at a time as
        # they fill: the decode lane then brings a member's tokens up to date only when it
        # finishes (core/decode_lane.py).
        self.scheduler.kv.hash_ahead(request, answer)
        try:
            try:
                self.scheduler.add_request(request)
            except SessionError:
                # A turn its session cannot take (its previous turn still runs, as an
                # open-loop trace allows) runs as an ordinary one.
                self.session_fallbacks += 1
                request = Request(request_id, request.prompt_token_ids, trace_request
                                  .sampling_params(self.sim.scheduler_config.max_model_len,
                                                   False),
                                  arrival_time=trace_request.received)
                self.scheduler.add_request(request)
        except (RequestRejected, QueueFullError) as error:
            self.refuse(request_id, error)
            return False
        self.live[request_id] = request
        return True

    def refuse(self, request_id: str, error: RequestRejected | QueueFullError) -> None:
        """A request refused before it queued: its record says why."""
        self.executor.forget(request_id)
        self.recorder.refuse(request_id, error)
        self.finished.add(request_id)
        if self.conversations is not None:
            self.conversations.ended(request_id)

    def end_session(self, tenant: str, session_id: str, now: float) -> None:
        """The client ended its session at ``now`` (a turn's ``session_end_time``, U8): its
        hold released, a turn in flight not held after (with sessions off, nothing)."""
        if self.scheduler.sessions is not None:
            self.scheduler.release_session(session_id, tenant, now=now)

    def cancel(self, request_id: str, now: float) -> None:
        """The client gave up on the request at ``now`` (its trace's cancel time): aborted
        wherever it is, unless it already finished."""
        if request_id in self.finished:
            return
        if request_id in self.live:
            metrics = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED,
                                                    stop_reason="cancelled", now=now)
            self.recorder.finish(request_id, "abort", "cancelled", metrics)
            self._forget(request_id)
            return
        for index, held in enumerate(self.held):
            if held.request_id == request_id:
                del self.held[index]
                break
        self.recorder.finish(request_id, "abort", "cancelled")
        self.finished.add(request_id)
        if self.conversations is not None:
            self.conversations.ended(request_id)

    # -- outputs ---------------------------------------------------------------------------

    def collect(self, outputs: list[RequestOutput], now: float) -> None:
        """A step's outputs into the records; the finished requests are forgotten."""
        for request_id in self.recorder.collect(outputs, now):
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        """A finished request (its record is written): drop its state here."""
        self.finished.add(request_id)
        if self.conversations is not None:
            self.conversations.ended(request_id)
        request = self.live.pop(request_id, None)
        if request is not None:
            self.close_preempted_spans(request)
        self.executor.forget(request_id)

    def close_preempted_spans(self, request: Request) -> None:
        """Preempted spans from the request's own event history: preempted -> resumed (or
        finished, if it never resumed)."""
        spans = self.records[request.request_id].preempted_spans
        opened = None
        for event in request.events:
            if event.type is EventType.PREEMPTED:
                opened = event.timestamp
            elif event.type in (EventType.RESUMED, EventType.FINISHED) and opened is not None:
                spans.append((opened, event.timestamp))
                opened = None
