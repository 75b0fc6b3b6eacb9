#!/usr/bin/env python
"""W3 online against `kvserve serve` at several values of one serve flag, alternated: what a
knob costs, measured on this machine (`kvserve whatif` predicts it from a recording).

One server per value, all started before the first run and idle while another runs (prefix
caching off, so nothing carries over), each with benchmarks/online_ab.py's settings (its
``--dtype``, 2 GiB of KV cache, max model length 1024) plus ``--FLAG VALUE``. Each round runs
every value once through ../shared/bench/load_client.py, the order rotated one place per round
so that no value always runs first. Per value: each figure's best and median; per run, the
machine's conditions (benchmarks/ab_protocol.py). With --write-docs the table for this CPU and
flag in docs/benchmarks.md is replaced. Each server holds its KV cache, so at most
MAX_VALUES values run in one sitting.

With --whatif the first value's server records its first run (POST /admin/record/start and
stop, docs/recording.md), and `kvserve whatif` prices the other values on that recording; its
prediction goes in the section beside the runs. Takes a flag whatif can change (a scheduler
or cache setting; its name with underscores).

    flock /tmp/kvserve-bench.lock python benchmarks/online_knob.py --whatif \\
        --flag max-num-batched-tokens --values 2048,1024,512 --rounds 3 --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import ab_protocol as ab
from docs_section import publish
from online_ab import FIGURES, OUT, ROOT, Server, prepare, w3_cells

MAX_VALUES = 4


def run_order(values: Sequence[str], round_index: int) -> list[str]:
    """The values in the order round ``round_index`` (from 0) runs them: rotated one place a
    round, so each value leads a round in turn."""
    shift = round_index % len(values)
    return [*values[shift:], *values[:shift]]


def median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def value_rows(values: Sequence[str], runs: dict[str, list[dict]]) -> list[str]:
    """Markdown rows: per value, each figure's best and median (best: the highest rate, the
    lowest time)."""
    lines = ["| value | " + " | ".join(f"{f.label} best / median" for f in FIGURES) + " |",
             "|---|" + "---|" * len(FIGURES)]
    for value in values:
        cells = []
        for figure in FIGURES:
            series = [run[figure.key] for run in runs[value]]
            best = max(series) if figure.higher_is_better else min(series)
            cells.append(f"{figure.fmt.format(best)} / "
                         f"{figure.fmt.format(median(runs[value], figure.key))}")
        lines.append(f"| {value} | " + " | ".join(cells) + " |")
    return lines


# each figure of a run (FIGURES' keys) in whatif's report: its aggregate key, and the scale
# to the run's unit
WHATIF_KEYS = {"output_tok_s": ("throughput_output_tok_s", 1.0), "wall_s": ("duration_s", 1.0),
               "ttft_p50_s": ("ttft_p50", 1.0), "ttft_p99_s": ("ttft_p99", 1.0),
               "itl_p50_ms": ("itl_p50", 1000.0), "itl_p99_ms": ("itl_p99", 1000.0)}


def predicted_figure(aggregate: dict, figure: ab.Figure) -> float:
    """``figure`` (one of FIGURES) read from a whatif run's aggregate, in the runs' unit."""
    key, scale = WHATIF_KEYS[figure.key]
    return aggregate[key] * scale


def whatif_rows(report: dict) -> list[str]:
    """Markdown rows of `kvserve whatif --report`'s runs: the recorded one, the calibrated
    model's reading of it, and each change, with the share of its step time in shapes the
    recording lacks (docs/fidelity.md, "Shapes the recording lacks")."""
    lines = ["| run | " + " | ".join(f.label for f in FIGURES) + " | unrecorded shapes |",
             "|---|" + "---|" * (len(FIGURES) + 1)]
    for run in report["runs"]:
        cells = [f.fmt.format(predicted_figure(run["aggregate"], f)) for f in FIGURES]
        share = run["aggregate"].get("off_record_share")
        cells.append("-" if share is None else f"{share:.0%}")
        lines.append(f"| {run['label']} | " + " | ".join(cells) + " |")
    return lines


def change_rows(values: Sequence[str], runs: dict[str, list[dict]], report: dict) -> list[str]:
    """Markdown rows: each other value's change from the first, as whatif predicted it (the
    change's figure over its reading of the recorded settings, "recorded (calibrated model)")
    and as the engine made it (the value's median over the first value's median)."""
    predicted = {run["label"]: run["aggregate"] for run in report["runs"]}
    base = predicted["recorded (calibrated model)"]
    lines = [f"| change from {values[0]} | " + " | ".join(f.label for f in FIGURES) + " |",
             "|---|" + "---|" * len(FIGURES)]
    for value in values[1:]:
        change = next((aggregate for label, aggregate in predicted.items()
                       if label.endswith(f"={value}")), None)
        if change is None:
            continue
        whatif_cells = [f"{predicted_figure(change, f) / predicted_figure(base, f):.2f}x"
                        for f in FIGURES]
        engine_cells = [f"{median(runs[value], f.key) / median(runs[values[0]], f.key):.2f}x"
                        for f in FIGURES]
        lines.append(f"| {value}, whatif | " + " | ".join(whatif_cells) + " |")
        lines.append(f"| {value}, the engine | " + " | ".join(engine_cells) + " |")
    return lines


def post(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def recorded_run(server: Server, directory: Path, round_number: int, requests: int) -> dict:
    """``server.run`` with the server recording it into ``directory`` (replaced)."""
    shutil.rmtree(directory, ignore_errors=True)
    post(f"{server.url}/admin/record/start", {"dir": str(directory)})
    try:
        return server.run(round_number, requests)
    finally:
        post(f"{server.url}/admin/record/stop")


def whatif(directory: Path, setting: str, values: Sequence[str]) -> dict | str:
    """`kvserve whatif`'s report on ``directory`` with ``setting`` at each of ``values``, or
    its error's last line."""
    report = OUT / "online_knob_whatif.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvserve", "whatif", str(directory), "--set",
         f"{setting}={','.join(values)}", "--report", str(report)],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit status {done.returncode}"
    return json.loads(report.read_text())


