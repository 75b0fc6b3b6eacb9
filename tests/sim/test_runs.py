"""Issue 17.3: the simulator and the engine's trace runner record a run with one module,
kvserve.runs (records, ITL, refusals, state samples, the result), and neither imports the
other's internals."""

from __future__ import annotations

import ast
from pathlib import Path

from kvserve.core import QueueFullError, RequestMetrics, RequestRejected
from kvserve.runs import RunRecorder, refusal_reason
from kvserve.sim.trace import TraceRequest

SRC = Path(__file__).resolve().parents[2] / "src" / "kvserve"


def arrivals() -> list[TraceRequest]:
    return [TraceRequest("a", 0.0, output_len=4, prompt_len=8),
            TraceRequest("b", 0.5, output_len=2, prompt_len=16, tenant="t")]


def test_collect_records_tokens_itl_and_finishes():
    recorder = RunRecorder(arrivals())
    metrics = RequestMetrics(0.0, 0.5, 1.0, 1.25, 8, 3, 0, 0, 0, 0.0)
    assert recorder.collect([("a", [5], False, None, None, None),
                             ("b", [7], False, None, None, None)], 1.0) == []
    assert recorder.collect([("a", [6, 9], True, "length", None, metrics),
                             ("b", [], True, None, 42, None)], 1.25) == ["a", "b"]
    a, b = recorder.records["a"], recorder.records["b"]
    # a: tokens at 1.0 and 1.25 -> one gap of 0.25; b's last output carried no token
    assert (a.num_output_tokens, a.itl_sum, a.itl_max, a.finish_reason, a.metrics) == \
        (3, 0.25, 0.25, "length", metrics)
    assert (b.num_output_tokens, b.finish_reason, b.stop_reason, b.tenant) == \
        (1, "error", "42", "t")
    assert list(recorder.itl) == [0.25]


def test_refusals_are_named_alike_in_both_runners():
    recorder = RunRecorder(arrivals())
    recorder.refuse("a", RequestRejected("too long"))
    recorder.refuse("b", QueueFullError("queue full"))
    assert [(r.finish_reason, r.stop_reason) for r in recorder.records.values()] == \
        [("rejected", "too long"), ("queue_full", "queue full")]
    assert refusal_reason(ValueError("x")) is None


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_engine_does_not_reach_into_the_simulator_nor_the_simulator_into_the_engine():
    engine = {m for p in (SRC / "engine").glob("*.py") for m in _imports(p)}
    sim = {m for p in (SRC / "sim").glob("*.py") for m in _imports(p)}
    assert "kvserve.sim.simulator" not in engine
    assert not {m for m in sim if m.startswith(("kvserve.engine", "kvserve.model"))}
