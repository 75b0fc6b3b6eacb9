"""``kvserve serve --record DIR``: what the server saw, written as it serves, in the
simulator's trace format plus each engine's step log (docs/recording.md).

The recorder sits where arrivals are seen: the server hands it each request's prompt and
sampling parameters before queueing (:meth:`Recorder.submitted`), and it observes every
:class:`~kvserve.engine.core_loop.StepReport` of every engine (thread, engine process or
data-parallel replica). A report carries the requests its engine took since the last one,
with the time it took them: that is a recorded request's ``arrival_time``, the moment its
scheduler first saw it, so a replay hands it over between the same two steps.

The observer only queues the report; a writer thread turns reports into lines, so the engine
pays one queue put per step. Files, rotated past ``max_file_bytes``::

    DIR/recording.json            the manifest: format, settings, prompt mode, segments
    DIR/trace-00000.jsonl         one line per finished request (kvserve.sim.trace format)
    DIR/steps-0-00000.jsonl       engine 0's steps and scheduling events

Times are seconds since the recording began (one monotonic clock for the server and its
engine processes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from kvserve.core import SamplingParams
from kvserve.core.prefix_cache import prompt_block_hashes
from kvserve.engine.core_loop import ABORTED, StepReport
from kvserve.engine.engine import EngineInfo

logger = logging.getLogger("kvserve.server")
RECORDING_FORMAT = "kvserve-recording/1"
MANIFEST = "recording.json"
PROMPT_MODES = ("none", "hashes", "ids")
DEFAULT_MAX_FILE_BYTES = 64 << 20
HASH_HEX_DIGITS = 16  # 64 bits of each block's digest: collisions are not a concern


class RecordingError(ValueError):
    """A recording that cannot start: the message is one line naming the problem."""


def check_nul(directory: str | Path) -> None:
    """Refuse a path no file system takes (before any path function reads it)."""
    if "\0" in str(directory):
        raise RecordingError(f"recording directory {str(directory)!r} holds a NUL character")


def check_directory(directory: str | Path) -> Path:
    """``directory`` as an absolute path (a relative one is this process's working
    directory's), created if missing, if this process may write a new recording there."""
    check_nul(directory)
    path = Path(os.path.abspath(directory))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RecordingError(f"cannot create recording directory {path}: "
                             f"{error.strerror}") from None
    if not path.is_dir():
        raise RecordingError(f"recording directory {path} is not a directory")
    probe = path / f".kvserve-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise RecordingError(f"recording directory {path} is not writable: "
                             f"{error.strerror}") from None
    if (path / MANIFEST).exists():
        raise RecordingError(f"{path} already holds a recording ({MANIFEST}); give a "
                             "directory without one")
    return path


def recorded_settings(info: EngineInfo, num_engines: int = 1,
                      router: Any = None) -> dict[str, Any]:
    """The engine's scheduler and cache settings as ``kvserve simulate`` flags take them;
    with replicas, their number and ``router``'s policy (and its imbalance bound)."""
    settings = {f.name: getattr(info.scheduler_config, f.name)
                for f in dataclasses.fields(info.scheduler_config)}
    settings["tenant_weights"] = [list(pair) for pair in settings["tenant_weights"]]
    settings.update(num_kv_blocks=info.num_kv_blocks, block_size=info.block_size,
                    enable_prefix_caching=info.enable_prefix_caching,
                    num_host_blocks=info.num_host_blocks)
    if num_engines > 1:
        settings["data_parallel_size"] = num_engines
        if router is not None:
            settings["router"] = router.policy
            if hasattr(router, "imbalance_bound"):
                settings["router_imbalance_bound"] = router.imbalance_bound
    return settings


class _Rotating:
    """One JSONL series, ``STEM-00000.jsonl``, a new file past ``max_bytes``."""

    def __init__(self, directory: Path, stem: str, max_bytes: int) -> None:
        self.directory, self.stem, self.max_bytes = directory, stem, max_bytes
        self.index, self.size = 0, 0
        self.handle: TextIO | None = None

    def write(self, line: str) -> None:
        if self.handle is not None and self.size and self.size + len(line) > self.max_bytes:
            self.handle.close()
            self.handle, self.index = None, self.index + 1
        if self.handle is None:
            path = self.directory / f"{self.stem}-{self.index:05d}.jsonl"
            self.handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
            self.size = path.stat().st_size
        self.handle.write(line)
        self.size += len(line)

    def flush(self) -> None:
        if self.handle is not None:
            self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


