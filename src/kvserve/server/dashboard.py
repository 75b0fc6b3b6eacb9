"""``GET /dashboard``: the scheduler live, in a browser (docs/recording.md, "Dashboard").

The page (``dashboard_page.PAGE``: inline SVG and JavaScript, nothing fetched but this
server) opens ``GET /dashboard/events``, a server-sent event stream that sends, every
``interval`` seconds, the steps since the last message (running, waiting, KV usage,
preemptions, prefix hit rate) and the timelines of the most recent requests (queued, prefill,
decode, preempted), the charts of the simulator's HTML report.

Nothing is collected while nobody watches: the view registers its step observer when the
first stream opens and removes it when the last one closes, so the engine pays nothing then.
With keys configured, both need an admin key, sent as a header or as ``?key=`` (a browser
cannot set headers on a page load or an EventSource; kvserve's access log masks it, a
proxy's may not, so serve the dashboard on a trusted network).
"""

from __future__ import annotations

import asyncio
import html
import json
import threading
import time
import urllib.parse
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from kvserve.engine.core_loop import StepReport
from kvserve.server.disconnect import ClosingStreamingResponse
from kvserve.server.errors import APIError
from kvserve.server.state import ServerState

MAX_POINTS = 600  # steps kept for the charts
MAX_REQUESTS = 40  # requests on the timeline


class LiveView:
    """Step samples and recent request timelines, collected only while someone watches."""

    def __init__(self, engine: Any, max_points: int = MAX_POINTS,
                 max_requests: int = MAX_REQUESTS) -> None:
        self.engine = engine
        self.origin = time.monotonic()
        self.watchers = 0
        self.max_requests = max_requests
        self._lock = threading.Lock()
        self._samples: deque[tuple[int, list[float]]] = deque(maxlen=max_points)
        self._requests: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._stats: dict[int, Any] = {}  # the latest stats of each engine (data parallel)
        self._seq = 0

    def watch(self) -> None:
        """A watcher came; the first one starts the collecting, with a sample of each
        engine's figures as they stand (the pass: an idle server's page read 0 preemptions
        and a 0% hit rate until a step ran)."""
        with self._lock:
            self.watchers += 1
            if self.watchers == 1:  # times count from when the watching began, as the
                self.origin = time.monotonic()  # page says (they counted from boot: QA)
                self.engine.observers.append(self.observe)
                deaths = getattr(self.engine, "death_observers", None)  # data parallel
                if deaths is not None:
                    deaths.append(self.replica_died)
                for figures in self.engine.engine_figures():
                    self._stats[figures.index] = figures.stats
                if self._stats:
                    self._seq += 1
                    self._samples.append((self._seq, self._sample(0.0)))

    def leave(self) -> None:
        with self._lock:
            self.watchers -= 1
            if self.watchers == 0:
                if self.observe in self.engine.observers:
                    self.engine.observers.remove(self.observe)
                deaths = getattr(self.engine, "death_observers", None)
                if deaths is not None and self.replica_died in deaths:
                    deaths.remove(self.replica_died)
                self._samples.clear()
                self._requests.clear()
                self._stats.clear()

    def replica_died(self, engine: int, when: float, request_ids: Any = ()) -> None:
        """A replica died: nothing of it is in flight any more, as /metrics reads it, until
        it reports again; its requests end on the timeline then (QA: they stayed "running"),
        and one placed again on another replica starts anew there as it arrives."""
        with self._lock:
            if engine in self._stats:
                self._stats[engine] = self._stats[engine].at_rest()
            at = round(when - self.origin, 4)
            for request_id in request_ids:
                entry = self._requests.get(request_id)
                if entry is not None and entry["finished"] is None:
                    entry["finished"] = at

    def observe(self, report: StepReport) -> None:
        """A step observer (on the engine's thread). A report of aborts runs no tokens and
        has no events: its finished chunks end their requests (the pass: an aborted
        request ran on, on the timeline and in the figures)."""
        now = round(report.time + report.seconds - self.origin, 4)
        with self._lock:
            self._stats[report.engine] = report.stats
            if report.num_scheduled_tokens or report.chunks:
                self._seq += 1
                # Replicas report on their own threads, a little out of order: the series
                # stays in time order (a sample is never dated before the one before it)
                last = self._samples[-1][1][0] if self._samples else now
                self._samples.append((self._seq, self._sample(max(now, last))))
            for event in report.events:
                self._event(event)
            for chunk in report.chunks:
                entry = self._requests.get(chunk.request_id)
                if entry is None:
                    continue
                if chunk.new_token_ids and entry["first_token"] is None:
                    entry["first_token"] = now
                if chunk.finished and entry["finished"] is None:
                    entry["finished"] = now

    def _sample(self, now: float) -> list[float]:
        stats = list(self._stats.values())
        blocks = sum(s.num_blocks for s in stats)
        used = sum(s.num_blocks - s.num_free_blocks for s in stats)
        queries = sum(s.prefix_cache_queries for s in stats)
        hits = sum(s.prefix_cache_hits for s in stats)
        return [now, sum(s.num_running for s in stats),
                sum(s.num_waiting + s.num_swapped for s in stats),
                round(used / blocks, 4) if blocks else 0.0,
                sum(s.num_preemptions for s in stats),
                round(hits / queries, 4) if queries else 0.0]

    def _event(self, event: Any) -> None:
        kind, at = str(getattr(event.kind, "value", event.kind)), round(
            event.time - self.origin, 4)
        requests = self._requests
        if kind == "arrived":
            requests[event.request_id] = {"id": event.request_id, "arrival": at,
                                          "scheduled": None, "first_token": None,
                                          "finished": None, "preempted": []}
            while len(requests) > self.max_requests:
                requests.popitem(last=False)
            return
        entry = requests.get(event.request_id)
        if entry is None:
            return
        if kind == "admitted" and entry["scheduled"] is None:
            entry["scheduled"] = at
        elif kind == "preempted":
            entry["preempted"].append([at, None])
        elif kind == "resumed" and entry["preempted"]:
            entry["preempted"][-1][1] = at
        elif kind == "finished":
            entry["finished"] = at

    def snapshot(self, after: int) -> tuple[int, dict[str, Any]]:
        """The samples after sequence number ``after``, and every recent request."""
        with self._lock:
            samples = [s for seq, s in self._samples if seq > after]
            requests = [dict(r, preempted=[list(p) for p in r["preempted"]])
                        for r in self._requests.values()]
            return self._seq, {"now": round(time.monotonic() - self.origin, 4),
                               "samples": samples, "requests": requests}


