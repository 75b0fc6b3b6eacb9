"""Small factories for the simulator tests."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core import CacheConfig, SchedulerConfig
from kvserve.sim.cost_models import CostModel, UnitCostModel
from kvserve.sim.report import aggregate
from kvserve.sim.simulator import RequestRecord, SimResult, Simulator
from kvserve.sim.trace import TraceRequest


def req(request_id: str, prompt_len: int, output_len: int, arrival: float = 0.0,
        **fields: object) -> TraceRequest:
    return TraceRequest(request_id, arrival, output_len, prompt_len=prompt_len,
                        **fields)  # type: ignore[arg-type]


def simulate(trace: Sequence[TraceRequest], num_blocks: int = 1000, *,
             cost_model: CostModel | None = None, batching: str = "continuous",
             block_size: int = 16, enable_prefix_caching: bool = True,
             **config: object) -> SimResult:
    """Run with invariant checks after every step."""
    sim = Simulator(SchedulerConfig(**config),  # type: ignore[arg-type]
                    CacheConfig(num_blocks, block_size, enable_prefix_caching),
                    cost_model or UnitCostModel(), batching=batching, check=True)
    return sim.run(trace)


def by_id(result: SimResult) -> dict[str, RequestRecord]:
    return {r.request_id: r for r in result.records}


def timings(record: RequestRecord) -> tuple[float | None, float | None, float]:
    """(first scheduled, first token, finished) of a finished request."""
    m = record.metrics
    assert m is not None, record
    return m.first_scheduled_time, m.first_token_time, m.finished_time


__all__ = ["aggregate", "by_id", "req", "simulate", "timings"]
