#!/usr/bin/env python
"""Fidelity near capacity, judged against the engine's own spread (issue 15 item 1).

The simulator is calibrated on the engine's steps in service, fitted on one run and checked
on others; every engine figure is the median of repeated runs with its min-max band.

- ``--phase calibrate``: the grid calibration (``kvserve calibrate``'s, as fidelity.py runs
  it), then the **calibration run**: W3's requests 100-199 (arrivals shifted to start at 0)
  on the engine at 80% of the grid model's capacity, and the in-service models fitted on
  the steps it ran (``--phase fit``). Neither sees the requests the study judges.
- ``--phase fit``: (re)fit the in-service models on the calibration run's saved steps, no
  engine: **kinds**, the six terms and the step-kind term (a fixed cost of a step with
  prefill chunks), relative to the model's price; **six-term**, ``kvserve calibrate
  --trace``'s fit before the kind term (six terms, relative to the measured time).
- ``--phase run --shares 0.5 0.85 1.0 --runs 3``: W3's first 100 requests (the **judged
  trace**) on the engine at these shares of the kinds model's simulated capacity
  (``kvserve plan``'s search: the largest rate whose p99 queueing stays within 2 s), each
  share ``--runs`` times, one fresh engine per run; each run's figures and step log are kept.
- ``--phase report [--write-docs]``: per share, the engine's median and min-max of each
  figure against the simulated figure of each model (**pooled**: the kinds fit on the
  calibration run and the runs at every other share, leave-share-out; kinds; six-term;
  the grid's) (a
  figure is met when it lies in the band, or within 8% of the median where the band is
  narrower); the engine's capacity (the largest share whose median p99 queueing is within
  2 s) against the simulated one; and each model's step error on every judged run's own
  steps (shapes from the step log), in all and by kind (decode-only, with a prefill chunk).

Run each phase under the bench lock on a quiet machine; ``--requests`` and the shares can
shrink a smoke test (``--phase run --shares 0.5 --runs 1 --requests 8``).

    python benchmarks/fidelity_band.py --phase calibrate   # or --phase fit on saved steps
    python benchmarks/fidelity_band.py --phase run --shares 0.5 --runs 3
    python benchmarks/fidelity_band.py --phase report --write-docs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from docs_section import publish
from fidelity import (  # first: sets OMP_WAIT_POLICY before torch loads
    BLOCK_SIZE,
    DOCS,
    DTYPE,
    OUT,
    QUEUE_P99_BOUND,
    TITLE,
    W1_SETTINGS,
    engine_configs,
    judge,
    new_engine,
    now,
    simulate,
)
from kvserve.engine import calibrate
from kvserve.engine.trace_runner import run_trace
from kvserve.sim.calibration import fit, read_step_log
from kvserve.sim.cost_models import CalibratedCostModel, ReplayCostModel
from kvserve.sim.executor import BatchView
from kvserve.sim.machine import cpu_identity, describe_cpu
from kvserve.sim.plan import capacity_qps
from kvserve.sim.report import aggregate
from kvserve.sim.trace import TraceRequest
from shared_workloads import w3_trace

BAND = OUT / "band"
JUDGED = 100  # W3's first requests: the judged trace
CALIBRATION_SHARE = 0.8  # of the grid model's capacity: the calibration run's rate
FIGURES = (("throughput_output_tok_s", "output tok/s"), ("ttft_p50", "TTFT p50"),
           ("ttft_p99", "TTFT p99"), ("itl_p50", "ITL p50"), ("itl_p99", "ITL p99"),
           ("e2e_p50", "E2E p50"), ("e2e_p99", "E2E p99"), ("queue_p99", "queue p99"))
JUDGED_FIGURES = {"ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99"}
NEAR_MEDIAN = 0.08


def judged_trace(rate: float, requests: int = JUDGED) -> list[TraceRequest]:
    return w3_trace(200, rate)[:requests]


def calibration_trace(rate: float) -> list[TraceRequest]:
    """W3's requests 100-199 at ``rate``, the first arriving at 0: none of the judged ones."""
    tail = w3_trace(200, rate)[JUDGED:]
    origin = tail[0].arrival_time
    return [dataclasses.replace(r, arrival_time=r.arrival_time - origin) for r in tail]


