"""AsyncEngine: the synchronous :class:`Engine` on a background thread, with per-request async
output streams for an asyncio server.

::

    event loop                                   engine thread
    ----------                                   -------------
    add_requests() --(command, Future)------->   between steps: engine.add_request(...)
    abort()        --(command)--------------->   between steps: engine.abort(...)
    RequestStream  <--call_soon_threadsafe----   engine.step().chunks, per stream queue

Only the engine thread touches the Engine (and so the scheduler and the model); the event
loop never waits on a forward pass. Every stream ends: with a finished chunk from the
scheduler (stop, length, queue timeout), with a synthetic ``abort`` chunk when the request is
aborted from outside, or with :class:`EngineDeadError` when the loop fails. A consumer that
stops early (a client disconnect cancels it) aborts what it started, so blocks return to the
pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.core import SamplingParams, SchedulerStats
from kvserve.engine.core_loop import ABORTED, EngineCore, StepReport, stalled
from kvserve.engine.engine import CompletionChunk, Engine, EngineInfo, Prompt

__all__ = ["ABORTED", "AsyncEngine", "EngineDeadError", "EngineFigures", "RequestStream",
           "RouterFigures", "ServingEngine", "StepReport", "StreamRestarted"]

logger = logging.getLogger("kvserve.engine")


class EngineDeadError(RuntimeError):
    """The engine thread stopped: every open stream raises this. ``retry_after``: seconds
    after which a retry may succeed (replicas restarting), None when none will."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StreamRestarted(Exception):
    """Raised by a stream whose unfinished requests (``request_ids``) were placed again from
    the start (a data-parallel replica died under them, and the consumer had said it can
    drop what it read): drop the chunks read of those and read on."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


@dataclass(frozen=True)
class EngineFigures:
    """One engine's figures at scrape time. ``index`` is vLLM's ``engine`` label: 0 for a
    single engine, the replica's index behind a router."""

    index: int
    stats: SchedulerStats
    invariant_violations: int


@dataclass(frozen=True)
class RouterFigures:
    """What a router among replicas has done: requests placed per (replica, reason), and how
    often each replica was launched again after dying."""

    decisions: dict[tuple[int, str], int]
    num_restarts: list[int]
    num_failed_restarts: list[int]  # relaunches that died before they were ready
    replicas_up: list[bool]  # serving now (False: dead, restarting or waiting to)


class ServingEngine(Protocol):
    """What the server needs of an engine, wherever it runs (a thread of the server's process:
    :class:`AsyncEngine`; a process of its own: ``ProcessEngine``; N replicas behind a router:
    ``DataParallelEngine``). ``stats`` is the latest snapshot; observers are called with each
    :class:`StepReport` on a thread that is not the event loop's."""

    info: EngineInfo  # the engine's fixed facts (tokenizer, limits, cache shape)
    observers: list[Callable[[StepReport], None]]

    @property
    def stats(self) -> SchedulerStats: ...
    @property
    def is_running(self) -> bool: ...
    @property
    def idle_checks(self) -> int: ...
    @property
    def invariant_violations(self) -> int: ...
    def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def add_requests(self, items: Sequence[tuple[str, Prompt, SamplingParams]],
                           arrival_time: float | None = None) -> RequestStream: ...
    def abort(self, *request_ids: str) -> None: ...
    async def release_session(self, session_id: str, tenant: str | None) -> None:
        """End a session (U8); raises SessionNotFound when none of that id is live."""
    def health(self) -> str | None:
        """None when the engine serves at full strength; else what is degraded."""
    def engine_figures(self) -> list[EngineFigures]:
        """Each live engine's latest figures (one, index 0, for a single engine)."""
    def router_figures(self) -> RouterFigures | None:
        """The router's counts; None when there is no router (one engine)."""


class _Aborter(Protocol):
    def abort(self, *request_ids: str) -> None: ...


@dataclass
class _Add:
    items: list[tuple[str, Prompt, SamplingParams, float | None]]
    stream: RequestStream
    future: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Release:
    session_id: str
    tenant: str | None
    future: concurrent.futures.Future[None]


