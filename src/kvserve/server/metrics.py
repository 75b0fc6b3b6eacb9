"""Prometheus metrics under vLLM's names (docs/architecture.md, "Metrics"), so existing
dashboards work, plus kvserve's own under ``kvserve:``. Every series carries ``model_name``, and
every one an engine observes (scheduler figures, per-request counters and histograms)
``engine="i"``, as vLLM labels them (``engine="0"`` for a single engine).

Scheduler-wide figures (running, waiting, KV usage, preemptions, prefix cache, recomputed
tokens, blocked admissions) are read from the engine's latest stats snapshot at scrape time;
per-request figures are observed on the engine thread as steps complete (:meth:`observe`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.core import RequestMetrics, SchedulerStats
from kvserve.core.preemption import PRIORITY, RECOMPUTE, SWAP
from kvserve.core.sessions import RELEASE_REASONS
from kvserve.core.stop import QUEUE_ENDS, ended_in_queue
from kvserve.engine.async_engine import ServingEngine, StepReport
from kvserve.engine.core_loop import ABORTED
from kvserve.engine.engine import CompletionChunk
from kvserve.server.slow_steps import SlowSteps
from kvserve.server.tenant_metrics import TenantCounters, TenantSeries

_UNCOUNTED = (ABORTED, *QUEUE_ENDS)  # finishes the per-request histograms skip
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM V1's buckets for a request's phases (E2E, queue, prefill, decode, inference) and for
# the time between tokens (inter-token latency, time per output token), so dashboards built
# on vLLM's bucket bounds read these series unchanged.
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                      2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM 0.32's, so a dashboard's le="4.0" reads the same (QA: 0 ... 100 here, no 4)
_COUNT_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
RECENT_SERVICE_TIMES = 100  # the requests Retry-After's pace is the mean of
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's finished_reason values
WAITING_REASONS = ("capacity", "deferred")  # vLLM's; nothing here defers a request
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens",
                     "max_num_queued_reqs_per_tenant")


def _1_2_5_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10



@dataclass
class _Group:
    """One prompt's ``n`` sequences, as vLLM's parent request: its n and its longest answer
    are observed when the last of them finishes."""

    n: int
    remaining: int
    longest: int = 0
    counted: bool = False  # a sequence of it finished that the histograms count

    def finish(self, num_generated: int, counted: bool) -> bool:
        """One sequence finished (``counted``: by the histograms); whether it was the last
        of a group the histograms count."""
        if counted:
            self.longest = max(self.longest, num_generated)
            self.counted = True
        self.remaining -= 1
        return not self.remaining and self.counted


@dataclass
class _Live:
    arrival_time: float
    num_prompt_tokens: int
    last_token_time: float | None = None
    tenant: TenantCounters | None = None
    max_tokens: int | None = None  # the request's max_tokens parameter (after the context)
    group: _Group | None = None
    num_generated: int = 0
    engine: int = 0  # the replica its tokens came from (data parallel: one placed again
    # after its replica died changes it, docs/scale-out.md)


class _EngineSeries:
    """The per-request series of one engine (``engine="i"``, as vLLM labels every series it
    observes; a dashboard's ``sum by (engine)`` reads them). A request's are observed on the
    engine that ran it."""

    def __init__(self, families: dict[str, Histogram | Counter], model_name: str,
                 engine: int, replicas: int = 1) -> None:
        labels = (model_name, str(engine))
        self.prompt_tokens = families["prompt_tokens"].labels(*labels)
        self.generation_tokens = families["generation_tokens"].labels(*labels)
        self.prompt_tokens_cached = families["prompt_tokens_cached"].labels(*labels)
        self.by_source = {source: families["prompt_tokens_by_source"].labels(*labels, source)
                          for source in PROMPT_SOURCES}
        self.labels = labels
        self.slow_steps_total = families["slow_steps"].labels(*labels)
        self.slow_steps = SlowSteps(engine, replicas)
        self.request_success = families["request_success"]
        for reason in FINISHED_REASONS:  # from boot, as vLLM's: rate() sees the first one
            self.request_success.labels(*labels, reason)
        for name in _ENGINE_HISTOGRAMS:
            setattr(self, name, families[name].labels(*labels))

    def success(self, reason: str) -> Counter:
        return self.request_success.labels(*self.labels, reason)


# Stands for token-count buckets up to the server's max_model_len (_1_2_5_buckets).
_TOKEN_COUNTS: tuple[float, ...] = ()
# attribute: (series name, help, buckets); every one labelled model_name and engine
_ENGINE_HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "ttft": ("vllm:time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS),
    "itl": ("vllm:inter_token_latency_seconds",
            "Time between consecutive tokens of a request.", _TOKEN_GAP_BUCKETS),
    "e2e": ("vllm:e2e_request_latency_seconds", "Arrival to finish.",
            _REQUEST_LATENCY_BUCKETS),
    "queue_time": ("vllm:request_queue_time_seconds", "Arrival to first scheduling.",
                   _REQUEST_LATENCY_BUCKETS),
    "request_preemptions": ("vllm:request_num_preemptions", "Preemptions per finished "
                            "request.", _COUNT_BUCKETS),
    "stall": ("kvserve:preemption_stall_seconds", "Longest preemption-to-next-token stall of "
              "a preempted request.", _LATENCY_BUCKETS),
    "request_prompt_tokens": ("vllm:request_prompt_tokens", "Prompt tokens per request.",
                              _TOKEN_COUNTS),
    "request_generation_tokens": ("vllm:request_generation_tokens",
                                  "Generated tokens per request.", _TOKEN_COUNTS),
    "request_max_tokens": ("vllm:request_params_max_tokens",
                           "The max_tokens request parameter.", _TOKEN_COUNTS),
    "request_n": ("vllm:request_params_n", "The n request parameter.", _N_BUCKETS),
    "request_max_generation": ("vllm:request_max_num_generation_tokens",
                               "The longest answer among a request's n sequences.",
                               _TOKEN_COUNTS),
    "inference_time": ("vllm:request_inference_time_seconds",
                       "First scheduled to finish (running).", _REQUEST_LATENCY_BUCKETS),
    "prefill_time": ("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                     _REQUEST_LATENCY_BUCKETS),
    "decode_time": ("vllm:request_decode_time_seconds", "First token to finish.",
                    _REQUEST_LATENCY_BUCKETS),
    "time_per_output_token": ("vllm:request_time_per_output_token_seconds",
                              "Mean time between a request's tokens after the first (0 for "
                              "one token).", _TOKEN_GAP_BUCKETS),
    "iteration_tokens": ("vllm:iteration_tokens_total", "Tokens per engine step.",
                         _STEP_TOKEN_BUCKETS),
    "prefill_kv_computed": ("vllm:request_prefill_kv_computed_tokens",
                            "Prompt tokens a request computed (not prefix-cache hits).",
                            _TOKEN_COUNTS),
}
# vLLM's prompt token sources (vllm:prompt_tokens_by_source); nothing comes over a KV
# connector here, so external_kv_transfer stays 0
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


# prometheus-fastapi-instrumentator's default bounds, which vLLM's server exports (QA: 14
# others here, so a fleet's histogram_quantile mixed bounds)
_HTTP_SECONDS = (0.1, 0.5, 1.0)


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH",
                          "TRACE", "CONNECT"})  # the http series' method label's values


# Routes the http series leave out, as vLLM's instrumentator excludes them (the metrics
# pass: a dashboard's request rate counted Prometheus' scrapes and the probes)
UNCOUNTED_ROUTES = frozenset({"/metrics", "/metrics/", "/health", "/load", "/ping",
                              "/version"})


class HttpMetrics:
    """ASGI middleware: each HTTP request's route (its template, ``none`` where no route
    matched), method, status class and duration into ``metrics``' http series, but for the
    scrapes and probes (UNCOUNTED_ROUTES)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets if the app fails before answering

        async def sending(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            handler = getattr(route, "path", None) or "none"
            if handler not in UNCOUNTED_ROUTES:
                self._count(handler, scope["method"], status, time.perf_counter() - start)

    def _count(self, handler: str, method: str, status: int, seconds: float) -> None:
        # the HTTP parser (h11) takes any method name: one a client invents is "other"
        # (QA: each made series of its own, for the life of the server)
        method = method if method in HTTP_METHODS else "other"
        self.metrics.http_requests.labels(handler, method, f"{status // 100}xx").inc()
        self.metrics.http_duration.labels(handler, method).observe(seconds)


class ServerMetrics:
    def __init__(self, engine: ServingEngine, model_name: str,
                 known_tenants: list[str] | None = None) -> None:
        """``known_tenants``: the tenants of the API keys, when keys are configured (the
        ``tenant`` label's values; any other tenant counts as ``other``)."""
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StatsCollector(engine, model_name))
        # the process_*, python_gc_* and python_info series vLLM's server exports (of this,
        # the API server's, process), which generic alerts read (QA: none here)
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)
        self.tenants = TenantSeries(engine, model_name, self.registry, known_tenants)
        labels = ["model_name"]
        reg = self.registry
        per_engine = ["model_name", "engine"]
        tokens = _1_2_5_buckets(engine.info.max_model_len)
        self._families: dict[str, Histogram | Counter] = {
            "prompt_tokens": Counter("vllm:prompt_tokens", "Prefill tokens processed.",
                                     per_engine, registry=reg),
            "generation_tokens": Counter("vllm:generation_tokens", "Generated tokens.",
                                         per_engine, registry=reg),
            "prompt_tokens_cached": Counter("vllm:prompt_tokens_cached",
                                            "Prompt tokens read from the prefix cache.",
                                            per_engine, registry=reg),
            "prompt_tokens_by_source": Counter("vllm:prompt_tokens_by_source",
                                               "Prompt tokens of finished requests, by "
                                               "where their KV came from.",
                                               [*per_engine, "source"], registry=reg),
            "request_success": Counter("vllm:request_success", "Finished requests.",
                                       [*per_engine, "finished_reason"], registry=reg),
            "slow_steps": Counter("kvserve:slow_steps", "Engine steps that took over 10x the "
                                  "median of the engine's recent steps and at least 0.25 s "
                                  "(kvserve/server/slow_steps.py: a shared CPU, usually).",
                                  per_engine, registry=reg),
            **{name: Histogram(series, text, per_engine, registry=reg,
                               buckets=tokens if buckets is _TOKEN_COUNTS else buckets)
               for name, (series, text, buckets) in _ENGINE_HISTOGRAMS.items()}}
        # every engine's series from boot, as vLLM's: rate() sees the first request
        replicas = getattr(engine, "num_replicas", 1)
        self._engines = [_EngineSeries(self._families, model_name, index, replicas)
                         for index in range(replicas)]
        self.failed = Counter("kvserve:requests_failed",
                              "Sequences (each choice of a request) an engine's death ended "
                              "under way (answered 503, or whose client had left), by "
                              "reason.", [*labels, "reason"], registry=reg)
        self.rejected = Counter("kvserve:requests_rejected",
                                "Requests the scheduler refused at arrival, by HTTP status.",
                                [*labels, "status"], registry=reg)
        for status in ("400", "409", "503"):  # every series from boot, as vLLM's counters
            self.rejected.labels(model_name, status)
        self.failed.labels(model_name, "engine_died")
        self.queue_timeouts = Counter(
            "kvserve:queue_timeouts", "Requests answered 503 because they waited past their "
            "queue deadline (--max-queue-delay, max_queue_delay) unscheduled.", labels,
            registry=reg).labels(model_name)
        self.queue_displacements = Counter(
            "kvserve:queue_displacements", "Waiting requests answered 503 because a more "
            "urgent arrival took their place in the full queue (priority policy, K5).",
            labels, registry=reg).labels(model_name)
        admission = Counter("vllm:admission_rejections",
                            "Admission attempts rejected by a queue limit, by reason.",
                            [*labels, "reason"], registry=reg)
        self.admission_rejections = {reason: admission.labels(model_name, reason)
                                     for reason in ADMISSION_REASONS}
        # Every HTTP answer, as vLLM's server counts them (prometheus-fastapi-instrumentator's
        # names): 4xx and 503 included, which no engine series sees (QA)
        self.http_requests = Counter("http_requests", "HTTP requests answered, by route, "
                                     "method and status class.",
                                     ["handler", "method", "status"], registry=reg)
        self.http_duration = Histogram("http_request_duration_seconds", "Seconds from a "
                                       "request's arrival to the end of its answer (a "
                                       "stream's last byte).", ["handler", "method"],
                                       registry=reg, buckets=_HTTP_SECONDS)
        info = engine.info
        # vLLM's labels where the engine has the fact (its engine label too, for joins on
        # it; QA: without), and model_name as every series here
        size_tokens = info.num_kv_blocks * info.block_size
        config_info = Gauge(
            "vllm:cache_config_info", "KV cache configuration.",
            ["model_name", "engine", "block_size", "num_gpu_blocks", "enable_prefix_caching",
             "cache_dtype", "kv_cache_size_tokens", "kv_cache_max_concurrency",
             "num_cpu_blocks"], registry=reg)
        for index in range(replicas):
            config_info.labels(
                model_name, str(index), str(info.block_size), str(info.num_kv_blocks),
                str(info.enable_prefix_caching), "auto", str(size_tokens),
                f"{size_tokens / info.max_model_len:.1f}",
                str(info.num_host_blocks) if info.num_host_blocks else "None").set(1)
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self.num_prompt_tokens = 0  # plain totals for the periodic log line
        self.num_generation_tokens = 0
        self.num_prompts = 0  # sequences whose prompt was computed (a first token came)
        # the most recent requests' first-scheduled-to-finish seconds (Retry-After's pace)
        self._service_times: deque[float] = deque(maxlen=RECENT_SERVICE_TIMES)
        engine.observers.append(self.observe)

    def flush_slow_steps(self) -> None:
        """Log the engines' slow steps not told yet (the periodic stats loop)."""
        for series in self._engines:
            series.slow_steps.flush()

    def series(self, engine: int = 0) -> _EngineSeries:
        """Engine ``engine``'s per-request series."""
        while engine >= len(self._engines):
            self._engines.append(_EngineSeries(self._families, self.model_name,
                                               len(self._engines)))
        return self._engines[engine]

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- per request -----------------------------------------------------------------------

    def request_added(self, request_id: str, arrival_time: float,
                      num_prompt_tokens: int, tenant: TenantCounters | None = None) -> None:
        with self._lock:
            self._live[request_id] = _Live(arrival_time, num_prompt_tokens, tenant=tenant)

    def request_dropped(self, request_id: str) -> None:
        with self._lock:
            self._live.pop(request_id, None)

    def requests_failed(self, request_ids: list[str], reason: str = "engine_died") -> None:
        """Requests that will never finish in an engine (their engine died under them):
        counted, and no longer followed."""
        with self._lock:
            ended = [live for request_id in request_ids
                     if (live := self._live.pop(request_id, None)) is not None]
            for live in ended:  # in vllm:prompt_tokens: in its sources too (the review: they
                if live.last_token_time is not None:  # drifted apart); its hits unknown
                    self.series(live.engine).by_source["local_compute"].inc(
                        live.num_prompt_tokens)
        if ended:
            self.failed.labels(self.model_name, reason).inc(len(ended))

    def request_params(self, sequences: Sequence[tuple[str, int | None]], n: int) -> None:
        """Sequences the engine took, (request id, max_tokens) each, ``n`` per prompt in
        order: each sequence's max_tokens is observed as it finishes (vLLM counts one per
        sequence), each prompt's n and longest answer when its last sequence does (one per
        parent request, as vLLM's)."""
        with self._lock:
            for start in range(0, len(sequences), n):
                ids = sequences[start:start + n]
                group = _Group(n, len(ids))
                for request_id, max_tokens in ids:
                    live = self._live.get(request_id)
                    if live is not None:
                        live.max_tokens, live.group = max_tokens, group

    def observe(self, report: StepReport) -> None:
        """Engine thread, after each step."""
        now = report.time + report.seconds
        series = self.series(report.engine)
        if report.num_scheduled_tokens:
            series.iteration_tokens.observe(report.num_scheduled_tokens)
            sequences = report.shape.num_seqs if report.shape is not None \
                else len(report.chunks)
            if series.slow_steps.observe(report.seconds, report.num_scheduled_tokens,
                                         sequences):
                series.slow_steps_total.inc()
        with self._lock:
            for chunk in report.chunks:
                live = self._live.get(chunk.request_id)
                if live is None:
                    continue
                num_new = len(chunk.new_token_ids)
                if num_new:
                    self._token(series, live, num_new, now, report.engine)
                if chunk.finished:
                    del self._live[chunk.request_id]
                    self._sequence_finished(series, live, chunk)

    def _sequence_finished(self, series: _EngineSeries, live: _Live,
                           chunk: CompletionChunk) -> None:
        if not ended_in_queue(chunk.finish_reason, chunk.stop_reason):
            # (the queue ended it unrun: its client got a 503, as for a full queue, which no
            # success counts; the metrics pass: a timeout read as request_success{abort})
            series.success(chunk.finish_reason or "error").inc()
        elif live.tenant is not None:  # whose requests the queue ends (QA: not told)
            live.tenant.queue_ends[str(chunk.stop_reason)].inc()
        if live.last_token_time is not None and chunk.metrics is not None:
            # its prompt's sources, counted for every prompt vllm:prompt_tokens counts (at
            # its first token; the metrics pass: an aborted one's were left out, and the
            # two totals drifted apart for good)
            metrics = chunk.metrics
            cached = min(max(metrics.num_cached_tokens, 0), metrics.num_prompt_tokens)
            series.by_source["local_compute"].inc(metrics.num_prompt_tokens - cached)
            series.by_source["local_cache_hit"].inc(cached)
            series.prompt_tokens_cached.inc(cached)
        # vLLM's per-request histograms leave out what a client or an operator aborted (its
        # metrics still reach the response), and so what the waiting queue ended unrun (a
        # 503: K4, K5)
        counted = not (chunk.finish_reason == "abort" and chunk.stop_reason in _UNCOUNTED)
        if counted and live.max_tokens is not None:
            series.request_max_tokens.observe(live.max_tokens)
        group = live.group
        if group is not None and group.finish(live.num_generated, counted):
            series.request_n.observe(group.n)
            series.request_max_generation.observe(group.longest)
        if counted and chunk.metrics is not None:
            self._finished(series, chunk.metrics)

    def _token(self, series: _EngineSeries, live: _Live, num_new: int, now: float,
               engine: int) -> None:
        if live.last_token_time is None:
            series.ttft.observe(max(0.0, now - live.arrival_time))
            series.prompt_tokens.inc(live.num_prompt_tokens)
            self.num_prompt_tokens += live.num_prompt_tokens
            self.num_prompts += 1
            if live.tenant is not None:
                live.tenant.prompt_tokens.inc(live.num_prompt_tokens)
            live.engine = engine
        elif engine != live.engine:  # placed again: the re-run's first token is no ITL
            live.engine = engine     # (QA: one spanned the death and the relaunch), and
            live.num_generated = 0   # its answer starts over (the longest-answer histogram
            # passed max_tokens); the counters keep the dropped run's tokens: engine work
        else:
            series.itl.observe(max(0.0, now - live.last_token_time) / num_new)
        live.last_token_time = now
        live.num_generated += num_new
        series.generation_tokens.inc(num_new)
        if live.tenant is not None:
            live.tenant.generation_tokens.inc(num_new)
        self.num_generation_tokens += num_new

    def recent_service_time(self) -> float | None:
        """Mean seconds from first scheduled to finished of the most recent requests (their
        time in a seat, not their wait for one); None before the first."""
        with self._lock:  # the engine thread appends
            times = list(self._service_times)
        return sum(times) / len(times) if times else None

    def _finished(self, series: _EngineSeries, metrics: RequestMetrics) -> None:
        e2e = max(0.0, metrics.finished_time - metrics.arrival_time)
        series.e2e.observe(e2e)
        if metrics.queue_time is not None:
            series.queue_time.observe(max(0.0, metrics.queue_time))
        series.request_preemptions.observe(metrics.num_preemptions)
        if metrics.num_preemptions:
            series.stall.observe(metrics.longest_stall)
        series.request_prompt_tokens.observe(metrics.num_prompt_tokens)
        cached = min(metrics.num_cached_tokens, metrics.num_prompt_tokens)
        series.prefill_kv_computed.observe(metrics.num_prompt_tokens - cached)
        series.request_generation_tokens.observe(metrics.num_output_tokens)
        scheduled, first_token = metrics.first_scheduled_time, metrics.first_token_time
        if scheduled is not None:
            inference = max(0.0, metrics.finished_time - scheduled)
            series.inference_time.observe(inference)
            self._service_times.append(inference)
            if first_token is not None:
                series.prefill_time.observe(max(0.0, first_token - scheduled))
        if first_token is not None:
            decode = max(0.0, metrics.finished_time - first_token)
            series.decode_time.observe(decode)
            series.time_per_output_token.observe(
                decode / (metrics.num_output_tokens - 1) if metrics.num_output_tokens > 1
                else 0.0)


