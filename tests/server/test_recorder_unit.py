"""The recorder on hand-made step reports (docs/recording.md): lines written, durations,
cancel times, data-parallel step logs, a cut at stop. No engine, no server."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvserve.core import CacheConfig, RequestMetrics, SamplingParams, Scheduler, SchedulerConfig
from kvserve.engine.core_loop import ABORTED, StepReport
from kvserve.engine.engine import CompletionChunk, EngineInfo
from kvserve.server.recorder import Recorder, RecordingError
from kvserve.sim.executor import BatchView
from kvserve.sim.recording import load_recording

CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
INFO = EngineInfo(None, 256, "fcfs", 16, 32, True, CONFIG)
BUSY = Scheduler(CONFIG, CacheConfig(num_blocks=32)).stats()
BUSY = dataclasses.replace(BUSY, num_running=1)
IDLE = dataclasses.replace(BUSY, num_running=0)
SHAPE = BatchView(1, 20, 1, 0, 0, 210)


def metrics(n: int) -> RequestMetrics:
    return RequestMetrics(0.0, 0.0, 0.0, 0.0, 20, n, 0, 0, 0, 0.0)


def report(recorder, at, tokens, *, engine=0, chunks=(), arrivals=(), stats=BUSY,
           seconds=0.1):
    return StepReport(recorder.origin + at, tokens, seconds, list(chunks), [], stats,
                      engine=engine, shape=SHAPE if tokens else None,
                      arrivals=tuple((rid, recorder.origin + t) for rid, t in arrivals))


def lines(directory, pattern):
    return [json.loads(line) for path in sorted(directory.glob(pattern))
            for line in path.read_text().splitlines()]


def test_reports_become_trace_lines_and_step_logs_per_engine(tmp_path):
    recorder = Recorder(tmp_path / "rec", INFO, prompts="ids", num_engines=2,
                        model_name="my-chat", model_id="SmolLM2-135M-Instruct")
    recorder.start()
    params = SamplingParams(max_tokens=8, priority=0, tenant="t")
    recorder.submitted([("a", list(range(20)), params), ("b", list(range(20)), params),
                        ("c", list(range(20)), params)])
    recorder.observe(report(recorder, 1.0, 20, arrivals=[("a", 0.9)]))
    recorder.observe(report(recorder, 1.5, 20, engine=1, arrivals=[("b", 1.4), ("c", 1.45)]))
    recorder.observe(report(recorder, 2.0, 1, chunks=[
        CompletionChunk("a", [2], "", True, "stop", None, metrics(3))], stats=IDLE))
    recorder.observe(report(recorder, 2.2, 0, engine=1, seconds=0.0, chunks=[
        CompletionChunk("b", [], "", True, "abort", ABORTED)]))
    recorder.flush()
    assert recorder.status()["requests"] == 2
    recorder.close()  # c is still running: written as cut at the stop
    trace = {row["request_id"]: row for row in lines(tmp_path / "rec", "trace-*.jsonl")}
    assert trace["a"] == {"request_id": "a", "arrival_time": 0.9,
                          "prompt_token_ids": list(range(20)), "output_len": 2,
                          "max_tokens": 8, "tenant": "t",
                          "replica": 0}  # stopped after 3: 2 + EOS
    assert (trace["b"]["replica"], trace["c"]["replica"]) == (1, 1)  # placed on replica 1
    assert trace["b"]["cancel_time"] == 2.2 and trace["b"]["output_len"] == 8
    assert trace["c"]["output_len"] == 8 and trace["c"]["cancel_time"] >= 1.45
    steps0 = [r for r in lines(tmp_path / "rec", "steps-0-*.jsonl") if r["type"] == "step"]
    # step 1 ran to step 2's start; step 2 left the engine idle: its own 0.1 s
    assert [(s["start"], s["duration"]) for s in steps0] == [(1.0, 1.0), (2.0, 0.1)]
    assert steps0[0]["shape"] == dataclasses.asdict(SHAPE)
    steps1 = [r for r in lines(tmp_path / "rec", "steps-1-*.jsonl") if r["type"] == "step"]
    assert [(s["start"], s["duration"]) for s in steps1] == [(1.5, 0.1)]  # closed at stop
    manifest = json.loads((tmp_path / "rec" / "recording.json").read_text())
    assert manifest["settings"]["data_parallel_size"] == 2
    assert "router" not in manifest["settings"]  # no router given: none recorded
    assert (manifest["model"], manifest["model_id"]) == ("my-chat", "SmolLM2-135M-Instruct")
    assert manifest["segments"][0]["stop"] is not None
    recording = load_recording(tmp_path / "rec", warn=pytest.fail)
    assert set(recording.engines) == {0, 1}


def test_nothing_is_queued_while_stopped(tmp_path):
    recorder = Recorder(tmp_path / "rec", INFO)
    recorder.submitted([("a", [1] * 20, SamplingParams(max_tokens=4))])
    recorder.observe(report(recorder, 1.0, 20, arrivals=[("a", 0.5)]))
    assert recorder._queue.empty() and not recorder._pending
    recorder.close()
    assert lines(tmp_path / "rec", "trace-*.jsonl") == []


def test_hashes_are_keyed_per_recording(tmp_path):
    params = SamplingParams(max_tokens=4)
    salted = {"c": SamplingParams(max_tokens=4, cache_salt=""),
              "d": SamplingParams(max_tokens=4, cache_salt="x")}
    written = []
    for name in ("one", "two"):
        recorder = Recorder(tmp_path / name, INFO)
        recorder.start()
        recorder.submitted([("a", list(range(40)), params), ("b", list(range(40)), params),
                            *[(rid, list(range(40)), p) for rid, p in salted.items()]])
        done = [CompletionChunk(rid, [1], "", True, "length", None, metrics(4))
                for rid in "abcd"]
        recorder.observe(report(recorder, 1.0, 40, arrivals=[(rid, 0.1) for rid in "abcd"],
                                chunks=done, stats=IDLE))
        recorder.close()
        written.append({r["request_id"]: r["prompt_hashes"]
                        for r in lines(tmp_path / name, "trace-*.jsonl")})
    assert written[0]["a"] == written[0]["b"] and len(written[0]["a"]) == 2
    assert written[0]["a"] != written[1]["a"]  # a guessed prompt cannot be checked
    # the server shares no block between no salt and an empty one; nor does the recording
    # (both were hashed alike, and a replay hit what the server never shared; QA)
    assert len({tuple(written[0][rid]) for rid in "acd"}) == 3


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"prompts": "text"}, "--record-prompts must be one of"),
    ({"max_file_bytes": 10}, "at least 1KiB"),
])
def test_bad_options_are_named(tmp_path, kwargs, needle):
    with pytest.raises(RecordingError, match=needle):
        Recorder(tmp_path / "rec", INFO, **kwargs)


def test_a_directory_holding_a_recording_is_refused(tmp_path):
    Recorder(tmp_path / "rec", INFO).close()
    with pytest.raises(RecordingError, match="already holds a recording"):
        Recorder(tmp_path / "rec", INFO)


@pytest.mark.parametrize(("argv", "needle"), [
    (["status", "--url", "http://127.0.0.1:1"], "cannot reach http://127.0.0.1:1"),
    (["stop", "--url", "ftp://x"], "is not an http(s) URL"),
    (["stop", "--dir", "d"], "--dir is for start only"),
    (["status", "--timeout", "-1"], "--timeout must be a positive number of seconds, got -1"),
    (["status", "--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
])
def test_the_record_command_fails_in_one_line(capsys, argv, needle):
    from kvserve.cli import main

    assert main(["record", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_the_record_command_says_when_the_answer_is_not_kvserve_s(capsys):
    """The dashboard pass: a 200 that was not JSON (a proxy's login page) ended in a
    traceback, and a proxy's HTML 502 page was printed whole as the one-line error."""
    import http.server
    import threading

    from kvserve.cli import main

    class Proxy(http.server.BaseHTTPRequestHandler):
        def answer(self, status: int) -> None:
            page = b"<!DOCTYPE html>\n<html>\n<body>bad gateway</body>\n</html>\n"
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def do_GET(self) -> None:
            self.answer(200)

        def do_POST(self) -> None:
            self.answer(502)

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["record", "status", "--url", url]) == 2
        assert capsys.readouterr().err == (
            f"kvserve record: error: {url}/admin/record answered, but not with kvserve's "
            "recording status: is --url a kvserve server?\n")
        assert main(["record", "stop", "--url", url]) == 2
        assert capsys.readouterr().err == (
            f"kvserve record: error: {url}: HTTP 502: <!DOCTYPE html> ...\n")
    finally:
        server.shutdown()


