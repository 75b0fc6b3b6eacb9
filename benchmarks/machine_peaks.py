#!/usr/bin/env python
"""Measure this machine's peak matmul rate and memory bandwidth with torch: the figures of
the roofline's ``cpu-local`` hardware preset (src/kvserve/sim/presets.py).

- matmul: square (n x n) @ (n x n) products in bf16 and fp32, 2 n^3 FLOPs each, at the
  size that runs fastest; the median of repeats;
- bandwidth: ``dst.copy_(src)`` of a 512 MiB fp32 tensor, counted as bytes read plus bytes
  written; the median of repeats.

    python benchmarks/machine_peaks.py [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from docs_section import publish
from fidelity import DOCS, TITLE


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(dtype: torch.dtype, sizes: tuple[int, ...] = (512, 1024, 2048)) -> float:
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out = torch.empty(n, n, dtype=dtype)
        seconds = median_seconds(lambda a=a, b=b, out=out: torch.matmul(a, b, out=out),
                                 repeats=max(5, int(2e10 / n ** 3)))
        best = max(best, 2 * n ** 3 / seconds)
    return best


def copy_bandwidth(num_bytes: int = 512 << 20) -> float:
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats=10)
    return 2 * num_bytes / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    bf16, fp32 = matmul_flops(torch.bfloat16), matmul_flops(torch.float32)
    bandwidth = copy_bandwidth()
    lines = ["## This machine", "",
             f"`python benchmarks/machine_peaks.py --write-docs` at "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {platform.machine()}, "
             f"{platform.processor() or 'unknown processor'}, {os.cpu_count()} cores, "
             f"torch {torch.__version__} with {torch.get_num_threads()} threads.", "",
             "| figure | measured |", "|---|---|",
             f"| matmul bf16 (best of n = 512, 1024, 2048) | {bf16 / 1e9:.0f} GFLOP/s |",
             f"| matmul fp32 | {fp32 / 1e9:.0f} GFLOP/s |",
             f"| memory bandwidth (512 MiB copy, read + write) | {bandwidth / 1e9:.1f} GB/s |",
             "", "The `cpu-local` roofline preset uses these figures as they are (efficiency "
             "1.0, no fixed step overhead), so its error in the tables below is the "
             "uncalibrated roofline's own."]
    publish("machine", "\n".join(lines), write_docs=args.write_docs, docs=DOCS, title=TITLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
