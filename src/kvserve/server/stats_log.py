"""Server logs: the boot lines about the KV cache, one structured line per preemption, and a
periodic line with throughput, queues, KV usage, prefix hit rate and preemptions; with a
host KV tier (``--swap-space``) its size at boot and its use in the periodic line."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from kvserve.core import EventType
from kvserve.engine.async_engine import StepReport
from kvserve.server.state import ServerState

logger = logging.getLogger("kvserve.server")

# The line's prefix cache hit rate is over the lookups of about this many most recent
# sequences, as vLLM's (CachingMetrics): a window with no new prompt does not read 0%.
RECENT_PROMPTS = 1000


def log_boot(state: ServerState) -> None:
    info = state.engine.info
    num_tokens = info.num_kv_blocks * info.block_size
    max_model_len = info.max_model_len
    replicas = getattr(state.engine, "num_replicas", 1)
    each = f" per replica, {replicas} replicas" if replicas > 1 else ""
    logger.info("KV cache size: %d tokens (%d blocks of %d)%s", num_tokens, info.num_kv_blocks,
                info.block_size, each)
    logger.info("Maximum concurrency for %d tokens per request: %.2fx%s", max_model_len,
                num_tokens / max_model_len, each)
    if num_tokens < max_model_len:  # vLLM refuses to start; kvserve serves, rule J2
        logger.warning("the KV cache holds %d tokens%s, fewer than max_model_len %d: a "
                       "sequence stops at %d tokens with stop_reason 'kv_capacity' (rule "
                       "J2); lower --max-model-len or give the cache more memory",
                       num_tokens, " per replica" if replicas > 1 else "", max_model_len,
                       num_tokens)
    logger.info("%s", host_tier_line(state))
    logger.info("%s", steps_line(state))


def steps_line(state: ServerState) -> str:
    """What one step may hold (docs/scheduler.md, D and Q), for the boot log."""
    config = state.engine.info.scheduler_config
    limits = (f"max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
              f"{config.max_num_batched_tokens}")
    # what an admission leaves free, where set (QA: a watermark held requests back unnamed)
    if config.watermark:
        limits += f", watermark {config.watermark:g} (of the KV blocks, kept free to admit)"
    if config.admission_policy != "optimistic":
        limits += f", admission policy {config.admission_policy}"
    if config.enable_priority_preemption:  # QA: a request waited 28 s, nothing said why
        limits += (f", urgent preemption of running priority values more than "
                   f"{config.priority_preemption_threshold} above an arrival's")
    if config.step_mix == "mixed":
        return f"Steps: mixed (decodes and prefill chunks share each step, vLLM V1); {limits}"
    bound = (f"at most {config.max_prefill_only_steps} in a row"
             if config.max_prefill_only_steps else "no bound in a row")
    return (f"Steps: prefill-first (pending prefills run alone while decodes wait, SGLang's "
            f"default; {bound}); {limits}")


def host_tier_line(state: ServerState) -> str:
    """The host KV tier (``--swap-space``) and the preemption mode, for the boot log (per
    replica, as the KV cache's line: each holds its own tier; the data-parallel pass)."""
    info = state.engine.info
    mode = info.scheduler_config.preemption_mode
    if not info.num_host_blocks:
        return f"Host KV cache (swap space): none; preemption mode: {mode}"
    size = f", {_size(info.host_kv_cache_bytes)}" if info.host_kv_cache_bytes else ""
    replicas = getattr(state.engine, "num_replicas", 1)
    each = f" per replica, {replicas} replicas" if replicas > 1 else ""
    return (f"Host KV cache (swap space): {info.num_host_blocks * info.block_size} tokens "
            f"({info.num_host_blocks} blocks of {info.block_size}{size}){each}; "
            f"preemption mode: {mode}")


def _size(num_bytes: int) -> str:
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):.2f} GiB"
    return f"{num_bytes / (1 << 20):.1f} MiB"


def log_preemptions(report: StepReport) -> None:
    """Engine thread: one key=value line per preemption, with its mode and why (the
    scheduler's reason: "recompute", "swap", "recompute (host tier full)", a "priority:"
    prefix for an urgent arrival, both prices under auto). A swapped victim loses no
    tokens: they move to the host tier."""
    for event in report.events:
        if event.kind is EventType.PREEMPTED:
            reason = event.reason or "recompute"
            mode = reason.removeprefix("priority:").split(" ", 1)[0]
            lost, swapped = (0, event.num_tokens) if mode == "swap" else (event.num_tokens, 0)
            logger.info("preemption request_id=%s mode=%s num_tokens_lost=%d "
                        "num_tokens_swapped=%d running=%d waiting=%d kv_cache_usage=%.3f "
                        "reason=%r", event.request_id, mode, lost, swapped,
                        report.stats.num_running, report.stats.num_waiting,
                        report.stats.kv_cache_usage, reason)


class StatsLogger:
    """Preemption lines as they happen; every ``interval`` seconds of :meth:`run`, one stats
    line, unless the server was idle the whole time."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._last = (time.monotonic(), 0, 0, 0, 0, 0, 0)
        # the windows' (prompts, lookups, hits) that the hit rate is over, and their sums
        self._recent: deque[tuple[int, int, int]] = deque()
        self._recent_sums = [0, 0, 0]
        state.engine.observers.append(log_preemptions)

    def line(self) -> str | None:
        now = time.monotonic()
        metrics, stats = self.state.metrics, self.state.engine.stats
        current = (now, metrics.num_prompt_tokens, metrics.num_generation_tokens,
                   stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits,
                   metrics.num_prompts)
        last, self._last = self._last, current
        elapsed = max(now - last[0], 1e-9)
        # A replica's counters carry on across its restart (DataParallelEngine); should a
        # count still fall, the window counts from there, never below 0.
        prompt, generated, preempted, queries, hits, prompts = (
            max(0, c - p) for c, p in zip(current[1:], last[1:], strict=True))
        hit_rate = self._recent_hit_rate(prompts, queries, hits)
        if not (prompt or generated or stats.num_running or stats.num_waiting):
            return None
        # With a host tier, vLLM V0's "Swapped" count and the tier's usage join the line.
        host = "" if not stats.num_host_blocks else (
            f"Swapped: {stats.num_swapped} reqs, Host KV cache usage: "
            f"{100 * (1 - stats.num_free_host_blocks / stats.num_host_blocks):.1f}%, ")
        return (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"{host}KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {hit_rate:.1f}%, Preemptions: {preempted}")

    def _recent_hit_rate(self, prompts: int, queries: int, hits: int) -> float:
        """The hit rate in percent over the windows of the last RECENT_PROMPTS prompts, this
        one's (``prompts``, ``queries``, ``hits``) added."""
        recent, sums = self._recent, self._recent_sums
        if queries or prompts:
            recent.append((prompts, queries, hits))
            sums[:] = [total + part for total, part in zip(sums, recent[-1], strict=True)]
        while len(recent) > 1 and sums[0] - recent[0][0] >= RECENT_PROMPTS:
            sums[:] = [total - part for total, part in zip(sums, recent.popleft(),
                                                            strict=True)]
        return 100.0 * sums[2] / sums[1] if sums[1] else 0.0

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.state.metrics.flush_slow_steps()
            line = self.line()
            if line is not None:
                logger.info(line)
