"""A cluster of data-parallel replicas on one virtual clock (``kvserve simulate
--data-parallel-size N --router P``).

Each replica is a whole simulated engine: its own Scheduler, KV pool, SimExecutor and cost
model. An arrival is routed the moment it arrives by the same router object the server uses
(:mod:`kvserve.core.router`), from each replica's queue and KV usage as they stand then; it
reaches its replica's scheduler at that replica's next step boundary, as a request reaches a
busy engine. Until then it counts as waiting there, so a burst does not all see one idle
replica.

A recording of replicas (docs/recording.md) replays with ``router`` ``recorded``: each request
goes to the replica the server placed it on (the trace's ``replica``), and with the replay
cost model each replica replays its own engine's step log, each step held to its logged
start, as one engine's replay is (so the replicas make the server's decisions, step for step).

Two ways of stepping:

- independent (default): every replica steps on its own, as separate engines do;
- lockstep: all replicas step together and a step lasts as long as the slowest replica's,
  as data-parallel attention with expert-parallel MoE layers does. There the coordinator may
  throttle prefills (spec N): with ``prefill_schedule_interval`` K > 1, only every K-th step
  admits or continues prefills on ranks that have decodes to run, so the ranks' long prefill
  steps coincide instead of each one stretching everybody's decode step in turn.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.core import (
    ModelOutput,
    QueueFullError,
    Request,
    RequestRejected,
    Scheduler,
    SchedulerOutput,
    check_invariants,
)
from kvserve.core.limits import check_servable_length
from kvserve.core.prefix_cache import first_block_key, prompt_block_hashes
from kvserve.core.router import (
    DEFAULT_IMBALANCE_BOUND,
    ROUTER_POLICIES,
    ReplicaLoad,
    RouteDecision,
    make_router,
)
from kvserve.core.sessions import SessionError
from kvserve.sim.conversations import ConversationGate, SessionEnds, take_due
from kvserve.sim.cost_models import CostModel, holds_recorded_steps
from kvserve.sim.prompt_draws import SessionChains
from kvserve.sim.simulator import (
    ProgressFn,
    RequestRecord,
    SimResult,
    SimRun,
    Simulator,
    StepSeries,
)
from kvserve.sim.trace import TraceRequest, check_trace

# The simulator's routers: the server's, and the placement a recording holds.
SIM_ROUTERS = (*ROUTER_POLICIES, "recorded")
# Each simulated replica holds its own scheduler and KV pool: a count past this ran for
# minutes into gigabytes before it said anything (QA); vLLM deployments stay far below it.
MAX_REPLICAS = 1024


@dataclass(frozen=True)
class ClusterOptions:
    data_parallel_size: int = 1
    router: str = "least-loaded"
    lockstep: bool = False
    prefill_schedule_interval: int = 1
    imbalance_bound: int = DEFAULT_IMBALANCE_BOUND

    def __post_init__(self) -> None:
        if isinstance(self.data_parallel_size, bool) or self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got "
                             f"{self.data_parallel_size}")
        if self.data_parallel_size > MAX_REPLICAS:
            raise ValueError(f"--data-parallel-size {self.data_parallel_size}: at most "
                             f"{MAX_REPLICAS} replicas are simulated (each holds its own "
                             "scheduler and KV pool)")
        if self.router not in SIM_ROUTERS:
            raise ValueError(f"--router {self.router!r}: choose from "
                             f"{', '.join(SIM_ROUTERS)}")
        if self.prefill_schedule_interval < 1:
            raise ValueError(f"--prefill-schedule-interval must be >= 1, got "
                             f"{self.prefill_schedule_interval}")
        if self.prefill_schedule_interval > 1 and not self.lockstep:
            raise ValueError("--prefill-schedule-interval throttles ranks that step in "
                             "lockstep: add --data-parallel-lockstep")
        if self.imbalance_bound < 0:
            raise ValueError(f"--router-imbalance-bound must be >= 0, got "
                             f"{self.imbalance_bound}")

    def describe(self) -> dict[str, object]:
        return {"size": self.data_parallel_size, "router": self.router,
                "lockstep": self.lockstep,
                "prefill_schedule_interval": self.prefill_schedule_interval,
                "imbalance_bound": self.imbalance_bound}


@dataclass
class ClusterResult(SimResult):
    """The whole cluster as one SimResult (figures over every request and every replica's
    steps; its time series sums running and waiting and averages KV usage over replicas),
    plus each replica's own result and where each request went."""

    replicas: list[SimResult] = field(default_factory=list)
    replica_of: dict[str, int] = field(default_factory=dict)
    route_reasons: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Flight:
    """A replica's step between its start and its end."""

    start: float
    duration: float
    out: SchedulerOutput
    model_output: ModelOutput


