#!/usr/bin/env python
"""Where the calibrated cost model is wrong, step by step, on the engine's own steps.

benchmarks/fidelity.py keeps each engine run's step log (out/fidelity/NAME-steps.jsonl).
Replaying it through the simulator reproduces the engine's decisions, so every step the
engine ran is seen again with its batch shape; the calibrated model prices that shape and
the price is compared with the measured duration. No feedback: a wrong price here does
not change what runs next, as it does in a free-running simulation.

The replay holds each step until the engine's logged start, so it admits what the engine
admitted and follows a Poisson run to its end. (A replay by durations alone, as before,
could diverge where an arrival fell between the engine's clock and the replay's; steps
up to a divergence are used. Logs written before the idle-wait change fold an idle wait
into the step before it, so a step before an idle period reads long.)

The replay always tracks the block layout, so the table also says what share of each
group's context KV sat in scattered blocks (kvserve.sim.layout), whether or not the model
prices it.

    python benchmarks/fidelity_steps.py [--workloads w1 w2 w3 ...] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from docs_section import publish
from fidelity import DOCS, OUT, TITLE, engine_configs, workload
from kvserve.sim.cost_models import CalibratedCostModel, CostModelError, ReplayCostModel
from kvserve.sim.executor import BatchView
from kvserve.sim.simulator import Simulator

BINS = ((1, 8), (8, 24), (24, 48), (48, 80), (80, 257))


class PricedReplay:
    """Replays the engine's durations and notes what the calibrated model would charge."""

    name = "priced-replay"
    needs_block_layout = True  # for the table's layout column, whatever the model prices

    def __init__(self, replay: ReplayCostModel, model: CalibratedCostModel) -> None:
        self.replay, self.model = replay, model
        self.steps: list[tuple[BatchView, float, float]] = []  # shape, measured, priced

    def step_start(self, now: float) -> float:
        return self.replay.step_start(now)

    def step_time(self, scheduler_output: Any, view: BatchView) -> float:
        measured = self.replay.step_time(scheduler_output, view)
        self.steps.append((view, measured, self.model.step_time(scheduler_output, view)))
        return measured

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


def priced_steps(name: str, model: CalibratedCostModel, capacity: float | None
                 ) -> list[tuple[BatchView, float, float]]:
    def known_capacity() -> float:
        if capacity is None:
            raise SystemExit(f"{OUT / 'capacity.json'} is missing: run fidelity.py first")
        return capacity

    trace, settings, _ = workload(name, known_capacity, 200)  # fidelity.py's default
    priced = PricedReplay(ReplayCostModel.load(OUT / f"{name}-steps.jsonl"), model)
    try:
        Simulator(*engine_configs(settings), priced).run(trace)
    except CostModelError as error:
        print(f"{name}: {error}; using the {len(priced.steps)} steps before it",
              file=sys.stderr)
    return priced.steps


def summary(name: str, steps: list[tuple[BatchView, float, float]]) -> list[str]:
    def row(label: str, chosen: list[tuple[BatchView, float, float]]) -> str:
        measured = [m for _, m, _ in chosen]
        errors = [p / m - 1 for _, m, p in chosen]
        total = sum(p for _, _, p in chosen) / sum(measured) - 1
        context = sum(v.context_tokens for v, _, _ in chosen)
        scattered = sum(v.scattered_context_tokens for v, _, _ in chosen) / (context or 1)
        return (f"| {name.upper()} | {label} | {len(chosen)} | "
                f"{1000 * statistics.median(measured):.1f} | "
                f"{100 * statistics.median(errors):+.1f}% | "
                f"{100 * statistics.median(abs(e) for e in errors):.1f}% | {100 * total:+.1f}% "
                f"| {100 * scattered:.0f}% |")

    lines = []
    decodes = [s for s in steps if s[0].num_tokens == s[0].num_seqs]
    for lo, hi in BINS:
        chosen = [s for s in decodes if lo <= s[0].num_seqs < hi]
        if chosen:
            lines.append(row(f"decode only, {lo}-{hi - 1} sequences", chosen))
    mixed = [s for s in steps if s[0].num_tokens != s[0].num_seqs]
    if mixed:
        lines.append(row("with a prefill chunk", mixed))
    if steps:
        lines.append(row("**all steps**", steps))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+",
                        default=["w1", "w2", "w3", "w3-50", "w3-85", "w3-100"])
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    model = CalibratedCostModel.load(OUT / "cost-model.json")
    capacity_file = OUT / "capacity.json"
    capacity = json.loads(capacity_file.read_text())["qps"] if capacity_file.exists() else None
    lines = ["## The calibrated model on the engine's own steps", "",
             f"`python benchmarks/fidelity_steps.py {' '.join(sys.argv[1:])}`: each engine "
             "run's step log replayed, each step priced by the calibrated model. Error = "
             "priced / measured - 1; scattered context = the share of the steps' context "
             "tokens in blocks that do not follow their predecessor.", "",
             "| workload | steps | count | measured median ms | error, median | "
             "abs error, median | error of the sum | scattered context |",
             "|---|---|---|---|---|---|---|---|"]
    for name in args.workloads:
        if (OUT / f"{name}-steps.jsonl").exists():
            lines += summary(name, priced_steps(name, model, capacity))
    publish("fidelity_steps", "\n".join(lines), write_docs=args.write_docs, docs=DOCS,
            title=TITLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