def run_row(round_number: int, value: str, r: dict, conditions: ab.Conditions) -> str:
    return f"| {round_number} | {value} | {w3_cells(r)} | {conditions} |"


def section(args: argparse.Namespace, model: str, flags: str, runs: dict[str, list[dict]],
            rows: list[str], rounds_done: int, predicted: dict | str | None = None) -> str:
    command = ab.kernel_env() + "python benchmarks/online_knob.py " + " ".join(sys.argv[1:])
    done = "" if rounds_done == args.rounds else f" (cut short: {rounds_done} rounds done)"
    return "\n".join([
        f"### W3 online at each `--{args.flag}` on {ab.cpu_title(model, flags)}{done}", "",
        f"`flock /tmp/kvserve-bench.lock {command.strip()}` on "
        f"{ab.machine_line(model, flags, None)}. The first {args.requests} requests of W3 "
        "through ../shared/bench/load_client.py against one `kvserve serve` per value, "
        "alternated (the order rotated each round); each "
        f"{args.dtype}, 2 GiB KV, prefix caching off, max model length 1024, defaults "
        "otherwise. Each run's load average before it, steal time during it and a 1024^3 "
        "bf16 matmul's rate just before it are in the rows.", "",
        *value_rows(args.values, runs), "",
        "| round | value | output tok/s | wall s | TTFT p50 / p99 s | ITL p50 / p99 ms | "
        "completed / failed | load / steal / bf16 GFLOP/s |",
        "|---|---|---|---|---|---|---|---|", *rows, *whatif_part(args, runs, predicted)])


def whatif_part(args: argparse.Namespace, runs: dict[str, list[dict]],
                predicted: dict | str | None) -> list[str]:
    """The section's lines on whatif's prediction (none without --whatif)."""
    if predicted is None:
        return []
    head = (f"`kvserve whatif` on the recording of round 1's run at {args.flag} "
            f"{args.values[0]} (the server's own timing of it, the warm-up request included), "
            "each other value priced by the cost model fitted on its steps:")
    if isinstance(predicted, str):
        return ["", f"{head} it failed: {predicted}"]
    return ["", head, "", *whatif_rows(predicted), "",
            "Each change as whatif predicted it (over its own reading of the recorded settings, "
            "the row above) and as the engine made it (medians over medians):", "",
            *change_rows(args.values, runs, predicted)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flag", required=True,
                        help="a kvserve serve flag without its dashes, e.g. max-num-seqs")
    parser.add_argument("--values", required=True, type=lambda text: text.split(","),
                        help=f"its values, comma-separated (2 to {MAX_VALUES})")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200, help="first N of W3 (smoke: 20)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="auto: bfloat16 where the CPU computes it natively, else float32")
    parser.add_argument("--whatif", action="store_true",
                        help="record the first value's first run and let kvserve whatif "
                             "predict the others from it")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("serve_flags", nargs="*", help="more kvserve serve flags (after --)")
    args = parser.parse_args()
    args.flag = args.flag.lstrip("-")
    if not 2 <= len(args.values) <= MAX_VALUES or len(set(args.values)) != len(args.values) \
            or "" in args.values:
        print(f"--values: 2 to {MAX_VALUES} distinct values, comma-separated", file=sys.stderr)
        return 2
    if args.rounds < 1 or not 1 <= args.requests <= 200:
        print("--rounds must be >= 1 and --requests in [1, 200]", file=sys.stderr)
        return 2
    machine = prepare(args)  # the load client runs on the vLLM venv's Python (aiohttp)
    if machine is None:
        return 2
    model, flags = machine
    servers = {value: Server(f"knob_{args.flag}_{value}",
                             [*args.serve_flags, f"--{args.flag}", value], args.dtype)
               for value in args.values}
    runs: dict[str, list[dict]] = {value: [] for value in args.values}
    rows: list[str] = []
    recording = OUT / f"online_knob_{args.flag}_{args.values[0]}.rec"
    predicted: dict | str | None = None

    def run_once(value: str, index: int) -> dict:
        if args.whatif and index == 0 and value == args.values[0]:
            return recorded_run(servers[value], recording, 1, args.requests)
        return servers[value].run(index + 1, args.requests)

    try:
        for server in servers.values():
            server.wait()
        for index in range(args.rounds):
            for value in run_order(args.values, index):
                result, conditions = ab.measured(
                    lambda value=value, index=index: run_once(value, index))
                runs[value].append(result)
                rows.append(run_row(index + 1, value, result, conditions))
                print(rows[-1], flush=True)
            if args.whatif and predicted is None:
                predicted = whatif(recording, args.flag.replace("-", "_"), args.values[1:])
            publish(f"online_knob:{ab.cpu_slug(model, flags)}:{args.flag}",
                    section(args, model, flags, runs, rows, index + 1, predicted),
                    write_docs=args.write_docs)
    finally:
        for server in servers.values():
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
