"""`--data-parallel-size 2` on both backends (local processes; Ray actors on a real local Ray
instance): completions and streams are served by both replicas, /metrics labels each engine's
series engine="i" and counts the router's decisions, and a killed replica is survived: what
had streamed ends with an error, what had not is placed again on the live replica, the replica
is restarted, /health says degraded until it is back, and every live pool is whole after."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from .helpers import LiveServer, engine_spec, metric_values, tokenizer, wait_for

LONG = {"prompt": [11] * 20, "max_tokens": 900, "ignore_eos": True}
ROOT = Path(__file__).resolve().parents[2]


def data_parallel(launchers: list, policy: str = "round-robin",
                  step_timeout: float | None = None):
    from kvserve.core.router import make_router
    from kvserve.engine.data_parallel import DataParallelEngine

    spec = dataclasses.replace(engine_spec(0.01, max_num_seqs=1, max_model_len=1024),
                               step_timeout=step_timeout)
    return DataParallelEngine(spec, tokenizer(), launchers, make_router(policy, 2),
                              restart_delay=0.2)


def pools_whole(live: LiveServer) -> bool:
    stats = [figures.stats for figures in live.state.engine.engine_figures()]
    return len(stats) == 2 and all(
        s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks
        for s in stats) and not live.state.groups


def check_both_replicas_serve(live: LiveServer) -> None:
    """Round-robin: a plain completion on replica 0, a stream on replica 1 (R2)."""
    reply = httpx.post(live.url + "/v1/completions", timeout=60,
                       json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    with httpx.stream("POST", live.url + "/v1/completions", timeout=60, json={
            "prompt": "hi", "max_tokens": 3, "ignore_eos": True, "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 4
    wait_for(lambda: pools_whole(live), what="both pools whole")
    values = metric_values(httpx.get(live.url + "/metrics").text)
    for replica in ("0", "1"):
        labels = (("engine", replica), ("model_name", "tiny"))
        assert values[("kvserve:engine_steps_total", labels)] > 0
        assert values[("vllm:num_requests_running", labels)] == 0
        assert values[("kvserve:router_decisions_total", (
            ("model_name", "tiny"), ("reason", "round_robin"), ("replica", replica)))] == 1
        # each request's tokens counted on the replica that ran it (round robin: one each)
        assert values[("vllm:generation_tokens_total", labels)] == 3
        assert values[("vllm:request_success_total", (
            labels[0], ("finished_reason", "length"), labels[1]))] == 1


def check_a_killed_replica_is_survived(live: LiveServer, kill) -> None:
    """Replica 0 holds a stream that has sent tokens and a queued request that has not; it
    dies. The stream ends with a 503 error event, the queued request is served by replica 1,
    and replica 0 comes back."""
    streamed: list[str] = []
    plain: list[httpx.Response] = []

    def stream(request_id: str) -> None:
        with httpx.stream("POST", live.url + "/v1/completions", timeout=120,
                          json={**LONG, "stream": True},
                          headers={"X-Request-Id": request_id}) as response:
            lines = response.iter_lines()
            for line in lines:
                streamed.append(f"{request_id} {line}")

    def queued() -> None:
        plain.append(httpx.post(live.url + "/v1/completions", timeout=120, json={
            "prompt": [7] * 8, "max_tokens": 4, "ignore_eos": True}))
    engine = live.state.engine
    threads = [threading.Thread(target=stream, args=("a",))]  # round-robin: replica 0
    threads[0].start()
    wait_for(lambda: any(s.startswith("a data:") for s in streamed), what="a streaming")
    threads.append(threading.Thread(target=stream, args=("b",)))  # replica 1
    threads[1].start()
    wait_for(lambda: any(s.startswith("b data:") for s in streamed), what="b streaming")
    threads.append(threading.Thread(target=queued))  # replica 0, behind a
    threads[2].start()
    wait_for(lambda: engine.replicas[0].stats.num_waiting == 1, what="queued on replica 0")
    replica0 = (("engine", "0"), ("model_name", "tiny"))
    steps_before = metric_values(httpx.get(live.url + "/metrics").text)[
        ("kvserve:engine_steps_total", replica0)]
    assert steps_before > 0
    kill(engine, 0)
    threads[0].join(timeout=60)
    assert not threads[0].is_alive(), "the stream of the dead replica hung"
    events = [s[len("a data: "):] for s in streamed if s.startswith("a data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503
    assert "replica 0 failed with this request under way" in events[-2]
    # the queued request moved to replica 1, where it waits behind b
    wait_for(lambda: engine.replicas[1].stats.num_waiting == 1, what="the retry on replica 1")
    assert httpx.get(live.url + "/health").text.startswith("degraded: replica 0 of 2 down")
    down = metric_values(httpx.get(live.url + "/metrics").text)
    assert down[("kvserve:replica_up", (("model_name", "tiny"), ("replica", "0")))] == 0
    httpx.post(live.url + "/v1/abort", json={"request_id": "b"})
    for thread in threads[1:]:
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert plain[0].status_code == 200, plain[0].text
    assert plain[0].json()["usage"]["completion_tokens"] == 4
    wait_for(lambda: engine.num_restarts[0] == 1 and engine.health() is None, timeout=300,
             what="replica 0 to come back")
    assert httpx.get(live.url + "/health").text == "ok"
    wait_for(lambda: pools_whole(live), what="every live pool whole")
    values = metric_values(httpx.get(live.url + "/metrics").text)
    assert values[("kvserve:replica_restarts_total", (("model_name", "tiny"),
                                                      ("replica", "0")))] == 1
    assert values[("kvserve:replica_restart_failures_total", (("model_name", "tiny"),
                                                              ("replica", "0")))] == 0
    assert values[("kvserve:replica_up", (("model_name", "tiny"), ("replica", "0")))] == 1
    # its counters carried on across the restart: a counter never goes down
    assert values[("kvserve:engine_steps_total", replica0)] >= steps_before
    assert values[("vllm:num_requests_running", replica0)] == 0
    # the router sends new work to the restarted replica again
    reply = httpx.post(live.url + "/v1/completions", timeout=60,
                       json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
    assert reply.status_code == 200


def kill_process(engine, index: int) -> None:
    os.kill(engine.replicas[index].pid, signal.SIGKILL)


def test_two_local_replicas_serve_and_survive_a_killed_one(tmp_path):
    from kvserve.engine.engine_process import LocalLauncher, short_process_name
    from kvserve.server.admin import new_recorder

    engine = data_parallel([LocalLauncher(f"replica-{i}") for i in range(2)])
    with LiveServer(serving=engine) as live:
        # each replica shows under its name in ps and top (it read spawn_main)
        assert [Path(f"/proc/{r.pid}/cmdline").read_bytes().split(b"\0")[0]
                for r in engine.replicas] == [b"replica-0", b"replica-1"]
        # and in the kernel's 15-byte short name, apart (kvserve-engine-N all read
        # kvserve-engine- there)
        assert [Path(f"/proc/{r.pid}/comm").read_text().strip()
                for r in engine.replicas] == ["replica-0", "replica-1"]
        assert short_process_name("kvserve-engine-12") == "kvs-engine-12"
        check_both_replicas_serve(live)
        recorder = new_recorder(live.state, str(tmp_path / "rec"))  # sees the death
        recorder.start()
        check_a_killed_replica_is_survived(live, kill_process)
        recorder.close()
    manifest = json.loads((tmp_path / "rec" / "recording.json").read_text())
    assert [death["engine"] for death in manifest["replica_deaths"]] == [0]
    assert manifest["requests_placed_again"] == 1  # the queued request, on replica 1
    # stop() killed what did not exit within its join; under load the kernel may still be
    # reaping it when stop() returns, so poll rather than look once
    wait_for(lambda: not any(r.launcher.alive() for r in engine.replicas), timeout=60,
             what="every replica process gone after stop")


def stop_process(engine, index: int) -> None:
    os.kill(engine.replicas[index].pid, signal.SIGSTOP)


def test_a_hung_replica_is_killed_and_restarted():
    """A replica that stops making progress (SIGSTOP: alive, silent) is what the step
    watchdog is for: it is killed at the timeout and then survived as a crash is."""
    from kvserve.engine.engine_process import LocalLauncher

    engine = data_parallel([LocalLauncher(f"replica-{i}") for i in range(2)], step_timeout=4)
    with LiveServer(serving=engine) as live:
        check_a_killed_replica_is_survived(live, stop_process)
    wait_for(lambda: not any(r.launcher.alive() for r in engine.replicas), timeout=60,
             what="every replica process gone after stop")


def test_a_plain_request_under_way_on_a_dying_replica_is_placed_again():
    """A request that is not streamed has shown its client nothing while it runs: when its
    replica dies mid-decode, its unfinished sequences start over on the live replica and it
    is answered whole, not with a 503 (a streamed one cannot be: tokens reached its client).
    A sequence that had finished keeps its answer (the chaos pass: the whole group ran again,
    the finished one's re-run in no token count)."""
    from kvserve.engine.engine_process import LocalLauncher

    engine = data_parallel([LocalLauncher(f"replica-{i}") for i in range(2)])
    with LiveServer(serving=engine) as live:
        results: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: results.append(httpx.post(
            live.url + "/v1/completions", timeout=120,
            json={"prompt": [[5] * 8, [11] * 20], "max_tokens": 300, "ignore_eos": True})))
        thread.start()  # round-robin: replica 0, one sequence at a time
        wait_for(lambda: engine.replicas[0].stats.num_finished.get("length") == 1 and
                 engine.replicas[0].stats.num_running == 1 and
                 engine.replicas[0].stats.num_steps > 320, what="the second decoding")
        kill_process(engine, 0)
        thread.join(timeout=120)
        assert not thread.is_alive()
        assert results[0].status_code == 200, results[0].text
        assert results[0].json()["usage"]["completion_tokens"] == 600
        assert engine.replicas[1].stats.num_finished == {"length": 1}  # the second, there
        # the TTFTs are replica 0's; the re-run's first token is no inter-token latency on
        # replica 1 (QA: one spanned the death and the relaunch)
        values = metric_values(httpx.get(live.url + "/metrics").text)
        count = {(name, dict(labels).get("engine")): value
                 for (name, labels), value in values.items() if name.endswith("_count")}
        assert count[("vllm:time_to_first_token_seconds_count", "0")] == 2
        assert count[("vllm:time_to_first_token_seconds_count", "1")] == 0
        assert count[("vllm:inter_token_latency_seconds_count", "1")] == 299
        # its longest answer is the one it got, not that plus the dropped run's tokens
        sums = {(name, dict(labels).get("engine")): value
                for (name, labels), value in values.items() if name.endswith("_sum")}
        assert sums[("vllm:request_max_num_generation_tokens_sum", "1")] == 300
        wait_for(lambda: engine.num_restarts[0] == 1 and engine.health() is None,
                 timeout=300, what="replica 0 to come back")
        wait_for(lambda: pools_whole(live), what="every pool whole")


