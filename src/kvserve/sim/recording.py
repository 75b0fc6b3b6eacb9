"""A recording directory (``kvserve serve --record DIR``, docs/recording.md) read back for
the simulator: the trace, the recorded settings, each engine's steps and events.

A recording may end badly (the server killed mid-write): a file's last line without its
newline is skipped with a warning naming it, and the replay ends where the recording does.
Requests the step log saw arrive that have no trace line (they were still in flight when
the writing stopped) are lost; the recording is cut at the first of them, or at the end of
its last logged step, whichever comes first. A request still unfinished at the cut (no
``finished`` event logged by then) is replayed as cancelled there, as it was in the recording as
far as anyone can tell; requests arriving after the cut are left out.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvserve.core.checks import is_finite, is_int
from kvserve.core.request import EventType
from kvserve.core.sessions import DELETED
from kvserve.sim.cost_models import CostModelError, ReplayCostModel
from kvserve.sim.executor import BatchView
from kvserve.sim.trace import TraceError, TraceRequest, decode_line, parse_request

MANIFEST = "recording.json"
EVENT_KINDS = frozenset(kind.value for kind in EventType)
RECORDING_FORMAT = "kvserve-recording/1"
Warn = Callable[[str], None]
T = TypeVar("T")


def is_recording(path: str | Path) -> bool:
    return Path(path).is_dir()


def _stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


@dataclass
class EngineLog:
    """One engine's steps (start, duration, tokens, shape) and scheduling events."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    # the events before the last step line (a step's events are written before its line:
    # those after it are a step's whose line was not written, or came with no step)
    events_stepped: int = 0
    # every step read, those past the replay's cut too (None: none cut): a fit's steps
    logged: list[dict[str, Any]] | None = None

    @property
    def fit_steps(self) -> list[dict[str, Any]]:
        """The steps a cost model is fitted on: every one logged (the sim-agreement pass: a
        trace cut short at its first burst left one step of 150 to fit, and whatif and
        plan refused the recording)."""
        return self.steps if self.logged is None else self.logged

    @property
    def end(self) -> float:
        return max((s["start"] + s["duration"] for s in self.steps), default=0.0)


@dataclass
class Recording:
    path: Path
    manifest: dict[str, Any]
    trace: list[TraceRequest]
    engines: dict[int, EngineLog]
    warnings: list[str]
    cut: float | None = None  # where the replay ends (None: every request ended in the log)
    inexact: str | None = None  # why the recorded step times cannot replay exactly
    _fitted: Any = field(default=None, repr=False, compare=False)  # fitted once, then kept

    @property
    def model(self) -> str:
        """The model's name as the server recorded it: its own where it was served under an
        alias (``model_id``), else the served one ('' if none)."""
        return str(self.manifest.get("model_id") or self.manifest.get("model") or "")

    def model_preset(self) -> str | None:
        """The simulator's preset for the recorded model, by name (``SmolLM2-135M-Instruct``
        -> ``smollm2-135m``: the preset's name, its size included, begins the model's), or
        None when no preset names it."""
        from kvserve.sim.presets import model_preset_for

        return model_preset_for(self.model)

    @property
    def settings(self) -> dict[str, Any]:
        """The recorded scheduler and cache settings, as simulate's flags give them."""
        return _settings(self.manifest["settings"])

    def replay_cost_model(self, engine: int = 0) -> ReplayCostModel:
        """The recorded step times of ``engine``, each step held to its logged start (none
        for a replica that ran no step while others did)."""
        steps = self.engines.get(engine, EngineLog()).steps
        if not any(log.steps for log in self.engines.values()):
            raise CostModelError(f"{self.path}: no engine logged a step to replay")
        if self.inexact and engine == 0:
            _stderr(f"{self.path}: {self.inexact}; the replay may diverge")
        return ReplayCostModel([s["duration"] for s in steps],
                               [s["num_scheduled_tokens"] for s in steps],
                               f"{self.path} (engine {engine})",
                               [s["start"] for s in steps])

    def step_shapes(self) -> tuple[list[Any], list[float]]:
        """Every engine's logged steps that have a shape and a duration: their batch shapes
        and seconds (calibration.shaped_steps)."""
        from kvserve.sim.calibration import shaped_steps

        return shaped_steps([s for log in self.engines.values() for s in log.fit_steps],
                            str(self.path))

    def fitted_cost_model(self) -> Any:
        """A calibrated cost model fitted on the recorded steps (shape -> duration), the way
        ``kvserve calibrate --trace`` and ``--step-logs`` fit steps run in service: relative
        to the price, with the prefill-step term (docs/fidelity.md: a fit relative to the
        measured time leans low on noisy steps)."""
        from kvserve.sim.calibration import fit, goodness, poor_fit_note

        if self._fitted is not None:  # a cluster's replicas, a sweep's runs: one fit
            return self._fitted
        try:
            views, seconds = self.step_shapes()
            self._fitted = fit(views, seconds, source=f"the recorded steps of {self.path}",
                               kind_term=True, relative_to="priced")
            note = poor_fit_note(goodness(self._fitted, views, seconds)["mean_abs_error"])
            if note:
                _stderr(f"{self.path}: {note}")
            return self._fitted
        except ValueError as error:
            raise CostModelError(f"{self.path}: cannot fit a cost model on the recorded "
                                 f"steps ({error}); give --cost-model roofline with the "
                                 "--hardware it ran on (cpu-local: this machine; the "
                                 "default is h100-sxm), or a --calibration") from None