def simulated_capacity(model: CalibratedCostModel, requests: int = JUDGED) -> float:
    configs = engine_configs(W1_SETTINGS)

    def queue_p99(qps: float) -> float | None:
        return simulate(configs, judged_trace(qps, requests), model)["queue_p99"]

    qps, _ = capacity_qps(queue_p99, 1.0, QUEUE_P99_BOUND, rel_tol=0.01)
    if qps is None:
        raise SystemExit("no rate keeps p99 queueing within the bound in the simulator")
    return qps


def load_model(name: str) -> CalibratedCostModel:
    return CalibratedCostModel.load(BAND / f"{name}.json")


def logged_steps(path: Path) -> list[tuple[BatchView, float]]:
    """Each logged step's shape (as the engine recorded it) and its measured duration."""
    return list(zip(*read_step_log(path), strict=True))


def machine_note() -> dict[str, Any]:
    return {"load_1min": os.getloadavg()[0], "time": now()}


def phase_calibrate(requests: int, quick: bool) -> None:
    engine = new_engine(W1_SETTINGS)
    shapes = calibrate.grid(quick, block_size=BLOCK_SIZE)
    start = time.perf_counter()
    grid, seconds = calibrate.calibrate(engine.executor, engine.scheduler.cache_config.num_blocks,
                                        shapes, warmup=1 if quick else 2,
                                        repeats=1 if quick else 5)
    meta = {"model": "smollm2-135m", "dtype": DTYPE, "block_size": BLOCK_SIZE,
            "num_samples": len(shapes), "seconds": round(time.perf_counter() - start, 1),
            **machine_note()}
    (BAND / "grid.json").write_text(calibrate.to_json(grid, shapes, seconds, meta))
    del engine
    rate = CALIBRATION_SHARE * simulated_capacity(grid, requests)
    trace = calibration_trace(rate)[:requests]
    note = machine_note()
    engine = new_engine(W1_SETTINGS)
    with (BAND / "calibration-run-steps.jsonl").open("w") as log:
        run_trace(engine, trace, log=log, greedy=True)
    meta = {"model": "smollm2-135m", "dtype": DTYPE, "block_size": BLOCK_SIZE,
            "trace": f"W3 requests 100-199 at {rate:.3f} req/s", "rate": rate, **note}
    print(f"grid: {grid.source}", flush=True)
    phase_fit(meta)


# The in-service models: file name, and fit() options.
IN_SERVICE = {"kinds": ("service-kinds", {"kind_term": True, "relative_to": "priced"}),
              "six-term": ("service", {})}


def phase_fit(meta: dict[str, Any] | None = None) -> None:
    """Fit each in-service model on the calibration run's steps (``meta``: the run's, or
    the one an earlier fit saved)."""
    steps = logged_steps(BAND / "calibration-run-steps.jsonl")
    views, durations = [v for v, _ in steps], [d for _, d in steps]
    if meta is None:
        meta = json.loads((BAND / "service.json").read_text())["meta"]
    for name, (file, options) in IN_SERVICE.items():
        model = fit(views, durations, source=f"in service ({name}): W3 requests 100-199 at "
                    f"{meta['rate']:.2f} req/s, {len(views)} steps", **options)
        quality = calibrate.goodness(model, views, durations)
        (BAND / f"{file}.json").write_text(calibrate.in_service_json(
            model, {**meta, "num_steps": len(views), "fit": options, **quality}))
        print(f"{name}: {model.source}; error of the sum {100 * quality['error_of_the_sum']:+.1f}%",
              flush=True)


def run_name(share: float, index: int) -> str:
    return f"share{round(100 * share)}-run{index}"


