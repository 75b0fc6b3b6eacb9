#!/usr/bin/env python
"""The C++ kernels of two checkouts, A/B: kernel timings and W1 offline, alternated.

Each side is a fresh process whose ``kvserve`` comes from that checkout's ``src`` (its
extension built from its own csrc/, cached by source hash); the measuring code is this
file's, so both sides run the same cases. Per side: the decode kernel on a W1-like batch (128
requests, contexts uniform in [64, 640], SmolLM2's attention shape, as
benchmarks/attention_kernel.py), float32 and bfloat16; a 512-token prefill chunk; the fused
layer ops of a 128-token decode step over 30 layers (bf16); then W1 offline (bf16, decode-heavy:
128 requests, 128 output tokens each; benchmarks/offline_throughput.py), wall seconds. Pairs
alternate which side goes first. Reported: per pair the ratio base / head (above 1: head
faster), the median of the pair ratios and the ratio of the minima.

    mkdir -p /tmp/base && git archive a0fe011 src | tar -x -C /tmp/base
    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/kernel_ab.py \\
        --base /tmp/base/src [--head DIR/src] [--pairs 3] [--reps 15] [--w1-n 128] \\
        [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent


def worker(reps: int, w1_n: int) -> dict[str, float]:
    """This process's kvserve: the median time (s) of each kernel case, and W1's wall time."""
    import torch

    from attention_kernel import alternate, decode_case
    from kvserve.model import paged_kernel

    if not paged_kernel.available():
        raise SystemExit(f"kernel unavailable: {paged_kernel.unavailable_reason()}")
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, batch = decode_case(128, dtype, sort=True)
        tables, lens = batch.decode_block_tables, batch.decode_context_lens
        cases[f"decode {str(dtype)[6:]}"] = \
            lambda q=q, k=k, v=v, t=tables, n=lens: paged_kernel.decode_attention(q, k, v, t, n)
        gen = torch.Generator().manual_seed(1)
        q = torch.randn((512, 9, 64), generator=gen).to(dtype)
        table = torch.randperm(k.shape[0], generator=gen)[:32]
        cases[f"prefill {str(dtype)[6:]} 512"] = \
            lambda q=q, k=k, v=v, t=table: paged_kernel.prefill_attention(q, k, v, t, 512)
    cases["layer ops bf16 x30"] = layer_ops_step(torch.bfloat16)
    timings = alternate(list(cases.values()), reps)
    result = {name: median for name, (median, _) in zip(cases, timings, strict=True)}
    if w1_n:
        from offline_throughput import run

        result["W1 offline bf16"] = run("w1", w1_n, "bfloat16", 16, 2 << 30)["wall_s"]
    return result


def layer_ops_step(dtype: Any) -> Callable[[], None]:
    """A 128-token decode step's fused layer ops over 30 layers, SmolLM2-135M's sizes."""
    import torch

    from kvserve.model import paged_kernel

    ops = paged_kernel.layer_ops()
    gen = torch.Generator().manual_seed(2)
    tokens, hidden, inter, heads, kv_heads, dim = 128, 576, 1536, 9, 3, 64
    x = torch.randn((tokens, hidden), generator=gen).to(dtype)
    residual = torch.randn((tokens, hidden), generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    gate_up = torch.randn((tokens, 2 * inter), generator=gen).to(dtype)
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * dim), generator=gen).to(dtype)
    positions = torch.randint(0, 600, (tokens,), generator=gen)
    angles = torch.arange(2048)[:, None] * torch.rand(dim // 2, generator=gen)[None, :]
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    k_cache = torch.zeros((64, 16, kv_heads, dim), dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(64 * 16, generator=gen)[:tokens]

    def step() -> None:
        for _ in range(30):
            ops.add_rms_norm_(x, residual, weight, 1e-5)
            ops.rope_and_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, heads,
                                  kv_heads)
            ops.add_rms_norm_(x, residual, weight, 1e-5)
            ops.silu_and_mul(gate_up)

    return step


def run_side(side: str, src: Path, reps: int, w1_n: int) -> dict[str, float]:
    # Each side's extension in a cache of its own: older code names its build by source
    # alone, and another checkout of that source loading it meanwhile would rebuild it.
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" /
                                "torch_extensions")) / f"kernel_ab-{side}"
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{BENCHMARKS}",
               TORCH_EXTENSIONS_DIR=str(cache),
               OMP_WAIT_POLICY="PASSIVE")  # as kvserve runs by default; the machine is shared
    out = subprocess.run([sys.executable, __file__, "--worker", "--reps", str(reps),
                          "--w1-n", str(w1_n)], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def load() -> str:
    """The load averages over 1, 5 and 15 minutes: how busy the shared machine was."""
    return " / ".join(Path("/proc/loadavg").read_text().split()[:3])


def revision(src: Path) -> str:
    """The commit a checkout's src belongs to, or its path when it is not a git checkout."""
    out = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else str(src)