def test_a_replica_death_marks_the_recording_and_ends_the_requests_it_failed(tmp_path):
    """Replica 1 dies at 2.0 s holding a and b: a starts again on replica 0 (placed again),
    b failed with its replica (its client got a 503), so b's line ends at the death, not at
    the recording's stop; the manifest names the death and the re-placement, and the replay
    says why it cannot follow the logs step for step."""
    recorder = Recorder(tmp_path / "rec", INFO, prompts="none", num_engines=2)
    recorder.start()
    params = SamplingParams(max_tokens=8)
    recorder.submitted([("a", list(range(20)), params), ("b", list(range(20)), params),
                        ("c", list(range(20)), params)])
    recorder.observe(report(recorder, 1.0, 40, engine=1, arrivals=[("a", 0.9), ("b", 0.9)]))
    # c was sent to replica 1 but not taken yet: the replica's held ids name it
    recorder.replica_died(1, recorder.origin + 2.0, ["a", "b", "c"])
    recorder.observe(report(recorder, 2.5, 20, engine=0, arrivals=[("a", 2.4), ("c", 2.4)]))
    recorder.observe(report(recorder, 3.0, 1, engine=0, chunks=[
        CompletionChunk("a", [2], "", True, "stop", None, metrics(3))], stats=IDLE))
    recorder.flush()
    recorder.close()
    manifest = json.loads((tmp_path / "rec" / "recording.json").read_text())
    assert manifest["replica_deaths"] == [{"engine": 1, "time": 2.0}]
    assert manifest["requests_placed_again"] == 2  # a and c
    trace = {row["request_id"]: row for row in lines(tmp_path / "rec", "trace-*.jsonl")}
    assert (trace["a"]["replica"], trace["a"]["arrival_time"]) == (0, 2.4)
    assert trace["b"]["cancel_time"] == 2.0 and trace["b"]["replica"] == 1
    steps1 = [r for r in lines(tmp_path / "rec", "steps-1-*.jsonl") if r["type"] == "step"]
    assert [(s["start"], s["duration"]) for s in steps1] == [(1.0, 0.1)]  # closed at death
    inexact = load_recording(tmp_path / "rec", warn=lambda _: None).inexact
    assert "replica 1 died at 2.000 s" in inexact
    assert "2 request(s) were placed again" in inexact


