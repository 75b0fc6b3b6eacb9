"""A recording of data-parallel replicas replays step for step (docs/recording.md, "Replay"):
each request on the replica the server placed it on (``--router recorded``), each replica
replaying its own step log, held to its logged starts.

The hand-built recording: two replicas, max_num_seqs 1 each. Requests a, b, c, d arrive at
t=0 with 16-token prompts and answer 2 tokens then EOS (3 steps each). The server put a on
replica 0 and b, c, d on replica 1 (say prefix-affinity kept them together). Replica 0's
steps take 1 s: a runs at 0, 1, 2 and finishes at 3 s. Replica 1 took its requests a
little late (its loop read its clock 0.05 s after they arrived) and its steps take 0.5 s:
b at 0.05-1.55, c at 1.55-3.05, d at 3.05-4.55. Any other placement (least-loaded puts one
of b, c, d on replica 0) schedules other steps than the logs, so only the recorded one
replays; without the hold each of replica 1's requests would finish 0.05 s early.
"""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvserve.sim.cluster import ClusterOptions, check_recorded_placement
from kvserve.sim.deployment import Deployment
from kvserve.sim.recording import load_recording

SETTINGS = {"max_num_seqs": 1, "max_num_batched_tokens": 64, "max_model_len": 128,
            "num_kv_blocks": 32, "block_size": 16, "enable_prefix_caching": True,
            "data_parallel_size": 2, "router": "prefix-affinity",
            "router_imbalance_bound": 3}
PLACED = {"a": 0, "b": 1, "c": 1, "d": 1}
FINISHED = {"a": 3.0, "b": 1.55, "c": 3.05, "d": 4.55}
SHAPE_FIELDS = ("num_seqs", "num_tokens", "num_sampled", "num_decode_seqs", "context_tokens",
                "attention_pairs", "scattered_context_tokens")


def build(directory, *, placed=True, settings=SETTINGS):
    directory.mkdir()
    (directory / "recording.json").write_text(json.dumps({
        "format": "kvserve-recording/1", "settings": settings, "record_prompts": "none",
        "segments": [{"start": 0.0, "stop": 5.0, "in_flight_at_start": 0}]}))
    (directory / "trace-00000.jsonl").write_text("".join(
        json.dumps({"request_id": rid, "arrival_time": 0.0, "prompt_len": 16,
                    "output_len": 2, "max_tokens": 8,
                    **({"replica": replica} if placed else {})}) + "\n"
        for rid, replica in PLACED.items()))
    logs = {0: [(0.0, 1.0, 16), (1.0, 1.0, 1), (2.0, 1.0, 1)], 1: []}
    for index in range(3):  # b, c, d on replica 1
        start = 0.05 + 1.5 * index
        logs[1] += [(start, 0.5, 16), (start + 0.5, 0.5, 1), (start + 1.0, 0.5, 1)]
    shapes = [[1, 16, 1, 0, 0, 136, 0], [1, 1, 1, 1, 16, 17, 0], [1, 1, 1, 1, 17, 18, 0]]
    for engine, steps in logs.items():
        rows = [{"type": "step", "start": s, "duration": d, "num_scheduled_tokens": n,
                 "shape": dict(zip(SHAPE_FIELDS, shapes[i % 3], strict=True))}
                for i, (s, d, n) in enumerate(steps)]
        rows += [{"type": "event", "time": t, "kind": "finished", "request_id": rid}
                 for rid, t in FINISHED.items() if PLACED[rid] == engine]
        (directory / f"steps-{engine}-00000.jsonl").write_text(
            "".join(json.dumps(row) + "\n" for row in rows))
    return directory


def finish_times(report: dict) -> dict[str, float]:
    return {r["request_id"]: round(r["arrival_time"] + r["e2e_s"], 6)
            for r in report["requests"]}


def test_simulate_replays_each_replica_where_the_server_placed_it(tmp_path):
    directory = build(tmp_path / "rec")
    report = tmp_path / "r.json"
    events = tmp_path / "e.jsonl"
    assert main(["simulate", "--trace", str(directory), "--quiet", "--report", str(report),
                 "--events", str(events)]) == 0
    data = json.loads(report.read_text())
    assert data["config"]["cost_model"]["name"] == "replay"
    assert data["config"]["data_parallel"]["router"] == "recorded"
    assert data["config"]["cost_model"]["source"] == f"{directory} (engines 0-1, each " \
        "replica its own)"
    assert data["config"]["cost_model"]["num_steps"] == 12  # both logs
    assert finish_times(data) == FINISHED
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    assert {r["request_id"]: r["replica"] for r in rows} == PLACED


def test_a_change_goes_through_the_recorded_router_under_the_fitted_model(tmp_path):
    directory = build(tmp_path / "rec")
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(directory), "--quiet", "--report", str(report),
                 "--max-num-seqs", "2"]) == 0
    data = json.loads(report.read_text())
    assert data["config"]["cost_model"]["name"] == "calibrated"
    assert data["config"]["data_parallel"]["router"] == "prefix-affinity"
    assert data["config"]["data_parallel"]["imbalance_bound"] == 3
    assert main(["simulate", "--trace", str(directory), "--quiet", "--report", str(report),
                 "--router", "least-loaded"]) == 0  # another router: no step-for-step replay
    data = json.loads(report.read_text())
    assert data["config"]["cost_model"]["name"] == "calibrated"
    assert data["config"]["data_parallel"]["router"] == "least-loaded"


