#!/usr/bin/env python
"""Capacity confirmed on the engine (issue 15): the simulator's W3 capacity against the
engine's, at a step budget where the p99 queueing bound measures queueing.

Capacity is the largest rate whose p99 queueing (arrival to first scheduled) stays within
2 s. On a CPU where one 2,048-token step takes longer than that bound, p99 queueing sits
near one step's time at any load, and the 2 s line is crossed by noise, not by the queue
(docs/fidelity.md, "Capacity on the engine"). This check runs the deployment with a smaller
step budget (``--max-num-batched-tokens``, default 512), where a step is a fraction of the
bound, and brackets the engine's capacity around the simulated one:

- ``--phase calibrate --runs 2 --rate 0.45``: calibration runs on the engine at this step
  budget, W3's requests 100-199 (none of the judged ones) at ``--rate``, each on a fresh
  engine, their step logs kept as calib-run*. This machine's speed wanders about 20% from
  hour to hour (docs/fidelity.md, "Pooled calibration"), so calibrate in the same sitting as
  the judged runs, not on another day's logs.
- ``--phase plan``: one model fitted on every step log given (``kvserve calibrate
  --step-logs``'s pooled kinds fit; default: this check's calibration runs, else every log
  benchmarks/fidelity_band.py and this check saved), then ``kvserve plan``'s search on W3's
  first 100 requests: the simulated capacity C, every probe (the p99 queueing against the
  rate, so the bound's steepness shows) and the p99 queueing at 10% of C (the floor a lone
  request meets). Saved to out/fidelity/capacity/plan.json.
- ``--phase run --shares 0.9 1.1 --runs 3``: the same requests on the engine at these shares
  of C, the shares alternating, one fresh engine per run; each run's figures and step log
  are kept.
- ``--phase report [--write-docs]``: per share, each run's p99 queueing, the median and the
  simulator's figure at that rate; the engine's capacity is bracketed by the largest share
  whose median is within the bound and the smallest that is not. C is confirmed within 10%
  when the engine holds the bound at 0.9 C and not at 1.1 C.

    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/capacity_check.py --phase calibrate
    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/capacity_check.py --phase plan
    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/capacity_check.py --phase run
    .venv/bin/python benchmarks/capacity_check.py --phase report --write-docs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from docs_section import publish
from fidelity import (  # first: sets OMP_WAIT_POLICY before torch loads
    DOCS,
    OUT,
    QUEUE_P99_BOUND,
    TITLE,
    engine_configs,
    simulate,
)
from fidelity_band import (
    BAND,
    JUDGED,
    calibration_trace,
    engine_run,
    judged_trace,
    logged_steps,
    machine_note,
    run_name,
)
from kvserve.engine import calibrate
from kvserve.sim.calibration import fit
from kvserve.sim.cost_models import CalibratedCostModel
from kvserve.sim.machine import cpu_identity, describe_cpu
from kvserve.sim.plan import FLOOR_SHARE, capacity_floor, capacity_qps

HERE = OUT / "capacity"


def settings(max_num_batched_tokens: int) -> dict[str, Any]:
    return {"max_num_seqs": 256, "max_num_batched_tokens": max_num_batched_tokens}


def step_logs(extra: list[Path]) -> list[Path]:
    """The logs the model is fitted on: ``extra`` if given, else this check's calibration
    runs, else every saved one."""
    if extra:
        return extra
    return (sorted(HERE.glob("calib-run*-steps.jsonl")) or
            sorted(BAND.glob("*-steps.jsonl")) + sorted(HERE.glob("*-steps.jsonl")))


def pooled_model(logs: list[Path]) -> CalibratedCostModel:
    steps = [step for log in logs for step in logged_steps(log)]
    if not steps:
        raise SystemExit("no step logs to fit on: run benchmarks/fidelity_band.py --phase "
                         "calibrate first, or pass --step-logs")
    return fit([v for v, _ in steps], [d for _, d in steps], kind_term=True,
               relative_to="priced",
               source=f"pooled kinds fit on {len(logs)} step logs, {len(steps):,} steps")


def queue_p99(model: CalibratedCostModel, budget: int, rate: float) -> float | None:
    return simulate(engine_configs(settings(budget)), judged_trace(rate), model)["queue_p99"]


def phase_calibrate(budget: int, rate: float, runs: int) -> None:
    for index in range(runs):
        engine_run(HERE, f"calib-run{index}", settings(budget), calibration_trace(rate),
                   {"rate": rate, "max_num_batched_tokens": budget,
                    "trace": f"W3 requests {JUDGED}-{2 * JUDGED - 1}"})


def phase_plan(budget: int, logs: list[Path]) -> None:
    model = pooled_model(logs)
    def at(rate: float) -> float | None:
        return queue_p99(model, budget, rate)

    qps, probes = capacity_qps(at, 1.0, QUEUE_P99_BOUND, rel_tol=0.01)
    if qps is None:
        raise SystemExit("no rate keeps p99 queueing within the bound in the simulator")
    floor, _ = capacity_floor(at, qps, QUEUE_P99_BOUND)  # kvserve plan's floor
    (HERE / "model.json").write_text(calibrate.in_service_json(
        model, {"step_logs": [str(log) for log in logs], **machine_note()}))
    plan = {"capacity_qps": qps, "max_num_batched_tokens": budget,
            "queue_p99_bound_s": QUEUE_P99_BOUND, "model_source": model.source,
            "step_logs": [str(log) for log in logs], "probes": probes,
            "floor": {"qps": FLOOR_SHARE * qps, "queue_p99": floor},
            **machine_note()}
    (HERE / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    print(f"{model.source}\nsimulated capacity at {budget} tokens per step: {qps:.3f} req/s; "
          f"p99 queueing at {FLOOR_SHARE:.0%} of it: {plan['floor']['queue_p99']:.2f} s",
          flush=True)


def load_plan() -> dict[str, Any]:
    path = HERE / "plan.json"
    if not path.exists():
        raise SystemExit(f"{path} is missing: run --phase plan first")
    return json.loads(path.read_text())


def phase_run(shares: list[float], runs: int) -> None:
    plan = load_plan()
    capacity, budget = plan["capacity_qps"], plan["max_num_batched_tokens"]
    for index in range(runs):  # the shares alternate, so drift in the machine hits each alike
        for share in shares:
            engine_run(HERE, run_name(share, index), settings(budget),
                       judged_trace(share * capacity),
                       {"share": share, "rate": share * capacity, "capacity": capacity,
                        "max_num_batched_tokens": budget, "requests": JUDGED})


def verdict(medians: dict[float, float]) -> tuple[float | None, float | None, bool]:
    """Median p99 queueing per share -> (the largest share that holds the bound, the
    smallest share above it, which does not, and whether the capacity is confirmed within
    10%: held at 0.9 or more and missed at 1.1 or less)."""
    passing = max((s for s in medians if medians[s] <= QUEUE_P99_BOUND), default=None)
    failing = min((s for s in medians if passing is None or s > passing), default=None)
    within = passing is not None and failing is not None and passing >= 0.9 and failing <= 1.1
    return passing, failing, within


def speed(model: CalibratedCostModel, log: Path) -> float:
    """A run's steps: their measured time over the model's price of the same shapes (1.00:
    priced exactly; below 1, the engine ran faster than the model says)."""
    steps = logged_steps(log)
    return sum(d for _, d in steps) / sum(model.step_time(None, view) for view, _ in steps)


def phase_report(write_docs: bool) -> None:
    plan = load_plan()
    model = CalibratedCostModel.load(HERE / "model.json")
    capacity, budget = plan["capacity_qps"], plan["max_num_batched_tokens"]
    rows_by_share: dict[float, list[dict[str, Any]]] = {}
    for path in sorted(HERE.glob("share*-run*.json")):
        row = json.loads(path.read_text())
        rows_by_share.setdefault(row["share"], []).append(row)
    if not rows_by_share:
        raise SystemExit(f"no engine runs in {HERE}: run --phase run first")
    table = ["| share of C | rate req/s | engine p99 queueing per run, s | median | within "
             f"{QUEUE_P99_BOUND:g} s | simulated | run times (UTC), load before each |",
             "|---|---|---|---|---|---|---|"]
    medians = {}
    for share, rows in sorted(rows_by_share.items()):
        values = [r["engine"]["queue_p99"] for r in rows]
        medians[share] = statistics.median(values)
        simulated = queue_p99(model, budget, rows[0]["rate"])
        table.append(
            f"| {share:.0%} | {rows[0]['rate']:.3f} | {', '.join(f'{v:.2f}' for v in values)} "
            f"| {medians[share]:.2f} | {'yes' if medians[share] <= QUEUE_P99_BOUND else 'no'} "
            f"| {simulated:.2f} | "
            + ", ".join(f"{r['time'][11:16]} ({r['load_1min']:.2f})" for r in rows) + " |")
    passing, failing, within = verdict(medians)
    speeds = [f"{log.name.removesuffix('-steps.jsonl')}: {speed(model, log):.2f}"
              for log in sorted(HERE.glob("calib-run*-steps.jsonl"))]
    for share, rows in sorted(rows_by_share.items()):
        for index in range(len(rows)):
            log = HERE / f"{run_name(share, index)}-steps.jsonl"
            speeds.append(f"{share:.0%} run {index + 1}: {speed(model, log):.2f}")
    bracket = ((f"at least {passing:.0%} of C" if passing is not None else "below every share")
               + (f" and below {failing:.0%}" if failing is not None else
                  " (no share missed the bound)"))
    probes = ", ".join(f"{p['qps']:.3f}: {p['queue_p99']:.2f}" for p in plan["probes"]
                       if p["queue_p99"] is not None)
    lines = [
        f"## Capacity, confirmed on the engine ({budget} tokens per step)", "",
        f"`python benchmarks/capacity_check.py` (phases plan, run, report) on "
        f"{describe_cpu(cpu_identity())}, {plan['time']} onwards. "
        f"The model: {plan['model_source']}. "
        f"Its capacity for W3's first {JUDGED} requests (p99 queueing within "
        f"{QUEUE_P99_BOUND:g} s; max_num_seqs 256, {budget} tokens per step): "
        f"**C = {capacity:.3f} req/s**. At {FLOOR_SHARE:.0%} of C the simulated p99 queueing "
        f"is {plan['floor']['queue_p99']:.2f} s. The search's probes (req/s: simulated p99 "
        f"queueing, s): {probes}.", "", *table, "",
        f"Engine capacity (median of the runs per share): {bracket}. "
        + ("**The simulated capacity is within 10% of the engine's.**" if within else
           "The runs do not confirm the simulated capacity within 10%."), "",
        "Each run's steps, measured against the model's price for the same shapes (1.00: "
        "priced exactly; below 1, the engine ran faster than the model says): "
        + "; ".join(speeds) + ".",
    ]
    publish("capacity_check", "\n".join(lines), write_docs=write_docs, docs=DOCS, title=TITLE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("calibrate", "plan", "run", "report"),
                        required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--step-logs", type=Path, nargs="+", default=[],
                        help="plan: fit on these engine step logs (default: this check's "
                             "calibration runs, else every saved one)")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.9, 1.1])
    parser.add_argument("--runs", type=int, default=3,
                        help="run: runs per share; calibrate: calibration runs")
    parser.add_argument("--rate", type=float, default=0.45,
                        help="calibrate: the calibration runs' rate, req/s")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if args.max_num_batched_tokens < 1 or args.runs < 1 or min(args.shares) <= 0:
        parser.error("--max-num-batched-tokens and --runs must be >= 1, shares > 0")
    if args.rate <= 0:
        parser.error("--rate must be > 0")
    HERE.mkdir(parents=True, exist_ok=True)
    if args.phase == "calibrate":
        phase_calibrate(args.max_num_batched_tokens, args.rate, args.runs)
    elif args.phase == "plan":
        phase_plan(args.max_num_batched_tokens, step_logs(args.step_logs))
    elif args.phase == "run":
        phase_run(args.shares, args.runs)
    else:
        phase_report(args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