@dataclasses.dataclass(eq=False)
class _Pending:
    prompt: Sequence[int]
    params: SamplingParams
    arrival: float | None = None  # seconds into the recording, once an engine took it
    engine: int = 0  # the replica that took it
    received: float | None = None  # seconds into the recording, when the server got it
    orphaned: float | None = None  # when its replica died under it (placed again, or failed)


@dataclasses.dataclass
class _OpenStep:
    start: float
    seconds: float
    num_scheduled_tokens: int
    shape: Any


def check_options(prompts: str, max_file_bytes: int) -> None:
    """RecordingError unless --record-prompts and --record-max-file-size can be used."""
    if prompts not in PROMPT_MODES:
        raise RecordingError(f"--record-prompts must be one of {', '.join(PROMPT_MODES)}, "
                             f"got {prompts!r}")
    if max_file_bytes < 1024:
        raise RecordingError(f"--record-max-file-size must be at least 1KiB, got "
                             f"{max_file_bytes} bytes")


class Recorder:
    """Records into ``directory`` (checked by :func:`check_directory`); :meth:`start` begins
    a segment, :meth:`stop` ends one, :meth:`close` ends the recording."""

    def __init__(self, directory: str | Path, info: EngineInfo, *, prompts: str = "hashes",
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, model_name: str = "",
                 model_id: str = "", num_engines: int = 1, router: Any = None) -> None:
        check_options(prompts, max_file_bytes)
        self.directory = check_directory(directory)
        self.prompts, self.block_size = prompts, info.block_size
        self.max_file_bytes = max_file_bytes
        self.origin = time.monotonic()
        self._salt = secrets.token_hex(16)  # hashes name prefixes of this recording only
        self.manifest: dict[str, Any] = {
            "format": RECORDING_FORMAT, "model": model_name,
            **({"model_id": model_id} if model_id and model_id != model_name else {}),
            "started_unix": round(time.time(), 3), "record_prompts": prompts,
            "settings": recorded_settings(info, num_engines, router), "segments": []}
        self.num_engines = num_engines
        self.active = False
        self.error: str | None = None  # why the writer stopped the recording, if it did
        self._cache_queries_at_stop = 0  # the engines' prefix cache lookups when the last
        # segment stopped (start: was the cache touched outside the recording since?)
        self.num_requests = self.num_steps = 0
        # writer thread only: the requests submitted and not yet written, by id, in the
        # order they were submitted (a client may send an id again while the writer still
        # holds the earlier request's entry: the review, both were lost)
        self._pending: dict[str, deque[_Pending]] = {}
        self._open_steps: dict[int, _OpenStep] = {}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._trace = _Rotating(self.directory, "trace", max_file_bytes)
        self._steps: dict[int, _Rotating] = {}
        self._lock = threading.Lock()  # start/stop against each other
        self._write_manifest()
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-recorder",
                                        daemon=True)
        self._writer.start()

    # -- the server's side (event loop) ---------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.origin

    def start(self, in_flight: int = 0, cache_queries: int = 0) -> bool:
        """Begin a segment; False if one is open. ``in_flight``: requests the engines hold
        now, which this recording will not see whole (their replay is not exact).
        ``cache_queries``: the engines' prefix cache lookups so far; more than when the last
        segment stopped (or than none, for the first) means requests outside the recording
        may have left blocks in the cache, which a replay starts without."""
        with self._lock:
            if self.error is not None:
                raise RecordingError(f"the recording into {self.directory} stopped on an "
                                     f"error ({self.error}); record into another directory")
            if self.active:
                return False
            self.active = True
            warm = cache_queries > self._cache_queries_at_stop
            self._queue.put(("start", self.now(), in_flight, warm))
            return True

    def stop(self, cache_queries: int | None = None) -> bool:
        """End the segment: requests still in flight are written as cut at this moment (a
        ``cancel_time`` now, docs/recording.md). False if none was open. ``cache_queries``:
        as :meth:`start`'s, now."""
        with self._lock:
            if not self.active:
                return False
            self.active = False
            if cache_queries is not None:
                self._cache_queries_at_stop = cache_queries
            self._queue.put(("stop", self.now()))
            return True

    def close(self, timeout: float = 10.0) -> None:
        """Stop, write everything, close the files."""
        self.stop()
        self._queue.put(None)
        self._writer.join(timeout)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until everything observed so far is written (tests, status)."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def submitted(self, items: Sequence[tuple[str, Sequence[int], SamplingParams]],
                  received: float | None = None) -> None:
        """Requests about to be queued (before the engine can report them), received by
        the server at ``received`` (its monotonic clock)."""
        if self.active:  # through the writer's queue: ordered with the engine's reports
            at = None if received is None else received - self.origin
            self._queue.put(("submitted", [(request_id, _Pending(prompt, params, received=at))
                                           for request_id, prompt, params in items]))

    def failed(self, request_ids: Sequence[str]) -> None:
        """Requests that failed with their replica (their clients got a 503): written now,
        ending at the death (the chaos pass: they waited for the segment's stop, so a
        recording cut before it lost everything after the first of them)."""
        if self.active:
            self._queue.put(("failed", list(request_ids)))

    def dropped(self, request_ids: Sequence[str]) -> None:
        """Requests the engine refused: nothing will be reported of them."""
        if self.active:
            self._queue.put(("dropped", list(request_ids)))

    def attach(self, engine: Any) -> None:
        """Hear ``engine``'s steps, and its replicas' deaths where it has replicas."""
        engine.observers.append(self.observe)
        if hasattr(engine, "death_observers"):
            engine.death_observers.append(self.replica_died)

    def detach(self, engine: Any) -> None:
        """Stop hearing ``engine`` (each observer removed if present)."""
        for observers, observer in ((engine.observers, self.observe),
                                    (getattr(engine, "death_observers", []),
                                     self.replica_died)):
            if observer in observers:
                observers.remove(observer)

    def replica_died(self, engine: int, when: float, request_ids: Sequence[str] = ()) -> None:
        """A data-parallel replica died at ``when`` (monotonic) holding ``request_ids``: they
        were placed again or failed; the manifest says so (a replay cannot follow it step for
        step)."""
        if self.active:
            self._queue.put(("died", when - self.origin, engine, tuple(request_ids)))

    def observe(self, report: StepReport) -> None:
        """A step observer: only queues the report (the engine's thread pays no more)."""
        if self.active:
            self._queue.put(report)

    def status(self) -> dict[str, Any]:
        status = {"recording": self.active, "directory": str(self.directory),
                  "record_prompts": self.prompts, "requests": self.num_requests,
                  "steps": self.num_steps}
        if self.error is not None:
            status["error"] = f"the recording stopped: {self.error}"
        return status

    # -- the writer thread ----------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            items = [item]
            with contextlib.suppress(queue.Empty):
                while item is not None:
                    item = self._queue.get_nowait()
                    items.append(item)
            for entry in items:
                if entry is None:
                    self._guarded(self._flush_files, close=True)
                    return
                if isinstance(entry, threading.Event):
                    self._guarded(self._flush_files)
                    entry.set()
                elif self.error is not None:
                    continue  # the recording stopped on an error: nothing more is kept
                elif isinstance(entry, StepReport):
                    self._guarded(self._record, entry)
                else:
                    self._guarded(self._control, entry)
            self._guarded(self._flush_files)

    def _guarded(self, write: Any, *args: Any, **kwargs: Any) -> None:
        """``write`` on the writer thread; a write error (a full disk, a file gone) stops
        the recording with one logged line and the reason in :meth:`status` (the thread died
        with a traceback, and the status said it still recorded); any other failure stops
        it too, with its traceback logged (QA: the thread died and the reports piled up in
        its queue for the life of the server)."""
        try:
            write(*args, **kwargs)
        except OSError as error:
            self._stop_on(f"{error.strerror or error} ({error.filename or self.directory})")
        except Exception as error:
            logger.exception("recording into %s failed", self.directory)
            self._stop_on(f"internal error: {type(error).__name__}: {error}")

    def _stop_on(self, error: str) -> None:
        if self.error is None:
            self.error = error
            self.active = False
            self._pending.clear()  # nothing more of them will be written
            logger.error("recording into %s stopped: %s", self.directory, self.error)

    def _control(self, entry: tuple[Any, ...]) -> None:
        segments = self.manifest["segments"]
        if entry[0] == "submitted":
            for request_id, pending in entry[1]:
                self._pending.setdefault(request_id, deque()).append(pending)
        elif entry[0] == "dropped":
            for request_id in entry[1]:
                self._take(request_id, lambda e: e.arrival is None, last=True)
        elif entry[0] == "failed":
            for request_id in entry[1]:
                pending = self._take(request_id, lambda e: e.orphaned is not None)
                if pending is not None and pending.arrival is not None:
                    self._write_request(request_id, pending, None,
                                        max(pending.orphaned or 0.0, pending.arrival))
        elif entry[0] == "start":
            segment = {"start": round(entry[1], 6), "stop": None, "in_flight_at_start": entry[2]}
            if entry[3]:
                segment["prefix_cache_warm_at_start"] = True
            segments.append(segment)
        elif entry[0] == "died":
            self._died(entry[1], entry[2], entry[3])
        else:
            stop = entry[1]
            for engine in list(self._open_steps):
                self._close_step(engine, None)
            for request_id, entries in self._pending.items():
                for pending in entries:
                    if pending.arrival is not None:  # still running, or failed with its
                        end = stop if pending.orphaned is None else pending.orphaned  # replica
                        self._write_request(request_id, pending, None,
                                            max(end, pending.arrival))
            self._pending.clear()
            if segments:
                segments[-1]["stop"] = round(stop, 6)
        self._write_manifest()

    def _died(self, when: float, engine: int, held: Sequence[str]) -> None:
        """Replica ``engine`` died: its open step ends; each request it held (taken, or
        sent and not yet taken) is orphaned until another replica takes it (placed again),
        or ends there (it failed, 503)."""
        self.manifest.setdefault("replica_deaths", []).append(
            {"engine": engine, "time": round(when, 6)})
        self._close_step(engine, None)
        held_ids = set(held)
        for request_id, entries in self._pending.items():
            for entry in entries:
                # the first death it saw (the chaos pass: a later one of the same replica
                # index moved its end there)
                if entry.orphaned is None and (request_id in held_ids or (
                        entry.arrival is not None and entry.engine == engine)):
                    entry.orphaned = when

    def _record(self, report: StepReport) -> None:
        origin = self.origin
        for request_id, taken in report.arrivals:
            # the first not taken yet, or placed again after its replica died
            entry = self._first(request_id, lambda e: e.arrival is None or
                                e.orphaned is not None)
            if entry is not None:
                if entry.orphaned is not None:  # its replica died: it started again here
                    self.manifest["requests_placed_again"] = \
                        self.manifest.get("requests_placed_again", 0) + 1
                    self._write_manifest()
                    entry.orphaned = None
                entry.arrival, entry.engine = taken - origin, report.engine
        # What came before the segment began is not its (QA: a segment begun with requests
        # in flight logged the step under way, and their arrivals, at negative times, and
        # the replay read those as requests still in flight at its end)
        begun = self.manifest["segments"][-1]["start"] if self.manifest["segments"] else 0.0
        if report.num_scheduled_tokens and report.time - origin >= begun:
            self._close_step(report.engine, report.time - origin)
            self._open_steps[report.engine] = _OpenStep(
                report.time - origin, report.seconds, report.num_scheduled_tokens,
                report.shape)
        # every report's events, a step's or not (QA: sessions released while the engine
        # was idle were in no log)
        self._log(report.engine, [json.dumps(
            {"type": "event", **dataclasses.asdict(e), "time": round(e.time - origin, 6)})
            for e in report.events if e.time - origin >= begun])
        stats = report.stats
        if not (stats.num_running or stats.num_waiting or stats.num_swapped):
            self._close_step(report.engine, None)  # idle now: the wait is not the step's
        # as the engine made them: a replay redoes its work (QA: a stop string matched in the
        # server's process recorded the answer a token short, and the replay diverged)
        chunks = report.chunks if report.engine_chunks is None else report.engine_chunks
        engine = report.engine

        def taken_here(entry: _Pending) -> bool:
            return entry.arrival is not None and entry.engine == engine

        for chunk in chunks:
            if chunk.finished:  # the earliest this engine took (another replica may run a
                # retry of the id meanwhile: the review), else the earliest any engine took;
                # never one no engine took (QA: a retry's entry went with a finish from
                # before the recording began)
                entry = self._take(chunk.request_id, taken_here) or \
                    self._take(chunk.request_id, lambda e: e.arrival is not None)
                if entry is not None:
                    # (a stop string "aborted" finishes "stop": no cancel)
                    aborted = chunk.finish_reason == "abort" and chunk.stop_reason == ABORTED
                    cancel = report.time - origin if aborted else None
                    self._write_request(chunk.request_id, entry, chunk, cancel)

    def _first(self, request_id: str, match: Callable[[_Pending], bool]) -> _Pending | None:
        """The earliest submitted entry of ``request_id`` that ``match`` takes, or None."""
        return next((e for e in self._pending.get(request_id, ()) if match(e)), None)

    def _take(self, request_id: str, match: Callable[[_Pending], bool],
              last: bool = False) -> _Pending | None:
        """Remove and return the earliest (``last``: the latest) entry of ``request_id``
        that ``match`` takes; None when none does."""
        entries = self._pending.get(request_id)
        if not entries:
            return None
        indices = range(len(entries) - 1, -1, -1) if last else range(len(entries))
        index = next((i for i in indices if match(entries[i])), None)
        if index is None:
            return None
        entry = entries[index]
        del entries[index]
        if not entries:
            del self._pending[request_id]
        return entry

    def _close_step(self, engine: int, next_start: float | None) -> None:
        """Write engine's open step: it lasted to ``next_start`` (None: its own seconds)."""
        step = self._open_steps.pop(engine, None)
        if step is None:
            return
        duration = step.seconds if next_start is None else next_start - step.start
        row: dict[str, Any] = {"type": "step", "start": round(step.start, 6),
                               "duration": round(max(duration, 0.0), 6),
                               "num_scheduled_tokens": step.num_scheduled_tokens}
        if step.shape is not None:
            row["shape"] = dataclasses.asdict(step.shape)
        self.num_steps += 1
        self._log(engine, [json.dumps(row)])

    def _log(self, engine: int, lines: list[str]) -> None:
        """Append to engine's step log. A step's line is written when its duration is known
        (at the next step), after its events: step lines are in start order, events in
        decision order."""
        if not lines:
            return
        series = self._steps.get(engine)
        if series is None:
            series = self._steps[engine] = _Rotating(self.directory, f"steps-{engine}",
                                                     self.max_file_bytes)
        for line in lines:
            series.write(line + "\n")

    def _write_request(self, request_id: str, entry: _Pending, chunk: Any,
                       cancel: float | None) -> None:
        params = entry.params
        arrival = round(entry.arrival or 0.0, 6)
        row: dict[str, Any] = {"request_id": request_id, "arrival_time": arrival}
        if entry.received is not None and round(entry.received, 6) < arrival:
            row["received_time"] = round(max(entry.received, 0.0), 6)
        prompt = entry.prompt
        if self.prompts == "ids":
            row["prompt_token_ids"] = list(prompt)
            if params.cache_salt is not None:  # the blocks it shares (the record -> replay
                # pass: dropped, the replay shared what the server kept apart); a digest
                # keyed by this recording's salt, never the salt itself (hashes fold it in)
                row["cache_salt"] = hashlib.blake2b(
                    params.cache_salt.encode("utf-8", "surrogatepass"), digest_size=8,
                    key=self._salt.encode()).hexdigest()
        else:
            row["prompt_len"] = len(prompt)
        if self.prompts == "hashes":
            # no salt and an empty salt are apart, as on the server (QA: both hashed alike,
            # so a replay hit what the server never shared)
            salt = self._salt if params.cache_salt is None else \
                f"{self._salt}/{params.cache_salt}"
            row["prompt_hashes"] = [h.hex()[:HASH_HEX_DIGITS] for h in
                                    prompt_block_hashes(list(prompt), self.block_size, salt)]
            row["hash_block_size"] = self.block_size
        row["output_len"] = _output_len(chunk, params.max_tokens)
        row["max_tokens"] = params.max_tokens
        if params.priority:
            row["priority"] = params.priority
        if cancel is not None:
            row["cancel_time"] = round(cancel, 6)
        if params.ignore_eos:
            row["ignore_eos"] = True
        if params.tenant:
            row["tenant"] = params.tenant
        if params.session_id is not None:
            row["session_id"] = params.session_id
            if params.session_ttl is not None:  # its own, not the server's (QA: replayed
                row["session_ttl"] = params.session_ttl  # at the server's default)
        if params.prompt_logprobs is not None:  # never a prefix hit (G8), in the replay too
            row["prompt_logprobs"] = params.prompt_logprobs
        if params.max_queue_delay is not None:  # its own (the record -> replay pass: its
            row["max_queue_delay"] = params.max_queue_delay  # timeouts were in no changed run)
        if self.num_engines > 1:
            row["replica"] = entry.engine
        self.num_requests += 1
        self._trace.write(json.dumps(row, separators=(",", ":")) + "\n")

    def _flush_files(self, close: bool = False) -> None:
        for series in (self._trace, *self._steps.values()):
            series.close() if close else series.flush()

    def _write_manifest(self) -> None:
        path = self.directory / MANIFEST
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(self.manifest, indent=1) + "\n", encoding="utf-8")
        temporary.replace(path)


def _output_len(chunk: Any, max_tokens: int) -> int:
    """What the simulated model should answer so the replay ends the request as the engine
    did: a stop (EOS, stop string or token) after n tokens is n - 1 tokens and then the
    simulator's EOS; a length limit, n tokens; anything else (aborted, cut, timed out in the
    queue) ran on as far as it could, ``max_tokens``."""
    if chunk is None or chunk.metrics is None or chunk.finish_reason not in ("stop",
                                                                             "length"):
        return max_tokens
    produced = chunk.metrics.num_output_tokens
    return produced if chunk.finish_reason == "length" else max(produced - 1, 0)