@dataclass
class _Engine:
    labels: list[str]
    stats: SchedulerStats
    invariant_violations: int


def _families(family: type[GaugeMetricFamily] | type[CounterMetricFamily], labels: list[str],
              rows: tuple[tuple[str, str, Callable[[_Engine], float]], ...],
              engines: list[_Engine]) -> Iterator[Metric]:
    """One family of ``family``'s kind per (metric, help text, value) row, one sample per
    engine, labelled."""
    for metric, text, value in rows:
        series = family(metric, text, labels=labels)
        for engine in engines:
            series.add_metric(engine.labels, value(engine))
        yield series


class _StatsCollector(Collector):
    """Scheduler-wide series from each engine's latest stats snapshot, one sample per live
    engine labelled ``engine="i"`` as vLLM labels them (``engine="0"`` for a single engine),
    read through :meth:`ServingEngine.engine_figures`."""

    def __init__(self, engine: ServingEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        engines = [_Engine([self.model_name, str(e.index)], e.stats, e.invariant_violations)
                   for e in self.engine.engine_figures()]
        yield from _families(GaugeMetricFamily, labels, (
                ("vllm:num_requests_running", "Requests in the running batch.",
                 lambda e: e.stats.num_running),
                ("vllm:num_requests_waiting", "Requests waiting (new or preempted).",
                 lambda e: e.stats.num_waiting),
                ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).",
                 lambda e: e.stats.kv_cache_usage),
                ("kvserve:num_queued_tokens", "Tokens of the waiting requests.",
                 lambda e: e.stats.num_queued_tokens),
                ("kvserve:num_free_kv_blocks", "Free KV blocks.",
                 lambda e: e.stats.num_free_blocks)), engines)
        yield from _families(CounterMetricFamily, labels, (
                ("vllm:num_preemptions", "Preemptions.", lambda e: e.stats.num_preemptions),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 lambda e: e.stats.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 lambda e: e.stats.prefix_cache_hits),
                ("kvserve:prefix_cache_preempted_queries", "Tokens looked up in the prefix "
                 "cache by requests back from a preemption (not in vllm:prefix_cache_queries).",
                 lambda e: e.stats.prefix_cache_preempted_queries),
                ("kvserve:prefix_cache_preempted_hits", "Tokens of requests back from a "
                 "preemption found in the prefix cache (not in vllm:prefix_cache_hits).",
                 lambda e: e.stats.prefix_cache_preempted_hits),
                ("kvserve:recomputed_tokens", "Tokens computed again after a preemption.",
                 lambda e: e.stats.num_recomputed_tokens),
                ("kvserve:engine_steps", "Engine steps.", lambda e: e.stats.num_steps),
                ("kvserve:scheduled_tokens", "Tokens computed, recomputation included.",
                 lambda e: e.stats.num_scheduled_tokens),
                ("kvserve:prefill_only_steps", "Steps that ran prefills only while decodes "
                 "waited (--step-mix prefill-first).",
                 lambda e: e.stats.num_prefill_only_steps),
                ("kvserve:preemption_guard_waits", "Steps a running request got no tokens "
                 "because every victim had reached --max-preemptions-per-request (P2).",
                 lambda e: e.stats.num_guard_waits),
                ("kvserve:invariant_violations",
                 "Scheduler state checks (no leaked or doubly held KV block, ...) failed when "
                 "the engine fell idle.", lambda e: e.invariant_violations)), engines)
        yield from _preemption_families(labels, engines)
        yield from _session_families(labels, engines)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting_by_reason",
                                    "Waiting requests by reason: 'capacity' waits for room "
                                    "to be scheduled; 'deferred' is always 0 here.",
                                    labels=[*labels, "reason"])
        blocked = CounterMetricFamily("kvserve:admissions_blocked",
                                      "Steps whose waiting pass stopped, by reason.",
                                      labels=[*labels, "reason"])
        for engine in engines:
            for reason in WAITING_REASONS:
                waiting.add_metric([*engine.labels, reason],
                                   engine.stats.num_waiting if reason == "capacity" else 0)
            for reason, count in sorted(engine.stats.num_blocked_steps.items()):
                blocked.add_metric([*engine.labels, reason], count)
        yield waiting
        yield blocked
        yield from _router_families(self.engine, self.model_name)


