#!/usr/bin/env python
"""Peak resident memory of ``kvserve generate`` with the bundled model and a 1 GiB KV cache
(targets: under 2.5 GiB in any dtype, issue 4; under 2 GiB in bfloat16, issue 16), measured
from the child process's rusage; what an engine holds once loaded, read from /proc in another
child; and with ``--serve-w3``, what an engine holds while it serves: a third child replays
W3 (200 requests at their arrival times, as `kvserve serve` would take them) and reads its
peak and final resident set. The CPU it ran on is recorded with the figures.

    python benchmarks/memory.py [--dtype float32 bfloat16] [--kv-cache-memory 1GiB]
        [--serve-w3] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import ab_protocol as ab
from docs_section import publish
from kvserve.model.host_heap import TRIM_SLACK_BYTES
from kvserve.model.kernel_info import cpu_info, isa_line

TARGET_GIB = 2.5  # any dtype
TARGET_GIB_BY_DTYPE = {"bfloat16": 2.0}  # issue 16: no regression from the bf16 figure
# Build the engine as `kvserve serve` does, then report the process's resident set.
LOADED = """
import sys
from kvserve.engine.llm import build_engine
from kvserve.flags import parse_bytes
engine = build_engine(dtype=sys.argv[1], kv_cache_memory=parse_bytes(sys.argv[2]))
with open("/proc/self/status") as status:
    print(next(line.split()[1] for line in status if line.startswith("VmRSS:")))
"""


# The same engine replaying W3 by the clock: each request added once its arrival time has
# passed, one step whenever there is work; then its peak and final resident set (MiB).
SERVED = """
import sys, time
sys.path.insert(0, sys.argv[3])
from shared_workloads import w3_trace
from kvserve.core import SamplingParams
from kvserve.engine.llm import build_engine
from kvserve.flags import parse_bytes
engine = build_engine(dtype=sys.argv[1], kv_cache_memory=parse_bytes(sys.argv[2]))
trace, start = w3_trace(), time.perf_counter()
while trace or engine.has_unfinished_requests():
    while trace and trace[0].arrival_time <= time.perf_counter() - start:
        request = trace.pop(0)
        engine.add_request(request.request_id, list(request.prompt_token_ids),
                           SamplingParams(max_tokens=request.max_tokens, ignore_eos=True,
                                          temperature=0.0))  # greedy, as load_client asks
    if engine.has_unfinished_requests():
        engine.step()
    else:
        time.sleep(max(0.0, trace[0].arrival_time - (time.perf_counter() - start)))
status = {line.split(":")[0]: int(line.split()[1]) for line in open("/proc/self/status")
          if line.startswith(("VmHWM:", "VmRSS:"))}
heap = getattr(engine.executor, "heap", None)  # (None: code from before host_heap, for A/B)
print(status["VmHWM"], status["VmRSS"], heap.trims if heap else -1)
"""


def peak_of_generate(dtype: str, kv_cache_memory: str) -> tuple[float, float]:
    """(peak GiB, wall seconds) of one ``kvserve generate`` child, model load included."""
    command = [sys.executable, "-m", "kvserve", "generate", "--prompt", "Hello, my name is",
               "--max-tokens", "32", "--dtype", dtype, "--kv-cache-memory", kv_cache_memory]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped: Popen must know
    wall = time.perf_counter() - start
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, command)
    return usage.ru_maxrss / 2**20, wall  # KiB -> GiB


def resident_after_load(dtype: str, kv_cache_memory: str) -> float:
    """GiB resident in a process that has loaded the engine (KV cache zeroed), idle."""
    done = subprocess.run([sys.executable, "-c", LOADED, dtype, kv_cache_memory],
                          check=True, capture_output=True, text=True)
    return int(done.stdout.split()[-1]) / 2**20  # KiB -> GiB


def served_w3(dtype: str, kv_cache_memory: str) -> tuple[float, float, int]:
    """(peak GiB, final resident GiB, heap trims) of an engine that has served W3."""
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", SERVED, dtype, kv_cache_memory, here],
                          check=True, capture_output=True, text=True)
    peak, final, trims = done.stdout.split()[-3:]
    return int(peak) / 2**20, int(final) / 2**20, int(trims)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                        choices=("float32", "bfloat16"))
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--serve-w3", action="store_true",
                        help="also replay W3 in an engine and read its peak and final RSS "
                             "(about a minute in bfloat16)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    rows, missed = [], []
    for dtype in args.dtype:
        peak, wall = peak_of_generate(dtype, args.kv_cache_memory)
        loaded = resident_after_load(dtype, args.kv_cache_memory)
        target = TARGET_GIB_BY_DTYPE.get(dtype, TARGET_GIB)
        if peak >= target:
            missed.append(dtype)
        served = "-"
        if args.serve_w3:
            served_peak, served_final, trims = served_w3(dtype, args.kv_cache_memory)
            served = f"{served_peak:.2f} / {served_final:.2f} GiB ({trims} heap trims)"
        rows.append(f"| {dtype} | **{peak:.2f} GiB** | {target:g} GiB | {loaded:.2f} GiB | "
                    f"{served} | {wall:.1f} s |")
    verdict = (f"misses its target in {', '.join(missed)}" if missed
               else "meets its target in every dtype measured")
    cpu = cpu_info()
    model, flags = ab.cpu()
    section = "\n".join([
        f"### Memory on {ab.cpu_title(model, flags)}", "",
        f"`python benchmarks/memory.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        f"runs `kvserve generate` (the bundled model, KV cache {args.kv_cache_memory}, "
        "32 tokens) in a child process and reads its peak RSS; another child loads the "
        "engine the same way and reads its resident memory once loaded, idle (what a "
        "server holds before its first request); with `--serve-w3` a third replays W3's 200 "
        "requests at their arrival times and reads its peak and final resident memory (the "
        f"runner gives the C heap's freed memory back past {TRIM_SLACK_BYTES >> 20} MiB of "
        "growth: "
        f"`kvserve.model.host_heap`). On {cpu.name} (ISA: {isa_line(cpu)}). The peak of "
        f"`generate` {verdict}. The KV cache is allocated once, zeroed at start-up, and "
        "never grown.", "",
        "| weights | peak RSS | target | resident once loaded | serving W3: peak / final | "
        "wall, load included |",
        "|---|---|---|---|---|---|", *rows])
    # one section per CPU (the older one named "memory" holds a Zen 5's figures)
    publish(f"memory:{ab.cpu_slug(model, flags)}", section, write_docs=args.write_docs)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
