#!/usr/bin/env python
"""Fidelity study: the simulator's predictions against the real engine on this machine.

1. Calibrate: ``kvserve calibrate``'s grid of step shapes, measured on the engine's runner,
   fitted to the calibrated cost model (or ``--calibration FILE`` from an earlier run).
2. Capacity: the simulator's binary search (``kvserve plan``'s) for the largest W3 arrival
   rate whose p99 queueing delay stays within ``--queue-p99-bound``.
3. Each workload runs on the real engine (``run_trace``: arrivals on the wall clock, the
   dtype ``--dtype auto`` picks on this CPU (bf16 with AMX or AVX512-BF16, float32
   elsewhere), greedy, block 16) and in the simulator with the same scheduler and cache
   configuration, once with the calibrated model and once with the uncalibrated
   ``cpu-local`` roofline.
   Both sides are measured by the same code (kvserve.sim.report.aggregate).
4. The engine runs each workload ``--runs`` times (default 3, a fresh engine each): its
   figure is the median with the min-max band, and a simulated figure is met when it lies
   in the band or within the target (3% for throughput and p50s, 8% for p99s) of the median.

Workloads (../shared/WORKLOADS.md): W1 (128 requests at once, 1 GiB KV cache), W2 (W1 with
4,096 KV tokens and max_num_seqs 64), W3 (200 requests, Poisson 4 req/s) and W3's requests
at 50%, 85% and 100% of the simulated capacity (the last confirms the capacity on the
engine).

    python benchmarks/fidelity.py [--workloads w1 w2 w3 w3-50 w3-85 w3-100] [--runs 3]
                                  [--layout-term] [--load-requests N] [--calibration FILE]
                                  [--write-docs]

W3 near capacity is studied against the engine's spread by benchmarks/fidelity_band.py
(the 200-request shares here are kept as options; the default is W1, W2 and W3).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# A dedicated run, as in offline_throughput.py: spinning OpenMP threads are faster when
# nothing else wants the cores. Calibration and engine runs share the setting.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import torch

from docs_section import write_section
from kvserve.core import CacheConfig, SchedulerConfig
from kvserve.engine import calibrate
from kvserve.engine.engine import Engine
from kvserve.engine.llm import build_engine
from kvserve.engine.trace_runner import run_trace
from kvserve.model.dtype import auto_dtype_name
from kvserve.sim.cost_models import CalibratedCostModel, CostModel, RooflineCostModel
from kvserve.sim.machine import cpu_identity, describe_cpu, local_hardware
from kvserve.sim.plan import capacity_qps
from kvserve.sim.presets import get_model
from kvserve.sim.report import aggregate, request_latencies
from kvserve.sim.simulator import SimResult, Simulator
from kvserve.sim.svg import line_chart
from kvserve.sim.trace import TraceRequest
from shared_workloads import w1_trace, w3_trace

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "fidelity"
DOCS = ROOT / "docs" / "fidelity.md"
PLOTS = ROOT / "docs" / "img"
TITLE = "# Simulator fidelity"
QUEUE_P99_BOUND = 2.0  # s: W3's capacity is the largest rate whose p99 queueing stays within
# What ``--dtype auto`` runs the bundled (quantized) model in on this CPU: bf16 where the CPU
# computes it natively, float32 elsewhere (torch's emulated bf16 matmul on an AVX2-only CPU
# is a hundred times slower than its float32).
DTYPE = auto_dtype_name()
PRECISION = {"bfloat16": "bf16", "float32": "fp32"}[DTYPE]  # the roofline's name for it
BLOCK_SIZE = 16
W1_SETTINGS: dict[str, Any] = {"max_num_seqs": 256, "max_num_batched_tokens": 2048}
W2_SETTINGS: dict[str, Any] = {"max_num_seqs": 64, "max_num_batched_tokens": 2048,
                               "num_kv_blocks": 4096 // BLOCK_SIZE}
LOADS = {"w3-50": 0.50, "w3-85": 0.85, "w3-100": 1.0}
# (report key, label, kind): "rel" -> relative error; "count" -> simulated - engine.
METRICS = (("duration_s", "duration s", "rel"),
           ("throughput_output_tok_s", "output tok/s", "rel"),
           ("ttft_p50", "TTFT p50 s", "rel"), ("ttft_p99", "TTFT p99 s", "rel"),
           ("itl_p50", "ITL p50 s", "rel"), ("itl_p99", "ITL p99 s", "rel"),
           ("e2e_p50", "E2E p50 s", "rel"), ("e2e_p99", "E2E p99 s", "rel"),
           ("queue_p99", "queue p99 s", "rel"),
           ("num_preemptions", "preemptions", "count"),
           ("recomputed_tokens", "recomputed tokens", "count"),
           ("num_steps", "steps", "count"))
TARGETS = {"throughput_output_tok_s": 0.03, "ttft_p50": 0.03, "itl_p50": 0.03,
           "e2e_p50": 0.03, "ttft_p99": 0.08, "itl_p99": 0.08, "e2e_p99": 0.08}


def new_engine(settings: dict[str, Any]) -> Engine:
    return build_engine(None, dtype=DTYPE, block_size=BLOCK_SIZE, detokenize=False,
                        **settings)


def run_calibration(progress: bool, layout_term: bool) -> CalibratedCostModel:
    engine = new_engine(W1_SETTINGS)
    runner: Any = engine.executor
    shapes = calibrate.grid(block_size=BLOCK_SIZE, layout_twins=layout_term)
    start = time.perf_counter()
    model, seconds = calibrate.calibrate(runner, engine.scheduler.cache_config.num_blocks,
                                         shapes, warmup=2, repeats=5, progress=progress)
    meta = {**calibrate.model_meta(runner.model.config), "dtype": DTYPE, "block_size": BLOCK_SIZE,
            "num_samples": len(shapes), "seconds": round(time.perf_counter() - start, 1)}
    (OUT / "cost-model.json").write_text(calibrate.to_json(model, shapes, seconds, meta))
    calibrate.plot(PLOTS / "fidelity-calibration.svg", shapes, seconds, model)
    return model


Configs = tuple[SchedulerConfig, CacheConfig]
_CONFIGS: dict[str, Configs] = {}


def engine_configs(settings: dict[str, Any]) -> Configs:
    """The scheduler and cache configuration the engine builds for ``settings`` (built
    once per distinct settings, so simulations do not load the model again)."""
    key = json.dumps(settings, sort_keys=True)
    if key not in _CONFIGS:
        scheduler = new_engine(settings).scheduler
        _CONFIGS[key] = (scheduler.config, scheduler.cache_config)
    return _CONFIGS[key]


def simulate_result(configs: Configs, trace: Sequence[TraceRequest], cost_model: CostModel
                    ) -> SimResult:
    return Simulator(*configs, cost_model).run(trace)


def simulate(configs: Configs, trace: Sequence[TraceRequest], cost_model: CostModel
             ) -> dict[str, Any]:
    return aggregate(simulate_result(configs, trace, cost_model))


def ttft_plot(path: Path, title: str, results: dict[str, SimResult]) -> None:
    """Each request's TTFT, sorted (an inverse CDF), for the engine and the simulators."""
    series = []
    for label, result in results.items():
        ttfts = sorted(lat["ttft"] for lat in map(request_latencies, result.records)
                       if lat["ttft"] is not None)
        series.append((label, [100 * (i + 1) / len(ttfts) for i in range(len(ttfts))], ttfts))
    path.write_text(line_chart(title, series, "requests (%)", "TTFT (s)", width=720,
                               height=300), encoding="utf-8")


