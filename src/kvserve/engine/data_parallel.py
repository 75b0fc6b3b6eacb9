"""DataParallelEngine: N engine replicas behind one router, one ServingEngine to the server.

Each replica is a :class:`ProcessEngine` (its own scheduler, KV pool and model) started by a
launcher: a local spawned process (``--data-parallel-backend mp``) or a Ray actor (``ray``).
A request group (a prompt list, ``n`` > 1) goes to one replica, the one
:mod:`kvserve.core.router` picks from the request's leading block hashes and each replica's
load (its last stats plus the adds not yet answered).

A replica that dies never hangs a client: a group that has streamed nothing yet is placed again
on another live replica (same request ids, same arrival time, so its queue deadline holds);
one that has streamed ends with :class:`EngineDeadError` (the server answers 503 or ends the
stream with an error event). The router forgets the dead replica's prefixes and stops routing
to it; the replica is launched again in the background (a process respawn, or Ray's actor
restart), and :meth:`DataParallelEngine.health` reports the degraded state until it is back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvserve.core import QueueFullError, SamplingParams, SchedulerStats
from kvserve.core.prefix_cache import first_block_key, prompt_block_hashes
from kvserve.core.router import NoReplicaError, ReplicaLoad, RouteDecision, Router
from kvserve.core.sessions import SessionNotFound
from kvserve.engine.async_engine import (
    EngineDeadError,
    EngineFigures,
    RequestStream,
    RouterFigures,
    StepReport,
    StreamRestarted,
    notify,
)
from kvserve.engine.engine import CompletionChunk, Prompt
from kvserve.engine.engine_process import (
    JOIN_TIMEOUT_S,
    EngineSpec,
    Launcher,
    LocalLauncher,
    ProcessEngine,
)

logger = logging.getLogger("kvserve.engine")

Item = tuple[str, Prompt, SamplingParams]

STABLE_S = 60.0  # a replica that lived this long died once, not in a loop
MAX_RESTART_DELAY_S = 30.0
RETRY_WHILE_RESTARTING_S = 5  # Retry-After while every replica restarts


class DataParallelEngine:
    """N replicas of one engine behind ``router``. Each life of replica i (the first, and
    each after a death) is launched by its own copy of ``launchers[i]``: a launcher holds the
    process it launched, and a dead replica's must not be its relaunch's (the data-parallel
    pass: stopping joined the loading relaunch through the dead one, 10 s). Constructing it
    starts every replica at once and waits until all are ready."""

    def __init__(self, spec: EngineSpec, tokenizer: Any, launchers: Sequence[Launcher],
                 router: Router, *, restart_delay: float = 1.0) -> None:
        self.launchers = list(launchers)
        if all(isinstance(launcher, LocalLauncher) or getattr(launcher, "on_this_machine",
                                                               False)
               for launcher in self.launchers):
            # the replicas share this machine's cores: the wait policy counts all their
            # threads (Ray actors on an instance started here too, QA)
            spec = dataclasses.replace(spec, processes=len(self.launchers))
        self.spec = spec
        self.tokenizer = tokenizer
        self.router = router
        self.restart_delay = restart_delay
        self.observers: list[Callable[[StepReport], None]] = []
        self.decisions: dict[tuple[int, str], int] = {}  # (replica, reason) -> count
        # Called with (replica index, monotonic time, the request ids it held) when a
        # replica dies: those are placed again on a live replica, or fail.
        self.death_observers: list[Callable[[int, float, list[str]], None]] = []
        self.num_restarts = [0] * len(self.launchers)
        # Relaunches that failed before the replica was ready (a crash loop counts here).
        self.num_failed_restarts = [0] * len(self.launchers)
        # Crash-loop backoff: the first death within STABLE_S of a start is relaunched at
        # once; each further one (or a failed launch) waits longer (restart_delay, then twice
        # the last wait, up to MAX_RESTART_DELAY_S); one that ran STABLE_S starts over.
        self._started_at = [time.monotonic()] * len(self.launchers)
        self._next_delay = [0.0] * len(self.launchers)
        # What each replica's earlier lives counted (event loop only): its counters carry on
        # across a restart instead of starting again at 0.
        self._earlier: list[SchedulerStats | None] = [None] * len(self.launchers)
        self._earlier_violations = [0] * len(self.launchers)
        self._where: dict[str, int] = {}  # live request id -> replica
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()  # set by stop: a relaunch is cancelled
        self.replicas: list[ProcessEngine | None] = [None] * len(self.launchers)
        self._launch_all()
        first = self.replicas[0]
        assert first is not None
        self.info = first.info

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def _launch_all(self) -> None:
        """Start every replica at once and wait until all are ready (N loads take one load's
        time, QA); the first failure, or a signal meanwhile, stops them all."""
        cancel = threading.Event()
        pool = concurrent.futures.ThreadPoolExecutor(len(self.launchers),
                                                     thread_name_prefix="kvserve-launch")
        futures = [pool.submit(self._launch, index, cancel)
                   for index in range(len(self.launchers))]
        try:
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            for index, future in enumerate(futures):
                self.replicas[index] = future.result()
        except BaseException:
            cancel.set()  # the loading ones kill their process and end
            for future in futures:
                try:
                    replica = future.result()
                except BaseException:  # its own failure: the first one is raised
                    continue
                replica._kill()
            raise
        finally:
            pool.shutdown(wait=False)

    def _launch(self, index: int, cancel: threading.Event | None = None) -> ProcessEngine:
        replica = ProcessEngine(self.spec, self.tokenizer, name=f"kvserve-engine-{index}",
                                launcher=copy.copy(self.launchers[index]),
                                on_death=self._died,
                                cancel=cancel)
        replica.observers.append(lambda report, i=index: self._observe(i, report))
        return replica

    def _observe(self, index: int, report: StepReport) -> None:
        if report.chunks:
            with self._lock:
                for chunk in report.chunks:
                    if chunk.finished:
                        self._where.pop(chunk.request_id, None)
        notify(self.observers, dataclasses.replace(report, engine=index))

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for replica in self.replicas:
            if replica is not None:
                replica.start(self._loop)

    async def stop(self) -> None:
        self._stopping.set()
        await asyncio.gather(*(r.stop() for r in self.replicas if r is not None))

    def stop_here(self) -> None:
        """:meth:`stop` where no event loop runs (the offline LLM's close, at the
        interpreter's exit too, where no worker thread may start): every replica told,
        then each waited for."""
        self._stopping.set()
        replicas = [r for r in self.replicas if r is not None]
        for replica in replicas:
            replica.ask_to_stop()
        deadline = time.monotonic() + JOIN_TIMEOUT_S  # one wait for all (the review: each
        for replica in replicas:  # its own, N hung replicas took N times as long)
            replica.join(max(0.0, deadline - time.monotonic()))

    def _live(self) -> list[tuple[int, ProcessEngine]]:
        return [(i, r) for i, r in enumerate(self.replicas) if r is not None and r.is_running]

    @property
    def is_running(self) -> bool:
        return not self._stopping.is_set() and bool(self._live())

    def health(self) -> str | None:
        """None when every replica serves, or the server is stopping them; else what is
        missing (the server still serves while one replica is live)."""
        down = [i for i, r in enumerate(self.replicas) if r is None or not r.is_running]
        if not down or self._stopping.is_set():
            return None
        if len(down) == self.num_replicas:
            return f"every replica ({self.num_replicas}) is down (restarting)"
        return (f"degraded: replica {', '.join(map(str, down))} of {self.num_replicas} down "
                f"(restarting); {self.num_replicas - len(down)} serving")

    # -- what the server reads -------------------------------------------------------------

    @property
    def stats(self) -> SchedulerStats:
        """The sum over the replicas (KV usage: the share of all their blocks; one that is
        restarting holds nothing, and its counters carry on, :meth:`engine_figures`)."""
        return merge_stats([figures.stats for figures in self.engine_figures()])

    def engine_figures(self) -> list[EngineFigures]:
        """Each replica's latest stats and invariant violations, indexed by replica: its
        counters include its earlier lives'; one restarting reads at rest until it is back."""
        figures = []
        for index, replica in enumerate(self.replicas):
            if replica is None:
                continue
            earlier = self._earlier[index]
            stats = replica.stats if earlier is None else replica.stats.after(earlier)
            figures.append(EngineFigures(index, stats, replica.invariant_violations +
                                         self._earlier_violations[index]))
        return figures

    def router_figures(self) -> RouterFigures:
        with self._lock:
            decisions = dict(self.decisions)
        return RouterFigures(decisions, list(self.num_restarts),
                             list(self.num_failed_restarts),
                             [replica is not None and replica.is_running
                              for replica in self.replicas])

    @property
    def idle_checks(self) -> int:
        return sum(r.idle_checks for r in self.replicas if r is not None)

    @property
    def invariant_violations(self) -> int:
        return sum(r.invariant_violations for r in self.replicas if r is not None)

    # -- requests --------------------------------------------------------------------------

    async def add_requests(self, items: Sequence[Item],
                           arrival_time: float | None = None) -> RequestStream:
        """Route the group to one replica and queue it there (all or nothing); raises what
        the replica's engine raises, or EngineDeadError when no replica is live."""
        when = time.monotonic() if arrival_time is None else arrival_time
        index, stream, placed_again = await self._place(list(items), when)
        return _RoutedStream(self, list(items), when, index, stream,  # type: ignore[return-value]
                             placed_again)

    async def _place(self, items: list[Item], arrival_time: float, placed_again: bool = False,
                     ) -> tuple[int, RequestStream, bool]:
        """(the replica, its stream, whether the group was placed again): a replica that
        dies taking the group passes it to another, once. A group whose second replica dies
        too may be what kills them (one step fails the engine that runs it), and placed
        again each time it would take every replica down in turn: it fails instead."""
        hashes = self._prefix_hashes(items[0])
        params = items[0][2]
        session = None if params.session_id is None else (params.tenant, params.session_id)
        while True:
            loads = [self._load(i) for i in range(self.num_replicas)]
            try:
                with self._lock:  # the reader thread of a dying replica forgets it
                    decision = self.router.route(hashes, loads, session)
            except NoReplicaError:
                raise EngineDeadError("no engine replica is running (every one is "
                                      "restarting); retry later",
                                      retry_after=RETRY_WHILE_RESTARTING_S) from None
            replica = self.replicas[decision.replica]
            assert replica is not None
            with self._lock:
                for request_id, _, _ in items:
                    self._where[request_id] = decision.replica
            try:
                stream = await replica.add_requests(items, arrival_time)
                self._count(decision)
                return decision.replica, stream, placed_again
            except EngineDeadError as error:
                self._count(decision)
                if placed_again:
                    with self._lock:
                        for request_id, _, _ in items:
                            self._where.pop(request_id, None)
                    raise _second_death(decision.replica, error) from None
                placed_again = True
                continue  # it died just now: the router will not pick it again
            except BaseException as error:
                # refused (queue limits, a busy session, bad input): neither a decision
                # nor anything the router should remember (R7)
                with self._lock:
                    for request_id, _, _ in items:
                        self._where.pop(request_id, None)
                    self.router.withdraw(decision, hashes, session)
                if isinstance(error, QueueFullError):
                    raise _per_replica(error, decision.replica, self.num_replicas) from None
                raise

    def _count(self, decision: RouteDecision) -> None:
        with self._lock:
            key = (decision.replica, decision.reason)
            self.decisions[key] = self.decisions.get(key, 0) + 1

    def _prefix_hashes(self, item: Item) -> list[bytes]:
        """The prompt's leading block hashes as the replica's prefix cache will name them
        (salt and, under the tenant scope, tenant included)."""
        _, prompt, params = item
        if not isinstance(prompt, list) or not self.info.enable_prefix_caching:
            return []
        tenant_scoped = self.info.scheduler_config.prefix_cache_scope == "tenant"
        salt = first_block_key(_ParamsOnly(params), tenant_scoped)  # type: ignore[arg-type]
        return prompt_block_hashes(prompt, self.info.block_size, salt)

    def _load(self, index: int) -> ReplicaLoad:
        replica = self.replicas[index]
        if replica is None or not replica.is_running:
            return ReplicaLoad(index, False, 0, 0, 0.0)
        stats = replica.stats
        return ReplicaLoad(index, True, stats.num_running,
                           stats.num_waiting + replica.pending_adds, stats.kv_cache_usage)

    def abort(self, *request_ids: str) -> None:
        """Abort requests wherever they run; unknown ids are ignored. Any thread."""
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                index = self._where.get(request_id)
                if index is not None:
                    by_replica.setdefault(index, []).append(request_id)
        for index, ids in sorted(by_replica.items()):
            replica = self.replicas[index]
            if replica is not None:
                replica.abort(*ids)

    async def release_session(self, session_id: str, tenant: str | None) -> None:
        """End the session (U8) on the replica its turns go to (R6), asked alone first (a
        replica hung elsewhere held every DELETE up to its step watchdog: the sessions
        pass, 10 s; 120 s by default), then, where that one has it not, on every other
        live replica (one restarted, or the router's memory full, may have left it
        elsewhere). ``tenant`` None: every tenant's, on every live replica. None has it:
        SessionNotFound, naming any replica that failed as it was asked (its sessions
        ended with it; which replica failed decided between a 503 and a 404), or that
        failure where every replica asked failed. The router keeps routing the session
        where it was: that replica's prefix cache keeps the released blocks until they
        are reused."""
        live = self._live()
        if not live:  # QA: a 404 "never existed" while every replica restarts
            raise EngineDeadError("no engine replica is running (every one is restarting); "
                                  "retry later", retry_after=RETRY_WHILE_RESTARTING_S)
        answers: list[tuple[int, BaseException | None]] = []
        if tenant is not None:
            with self._lock:
                owner = self.router.session_replica((tenant, session_id))
            answers += await _release_on([(i, r) for i, r in live if i == owner],
                                         session_id, tenant)
            live = [(i, r) for i, r in live if i != owner]
        if not any(answer is None for _, answer in answers):
            answers += await _release_on(live, session_id, tenant)
        if any(answer is None for _, answer in answers):
            return
        missing = [answer for _, answer in answers if isinstance(answer, SessionNotFound)]
        failed = [(i, answer) for i, answer in answers
                  if answer is not None and not isinstance(answer, SessionNotFound)]
        if not missing:
            raise failed[0][1]
        if not failed:
            raise missing[0]
        raise SessionNotFound(f"no session {session_id!r} is live; " + "; ".join(
            f"replica {i} failed as it was asked ({error}), and its sessions ended with it"
            for i, error in failed))

    # -- failures --------------------------------------------------------------------------

    def _died(self, replica: ProcessEngine) -> None:
        """Reader thread of the dead replica: forget its prefixes and launch it again."""
        index = self.replicas.index(replica)
        logger.error("replica %d died: %s; restarting it", index, replica.error)
        with self._lock:  # its requests either moved (placed again) or failed
            self.router.forget_replica(index)
            held = [r for r, i in self._where.items() if i == index]
            for request_id in held:
                del self._where[request_id]
        for observer in list(self.death_observers):  # e.g. a recording marks it
            try:
                observer(index, time.monotonic(), held)
            except Exception:  # an observer must not stop the restart
                logger.exception("replica death observer failed")
        threading.Thread(target=self._restart, args=(index,), name=f"restart-{index}",
                         daemon=True).start()

    def _backoff(self, index: int) -> float:
        """Seconds to wait before launching replica ``index`` again, and the next wait."""
        if time.monotonic() - self._started_at[index] >= STABLE_S:
            self._next_delay[index] = 0.0  # it ran a while: a one-off death
        delay = self._next_delay[index]
        self._next_delay[index] = min(MAX_RESTART_DELAY_S,
                                      max(self.restart_delay, 2 * delay))
        return delay

    def _restart(self, index: int) -> None:
        while not self._stopping.is_set():
            delay = self._backoff(index)
            if delay:
                logger.warning("replica %d: waiting %.0f s before launching it again (it "
                               "died within %.0f s of its start)", index, delay, STABLE_S)
                if self._stopping.wait(delay):
                    return
            self._started_at[index] = time.monotonic()
            try:
                replica = self._launch(index, cancel=self._stopping)
            except Exception as error:
                if self._stopping.is_set():  # cancelled by the stop, no failure of its own
                    return
                self.num_failed_restarts[index] += 1
                logger.error("replica %d failed to restart: %s", index, error)
                continue
            if self._stopping.is_set() or self._loop is None:
                replica._kill()
                return
            self._loop.call_soon_threadsafe(self._swap_in, index, replica)
            return

    def _swap_in(self, index: int, replica: ProcessEngine) -> None:
        dead = self.replicas[index]
        if dead is not None:  # at rest since it died: its counters are final
            earlier = self._earlier[index]
            self._earlier[index] = dead.stats if earlier is None else dead.stats.after(earlier)
            self._earlier_violations[index] += dead.invariant_violations
        replica.start(self._loop)
        self.replicas[index] = replica
        self.num_restarts[index] += 1
        logger.info("replica %d is back (restart %d)", index, self.num_restarts[index])


# Local replicas started at most per CPU: each is a process with its own model (about
# 1.6 GB resident for the bundled one); past this a start is a fork storm (the
# data-parallel pass: --data-parallel-size 100000 launched every one at once)
MAX_LOCAL_REPLICAS_PER_CPU = 4


async def _release_on(replicas: list[tuple[int, ProcessEngine]], session_id: str,
                      tenant: str | None) -> list[tuple[int, BaseException | None]]:
    """Each replica's answer to releasing the session, asked at once: None where it had it,
    else what it raised."""
    results = await asyncio.gather(*(r.release_session(session_id, tenant)
                                     for _, r in replicas), return_exceptions=True)
    return [(i, result if isinstance(result, BaseException) else None)
            for (i, _), result in zip(replicas, results, strict=True)]


def check_local_replicas(size: int, backend: str) -> None:
    """ValueError where ``size`` replicas on this machine (``backend`` "mp") are more than
    it starts: MAX_LOCAL_REPLICAS_PER_CPU per CPU. Ray's are placed over its cluster."""
    cpus = os.cpu_count() or 1
    most = MAX_LOCAL_REPLICAS_PER_CPU * cpus
    if backend == "mp" and size > most:
        raise ValueError(f"data_parallel_size (--data-parallel-size) {size} would start "
                         f"{size} engine processes on this machine's {cpus} CPUs; at most "
                         f"{most} ({MAX_LOCAL_REPLICAS_PER_CPU} per CPU) are started here "
                         "(the ray backend places replicas over a cluster)")


def replicas_on_this_machine(size: int, backend: str) -> int:
    """How many of ``size`` replicas share this machine's memory: every one on ``mp`` and on
    the Ray instance a server starts here (no RAY_ADDRESS); on a cluster elsewhere, where
    Ray places them is not known before, one is checked."""
    return size if backend == "mp" or not os.environ.get("RAY_ADDRESS") else 1


def warn_oversubscribed(size: int, threads: int, backend: str) -> None:
    """A warning where ``size`` local replicas of ``threads`` threads each are more threads
    than this machine's CPUs (serve and the offline LLM alike; the data-parallel pass:
    LLM(threads_per_replica=1000) said nothing)."""
    cpus = os.cpu_count() or 1
    if backend == "mp" and size * threads > cpus:
        logger.warning("%d local replicas x %d threads = %d threads on %d CPUs: the replicas "
                       "will take turns on the cores (fewer replicas, or fewer threads each, "
                       "serve faster)", size, threads, size * threads, cpus)


def default_threads(num_replicas: int) -> int:
    """Torch threads per replica when none are given: the CPUs split evenly (at least 1)."""
    return max(1, (os.cpu_count() or 1) // num_replicas)


def ray_gpus_per_replica(device: str, cluster_gpus: float) -> int:
    """The GPUs a Ray replica asks for: one on ``cuda``, and on ``auto`` where the cluster
    has GPUs (an actor that asks for none has them hidden, so ``auto`` inside it would pick
    the CPU); none on ``cpu``, and on ``cuda:N``, which names a device of the node."""
    return 1 if device == "cuda" or (device == "auto" and cluster_gpus >= 1) else 0


def _warn_short_cluster(resources: dict[str, float], num_replicas: int, threads: int,
                        gpus: int) -> None:
    """Say at once when the Ray cluster has fewer CPUs (or GPUs) than the replicas ask for:
    Ray leaves an actor it cannot place pending, silently, until the start's timeout (QA:
    ten minutes without a word)."""
    for name, each in (("CPU", threads), ("GPU", gpus)):
        have, asked = resources.get(name, 0), num_replicas * each
        if each and have < asked:
            logger.warning("the Ray cluster has %g %s(s); %d replicas x %d ask for %d: the "
                           "replicas it cannot place wait for them (an autoscaler's new "
                           "nodes) until the start times out", have, name, num_replicas,
                           each, asked)


def replica_launchers(num_replicas: int, backend: str, device: str = "cpu",
                      threads: int = 1) -> list[Launcher]:
    """One launcher per replica: local spawned processes (``mp``) or Ray actors (``ray``,
    connecting to Ray now; each asks for ``threads`` CPUs). On ``--device cuda`` (or
    ``auto`` where there is a GPU) each replica gets a GPU of its own: a local one by its
    CUDA_VISIBLE_DEVICES, a Ray actor by asking Ray for one."""
    from kvserve.model.device import replica_gpus

    if backend == "ray":
        from kvserve.engine.ray_launcher import RayLauncher, ensure_ray
        ray = ensure_ray()
        resources = ray.cluster_resources()
        gpus = ray_gpus_per_replica(device, resources.get("GPU", 0))
        _warn_short_cluster(resources, num_replicas, threads, gpus)
        local = not os.environ.get("RAY_ADDRESS")  # ensure_ray started an instance here
        return [RayLauncher(i, num_gpus=gpus, on_this_machine=local)
                for i in range(num_replicas)]
    if backend != "mp":
        raise ValueError(f"unknown data-parallel backend {backend!r}; choose mp or ray")
    gpus = replica_gpus(num_replicas, device) or [None] * num_replicas
    return [LocalLauncher(f"kvserve-engine-{i}", gpu) for i, gpu in enumerate(gpus)]


@dataclasses.dataclass(frozen=True)
class _ParamsOnly:
    """What first_block_key reads of a request, before there is one."""

    sampling_params: SamplingParams


def _per_replica(error: QueueFullError, replica: int, num_replicas: int) -> QueueFullError:
    """The queue limits hold per replica, as max_num_seqs does (docs/scale-out.md): the
    refusal says whose (QA: "tenant 'b' has 4 requests waiting" beside /metrics' 8)."""
    head, sep, rest = str(error).partition(": ")
    if not (sep and head.startswith("request ")):
        head, sep, rest = "", "", str(error)
    if rest.endswith(")"):  # "(max_num_queued_reqs=3)" -> "(max_num_queued_reqs=3, ...)"
        rest = rest[:-1] + ", per replica)"
    return QueueFullError(f"{head}{sep}replica {replica} of {num_replicas}: {rest}",
                          error.limit)


def _second_death(replica: int, error: EngineDeadError) -> EngineDeadError:
    return EngineDeadError(f"replica {replica} failed with this request, the second replica "
                           "to fail with it (it is not placed again, lest it be what fails "
                           f"them): {error}")


class _RoutedStream:
    """A RequestStream that survives its replica's death while nothing has been read, or
    while what was read can be dropped (``replayable``): its unfinished requests are placed
    again on a live replica, in the latter case raising StreamRestarted once so the consumer
    starts them over (a finished one keeps its answer: the chaos pass saw a group's finished
    choices run again, in no token count). Placed again once at most, as
    DataParallelEngine._place says why."""

    def __init__(self, engine: DataParallelEngine, items: list[Item], arrival_time: float,
                 replica: int, inner: RequestStream, placed_again: bool = False) -> None:
        self.engine = engine
        self.items = items
        self.arrival_time = arrival_time
        self.replica = replica
        self.inner = inner
        self.request_ids = inner.request_ids
        self.read_any = False
        self.abort_sent = False
        self.replayable = False
        self.placed_again = placed_again
        self._finished: set[str] = set()
        self._asked: set[str | None] = set()  # aborts asked (None: all), for a new replica
        self._cancelled = self._placing = False

    @property
    def finished(self) -> bool:
        return self.inner.finished

    def __aiter__(self) -> _RoutedStream:
        return self

    async def __anext__(self) -> CompletionChunk:
        while True:
            try:
                chunk = await self.inner.__anext__()
            except EngineDeadError as error:
                if (self.read_any and not self.replayable) or self.abort_sent or \
                        self.engine._stopping.is_set():
                    raise EngineDeadError(f"replica {self.replica} failed with this request "
                                          f"under way: {error}") from None
                if self.placed_again:
                    raise _second_death(self.replica, error) from None
                self.items = [item for item in self.items if item[0] not in self._finished]
                if not self.items:
                    raise StopAsyncIteration from None  # every answer was whole
                logger.warning("replica %d died before request %s reached its client; "
                               "placing it again", self.replica, self.items[0][0])
                self._placing = True
                try:
                    self.replica, self.inner, _ = await self.engine._place(
                        self.items, self.arrival_time, placed_again=True)
                finally:
                    self._placing = False
                self.placed_again = True
                # asked while it was placed, of the dead replica's stream (the review: lost,
                # the requests ran on to their end)
                for request_id in self._asked:
                    self.inner.abort(request_id)
                if self._cancelled:
                    self.inner.cancel()
                if self.read_any:
                    self.read_any = False
                    raise StreamRestarted(f"request {self.items[0][0]} placed again on "
                                          f"replica {self.replica}",
                                          [item[0] for item in self.items]) from None
                continue
            if chunk.finished:
                self._finished.add(chunk.request_id)
            self.read_any = True
            return chunk

    def cancel(self) -> None:
        self._cancelled = True
        self.inner.cancel()

    def abort(self, request_id: str | None = None) -> bool:
        """RequestStream.abort on the replica that holds the requests; a stream with an
        abort asked (of any of its requests) is not placed again should that replica die
        before the abort lands, and one asked while it is placed again is asked again of
        its new replica."""
        asked = self.inner.abort(request_id) or self._placing  # asked of the new one then
        self.abort_sent = self.abort_sent or asked
        self._asked.add(request_id)
        return asked


def merge_stats(parts: Sequence[SchedulerStats]) -> SchedulerStats:
    """One snapshot for several schedulers: counts add up; KV usage is the share of all their
    blocks in use."""
    if len(parts) == 1:
        return parts[0]
    values: dict[str, Any] = {}
    for field in dataclasses.fields(SchedulerStats):
        if field.name == "kv_cache_usage":
            continue
        items = [getattr(part, field.name) for part in parts]
        if isinstance(items[0], dict):
            merged: dict[str, int] = {}
            for item in items:
                for key, count in item.items():
                    merged[key] = merged.get(key, 0) + count
            values[field.name] = merged
        else:
            values[field.name] = sum(items)
    blocks = values["num_blocks"]
    values["kv_cache_usage"] = (blocks - values["num_free_blocks"]) / blocks if blocks else 0.0
    return SchedulerStats(**values)