class _Replica:
    """One engine of the cluster: a simulator run fed by the router instead of a trace."""

    def __init__(self, index: int, sim: Simulator, cost_model: CostModel,
                 records: dict) -> None:
        self.index = index
        self.run = SimRun(sim, (), None)
        self.run.records = records  # shared: each replica writes its own requests' rows
        self.cost_model = cost_model
        self.inbox: list[Request] = []
        self.pending_cancels: list[str] = []
        # session ends not applied yet: (requests in the inbox before it, time, tenant, id)
        self.pending_session_ends: list[tuple[int, float, str, str]] = []
        self.flight: _Flight | None = None
        self.request_ids: list[str] = []
        # the router's decision for each request in the inbox, withdrawn where this
        # replica refuses it (R7, as the server's DataParallelEngine does)
        self.routes: dict[str, tuple[RouteDecision, Sequence[Any], Any]] = {}
        self.withdraw: Callable[[RouteDecision, Sequence[Any], Any], None] | None = None

    @property
    def scheduler(self) -> Scheduler:
        return self.run.scheduler

    def load(self) -> ReplicaLoad:
        scheduler = self.run.scheduler  # the server's load: its stats' num_waiting (held
        # session turns too) and the adds not yet applied (engine/data_parallel.py)
        return ReplicaLoad(self.index, True, len(scheduler.running),
                           len(scheduler.waiting) + len(scheduler.held_waiting)
                           + len(self.inbox), scheduler.kv.usage())

    def has_work(self) -> bool:
        return bool(self.inbox) or bool(self.pending_session_ends) or \
            self.run.scheduler.has_unfinished_requests()

    def held_until(self, now: float) -> float:
        """When this replica's next step may start: ``now``, or later where a replayed log
        holds the step to the time the engine decided it."""
        step_start = getattr(self.cost_model, "step_start", None)
        return now if step_start is None else step_start(now)

    def hand_over(self) -> None:
        """Requests routed here since the last step boundary enter the scheduler, and the
        session ends that came meanwhile, each after the requests before it."""
        ends = self.pending_session_ends
        for position, request in enumerate(self.inbox):
            while ends and ends[0][0] <= position:
                self._end_session(*ends.pop(0)[1:])
            self._take(request)
        while ends:
            self._end_session(*ends.pop(0)[1:])
        self.inbox.clear()

    def _end_session(self, now: float, tenant: str, session_id: str) -> None:
        self.run.end_session(tenant, session_id, now)

    def _take(self, request: Request) -> None:
        """``request`` into the scheduler (a turn its session cannot take, as an ordinary
        one), or refused."""
        run = self.run
        try:
            try:
                run.scheduler.add_request(request)
            except SessionError:
                # A turn this replica's session cannot take runs as an ordinary one,
                # as on one engine (SimRun._submit).
                run.session_fallbacks += 1
                request = Request(request.request_id, request.prompt_token_ids,
                                  dataclasses.replace(request.sampling_params,
                                                      session_id=None, session_ttl=None),
                                  arrival_time=request.arrival_time)
                run.scheduler.add_request(request)
        except (RequestRejected, QueueFullError) as error:
            run.refuse(request.request_id, error)
            route = self.routes.pop(request.request_id, None)
            if route is not None and self.withdraw is not None:
                self.withdraw(*route)
            return
        self.routes.pop(request.request_id, None)
        run.live[request.request_id] = request

    def cancel(self, request_id: str, now: float) -> None:
        for index, request in enumerate(self.inbox):
            if request.request_id == request_id:
                del self.inbox[index]
                self.routes.pop(request_id, None)
                self.run.executor.forget(request_id)
                record = self.run.records[request_id]
                record.finish_reason, record.stop_reason = "abort", "cancelled"
                self.run.finished.add(request_id)
                if self.run.conversations is not None:
                    self.run.conversations.ended(request_id)
                return
        if self.flight is not None:
            self.pending_cancels.append(request_id)
        else:
            self.run.cancel(request_id, now)

    def end_session(self, tenant: str, session_id: str, now: float) -> None:
        """The client ended a session (U8): applied at the next hand-over, after the
        requests routed here before it (the engine applies an add and then a DELETE between
        its steps, in the order they came: the review, a turn in flight then was released
        before it came)."""
        self.pending_session_ends.append((len(self.inbox), now, tenant, session_id))

    def start(self, now: float, throttle: bool) -> _Flight | None:
        """Schedule one step at ``now``; None when it scheduled nothing (then it is over)."""
        run = self.run
        scheduler = run.scheduler
        for _ in range(len(scheduler.running) + 2):
            out = scheduler.schedule(now, throttle=throttle)
            model_output = run.executor.execute(out)
            if out.total_num_scheduled_tokens:
                return _Flight(now, self.cost_model.step_time(out, run.executor.view), out,
                               model_output)
            # An empty step runs no model (see Simulator.run): update and try again while
            # a request preempted itself ahead of others.
            run.collect(scheduler.update(out, model_output, now), now)
            if not scheduler.running or throttle:
                return None
        raise AssertionError(f"replica {self.index} at t={now}: empty steps in a row with "
                             f"{len(scheduler.running)} requests running")

    def finish(self, flight: _Flight, end: float, check: bool) -> None:
        run, scheduler, steps = self.run, self.run.scheduler, self.run.steps
        run.collect(scheduler.update(flight.out, flight.model_output, end), end)
        steps.time.append(flight.start)
        steps.duration.append(end - flight.start)
        steps.num_scheduled_tokens.append(flight.out.total_num_scheduled_tokens)
        steps.sample_state(scheduler, len(self.inbox))  # as one engine's series
        if check:
            check_invariants(scheduler)
        if run.sim.record_events:
            run.events.extend(scheduler.take_events())
        for request_id in self.pending_cancels:
            run.cancel(request_id, end)
        self.pending_cancels.clear()


