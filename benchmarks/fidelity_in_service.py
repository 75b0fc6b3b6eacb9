#!/usr/bin/env python
"""Calibration in service: fit the calibrated model on the engine's own steps, then predict.

benchmarks/fidelity.py calibrates on a grid of step shapes measured in isolation. Here the
same linear model is fitted instead to the steps the engine ran in service (the step logs
fidelity.py keeps, replayed to recover each step's batch shape, as in fidelity_steps.py),
from the workloads named by --train, and every workload is simulated free-running with
both models. Training workloads are marked: their figures are not a prediction.

    python benchmarks/fidelity_in_service.py [--train w3-50] [--with-grid] [--write-docs]

``--with-grid`` fits on the grid's samples and the in-service steps together.
"""

from __future__ import annotations

import argparse
import json
import sys

from docs_section import publish
from fidelity import DOCS, OUT, TITLE, engine_configs, simulate, workload
from fidelity_steps import priced_steps
from kvserve.engine.calibrate import StepShape
from kvserve.sim.calibration import fit
from kvserve.sim.cost_models import CalibratedCostModel
from kvserve.sim.executor import BatchView

WORKLOADS = ("w1", "w2", "w3", "w3-50", "w3-85", "w3-100")
FIGURES = (("throughput_output_tok_s", "output tok/s"), ("ttft_p50", "TTFT p50"),
           ("ttft_p99", "TTFT p99"), ("itl_p50", "ITL p50"), ("itl_p99", "ITL p99"),
           ("e2e_p50", "E2E p50"))


def grid_samples() -> tuple[list[BatchView], list[float]]:
    """The calibration's own measured shapes (out/fidelity/cost-model.json)."""
    samples = json.loads((OUT / "cost-model.json").read_text())["samples"]
    shapes = [StepShape(tuple(s["decode_contexts"]), tuple(map(tuple, s["prefills"])),
                        s.get("scattered", True)) for s in samples]
    return [shape.view() for shape in shapes], [s["seconds"] for s in samples]


def fit_in_service(names: list[str], grid: CalibratedCostModel, capacity: float,
                   with_grid: bool) -> CalibratedCostModel:
    views, seconds = grid_samples() if with_grid else ([], [])
    for name in names:
        for view, measured, _ in priced_steps(name, grid, capacity):
            views.append(view)
            seconds.append(measured)
    source = "in service: " + ", ".join(names) + (" and the grid" if with_grid else "")
    return fit(views, seconds, source=source)


def errors(model: CalibratedCostModel, name: str, capacity: float) -> list[float]:
    trace, settings, _ = workload(name, lambda: capacity, 200)  # fidelity.py's default
    engine = json.loads((OUT / f"{name}.json").read_text())["engine"]
    simulated = simulate(engine_configs(settings), trace, model)
    return [simulated[key] / engine[key] - 1 for key, _ in FIGURES]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", nargs="+", default=["w3-50"], choices=WORKLOADS)
    parser.add_argument("--with-grid", action="store_true")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    grid = CalibratedCostModel.load(OUT / "cost-model.json")
    capacity = json.loads((OUT / "capacity.json").read_text())["qps"]
    service = fit_in_service(args.train, grid, capacity, args.with_grid)
    lines = ["## Calibration in service (an experiment)", "",
             f"`python benchmarks/fidelity_in_service.py {' '.join(sys.argv[1:])}`".strip()
             + f": the calibrated model fitted on the engine's own steps from "
             f"{', '.join(n.upper() for n in args.train)}"
             + (" and on the grid's samples" if args.with_grid else "")
             + f" ({service.source.split('; ')[1]}), "
             "against the grid-calibrated model above, both simulating each workload "
             "free-running. Error = simulated / engine - 1; grid / in service.", "",
             "| workload | " + " | ".join(label for _, label in FIGURES) + " |",
             "|---|" + "---|" * len(FIGURES)]
    for name in WORKLOADS:
        pairs = zip(errors(grid, name, capacity), errors(service, name, capacity), strict=True)
        cells = [f"{100 * a:+.1f}% / {100 * b:+.1f}%" for a, b in pairs]
        label = name.upper() + (" (trained on)" if name in args.train else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    publish("fidelity_in_service", "\n".join(lines), write_docs=args.write_docs, docs=DOCS,
            title=TITLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