def test_a_request_that_kills_two_replicas_is_not_placed_again():
    """A request that fails every engine it reaches (QA: one temperature of 1e-38 did, before
    the sampler was fixed) was placed again on each live replica in turn, taking the whole
    server down with everything in flight on it. It is placed again once: the second death
    fails it, and the replicas come back to serve others."""
    from kvserve.core.router import make_router
    from kvserve.engine.data_parallel import DataParallelEngine
    from kvserve.engine.engine_process import EngineSpec, LocalLauncher

    from .helpers import poisoned_engine

    spec = EngineSpec(functools.partial(poisoned_engine, 13, max_num_seqs=1,
                                        max_model_len=1024), threads=1,
                      wait_policy="PASSIVE")
    engine = DataParallelEngine(spec, tokenizer(), [LocalLauncher(f"replica-{i}")
                                                    for i in range(2)],
                                make_router("round-robin", 2), restart_delay=0.2)
    with LiveServer(serving=engine) as live:
        reply = httpx.post(live.url + "/v1/completions", timeout=120,
                           json={"prompt": [13] * 20, "max_tokens": 4})
        assert reply.status_code == 503, reply.text
        assert "second replica to fail with it (it is not placed again" in reply.text
        wait_for(lambda: engine.num_restarts == [1, 1] and engine.health() is None,
                 timeout=300, what="both replicas back")
        reply = httpx.post(live.url + "/v1/completions", timeout=120,
                           json={"prompt": [11] * 20, "max_tokens": 4})
        assert reply.status_code == 200, reply.text