def engine_run(directory: Path, name: str, settings: dict[str, Any],
               trace: list[TraceRequest], row: dict[str, Any]) -> dict[str, Any]:
    """``trace`` on a fresh engine with ``settings``: its step log goes to
    ``name``-steps.jsonl and ``row`` (with "rate") plus the run's wall time, the machine's
    state before it and the engine's figures to ``name``.json, both under ``directory``."""
    note = machine_note()
    engine = new_engine(settings)
    with (directory / f"{name}-steps.jsonl").open("w") as log:
        start = time.perf_counter()
        run = run_trace(engine, trace, log=log, greedy=True)
        wall = time.perf_counter() - start
    row = {**row, "wall_s": wall, **note, "engine": aggregate(run.result)}
    (directory / f"{name}.json").write_text(json.dumps(row, indent=1) + "\n")
    print(f"{name}: {row['rate']:.3f} req/s, {wall:.0f} s, queue p99 "
          f"{row['engine']['queue_p99']:.3f} s, load {note['load_1min']:.2f}", flush=True)
    return row


def phase_run(shares: list[float], runs: int, requests: int) -> None:
    capacity = simulated_capacity(load_model("service-kinds"), requests)
    for index in range(runs):  # the shares alternate, so drift in the machine hits each alike
        for share in shares:
            engine_run(BAND, run_name(share, index), W1_SETTINGS,
                       judged_trace(share * capacity, requests),
                       {"share": share, "rate": share * capacity, "capacity": capacity,
                        "requests": requests})


def number(v: float) -> str:
    return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"


def share_table(share: float, rows: list[dict[str, Any]], models: dict[str, Any]
                ) -> tuple[list[str], dict[str, int]]:
    rate, requests = rows[0]["rate"], rows[0]["requests"]
    configs = engine_configs(W1_SETTINGS)
    simulated = {name: simulate(configs, judged_trace(rate, requests), model)
                 for name, model in models.items()}
    loads = ", ".join(f"{r['load_1min']:.2f}" for r in rows)
    lines = [f"**{round(100 * share)}% of capacity: {rate:.2f} req/s** ({len(rows)} engine "
             f"runs, {rows[0]['time']} onwards; 1-minute load before each: {loads})", "",
             "| figure | engine median [min - max] | "
             + " | ".join(f"{name} sim | error | met" for name in models) + " |",
             "|---|---|" + "---|---|---|" * len(models)]
    met = dict.fromkeys(models, 0)
    for key, label in FIGURES:
        values = [r["engine"][key] for r in rows]
        cells = [f"{number(statistics.median(values))} [{number(min(values))} - "
                 f"{number(max(values))}]"]
        for name in models:
            error, ok = judge(simulated[name][key], values, NEAR_MEDIAN)
            judged = key in JUDGED_FIGURES
            met[name] += ok and judged
            cells += [number(simulated[name][key]), error,
                      ("**yes**" if ok else "no") if judged else ""]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines, met


def step_errors(rows_by_share: dict[float, list[dict[str, Any]]], models: dict[str, Any],
                pooled: dict[float, CalibratedCostModel]) -> list[str]:
    lines = ["| share | model | steps (all runs) | measured median ms | error of the sum | "
             "decode-only steps: error of the sum | steps with a prefill chunk: error of "
             "the sum | abs error, median |", "|---|---|---|---|---|---|---|---|"]
    for share, rows in rows_by_share.items():
        steps = run_steps(share, len(rows))
        measured = [s for _, s in steps]
        mixed = [view.num_tokens > view.num_decode_seqs for view, _ in steps]
        for name, model in {"pooled": pooled[share], **models}.items():
            priced = [model.step_time(None, view) for view, _ in steps]
            errors = [abs(p / m - 1) for p, m in zip(priced, measured, strict=True)]
            by_kind = [_sum_error(priced, measured, [m == kind for m in mixed])
                       for kind in (False, True)]
            lines.append(f"| {round(100 * share)}% | {name} | {len(steps):,} | "
                         f"{1000 * statistics.median(measured):.1f} | "
                         f"{_sum_error(priced, measured, [True] * len(steps))} | "
                         f"{by_kind[0]} | {by_kind[1]} | {100 * statistics.median(errors):.1f}% |")
    return lines


