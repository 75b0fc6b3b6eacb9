"""Drive a whole benchmark: arrivals (trace times, Poisson, or a fixed concurrency), the
requests, and the server's /metrics before and after."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvserve.bench.client import RequestResult, Target, send
from kvserve.bench.workload import BenchRequest

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass
class RunResult:
    results: list[RequestResult]
    duration: float
    metrics_before: dict[str, float] | None
    metrics_after: dict[str, float] | None


# Gauges of a share, one sample per engine: their mean, where a sum reads past 100% with
# data-parallel engines (QA: two engines at 80% read 1.6).
_MEAN_OVER_LABELS = frozenset({"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"})


async def scrape_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """Every sample of /metrics summed over its labels (a share's gauge averaged); None if
    the server has no /metrics."""
    try:
        response = await client.get(base_url + "/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            try:
                value = float(match.group(3))
            except ValueError:
                continue
            name = match.group(1)
            totals[name] = totals.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    for name in _MEAN_OVER_LABELS & totals.keys():
        totals[name] /= counts[name]
    return totals


async def first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(base_url + "/v1/models", headers=headers)
        response.raise_for_status()
        listed = response.json()
    models = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(models, list) or not models or not isinstance(models[0], dict) or \
            not isinstance(models[0].get("id"), str):  # QA: a list was a TypeError traceback
        raise ValueError("the server lists no model (an OpenAI list's data[0].id): give "
                         "--model")
    return models[0]["id"]


async def run(requests: list[BenchRequest], target: Target, *,
              max_concurrency: int | None = None, disconnect_prob: float = 0.0,
              seed: int = 0, timeout: float = 600.0,
              on_done: Callable[[RequestResult], None] | None = None) -> RunResult:
    rng = random.Random(seed + 2)
    disconnects = [rng.randint(1, max(1, r.max_tokens - 1))
                   if rng.random() < disconnect_prob else None for r in requests]
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30),
                                 limits=limits) as client:
        before = await scrape_metrics(client, target.base_url)
        start = time.perf_counter()
        previous_turn = _previous_turns(requests)
        ended = {r.index: asyncio.Event() for r in requests if r.session is not None}

        async def one(request: BenchRequest, disconnect_after: int | None) -> RequestResult:
            try:
                return await answered(request, disconnect_after)
            finally:  # however it ended: its session's next turn may go
                if request.index in ended:
                    ended[request.index].set()

        async def answered(request: BenchRequest, disconnect_after: int | None
                           ) -> RequestResult:
            if request.arrival_time is not None:
                await asyncio.sleep(max(0.0, start + request.arrival_time -
                                        time.perf_counter()))
            before_me = previous_turn.get(request.index)
            if before_me is not None:  # a chat client reads the answer first (no slot held)
                await ended[before_me].wait()
            if gate is None:
                result = await _send(client, target, request, disconnect_after, timeout)
            else:
                async with gate:
                    result = await _send(client, target, request, disconnect_after, timeout)
            if on_done is not None:
                on_done(result)
            return result

        results = await asyncio.gather(*(one(r, d) for r, d in
                                         zip(requests, disconnects, strict=True)))
        duration = time.perf_counter() - start
        after = await scrape_metrics(client, target.base_url)
    return RunResult(list(results), duration, before, after)


def _previous_turns(requests: list[BenchRequest]) -> dict[int, int]:
    """Each session turn's index -> the index of its session's turn before it (in the
    requests' order, which is the trace's arrival order)."""
    last: dict[tuple[str, str], int] = {}
    before: dict[int, int] = {}
    for request in requests:
        if request.session is not None:
            if request.session in last:
                before[request.index] = last[request.session]
            last[request.session] = request.index
    return before


async def _send(client: httpx.AsyncClient, target: Target, request: BenchRequest,
                disconnect_after: int | None, timeout: float) -> RequestResult:
    """One request; whatever its answer raises fails that request, not the run (QA: an odd
    event's AttributeError lost every result)."""
    try:
        return await send(client, target, request, disconnect_after, timeout)
    except Exception as error:  # reported as the request's error
        return RequestResult(request.index, num_prompt_tokens=request.num_prompt_tokens,
                             streamed=target.stream,
                             error=f"bad answer: {type(error).__name__}: {error}")
