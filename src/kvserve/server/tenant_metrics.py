"""Per-tenant Prometheus series (docs/tenants.md, "Per-tenant metrics"), with a bounded
number of ``tenant`` label values.

A label value is a tenant's name when the tenants are known (the API keys file's tenants and
``operator``); any other name is ``other``. Without keys a tenant is ``user:<user>`` or
``addr:<ip>``, names a client chooses, so the first ``max_series`` distinct names get their
own series and every later one (and any name longer than ``MAX_LABEL_CHARS``) is counted as
``other``: no client can grow the scrape or the server's memory without bound. Such a
name's invisible characters are written as ``\\uXXXX`` in its label.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.core.stop import QUEUE_ENDS
from kvserve.engine.async_engine import ServingEngine

MAX_TENANT_SERIES = 100  # tenant labels given out when tenants are not known in advance
MAX_LABEL_CHARS = 128
OTHER = "other"


def _printable(name: str) -> str:
    """A client's name as a label value with its invisible characters (control, format,
    line and paragraph separators, lone surrogates) written as ``\\uXXXX``: a carriage return
    or a terminal's escape went into the scrape as sent (QA), where a reader that splits
    lines on CR, or a terminal showing the scrape, took them as its own."""
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in name)


@dataclass
class TenantCounters:
    """One tenant label's token counters, looked up once per request (the engine thread
    increments them per step)."""

    prompt_tokens: Counter
    generation_tokens: Counter
    queue_ends: dict[str, Counter]  # by stop reason: queue_timeout (K4), displaced (K5)


class TenantSeries:
    """``kvserve:tenant_requests_total``, ``kvserve:tenant_requests_rejected_total``,
    ``kvserve:tenant_requests_ended_in_queue_total`` (also labelled ``reason``),
    ``kvserve:tenant_prompt_tokens_total``, ``kvserve:tenant_generation_tokens_total`` and
    the gauge ``kvserve:tenant_queued_requests``, each labelled ``model_name`` and
    ``tenant``."""

    def __init__(self, engine: ServingEngine, model_name: str, registry: CollectorRegistry,
                 known: Iterable[str] | None = None,
                 max_series: int = MAX_TENANT_SERIES) -> None:
        self.model_name = model_name
        self.known = frozenset(known) if known is not None else None
        self.max_series = max_series
        self._labels: dict[str, str] = {}  # tenant -> its label, for tenants seen so far
        self._num_named = 0  # tenants with a label of their own (without known tenants)
        self._lock = threading.Lock()
        labels = ["model_name", "tenant"]
        self.requests = Counter("kvserve:tenant_requests", "Sequences queued, by tenant "
                                "(a request with P prompts and n samples queues P x n).",
                                labels, registry=registry)
        self.rejected = Counter("kvserve:tenant_requests_rejected", "Sequences the waiting "
                                "queue refused at arrival, by tenant.", labels,
                                registry=registry)
        self.ended_in_queue = Counter(
            "kvserve:tenant_requests_ended_in_queue", "Sequences the waiting queue ended "
            "before they were scheduled (503), by tenant and reason: queue_timeout (their "
            "deadline passed) or displaced (a more urgent arrival took their place).",
            [*labels, "reason"], registry=registry)
        self.prompt_tokens = Counter("kvserve:tenant_prompt_tokens", "Prompt tokens of "
                                     "requests whose first token was sent, by tenant.",
                                     labels, registry=registry)
        self.generation_tokens = Counter("kvserve:tenant_generation_tokens",
                                         "Generated tokens, by tenant.", labels,
                                         registry=registry)
        registry.register(_QueuedCollector(engine, self))
        for tenant in sorted(self.known or ()):  # known tenants' series exist from boot, at 0
            for counter in (self.requests, self.rejected, self.prompt_tokens,
                            self.generation_tokens):
                counter.labels(model_name, tenant)
            for reason in QUEUE_ENDS:
                self.ended_in_queue.labels(model_name, tenant, reason)

    def label(self, tenant: str) -> str:
        """The ``tenant`` label value of ``tenant``: its name or ``other``."""
        label = self._labels.get(tenant)
        if label is not None:
            return label
        with self._lock:
            label = self._labels.get(tenant)
            if label is not None:  # another thread gave it out meanwhile
                return label
            if self.known is not None:
                label = tenant if tenant in self.known else OTHER
            elif len(tenant) <= MAX_LABEL_CHARS and tenant != OTHER \
                    and self._num_named < self.max_series:
                label = _printable(tenant)
                self._num_named += 1
            else:
                label = OTHER
            if label != OTHER or (len(tenant) <= MAX_LABEL_CHARS
                                  and len(self._labels) < 4 * self.max_series):
                self._labels[tenant] = label  # remembered, within a bound (QA: 2 MB names)
            return label

    def labels_seen(self) -> list[str]:
        """Every label value given out so far, and the known tenants', sorted."""
        seen = set(self._labels.values())
        if self.known is not None:
            seen |= self.known
        return sorted(seen)

    def counters(self, tenant: str) -> TenantCounters:
        """``tenant``'s token counters, for a request of it that is being queued."""
        label = self.label(tenant)
        return TenantCounters(
            self.prompt_tokens.labels(self.model_name, label),
            self.generation_tokens.labels(self.model_name, label),
            {reason: self.ended_in_queue.labels(self.model_name, label, reason)
             for reason in QUEUE_ENDS})

    def queued(self, tenant: str, count: int) -> None:
        """``count`` sequences of ``tenant`` were queued."""
        self.requests.labels(self.model_name, self.label(tenant)).inc(count)

    def refused(self, tenant: str, count: int) -> None:
        """The waiting queue refused ``count`` sequences of ``tenant`` (400 or 503)."""
        self.rejected.labels(self.model_name, self.label(tenant)).inc(count)


class _QueuedCollector(Collector):
    """``kvserve:tenant_queued_requests{tenant}`` from the engine's stats snapshot: the
    requests waiting (new or preempted) per tenant, summed over replicas; 0 for every label
    given out so far, so a series does not vanish when its tenant's queue empties."""

    def __init__(self, engine: ServingEngine, series: TenantSeries) -> None:
        self.engine = engine
        self.series = series

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("kvserve:tenant_queued_requests",
                                   "Requests waiting (new or preempted), by tenant.",
                                   labels=["model_name", "tenant"])
        counts = dict.fromkeys(self.series.labels_seen(), 0)
        for tenant, count in self.engine.stats.num_waiting_by_tenant.items():
            label = self.series.label(tenant)
            counts[label] = counts.get(label, 0) + count
        for label, count in sorted(counts.items()):
            family.add_metric([self.series.model_name, label], count)
        yield family