def _authorize(state: ServerState, request: Request) -> None:
    if not state.keys.enabled:
        return
    headers = request.headers.getlist("authorization")
    # ?key= as pasted: a "+" is the key's own (a base64 key's), not a space as a form's
    # query reads it (the dashboard pass: such a key was "invalid"); two keys are refused
    keys = [urllib.parse.unquote(value) for name, _, value in
            (part.partition("=") for part in request.url.query.split("&")) if name == "key"]
    if len(keys) > 1:
        raise APIError(401, "give one key (?key= is given more than once)")
    key = keys[0] if keys else None
    if not headers and key:
        headers = [f"Bearer {key}"]
    if not state.keys.authenticate(headers).admin:
        raise APIError(403, "the dashboard needs an admin key")


# The page runs its own inline script and style and loads nothing else; the admin key in
# its URL goes to no other site, and nothing frames, caches or sniffs it.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                               "style-src 'unsafe-inline'; connect-src 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}


def register(app: FastAPI, state: ServerState, interval: float = 0.5) -> LiveView:
    from kvserve.server.dashboard_page import PAGE

    view = LiveView(state.engine)

    @app.api_route("/dashboard", methods=["GET", "HEAD"])  # HEAD: curl -I (it read 405)
    async def dashboard(request: Request) -> Response:
        _authorize(state, request)
        # the name as HTML text, never in the script (QA: a --served-model-name holding
        # </script> ran as script on a page whose URL carries the admin key)
        return HTMLResponse(PAGE.replace("__MODEL__", html.escape(state.model_name)),
                            headers=PAGE_HEADERS)

    @app.get("/dashboard/events")
    async def dashboard_events(request: Request) -> Response:
        _authorize(state, request)
        view.watch()  # until the response ends, however it ends (the client left)
        return ClosingStreamingResponse(_stream(view, interval, request, state), view.leave,
                                        media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache"})

    return view


async def _stream(view: LiveView, interval: float, request: Request,
                  state: ServerState) -> AsyncIterator[str]:
    """A snapshot every ``interval`` seconds until the client goes (checked before each one:
    a write to a closed connection need not fail) or the server's shutdown begins (the pass:
    an open dashboard held the exit for as long as it stayed open, a second SIGTERM too)."""
    seen = 0
    while not state.shutting_down and not await request.is_disconnected():
        seen, snapshot = view.snapshot(seen)
        yield f"data: {json.dumps(snapshot, separators=(',', ':'))}\n\n"
        await asyncio.sleep(interval)