def test_a_request_that_failed_with_its_replica_is_written_then_and_ends_at_its_death(
        tmp_path):
    """The chaos pass: a failed request waited for the segment's stop to be written (a
    recording cut before it replayed only up to the first such failure), and each later
    death of the same replica index moved its end there."""
    recorder = Recorder(tmp_path / "rec", INFO, prompts="none", num_engines=2)
    recorder.start()
    recorder.submitted([("b", list(range(20)), SamplingParams(max_tokens=8))])
    recorder.observe(report(recorder, 1.0, 20, engine=1, arrivals=[("b", 0.9)]))
    recorder.replica_died(1, recorder.origin + 2.0, ["b"])
    recorder.failed(["b"])  # its client got the 503
    recorder.replica_died(1, recorder.origin + 5.0, [])  # the index dies again, idle
    recorder.flush()
    [row] = lines(tmp_path / "rec", "trace-*.jsonl")  # before the stop
    assert (row["request_id"], row["cancel_time"]) == ("b", 2.0)
    recorder.close()
    assert len(lines(tmp_path / "rec", "trace-*.jsonl")) == 1


def test_a_failed_request_keeps_its_first_death_until_the_stop_writes_it(tmp_path):
    """The chaos pass: without the failure told (an older server), the stop writes it, at
    the first death of its replica, not the last."""
    recorder = Recorder(tmp_path / "rec", INFO, prompts="none", num_engines=2)
    recorder.start()
    recorder.submitted([("b", list(range(20)), SamplingParams(max_tokens=8))])
    recorder.observe(report(recorder, 1.0, 20, engine=1, arrivals=[("b", 0.9)]))
    recorder.replica_died(1, recorder.origin + 2.0, ["b"])
    recorder.replica_died(1, recorder.origin + 5.0, [])
    recorder.close()
    [row] = lines(tmp_path / "rec", "trace-*.jsonl")
    assert row["cancel_time"] == 2.0


def test_a_request_asking_prompt_logprobs_is_recorded_so(tmp_path):  # G8
    recorder = Recorder(tmp_path / "rec", INFO, prompts="ids")
    recorder.start()
    recorder.submitted([("a", list(range(20)), SamplingParams(max_tokens=4,
                                                              prompt_logprobs=2))])
    recorder.observe(report(recorder, 1.0, 20, arrivals=[("a", 0.5)], stats=IDLE, chunks=[
        CompletionChunk("a", [1], "", True, "length", None, metrics(4))]))
    recorder.close()
    [row] = lines(tmp_path / "rec", "trace-*.jsonl")
    assert row["prompt_logprobs"] == 2
    assert load_recording(tmp_path / "rec", warn=pytest.fail).trace[0].prompt_logprobs == 2