def test_a_refusal_under_data_parallelism_names_its_replica_and_routes_nothing():  # R7
    """QA (data-parallel fuzz): a request its replica refused (the queue limits, which hold
    per replica) counted as a router decision and pinned its session there, though it never
    ran; the 503 read like the whole server's count. Now the refusal names the replica, the
    router forgets it, and a DELETE of a session while no replica runs is a 503, not 404."""
    from kvserve.core.router import make_router
    from kvserve.engine.data_parallel import DataParallelEngine
    from kvserve.engine.engine_process import LocalLauncher

    spec = engine_spec(0.01, max_num_seqs=1, max_model_len=1024, max_num_queued_reqs=1,
                       max_session_kv=0.5)
    engine = DataParallelEngine(spec, tokenizer(), [LocalLauncher(f"replica-{i}")
                                                    for i in range(2)],
                                make_router("round-robin", 2), restart_delay=0.2)
    with LiveServer(serving=engine) as live:
        replies: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda i=i: replies.append(httpx.post(
            live.url + "/v1/completions", timeout=120, json=LONG,
            headers={"X-Request-Id": f"fill-{i}"}))) for i in range(4)]
        for thread in threads:  # round-robin: one running and one waiting on each
            thread.start()
        wait_for(lambda: all(r.stats.num_running == 1 and r.stats.num_waiting == 1
                             for r in engine.replicas), what="both replicas full")
        turn = {"prompt": [5] * 20, "max_tokens": 2, "session": {"id": "s"}}
        refused = httpx.post(live.url + "/v1/completions", timeout=60, json=turn)
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert "replica 0 of 2: the waiting queue is full (1 requests, " \
            "max_num_queued_reqs=1, per replica)" in message, message
        httpx.post(live.url + "/v1/abort", json={"request_id": [f"fill-{i}" for i in range(4)]})
        for thread in threads:
            thread.join(timeout=60)
        wait_for(lambda: pools_whole(live), what="both pools whole")
        assert httpx.post(live.url + "/v1/completions", timeout=60,
                          json=turn).status_code == 200
        values = metric_values(httpx.get(live.url + "/metrics").text)
        decisions = {(dict(labels)["reason"], dict(labels)["replica"]): value
                     for (name, labels), value in values.items()
                     if name == "kvserve:router_decisions_total" and value}
        # the four fills and the turn, routed afresh (not "session": it ran nowhere), to
        # replica 1: the turn in order moved on past the refusal
        assert decisions == {("round_robin", "0"): 2, ("round_robin", "1"): 3}, decisions
        live_replicas = engine._live
        engine._live = lambda: []  # as while every replica restarts
        try:
            gone = httpx.delete(live.url + "/v1/sessions/s", timeout=30)
        finally:
            engine._live = live_replicas
        assert gone.status_code == 503 and "retry later" in gone.json()["error"]["message"]
        assert httpx.delete(live.url + "/v1/sessions/s", timeout=30).status_code == 200