def _router_families(engine: ServingEngine, model_name: str) -> Iterator[Metric]:
    """kvserve:router_decisions{replica,reason}, the prefix-affinity hit rate and replica
    restarts, when the engine routes among replicas."""
    figures = engine.router_figures()
    if figures is None:
        return
    counts = sorted(figures.decisions.items())
    family = CounterMetricFamily("kvserve:router_decisions",
                                 "Requests the router placed, by replica and reason.",
                                 labels=["model_name", "replica", "reason"])
    for (replica, reason), count in counts:
        family.add_metric([model_name, str(replica), reason], count)
    yield family
    total = sum(count for _, count in counts)
    hits = sum(count for (_, reason), count in counts if reason == "prefix_hit")
    rate = GaugeMetricFamily("kvserve:router_prefix_hit_rate",
                             "Share of routed requests sent to the replica holding their "
                             "prefix (prefix-affinity).", labels=["model_name"])
    rate.add_metric([model_name], hits / total if total else 0.0)
    yield rate
    per_replica = (
        (CounterMetricFamily, "kvserve:replica_restarts", "Replicas launched again after "
         "dying.", figures.num_restarts),
        (CounterMetricFamily, "kvserve:replica_restart_failures", "Relaunches of a dead "
         "replica that failed before it was ready (a crash loop).",
         figures.num_failed_restarts),
        (GaugeMetricFamily, "kvserve:replica_up", "1 while the replica serves; 0 while it is "
         "dead, restarting or waiting to restart.", [float(up) for up in figures.replicas_up]))
    for kind, name, text, values in per_replica:
        family = kind(name, text, labels=["model_name", "replica"])
        for replica, value in enumerate(values):
            family.add_metric([model_name, str(replica)], value)
        yield family