def _sum_error(priced: list[float], measured: list[float], chosen: list[bool]) -> str:
    total = sum(m for m, c in zip(measured, chosen, strict=True) if c)
    if not total:
        return "—"
    return f"{100 * (sum(p for p, c in zip(priced, chosen, strict=True) if c) / total - 1):+.1f}%"


def replay_lines(rows_by_share: dict[float, list[dict[str, Any]]]) -> list[str]:
    """Each run simulated with its own measured step times (``ReplayCostModel``): what is
    left between the replay and the engine is everything but the step prices."""
    configs = engine_configs(W1_SETTINGS)
    lines = ["| share | runs | largest error of the replay, any judged figure or queue p99 |",
             "|---|---|---|"]
    for share, rows in rows_by_share.items():
        worst = 0.0
        for index, row in enumerate(rows):
            log = BAND / f"{run_name(share, index)}-steps.jsonl"
            replayed = simulate(configs, judged_trace(row["rate"], row["requests"]),
                                ReplayCostModel.load(log))
            for key in (*JUDGED_FIGURES, "queue_p99"):
                worst = max(worst, abs(replayed[key] / row["engine"][key] - 1))
        lines.append(f"| {round(100 * share)}% | {len(rows)} | {100 * worst:.1f}% |")
    return lines


def capacity_lines(rows_by_share: dict[float, list[dict[str, Any]]], capacities: dict[str, float]
                   ) -> list[str]:
    lines = ["| share | rate req/s | engine p99 queueing per run, s | median | within "
             f"{QUEUE_P99_BOUND:g} s |", "|---|---|---|---|---|"]
    passing, failing = None, None
    for share in sorted(rows_by_share):
        rows = rows_by_share[share]
        values = [r["engine"]["queue_p99"] for r in rows]
        ok = statistics.median(values) <= QUEUE_P99_BOUND
        if ok and failing is None:
            passing = rows[0]["rate"]
        elif not ok and failing is None:
            failing = rows[0]["rate"]
        lines.append(f"| {round(100 * share)}% | {rows[0]['rate']:.2f} | "
                     + ", ".join(f"{v:.2f}" for v in values)
                     + f" | {statistics.median(values):.2f} | {'yes' if ok else 'no'} |")
    where = (f"at least {passing:.2f} req/s" if passing else "below every rate run") + \
        (f" and below {failing:.2f} req/s" if failing else " (no rate run failed)")
    simulated = "; ".join(f"{name} model {qps:.2f} req/s" for name, qps in capacities.items())
    return [*lines, "", f"Engine capacity (median of the runs per rate): {where}. Simulated "
            f"on the judged trace: {simulated}."]


def run_steps(share: float, runs: int) -> list[tuple[BatchView, float]]:
    steps = []
    for index in range(runs):
        steps += logged_steps(BAND / f"{run_name(share, index)}-steps.jsonl")
    return steps


def pooled_models(rows_by_share: dict[float, list[dict[str, Any]]]
                  ) -> dict[float, CalibratedCostModel]:
    """Per share, the kinds fit (``kvserve calibrate --step-logs``'s) on the calibration run
    and every run at the *other* shares: calibration pooled over a dozen runs spread over the
    hour, none of them the runs it is judged on (leave-share-out)."""
    calibration = logged_steps(BAND / "calibration-run-steps.jsonl")
    models = {}
    for share in rows_by_share:
        steps = list(calibration)
        for other, rows in rows_by_share.items():
            if other != share:
                steps += run_steps(other, len(rows))
        models[share] = fit([v for v, _ in steps], [d for _, d in steps],
                            source=f"pooled without the {round(100 * share)}% runs",
                            kind_term=True, relative_to="priced")
    return models