def test_a_group_the_queue_refused_part_of_leaves_no_event_behind():
    """QA: the undone first of an n=2 request (its second found the queue full) left its
    arrival and abort in the event log, in no trace: a recording's replay read it as a
    request still in flight at the end and stopped there (19 of 24 requests, all aborted)."""
    from kvserve.core import QueueFullError
    from kvserve.engine.core_loop import EngineCore

    from .helpers import make_engine

    core = EngineCore(make_engine(max_num_queued_reqs=1, max_num_seqs=1,
                                  max_num_batched_tokens=64))
    params = SamplingParams(max_tokens=4)
    assert core.add([("x", [5] * 4, params, None)]) is None
    error = core.add([("g-0", [5] * 4, params, None), ("g-1", [5] * 4, params, None)])
    assert isinstance(error, QueueFullError)
    events = core.engine.scheduler.take_events()
    assert [(e.kind, e.request_id) for e in events] == [("arrived", "x")]


def test_a_session_released_on_an_idle_engine_is_reported_at_once():  # U8
    """The record -> replay pass: a DELETE on an idle engine reached no report (no step
    followed), so a recording never logged the release."""
    from kvserve.engine.core_loop import EngineCore

    from .helpers import make_engine

    core = EngineCore(make_engine(max_session_kv=0.5))
    params = SamplingParams(max_tokens=2, ignore_eos=True, session_id="s")
    assert core.add([("t1", [5] * 20, params, None)]) is None
    while core.busy:
        core.step()
    core.engine.scheduler.take_events()
    error, report = core.release_session("s", None)
    assert error is None and report is not None
    assert [(e.kind, e.request_id, e.reason) for e in report.events] == \
        [("released", "t1", "deleted")]
    assert report.stats.num_sessions_held == 0
    error, report = core.release_session("s", None)
    assert error is not None and report is None  # none live: nothing to report


def test_a_segment_begun_mid_step_logs_nothing_from_before_it(tmp_path):
    """QA: ``kvserve record start`` on a busy server logged the step under way and the
    in-flight requests' arrivals at negative times; the replay read those as requests lost
    at the end, and refused the recording ("no whole request")."""
    from kvserve.core.outputs import SchedulerEvent

    recorder = Recorder(tmp_path / "rec", INFO, prompts="ids")
    recorder.origin -= 10.0  # the server has run 10 s; the segment begins now
    recorder.start(in_flight=1)
    recorder.flush()
    begun = json.loads((tmp_path / "rec" / "recording.json").read_text())["segments"][0]
    params = SamplingParams(max_tokens=2)
    recorder.submitted([("new", list(range(20)), params)])
    before = begun["start"] - 0.5  # the step under way, and the old request's arrival
    recorder.observe(StepReport(recorder.origin + before, 20, 0.6, [], [
        SchedulerEvent(recorder.origin + before - 1.0, "arrived", "old", 20)], BUSY,
        shape=SHAPE))
    after = begun["start"] + 0.2
    recorder.observe(StepReport(recorder.origin + after, 20, 0.1, [
        CompletionChunk("new", [1, 2], "", True, "length", None, metrics(2))], [
        SchedulerEvent(recorder.origin + after, "arrived", "new", 20),
        SchedulerEvent(recorder.origin + after, "admitted", "new", 20)], IDLE, shape=SHAPE,
        arrivals=(("new", recorder.origin + after),)))
    recorder.close()
    rows = lines(tmp_path / "rec", "steps-0-*.jsonl")
    assert [r["start"] for r in rows if r["type"] == "step"] == [round(after, 6)]
    assert {r["request_id"] for r in rows if r["type"] == "event"} == {"new"}
    warnings: list[str] = []
    recording = load_recording(tmp_path / "rec", warn=warnings.append)
    assert [r.request_id for r in recording.trace] == ["new"] and not warnings
    assert "in flight" in (recording.inexact or "")


@pytest.mark.parametrize("prompts", ["ids", "hashes"])
def test_a_cache_salt_is_recorded_as_a_digest_with_ids(tmp_path, prompts):  # G3
    """The record -> replay pass: ids recorded without their cache_salt replayed as shared
    prefixes the server kept apart. With ids, a digest of the salt (this recording's own,
    never the salt itself) goes on the line; hashes hold it already."""
    recorder = Recorder(tmp_path / "rec", INFO, prompts=prompts)
    recorder.start()
    recorder.submitted([(name, list(range(20)), SamplingParams(max_tokens=2, cache_salt=salt))
                        for name, salt in (("a", "secret"), ("b", "secret"), ("c", "other"),
                                           ("d", None))])
    at = recorder.origin + recorder.now()
    recorder.observe(StepReport(at, 80, 0.001, [
        CompletionChunk(name, [1, 2], "", True, "length", None, metrics(2)) for name in "abcd"],
        [], IDLE, shape=SHAPE, arrivals=tuple((name, at) for name in "abcd")))
    recorder.close()
    salts = {row["request_id"]: row.get("cache_salt")
             for row in lines(tmp_path / "rec", "trace-*.jsonl")}
    if prompts == "hashes":
        assert set(salts.values()) == {None}
        return
    assert salts["a"] == salts["b"] != salts["c"] and salts["d"] is None
    assert "secret" not in salts["a"] and len(salts["a"]) == 16


