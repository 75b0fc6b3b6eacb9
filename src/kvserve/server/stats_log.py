"""Server logs: the boot lines about the KV cache, one structured line per preemption, and a
periodic line with throughput, queues, KV usage, prefix hit rate and preemptions."""

from __future__ import annotations

import asyncio
import logging
import time

from kvserve.core import EventType
from kvserve.engine.async_engine import StepReport
from kvserve.server.state import ServerState

logger = logging.getLogger("kvserve.server")


def log_boot(state: ServerState) -> None:
    info = state.engine.info
    num_tokens = info.num_kv_blocks * info.block_size
    max_model_len = info.max_model_len
    logger.info("KV cache size: %d tokens (%d blocks of %d)", num_tokens, info.num_kv_blocks,
                info.block_size)
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_model_len,
                num_tokens / max_model_len)


def log_preemptions(report: StepReport) -> None:
    """Engine thread: one key=value line per preemption."""
    for event in report.events:
        if event.kind is EventType.PREEMPTED:
            logger.info("preemption request_id=%s num_tokens_lost=%d running=%d waiting=%d "
                        "kv_cache_usage=%.3f", event.request_id, event.num_tokens,
                        report.stats.num_running, report.stats.num_waiting,
                        report.stats.kv_cache_usage)


class StatsLogger:
    """Preemption lines as they happen; every ``interval`` seconds of :meth:`run`, one stats
    line, unless the server was idle the whole time."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._last = (time.monotonic(), 0, 0, 0, 0, 0)
        state.engine.observers.append(log_preemptions)

    def line(self) -> str | None:
        now = time.monotonic()
        metrics, stats = self.state.metrics, self.state.engine.stats
        current = (now, metrics.num_prompt_tokens, metrics.num_generation_tokens,
                   stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits)
        last, self._last = self._last, current
        elapsed = max(now - last[0], 1e-9)
        prompt, generated, preempted, queries, hits = (c - p for c, p in
                                                       zip(current[1:], last[1:], strict=True))
        if not (prompt or generated or stats.num_running or stats.num_waiting):
            return None
        hit_rate = 100.0 * hits / queries if queries else 0.0
        return (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {hit_rate:.1f}%, Preemptions: {preempted}")

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            line = self.line()
            if line is not None:
                logger.info(line)
