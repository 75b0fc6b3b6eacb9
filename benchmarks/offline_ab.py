#!/usr/bin/env python
"""W1 / W2 offline, vLLM's CPU build and kvserve alternately (vLLM first), same machine.

vLLM runs from the scratch venv that ../shared/bench/setup_vllm.sh builds (under
$PEERS_DIR, default /tmp/peers) with ../shared/bench/vllm_env.sh's runtime settings, in
benchmarks/vllm_offline_worker.py: one ``vllm.LLM`` per workload, built and warmed up once
(its start compiles for minutes) and run once per pair; kvserve runs
benchmarks/offline_throughput.py, a fresh process per run. Both exclude model load.
The figures follow benchmarks/ab_protocol.py (each
side's best and median, the ratio of bests, the median of the pair ratios, load and steal
per run, the roofline fraction); with --write-docs the workload's section for this CPU in
docs/benchmarks.md is replaced (one per workload: a run of W1 alone keeps W2's table).
Run it under the bench lock:

    flock /tmp/kvserve-bench.lock python benchmarks/offline_ab.py --pairs 5 --workload w1 \
        --write-docs
    python benchmarks/offline_ab.py --pairs 1 --requests 16 --no-peaks   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import ab_protocol as ab
from docs_section import publish

ROOT = Path(__file__).resolve().parents[1]
BENCH = ab.shared_bench()
PEERS = Path(os.environ.get("PEERS_DIR", Path(tempfile.gettempdir()) / "peers"))
# W1 in 2 GiB of KV on both sides (no preemption); W2 in 4,096 KV tokens with 64 seats
# (vLLM's CPU attention needs blocks of 32, so 128 x 32 against kvserve's 256 x 16).
VLLM_ARGS = {"w1": ["--kv-cache-gib", "2"],
             "w2": ["--kv-blocks", "128", "--block-size", "32", "--max-num-seqs", "64"]}
KVSERVE_ARGS = {"w1": ["--kv-cache-memory", "2GiB"], "w2": []}
PEAK = {"bfloat16": "bf16_flops", "float32": "fp32_flops"}  # the roofline's matmul rate
FIGURES = [ab.Figure("wall_s", "wall s", False), ab.Figure("output_tok_s", "output tok/s",
                                                             True, "{:.0f}")]


def vllm_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="0-1",
               LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:"
                          f"{PEERS / 'venvs/vllm/lib/libiomp5.so'}")
    return env


class VllmWorker:
    """vLLM's LLM for one workload, built once; :meth:`run` runs the workload once."""

    def __init__(self, workload: str, requests: int, dtype: str, log: Path) -> None:
        self.process = subprocess.Popen(
            [str(PEERS / "venvs/vllm/bin/python"), str(Path(__file__).with_name(
                "vllm_offline_worker.py")), str(BENCH), "--n", str(requests), "--dtype", dtype,
             *VLLM_ARGS[workload]], env=vllm_env(), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
        self._read()  # {"ready": true} once built and warmed up

    def _read(self) -> dict:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise SystemExit(f"the vLLM worker exited ({self.process.wait()}): see its log")

    def run(self) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()


def run_kvserve(workload: str, requests: int, dtype: str, out: Path) -> dict:
    subprocess.run([sys.executable, str(ROOT / "benchmarks/offline_throughput.py"),
                    "--workload", workload, "--dtype", dtype, "--n", str(requests),
                    "--json", str(out), *KVSERVE_ARGS[workload]],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())[0]


def run_row(workload: str, pair: int, side: str, r: dict, conditions: ab.Conditions,
            peaks: dict[str, float] | None, dtype: str) -> str:
    fraction = "-"
    if peaks:
        floor = ab.roofline_floor_s(r["prompt_tokens"], r["output_tokens"],
                                    peaks[PEAK[dtype]])
        fraction = f"{floor / r['wall_s']:.2f}"
    preempted = "?" if r.get("preemptions") is None else f"{r['preemptions']:.0f}"
    return (f"| {workload.upper()} | {pair} | {side} | {r['wall_s']:.1f} | "
            f"{r['output_tok_s']:.0f} | {preempted} | {conditions} | {fraction} |")


def section(args: argparse.Namespace, model: str, flags: str, peaks: dict[str, float] | None,
            workload: str, sides: dict[str, list[dict]], rows: list[str]) -> str:
    """One workload's section: each workload has its own on each CPU, so a run of one
    workload replaces its own table and leaves the other's."""
    command = ab.kernel_env() + "python benchmarks/offline_ab.py " + " ".join(sys.argv[1:])
    setting = ("W1 in 2 GiB of KV cache on both sides" if workload == "w1" else
               "W2: W1's requests in 4,096 KV tokens (vLLM 128 blocks of 32, its CPU "
               "attention's smallest; kvserve 256 of 16), max_num_seqs 64")
    pairs = len(sides["kvserve"])
    cut = "" if pairs == args.pairs else f" (cut short: {pairs} pairs done)"
    dtype = args.dtype
    lines = [f"### Offline throughput against vLLM on {ab.cpu_title(model, flags)}: "
             f"{workload.upper()}{cut}", "",
             f"`flock /tmp/kvserve-bench.lock {command.strip()}` on "
             f"{ab.machine_line(model, flags, peaks)}. vLLM CPU 0.32.0 ({dtype}, torch.compile; "
             f"one LLM built once per workload) and kvserve ({dtype}, a fresh process per run) "
             "alternately, vLLM first, model load excluded; the first "
             f"{args.requests} requests of W1. {setting}. The machine is shared with other "
             "jobs: each run's load average before it, steal time during it and a 1024^3 "
             "bf16 matmul's rate just before it are in the rows. Roofline: the run's matmul "
             f"work at the measured {dtype} peak over its wall "
             "time.", "",
             *ab.summary_table(ab.summarize(FIGURES, sides["vLLM"], sides["kvserve"])), ""]
    return "\n".join([*lines, "| workload | pair | engine | wall s | output tok/s | "
                       "preemptions | load / steal / bf16 GFLOP/s | roofline fraction |",
                       "|---|---|---|---|---|---|---|---|", *rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=128, help="first N of W1 (smoke: 16)")
    parser.add_argument("--workload", nargs="+", default=["w1", "w2"], choices=("w1", "w2"))
    parser.add_argument("--no-peaks", action="store_true",
                        help="skip measuring this machine's peaks (no roofline column)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="both engines' dtype (auto: bfloat16 where the CPU computes it "
                             "natively, AMX or AVX512-BF16; float32 elsewhere)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if not (PEERS / "venvs/vllm/bin/python").exists():
        print(f"no vLLM venv under {PEERS}: run ../shared/bench/setup_vllm.sh first",
              file=sys.stderr)
        return 2
    if args.pairs < 1 or not 1 <= args.requests <= 128:
        print("--pairs must be >= 1 and --requests in [1, 128]", file=sys.stderr)
        return 2
    model, flags = ab.cpu()
    if args.dtype == "auto":
        args.dtype = ab.fast_dtype(flags)
    peaks = None if args.no_peaks else ab.measure_peaks()
    runs: dict[str, dict[str, list[dict]]] = {w: {"vLLM": [], "kvserve": []}
                                              for w in args.workload}
    rows: dict[str, list[str]] = {w: [] for w in args.workload}
    with tempfile.TemporaryDirectory() as scratch:
        for workload in args.workload:
            vllm = VllmWorker(workload, args.requests, args.dtype, Path(scratch) / "vllm.log")
            try:
                for pair in range(1, args.pairs + 1):
                    out = Path(scratch) / f"kvserve-{workload}-{pair}.json"
                    for side, runner in (
                            ("vLLM", vllm.run),
                            ("kvserve", lambda out=out, w=workload: run_kvserve(
                                w, args.requests, args.dtype, out))):
                        result, conditions = ab.measured(runner)
                        runs[workload][side].append(result)
                        rows[workload].append(
                            run_row(workload, pair, side, result, conditions, peaks,
                                    args.dtype))
                        print(rows[workload][-1], flush=True)
                    # each finished pair is published: a run cut short keeps what it measured
                    publish(f"offline_ab:{ab.cpu_slug(model, flags)}:{workload}",
                            section(args, model, flags, peaks, workload, runs[workload],
                                    rows[workload]),
                            write_docs=args.write_docs)
            finally:
                vllm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