def test_requests_in_flight_when_a_recording_stops_are_named_cut(tmp_path, capsys):
    """The record -> replay pass: a request the recording's stop cut (written with a
    cancel_time then, its end unknown) replayed as a client's abort with no word, and
    ``plan`` then blamed the KV pool ("no candidate served any ... give a larger pool")."""
    from kvserve.cli import main
    from kvserve.core.outputs import SchedulerEvent

    recorder = Recorder(tmp_path / "rec", INFO, prompts="ids")
    recorder.start()
    recorder.submitted([("long", list(range(20)),
                         SamplingParams(max_tokens=60, max_queue_delay=3.0))])
    at = recorder.origin + recorder.now()  # the step ran before the stop
    recorder.observe(StepReport(at, 20, 0.001, [CompletionChunk("long", [1], "", False)], [
        SchedulerEvent(at, "arrived", "long", 20), SchedulerEvent(at, "admitted", "long", 20)],
        BUSY, shape=SHAPE, arrivals=(("long", at),)))
    recorder.close()  # stops with "long" in flight
    [row] = lines(tmp_path / "rec", "trace-*.jsonl")
    assert "cancel_time" in row
    assert row["max_queue_delay"] == 3.0  # its own queue deadline, for a changed run
    assert "cache_salt" not in row  # none given
    warnings: list[str] = []
    recording = load_recording(tmp_path / "rec", warn=warnings.append)
    assert any("1 request(s) were in flight when the recording stopped" in w
               for w in warnings), warnings
    assert main(["plan", "--trace", str(tmp_path / "rec"), "--candidates", "4",
                 "--cost-model", "roofline", "--hardware", "cpu-local"]) == 2
    err = capsys.readouterr().err
    assert "every one was cancelled, or cut by the recording's stop, before it finished" \
        in err and "larger KV pool" not in err
    assert [r.request_id for r in recording.trace] == ["long"]


def test_events_of_a_report_with_no_step_are_logged_and_a_turns_own_ttl_recorded(tmp_path):
    """QA: a session released while the engine was idle (a report with no tokens) was in no
    log; a turn's own session ttl was not recorded, so its replay held it the server's
    default."""
    from kvserve.core.outputs import SchedulerEvent

    recorder = Recorder(tmp_path / "rec", INFO, prompts="ids")
    recorder.start()
    params = SamplingParams(max_tokens=2, session_id="s", session_ttl=5.0)
    recorder.submitted([("t1", list(range(20)), params)])
    recorder.observe(report(recorder, 1.0, 20, arrivals=[("t1", 0.9)], chunks=[
        CompletionChunk("t1", [1, 2], "", True, "length", None, metrics(2))], stats=IDLE))
    recorder.observe(StepReport(recorder.origin + 7.0, 0, 0.0, [], [
        SchedulerEvent(recorder.origin + 6.1, "released", "t1", 21, "ttl")], IDLE))
    recorder.close()
    events = [r for r in lines(tmp_path / "rec", "steps-0-*.jsonl") if r["type"] == "event"]
    assert [(e["kind"], e["time"], e["reason"]) for e in events] == [("released", 6.1, "ttl")]
    [row] = lines(tmp_path / "rec", "trace-*.jsonl")
    assert (row["session_id"], row["session_ttl"]) == ("s", 5.0)


def one_request_recording(directory, prompts: str = "ids") -> None:
    recorder = Recorder(directory, INFO, prompts=prompts)
    recorder.start()
    recorder.submitted([("a", list(range(20)), SamplingParams(max_tokens=2))])
    recorder.observe(report(recorder, 1.0, 20, arrivals=[("a", 0.9)], chunks=[
        CompletionChunk("a", [1, 2], "", True, "length", None, metrics(2))], stats=IDLE))
    recorder.close()


def test_prompts_recorded_as_lengths_replay_as_inexact(tmp_path):
    """QA: docs say such a replay shares no prefix, yet it was taken as exact, and any prefix
    hit the server had made it fail ("replay diverged")."""
    one_request_recording(tmp_path / "rec", prompts="none")
    recording = load_recording(tmp_path / "rec", warn=pytest.fail)
    assert "lengths only (--record-prompts none)" in (recording.inexact or "")