def check_pool_setting(names: Any) -> None:
    """A recording's pool is its number of KV blocks: ``kv_cache_memory`` among ``names``
    (settings given for a replay) is refused, since the recording does not hold its model's
    bytes per block to convert it (ValueError naming ``num_kv_blocks`` instead)."""
    if "kv_cache_memory" in names:
        raise ValueError("a recording's KV pool is set in blocks (its model's bytes per block "
                         "are not recorded): give num_kv_blocks (--num-kv-blocks) instead "
                         "of kv_cache_memory")


def pool_at_block_size(recorded: dict[str, Any], change: dict[str, Any]) -> dict[str, int]:
    """``num_kv_blocks`` where ``change`` sets a block size on a recording and no pool: the
    recorded pool's memory (its tokens) in blocks of that size; else nothing. The pool is
    its count of blocks, so the size alone changed its tokens: block_size=32 doubled the
    pool and read as a 38% lower TTFT p99 (the sim-agreement pass)."""
    size = change.get("block_size")
    if not is_int(size) or size < 1 or size == recorded.get("block_size", 16) or \
            "num_kv_blocks" in change or "kv_cache_memory" in change or \
            not recorded.get("num_kv_blocks"):
        return {}
    tokens = recorded["num_kv_blocks"] * recorded.get("block_size", 16)
    return {"num_kv_blocks": max(1, tokens // size)}


def replay_or_fitted(run: Callable[[Any], T], deployment: Any, warn: Warn = _stderr) -> T:
    """``run(deployment)``; where that replays the step times of a recording that cannot
    replay exactly (:attr:`Recording.inexact`) and the replay diverges, a warning, then
    ``run`` again under a cost model fitted on the recorded steps (docs/recording.md)."""
    try:
        return run(deployment)
    except CostModelError as error:
        recording = deployment.recording
        if deployment.cost_model != "replay" or deployment.replay_log is not None or \
                recording is None or not recording.inexact:
            raise
        warn(f"{recording.path}: {error}; simulating under a cost model fitted on the "
             "recorded steps instead")
        return run(dataclasses.replace(deployment, cost_model="calibrated"))


def load_recording(path: str | Path, warn: Warn = _stderr) -> Recording:
    """Read a recording directory; raises TraceError naming the file and line."""
    root = Path(path)
    manifest = _manifest(root)
    warnings: list[str] = []

    def note(message: str) -> None:
        warnings.append(message)
        warn(message)

    rows = [(where, row) for file in _series(root, "trace")
            for where, row in _lines(file, note)]
    trace = []
    for where, row in rows:
        try:
            trace.append(parse_request(row))
        except ValueError as error:
            raise TraceError(f"{where}: {error}") from None
    engines: dict[int, EngineLog] = {}
    for file in sorted(root.glob("steps-*-*.jsonl")):
        engine = file.name.split("-")[1]
        if not engine.isdigit():
            raise TraceError(f"{file}: not a step log's name (steps-ENGINE-N.jsonl)")
        log = engines.setdefault(int(engine), EngineLog())
        for where, row in _lines(file, note):
            _add_step_row(log, where, row)
    for log in engines.values():
        log.steps.sort(key=lambda s: s["start"])
    trace = _reused_ids_apart(trace, engines, note, manifest.get("replica_deaths") or ())
    trace = _session_ends(trace, engines)
    steps = [step for log in engines.values() for step in log.steps]
    if steps and not any(step["duration"] > 0 for step in steps):  # QA: "the simulation
        # scheduled more" (whatif), "got 0 and 0" (plan)
        raise TraceError(f"{root}: every logged step has duration 0: no step times to "
                         "replay or fit")
    recording = Recording(root, manifest, trace, engines, warnings)
    _cut(recording, note)
    if not recording.trace:
        raise TraceError(f"{root}: the recording has no whole request")
    return recording


def recorded_model(path: str | Path) -> str:
    """The model a recording's server served (as :attr:`Recording.model`), from its manifest
    alone ('' if it names none); TraceError where it is no recording."""
    manifest = _manifest(Path(path))
    return str(manifest.get("model_id") or manifest.get("model") or "")


def _manifest(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise TraceError(f"{root} is not a recording directory")
    try:
        manifest = decode_line((root / MANIFEST).read_text(encoding="utf-8"))
    except OSError as error:
        raise TraceError(f"{root}: cannot read {MANIFEST}: {error.strerror} (is it a "
                         "recording, written by kvserve serve --record?)") from None
    except ValueError as error:
        raise TraceError(f"{root / MANIFEST}: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != RECORDING_FORMAT:
        raise TraceError(f"{root / MANIFEST}: format must be {RECORDING_FORMAT!r}")
    if not isinstance(manifest.get("settings"), dict):
        raise TraceError(f"{root / MANIFEST}: no settings")
    _check_rows(root / MANIFEST, manifest, "segments", times=("start",), optional=("stop",))
    _check_rows(root / MANIFEST, manifest, "replica_deaths", times=("time",),
                ints=("engine",))
    _check_settings(root / MANIFEST, manifest["settings"])
    return manifest


def _settings(recorded: dict[str, Any]) -> dict[str, Any]:
    """The manifest's settings as simulate's flags give them (tenant weights as pairs)."""
    settings = dict(recorded)
    settings["tenant_weights"] = tuple(tuple(p) for p in settings.get("tenant_weights", ()))
    return settings


def _check_settings(where: Path, settings: dict[str, Any]) -> None:
    """The recorded settings make a scheduler and a cache (QA: a bad one was refused later
    naming no file, and ``num_kv_blocks`` as ``num_blocks``)."""
    from kvserve.core import ConfigError
    from kvserve.flags import cache_config, scheduler_config

    blocks = settings.get("num_kv_blocks", 1)
    if not is_int(blocks) or blocks < 1:
        raise TraceError(f"{where}: settings: num_kv_blocks must be an integer >= 1, got "
                         f"{blocks!r}")
    try:
        scheduler_config(_settings(settings))
        cache_config(settings, blocks)
    except (ConfigError, TypeError, ValueError) as error:
        raise TraceError(f"{where}: settings: {error}") from None


def _check_rows(where: Path, manifest: dict[str, Any], key: str, *, times: tuple[str, ...],
                optional: tuple[str, ...] = (), ints: tuple[str, ...] = ()) -> None:
    """``key``: absent, or a list of objects whose ``times`` are numbers of seconds, its
    ``optional`` ones numbers or null, its ``ints`` integers (QA: an AttributeError's
    traceback, "Unknown format code 'f'")."""
    rows = manifest.get(key)
    if rows is None:
        return
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise TraceError(f"{where}: {key} must be a list of objects")
    for row in rows:
        bad = [name for name in times if not is_finite(row.get(name))]
        bad += [name for name in optional if row.get(name) is not None
                and not is_finite(row[name])]
        bad += [name for name in ints if not is_int(row.get(name))]
        if bad:
            raise TraceError(f"{where}: {key}: {', '.join(bad)} must be a number in {row}")


def _series(root: Path, stem: str) -> list[Path]:
    return sorted(root.glob(f"{stem}-*.jsonl"))


def _lines(file: Path, note: Warn) -> list[tuple[str, Any]]:
    """(file:line, decoded row) for each line; a last line cut short is skipped with a
    warning, any other bad line is an error."""
    try:
        text = file.read_text(encoding="utf-8-sig", errors="replace")  # a BOM: no line
    except OSError as error:
        raise TraceError(f"cannot read {file}: {error.strerror or error}") from None
    lines = text.split("\n")
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{file}:{number}"
        try:
            out.append((where, decode_line(line)))
        except ValueError as error:
            if number == len(lines):  # no newline after it: the writer stopped mid-line
                note(f"{where}: the last line is cut short (the server stopped while "
                     "writing it); replaying up to the line before")
                break
            raise TraceError(f"{where}: {error}") from None
    return out


def _reused_ids_apart(trace: list[TraceRequest], engines: dict[int, EngineLog],
                      note: Warn, deaths: Sequence[Any] = ()) -> list[TraceRequest]:
    """Tell apart requests that came one after another with one id (the server takes a
    client's id again once its request has left it: a retrying gateway, a benchmark's fixed
    ids; QA: the recording could not be replayed): the k-th to arrive becomes ``<id>#k``
    from the second on, in the trace (by arrival) and in the step logs (:func:`_occurrences`
    says which request of its id each event is). An id the step logs saw arrive more often
    than the trace has it (a recording cut short) counts too."""
    counts: dict[str, int] = {}
    for request in trace:
        counts[request.request_id] = counts.get(request.request_id, 0) + 1
    arrived: dict[str, int] = {}
    for log in engines.values():
        for event in log.events:
            if event["kind"] == "arrived":
                arrived[event["request_id"]] = arrived.get(event["request_id"], 0) + 1
    candidates = {request_id for request_id, count in (*counts.items(), *arrived.items())
                  if count > 1}
    if not candidates:  # the common case: no sort of every event
        return trace
    events = sorted(((event["time"], engine, event) for engine, log in engines.items()
                     for event in log.events if event["request_id"] in candidates),
                    key=lambda item: item[0])
    which, seen = _occurrences(events, candidates, deaths)
    reused = {request_id for request_id in candidates
              if max(counts.get(request_id, 0), seen.get(request_id, 0)) > 1}
    if not reused:
        return trace
    taken = set(counts)
    names: dict[tuple[str, int], str] = {}

    def name(request_id: str, k: int) -> str:
        key = (request_id, k)
        if key not in names:
            candidate = f"{request_id}#{k}"
            while candidate in taken:
                candidate += "#"
            taken.add(candidate)
            names[key] = candidate
        return names[key]

    renamed, nth = list(trace), dict.fromkeys(reused, 0)
    for index in sorted(range(len(trace)), key=lambda i: trace[i].arrival_time):
        request_id = trace[index].request_id
        if request_id in reused:
            nth[request_id] += 1
            if nth[request_id] > 1:
                renamed[index] = dataclasses.replace(trace[index],
                                                     request_id=name(request_id, nth[request_id]))
    for event, k in which:
        if event["request_id"] in reused and k > 1:
            event["request_id"] = name(event["request_id"], k)
    for request_id in sorted(reused):
        times = max(counts.get(request_id, 0), seen.get(request_id, 0))
        note(f"request id {request_id!r} was taken by {times} requests one after another; "
             f"replayed as {request_id!r}, {name(request_id, 2)!r}"
             + (", ..." if times > 2 else ""))
    return renamed


def _session_ends(trace: list[TraceRequest],
                  engines: dict[int, EngineLog]) -> list[TraceRequest]:
    """Each session its client ended (``DELETE /v1/sessions/{id}``: a ``released`` event
    of reason ``deleted``) ended in the trace too, on the turn it released, at the event's
    time (the record -> replay pass: the replay held the session's KV on where the server
    had released it). The first end of a turn counts; a turn from before the recording
    began is in no trace."""
    ends: dict[str, float] = {}
    for log in engines.values():
        for event in log.events:
            if event["kind"] == "released" and event.get("reason") == DELETED:
                request_id = event["request_id"]
                ends[request_id] = min(event["time"], ends.get(request_id, event["time"]))
    if not ends:
        return trace
    return [dataclasses.replace(request, session_end_time=ends[request.request_id])
            if request.request_id in ends and request.session_id is not None else request
            for request in trace]


@dataclass
class _Occurrence:
    engine: int
    arrived: float
    finished: bool = False
    holding: bool = False  # its session's KV held after it (a ``held`` event)


def _occurrences(events: Sequence[tuple[float, int, dict[str, Any]]], ids: set[str],
                 deaths: Sequence[Any]) -> tuple[list[tuple[dict[str, Any], int]],
                                                 dict[str, int]]:
    """Which request of its id (1, 2, ...) each event of ``ids`` is, in time order across
    the engines' logs, and how many requests each id had. An ``arrived`` starts the id's
    next request, unless one of its requests is unfinished on a replica that died since it
    arrived: then it is that request placed again. A ``finished`` ends the earliest
    unfinished request of its engine (two of an id may overlap: a client that left
    mid-stream and came back at once, the second on another replica; the review), ``held``
    follows the latest finished, ``released`` the one that holds (else the latest live or
    finished), any other the latest arrived on its engine."""
    died = [(d.get("engine"), d.get("time", 0.0)) for d in deaths if isinstance(d, dict)]
    which: list[tuple[dict[str, Any], int]] = []
    runs: dict[str, list[_Occurrence]] = {}
    for time, engine, event in events:
        request_id, kind = event["request_id"], event["kind"]
        if request_id not in ids:
            continue
        runs_of = runs.setdefault(request_id, [])
        live = [k for k, run in enumerate(runs_of) if not run.finished]
        if kind == "arrived":
            again = [k for k in live if any(e == runs_of[k].engine and
                                            runs_of[k].arrived <= t <= time for e, t in died)]
            if again:
                k = again[0]
                runs_of[k].engine = engine
            else:
                runs_of.append(_Occurrence(engine, time))
                k = len(runs_of) - 1
        elif kind == "finished":
            ending = [k for k in live if runs_of[k].engine == engine] or live
            if ending:
                k = ending[0]
                runs_of[k].finished = True
            else:  # one that arrived before the recording began
                k = max(len(runs_of) - 1, 0)
        elif kind == "held":
            done = [k for k, run in enumerate(runs_of) if run.finished]
            k = (done or [0])[-1]
            if runs_of:
                runs_of[k].holding = True
        elif kind == "released":  # the one that holds the session (the review: the latest
            # finished, an ordinary request of the id again, took a DELETE's release)
            holding = [k for k, run in enumerate(runs_of) if run.holding]
            done = [k for k, run in enumerate(runs_of) if run.finished]
            k = (holding or live or done or [0])[-1]
            if runs_of:
                runs_of[k].holding = False
        else:
            mine = [k for k, run in enumerate(runs_of) if run.engine == engine]
            k = (mine or [max(len(runs_of) - 1, 0)])[-1]
        which.append((event, k + 1))
    return which, {request_id: len(runs_of) for request_id, runs_of in runs.items()}


def _add_step_row(log: EngineLog, where: str, row: Any) -> None:
    if not isinstance(row, dict) or row.get("type") not in ("step", "event"):
        raise TraceError(f"{where}: a step log line is a step or an event")
    if row["type"] == "event":  # QA: one without a request_id was a KeyError's traceback
        request_id, kind = row.get("request_id"), row.get("kind")
        if not isinstance(request_id, str) or not request_id or kind not in EVENT_KINDS \
                or not is_finite(row.get("time")):
            raise TraceError(f"{where}: an event needs a request_id, a kind (one of "
                             f"{', '.join(sorted(EVENT_KINDS))}) and a time in seconds")
        log.events.append(row)
        return
    start, duration, tokens = (row.get(k) for k in ("start", "duration",
                                                    "num_scheduled_tokens"))
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               for v in (start, duration)) or duration < 0 \
            or not isinstance(tokens, int) or tokens < 1:
        raise TraceError(f"{where}: a step needs start, duration >= 0 and "
                         "num_scheduled_tokens >= 1")
    shape = row.get("shape")
    if shape is not None and set(shape) != {f.name for f in dataclasses.fields(BatchView)}:
        raise TraceError(f"{where}: shape must have the fields of a BatchView")
    log.steps.append(row)
    log.events_stepped = len(log.events)


def _cut(recording: Recording, note: Warn) -> None:
    """End the replay where the recording ends (module docstring)."""
    known = {r.request_id for r in recording.trace}
    events = [e for log in recording.engines.values() for e in log.events]
    finished_events = [e for e in events if e["kind"] == "finished"]
    ran = {e["request_id"] for e in events if e["kind"] == "admitted"}
    unrun = {e["request_id"] for e in finished_events} - ran
    segments = recording.manifest.get("segments") or []
    # An arrival with no trace line was in flight when the writing stopped (or its line was
    # cut short), unless it ended without ever running (a group of n the queue refused part
    # of, undone at once: recordings before 6 December log it) or it came between segments
    # (in flight when one began)
    lost = sorted((e["time"], e["request_id"]) for e in events
                  if e["kind"] == "arrived" and e["request_id"] not in known
                  and e["request_id"] not in unrun and _within(segments, e["time"]))
    ends = [log.end for log in recording.engines.values() if log.steps]
    cut = max(ends) if ends else None
    if lost:
        # how many whole requests that leaves out (the sim-agreement pass: a line cut in the
        # first burst left 1 of 8 whole ones, unsaid)
        after = sum(r.arrival_time >= lost[0][0] for r in recording.trace)
        left_out = f" ({after} request(s) with whole lines arrived later and are left out)" \
            if after else ""
        note(f"{recording.path}: {len(lost)} request(s) arrived with no trace line (in flight "
             f"when the writing stopped), the first {lost[0][1]!r} at {lost[0][0]:.3f} s; "
             f"replaying up to then{left_out}")
        if cut is None or lost[0][0] < cut:
            cut = lost[0][0]
            finished_events = [e for e in finished_events if e.get("time", cut) <= cut]
    stops = {s["stop"] for s in segments if s.get("stop") is not None}
    cut_short = sorted((r.cancel_time, r.request_id) for r in recording.trace
                       if r.cancel_time is not None and round(r.cancel_time, 6) in stops)
    if cut_short:  # the record -> replay pass: read as clients' aborts, with no word
        note(f"{recording.path}: {len(cut_short)} request(s) were in flight when the "
             f"recording stopped, the first {cut_short[0][1]!r} at {cut_short[0][0]:.3f} s: "
             "their ends are not recorded, so the replay aborts them then")
    reasons = []
    if any(s.get("in_flight_at_start") for s in segments):
        reasons.append("a segment began with requests in flight, whose steps are in the log "
                       "but not their requests")
    if any(s.get("prefix_cache_warm_at_start") for s in segments):
        reasons.append("a segment began with blocks in the server's prefix cache from "
                       "requests it did not record, which the replay starts without")
    for death in recording.manifest.get("replica_deaths") or []:
        reasons.append(f"replica {death.get('engine')} died at {death.get('time', 0):.3f} s "
                       "(its KV and queue were lost; it was started again)")
    if recording.manifest.get("record_prompts") == "none":  # QA: exact, then "diverged"
        reasons.append("the prompts were recorded as lengths only (--record-prompts none), "
                       "so the replay shares none of the server's prefix hits")
    if recording.manifest.get("requests_placed_again"):
        reasons.append(f"{recording.manifest['requests_placed_again']} request(s) were placed "
                       "again on another replica after theirs died")
    if reasons:
        recording.inexact = "; ".join(reasons)
    if cut is None:
        return
    # At the log's end every logged finish counts: a finish is stamped by the engine's clock
    # a little after the step's own end, which the cut is. But not a finish of a request that
    # ran, logged after its log's last step line: the step that finished it has no line (the
    # writing stopped between its events and its line; the sim-agreement pass: the replay
    # then needed a step more than the log held, and refused the recording).
    unstepped = {e["request_id"] for log in recording.engines.values()
                 for e in log.events[log.events_stepped:] if e["kind"] == "finished"} & ran
    if unstepped:
        note(f"{recording.path}: {len(unstepped)} request(s) finished in a step whose line is "
             f"not in the log (the writing stopped before it); replayed as cancelled at "
             f"{cut:.3f} s, the end of the last logged step")
    finished = {e["request_id"] for e in finished_events} - unstepped
    trace = []
    for request in recording.trace:
        if request.arrival_time >= cut:
            continue
        if request.request_id not in finished and (request.cancel_time is None
                                                   or request.cancel_time > cut):
            request = dataclasses.replace(request, cancel_time=cut)
        trace.append(request)
    recording.trace = trace
    recording.cut = cut
    for log in recording.engines.values():
        log.logged, log.steps = log.steps, [s for s in log.steps if s["start"] < cut]


def _within(segments: list[dict[str, Any]], time: float) -> bool:
    """Whether ``time`` falls in a recorded segment (no segments: the whole log)."""
    return not segments or any(
        s["start"] <= time and (s.get("stop") is None or time <= s["stop"]) for s in segments)
