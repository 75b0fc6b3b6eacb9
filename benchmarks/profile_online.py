#!/usr/bin/env python
"""Where W3's time goes inside `kvserve serve`: py-spy samples every Python thread of the
server (and of its engine process, with --engine-process) while W3 runs through
`kvserve bench serve`, then each sample is put in one bucket by the innermost frame that names
one (projections, attention, fused layer ops, LM head, sampling, scheduler, model inputs,
detokenize, HTTP/event loop, waiting for work, other Python).

A sample of a thread that is waiting (py-spy --idle) counts as waiting, whichever frame it
waits in; the event loop's idle time is its selector. Torch's OpenMP threads are not Python
threads and are not sampled: the engine thread's samples stand for the whole step, the time
its other OpenMP threads run alongside included.

    pip install py-spy   # (the `profile` extra; not needed by kvserve itself)
    flock /tmp/kvserve-bench.lock python benchmarks/profile_online.py --n 100 --write-docs
    python benchmarks/profile_online.py --raw FILE   # the table of a py-spy raw profile
                                                     # taken otherwise (record --pid ...)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from docs_section import publish
from online_load import OUT, bench, free_port, w3_trace

ROOT = Path(__file__).resolve().parents[1]
# (bucket, pattern on "function (file:line)") from the most specific; the innermost frame of
# a sample that matches any wins
BUCKETS = [
    ("attention", r"model/attention\.py|paged_kernel\.py"),
    ("fused layer ops", r"model/layer_ops\.py"),
    ("LM head", r"compute_logits \(kvserve/model/llama\.py"),
    ("projections", r"Linear\.forward \(kvserve/model/llama\.py"),
    ("sampling", r"model/sampler\.py|ModelRunner\._sample"),
    ("model inputs and outputs", r"model/runner\.py|model/input_batch\.py"),
    ("model, other", r"model/llama\.py|torch/nn/"),
    ("scheduler", r"kvserve/core/"),
    ("detokenize and stop strings", r"engine/text\.py|model/tokenizer\.py|"
                                    r"model/detokenizer\.py|tokenizers"),
    ("engine loop", r"kvserve/engine/"),
    ("HTTP, SSE, JSON (event loop)", r"uvicorn|starlette|kvserve/server/|asyncio|h11|"
                                     r"json/|httptools"),
]
IDLE = re.compile(r"\b(wait|select|poll|get|acquire|sleep|recv_bytes|_recv|read|_worker) \(")


PROCESS = re.compile(r"^process (\d+):")


def parse(path: Path, processes: dict[int, str] | None = None
          ) -> dict[str, collections.Counter]:
    """py-spy's raw output (``thread (tid): name;frame;...;frame count``; with
    --subprocesses each line starts ``process pid:"cmdline";``), idle samples included, as
    {thread name: Counter(bucket -> samples)}. A process's threads are named after it:
    ``processes`` labels pids (the server) and any other pid is an engine process; without
    it (--raw), each is ``process <pid>``."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        owner = ""
        if parts and (match := PROCESS.match(parts[0])):
            pid = int(match.group(1))
            owner = (f"process {pid}" if processes is None
                     else processes.get(pid, "engine process")) + ": "
            parts = parts[1:]
        head, *frames = parts
        name = head.partition(": ")[2] or "unnamed"
        name = owner + re.sub(r"-\d+$", "", name)
        threads[name][bucket(frames)] += int(count)
    return threads


def bucket(frames: list[str]) -> str:
    if frames and IDLE.search(frames[-1]) and not any("Linear" in f for f in frames[-3:]):
        return "waiting"
    for frame in reversed(frames):
        for name, pattern in BUCKETS:
            if re.search(pattern, frame):
                return name
    return "other Python"


def table(threads: dict[str, collections.Counter], top: int = 4) -> list[str]:
    lines = ["| thread | samples | where (share of the thread's samples) |", "|---|---|---|"]
    ranked = sorted(threads.items(), key=lambda item: -sum(item[1].values()))
    for name, counter in ranked[:top]:
        total = sum(counter.values())
        shares = ", ".join(f"{b} {100 * n / total:.0f}%" for b, n in counter.most_common()
                           if n / total >= 0.01)
        lines.append(f"| {name} | {total} | {shares} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="W3 requests (first n)")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--raw", type=Path, help="only print the table of this py-spy raw "
                        "profile (py-spy record --idle --threads --format raw)")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("serve_flags", nargs="*", help="extra kvserve serve flags (after --)")
    args = parser.parse_args()
    if args.raw is not None:
        print("\n".join(table(parse(args.raw))))
        return 0
    if not shutil.which(args.py_spy):
        print("py-spy not found: pip install py-spy (or --py-spy PATH)", file=sys.stderr)
        return 2
    OUT.mkdir(exist_ok=True)
    trace = OUT / "w3-trace.jsonl"
    w3_trace(trace, args.n)
    port = free_port()
    raw = OUT / "profile_online.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    server = subprocess.Popen(
        [args.py_spy, "record", "--idle", "--threads", "--subprocesses", "--format", "raw",
         "-r", str(args.rate), "-o", str(raw), "--", sys.executable, "-m", "kvserve", "serve",
         "--port", str(port), "--dtype", "bfloat16", "--log-stats-interval", "0",
         *args.serve_flags], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import httpx
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("kvserve serve did not come up under py-spy")
        time.sleep(0.5)
    load = os.getloadavg()[0]
    try:
        result = bench(f"http://127.0.0.1:{port}", ["--trace", str(trace), "--no-progress"],
                       OUT / "profile_online.json")
    finally:
        served = _children(server.pid)  # the server under py-spy
        for child in served:  # SIGINT stops it in order
            os.kill(child, signal.SIGINT)
        server.wait(timeout=120)
    command = "python benchmarks/profile_online.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        "### Where W3's time goes in `kvserve serve` (py-spy)", "",
        f"`flock /tmp/kvserve-bench.lock {command.strip()}` ({os.cpu_count()} cores, load "
        f"average {load:.1f} when W3 started): the first {args.n} requests of W3, bf16, "
        f"{result['output_throughput']:.0f} output tok/s, TTFT p50 "
        f"{result['ttft']['p50_ms'] / 1000:.2f} s, ITL p50 {result['itl']['p50_ms']:.0f} ms. "
        "Samples over the whole run (start-up and the idle tail included), each put in one "
        "bucket by its innermost kvserve, torch or server frame; `waiting` is a thread "
        "blocked for work, a lock or the GIL.", "",
        *table(parse(raw, {pid: "server" for pid in served}))])
    publish("profile_online", text, write_docs=args.write_docs)
    return 0


def _children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return [int(p) for p in out.split()]


if __name__ == "__main__":
    sys.exit(main())