def test_an_old_recordings_undone_group_member_is_not_taken_for_a_lost_request(tmp_path):
    """Recordings made before the engine took such events back hold them: an arrival with
    no trace line that ended without ever running is no request lost at the end."""
    one_request_recording(tmp_path / "rec")
    log = sorted((tmp_path / "rec").glob("steps-0-*.jsonl"))[0]
    ghost = [{"type": "event", "time": 0.95, "kind": kind, "request_id": "g-0",
              "num_tokens": 20, "reason": reason} for kind, reason in
             (("arrived", ""), ("finished", "abort"))]
    log.write_text("".join(json.dumps(row) + "\n" for row in ghost) + log.read_text())
    recording = load_recording(tmp_path / "rec", warn=pytest.fail)
    assert [r.request_id for r in recording.trace] == ["a"] and recording.cut is not None


@pytest.mark.parametrize(("damage", "message"), [
    ("event", "an event needs a request_id, a kind"),
    ("segments", "segments must be a list of objects"),
    ("deaths", "replica_deaths: time must be a number"),
    ("deep", "not valid JSON: nested too deep"),
    ("digits", "not valid JSON: Exceeds the limit"),
    ("name", "not a step log's name"),
    ("setting", r"recording\.json: settings: max_num_seqs must be an integer"),
    ("blocks", r"recording\.json: settings: num_kv_blocks must be an integer >= 1, got -5"),
])
def test_a_damaged_recording_is_one_error_naming_the_file(tmp_path, damage, message):
    """QA: a KeyError, an AttributeError or a RecursionError's traceback, "Unknown format
    code 'f'", or a message naming no file."""
    from kvserve.sim.trace import TraceError

    directory = tmp_path / "rec"
    one_request_recording(directory)
    manifest_path = directory / "recording.json"
    manifest = json.loads(manifest_path.read_text())
    log = sorted(directory.glob("steps-0-*.jsonl"))[0]
    trace = sorted(directory.glob("trace-*.jsonl"))[0]
    if damage == "event":
        log.write_text(log.read_text() + json.dumps({"type": "event", "kind": "arrived",
                                                     "time": 1.0}) + "\n")
    elif damage == "segments":
        manifest_path.write_text(json.dumps({**manifest, "segments": "oops"}))
    elif damage == "deaths":
        manifest_path.write_text(json.dumps({**manifest, "replica_deaths": [
            {"engine": 0, "time": "x"}]}))
    elif damage == "deep":
        trace.write_text("[" * 100_000 + "]" * 100_000 + "\n" + trace.read_text())
    elif damage == "digits":
        trace.write_text('{"request_id": "b", "arrival_time": 1' + "0" * 5000 + "}\n"
                         + trace.read_text())
    elif damage == "setting":
        manifest_path.write_text(json.dumps({**manifest, "settings": {
            **manifest["settings"], "max_num_seqs": "abc"}}))
    elif damage == "blocks":
        manifest_path.write_text(json.dumps({**manifest, "settings": {
            **manifest["settings"], "num_kv_blocks": -5}}))
    else:
        log.rename(directory / "steps-x-00000.jsonl")
    with pytest.raises(TraceError, match=message) as caught:
        load_recording(directory, warn=lambda text: None)
    assert str(directory) in str(caught.value) and "\n" not in str(caught.value)


def test_a_failure_in_the_writer_stops_the_recording_and_says_why(tmp_path, monkeypatch):
    """Only a write error (OSError) stopped the recording: any other exception killed the
    writer thread while the status said it recorded, and every step report after it piled
    up in the writer's queue for the life of the server (QA)."""
    recorder = Recorder(tmp_path / "rec", INFO, prompts="ids")
    recorder.start()

    def broken(report: object) -> None:
        raise RuntimeError("dictionary changed size during iteration")

    monkeypatch.setattr(recorder, "_record", broken)
    recorder.submitted([("a", [1, 2], SamplingParams(max_tokens=2))])
    recorder.observe(report(recorder, 1.0, 0, stats=IDLE))
    recorder.flush()
    status = recorder.status()
    assert status["recording"] is False and not recorder._pending  # none kept for ever
    assert "internal error: RuntimeError: dictionary changed size" in status["error"]
    recorder.observe(report(recorder, 2.0, 0, stats=IDLE))  # queued no more
    assert recorder._queue.qsize() == 0 and recorder._writer.is_alive()
    recorder.close()