@dataclass
class RequestStream:
    """Chunks of one or more requests added together (a prompt list, ``n`` > 1), in the order
    the engine produced them. Iterate it; it stops when every request has finished."""

    request_ids: list[str]
    _engine: _Aborter
    _queue: asyncio.Queue[CompletionChunk | BaseException] = field(
        default_factory=asyncio.Queue)
    _unfinished: set[str] = field(default_factory=set)  # membership only
    _aborting: set[str] = field(default_factory=set)  # asked to abort: membership only
    # The consumer can drop what it read (none of it reached a client), so a data-parallel
    # engine may place the requests again after a replica's death (StreamRestarted).
    replayable: bool = False

    def __post_init__(self) -> None:
        self._unfinished = set(self.request_ids)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> CompletionChunk:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def cancel(self) -> None:
        """Abort every request of this stream that has not finished and stop reading it
        (idempotent)."""
        self.abort()
        self._unfinished.clear()

    def abort(self, request_id: str | None = None) -> bool:
        """Ask the engine to abort every unfinished request of this stream (or only
        ``request_id``, one of them: a choice) and keep it open: its consumer sees each end
        with an ``abort`` chunk, the others run on. False when there was nothing left to
        ask (finished, cancelled, or asked already)."""
        asked = [r for r in (self.request_ids if request_id is None else [request_id])
                 if r in self._unfinished and r not in self._aborting]
        if not asked:
            return False
        self._aborting.update(asked)
        self._engine.abort(*asked)
        return True

    def _put(self, item: CompletionChunk | BaseException) -> None:
        self._queue.put_nowait(item)


class AsyncEngine:
    """Run ``engine`` on a daemon thread; call :meth:`start` from the event loop."""

    def __init__(self, engine: Engine, *, idle_wait: float = 0.005) -> None:
        self.engine = engine
        self.core = EngineCore(engine)
        self.info: EngineInfo = engine.info  # what the server may know; never the scheduler
        self.idle_wait = idle_wait
        self.observers: list[Callable[[StepReport], None]] = []
        self._commands: queue.SimpleQueue[_Add | _Abort | _Release | None] = \
            queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's snapshot; once the loop failed, at rest (its requests failed)."""
        stats = self.core.stats
        return stats if self.error is None else stats.at_rest()

    @property
    def idle_checks(self) -> int:
        return self.core.idle_checks

    @property
    def invariant_violations(self) -> int:
        return self.core.invariant_violations

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def health(self) -> str | None:
        return None

    def engine_figures(self) -> list[EngineFigures]:
        return [EngineFigures(0, self.stats, self.invariant_violations)]

    def router_figures(self) -> RouterFigures | None:
        return None

    # -- requests --------------------------------------------------------------------------

    async def add_requests(self, items: Sequence[tuple[str, Prompt, SamplingParams]],
                           arrival_time: float | None = None) -> RequestStream:
        """Queue all of ``items`` or none: raises what Engine.add_request raises (RequestError,
        RequestRejected, QueueFullError) for the first that fails, with the others undone."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        stream = RequestStream([request_id for request_id, _, _ in items], self)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Add([(rid, prompt, params, arrival_time)
                                 for rid, prompt, params in items], stream, future))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the caller left: nobody will read the stream
            stream.cancel()
            raise
        return stream

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[CompletionChunk]:
        """Chunks of one request; leaving the loop early (or being cancelled) aborts it."""
        async for chunk in generate(self, request_id, prompt, params, arrival_time):
            yield chunk

    def abort(self, *request_ids: str) -> None:
        """Abort requests in any state; their streams end with an ``abort`` chunk. Safe from
        any thread; unknown ids are ignored."""
        self._commands.put(_Abort(list(request_ids)))

    async def release_session(self, session_id: str, tenant: str | None) -> None:
        """End a session between steps (U8); SessionNotFound when none is live."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Release(session_id, tenant, future))
        await asyncio.wrap_future(future)

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._drain_commands(block=not self.core.busy):
                    break
                if self.core.busy:
                    report = self.core.step()
                    self._notify(report)  # before the clients hear: see _notify
                    self._deliver(report.chunks)
                    if stalled(report):
                        self._stopping.wait(self.idle_wait)
                else:
                    report = self.core.idle()
                    if report is not None:  # sessions released: their events and stats
                        self._notify(report)
        except BaseException as error:  # the loop must report, not vanish
            logger.exception("engine loop failed")
            self.error = error
            self._fail_all(EngineDeadError(f"engine loop failed: {error!r}"))
        else:
            self._fail_all(EngineDeadError("the engine was shut down"))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; when idle, wait for the first. False on shutdown."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            if isinstance(command, _Add):
                self._apply_add(command)
            elif isinstance(command, _Release):
                error, report = self.core.release_session(command.session_id,
                                                          command.tenant)
                settle(command.future, error)
                if report is not None:  # the release's events and stats
                    self._notify(report)
            else:
                report = self.core.abort(command.request_ids)
                if report is not None:
                    self._notify(report)
                    self._deliver(report.chunks)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply_add(self, command: _Add) -> None:
        error = self.core.add(command.items)
        if error is None:  # a caller gone meanwhile has asked to abort them: queued next
            for request_id in command.stream.request_ids:
                self._streams[request_id] = command.stream
        settle(command.future, error)

    def _notify(self, report: StepReport) -> None:
        """Step observers (metrics, the recorder, the dashboard) hear of a step before any
        client gets its tokens, so whatever a client does next (stopping a recording, reading
        /metrics) comes after the step in their view."""
        notify(self.observers, report)

    def _deliver(self, chunks: list[CompletionChunk]) -> None:
        routed = route_chunks(self._streams, chunks)
        if routed and self._loop is not None:
            self._loop.call_soon_threadsafe(_put_all, routed)

    def _fail_all(self, error: BaseException) -> None:
        streams = list({id(s): s for s in self._streams.values()}.values())
        self._streams.clear()
        if self._loop is not None and streams:
            self._loop.call_soon_threadsafe(_put_all, [(s, error) for s in streams])
        while True:  # answer adds that will never be applied
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                settle(command.future, error)


