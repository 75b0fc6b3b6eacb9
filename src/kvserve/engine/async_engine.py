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
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from kvserve.core import (
    InvariantError,
    SamplingParams,
    SchedulerEvent,
    SchedulerStats,
    check_invariants,
)
from kvserve.engine.engine import CompletionChunk, Engine, EngineInfo, Prompt

logger = logging.getLogger("kvserve.engine")

ABORTED = "aborted"  # stop_reason of a request aborted from outside (client, operator)


class EngineDeadError(RuntimeError):
    """The engine thread stopped: every open stream raises this."""


@dataclass(frozen=True)
class StepReport:
    """What one engine step did, handed to observers on the engine thread (metrics, logs).
    Aborts applied between steps are reported too, with no tokens and no events."""

    time: float
    num_scheduled_tokens: int
    seconds: float
    chunks: list[CompletionChunk]
    events: list[SchedulerEvent]
    stats: SchedulerStats


@dataclass
class _Add:
    items: list[tuple[str, Prompt, SamplingParams, float | None]]
    stream: RequestStream
    future: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class RequestStream:
    """Chunks of one or more requests added together (a prompt list, ``n`` > 1), in the order
    the engine produced them. Iterate it; it stops when every request has finished."""

    request_ids: list[str]
    _engine: AsyncEngine
    _queue: asyncio.Queue[CompletionChunk | BaseException] = field(
        default_factory=asyncio.Queue)
    _unfinished: set[str] = field(default_factory=set)  # membership only

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
        """Abort every request of this stream that has not finished (idempotent)."""
        if self._unfinished:
            self._engine.abort(*[r for r in self.request_ids if r in self._unfinished])
            self._unfinished.clear()

    def _put(self, item: CompletionChunk | BaseException) -> None:
        self._queue.put_nowait(item)


class AsyncEngine:
    """Run ``engine`` on a daemon thread; call :meth:`start` from the event loop."""

    def __init__(self, engine: Engine, *, idle_wait: float = 0.005) -> None:
        self.engine = engine
        self.info: EngineInfo = engine.info  # what the server may know; never the scheduler
        self.idle_wait = idle_wait
        self.observers: list[Callable[[StepReport], None]] = []
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        self.stats: SchedulerStats = engine.scheduler.stats()
        # The scheduler's invariants (I1-I4: no leaked or doubly held block, ...) are checked
        # each time the engine falls idle, where they are cheapest; a failure is logged and
        # counted (kvserve:invariant_violations), not raised, so serving goes on.
        self.idle_checks = self.invariant_violations = 0
        self._checked_since_busy = True

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
        stream = await self.add_requests([(request_id, prompt, params)], arrival_time)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.cancel()

    def abort(self, *request_ids: str) -> None:
        """Abort requests in any state; their streams end with an ``abort`` chunk. Safe from
        any thread; unknown ids are ignored."""
        self._commands.put(_Abort(list(request_ids)))

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished_requests()
                if not self._drain_commands(block=not busy):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                    self._checked_since_busy = False
                else:
                    if not self._checked_since_busy:
                        self._check_when_idle()
                    self.stats = self.engine.scheduler.stats()
        except BaseException as error:  # the loop must report, not vanish
            logger.exception("engine loop failed")
            self.error = error
            self._fail_all(EngineDeadError(f"engine loop failed: {error!r}"))
        else:
            self._fail_all(EngineDeadError("the engine was shut down"))

    def _check_when_idle(self) -> None:
        self._checked_since_busy = True
        self.idle_checks += 1
        try:
            check_invariants(self.engine.scheduler)
        except InvariantError as error:
            self.invariant_violations += 1
            logger.error("scheduler state check failed with the engine idle: %s", error)

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
            else:
                self._apply_abort(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply_add(self, command: _Add) -> None:
        added: list[str] = []
        try:
            for request_id, prompt, params, arrival_time in command.items:
                self.engine.add_request(request_id, prompt, params, arrival_time)
                added.append(request_id)
                self._streams[request_id] = command.stream
        except Exception as error:
            for request_id in added:
                self.engine.abort(request_id)
                self._streams.pop(request_id, None)
            self._resolve(command.future, error)
            return
        self._resolve(command.future, None)

    def _resolve(self, future: concurrent.futures.Future[None],
                 error: BaseException | None) -> None:
        self.stats = self.engine.scheduler.stats()  # an add the caller saw is in the stats
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _apply_abort(self, command: _Abort) -> None:
        chunks = []
        for request_id in command.request_ids:
            if self.engine.abort(request_id):
                chunks.append(CompletionChunk(request_id, [], "", True, "abort", ABORTED))
        if chunks:
            self.stats = self.engine.scheduler.stats()
            self._deliver(chunks)
            self._notify(StepReport(time.monotonic(), 0, 0.0, chunks, [], self.stats))

    def _step(self) -> None:
        start = time.monotonic()
        record = self.engine.step()
        chunks, num_tokens = record.chunks, record.num_scheduled_tokens
        seconds = record.end - record.start
        events = self.engine.scheduler.take_events()
        self.stats = self.engine.scheduler.stats()
        if chunks:
            self._deliver(chunks)
        self._notify(StepReport(start, num_tokens, seconds, chunks, events, self.stats))
        if num_tokens == 0 and not chunks:
            # Nothing could run (every waiting request blocked): wait for an arrival or an
            # abort instead of spinning; queue deadlines are checked again after the wait.
            self._stopping.wait(self.idle_wait)

    def _notify(self, report: StepReport) -> None:
        for observer in self.observers:
            try:
                observer(report)
            except Exception:  # a broken metric must not stop the engine
                logger.exception("step observer %r failed", observer)

    def _deliver(self, chunks: list[CompletionChunk]) -> None:
        routed = []
        for chunk in chunks:
            stream = self._streams.get(chunk.request_id)
            if stream is None:
                continue
            if chunk.finished:
                del self._streams[chunk.request_id]
            routed.append((stream, chunk))
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
                self._resolve(command.future, error)


def _put_all(routed: list[tuple[RequestStream, CompletionChunk | BaseException]]) -> None:
    for stream, item in routed:
        stream._put(item)
