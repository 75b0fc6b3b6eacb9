"""Spec Q in the simulator: a prefill-first step holds the decodes back, so an arrival's
first token comes one decode batch sooner, and the simulator prices the step it ran."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.core.outputs import SchedulerOutput

from .helpers import by_id, req, simulate, timings


class PerToken:
    """10 ms per scheduled token, nothing else: a step's time says what it held."""

    name = "per-token"

    def step_time(self, scheduler_output: SchedulerOutput, view: Any) -> float:
        return 0.01 * scheduler_output.total_num_scheduled_tokens

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


@pytest.mark.parametrize("step_mix, first_token", [
    ("mixed", 0.64 + 2.04),  # the arrival's step holds four decodes and its 200 tokens
    ("prefill-first", 0.64 + 2.00),  # its 200 tokens alone (Q2)
])
def test_an_arrival_during_decodes_q1_q2(step_mix, first_token) -> None:
    trace = [req(f"d{i}", 16, 20, ignore_eos=True, max_tokens=20) for i in range(4)]
    trace.append(req("late", 200, 5, arrival=0.5, ignore_eos=True, max_tokens=5))
    result = simulate(trace, cost_model=PerToken(), step_mix=step_mix)  # type: ignore[arg-type]
    records = by_id(result)
    _, first, _ = timings(records["late"])
    assert first == pytest.approx(first_token)
    # the decoders' longest gap holds the arrival's prefill either way: 2.04 s mixed; with
    # prefill-first its 2.00 s step, then a 0.05 s step of five decodes
    gap = max(records[f"d{i}"].itl_max for i in range(4))
    assert gap == pytest.approx(2.04 if step_mix == "mixed" else 2.05)
    assert all(r.num_output_tokens == (5 if r.request_id == "late" else 20)
               for r in result.records)