async def generate(engine: ServingEngine, request_id: str, prompt: Prompt,
                   params: SamplingParams, arrival_time: float | None = None
                   ) -> AsyncIterator[CompletionChunk]:
    """Chunks of one request on any serving engine; leaving early (or being cancelled) aborts
    it."""
    stream = await engine.add_requests([(request_id, prompt, params)], arrival_time)
    try:
        async for chunk in stream:
            yield chunk
    finally:
        stream.cancel()


def notify(observers: list[Callable[[StepReport], None]], report: StepReport) -> None:
    for observer in observers:
        try:
            observer(report)
        except Exception:  # a broken metric must not stop the engine
            logger.exception("step observer %r failed", observer)


def route_chunks(streams: dict[str, RequestStream], chunks: list[CompletionChunk]
                 ) -> list[tuple[RequestStream, CompletionChunk]]:
    """Pair each chunk with its request's stream, dropping the stream once its request
    finishes; chunks of requests nobody streams any more are skipped."""
    routed = []
    for chunk in chunks:
        stream = streams.get(chunk.request_id)
        if stream is None:
            continue
        if chunk.finished:
            del streams[chunk.request_id]
        routed.append((stream, chunk))
    return routed


def settle(future: concurrent.futures.Future[None], error: BaseException | None = None
           ) -> None:
    """Answer a caller waiting on ``future`` (through ``asyncio.wrap_future``), unless it has
    gone: a cancelled caller cancels the future, and setting a cancelled future's result
    raises in the engine's thread, which took that for the engine dying (QA: a second Ctrl-C
    failed every request)."""
    if future.set_running_or_notify_cancel():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _put_all(routed: list[tuple[RequestStream, CompletionChunk | BaseException]]) -> None:
    for stream, item in routed:
        stream._put(item)