def find_capacity(model: CalibratedCostModel, bound: float) -> tuple[float, list[dict]]:
    configs = engine_configs(W1_SETTINGS)

    def queue_p99(qps: float) -> float | None:
        return simulate(configs, w3_trace(rate=qps), model)["queue_p99"]

    qps, probes = capacity_qps(queue_p99, 1.0, bound, rel_tol=0.01)
    if qps is None:
        raise SystemExit(f"no W3 rate keeps p99 queueing within {bound} s in the simulator")
    return qps, probes


def workload(name: str, capacity: Callable[[], float], load_requests: int
             ) -> tuple[list[TraceRequest], dict[str, Any], str]:
    """(trace, engine settings, description)."""
    if name == "w1":
        return w1_trace(), W1_SETTINGS, "128 requests at t=0, KV cache 1 GiB"
    if name == "w2":
        return w1_trace(), W2_SETTINGS, "W1 in 4,096 KV tokens, max_num_seqs 64"
    if name == "w3":
        return w3_trace(), W1_SETTINGS, "200 requests, Poisson 4 req/s"
    share, full = LOADS[name], capacity()
    return (w3_trace(load_requests, rate=share * full), W1_SETTINGS,
            f"W3's first {load_requests} requests at {share * full:.2f} req/s, {share:.0%} of "
            f"the simulated capacity ({full:.2f} req/s: the largest rate whose p99 queueing "
            f"delay stays within {QUEUE_P99_BOUND:g} s)")