def test_an_id_sent_again_before_the_first_request_was_written_keeps_both(tmp_path):
    """The review: a client left mid-stream and came back at once with the same
    X-Request-Id; the server freed the id before the engine ended the first request, so the
    second arrived while the first still ran, and the recorder, which held one entry an id,
    wrote neither (an unreplayable recording)."""
    from kvserve.core import EventType
    from kvserve.core.outputs import SchedulerEvent

    def event(at, kind, rid):
        return SchedulerEvent(recorder.origin + at, kind, rid, 0, "")

    recorder = Recorder(tmp_path / "rec", INFO, prompts="ids")
    recorder.start()
    params = SamplingParams(max_tokens=8)
    recorder.submitted([("same", list(range(20)), params)])
    recorder.observe(StepReport(recorder.origin + 1.0, 20, 0.1, [], [
        event(1.0, EventType.ARRIVED, "same"), event(1.0, EventType.ADMITTED, "same")],
        BUSY, arrivals=(("same", recorder.origin + 1.0),), shape=SHAPE))
    recorder.submitted([("same", list(range(30)), params)])  # the client came back
    recorder.observe(StepReport(recorder.origin + 1.2, 0, 0.0, [], [
        event(1.2, EventType.ARRIVED, "same")], BUSY,
        arrivals=(("same", recorder.origin + 1.2),)))
    recorder.observe(StepReport(recorder.origin + 1.4, 30, 0.1, [
        CompletionChunk("same", [], "", True, "abort", ABORTED)], [
        event(1.4, EventType.FINISHED, "same"), event(1.4, EventType.ADMITTED, "same")],
        BUSY, shape=SHAPE))
    recorder.observe(StepReport(recorder.origin + 1.6, 1, 0.1, [
        CompletionChunk("same", [2], "", True, "stop", None, metrics(3))], [
        event(1.6, EventType.FINISHED, "same")], IDLE, shape=SHAPE))
    recorder.close()
    warnings: list[str] = []
    recording = load_recording(tmp_path / "rec", warn=warnings.append)
    assert {r.request_id: len(r.prompt_token_ids) for r in recording.trace} == \
        {"same": 20, "same#2": 30}
    assert [(e["kind"], e["request_id"]) for e in recording.engines[0].events] == [
        ("arrived", "same"), ("admitted", "same"), ("arrived", "same#2"),
        ("finished", "same"), ("admitted", "same#2"), ("finished", "same#2")]
    assert warnings == ["request id 'same' was taken by 2 requests one after another; "
                        "replayed as 'same', 'same#2'"]


def test_a_cut_recording_names_the_later_requests_of_an_id_lost(tmp_path):
    """The review: where the trace kept one line of an id the step logs saw arrive three
    times (the writing stopped), the later two kept the known id and were dropped silently."""
    recorder = Recorder(tmp_path / "rec", INFO, prompts="ids")
    recorder.start()
    params = SamplingParams(max_tokens=8)
    for at in (1.0, 2.0, 3.0):
        recorder.submitted([("same", list(range(20)), params)])
        recorder.observe(report(recorder, at, 20, arrivals=[("same", at)]))
        recorder.observe(report(recorder, at + 0.5, 1, chunks=[
            CompletionChunk("same", [2], "", True, "stop", None, metrics(3))], stats=IDLE))
    recorder.close()
    trace_files = sorted((tmp_path / "rec").glob("trace-*.jsonl"))
    rows = trace_files[0].read_text().splitlines()
    assert len(rows) == 3
    trace_files[0].write_text(rows[0] + "\n")  # the writing stopped after the first
    events = tmp_path / "rec" / "steps-0-00000.jsonl"
    arrivals = [json.dumps({"type": "event", "time": at, "kind": "arrived", "request_id":
                            "same", "num_tokens": 20, "reason": ""}) for at in (1.0, 2.0, 3.0)]
    events.write_text(events.read_text() + "\n".join(arrivals) + "\n")
    warnings: list[str] = []
    recording = _load_with_segment_to(tmp_path / "rec", 10.0, warnings.append)
    assert [r.request_id for r in recording.trace] == ["same"]
    assert any("arrived with no trace line" in w for w in warnings), warnings


def _event(recorder, at, kind, rid):
    from kvserve.core.outputs import SchedulerEvent

    return SchedulerEvent(recorder.origin + at, kind, rid, 0, "")


def _load_with_segment_to(directory, stop, warn):
    """load_recording with the last segment stopped at ``stop`` (hand-made report times lie
    past the real clock's stop: this puts them within their segment)."""
    manifest = directory / "recording.json"
    data = json.loads(manifest.read_text())
    data["segments"][-1]["stop"] = stop
    manifest.write_text(json.dumps(data))
    return load_recording(directory, warn=warn)


def _arrive(recorder, at, rid, engine=0, tokens=20):
    """A step at ``at`` on ``engine`` that took ``rid``, its ``arrived`` event logged."""
    from kvserve.core import EventType

    recorder.observe(StepReport(recorder.origin + at, tokens, 0.1, [], [
        _event(recorder, at, EventType.ARRIVED, rid)], BUSY, engine=engine,
        arrivals=((rid, recorder.origin + at),), shape=SHAPE))