def test_without_the_logged_starts_the_replica_replay_would_run_early(tmp_path):
    recording = load_recording(build(tmp_path / "rec"), warn=pytest.fail)
    cluster = ClusterOptions(2, "recorded")
    settings = {k: v for k, v in recording.settings.items()
                if k not in ("data_parallel_size", "router", "router_imbalance_bound")}
    result = Deployment(cost_model="replay", recording=recording).simulate(
        recording.trace, settings, cluster=cluster)[1]
    assert [len(part.steps.time) for part in result.replicas] == [3, 9]
    assert list(result.replicas[1].steps.time)[:2] == [0.05, 0.55]
    unit = Deployment(cost_model="unit", recording=recording).simulate(
        recording.trace, settings, cluster=cluster)[1]
    assert list(unit.replicas[1].steps.time)[:2] == [0.0, 1.0]  # no log: no hold


@pytest.mark.parametrize(("argv", "needle"), [
    (["--cost-model", "replay", "--router", "least-loaded"], "replays the recorded run only"),
    (["--cost-model", "replay", "--data-parallel-lockstep"], "replays the recorded run only"),
    (["--cost-model", "replay", "--max-num-seqs", "2"], "replays the recorded run only"),
    (["--cost-model", "replay", "--data-parallel-size", "1"], "replays the recorded run only"),
    (["--data-parallel-size", "3", "--router", "recorded"],
     "--router recorded replays the 2 recorded replicas"),
])
def test_a_replay_that_cannot_follow_the_logs_is_one_line(tmp_path, capsys, argv, needle):
    directory = build(tmp_path / "rec")
    assert main(["simulate", "--trace", str(directory), "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_an_older_recording_without_placement_is_simulated_behind_a_router(tmp_path, capsys):
    settings = {k: v for k, v in SETTINGS.items() if not k.startswith("router")}
    directory = build(tmp_path / "rec", placed=False, settings=settings)
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(directory), "--quiet", "--report",
                 str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["config"]["cost_model"]["name"] == "calibrated"
    assert data["config"]["data_parallel"]["router"] == "least-loaded"
    assert main(["simulate", "--trace", str(directory), "--quiet", "--router",
                 "recorded"]) == 2
    assert "request 'a' names none" in capsys.readouterr().err


def test_recorded_placement_is_checked_before_anything_runs():
    from kvserve.sim.trace import TraceRequest

    trace = [TraceRequest("x", 0.0, 1, prompt_len=4, replica=0),
             TraceRequest("y", 0.0, 1, prompt_len=4, replica=2)]
    with pytest.raises(ValueError, match="'y' was on replica 2, past --data-parallel-size 2"):
        check_recorded_placement(trace, 2)
    check_recorded_placement(trace, 3)


def test_whatif_on_replicas_replays_them_then_changes_the_cluster(tmp_path, capsys):
    directory = build(tmp_path / "rec")
    report = tmp_path / "w.json"
    assert main(["whatif", str(directory), "--set", "data_parallel_size=4", "--set",
                 "router=least-loaded", "--set", "max_num_seqs=2", "--cost-model", "unit",
                 "--report", str(report)]) == 0
    runs = {run["label"]: run["aggregate"] for run in json.loads(report.read_text())["runs"]}
    assert list(runs) == ["recorded", "recorded (unit model)", "data_parallel_size=4",
                          "router=least-loaded", "max_num_seqs=2"]
    assert runs["recorded"]["duration_s"] == pytest.approx(4.55)  # the logs, step for step
    # unit model, 1 s a step: prefix-affinity (no shared prefix) spreads a, b | c, d: 6 s;
    # four replicas run one request each: 3 s
    assert runs["recorded (unit model)"]["duration_s"] == 6.0
    assert runs["data_parallel_size=4"]["duration_s"] == 3.0
    assert runs["max_num_seqs=2"]["duration_s"] == 3.0
    out = capsys.readouterr().out
    # against the recorded settings under the unit model: c and d each get a replica of
    # their own with four, and start at once
    assert "d: e2e 6.000 s -> 3.000 s (-3.000 s), TTFT 4.000 s -> 1.000 s; recorded (unit " \
        "model): admitted on replica 1 at step 4 (3.000 s); data_parallel_size=4: admitted " \
        "on replica 3" in out


@pytest.mark.parametrize(("change", "needle"), [
    ("data_parallel_size=0", "data_parallel_size must be an integer >= 1"),
    ("data_parallel_size=1.5", "data_parallel_size must be an integer >= 1"),
    ("router=recorded", "choose a router from round-robin"),
    ("nonsense=1", "known: max_num_seqs"),
])
def test_bad_cluster_changes_are_one_line(tmp_path, capsys, change, needle):
    directory = build(tmp_path / "rec")
    assert main(["whatif", str(directory), "--set", change]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
