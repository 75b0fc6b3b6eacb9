"""AsyncEngine: streams, abort on cancellation, and no stream ever left hanging."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.core import QueueFullError, RequestRejected, SamplingParams
from kvserve.core.stop import QUEUE_TIMEOUT
from kvserve.engine.async_engine import ABORTED, AsyncEngine

from .helpers import make_engine


def run(coro_fn, **settings):
    async def main():
        engine = AsyncEngine(make_engine(**settings))
        engine.start()
        try:
            return await asyncio.wait_for(coro_fn(engine), timeout=30)
        finally:
            await engine.stop()
    return asyncio.run(main())


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def _until_idle(engine: AsyncEngine) -> None:
    for _ in range(2000):
        stats = engine.stats
        if stats.num_running == stats.num_waiting == 0 and \
                stats.num_free_blocks == stats.num_blocks:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("engine did not go idle")


def test_generate_streams_every_token_then_finishes():
    async def body(engine):
        chunks = [c async for c in engine.generate("a", "Hello there", greedy(8))]
        return chunks
    chunks = run(body)
    assert sum(len(c.new_token_ids) for c in chunks) == 8
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert chunks[-1].metrics is not None and chunks[-1].metrics.num_output_tokens == 8


def test_concurrent_requests_each_get_their_own_stream():
    async def body(engine):
        async def one(i):
            return [c async for c in engine.generate(f"r{i}", [10 + i] * 5, greedy(4 + i))]
        return await asyncio.gather(*(one(i) for i in range(6)))
    results = run(body)
    for i, chunks in enumerate(results):
        assert {c.request_id for c in chunks} == {f"r{i}"}
        assert sum(len(c.new_token_ids) for c in chunks) == 4 + i


def test_errors_raise_from_add_and_record_nothing():
    async def body(engine):
        with pytest.raises(RequestRejected):
            await engine.add_requests([("long", [5] * 2000, greedy())])
        stream = await engine.add_requests([("x", [5] * 4, greedy(200))])
        with pytest.raises(QueueFullError):
            # the first of this pair fits; the second finds the queue full: both undone
            await engine.add_requests([("y", [5] * 4, greedy()), ("z", [5] * 4, greedy())])
        stream.cancel()
        await _until_idle(engine)
        return engine.engine.scheduler.kv.num_free_blocks
    assert run(body, max_num_queued_reqs=1, max_num_seqs=1, max_num_batched_tokens=64) == 256


def test_cancelling_a_consumer_aborts_and_frees_the_blocks():
    async def body(engine):
        async def consume():
            async for _ in engine.generate("c", [7] * 40, greedy(1000)):
                pass
        task = asyncio.ensure_future(consume())
        for _ in range(2000):
            if engine.stats.num_running:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until_idle(engine)
        return engine.engine.scheduler.kv.num_free_blocks, engine.stats.num_finished
    free, finished = run(body)
    assert free == 256
    assert finished == {"abort": 1}


def test_a_caller_gone_while_its_request_is_added_leaves_the_engine_serving():
    """Cancelled at its await on the add (a client gone, a second Ctrl-C): the engine
    thread set a cancelled future's result, raised, and failed every request (QA)."""
    async def body(engine):
        for attempt in range(5):
            task = asyncio.ensure_future(engine.add_requests([(f"gone-{attempt}", [7] * 8,
                                                               greedy(4))]))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        tokens = [c.new_token_ids async for c in engine.generate("after", [7] * 8, greedy(3))]
        await _until_idle(engine)
        return sum(map(len, tokens)), engine.is_running, engine.stats.num_finished
    count, running, finished = run(body)
    assert (count, running) == (3, True)
    assert finished.get("length") == 1 and sum(finished.values()) <= 6


def test_abort_from_outside_ends_the_stream_with_an_abort_chunk():
    async def body(engine):
        stream = await engine.add_requests([("o", [7] * 10, greedy(1000))])
        engine.abort("o")
        return [c async for c in stream]
    chunks = run(body)
    assert chunks[-1].finished and chunks[-1].finish_reason == "abort"
    assert chunks[-1].stop_reason == ABORTED


def test_queue_timeout_ends_a_waiting_stream():
    async def body(engine):
        busy = await engine.add_requests([("busy", [7] * 10, greedy(300))])
        late = await engine.add_requests([("late", [8] * 10, greedy(4, max_queue_delay=0.001))])
        chunks = [c async for c in late]
        busy.cancel()
        return chunks
    chunks = run(body, max_num_seqs=1, max_num_batched_tokens=64)
    assert chunks[-1].finish_reason == "abort" and chunks[-1].stop_reason == QUEUE_TIMEOUT


def test_a_stream_of_several_requests_ends_when_all_finish():
    async def body(engine):
        stream = await engine.add_requests([(f"g{i}", [9] * 5, greedy(3 + i)) for i in range(3)])
        return [c async for c in stream]
    chunks = run(body)
    assert sorted({c.request_id for c in chunks if c.finished}) == ["g0", "g1", "g2"]


class _Broken:
    def execute(self, scheduler_output):
        raise RuntimeError("the device fell off")


def test_a_failed_engine_loop_ends_every_stream_and_refuses_new_work():
    from kvserve.engine.async_engine import EngineDeadError

    async def main():
        engine = make_engine()
        engine.executor = _Broken()
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            stream = await async_engine.add_requests([("d", [5] * 4, greedy())])
            with pytest.raises(EngineDeadError, match="the device fell off"):
                async for _ in stream:
                    pass
            assert not async_engine.is_running
            # its request failed: the gauges read nothing in flight, the counters stay
            stats = async_engine.stats
            assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0)
            assert stats.num_free_blocks == stats.num_blocks
            with pytest.raises(EngineDeadError):
                await async_engine.add_requests([("e", [5] * 4, greedy())])
        finally:
            await async_engine.stop()
    asyncio.run(asyncio.wait_for(main(), timeout=30))