def test_a_reused_id_on_two_replicas_finishes_the_request_of_its_engine(tmp_path):
    """The second review: the retry of a client that left ran on the other replica and
    finished first; its finish went to the first request (the earliest of the id), so the
    abandoned stream was recorded complete and the answered retry cancelled."""
    from kvserve.core import EventType

    recorder = Recorder(tmp_path / "rec", INFO, prompts="ids", num_engines=2)
    recorder.start()
    params = SamplingParams(max_tokens=8)
    recorder.submitted([("same", list(range(20)), params)])
    _arrive(recorder, 1.0, "same", engine=0)
    recorder.submitted([("same", list(range(30)), params)])  # the client came back
    _arrive(recorder, 1.2, "same", engine=1, tokens=30)
    recorder.observe(StepReport(recorder.origin + 1.4, 1, 0.1, [
        CompletionChunk("same", [2], "", True, "stop", None, metrics(3))], [
        _event(recorder, 1.4, EventType.FINISHED, "same")], IDLE, engine=1, shape=SHAPE))
    recorder.observe(StepReport(recorder.origin + 1.6, 0, 0.0, [
        CompletionChunk("same", [], "", True, "abort", ABORTED)], [
        _event(recorder, 1.6, EventType.FINISHED, "same")], IDLE, engine=0))
    recorder.close()
    rows = {len(row["prompt_token_ids"]): row for row in lines(tmp_path / "rec",
                                                               "trace-*.jsonl")}
    assert rows[20]["cancel_time"] == 1.6 and "cancel_time" not in rows[30]
    recording = load_recording(tmp_path / "rec", warn=lambda message: None)
    assert [(e["kind"], e["request_id"]) for e in recording.engines[1].events] == [
        ("arrived", "same#2"), ("finished", "same#2")]
    assert [(e["kind"], e["request_id"]) for e in recording.engines[0].events] == [
        ("arrived", "same"), ("finished", "same")]


def test_the_finish_of_a_request_from_before_the_recording_leaves_its_ids_retry(tmp_path):
    """The second review: a recording begun while a request ran saw its finish after the
    client's retry with the same id was submitted, and the finish took the retry's entry:
    no trace line at all."""
    recorder = Recorder(tmp_path / "rec", INFO, prompts="ids")
    recorder.start(in_flight=1)
    params = SamplingParams(max_tokens=8)
    recorder.submitted([("same", list(range(30)), params)])
    recorder.observe(report(recorder, 1.0, 0, seconds=0.0, chunks=[
        CompletionChunk("same", [], "", True, "abort", ABORTED)]))  # the first, unseen
    recorder.observe(report(recorder, 1.2, 30, arrivals=[("same", 1.1)]))
    recorder.observe(report(recorder, 1.4, 1, chunks=[
        CompletionChunk("same", [2], "", True, "stop", None, metrics(3))], stats=IDLE))
    recorder.close()
    [row] = lines(tmp_path / "rec", "trace-*.jsonl")
    assert (row["request_id"], len(row["prompt_token_ids"])) == ("same", 30)


def test_a_request_placed_again_after_its_replica_died_is_one_request_of_its_id(tmp_path):
    """The second review: with an id reused, the arrival of a request placed again on
    another replica after a death was read as the id's next request, and the replay was
    cut at the real next one."""
    from kvserve.core import EventType

    recorder = Recorder(tmp_path / "rec", INFO, prompts="ids", num_engines=2)
    recorder.start()
    params = SamplingParams(max_tokens=8)
    recorder.submitted([("X", list(range(20)), params)])
    _arrive(recorder, 1.0, "X", engine=0)
    recorder.replica_died(0, recorder.origin + 1.5, ["X"])
    for at, engine_events in ((2.0, "first"), (3.0, "second")):
        if engine_events == "second":
            recorder.submitted([("X", list(range(30)), params)])
        _arrive(recorder, at, "X", engine=1)
        recorder.observe(StepReport(recorder.origin + at + 0.5, 1, 0.1, [
            CompletionChunk("X", [2], "", True, "stop", None, metrics(3))], [
            _event(recorder, at + 0.5, EventType.FINISHED, "X")], IDLE, engine=1,
            shape=SHAPE))
    recorder.close()
    warnings: list[str] = []
    recording = _load_with_segment_to(tmp_path / "rec", 10.0, warnings.append)
    assert sorted(r.request_id for r in recording.trace) == ["X", "X#2"]
    assert [(e["kind"], e["request_id"]) for e in recording.engines[1].events] == [
        ("arrived", "X"), ("finished", "X"), ("arrived", "X#2"), ("finished", "X#2")]
    assert not any("no trace line" in w for w in warnings), warnings
