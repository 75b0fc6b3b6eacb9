#!/usr/bin/env python
"""The C++ kernels of two checkouts, A/B: kernel calls interleaved in one process, and W1
offline in alternated processes.

Kernels: both checkouts' csrc/ are built as two extension modules and loaded into this one
process, and every case calls base, head, base, head ... (``--reps`` pairs), so both sides
see the same machine at the same moments; per case each side's median and minimum, the
median of the per-pair ratios and the ratio of the minima. Cases: the decode kernel on a
W1-like batch (128 requests, contexts uniform in [64, 640], SmolLM2's attention shape, as
benchmarks/attention_kernel.py), float32 and bfloat16, one layer (its ~35 MB of K and V
partly in the last-level cache from call to call); the same batch over 30 layers of a 2 GiB
bf16 pool (read from memory, as in the engine); a 512-token prefill chunk (and on a build
with AMX tiles, bf16 chunks of 128, 320 and 512 tokens on them); the fused layer
ops of a 128-token decode step over 30 layers (float32 and bf16); on an AVX512-BF16 build, the
layer projections of 30 layers on the bf16 panels at 1, 12 and 128 rows.

W1: each side's whole engine (its ``kvserve`` from its ``src``) runs W1 offline (in the dtype
``--dtype auto`` picks here: bf16 where the CPU computes it natively, else float32;
decode-heavy: 128 output tokens per request; benchmarks/offline_throughput.py) in a fresh
process, ``--pairs`` pairs, which side goes first alternating; wall seconds per pair, the
median of the pair ratios and the ratio of the minima. Ratios are base / head: above 1, head
is faster.

    mkdir -p /tmp/base && git archive a0fe011 src | tar -x -C /tmp/base
    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/kernel_ab.py \\
        --base /tmp/base/src [--head DIR/src] [--pairs 3] [--reps 31] [--w1-n 32] \\
        [--write-docs]

``--section NAME`` writes the table under its own markers in docs/benchmarks.md (the default,
kernel_ab, is replaced by every run that writes the docs).

One checkout under two settings: ``--base-env`` / ``--head-env VAR=VALUE`` (repeatable) set
environment variables for that side's W1 processes, and ``--reps 0`` skips the kernel cases
(the same csrc on both sides). On an AMX CPU, whether oneDNN-AMX or the AVX512-BF16 panels
should take decode's small calls, end to end:

    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/kernel_ab.py --base src \\
        --base-env KVSERVE_PROJECTIONS=onednn --head-env KVSERVE_PROJECTIONS=hybrid \\
        --reps 0 --pairs 5 --w1-n 128
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("TORCH_EXTENSIONS_DIR",
                            Path.home() / ".cache" / "torch_extensions")) / "kernel_ab"
IDENTICAL = {True: "yes", False: "no", None: "n/a"}
DEFAULT_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]  # before CFLAGS was read
SECTION_NAME = re.compile(r"[A-Za-z0-9_]+")  # --section: the name inside its docs markers


def checkout_cflags(src: Path) -> list[str]:
    """The compiler flags a checkout builds its kernels with: its paged_kernel.py's CFLAGS,
    read without importing it (the flags are part of what an A/B compares)."""
    tree = ast.parse((src / "kvserve" / "model" / "paged_kernel.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "CFLAGS" for target in node.targets):
            return list(ast.literal_eval(node.value))
    return DEFAULT_CFLAGS


def load_kernels(src: Path, side: str) -> ModuleType:
    """A checkout's csrc/ built as its own extension module (cached by source hash)."""
    from torch.utils import cpp_extension

    csrc = src / "kvserve" / "model" / "csrc"
    cflags = checkout_cflags(src)
    sources = sorted(csrc.glob("*.cpp"))
    files = sources + sorted(csrc.glob("*.h"))
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files) +
                            " ".join(cflags).encode()).hexdigest()[:12]
    name = f"kvserve_ab_{side}_{digest}"
    build = CACHE / name
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name=name, sources=[str(f) for f in sources],
                              extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                              build_directory=str(build), verbose=False)