def phase_report(write_docs: bool) -> None:
    models = {"kinds": load_model("service-kinds"), "six-term": load_model("service"),
              "grid": load_model("grid")}
    rows_by_share: dict[float, list[dict[str, Any]]] = {}
    for path in sorted(BAND.glob("share*-run*.json")):
        row = json.loads(path.read_text())
        rows_by_share.setdefault(row["share"], []).append(row)
    rows_by_share = dict(sorted(rows_by_share.items()))
    requests = next(iter(rows_by_share.values()))[0]["requests"]
    pooled = pooled_models(rows_by_share)
    capacities = {name: simulated_capacity(model, requests) for name, model in models.items()}
    capacities.update({f"pooled without {round(100 * share)}%":
                       simulated_capacity(model, requests) for share, model in pooled.items()})
    service_meta = json.loads((BAND / "service-kinds.json").read_text())["meta"]
    lines = ["## Near capacity, against the engine's spread", "",
             f"`python benchmarks/fidelity_band.py` (phases calibrate, run, report) on "
             f"{describe_cpu(cpu_identity())}. The in-service models were fitted on the "
             f"calibration run ({service_meta['trace']}, {service_meta['num_steps']:,} steps, "
             f"{service_meta['time']}, load {service_meta['load_1min']:.2f}): **kinds** with "
             "the step-kind term, relative to its price (mean step error "
             f"{100 * service_meta['mean_abs_error']:.1f}%), **six-term** without it, "
             "relative to the measured time (the fit before it); the grid model on "
             "`kvserve calibrate`'s 31 shapes in the same sitting; **pooled**, the kinds "
             "fit on the calibration run and every run at the other shares, so each share "
             "is judged by a model that saw none of its own runs (`kvserve calibrate "
             "--step-logs`, leave-share-out). Judged: W3's first "
             f"{requests} requests, which no fit saw, at shares of the kinds model's "
             "capacity. A p50 or p99 is met when the simulated figure lies in the engine's "
             "min-max band or within 8% of its median.", ""]
    for share, rows in rows_by_share.items():
        table, met = share_table(share, rows, {"pooled": pooled[share], **models})
        lines += [*table, "", "Met: " + ", ".join(f"{name} {count} of "
                                                  f"{len(JUDGED_FIGURES)}"
                                                  for name, count in met.items()), ""]
    lines += ["### Capacity on the engine", "", *capacity_lines(rows_by_share, capacities), "",
              "### The engine's own step times, replayed", "",
              "Each engine run simulated with its own step log's durations "
              "(`kvserve simulate --replay-step-times`): the simulator then makes the "
              "engine's decisions, and whatever differs from the engine besides the price "
              "of a step (admission, chunking, the loop between steps, the first token's "
              "time) would show here.", "", *replay_lines(rows_by_share), "",
              "### Step error on the judged runs' own steps", "",
              "Each step the engine ran (its shape from the step log) priced by each model; "
              "error = priced / measured - 1, in all and by kind (a step with a prefill "
              "chunk has num_tokens > num_decode_seqs).", "",
              *step_errors(rows_by_share, models, pooled)]
    publish("fidelity_band", "\n".join(lines), write_docs=write_docs, docs=DOCS, title=TITLE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("calibrate", "fit", "run", "report"), required=True)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.5, 0.85, 1.0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=JUDGED,
                        help=f"judged requests (<= {JUDGED}; fewer for a smoke test)")
    parser.add_argument("--quick", action="store_true",
                        help="calibrate: the small grid, one repeat (a smoke test)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if not 1 <= args.requests <= JUDGED or args.runs < 1:
        parser.error(f"--requests must be in 1..{JUDGED} and --runs >= 1")
    BAND.mkdir(parents=True, exist_ok=True)
    if args.phase == "calibrate":
        phase_calibrate(args.requests, args.quick)
    elif args.phase == "fit":
        phase_fit()
    elif args.phase == "run":
        phase_run(args.shares, args.runs, args.requests)
    else:
        phase_report(args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
