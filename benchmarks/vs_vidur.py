#!/usr/bin/env python
"""kvserve's simulator beside Vidur (issue 15, item 2): the same 10,000 requests, the
closest deployment both model, timed in alternated pairs, with both predictions.

Vidur 0.0.26 (PyPI) is never a kvserve dependency: it runs from a scratch virtualenv,
offline, with the profiling data of the kit in shared/bench/vidur (its README says how to
build the venv and the data; this script expects both done):

    python3 -m venv $PEERS/venvs/vidur && $PEERS/venvs/vidur/bin/pip install vidur==0.0.26
    $PEERS/venvs/vidur/bin/python $KIT/build_dataset.py

The deployment: Llama-3-8B (kvserve: llama-3.1-8b, the same shapes) on one A100-80GB, bf16,
no prefix caching, 16-token blocks and the same KV pool (26,554 blocks), at most 128 running
requests and 2,048 tokens a step with chunked prefill (Vidur's sarathi scheduler, kvserve's
vLLM-V1 scheduler), max_model_len 8,192. The trace: 10,000 requests, Poisson arrivals at 7
req/s, lognormal prompts (mean 1,000, sigma 0.8) and outputs (mean 250, sigma 0.8); each
request generates exactly its output length in both (ignore_eos, max_tokens). Both sides'
figures come from the per-request records with the same formulas (``summarise``).

    python benchmarks/vs_vidur.py [--pairs 3] [--write-docs] [--json PATH]

The first Vidur run on a fresh cache trains its random forests; run once before timing
(``--warm``). Run under the bench lock; the load average is recorded.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ab_protocol import shared_bench
from docs_section import publish
from sched_ab import ROOT, cpu_description

NUM_BLOCKS = 26_554
KVSERVE_FLAGS = [
    "--model", "llama-3.1-8b", "--hardware", "a100-80gb", "--dtype", "bfloat16",
    "--cost-model", "roofline", "--max-num-seqs", "128", "--max-num-batched-tokens", "2048",
    "--max-model-len", "8192", "--block-size", "16", "--no-enable-prefix-caching",
    "--num-kv-blocks", str(NUM_BLOCKS),
]
WORKLOAD = [
    "-n", "10000", "--rate", "7", "--arrival", "poisson",
    "--prompt-len", "lognormal:mean=1000,sigma=0.8,min=16,max=6000",
    "--output-len", "lognormal:mean=250,sigma=0.8,min=1,max=2000", "--seed", "1",
]
FIGURES = ("sim_duration_s", "out_tok_s", "req_s", "ttft_p50", "ttft_p99", "tpot_p50",
           "tpot_p99", "e2e_p50", "e2e_p99", "queue_p50", "queue_p99", "preemptions")


def kvserve_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def make_workload(work: Path) -> tuple[Path, Path]:
    """The trace as kvserve JSONL (every request exactly its output length) and as Vidur's
    trace_replay CSV (Date, Time, PromptTokenCount, CompletionTokenCount)."""
    work.mkdir(parents=True, exist_ok=True)
    generated, jsonl, table = work / "gen.jsonl", work / "workload.jsonl", work / "workload.csv"
    subprocess.run([sys.executable, "-m", "kvserve", "workload", "gen", *WORKLOAD,
                    "-o", str(generated)], check=True, env=kvserve_env(),
                   capture_output=True)
    with generated.open() as src, jsonl.open("w") as out, table.open("w", newline="") as csv_out:
        writer = csv.writer(csv_out)
        writer.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for line in src:
            request = json.loads(line)
            request["max_tokens"], request["ignore_eos"] = request["output_len"], True
            out.write(json.dumps(request) + "\n")
            writer.writerow(["2023-08-21", repr(float(request["arrival_time"])),
                             int(request["prompt_len"]), int(request["output_len"])])
    return jsonl, table


def timed(command: list[str], env: dict[str, str], stderr_path: Path) -> dict[str, float]:
    """Run ``command``; its wall seconds, CPU seconds (user + system) and peak RSS (MB)."""
    start = time.perf_counter()
    with stderr_path.open("w") as err:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{command[0]} failed; see {stderr_path}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024}


def run_vidur(kit: Path, peers: Path, table: Path, out: Path) -> dict[str, Any]:
    env = {**os.environ, "PEERS_DIR": str(peers), "NUM_BLOCKS": str(NUM_BLOCKS),
           "ENTRY": str(kit / "vidur_timed.py")}
    err = out.with_suffix(".err")
    figures: dict[str, Any] = timed([str(kit / "run_vidur.sh"), str(table), str(out), "sarathi"],
                                    env, err)
    for line in err.read_text().splitlines():
        if line.startswith("VIDUR_PHASES "):
            figures["phases"] = json.loads(line.split(" ", 1)[1])
    return figures


def run_kvserve(jsonl: Path, report: Path) -> dict[str, Any]:
    return timed([sys.executable, "-m", "kvserve", "simulate", "--trace", str(jsonl),
                  *KVSERVE_FLAGS, "--quiet", "--report", str(report)], kvserve_env(),
                 report.with_suffix(".err"))


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarise(rows: list[tuple[float, float, float, float, int, int]],
              preemptions: int) -> dict[str, float]:
    """rows: (arrival, ttft, e2e, queue, prompt tokens, output tokens), seconds. Duration:
    first arrival to last finish; TPOT: (e2e - ttft) / (output - 1)."""
    first = min(r[0] for r in rows)
    duration = max(r[0] + r[2] for r in rows) - first
    out: dict[str, float] = {
        "sim_duration_s": round(duration, 1),
        "out_tok_s": round(sum(r[5] for r in rows) / duration, 1),
        "req_s": round(len(rows) / duration, 3), "preemptions": preemptions}
    series = {"ttft": [r[1] for r in rows], "e2e": [r[2] for r in rows],
              "queue": [r[3] for r in rows],
              "tpot": [(r[2] - r[1]) / (r[5] - 1) for r in rows if r[5] > 1]}
    for name, values in series.items():
        for q in (50, 99):
            out[f"{name}_p{q}"] = round(percentile(values, q), 4)
    return out


def kvserve_figures(report_path: Path) -> dict[str, float]:
    report = json.loads(report_path.read_text())
    rows = [(r["arrival_time"], r["ttft_s"], r["e2e_s"], r["queue_s"], r["prompt_tokens"],
             r["output_tokens"]) for r in report["requests"]]
    return summarise(rows, report["aggregate"]["num_preemptions"])


def vidur_figures(out: Path, table: Path) -> dict[str, float]:
    run_dir = Path(sorted(glob.glob(f"{out}/*/request_metrics.csv"))[-1]).parent
    with table.open() as f:
        trace = list(csv.DictReader(f))
    rows, restarts = [], 0
    with (run_dir / "request_metrics.csv").open() as f:
        for r in csv.DictReader(f):
            t = trace[int(r["Request Id"])]
            rows.append((float(t["Time"]), float(r["prefill_e2e_time"]),
                         float(r["request_e2e_time"]), float(r["request_scheduling_delay"]),
                         int(t["PromptTokenCount"]), int(t["CompletionTokenCount"])))
            restarts += int(float(r["request_num_restarts"]))
    return summarise(rows, restarts)


def step_costs(kit: Path, peers: Path) -> str:
    """The kit's compare_steps.py: identical batch shapes priced by both (ms per step)."""
    env = {**kvserve_env(), "PEERS_DIR": str(peers)}
    return subprocess.run([sys.executable, str(kit / "compare_steps.py")], check=True,
                          capture_output=True, text=True, env=env).stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--kit", type=Path, help="shared/bench/vidur (default: beside the "
                                                  "checkout, or $KVSERVE_SHARED_BENCH/vidur)")
    parser.add_argument("--peers-dir", type=Path,
                        default=Path(os.environ.get("TMPDIR", "/tmp")) / "peers")
    parser.add_argument("--warm", action="store_true",
                        help="one untimed Vidur run first (trains its predictors)")
    parser.add_argument("--section", default="vs_vidur")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    kit, peers = args.kit or shared_bench() / "vidur", args.peers_dir
    if not (kit / "run_vidur.sh").exists():
        raise SystemExit(f"no Vidur kit at {kit}: give --kit or $KVSERVE_SHARED_BENCH")
    if not (peers / "venvs" / "vidur" / "bin" / "python").exists():
        raise SystemExit(f"no Vidur venv at {peers}/venvs/vidur: see this script's docstring")
    work = peers / "vs_vidur"
    jsonl, table = make_workload(work)
    if args.warm:
        run_vidur(kit, peers, table, work / "warm")
    load_before = os.getloadavg()[0]
    pairs = []
    for pair in range(args.pairs):
        got: dict[str, dict[str, Any]] = {}
        for side in (("vidur", "kvserve") if pair % 2 == 0 else ("kvserve", "vidur")):
            if side == "vidur":
                out = work / f"vidur_{pair}"
                got["vidur"] = run_vidur(kit, peers, table, out)
                got["vidur"]["figures"] = vidur_figures(out, table)
            else:
                report = work / f"kvserve_{pair}.json"
                got["kvserve"] = run_kvserve(jsonl, report)
                got["kvserve"]["figures"] = kvserve_figures(report)
        pairs.append(got)
        print(json.dumps({"pair": pair, **{k: {m: v for m, v in got[k].items()
                                                if m != "figures"} for k in got}}),
              flush=True)
    load_after = os.getloadavg()[0]
    for side in ("vidur", "kvserve"):  # both simulators are deterministic
        if any(p[side]["figures"] != pairs[0][side]["figures"] for p in pairs):
            raise SystemExit(f"{side}'s predictions differ from run to run")
    lines = [
        "### kvserve's simulator beside Vidur 0.0.26 on the same trace",
        "",
        f"`python benchmarks/vs_vidur.py --pairs {args.pairs}` on {cpu_description()}, "
        f"Python {platform.python_version()} (kvserve), Vidur in its own venv; load average "
        f"{load_before:.1f} before, {load_after:.1f} after. 10,000 requests at 7 req/s "
        "(lognormal prompts ~1,000 and outputs ~250 tokens), Llama-3-8B on one A100-80GB, "
        "bf16, 128 seats, 2,048-token chunks (Vidur: sarathi), 26,554 KV blocks of 16, no "
        "prefix caching. The order alternates from pair to pair; each run is a fresh process "
        "(Vidur's predictors come from its cache, trained by an earlier run).",
        "",
        "| pair | Vidur wall s (CPU s, event loop s) | Vidur RSS MB | kvserve wall s (CPU s) "
        "| kvserve RSS MB | Vidur / kvserve, wall (CPU) |",
        "|---|---|---|---|---|---|",
    ]
    for index, p in enumerate(pairs):
        v, k = p["vidur"], p["kvserve"]
        loop = v.get("phases", {}).get("loop_s", float("nan"))
        lines.append(f"| {index} | {v['wall']:.1f} ({v['cpu']:.1f}, {loop:.1f}) | "
                     f"{v['rss_mb']:.0f} | {k['wall']:.1f} ({k['cpu']:.1f}) | "
                     f"{k['rss_mb']:.0f} | {v['wall'] / k['wall']:.2f} "
                     f"({v['cpu'] / k['cpu']:.2f}) |")
    wall = statistics.median(p["vidur"]["wall"] / p["kvserve"]["wall"] for p in pairs)
    cpu = statistics.median(p["vidur"]["cpu"] / p["kvserve"]["cpu"] for p in pairs)
    lines += [f"| median of pairs | | | | | **{wall:.2f} ({cpu:.2f})** |", "",
              "Predictions (identical in every pair; seconds, tokens/s):", "",
              "| figure | Vidur | kvserve | kvserve / Vidur |", "|---|---|---|---|"]
    vf, kf = pairs[0]["vidur"]["figures"], pairs[0]["kvserve"]["figures"]
    for name in FIGURES:
        ratio = f"{kf[name] / vf[name]:.2f}" if vf[name] else "-"
        lines.append(f"| {name} | {vf[name]:g} | {kf[name]:g} | {ratio} |")
    lines += ["", "The same batch shapes priced by both (`compare_steps.py` of the kit; ms per "
              "step; Vidur's linear ops, KV-cache write and attention, kvserve's roofline "
              "compute and memory terms):", "", "```", step_costs(kit, peers).rstrip(), "```"]
    publish(args.section, "\n".join(lines) + "\n", pairs, args.json, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