def interleave(fns: list[Callable[[], Any]], reps: int) -> list[list[float]]:
    """Seconds of each call, run round-robin (after one warm-up each)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for index, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[index].append(time.perf_counter() - start)
    return times


def kernel_cases(kernels: ModuleType) -> dict[str, Callable[[], Any]]:
    """The timed calls on one side's module; the same inputs for every module."""
    import torch

    from attention_kernel import decode_case

    cases: dict[str, Callable[[], Any]] = {}
    scale = 1 / 8  # 1/sqrt(head_dim 64)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype)[6:]
        q, k, v, batch = decode_case(128, dtype, sort=True)
        tables, lens = batch.decode_block_tables, batch.decode_context_lens
        cases[f"decode {name}"] = lambda q=q, k=k, v=v, t=tables, n=lens: \
            kernels.decode_attention(q, k, v, t, n, scale)
        gen = torch.Generator().manual_seed(1)
        q = torch.randn((512, 9, 64), generator=gen).to(dtype)
        table = torch.randperm(k.shape[0], generator=gen)[:32]
        cases[f"prefill {name} 512"] = lambda q=q, k=k, v=v, t=table: \
            kernels.prefill_attention(q, k, v, t, 512, scale)
        if dtype == torch.bfloat16 and not kernels.amx_bf16_status():
            for rows in (128, 320, 512):  # W1's prompts are 64-512 tokens
                cases[f"prefill bfloat16 {rows} on AMX tiles"] = \
                    lambda q=q[:rows], k=k, v=v, t=table, n=rows: \
                    kernels.amx_prefill_attention(q, k, v, t, n, scale)
    cases["decode bfloat16 x30 (2 GiB pool)"] = decode_pool_step(kernels)
    cases["layer ops float32 x30"] = layer_ops_step(kernels, torch.float32)
    cases["layer ops bf16 x30"] = layer_ops_step(kernels, torch.bfloat16)
    if kernels.panel_linear_bf16_compiled():
        for rows in (1, 12, 128):
            cases[f"bf16 panel projections x30, {rows} rows"] = projections_step(kernels, rows)
    return cases


def projections_step(kernels: ModuleType, rows: int) -> Callable[[], Any]:
    """A decode step's layer projections on the AVX512-BF16 panels (panel_linear_bf16):
    SmolLM2-135M's q/k/v, o, gate/up and down, 30 layers of distinct bf16 weights (212 MB,
    shared by both sides), so every call streams its weight from memory as in the engine."""
    import torch

    from kvserve.model.llama import pack_pair_panels

    if "panels" not in _POOL:
        gen = torch.Generator().manual_seed(4)
        shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
        _POOL["panels"] = [
            (pack_pair_panels((torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)),
             shape) for _ in range(30) for shape in shapes]
    gen = torch.Generator().manual_seed(rows)
    inputs = {k: torch.randn((rows, k), generator=gen).to(torch.bfloat16) for k in (576, 1536)}

    def step() -> Any:  # each output's sum: comparable between the sides, cheap to keep
        return torch.stack([kernels.panel_linear_bf16(inputs[k], panels, n).double().sum()
                            for panels, (n, k) in _POOL["panels"]])

    return step


_POOL: dict[str, Any] = {}


def decode_pool_step(kernels: ModuleType) -> Callable[[], Any]:
    """A W1-like decode step as the engine runs it: 30 layers, each its own K and V caches in
    a 2 GiB bf16 pool (W1's; SmolLM2's shape, block size 16), 128 requests of contexts uniform in
    [64, 640] on shuffled blocks, so the step reads ~1 GB from memory, not cache. The caches
    are built once and shared by both sides."""
    import torch

    if not _POOL:
        layers, block, kv_heads, dim = 30, 16, 3, 64
        num_blocks = (2 << 30) // (block * kv_heads * dim * 2 * 2 * layers)
        gen = torch.Generator().manual_seed(3)
        lens = torch.randint(64, 641, (128,), generator=gen).sort(descending=True).values
        needed = (lens + block - 1) // block
        perm = torch.randperm(num_blocks, generator=gen)
        tables = torch.zeros((128, int(needed.max())), dtype=torch.long)
        start = 0
        for row, count in enumerate(needed.tolist()):
            tables[row, :count] = perm[start:start + count]
            start += count
        shape = (num_blocks, block, kv_heads, dim)
        _POOL.update(
            caches=[(torch.randn(shape, generator=gen).to(torch.bfloat16),
                     torch.randn(shape, generator=gen).to(torch.bfloat16))
                    for _ in range(layers)],
            q=torch.randn((128, 9, dim), generator=gen).to(torch.bfloat16),
            tables=tables, lens=lens)

    def step() -> Any:
        outs = [kernels.decode_attention(_POOL["q"], k, v, _POOL["tables"], _POOL["lens"],
                                         1 / 8) for k, v in _POOL["caches"]]
        return torch.cat([out.flatten() for out in outs])

    return step


