"""Parallel sweeps (issue 15, item 3): ``simulate --sweep`` and ``kvserve plan`` run their
simulations on a pool of processes, and their output is byte-identical to the serial run's
(docs/simulator-speed.md)."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvserve.sim.parallel import Workers, next_questions
from kvserve.sim.plan import capacity_qps


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    assert main(["workload", "gen", "-n", "60", "--rate", "30", "--prompt-len",
                 "uniform:32,256", "--output-len", "uniform:8,64", "--prefix-groups", "2",
                 "--seed", "5", "-o", str(path)]) == 0
    return path


def step_p99(capacity: float):
    """A queue whose p99 is 0.1 s below ``capacity`` req/s and 9 s above it."""
    return lambda qps: 0.1 if qps <= capacity else 9.0


@pytest.mark.parametrize("capacity", [0.3, 1.0, 3.7, 11.0, 5000.0, 0.0001])
@pytest.mark.parametrize("workers", [2, 3, 8])
def test_capacity_search_running_ahead_probes_what_the_serial_search_probes(
        capacity: float, workers: int) -> None:
    p99 = step_p99(capacity)
    serial = capacity_qps(p99, 1.0, 2.0, rel_tol=0.01)
    batches: list[list[float]] = []

    def run_many(rates: list[float]) -> list[float | None]:
        batches.append(list(rates))
        return [p99(q) for q in rates]

    here: list[float] = []

    def run_here(qps: float) -> float | None:
        here.append(qps)
        return p99(qps)

    ahead = capacity_qps(run_here, 1.0, 2.0, rel_tol=0.01, run_many=run_many,
                         workers=workers)
    assert ahead == serial
    # each probe runs once, in its batch: every one was run again in this process, with no
    # progress bar (QA: the capacity search showed no progress), its batch's run wasted
    assert here == []
    assert all(len(b) <= workers for b in batches)
    # every probe of the search was simulated in some batch; with three workers or more
    # both answers to a question are covered, so two probes take one batch
    simulated = {q for b in batches for q in b}
    assert {round(q, 6) for q in simulated} >= {p["qps"] for p in serial[1]}
    if workers >= 3 and len(serial[1]) > 2:
        assert len(batches) < len(serial[1])


def test_next_questions_are_the_first_question_then_both_answers_breadth_first() -> None:
    def search(ask) -> float:
        return 1.0 if ask(1.0) else (2.0 if ask(2.0) else float(ask(3.0)))

    assert next_questions(search, {}, 1) == [1.0]
    assert next_questions(search, {}, 2) == [1.0, 2.0]  # ask(1.0) true ends the search
    assert next_questions(search, {}, 5) == [1.0, 2.0, 3.0]
    assert next_questions(search, {1.0: False}, 3) == [2.0, 3.0]
    assert next_questions(search, {1.0: True}, 3) == []


def test_workers_map_keeps_order_and_raises_a_jobs_error(monkeypatch) -> None:
    shown: list[tuple[str, int]] = []

    class Bar:  # a pool's runs had no progress bar at all (QA: plan ran 46 s silently)
        def __init__(self, total: int, label: str) -> None:
            self.label = label

        def update(self, done: int) -> None:
            shown.append((self.label, done))

        def close(self) -> None:
            shown.append((self.label, -1))

    monkeypatch.setattr("kvserve.sim.parallel.Progress", Bar)
    with Workers(2) as pool:
        assert pool.map(divmod, [(7, 2), (9, 4), (1, 1)]) == [(3, 1), (2, 1), (1, 0)]
        assert shown == [("3 runs on 2 workers", n) for n in (1, 2, 3, -1)]
        with pytest.raises(ZeroDivisionError):
            pool.map(divmod, [(1, 1), (1, 0)])
    with pytest.raises(ValueError, match="--workers must be >= 1, got 0"):
        Workers(0)


def test_simulate_sweep_report_is_byte_identical_with_one_or_two_workers(tmp_path, trace):
    reports = []
    for workers in ("1", "2"):
        report = tmp_path / f"sweep{workers}.json"
        assert main(["simulate", "--trace", str(trace), "--quiet", "--report", str(report),
                     "--num-kv-blocks", "60", "--sweep", "max-num-seqs=2,8,32",
                     "--workers", workers]) == 0
        reports.append(report.read_bytes())
    assert reports[0] == reports[1]
    rows = json.loads(reports[0])["sweep"]["rows"]
    assert [r["value"] for r in rows] == [2, 8, 32]
    # the rows are three different runs, each in its place: 2 seats queue longest
    queues = [r["aggregate"]["queue_p99"] for r in rows]
    assert queues[0] > queues[2]


def test_plan_with_sweep_and_capacity_is_byte_identical_with_one_or_two_workers(trace,
                                                                                capsys):
    outs = []
    for workers in ("1", "2"):
        assert main(["plan", "--trace", str(trace), "--num-kv-blocks", "60", "--candidates",
                     "2,8,32", "--queue-delay-p99", "0.5", "--json",
                     "--workers", workers]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    plan = json.loads(outs[0])
    assert [r["max_num_seqs"] for r in plan["sweep"]] == [2, 8, 32]
    assert len(plan["capacity_probes"]) >= 3


def test_simulate_refuses_zero_workers(trace, capsys):
    assert main(["simulate", "--trace", str(trace), "--sweep", "max-num-seqs=2,4",
                 "--workers", "0"]) == 2
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err


def bars(labels: list[str]) -> type:
    """A stand-in for kvserve.sim.table.Progress that records the bars' labels."""

    class Bar:
        def __init__(self, total: int, label: str = "simulating") -> None:
            labels.append(label)

        def __call__(self, now: float, num_finished: int, total: int) -> None:
            pass

        def update(self, done: int, note: str = "") -> None:
            pass

        def close(self) -> None:
            pass

    return Bar


@pytest.mark.parametrize("workers", ["1", "2"])
def test_the_capacity_search_shows_progress_as_the_sweep_does(trace, capsys, monkeypatch,
                                                              workers):
    """Serially a bar per run, the sweep's labelled by max_num_seqs and the search's by its
    rate; on a pool one bar over each map's runs (QA: the search showed none)."""
    labels: list[str] = []
    monkeypatch.setattr("kvserve.sim.table.Progress", bars(labels))
    monkeypatch.setattr("kvserve.sim.parallel.Progress", bars(labels))
    assert main(["plan", "--trace", str(trace), "--num-kv-blocks", "60", "--candidates",
                 "2,8", "--queue-delay-p99", "0.5", "--json", "--workers", workers]) == 0
    plan = json.loads(capsys.readouterr().out)
    floor = f"capacity search at {0.1 * plan['capacity_qps']:.4g} QPS"
    if workers == "1":
        probes = [f"capacity search at {p['qps']:.4g} QPS" for p in plan["capacity_probes"]]
        assert labels == ["max_num_seqs=2", "max_num_seqs=8", *probes, floor]
    else:
        assert labels[0] == "2 runs on 2 workers"  # the sweep
        # each round of the search's runs; a round of one runs here, with its own bar
        assert "capacity search: 2 runs on 2 workers" in labels[1:-1]
        assert all(label.startswith("capacity search") for label in labels[1:])
        assert labels[-1] == floor  # the floor's one run, in this process
