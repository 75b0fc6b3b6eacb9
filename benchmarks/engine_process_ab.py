#!/usr/bin/env python
"""W3 online, the engine on a thread of the server (the default) against the engine in a
process of its own (``--engine-process``), alternated in one sitting.

Each pair starts a fresh `kvserve serve` for each side (the bundled model, bf16, the default
1 GiB KV cache, extra serve flags after --) and sends W3 of ../shared/WORKLOADS.md with
`kvserve bench serve --trace`; the order within a pair alternates. Figures per run, each side's
minimum and median, and the median of the pair ratios (process / thread) go to stdout and, with
--write-docs, to docs/benchmarks.md, with the CPU model, its ISA flags and the load average.
Run it under the bench lock:

    flock /tmp/kvserve-bench.lock python benchmarks/engine_process_ab.py --pairs 3 --write-docs
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_load import OUT, bench, free_port, w3_count, w3_trace, write_docs

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- engine_process_ab:begin -->", "<!-- engine_process_ab:end -->"
SIDES = {"thread": ["--no-engine-process"], "process": ["--engine-process"],
         # one torch thread in the engine process leaves a core to the server: it spins
         "process-1t": ["--engine-process", "--threads-per-replica", "1"]}


def cpu() -> tuple[str, str]:
    """The CPU model and its vector ISA flags, from /proc/cpuinfo."""
    model, flags = platform.processor(), ""
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not flags:
                model = value.strip()
            elif key.strip() == "flags":
                flags = " ".join(f for f in value.split() if f.startswith(("avx", "amx", "fma")))
                break
    return model, flags


def serve(port: int, flags: list[str], log: Path) -> subprocess.Popen:
    """`python -m kvserve serve` from this checkout (not whatever `kvserve` is on PATH)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, "-m", "kvserve", "serve", "--port", str(port), *flags]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    import httpx
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"kvserve serve exited: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("kvserve serve did not come up in 600 s")


def serve_and_bench(name: str, flags: list[str], trace: Path) -> dict:
    """Start a fresh `kvserve serve` with ``flags``, send ``trace`` through `kvserve bench
    serve`, stop the server; the result carries the load average before the run. Logs and
    JSON go to out/NAME.log and out/NAME.json."""
    port, load = free_port(), os.getloadavg()[0]
    server = serve(port, flags, OUT / f"{name}.log")
    try:
        result = bench(f"http://127.0.0.1:{port}", ["--trace", str(trace), "--no-progress"],
                       OUT / f"{name}.json")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    result["load_before"] = load
    return result


def run(side: str, trace: Path, dtype: str, extra: list[str]) -> dict:
    flags = ["--dtype", dtype, "--log-stats-interval", "0", *SIDES[side], *extra]
    return serve_and_bench(f"engine_process_ab_{side}", flags, trace)


def row(side: str, index: int, r: dict) -> str:
    """One table row: pair, side, output tok/s, duration, TTFT and ITL p50/p99, outcome, load."""
    t, i = r["ttft"], r["itl"]
    return (f"| {index} | {side} | {r['output_throughput']:.1f} | {r['duration_s']:.1f} | "
            f"{t['p50_ms'] / 1000:.2f} / {t['p99_ms'] / 1000:.2f} | "
            f"{i['p50_ms']:.0f} / {i['p99_ms']:.0f} | {r['completed']} / {r['failed']} | "
            f"{r['load_before']:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--n", type=w3_count, default=200, help="W3 requests (first n)")
    parser.add_argument("--other", choices=("process", "process-1t"), default="process",
                        help="the side measured against the engine thread")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("serve_flags", nargs="*", help="extra kvserve serve flags (after --)")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    trace = OUT / "w3-trace.jsonl"
    w3_trace(trace, args.n)
    other = args.other
    results: dict[str, list[dict]] = {"thread": [], other: []}
    rows = []
    for pair in range(args.pairs):
        order = ("thread", other) if pair % 2 == 0 else (other, "thread")
        for side in order:
            result = run(side, trace, args.dtype, args.serve_flags)
            results[side].append(result)
            rows.append(row(side, pair + 1, result))
            print(rows[-1], flush=True)
    tput = {side: [r["output_throughput"] for r in rs] for side, rs in results.items()}
    ratios = [p / t for p, t in zip(tput[other], tput["thread"], strict=True)]
    model, flags = cpu()
    command = "python benchmarks/engine_process_ab.py " + " ".join(sys.argv[1:])
    summary = (f"Output tok/s, thread: min {min(tput['thread']):.0f}, median "
               f"{statistics.median(tput['thread']):.0f}; {other}: min "
               f"{min(tput[other]):.0f}, median {statistics.median(tput[other]):.0f}. "
               f"Ratio of minima {min(tput[other]) / min(tput['thread']):.2f}, median of "
               f"the pair ratios ({other} / thread) {statistics.median(ratios):.2f}.")
    text = "\n".join([
        BEGIN, "## The engine in its own process (W3 online, A/B)", "",
        f"`flock /tmp/kvserve-bench.lock {command.strip()}` on {model} "
        f"({os.cpu_count()} cores; ISA: {flags}), shared with other jobs (load average before "
        "each run in the last column). Each run is a fresh `kvserve serve` (bundled "
        f"SmolLM2-135M-Instruct, {args.dtype}, 1 GiB KV) and W3 of ../shared/WORKLOADS.md by "
        "`kvserve bench serve --trace`; thread = `--no-engine-process` (the engine on a thread "
        "of the server's process, passive OpenMP waiting), process = `--engine-process` "
        "(torch's threads on every core, so passive waiting there too), process-1t = "
        "`--engine-process --threads-per-replica 1` (one engine thread, a core left to the "
        "server: `OMP_WAIT_POLICY=ACTIVE` there). Pairs alternate their order.", "",
        "| pair | engine | output tok/s | duration s | TTFT p50 / p99 s | ITL p50 / p99 ms | "
        "completed / failed | load avg |", "|---|---|---|---|---|---|---|---|", *rows, "",
        summary, END, ""])
    print(text)
    if args.write_docs:
        doc = (ROOT / "docs" / "benchmarks.md").read_text()
        if BEGIN in doc and END in doc:
            head, rest = doc.split(BEGIN, 1)
            (ROOT / "docs" / "benchmarks.md").write_text(
                head + text.rstrip("\n") + rest.split(END, 1)[1])
        else:
            write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
