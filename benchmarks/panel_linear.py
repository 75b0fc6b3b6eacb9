#!/usr/bin/env python
"""kvserve's panel GEMMs (csrc/panel_linear.cpp, csrc/panel_dpbf16.h) against oneDNN's packed
GEMM, on SmolLM2-135M's layer projections.

Thirty layers' worth of distinct weights (q/k/v 960 x 576, o 576 x 576, gate/up 3,072 x 576,
down 576 x 1,536: 424 MB in float32), so every call streams its weight from memory as in a
model step, at 1 to 2,048 rows. Three ways alternately in one process: oneDNN's packed
float32 (what float32 projections ran on an AVX2-only CPU before), panel_linear with float32
panels (the bundled model: its dequantised weights are not bf16 numbers) and with bf16 panels
(a weight of bf16 numbers, as a bf16 checkpoint run in float32). Each figure is the median of
``--rounds`` alternated rounds; GFLOP/s from the fastest round. Needs a build with AVX2 and
FMA, where panel_linear exists.

``--dtype bfloat16`` compares what a bf16 model's projections can run on, each from bf16 rows
to bf16 outputs as :class:`kvserve.model.llama.Linear` calls it: oneDNN's packed bf16 where it
runs bf16 natively (AMX, AVX512-BF16), the AVX2 panels with bf16 panels (rows widened to
float32 first) and, on an AVX512-BF16 build, panel_linear_bf16's pairs-of-k panels
(vdpbf16ps), and on an AMX-BF16 build the same panels on kvserve's own tiles
(panel_linear_amx, csrc/panel_amx.h). ``--between-mb`` reads other memory between layers, as
a step's attention reads the KV cache, so the weights come from memory as they do in a step.
That is the measurement that decides KVSERVE_PROJECTIONS's default for bf16 on
such a CPU (docs/kernels.md); each CPU gets its own section. Run it under the bench lock:

    flock /tmp/kvserve-bench.lock python benchmarks/panel_linear.py --write-docs
    flock /tmp/kvserve-bench.lock python benchmarks/panel_linear.py --dtype bfloat16 --write-docs
    flock /tmp/kvserve-bench.lock python benchmarks/panel_linear.py --dtype bfloat16 \
        --between-mb 5 --write-docs
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

from ab_protocol import cpu, cpu_slug, cpu_title
from docs_section import publish
from kvserve.model import paged_kernel
from kvserve.model.kernel_info import onednn_runs_bf16
from kvserve.model.llama import pack_pair_panels, pack_panels, panel_linear_available

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in] per layer
LAYERS = 30
ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 2048)


def timed(fn: Callable[[dict[int, torch.Tensor]], float | None],
          xs: dict[int, torch.Tensor]) -> float:
    """The seconds fn took, or those it reports (a way that leaves out work of its own)."""
    start = time.perf_counter()
    spent = fn(xs)
    return time.perf_counter() - start if spent is None else spent


Way = Callable[[dict[int, torch.Tensor]], float | None]
Call = Callable[[int, dict[int, torch.Tensor]], None]  # weight i's projection of its rows


def measure(ways: dict[str, Way], row_counts: list[int], rounds: int,
            dtype: torch.dtype) -> list[dict]:
    """Per row count: each way's median ms over ``rounds`` alternated rounds (after one
    warm-up) and its GFLOP/s from the fastest round, on random ``dtype`` rows."""
    rows_out = []
    for rows in row_counts:
        xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for way in ways.values():  # warm-up
            way(xs)
        for _ in range(rounds):
            for name, way in ways.items():
                times[name].append(timed(way, xs))
        flop = 2 * rows * LAYERS * sum(n * k for n, k in SHAPES)
        row: dict = {"rows": rows}
        for name, seconds in times.items():
            row[name] = {"ms": statistics.median(seconds) * 1e3,
                         "gflops": flop / min(seconds) / 1e9}
        rows_out.append(row)
        print(rows, {name: f"{row[name]['ms']:.1f} ms" for name in ways}, flush=True)
    return rows_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--between-mb", type=int, default=0,
                        help="bfloat16: MB of other memory read before each layer (untimed), "
                             "as attention reads the KV cache in a model step (default 0)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if not panel_linear_available():
        print("panel_linear needs a build with AVX2 and FMA", file=sys.stderr)
        return 2
    if args.dtype == "bfloat16":
        return bf16_main(args)
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
    rows_out = measure(ways, args.rows, args.rounds, torch.float32)
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


def bf16_ways(between_mb: int = 0) -> dict[str, Way]:
    """Each bf16 kernel this machine has, over the same thirty layers of bf16 weights. With
    ``between_mb``, that many MB of other memory are read before each layer's four
    projections (not timed), as a model step's attention reads the KV cache between them:
    alone, the layers' 212 MB are the only traffic, and a CPU whose last-level cache holds a
    good part of them serves those from the cache, which a model step does not."""
    ops = paged_kernel.layer_ops()
    weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(LAYERS) for n, k in SHAPES]
    calls: dict[str, Call] = {}
    if onednn_runs_bf16():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        calls["oneDNN bf16"] = lambda i, xs: torch.ops.mkldnn._linear_pointwise(
            xs[weights[i].shape[1]], packed[i], None, "none", [], "")
    panels = [pack_panels(w.float()) for w in weights]
    calls["AVX2 bf16 panels"] = lambda i, xs: ops.panel_linear(
        xs[weights[i].shape[1]].float(), panels[i], weights[i].shape[0]).to(torch.bfloat16)
    if ops.panel_linear_bf16_compiled():
        pairs = [pack_pair_panels(w) for w in weights]
        calls["AVX512-BF16 panels"] = lambda i, xs: ops.panel_linear_bf16(
            xs[weights[i].shape[1]], pairs[i], weights[i].shape[0], True)  # bf16 out, as Linear
        if paged_kernel.panel_amx_runs():
            calls["AMX tiles on the panels"] = lambda i, xs: ops.panel_linear_amx(
                xs[weights[i].shape[1]], pairs[i], weights[i].shape[0], True)
    other = torch.ones(LAYERS, max(1, between_mb * 2**20 // 2), dtype=torch.bfloat16)

    def way(call: Call) -> Way:
        def run(xs: dict[int, torch.Tensor]) -> float:
            spent = 0.0
            for layer in range(LAYERS):
                if between_mb > 0:
                    other[layer].sum()
                start = time.perf_counter()
                for i in range(layer * len(SHAPES), (layer + 1) * len(SHAPES)):
                    call(i, xs)
                spent += time.perf_counter() - start
            return spent
        return run

    return {name: way(call) for name, call in calls.items()}


def bf16_main(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    ways = bf16_ways(args.between_mb)
    rows_out = measure(ways, args.rows, args.rounds, torch.bfloat16)
    model_name, flags = cpu()
    load = Path("/proc/loadavg").read_text().split()[0]
    names = list(ways)
    lines = [f"## bf16 projections on {cpu_title(model_name, flags)}: the panel GEMMs against "
             "oneDNN", "",
             f"`python benchmarks/panel_linear.py --dtype bfloat16 --write-docs` at "
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on **{model_name}** (ISA: "
             f"{flags}), load average {load} after; torch threads {torch.get_num_threads()}. "
             f"SmolLM2-135M's four layer projections x {LAYERS} layers of distinct bf16 "
             f"weights, bf16 rows in and bf16 outputs out (the conversions included)" +
             (f", {args.between_mb} MB of other memory read before each layer (untimed, as "
              "attention reads the KV cache in a step)" if args.between_mb > 0 else "") +
             "; median "
             f"ms of {args.rounds} alternated rounds, GFLOP/s from the fastest. Ratio: "
             f"{names[0]} / the column's kernel (above 1, that kernel is faster).", "",
             "| rows | " + " | ".join(
                 f"{name} ms | GFLOP/s" + (" | ratio" if i else "")
                 for i, name in enumerate(names)) + " |",
             "|---|" + "---|" * (3 * len(names) - 1)]
    for r in rows_out:
        base = r[names[0]]["ms"]
        cells = []
        for i, name in enumerate(names):
            cells += [f"{r[name]['ms']:.1f}", f"{r[name]['gflops']:.0f}"]
            if i:
                cells.append(f"{base / r[name]['ms']:.2f}x")
        lines.append(f"| {r['rows']} | " + " | ".join(cells) + " |")
    publish(f"panel_linear_bf16:{cpu_slug(model_name, flags)}", "\n".join(lines), rows_out,
            None, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