def markdown(pairs: list[dict[str, dict[str, float]]], command: str, base: str, head: str,
             loads: list[str]) -> str:
    from kvserve.model.kernel_info import cpu_info, isa_line

    cpu = cpu_info()
    names = list(pairs[0]["base"])
    lines = ["## C++ kernels, A/B against the previous code", "",
             f"`{command}`: base = {base}, head = {head}, pairs: {len(pairs)}, alternated "
             "(which side runs first alternates too), each side a fresh process. CPU: "
             f"{cpu.model}, {cpu.logical_cpus} logical CPUs; ISA: {isa_line(cpu)}. Load "
             f"average (1, 5, 15 min) before and after: {loads[0]} and {loads[-1]}.", "",
             "Kernel rows are each side's median of the alternated reps (ms); W1 is wall "
             "seconds. Ratio = base / head: above 1, head is faster.", "",
             "| measure | base per pair | head per pair | pair ratios | median ratio "
             "| ratio of minima |", "|---|---|---|---|---|---|"]
    for name in names:
        scale, unit = (1.0, "s") if name.startswith("W1") else (1e3, "ms")
        base_runs = [p["base"][name] * scale for p in pairs]
        head_runs = [p["head"][name] * scale for p in pairs]
        ratios = [b / h for b, h in zip(base_runs, head_runs, strict=True)]
        lines.append(
            f"| {name} ({unit}) | {', '.join(f'{x:.2f}' for x in base_runs)} "
            f"| {', '.join(f'{x:.2f}' for x in head_runs)} "
            f"| {', '.join(f'{r:.3f}' for r in ratios)} | {statistics.median(ratios):.3f} "
            f"| {min(base_runs) / min(head_runs):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="the other checkout's src directory")
    parser.add_argument("--head", type=Path, default=ROOT / "src",
                        help="this side's src directory (default: this checkout's)")
    parser.add_argument("--base-label", help="how to name the base (default: its commit or "
                        "path)")
    parser.add_argument("--head-label", help="how to name the head (default: its commit or "
                        "path)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--w1-n", type=int, default=128, help="W1 requests (0: skip W1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the pairs to this file")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.reps, args.w1_n)))
        return 0
    if args.base is None or not (args.base / "kvserve").is_dir():
        parser.error("--base must be a checkout's src directory (holding kvserve/)")
    sys.path[:0] = [str(args.head), str(BENCHMARKS)]
    from docs_section import publish

    loads, pairs = [load()], []
    for index in range(args.pairs):
        sides = ("base", "head") if index % 2 == 0 else ("head", "base")
        pair = {}
        for side in sides:
            start = time.perf_counter()
            pair[side] = run_side(side, args.base if side == "base" else args.head,
                                  args.reps, args.w1_n)
            print(f"pair {index + 1} {side}: {time.perf_counter() - start:.0f} s "
                  f"{json.dumps(pair[side])}", flush=True)
        pairs.append(pair)
        loads.append(load())
    command = "python benchmarks/kernel_ab.py " + " ".join(sys.argv[1:])
    section = markdown(pairs, command, args.base_label or revision(args.base),
                       args.head_label or revision(args.head), loads)
    publish("kernel_ab", section, pairs, args.json, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