def _session_families(labels: list[str], engines: list[_Engine]) -> Iterator[Metric]:
    """Multi-turn sessions holding KV between turns (docs/scheduler.md, U1-U8)."""
    yield from _families(GaugeMetricFamily, labels, (
            ("kvserve:sessions_held", "Sessions holding a finished turn's KV now.",
             lambda e: e.stats.num_sessions_held),
            ("kvserve:session_kv_blocks", "KV blocks held by sessions between turns.",
             lambda e: e.stats.num_session_blocks)), engines)
    yield from _families(CounterMetricFamily, labels, (
            ("kvserve:session_hits", "Turns admitted on their session's held KV.",
             lambda e: e.stats.num_session_hits),
            ("kvserve:session_hit_tokens", "Prompt tokens of those turns not prefilled again.",
             lambda e: e.stats.num_session_hit_tokens)), engines)
    releases = CounterMetricFamily("kvserve:session_releases",
                                   "Sessions ended, by reason (ttl, pressure, limit, "
                                   "deleted, aborted, replaced): a hold let go, or a "
                                   "turn's KV that will not be held.",
                                   labels=[*labels, "reason"])
    for engine in engines:
        for reason in RELEASE_REASONS:
            releases.add_metric([*engine.labels, reason],
                                engine.stats.session_releases.get(reason, 0))
    yield releases


