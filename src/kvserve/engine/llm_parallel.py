"""``LLM(data_parallel_size=N)``: offline generation over N engine replicas behind the router.

The replicas are the server's (:class:`~kvserve.engine.data_parallel.DataParallelEngine`):
N engine processes (or Ray actors), each with its own scheduler, KV pool and model, torch
threads split among them. The LLM drives them from an event loop of its own, so
``generate`` stays a plain blocking call: it adds every request (each its own group, so the
router spreads a batch), then reads every stream to its end. Prompts are tokenized here, so
the router sees their leading block hashes (prefix affinity) and each result holds its
prompt's token ids.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

from kvserve.core import SamplingParams
from kvserve.core.errors import QueueFullError, RequestRejected, without_request_id
from kvserve.engine.async_engine import RequestStream, StreamRestarted
from kvserve.engine.engine import CompletionChunk

Item = tuple[str, list[int], SamplingParams]


def refused_in_batch(index: int, error: ValueError) -> ValueError:
    """``prompts[index]``'s refusal by the engine, named by its place in the batch (not its
    id). A queue limit's is RequestRejected, not "retry later": generate() queues its whole
    batch at once, so the limit caps the batch (with replicas it was the QueueFullError, no
    hint: the data-parallel pass). Other errors keep their type and fields."""
    message = f"prompts[{index}]: {without_request_id(error)}"
    if isinstance(error, QueueFullError):
        return RequestRejected(f"{message}: generate() queues its whole batch at once, so a "
                               "queue limit caps the batch; send fewer prompts per call or "
                               "raise the limit")
    error.args = (message,)
    return error


class ReplicatedEngines:
    """N replicas started now; :meth:`close` stops them."""

    def __init__(self, model: Any, engine_args: dict[str, Any], tokenizer: Any, *,
                 size: int, backend: str = "mp", router: str = "least-loaded",
                 threads_per_replica: int | None = None) -> None:
        from kvserve.core.router import make_router
        from kvserve.engine.data_parallel import (
            DataParallelEngine,
            default_threads,
            replica_launchers,
            warn_oversubscribed,
        )
        from kvserve.engine.engine_process import EngineSpec
        from kvserve.engine.llm import build_engine, portable_model

        if threads_per_replica is not None and threads_per_replica < 1:
            raise ValueError(f"threads_per_replica must be >= 1, got {threads_per_replica}")
        policy = make_router(router, size)  # checks the size and the policy first
        threads = threads_per_replica or default_threads(size)
        warn_oversubscribed(size, threads, backend)
        spec = EngineSpec(functools.partial(build_engine, portable_model(model), **engine_args),
                          threads=threads)
        self.loop = asyncio.new_event_loop()
        launchers = replica_launchers(size, backend, str(engine_args.get("device", "auto")),
                                      threads)
        self.engine = DataParallelEngine(spec, tokenizer, launchers, policy)
        self.loop.run_until_complete(self._start())
        # A script that never closes its LLM hung at exit: multiprocessing's exit handler
        # waits for the engine processes, which wait for their pipe (QA). Registered after
        # multiprocessing's own, so it runs first (atexit runs the last registered first).
        atexit.register(self.close)

    async def _start(self) -> None:
        self.engine.start()

    def run(self, items: Sequence[Item], on_chunk: Callable[[CompletionChunk], None],
            on_restart: Callable[[list[str]], None]) -> None:
        """Add every item, then pass each chunk to ``on_chunk`` until all have finished. When
        an add fails, the ones already queued are aborted and the error is raised; an
        interrupt (Ctrl-C) aborts every one as well, as one engine's generate does. Nothing
        reaches the caller before the end, so a replica's death places its unfinished
        requests again on another (as the server places a request not streamed; the
        data-parallel pass: the whole batch failed): ``on_restart`` is told their ids, to
        drop what was read of them."""
        task = self.loop.create_task(self._run(items, on_chunk, on_restart))
        try:
            self.loop.run_until_complete(task)
        except BaseException:  # an interrupt reaches the loop, not the task (the
            if not task.done():  # data-parallel pass: the batch ran on, and the next
                task.cancel()    # generate's loop finished it)
                with contextlib.suppress(BaseException):
                    self.loop.run_until_complete(task)  # its streams cancel on the way out
            raise

    async def _run(self, items: Sequence[Item], on_chunk: Callable[[CompletionChunk], None],
                   on_restart: Callable[[list[str]], None]) -> None:
        adds = [asyncio.ensure_future(self.engine.add_requests([item])) for item in items]
        try:
            await asyncio.wait(adds)
        except BaseException:  # cancelled while adding: what was added leaves too
            for add in adds:
                if add.done() and not add.cancelled() and add.exception() is None:
                    add.result().cancel()
                else:
                    add.cancel()  # a pending add cancels its own stream
            raise
        added = [add.exception() or add.result() for add in adds]
        failed = [(index, result) for index, result in enumerate(added)
                  if isinstance(result, BaseException)]
        streams = [result for result in added if not isinstance(result, BaseException)]
        if failed:
            for stream in streams:
                stream.cancel()
            index, error = failed[0]
            if isinstance(error, ValueError):
                raise refused_in_batch(index, error) from None
            raise error

        async def drain(stream: RequestStream) -> None:
            stream.replayable = True
            while True:
                try:
                    async for chunk in stream:
                        on_chunk(chunk)
                    return
                except StreamRestarted as restart:  # placed again: read them from the start
                    on_restart(restart.request_ids)
        try:
            await asyncio.gather(*(drain(stream) for stream in streams))
        except BaseException:  # a replica failed under way: leave nothing queued elsewhere
            for stream in streams:
                stream.cancel()
            raise

    def close(self) -> None:
        """Stop every replica (idempotent; at the interpreter's exit too)."""
        if self.loop.is_closed():
            return
        atexit.unregister(self.close)
        self.engine.stop_here()  # the loop's stop() asks a worker thread, refused at exit
        self.loop.close()
