#!/usr/bin/env python
"""kvserve's panel GEMM (csrc/panel_linear.cpp) against oneDNN's packed float32 GEMM, on
SmolLM2-135M's layer projections.

Thirty layers' worth of distinct weights (q/k/v 960 x 576, o 576 x 576, gate/up 3,072 x 576,
down 576 x 1,536: 424 MB in float32), so every call streams its weight from memory as in a
model step, at 1 to 2,048 rows. Three ways alternately in one process: oneDNN's packed
float32 (what float32 projections ran on an AVX2-only CPU before), panel_linear with float32
panels (the bundled model: its dequantised weights are not bf16 numbers) and with bf16 panels
(a weight of bf16 numbers, as a bf16 checkpoint run in float32). Each figure is the median of
``--rounds`` alternated rounds; GFLOP/s from the fastest round. Needs an AVX2 build (no
AVX-512), where panel_linear exists. Run it under the bench lock:

    flock /tmp/kvserve-bench.lock python benchmarks/panel_linear.py --write-docs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

from ab_protocol import cpu
from docs_section import publish
from kvserve.model import paged_kernel
from kvserve.model.llama import pack_panels, panel_linear_available

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in] per layer
LAYERS = 30
ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 2048)


def timed(fn: Callable[[dict[int, torch.Tensor]], None], xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    fn(xs)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if not panel_linear_available():
        print("panel_linear is built only for AVX2 CPUs without AVX-512", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    kernel = paged_kernel.layer_ops().panel_linear
    weights = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            w = torch.randn(n, k)
            weights.append((k, n, torch.ops.mkldnn._reorder_linear_weight(w, None),
                            pack_panels(w), pack_panels(w.to(torch.bfloat16).float())))

    def onednn(xs: dict[int, torch.Tensor]) -> None:
        for k, _, packed, _, _ in weights:
            torch.ops.mkldnn._linear_pointwise(xs[k], packed, None, "none", [], "")

    def float32_panels(xs: dict[int, torch.Tensor]) -> None:
        for k, n, _, panels, _ in weights:
            kernel(xs[k], panels, n)

    def bf16_panels(xs: dict[int, torch.Tensor]) -> None:
        for k, n, _, _, panels in weights:
            kernel(xs[k], panels, n)

    ways = {"oneDNN": onednn, "float32 panels": float32_panels, "bf16 panels": bf16_panels}
    rows_out = []
    for rows in args.rows:
        xs = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for way in ways.values():  # warm-up
            way(xs)
        for _ in range(args.rounds):
            for name, way in ways.items():
                times[name].append(timed(way, xs))
        flop = 2 * rows * LAYERS * sum(n * k for n, k in SHAPES)
        row = {"rows": rows}
        for name, seconds in times.items():
            row[name] = {"ms": statistics.median(seconds) * 1e3,
                         "gflops": flop / min(seconds) / 1e9}
        rows_out.append(row)
        print(rows, {name: f"{row[name]['ms']:.1f} ms" for name in ways}, flush=True)
    model_name, flags = cpu()
    load = Path("/proc/loadavg").read_text().split()[0]
    lines = ["## Float32 projections: kvserve's panel GEMM against oneDNN's packed GEMM", "",
             f"`python benchmarks/panel_linear.py --write-docs` at "
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on **{model_name}** (ISA: "
             f"{flags}), load average {load} after; torch threads {torch.get_num_threads()}. "
             f"SmolLM2-135M's four layer projections x {LAYERS} layers of distinct weights "
             f"(streamed from memory, as in a model step); median ms of {args.rounds} "
             f"alternated rounds, GFLOP/s from the fastest. Ratio: oneDNN / panels (above 1, "
             f"the panels are faster).", "",
             "| rows | oneDNN ms | GFLOP/s | float32 panels ms | GFLOP/s | ratio | "
             "bf16 panels ms | GFLOP/s | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        base = r["oneDNN"]["ms"]
        cells = [f"{r['oneDNN']['ms']:.1f}", f"{r['oneDNN']['gflops']:.0f}"]
        for name in ("float32 panels", "bf16 panels"):
            cells += [f"{r[name]['ms']:.1f}", f"{r[name]['gflops']:.0f}",
                      f"{base / r[name]['ms']:.2f}x"]
        lines.append(f"| {r['rows']} | " + " | ".join(cells) + " |")
    publish("panel_linear", "\n".join(lines), rows_out, None, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