def layer_ops_step(ops: ModuleType, dtype: Any) -> Callable[[], Any]:
    """A 128-token decode step's fused layer ops over 30 layers, SmolLM2-135M's sizes; returns
    everything they wrote, flattened, so the first call of each side can be compared."""
    import torch

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

    def step() -> Any:
        for _ in range(30):
            normed = ops.add_rms_norm_(x, residual, weight, 1e-5)
            ops.rope_and_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, heads,
                                  kv_heads)
            ops.add_rms_norm_(x, residual, weight, 1e-5)
            activated = ops.silu_and_mul(gate_up)
        return torch.cat([t.flatten() for t in (normed, residual, qkv, k_cache, v_cache,
                                                activated)])

    return step


def compare_kernels(base: Path, head: Path, reps: int) -> list[dict[str, Any]]:
    import torch

    sides = [load_kernels(base, "base"), load_kernels(head, "head")]
    base_cases, head_cases = (kernel_cases(module) for module in sides)
    rows = []
    for name in base_cases:
        outputs = base_cases[name](), head_cases[name]()
        same = torch.equal(*outputs) if isinstance(outputs[0], torch.Tensor) else None
        base_s, head_s = interleave([base_cases[name], head_cases[name]], reps)
        ratios = [b / h for b, h in zip(base_s, head_s, strict=True)]
        rows.append(dict(measure=name, base_median=statistics.median(base_s),
                         head_median=statistics.median(head_s), base_min=min(base_s),
                         head_min=min(head_s), median_ratio=statistics.median(ratios),
                         min_ratio=min(base_s) / min(head_s), identical=same))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def w1_dtype() -> str:
    """What ``--dtype auto`` runs the bundled model in on this CPU (bf16 where it is native,
    float32 elsewhere): W1 runs in it."""
    from kvserve.model.dtype import auto_dtype_name

    return auto_dtype_name()


def w1_worker(w1_n: int) -> float:
    from offline_throughput import run

    return run("w1", w1_n, w1_dtype(), 16, 2 << 30)["wall_s"]


def side_environment(settings: list[str]) -> dict[str, str]:
    """``VAR=VALUE`` settings (``--base-env`` / ``--head-env``) as a dict; ValueError naming
    one without ``=`` or a name."""
    env = {}
    for setting in settings:
        name, equals, value = setting.partition("=")
        if not equals or not name.strip():
            raise ValueError(f"{setting!r} is not VAR=VALUE")
        env[name.strip()] = value
    return env


