"""Measure this machine's peak matmul rate and memory bandwidth with torch: the figures of
the roofline's ``cpu-local`` hardware (:func:`kvserve.sim.machine.local_hardware`, which
runs ``python -m kvserve.engine.machine_peaks --json`` once per CPU and caches the result).

- matmul: square (n x n) @ (n x n) products in bf16 and fp32, 2 n^3 FLOPs each, at the
  size that runs fastest; the median of repeats;
- bandwidth: ``dst.copy_(src)`` of a 512 MiB fp32 tensor, counted as bytes read plus bytes
  written; the median of repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

MATMUL_SIZES = (512, 1024, 2048)
MATMUL_BUDGET_S = 3.0  # per size


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def matmul_flops(dtype: torch.dtype, sizes: tuple[int, ...] = MATMUL_SIZES,
                 budget_s: float = MATMUL_BUDGET_S,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """The best rate over ``sizes``, each size's repeats cut to fit ``budget_s``. Where the
    CPU computes ``dtype`` only by emulation (bf16 on an AVX2-only CPU: torch ran it at
    ~1.4 GFLOP/s, a hundredth of its fp32 rate), one product of the smallest size shows it
    and the larger sizes, slower still, are skipped, so the measurement takes seconds, not
    the quarter of an hour that 2048^3 products at that rate would."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out = torch.empty(n, n, dtype=dtype)
        start = clock()
        torch.matmul(a, b, out=out)
        once = clock() - start
        fits = int(budget_s / max(once, 1e-9))
        if fits < 3:  # too slow for a median: this one product is the figure
            return max(best, 2 * n ** 3 / once)
        seconds = median_seconds(lambda a=a, b=b, out=out: torch.matmul(a, b, out=out),
                                 repeats=min(max(5, int(2e10 / n ** 3)), fits), warmup=1,
                                 clock=clock)
        best = max(best, 2 * n ** 3 / seconds)
    return best


def copy_bandwidth(num_bytes: int = 512 << 20) -> float:
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats=10)
    return 2 * num_bytes / seconds


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def measure_peaks() -> dict[str, Any]:
    """The figures :func:`kvserve.sim.machine.local_hardware` reads, and how they were
    measured."""
    return {"bf16_flops": matmul_flops(torch.bfloat16), "fp32_flops": matmul_flops(torch.float32),
            "memory_bandwidth": copy_bandwidth(), "memory_bytes": memory_bytes(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    peaks = measure_peaks()
    if args.json:
        print(json.dumps(peaks))
    else:
        print(f"matmul bf16 {peaks['bf16_flops'] / 1e9:.0f} GFLOP/s, fp32 "
              f"{peaks['fp32_flops'] / 1e9:.0f} GFLOP/s, copy {peaks['memory_bandwidth'] / 1e9:.1f}"
              f" GB/s ({peaks['threads']} threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
