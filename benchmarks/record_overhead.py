#!/usr/bin/env python
"""What `kvserve serve --record DIR` costs: W3 online with and without recording, alternated
in one sitting (issue 18's target: under 2% of throughput).

Each run starts a fresh `kvserve serve` (the bundled model, the default 1 GiB KV cache, the
engine on a thread) and sends the first --n requests of W3 (../shared/WORKLOADS.md) with
`kvserve bench serve --trace`; "record" adds `--record` into a fresh directory (prompts as
hashes, the default). The order within a pair alternates. Per run: output tok/s, TTFT and
ITL; then each side's median and the median of the pair ratios (record / plain). With
--write-docs the table goes to docs/benchmarks.md, with the CPU model, its ISA flags and the
load average before each run. The last recording is kept in out/record_overhead_rec (the
README's worked example replays it with kvserve whatif). Run it under the bench lock:

    flock /tmp/kvserve-bench.lock python benchmarks/record_overhead.py --pairs 2 --n 60 --write-docs
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_process_ab import cpu, row, serve_and_bench
from online_load import OUT, w3_count, w3_trace

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- record_overhead:begin -->", "<!-- record_overhead:end -->"
RECORDING = OUT / "record_overhead_rec"


def run(side: str, trace: Path, dtype: str, extra: list[str]) -> dict:
    flags = ["--dtype", dtype, "--log-stats-interval", "0", "--no-engine-process", *extra]
    if side == "record":
        shutil.rmtree(RECORDING, ignore_errors=True)
        flags += ["--record", str(RECORDING)]
    return serve_and_bench(f"record_overhead_{side}", flags, trace)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--n", type=w3_count, default=60, help="W3 requests (the first n)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("serve_flags", nargs="*", help="extra kvserve serve flags (after --)")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    trace = OUT / "record-overhead-w3.jsonl"
    w3_trace(trace, args.n)
    results: dict[str, list[dict]] = {"plain": [], "record": []}
    rows = []
    for pair in range(args.pairs):
        for side in (("plain", "record") if pair % 2 == 0 else ("record", "plain")):
            results[side].append(run(side, trace, args.dtype, args.serve_flags))
            rows.append(row(side, pair + 1, results[side][-1]))
            print(rows[-1], flush=True)
    tput = {side: [r["output_throughput"] for r in rs] for side, rs in results.items()}
    ratios = [r / p for r, p in zip(tput["record"], tput["plain"], strict=True)]
    model, flags = cpu()
    command = "python benchmarks/record_overhead.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        BEGIN, "## Recording's cost (W3 online, with and without --record, A/B)", "",
        f"`flock /tmp/kvserve-bench.lock {command.strip()}` on {model} ({os.cpu_count()} "
        f"cores; ISA: {flags}), shared with other jobs (load average before each run in the "
        "last column). Each run is a fresh `kvserve serve` (bundled SmolLM2-135M-Instruct, "
        f"{args.dtype}, 1 GiB KV, the engine on a thread) and the first {args.n} requests of "
        "W3 by `kvserve bench serve --trace`; record = `--record DIR` (prompts as hashes). "
        "Pairs alternate their order.", "",
        "| pair | side | output tok/s | duration s | TTFT p50 / p99 s | ITL p50 / p99 ms | "
        "completed / failed | load avg |", "|---|---|---|---|---|---|---|---|", *rows, "",
        f"Output tok/s, plain: median {statistics.median(tput['plain']):.1f}; record: median "
        f"{statistics.median(tput['record']):.1f}. Pair ratios (record / plain): "
        + ", ".join(f"{r:.3f}" for r in ratios)
        + f"; median {statistics.median(ratios):.3f}.", END, ""])
    print(text)
    if args.write_docs:
        path = ROOT / "docs" / "benchmarks.md"
        doc = path.read_text()
        if BEGIN in doc and END in doc:
            head, rest = doc.split(BEGIN, 1)
            path.write_text(head + text.rstrip("\n") + rest.split(END, 1)[1])
        else:
            path.write_text(doc.rstrip("\n") + "\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