def run_w1(side: str, src: Path, w1_n: int, extra_env: dict[str, str] | None = None) -> float:
    # Each side's extension in a cache of its own: older code names its build by source
    # alone, and another checkout of that source loading it meanwhile would rebuild it.
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{BENCHMARKS}",
               TORCH_EXTENSIONS_DIR=str(CACHE.parent / f"kernel_ab-{side}"),
               OMP_WAIT_POLICY="PASSIVE")  # as kvserve runs by default; the machine is shared
    env.update(extra_env or {})
    out = subprocess.run([sys.executable, __file__, "--w1-worker", "--w1-n", str(w1_n)],
                         env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


def load() -> str:
    """The load averages over 1, 5 and 15 minutes: how busy the shared machine was."""
    return " / ".join(Path("/proc/loadavg").read_text().split()[:3])


def revision(src: Path) -> str:
    """The commit a checkout's src belongs to, or its path when it is not a git checkout."""
    out = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else str(src)


def markdown(kernels: list[dict[str, Any]], w1: list[dict[str, float]], reps: int,
             command: str, labels: tuple[str, str], loads: list[str]) -> str:
    from kvserve.model.kernel_info import cpu_info, isa_line

    cpu = cpu_info()
    lines = ["## C++ kernels, A/B against the previous code", "",
             f"`{command}`: base = {labels[0]}, head = {labels[1]}. CPU: {cpu.name}, "
             f"{cpu.logical_cpus} logical CPUs; ISA: {isa_line(cpu)}. Load average (1, 5, "
             f"15 min) at the start, after the kernels and at the end: {', '.join(loads)} "
             "(a shared machine).", ""]
    if kernels:
        lines += [f"Kernels, both sides in one process, calls interleaved base/head, {reps} "
                  "pairs per case (ms). Ratio = base / head: above 1, head is faster.", "",
                  "| case | base median | head median | base min | head min | median of "
                  "pair ratios | ratio of minima | outputs identical |",
                  "|---|---|---|---|---|---|---|---|"]
    else:
        lines.append("Kernel cases: not run (`--reps 0`).")
    for r in kernels:
        lines.append(f"| {r['measure']} | {r['base_median'] * 1e3:.2f} "
                     f"| {r['head_median'] * 1e3:.2f} | {r['base_min'] * 1e3:.2f} "
                     f"| {r['head_min'] * 1e3:.2f} | {r['median_ratio']:.3f} "
                     f"| {r['min_ratio']:.3f} "
                     f"| {IDENTICAL[r['identical']]} |")
    if w1:
        base_runs, head_runs = [p["base"] for p in w1], [p["head"] for p in w1]
        ratios = [b / h for b, h in zip(base_runs, head_runs, strict=True)]
        lines += ["", f"W1 offline ({w1_dtype()}), wall s, {len(w1)} pairs of fresh processes, "
                  "which side first alternating:", "",
                  "| pair | base s | head s | base / head |", "|---|---|---|---|"]
        lines += [f"| {i + 1} | {b:.1f} | {h:.1f} | {r:.3f} |"
                  for i, (b, h, r) in enumerate(zip(base_runs, head_runs, ratios,
                                                    strict=True))]
        lines.append(f"| median of pair ratios; ratio of minima | | | "
                     f"{statistics.median(ratios):.3f}; "
                     f"{min(base_runs) / min(head_runs):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="the other checkout's src directory")
    parser.add_argument("--head", type=Path, default=ROOT / "src",
                        help="this side's src directory (default: this checkout's)")
    parser.add_argument("--base-label", help="how to name the base (default: its commit)")
    parser.add_argument("--head-label", help="how to name the head (default: its commit)")
    parser.add_argument("--pairs", type=int, default=3, help="W1 pairs")
    parser.add_argument("--reps", type=int, default=31, help="interleaved pairs per kernel case")
    parser.add_argument("--w1-n", type=int, default=32, help="W1 requests (0: skip W1)")
    parser.add_argument("--base-env", action="append", default=[], metavar="VAR=VALUE",
                        help="an environment variable for the base side's W1 runs")
    parser.add_argument("--head-env", action="append", default=[], metavar="VAR=VALUE",
                        help="an environment variable for the head side's W1 runs")
    parser.add_argument("--w1-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--section", default="kernel_ab",
                        help="the docs/benchmarks.md section to write (default kernel_ab: "
                             "each run replaces the last; name one, e.g. kernel_ab_decode, "
                             "to keep a table beside the others)")
    args = parser.parse_args()
    if not SECTION_NAME.fullmatch(args.section):
        parser.error(f"--section {args.section!r}: letters, digits and _ only (it names the "
                     "section's <!-- markers --> in docs/benchmarks.md)")
    if args.w1_worker:
        print(w1_worker(args.w1_n))
        return 0
    if args.base is None or not (args.base / "kvserve").is_dir():
        parser.error("--base must be a checkout's src directory (holding kvserve/)")
    try:
        sides_env = {"base": side_environment(args.base_env),
                     "head": side_environment(args.head_env)}
    except ValueError as error:
        parser.error(f"--base-env / --head-env: {error}")
    sys.path[:0] = [str(ROOT / "src"), str(BENCHMARKS)]
    from docs_section import publish

    loads = [load()]
    kernels = compare_kernels(args.base, args.head, args.reps) if args.reps else []
    loads.append(load())
    w1 = []
    for index in range(args.pairs if args.w1_n else 0):
        pair = {}
        for side in ("base", "head") if index % 2 == 0 else ("head", "base"):
            pair[side] = run_w1(side, args.base if side == "base" else args.head, args.w1_n,
                                sides_env[side])
            print(f"W1 pair {index + 1} {side}: {pair[side]:.1f} s", flush=True)
        w1.append(pair)
    loads.append(load())
    if args.json:  # the figures first, whatever happens to the formatting
        Path(args.json).write_text(json.dumps({"kernels": kernels, "w1": w1}, indent=1))
    labels = tuple(" ".join([getattr(args, f"{side}_label") or revision(src),
                             *getattr(args, f"{side}_env")])
                   for side, src in (("base", args.base), ("head", args.head)))
    command = "python benchmarks/kernel_ab.py " + " ".join(sys.argv[1:])
    section = markdown(kernels, w1, args.reps, command, labels, loads)
    publish(args.section, section, {"kernels": kernels, "w1": w1}, args.json, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