def _preemption_families(labels: list[str], engines: list[_Engine]) -> Iterator[Metric]:
    """The host KV tier and preemptions by mode (docs/preemption.md). ``mode="priority"``
    counts the preemptions made for an urgent arrival; each of those is also counted under
    the mode it used, so recompute + swap = vllm:num_preemptions_total."""
    yield from _families(GaugeMetricFamily, labels, (
            ("vllm:num_requests_swapped", "Requests whose KV waits in the host tier.",
             lambda e: e.stats.num_swapped),
            ("kvserve:host_kv_cache_usage_perc",
             "Fraction of host-tier KV blocks in use (0..1; 0 without --swap-space).",
             lambda e: 1.0 - e.stats.num_free_host_blocks / e.stats.num_host_blocks
             if e.stats.num_host_blocks else 0.0)), engines)
    by_mode = CounterMetricFamily("kvserve:preemptions",
                                  "Preemptions by mode; priority = for an urgent arrival "
                                  "(also counted under its recompute or swap mode).",
                                  labels=[*labels, "mode"])
    copied = CounterMetricFamily("kvserve:swapped_blocks",
                                 "KV blocks copied to (out) and from (in) the host tier.",
                                 labels=[*labels, "direction"])
    for engine in engines:
        for mode in (RECOMPUTE, SWAP, PRIORITY):
            by_mode.add_metric([*engine.labels, mode],
                               engine.stats.num_preemptions_by_mode.get(mode, 0))
        copied.add_metric([*engine.labels, "out"], engine.stats.num_swapped_out_blocks)
        copied.add_metric([*engine.labels, "in"], engine.stats.num_swapped_in_blocks)
    yield by_mode
    yield copied
