#!/usr/bin/env python
"""Where W1's time goes in kvserve, by op and by the number of rows an op ran on.

Wraps the model's projections, LM head, attention, fused layer ops and sampling with
wall-clock timers (perf_counter around each call; a microsecond or two per call against
calls of tens of microseconds to tens of milliseconds) and runs W1 offline as
benchmarks/offline_throughput.py does. Rows split prefill-heavy steps (more than 160 rows)
from decode steps; "execute" is the whole model step, so what it holds beyond the rest is
Python and torch glue (decode steps run through the modules here: KVSERVE_LAYER_STACK=0
unless set). Run it alone on the machine: anything beside it shows up as time.

    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/profile_offline.py [--n 32]
        [--workload w1|w2] [--dtype auto] [--kv-cache-memory 2GiB] [--quantization int8]
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as offline_throughput.py
# Every op through the modules, where the timers are: the C++ loop over a step's layers
# (docs/kernels.md, "The layers in one C++ call") would hide them. So the wall
# here is the modules' wall; KVSERVE_LAYER_STACK=1 keeps the loop (its ops then count as
# "execute" only).
os.environ.setdefault("KVSERVE_LAYER_STACK", "0")

from kvserve.core import SamplingParams
from kvserve.engine.llm import LLM
from kvserve.flags import parse_bytes
from kvserve.model import llama
from kvserve.model import runner as runner_module
from kvserve.model.dtype import auto_dtype_name
from kvserve.model.kernel_info import cpu_info, isa_line
from offline_throughput import w1_prompts

Key = tuple[str, str]
FUSED_OPS = ("rope_and_write_kv", "silu_and_mul", "rms_norm", "add_rms_norm_")


def rows_bucket(rows: int) -> str:
    return ("<=8 rows" if rows <= 8 else "<=16 rows" if rows <= 16 else
            "<=64 rows" if rows <= 64 else "<=160 rows" if rows <= 160 else ">160 rows")


class Timers:
    """Seconds and calls per (op, rows) key, filled by the wrappers :meth:`install` sets."""

    def __init__(self) -> None:
        self.seconds: dict[Key, float] = collections.defaultdict(float)
        self.calls: collections.Counter[Key] = collections.Counter()

    def add(self, key: Key, seconds: float) -> None:
        self.seconds[key] += seconds
        self.calls[key] += 1

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self.add((name, ""), time.perf_counter() - start)
            return result
        return wrapper

    def install(self) -> None:
        linear_forward = llama.Linear.forward
        lm_head: list[Any] = [None]  # the runner's, once its first step shows it

        def linear(module: llama.Linear, x: Any) -> Any:
            start = time.perf_counter()
            result = linear_forward(module, x)
            op = "LM head" if module is lm_head[0] else "projections"
            self.add((op, rows_bucket(x.shape[0])), time.perf_counter() - start)
            return result

        llama.Linear.forward = linear  # type: ignore[method-assign]
        for name in FUSED_OPS:
            setattr(llama, name, self.timed(name, getattr(llama, name)))
        execute = runner_module.ModelRunner.execute
        timers = self

        def step(runner: runner_module.ModelRunner, scheduler_output: Any) -> Any:
            if not getattr(runner, "_profiled", False):  # its attention: the runner's own
                attention = runner.attention
                lm_head[0] = runner.model.lm_head

                def attend(q: Any, *args: Any) -> Any:
                    start = time.perf_counter()
                    result = attention(q, *args)
                    timers.add(("attention", rows_bucket(q.shape[0])),
                               time.perf_counter() - start)
                    return result
                runner.attention = attend
                runner._profiled = True  # type: ignore[attr-defined]
            start = time.perf_counter()
            result = execute(runner, scheduler_output)
            timers.add(("execute", ""), time.perf_counter() - start)
            return result
        runner_module.ModelRunner.execute = step  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32, help="first N requests of W1")
    parser.add_argument("--workload", default="w1", choices=("w1", "w2"),
                        help="w2: W1's requests in 4,096 KV tokens with 64 seats")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("2GiB"))
    parser.add_argument("--quantization", "-q", choices=("int8",), default=None,
                        help="int8: W8A8 projections (docs/quantization.md)")
    args = parser.parse_args()
    dtype = auto_dtype_name() if args.dtype == "auto" else args.dtype
    timers = Timers()
    timers.install()
    memory: dict[str, Any] = ({"max_num_seqs": 64, "num_kv_blocks": 4096 // 16}
                              if args.workload == "w2" else
                              {"max_num_seqs": 256, "kv_cache_memory": args.kv_cache_memory})
    llm = LLM(None, dtype=dtype, block_size=16, detokenize=False, max_num_batched_tokens=2048,
              quantization=args.quantization, **memory)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    timers.seconds.clear()
    timers.calls.clear()
    start = time.perf_counter()
    llm.generate(w1_prompts(args.n), params, use_tqdm=False)
    wall = time.perf_counter() - start
    cpu = cpu_info()
    quantized = f" + {args.quantization}" if args.quantization else ""
    print(f"{args.workload.upper()}, first {args.n} requests, {dtype}{quantized}, "
          f"{platform.machine()} {cpu.name} (ISA: {isa_line(cpu)}); wall {wall:.1f} s, "
          f"{llm.engine.scheduler.stats().num_steps} steps\n")
    print("| op | rows | seconds | share of wall | calls |\n|---|---|---|---|---|")
    for key, seconds in sorted(timers.seconds.items(), key=lambda item: -item[1]):
        print(f"| {key[0]} | {key[1] or '-'} | {seconds:.2f} | {seconds / wall:.1%} | "
              f"{timers.calls[key]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