def check_recorded_placement(trace: Sequence[TraceRequest], size: int) -> None:
    """``--router recorded`` needs every request's replica, below ``size`` (ValueError naming
    the first request that has none or another)."""
    for request in trace:
        if request.replica is None:
            raise ValueError(f"--router recorded places each request on the replica a "
                             f"recording of replicas names; request {request.request_id!r} "
                             "names none")
        if request.replica >= size:
            raise ValueError(f"--router recorded: request {request.request_id!r} was on "
                             f"replica {request.replica}, past --data-parallel-size {size}")


class ClusterSimulator:
    def __init__(self, sim: Simulator, options: ClusterOptions,
                 cost_models: Sequence[CostModel]) -> None:
        if sim.batching != "continuous":
            raise ValueError(f"--batching {sim.batching} holds arrivals in one engine; a "
                             f"cluster simulation needs continuous batching")
        if len(cost_models) != options.data_parallel_size:
            raise ValueError("one cost model per replica")
        replayed = any(getattr(m, "step_start", None) is not None for m in cost_models)
        if replayed and (options.lockstep or options.router != "recorded"
                         or len({id(m) for m in cost_models}) < len(cost_models)):
            raise ValueError("a replayed step log is one engine's: a cluster replays a "
                             "recording of replicas, each replica its own engine's log, "
                             "with --router recorded and independent steps")
        self.sim = sim
        self.options = options
        self.cost_models = list(cost_models)

    def run(self, trace: Sequence[TraceRequest],
            progress: ProgressFn | None = None) -> ClusterResult:
        check_trace(trace)
        return _ClusterRun(self, trace, progress).run()


