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
import sys
import time

import torch

from docs_section import publish
from fidelity import DOCS, TITLE
from kvserve.engine.machine_peaks import copy_bandwidth, matmul_flops
from kvserve.model.kernel_info import cpu_info, isa_line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    bf16, fp32 = matmul_flops(torch.bfloat16), matmul_flops(torch.float32)
    bandwidth = copy_bandwidth()
    cpu = cpu_info()
    lines = ["## This machine", "",
             f"`python benchmarks/machine_peaks.py{' --write-docs' if args.write_docs else ''}` at "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {platform.machine()}, "
             f"{cpu.name} (ISA: {isa_line(cpu)}), {os.cpu_count()} cores, "
             f"torch {torch.__version__} with {torch.get_num_threads()} threads.", "",
             "| figure | measured |", "|---|---|",
             f"| matmul bf16 (best of n = 512, 1024, 2048) | {bf16 / 1e9:.0f} GFLOP/s |",
             f"| matmul fp32 | {fp32 / 1e9:.0f} GFLOP/s |",
             f"| memory bandwidth (512 MiB copy, read + write) | {bandwidth / 1e9:.1f} GB/s |",
             "", "`--hardware cpu-local` measures the same figures itself (once per CPU, "
             "cached) and uses them as they are (efficiency 1.0, no fixed step overhead), "
             "so its error in the tables below is the uncalibrated roofline's own."]
    publish("machine", "\n".join(lines), write_docs=args.write_docs, docs=DOCS, title=TITLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
