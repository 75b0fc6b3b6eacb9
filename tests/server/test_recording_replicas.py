"""A recording of two data-parallel replicas (engine processes behind the least-loaded
router) replays step for step: each request on the replica the server placed it on, each
replica making its engine's decisions (docs/recording.md, "Replay")."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvserve.cli import main
from kvserve.sim.recording import load_recording

from .helpers import LiveServer, engine_spec, tokenizer, wait_for
from .test_recording import NUM_BLOCKS, SETTINGS, decisions, load, prompts


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from kvserve.core.router import make_router
    from kvserve.engine.data_parallel import DataParallelEngine
    from kvserve.engine.engine_process import LocalLauncher
    from kvserve.server.admin import new_recorder

    directory = tmp_path_factory.mktemp("rec") / "replicas"
    spec = dataclasses.replace(engine_spec(num_kv_blocks=NUM_BLOCKS, **SETTINGS))
    serving = DataParallelEngine(spec, tokenizer(),
                                 [LocalLauncher(f"replica-{i}") for i in range(2)],
                                 make_router("least-loaded", 2), restart_delay=0.2)
    with LiveServer(serving=serving) as live:
        recorder = new_recorder(live.state, str(directory))
        recorder.start()
        replies = load(live.url, prompts(16, seed=11))
        # every request's line written: the reports that finished them were all recorded
        wait_for(lambda: recorder.status()["requests"] == 16, what="16 requests recorded")
        recorder.close()
    return directory, replies


def test_each_request_is_recorded_with_its_replica(recorded):
    directory, _ = recorded
    recording = load_recording(directory, warn=pytest.fail)
    manifest = json.loads((directory / "recording.json").read_text())
    assert manifest["settings"]["data_parallel_size"] == 2
    assert manifest["settings"]["router"] == "least-loaded"
    placed = {r.request_id: r.replica for r in recording.trace}
    assert len(placed) == 16 and set(placed.values()) == {0, 1}
    for engine, log in recording.engines.items():  # a request's events are its replica's
        assert {e["request_id"] for e in log.events} <= \
            {rid for rid, replica in placed.items() if replica == engine}


def test_the_replay_makes_each_replicas_decisions(recorded, tmp_path):
    directory, _ = recorded
    report, events = tmp_path / "r.json", tmp_path / "e.jsonl"
    assert main(["simulate", "--trace", str(directory), "--quiet", "--report", str(report),
                 "--events", str(events)]) == 0
    config = json.loads(report.read_text())["config"]
    assert config["cost_model"]["name"] == "replay"
    assert config["data_parallel"] == {**config["data_parallel"], "size": 2,
                                       "router": "recorded"}
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    recording = load_recording(directory, warn=pytest.fail)
    for engine, log in recording.engines.items():
        simulated = [r for r in rows if r["replica"] == engine]
        assert decisions(simulated) == decisions(log.events)
        assert decisions(simulated)  # both replicas served