@pytest.mark.xdist_group("ray")  # one local Ray instance at a time (Makefile)
def test_two_ray_replicas_serve_and_survive_a_hung_actor(monkeypatch):
    """A Ray actor that stops making progress (SIGSTOP) is killed by the step watchdog
    through ``ray.kill`` and survived as a crash is: the killed-process path then runs as
    for a crashed actor, and Ray starts the actor again."""
    ray = pytest.importorskip("ray")
    from kvserve.engine.ray_launcher import RayLauncher

    # the actors import the engine factory from this test package
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        engine = data_parallel([RayLauncher(i) for i in range(2)], step_timeout=4)
        with LiveServer(serving=engine) as live:
            assert {r.pid for r in engine.replicas} != {os.getpid()}
            check_both_replicas_serve(live)
            check_a_killed_replica_is_survived(live, stop_process)
    finally:
        ray.shutdown()


def test_merged_stats_add_counts_and_pool_shares():
    """The server-wide snapshot of two replicas: counts and per-reason dicts add up; KV usage
    is the share of all their blocks in use, not the mean of the two shares."""
    from kvserve.core import SchedulerStats
    from kvserve.engine.data_parallel import merge_stats

    def stats(running: int, free: int, blocks: int, finished: dict) -> SchedulerStats:
        return SchedulerStats(running, 1, 10, 1 - free / blocks, free, blocks, 5, 2, 3, 40, 8,
                              4, finished, {"kv_capacity": 1})
    merged = merge_stats([stats(2, 10, 100, {"length": 3}),
                          stats(1, 40, 50, {"length": 1, "abort": 2})])
    assert (merged.num_running, merged.num_waiting, merged.num_free_blocks,
            merged.num_blocks, merged.num_steps) == (3, 2, 50, 150, 10)
    assert merged.kv_cache_usage == 100 / 150
    assert merged.num_finished == {"length": 4, "abort": 2}
    assert merged.num_blocked_steps == {"kv_capacity": 2}