def compare(name: str, description: str, trace: Sequence[TraceRequest],
            settings: dict[str, Any], calibrated: CostModel, runs: int) -> dict[str, Any]:
    """``runs`` engine runs (a fresh engine each; run i's steps in ``{name}-run{i}-steps``)
    against one simulation per cost model (the simulator is deterministic)."""
    engine_runs: list[tuple[float, SimResult]] = []
    for index in range(runs):
        engine = new_engine(settings)
        with (OUT / f"{name}-run{index}-steps.jsonl").open("w") as log:
            start = time.perf_counter()
            run = run_trace(engine, trace, log=log, greedy=True)
            engine_runs.append((time.perf_counter() - start, run.result))
        print(f"{name} run {index + 1}/{runs}: {engine_runs[-1][0]:.1f} s", flush=True)
    roofline = RooflineCostModel(get_model("smollm2-135m"), local_hardware(), PRECISION)
    configs = (engine.scheduler.config, engine.scheduler.cache_config)
    results = {"calibrated sim": simulate_result(configs, trace, calibrated),
               "roofline sim": simulate_result(configs, trace, roofline)}
    walls = [wall for wall, _ in engine_runs]
    median_run = sorted(range(runs), key=walls.__getitem__)[runs // 2]
    # fidelity_steps.py and fidelity_in_service.py read one run: the run of median wall time
    shutil.copyfile(OUT / f"{name}-run{median_run}-steps.jsonl", OUT / f"{name}-steps.jsonl")
    row = {"name": name, "description": description, "wall_s": walls,
           "load_1min": os.getloadavg()[0],
           "engine": aggregate(engine_runs[median_run][1]),
           "engine_runs": [aggregate(result) for _, result in engine_runs],
           "calibrated": aggregate(results["calibrated sim"]),
           "roofline": aggregate(results["roofline sim"])}
    (OUT / f"{name}.json").write_text(json.dumps(row, indent=1) + "\n")
    ttft_plot(PLOTS / f"fidelity-{name}-ttft.svg", f"{name.upper()}: TTFT per request, sorted",
              {"engine (the run of median wall time)": engine_runs[median_run][1], **results})
    return row


def judge(simulated: float | None, values: list[float], tolerance: float) -> tuple[str, bool]:
    """(error against the engine's median, met): the simulated figure lies in the engine's
    [min, max] over its runs, or within ``tolerance`` of their median."""
    median = statistics.median(values)
    if simulated is None or not median:
        return "—", False
    error = simulated / median - 1
    met = min(values) <= simulated <= max(values) or abs(error) <= tolerance
    return f"{100 * error:+.1f}%", met


def error(kind: str, engine: float | None, simulated: float | None) -> str:
    if engine is None or simulated is None:
        return "—"
    if kind == "count":
        return f"{simulated - engine:+.0f}"
    if engine == 0:
        return "—" if simulated == 0 else "∞"
    return f"{100 * (simulated - engine) / engine:+.1f}%"


def value(v: float | None) -> str:
    if v is None:
        return "—"
    if isinstance(v, int) or float(v).is_integer():
        return f"{v:,.0f}"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"


def band(values: list[float]) -> str:
    if len(values) == 1:
        return value(values[0])
    return f"{value(statistics.median(values))} [{value(min(values))} - {value(max(values))}]"


def table(row: dict[str, Any]) -> list[str]:
    runs = row["engine_runs"]
    lines = [f"### {row['name'].upper()}: {row['description']}", "",
             f"| figure | engine median [min - max] of {len(runs)} | calibrated sim | error | "
             "target | met | roofline sim (cpu-local) | error |",
             "|---|---|---|---|---|---|---|---|"]
    plot = f"img/fidelity-{row['name']}-ttft.svg"
    for key, label, kind in METRICS:
        values = [run[key] for run in runs]
        c, r = row["calibrated"][key], row["roofline"][key]
        if None in values:
            lines.append(f"| {label} | — | {value(c)} | — |  |  | {value(r)} | — |")
            continue
        median = statistics.median(values)
        target, met = "", ""
        if key in TARGETS:
            target = f"±{100 * TARGETS[key]:.0f}%"
            met = "**yes**" if judge(c, values, TARGETS[key])[1] else "no"
        elif key == "num_preemptions" and row["name"] == "w2":
            target, met = "equal", "**yes**" if set(values) == {c} else "no"
        lines.append(f"| {label} | {band(values)} | {value(c)} | {error(kind, median, c)} | "
                     f"{target} | {met} | {value(r)} | {error(kind, median, r)} |")
    return [*lines, "", f"![{row['name'].upper()} TTFT: engine (its run of median wall time) "
            f"and simulators]({plot})", ""]


def setup_markdown(model: CalibratedCostModel, command: str, loaded: Path | None = None
                   ) -> str:
    """The calibration every table below was simulated with (``loaded``: the file it came
    from, fitted by an earlier run on this machine)."""
    uname = platform.uname()
    origin = f"the grid calibration in `{loaded}`, used by " if loaded else ""
    lines = ["## Calibration", "",
             f"{origin}`{command}` at {now()} on {describe_cpu(cpu_identity())}, "
             f"{uname.machine} ({os.cpu_count()} cores, "
             f"{uname.system} {uname.release}), Python {platform.python_version()}, torch "
             f"{torch.__version__} with {torch.get_num_threads()} threads; SmolLM2-135M-Instruct "
             f"in {DTYPE}, block size {BLOCK_SIZE}. Coefficients "
             + (f"({loaded}, {model.source}):" if loaded else
                f"(out/fidelity/cost-model.json, {model.source}; measured against fitted step "
                "times in [img/fidelity-calibration.svg](img/fidelity-calibration.svg)):"),
             ""]
    lines += [f"- `{term}` = {v:.4g} s" for term, v in model.coefficients.items()]
    lines.append(f"- `min_tokens` = {model.min_tokens} (a step of fewer tokens costs as much)")
    return "\n".join(lines)


def workload_markdown(row: dict[str, Any], command: str) -> str:
    walls = ", ".join(f"{wall:.0f}" for wall in row["wall_s"])
    return "\n".join([*table(row), f"`{command}` at {now()}, {describe_cpu(cpu_identity())}; "
                      f"the engine ran for {walls} s; error = simulated / engine median - 1; "
                      "met = inside the engine's band or within the target of its median."])


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["w1", "w2", "w3"],
                        choices=["w1", "w2", "w3", *LOADS])
    parser.add_argument("--load-requests", type=int, default=200, metavar="N",
                        help="requests in the W3 runs at a share of capacity (<= 200)")
    parser.add_argument("--calibration", type=Path,
                        help="a cost model from kvserve calibrate (default: calibrate now)")
    parser.add_argument("--runs", type=int, default=3,
                        help="engine runs per workload (their median and min-max band)")
    parser.add_argument("--layout-term", action="store_true",
                        help="calibrate on both block layouts and fit the layout term")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    PLOTS.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if args.calibration:
        model = CalibratedCostModel.load(args.calibration)
    else:
        print("calibrating ...", flush=True)
        model = run_calibration(sys.stderr.isatty(), args.layout_term)
    print(f"cost model: {model.source}", flush=True)
    command = ("python benchmarks/fidelity.py " + " ".join(sys.argv[1:])).strip()
    if args.write_docs:
        write_section("fidelity_calibration", setup_markdown(model, command, args.calibration),
                      DOCS, TITLE)
    capacity: tuple[float, list[dict]] | None = None

    def capacity_rate() -> float:
        nonlocal capacity
        if capacity is None:
            capacity = find_capacity(model, QUEUE_P99_BOUND)
            (OUT / "capacity.json").write_text(json.dumps(
                {"qps": capacity[0], "queue_p99_bound_s": QUEUE_P99_BOUND,
                 "probes": capacity[1]}, indent=1) + "\n")
            print(f"simulated W3 capacity: {capacity[0]:.3f} req/s", flush=True)
        return capacity[0]

    for name in args.workloads:
        trace, settings, description = workload(name, capacity_rate, args.load_requests)
        row = compare(name, description, trace, settings, model, args.runs)
        body = workload_markdown(row, command)
        print(body, flush=True)
        if args.write_docs:  # one section per workload, so one can be rerun alone
            write_section(f"fidelity_{name}", body, DOCS, TITLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