class _ClusterRun:
    def __init__(self, cluster: ClusterSimulator, trace: Sequence[TraceRequest],
                 progress: ProgressFn | None) -> None:
        sim, options = cluster.sim, cluster.options
        self.sim, self.options, self.progress = sim, options, progress
        if not all(holds_recorded_steps(model) for model in cluster.cost_models):
            trace = [r.at_receipt() for r in trace]
        self.arrivals = sorted(trace, key=lambda r: (r.arrival_time, r.request_id))
        self.records = {r.request_id: RequestRecord(r.request_id, r.received,
                                                    r.num_prompt_tokens, deadline=r.deadline,
                                                    tenant=r.tenant)
                        for r in self.arrivals}
        self.replicas = [_Replica(i, sim, cost_model, self.records)
                         for i, cost_model in enumerate(cluster.cost_models)]
        # A conversation's next turn waits for its previous one, on whichever replica it ran
        # (closed loop, as on one engine: kvserve.sim.conversations).
        self.conversations = ConversationGate.for_trace(self.arrivals)
        for replica in self.replicas:
            replica.run.conversations = self.conversations
        # Each replica holds its own sessions' KV (U1-U8): a turn routed to a replica that
        # does not hold its session starts one there, as on the server's replicas.
        self.sessions_on = self.replicas[0].scheduler.sessions is not None
        self.chains = SessionChains(sim.seed)  # a recording's turns, as their client sent them
        self.router = None if options.router == "recorded" else \
            make_router(options.router, options.data_parallel_size,
                        imbalance_bound=options.imbalance_bound)
        if self.router is None:
            check_recorded_placement(self.arrivals, options.data_parallel_size)
        else:
            for replica in self.replicas:
                replica.withdraw = self._withdraw
        self.hash_prefixes = options.router == "prefix-affinity"
        # the replicas' prefix caches salt the first block by tenant under this scope (T7)
        self.tenant_scoped = sim.scheduler_config.prefix_cache_scope == "tenant"
        self.block_size = sim.cache_config.block_size
        self.cancels = sorted((r.cancel_time, r.request_id) for r in self.arrivals
                              if r.cancel_time is not None)
        self.next_arrival = self.next_cancel = 0
        self.session_ends = SessionEnds(self.arrivals)
        self.cancelled_early: set[str] = set()  # membership only
        self.replica_of: dict[str, int] = {}
        self.route_reasons: dict[str, int] = {}
        self.series = StepSeries()
        self.num_steps = 0
        self.last_step_end = 0.0
        # Independent stepping: steps in flight by (end, replica), replicas to try to start.
        self.ends: list[tuple[float, int]] = []
        self.wakeups: list[int] = []
        self.holds: list[tuple[float, int]] = []  # replicas held to a replayed step's start
        self.held: set[int] = set()
        # Each replica's (running, waiting, KV usage) as last seen, and their sums, so a
        # cluster-wide sample costs O(1) however many replicas there are.
        self.state = [(0, 0, 0.0)] * options.data_parallel_size
        self.totals = [0, 0, 0.0]

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> ClusterResult:
        wall_start = time.perf_counter()
        now = start = self.arrivals[0].arrival_time if self.arrivals else 0.0
        step = self._step_lockstep if self.options.lockstep else self._step_independent
        while True:
            self._take_due(now)
            upcoming = step(now)
            if upcoming is None:
                break
            now = max(now, upcoming)
        # to the end of the last step: a refusal or a cancellation after it adds no time
        return self._result(start, max(start, self.last_step_end), wall_start)

    def _step_independent(self, now: float) -> float | None:
        """Start a step on every idle replica that may have work (one that just finished a
        step, or got a request or a cancellation); the time of the next event."""
        ends, holds = self.ends, self.holds
        while holds and holds[0][0] <= now:
            index = heapq.heappop(holds)[1]
            self.held.discard(index)
            self._wake(index)
        for index in sorted(self.wakeups):
            replica = self.replicas[index]
            if replica.flight is None and replica.has_work() and index not in self.held:
                start = replica.held_until(now)
                if start > now:
                    heapq.heappush(holds, (start, index))
                    self.held.add(index)
                    continue
                replica.hand_over()
                replica.flight = flight = replica.start(now, throttle=False)
                if flight is not None:
                    heapq.heappush(ends, (flight.start + flight.duration, index))
                self._refresh(index)
        self.wakeups.clear()
        upcoming = self._next_event_time(now)
        if ends and (upcoming is None or ends[0][0] <= upcoming):
            end = ends[0][0]
            while ends and ends[0][0] == end:  # every step ending then, in replica order
                index = heapq.heappop(ends)[1]
                replica = self.replicas[index]
                flight = replica.flight
                assert flight is not None
                replica.flight = None
                replica.finish(flight, end, self.sim.check)
                self._refresh(index)
                self._wake(index)
                self._sample(end, flight.out.total_num_scheduled_tokens)
            return end
        return upcoming

    def _wake(self, index: int) -> None:
        if index not in self.wakeups:
            self.wakeups.append(index)

    def _refresh(self, index: int) -> None:
        """Bring replica ``index``'s entry of the cluster-wide sums up to date."""
        scheduler = self.replicas[index].scheduler
        new = (len(scheduler.running), len(scheduler.waiting) + len(scheduler.swapped)
               + len(scheduler.held_waiting) + len(self.replicas[index].inbox),
               scheduler.kv.usage())  # waiting as StepSeries.sample_state counts it
        old = self.state[index]
        self.state[index] = new
        totals = self.totals
        totals[0] += new[0] - old[0]
        totals[1] += new[1] - old[1]
        totals[2] += new[2] - old[2]

    def _step_lockstep(self, now: float) -> float | None:
        """One step of every replica at once, as long as the slowest; the time after it."""
        throttle = self.num_steps % self.options.prefill_schedule_interval != 0
        flights = []
        for replica in self.replicas:
            flight = None
            if replica.has_work():
                replica.hand_over()
                flight = replica.start(now, throttle)
            flights.append(flight)
        if not any(flights):
            if throttle and any(r.has_work() for r in self.replicas):
                self.num_steps += 1  # only throttled work was left: the next step may prefill
                return now
            return self._next_event_time(now)
        duration = max(f.duration for f in flights if f is not None)
        end = now + duration
        self.num_steps += 1
        for index, (replica, flight) in enumerate(zip(self.replicas, flights, strict=True)):
            if flight is not None:
                replica.finish(flight, end, self.sim.check)
            self._refresh(index)
        self._sample(end, sum(f.out.total_num_scheduled_tokens for f in flights if f))
        return end

    def _next_event_time(self, now: float) -> float | None:
        if self.conversations is not None and self.conversations.has_ready:
            return now  # a turn refused or cancelled: its session's next one comes now
        times = [self.holds[0][0]] if self.holds else []
        if self.next_arrival < len(self.arrivals):
            times.append(self.arrivals[self.next_arrival].arrival_time)
        cancels = self.cancels
        while self.next_cancel < len(cancels) and self._done(cancels[self.next_cancel][1]):
            self.next_cancel += 1  # a client timeout of a request already done never fires
        if self.next_cancel < len(cancels):
            times.append(cancels[self.next_cancel][0])
        if self.session_ends.next_time is not None:
            times.append(self.session_ends.next_time)
        return min(times) if times else None

    def _done(self, request_id: str) -> bool:
        """Finished where it ran, or refused before routing (by the first replica's run)."""
        return request_id in self.replicas[self.replica_of.get(request_id, 0)].run.finished

    # -- requests in -----------------------------------------------------------------------

    def _take_due(self, now: float) -> None:
        for when, tenant, session_id in self.session_ends.due(now, self._arrived):  # all,
            self._take_arrivals(when)  # as the server's DELETE, after the arrivals before
            for index, replica in enumerate(self.replicas):
                replica.end_session(tenant, session_id, when)
                self._wake(index)
        self._take_arrivals(now)
        cancels = self.cancels
        while self.next_cancel < len(cancels) and cancels[self.next_cancel][0] <= now:
            request_id = cancels[self.next_cancel][1]
            owner = self.replica_of.get(request_id)
            if self._done(request_id):
                pass  # refused before routing, or finished: the timeout never fires
            elif owner is not None:  # applied now, at a step boundary (as one engine's)
                self.replicas[owner].cancel(request_id, now)
                self._wake(owner)
                self._refresh(owner)
            else:  # not arrived yet
                self.cancelled_early.add(request_id)
                record = self.records[request_id]
                record.finish_reason, record.stop_reason = "abort", "cancelled"
            self.next_cancel += 1

    def _arrived(self, request_id: str) -> bool:
        """Taken from the trace (routed, or refused before routing), or cancelled before
        it came."""
        return request_id in self.replica_of or request_id in self.cancelled_early or \
            self._done(request_id)

    def _take_arrivals(self, now: float) -> None:
        self.next_arrival = take_due(self.arrivals, self.next_arrival, now, self.conversations,
                                     self.cancelled_early, self.records, self._route)

    def _route(self, trace_request: TraceRequest) -> None:
        seed = self.sim.seed
        config = self.sim.scheduler_config
        params = trace_request.sampling_params(config.max_model_len, self.sessions_on)
        try:  # J1 on the length alone, as one engine's: a refused prompt's ids are never
            # drawn (QA: a trace line's 10**13 tokens were, to hash them for the router),
            # and it is never routed, as the server refuses it before its router (QA: it
            # took a round-robin turn); the first replica's run records the refusal
            check_servable_length(trace_request.request_id, trace_request.num_prompt_tokens,
                                  config, self.sim.cache_config)
        except RequestRejected as error:
            self.replicas[0].run.refuse(trace_request.request_id, error)
            return
        prompt, answer = self.chains.apply(trace_request,
                                           trace_request.synthesise_prompt(seed))
        request = Request(trace_request.request_id, prompt, params,
                          arrival_time=trace_request.received)
        hashes = prompt_block_hashes(request.prompt_token_ids, self.block_size,
                                     first_block_key(request, self.tenant_scoped)) \
            if self.hash_prefixes else ()
        index = self._place(trace_request, hashes, params)
        replica = self.replicas[index]
        replica.run.executor.register(request.request_id, request.num_prompt_tokens,
                                      trace_request.output_len, trace_request.ignore_eos,
                                      trace_request.continuation_key(seed), answer)
        replica.inbox.append(request)
        self._wake(index)
        self._refresh(index)

    def _place(self, trace_request: TraceRequest, hashes: Sequence[Any],
               params: Any) -> int:
        """The replica the router (or the recording) places a request on, counted."""
        if self.router is None:  # as recorded (checked in __init__)
            decision = RouteDecision(trace_request.replica, "recorded")  # type: ignore[arg-type]
        else:
            session = None if params.session_id is None else (params.tenant, params.session_id)
            decision = self.router.route(hashes, [r.load() for r in self.replicas], session)
            self.replicas[decision.replica].routes[trace_request.request_id] = \
                (decision, hashes, session)
        self.replica_of[trace_request.request_id] = decision.replica
        self.route_reasons[decision.reason] = self.route_reasons.get(decision.reason, 0) + 1
        self.replicas[decision.replica].request_ids.append(trace_request.request_id)
        return decision.replica

    def _withdraw(self, decision: RouteDecision, hashes: Sequence[Any], session: Any) -> None:
        """A replica refused what it was routed (its queue limits): not a decision (R7)."""
        assert self.router is not None
        self.router.withdraw(decision, hashes, session)
        self.route_reasons[decision.reason] -= 1
        if not self.route_reasons[decision.reason]:
            del self.route_reasons[decision.reason]

    # -- results ---------------------------------------------------------------------------

    def _sample(self, now: float, num_scheduled_tokens: int) -> None:
        """One point of the cluster-wide series after a step ended (its duration is filled
        in at the end: until the next point)."""
        self.last_step_end = now
        series = self.series
        running, waiting, _ = self.totals
        series.time.append(now)
        series.duration.append(0.0)
        series.num_scheduled_tokens.append(num_scheduled_tokens)
        series.num_running.append(running)
        series.num_waiting.append(waiting)
        # the replicas' usage after their last steps, as their own series have it, so the
        # cluster's mean is their means' average (QA: 0.5% apart, sampled after scheduling)
        usage = [r.run.steps.kv_usage[-1] for r in self.replicas if len(r.run.steps.kv_usage)]
        series.kv_usage.append(sum(usage) / len(self.replicas))
        if self.progress is not None and len(series.time) % 256 == 0:
            self.progress(now, sum(len(r.run.finished) for r in self.replicas),
                          len(self.arrivals))

    def _replica_result(self, replica: _Replica, start: float, end: float) -> SimResult:
        run = replica.run
        for request in run.live.values():
            run.close_preempted_spans(request)
        if run.sim.record_events:
            run.events.extend(run.scheduler.take_events())
        # as one engine's result (the host tier's figures too: QA, a cluster run had none)
        result = run.recorder.result(
            [self.records[i] for i in replica.request_ids], start, end, run.steps,
            run.scheduler.stats(), run.events, 0.0,
            preemption_mode=self.sim.scheduler_config.preemption_mode,
            bytes_per_block=getattr(self.sim.preemption_prices, "bytes_per_block", 0),
            sessions_on=self.sessions_on)
        if result.sessions:
            result.sessions["session_fallbacks"] = run.session_fallbacks
        return result

    def _result(self, start: float, end: float, wall_start: float) -> ClusterResult:
        parts = [self._replica_result(r, start, end) for r in self.replicas]
        series = self._cluster_series(start, end)
        itl = array("d")
        blocked: dict[str, int] = {}
        by_mode: dict[str, int] = {}
        events = []
        for part in parts:
            itl.extend(part.itl_samples)
            for reason, count in part.num_blocked_steps.items():
                blocked[reason] = blocked.get(reason, 0) + count
            for mode, count in part.num_preemptions_by_mode.items():
                by_mode[mode] = by_mode.get(mode, 0) + count
            events.extend(part.events)
        events.sort(key=lambda event: event.time)  # stable: replica order within a time
        return ClusterResult(
            start_time=start, end_time=end,
            records=[self.records[r.request_id] for r in self.arrivals], steps=series,
            itl_samples=itl, num_preemptions=sum(p.num_preemptions for p in parts),
            num_scheduled_tokens=sum(p.num_scheduled_tokens for p in parts),
            num_recomputed_tokens=sum(p.num_recomputed_tokens for p in parts),
            prefix_cache_queries=sum(p.prefix_cache_queries for p in parts),
            prefix_cache_hits=sum(p.prefix_cache_hits for p in parts),
            num_blocked_steps=dict(sorted(blocked.items())), events=events,
            wall_seconds=time.perf_counter() - wall_start,
            preemption_mode=parts[0].preemption_mode,
            num_swapped_out_blocks=sum(p.num_swapped_out_blocks for p in parts),
            num_swapped_in_blocks=sum(p.num_swapped_in_blocks for p in parts),
            bytes_per_block=parts[0].bytes_per_block,
            num_preemptions_by_mode=by_mode, replicas=parts,
            replica_of=self.replica_of, route_reasons=dict(sorted(self.route_reasons.items())),
            sessions=self._session_totals(parts))

    def _session_totals(self, parts: list[SimResult]) -> dict[str, Any]:
        """The replicas' session figures added up (releases by reason too), with the turns
        the closed loop held back; {} with sessions off."""
        if not self.sessions_on:
            return {}
        totals: dict[str, Any] = {}
        for part in parts:
            for key, value in part.sessions.items():
                if isinstance(value, dict):
                    merged = totals.setdefault(key, {})
                    for reason, count in value.items():
                        merged[reason] = merged.get(reason, 0) + count
                else:
                    totals[key] = totals.get(key, 0) + value
        gate = self.conversations
        totals["turns_deferred"] = gate.num_deferred if gate is not None else 0
        return totals

    def _cluster_series(self, start: float, end: float) -> StepSeries:
        """The cluster-wide series with each point's duration (until the next point), so
        the time-weighted KV mean is over wall time, and the scheduled tokens per interval."""
        series = self.series
        times = series.time
        for index in range(len(times)):
            following = times[index + 1] if index + 1 < len(times) else end
            series.duration[index] = following - times[index]
        return series