def test_bench_serve_gets_the_same_answers_from_one_and_two_replicas(capsys):
    """The load client the docs use (`kvserve bench serve --save-detailed`, greedy, twelve
    requests at once) gets, request by request, the same text and lengths from one engine as
    from two replicas behind the router (least-loaded: both serve)."""
    from kvserve.cli import main
    from kvserve.core.router import make_router
    from kvserve.engine.data_parallel import DataParallelEngine
    from kvserve.engine.engine_process import LocalLauncher

    def bench(url: str) -> dict:
        assert main(["bench", "serve", "--base-url", url, "--json", "--no-progress",
                     "--save-detailed", "--num-prompts", "12", "--input-len", "8:40",
                     "--output-len", "4:16", "--request-rate", "inf", "--timeout", "120",
                     "--seed", "3"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert (summary["completed"], summary["failed"]) == (12, 0)
        return {key: summary[key] for key in ("input_lens", "output_lens", "generated_texts")}

    with LiveServer(max_model_len=1024) as live:
        one = bench(live.url)
    assert all(one["generated_texts"]) and sum(one["output_lens"]) >= 12 * 4
    engine = DataParallelEngine(engine_spec(max_model_len=1024), tokenizer(),
                                [LocalLauncher(f"replica-{i}") for i in range(2)],
                                make_router("least-loaded", 2))
    with LiveServer(serving=engine) as live:
        two = bench(live.url)
        decisions = engine.router_figures().decisions
        assert {replica for replica, _ in decisions} == {0, 1}
        assert sum(decisions.values()) == 12
        wait_for(lambda: pools_whole(live), what="both pools whole")
    assert two == one


def test_a_replica_dying_at_start_backs_off_and_its_failures_are_counted(monkeypatch):
    """A crash loop (QA: killed as it started, relaunched every second, failures uncounted):
    each death within a minute of its start doubles the wait before the next launch, up to
    30 s; a replica that ran a minute is relaunched at once; a relaunch that dies before
    it is ready is counted."""
    from types import SimpleNamespace

    import kvserve.engine.data_parallel as dp
    from kvserve.engine.data_parallel import DataParallelEngine
    from kvserve.engine.engine_process import EngineStartError

    clock = [1000.0]
    monkeypatch.setattr(dp.time, "monotonic", lambda: clock[0])
    engine = object.__new__(DataParallelEngine)  # its restart policy, without replicas
    engine.restart_delay, engine._started_at, engine._next_delay = 1.0, [clock[0]], [0.0]
    waits = []
    for _ in range(8):  # each launch dies at once
        waits.append(engine._backoff(0))
        engine._started_at[0] = clock[0]
    assert waits == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    clock[0] += dp.STABLE_S  # this life lasted a minute: a one-off death
    assert engine._backoff(0) == 0.0
    engine._started_at[0] = clock[0]  # and the next launch dies at once again
    assert engine._backoff(0) == 1.0

    class Stopping(threading.Event):  # its backoff waits return at once
        def wait(self, timeout=None):
            return self.is_set()

    engine._stopping, engine.num_failed_restarts, engine._loop = Stopping(), [0], None
    attempts = []

    def launch(index, cancel):
        attempts.append(index)
        if len(attempts) < 3:
            raise EngineStartError("the engine process (pid 7) died (signal 9, SIGKILL) "
                                      "before it was ready")
        cancel.set()  # the third comes up as the server stops: it is killed
        return SimpleNamespace(_kill=lambda: attempts.append("killed"))

    engine._launch = launch
    engine._next_delay = [0.0]
    engine._restart(0)
    assert attempts == [0, 0, 0, "killed"] and engine.num_failed_restarts == [2]


def test_stopping_while_a_replica_is_relaunched_cancels_the_relaunch(tmp_path):
    """The data-parallel pass: a SIGTERM while a dead replica's relaunch was loading took
    10 s (the dead replica's join waited on the loading process, their launcher shared) and
    counted a failed restart. Each life has its own launcher; the stop cancels the relaunch."""
    import time

    from kvserve.core.router import make_router
    from kvserve.engine.data_parallel import DataParallelEngine
    from kvserve.engine.engine_process import JOIN_TIMEOUT_S, EngineSpec, LocalLauncher

    from .helpers import relaunch_loads_for_ever

    spec = EngineSpec(functools.partial(relaunch_loads_for_ever, str(tmp_path),
                                        max_model_len=256), threads=1, wait_policy="PASSIVE")
    engine = DataParallelEngine(spec, tokenizer(), [LocalLauncher(f"replica-{i}")
                                                    for i in range(2)],
                                make_router("round-robin", 2), restart_delay=0.2)

    def relaunches() -> list[int]:
        return [int(name.split("-")[1]) for name in os.listdir(tmp_path)
                if name.startswith("relaunch-")]

    with LiveServer(serving=engine):
        kill_process(engine, 0)
        wait_for(lambda: relaunches(), timeout=60, what="the relaunch loading")
        stopping = time.monotonic()
    assert time.monotonic() - stopping < JOIN_TIMEOUT_S * 0.8  # it waited out the timeout
    [pid] = relaunches()
    wait_for(lambda: not _alive(pid), timeout=10, what="the relaunch stopped")
    wait_for(lambda: not any(t.name == "restart-0" for t in threading.enumerate()),
             what="the restart thread's end")
    assert engine.num_failed_restarts == [0, 0] and engine.num_restarts == [0, 0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_replicas_load_at_once(tmp_path):
    """QA: each replica was launched once the one before was ready, so N took N loads'
    time. Each of these is ready only once both are loading together."""
    from kvserve.core.router import make_router
    from kvserve.engine.data_parallel import DataParallelEngine
    from kvserve.engine.engine_process import EngineSpec, LocalLauncher

    from .helpers import rendezvous_engine

    spec = EngineSpec(functools.partial(rendezvous_engine, str(tmp_path), 2,
                                        max_model_len=256), threads=1, wait_policy="PASSIVE")
    engine = DataParallelEngine(spec, tokenizer(), [LocalLauncher(f"replica-{i}")
                                                    for i in range(2)],
                                make_router("round-robin", 2))
    with LiveServer(serving=engine) as live:
        check_both_replicas_serve(live)


def test_a_replica_that_fails_to_start_stops_the_others_loading(tmp_path):
    from kvserve.core.router import make_router
    from kvserve.engine.data_parallel import DataParallelEngine
    from kvserve.engine.engine_process import EngineSpec, EngineStartError, LocalLauncher

    from .helpers import loading_engine

    spec = EngineSpec(functools.partial(loading_engine, str(tmp_path), "replica-0"),
                      threads=1, wait_policy="PASSIVE")
    with pytest.raises(EngineStartError, match="settings are refused"):
        DataParallelEngine(spec, tokenizer(), [LocalLauncher(f"replica-{i}")
                                               for i in range(2)],
                           make_router("round-robin", 2))
    [pid] = [int(name) for name in os.listdir(tmp_path)]  # replica 1, still loading
    wait_for(lambda: not _alive(pid), timeout=10, what="the loading replica to be stopped")


def test_an_engine_process_ends_with_its_server_even_while_it_loads(tmp_path):
    """QA: a server killed while its replicas loaded left them loading on, orphans."""
    import subprocess
    import sys

    script = f"""
import functools, sys
sys.path[:0] = {[str(ROOT / "src"), str(ROOT)]!r}
from kvserve.engine.engine_process import EngineSpec, ProcessEngine
from tests.server.helpers import loading_engine, tokenizer
spec = EngineSpec(functools.partial(loading_engine, {str(tmp_path)!r}), threads=1,
                  wait_policy="PASSIVE")
ProcessEngine(spec, tokenizer())
"""
    server = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_for(lambda: os.listdir(tmp_path), timeout=60, what="the engine to start loading")
        [pid] = [int(name) for name in os.listdir(tmp_path)]
        server.kill()  # SIGKILL: nothing of the server's runs
        server.wait(10)
        wait_for(lambda: not _alive(pid), timeout=10, what="the orphan engine to end")
    finally:
        server.kill()


def test_a_signal_while_starting_stops_the_server_by_that_signal_in_one_line():
    import subprocess
    import sys

    script = f"""
import os, signal, sys, time
sys.path[:0] = [{str(ROOT / "src")!r}]
from kvserve.server.lifecycle import interruptible_start
with interruptible_start():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
print("not reached")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -signal.SIGTERM  # as a stop while serving ends
    assert "SIGTERM while starting" in done.stderr and "Traceback" not in done.stderr
    assert "not reached" not in done.stdout


def test_ray_that_cannot_be_reached_is_one_line_at_once(monkeypatch):
    """QA: RAY_ADDRESS naming nothing left the server in ray.init for minutes; a refusal
    ended in a traceback. Ray's own SIGTERM handler (exit status 15) does not outlive
    ray.init: a drained stop ends by the signal with either backend."""
    import socket
    import sys
    from types import SimpleNamespace

    from kvserve.engine.engine_process import EngineStartError
    from kvserve.engine.ray_launcher import ensure_ray

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(15))  # as Ray's driver does
        if kwargs["address"] == "127.0.0.1:1":
            raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:1\nmore")

    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(is_initialized=lambda: False,
                                                           init=init))
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(EngineStartError, match=f"cannot reach the Ray cluster at "
                                               f"RAY_ADDRESS=127.0.0.1:{port}"):
        ensure_ray()
    assert calls == []  # refused before Ray tried
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.delenv("RAY_ADDRESS")
    ensure_ray()  # a local instance
    # a local instance of its own, not the cluster a `ray start` here left named (QA)
    assert calls[-1]["address"] == "local" and signal.getsignal(signal.SIGTERM) is before
    import kvserve.ray_tasks as ray_tasks

    monkeypatch.setattr(ray_tasks, "_check_reachable", lambda address: None)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(EngineStartError) as refused:
        ensure_ray()
    # Ray's line says nothing of its token authentication, which it may be (QA)
    assert str(refused.value) == ("cannot start on the Ray cluster at RAY_ADDRESS=127.0.0.1:1: "
                                  "Failed to connect to Ray cluster at 127.0.0.1:1; a cluster "
                                  "with Ray's token authentication (`ray start` says so) needs "
                                  "RAY_AUTH_MODE=token here too")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(EngineStartError) as refused:
        ensure_ray()
    assert str(refused.value).endswith("Failed to connect to Ray cluster at 127.0.0.1:1")
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_abort_asked_while_a_group_is_placed_again_reaches_its_new_replica():
    """The review: an abort (or a client gone) while the group was being placed again went
    to the dead replica's stream and was lost; the requests ran on to their end."""
    import asyncio
    from types import SimpleNamespace

    from kvserve.engine.async_engine import EngineDeadError
    from kvserve.engine.data_parallel import _RoutedStream

    class Stream:
        def __init__(self, dead: bool) -> None:
            self.dead, self.aborted, self.cancelled = dead, [], False

        async def __anext__(self):
            if self.dead:
                raise EngineDeadError("replica 0 died")
            await asyncio.sleep(3600)

        def abort(self, request_id=None) -> bool:
            self.aborted.append(request_id)
            return not self.dead

        def cancel(self) -> None:
            self.cancelled = True

    async def run() -> Stream:
        placing, new = asyncio.Event(), Stream(dead=False)

        async def place(items, arrival_time, placed_again):
            await placing.wait()
            return 1, new, True

        dead = Stream(dead=True)
        dead.request_ids = ["g-0", "g-1"]
        engine = SimpleNamespace(_stopping=threading.Event(), _place=place)
        routed = _RoutedStream(engine, [("g-0", [5], None), ("g-1", [6], None)], 0.0, 0, dead)
        reading = asyncio.ensure_future(routed.__anext__())
        await asyncio.sleep(0)  # the death read: the group is being placed again
        assert routed.abort("g-1")  # taken (the second review: said not found)
        routed.cancel()
        placing.set()
        await asyncio.sleep(0.01)
        reading.cancel()
        return new

    new = asyncio.run(run())
    assert new.aborted[0] == "g-1" and new.cancelled


def test_a_ray_cluster_short_of_cpus_or_gpus_is_warned_at_once(caplog):
    """QA: three one-CPU replicas on a two-CPU cluster: the third waited, pending, for the
    start's ten-minute timeout without a word."""
    from kvserve.engine.data_parallel import _warn_short_cluster

    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        _warn_short_cluster({"CPU": 4.0}, 2, 2, 0)  # enough
        assert caplog.messages == []
        _warn_short_cluster({"CPU": 2.0}, 3, 1, 0)
        _warn_short_cluster({"CPU": 8.0, "GPU": 1.0}, 2, 1, 1)
    assert caplog.messages == [
        "the Ray cluster has 2 CPU(s); 3 replicas x 1 ask for 3: the replicas it cannot "
        "place wait for them (an autoscaler's new nodes) until the start times out",
        "the Ray cluster has 1 GPU(s); 2 replicas x 1 ask for 2: the replicas it cannot "
        "place wait for them (an autoscaler's new nodes) until the start times out"]


def test_a_session_is_released_where_its_turns_go_first_and_a_failure_reads_the_same():
    """The sessions pass: DELETE waited for every replica, so one hung elsewhere held it up
    to its step watchdog (10 s there, 120 s by default); and where the replica holding the
    session failed, the answer was a 503 or a 404 by which replica came first. The replica
    the session's turns go to (R6) is asked alone first; a failure beside not-founds is a
    404 that names it, whichever replica it was."""
    from types import SimpleNamespace

    from kvserve.core.router import make_router
    from kvserve.core.sessions import SessionNotFound
    from kvserve.engine.data_parallel import DataParallelEngine
    from kvserve.engine.engine_process import EngineDeadError

    asked: list[int] = []

    def replica(index: int, answer):
        async def release_session(session_id, tenant):
            asked.append(index)
            if answer == "hang":
                await asyncio.sleep(3600)  # never answers: must not be asked
            if isinstance(answer, BaseException):
                raise answer
        return SimpleNamespace(is_running=True, release_session=release_session)

    def engine(*answers):
        dp = object.__new__(DataParallelEngine)
        dp._lock, dp.router = threading.Lock(), make_router("round-robin", len(answers))
        dp.replicas = [replica(i, a) for i, a in enumerate(answers)]
        return dp

    def delete(dp, owner: int | None, tenant: str | None = "t"):
        asked.clear()
        if owner is not None:  # the session's turns went there
            dp.router._sessions[("t", "s")] = owner
        return asyncio.run(asyncio.wait_for(dp.release_session("s", tenant), 30))

    not_found = SessionNotFound("no session 's' is live (its ttl ran out, ...)")
    dead = EngineDeadError("the engine process (pid 7) was killed as hung")
    delete(engine(not_found, None, "hang"), owner=1)
    assert asked == [1]  # the hung replica 2 was never waited for
    delete(engine(None, not_found), owner=None)  # not remembered: every replica
    assert sorted(asked) == [0, 1]
    delete(engine(None, not_found), owner=1)  # moved (its replica restarted): the others
    assert asked == [1, 0]
    with pytest.raises(SessionNotFound, match=r"its ttl ran out"):
        delete(engine(not_found, not_found), owner=0)
    for answers in ((dead, not_found), (not_found, dead)):  # the same answer either way
        with pytest.raises(SessionNotFound) as raised:
            delete(engine(*answers), owner=answers.index(dead))
        replica_index = answers.index(dead)
        assert str(raised.value) == (
            f"no session 's' is live; replica {replica_index} failed as it was asked (the "
            "engine process (pid 7) was killed as hung), and its sessions ended with it")
    with pytest.raises(EngineDeadError):  # nobody could answer: retry later
        delete(engine(dead, dead), owner=None)
    delete(engine(not_found, None), owner=None, tenant=None)  # every tenant's: all asked
    assert sorted(asked) == [0, 1]
