#!/usr/bin/env python
"""--quantization int8 against the float model on this CPU: the kernel, the quality, W1.

- **kernel**: int8_linear (csrc/int8_linear.cpp) against the AVX2 float32 panels and, where
  oneDNN runs bf16 natively (AVX512-BF16, AMX: where ``--dtype auto`` is bf16), oneDNN's
  packed bf16 GEMM, over SmolLM2-135M's layer projections x 30 layers of distinct weights at
  1-2,048 rows, alternated rounds in one process (panel_linear.py's harness; the int8 figure
  includes quantizing the rows, the bf16 one converting them);
- **quality**: the bundled model in float32 and in int8 over fixed English text (the first
  ``--texts`` topics of Python's own ``pydoc_data``, in every CPython, so the text is the
  same on every machine), teacher-forced: perplexity, and how often the int8 model's top
  token is the float model's; then greedy continuations of ``--prompts`` openings of those
  texts (48 tokens): how many are identical, and the mean number of tokens before the first
  difference;
- **W1**: benchmarks/offline_throughput.py on W1 (``--n`` requests) in ``--dtype auto``
  (float32 on AVX2, bf16 where the CPU computes it natively), without then with int8,
  ``--pairs`` alternated pairs, each run its own process; the ratio of minima and the
  median of the pair ratios.

Writes the section ``quantization:<cpu>`` of docs/benchmarks.md with ``--write-docs``. Run it
under the bench lock, nothing else running:

    flock /tmp/kvserve-bench.lock python benchmarks/quantization.py --write-docs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from ab_protocol import cpu, cpu_slug, cpu_title
from docs_section import publish
from kvserve.core import SamplingParams
from kvserve.engine.llm import LLM, load_model
from kvserve.model import paged_kernel
from kvserve.model.dtype import auto_dtype_name
from kvserve.model.input_batch import SequenceSlice, build_batch
from kvserve.model.kernel_info import onednn_runs_bf16
from kvserve.model.kv_cache import allocate_kv_cache
from kvserve.model.llama import LlamaForCausalLM, pack_panels
from kvserve.model.quantization import int8_linear_available, pack_int8
from kvserve.model.tokenizer import Tokenizer
from panel_linear import LAYERS, ROWS, SHAPES, Way, measure

HERE = Path(__file__).resolve().parent
BLOCK = 16
TEXT_TOKENS = 1024  # each text's first tokens, teacher-forced
GREEDY_PROMPT_TOKENS, GREEDY_TOKENS = 32, 48


def kernel_rows(row_counts: list[int], rounds: int) -> list[dict]:
    torch.manual_seed(0)
    ops = paged_kernel.layer_ops()
    weights = [torch.randn(n, k) for _ in range(LAYERS) for n, k in SHAPES]
    floats = [(w.shape[1], w.shape[0], pack_panels(w)) for w in weights]
    int8s = [(w.shape[1], w.shape[0], *pack_int8(w)) for w in weights]

    def float32_panels(xs: dict[int, torch.Tensor]) -> None:
        for k, n, panels in floats:
            ops.panel_linear(xs[k], panels, n)

    def int8_panels(xs: dict[int, torch.Tensor]) -> None:
        for k, n, panels, scales in int8s:
            ops.int8_linear(xs[k], panels, scales, n)

    ways: dict[str, Way] = {"float32 panels": float32_panels, "int8_linear": int8_panels}
    if onednn_runs_bf16():  # what --dtype auto projects with on this CPU
        packed = [(w.shape[1], torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16),
                                                                       None))
                  for w in weights]

        def onednn_bf16(xs: dict[int, torch.Tensor]) -> None:
            for k, weight in packed:
                torch.ops.mkldnn._linear_pointwise(xs[k].to(torch.bfloat16), weight, None,
                                                   "none", [], "")

        ways["oneDNN bf16"] = onednn_bf16
    return measure(ways, row_counts, rounds, torch.float32)


def texts(count: int) -> list[str]:
    """Fixed English prose: the first ``count`` topics of pydoc_data, by name."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)[:count]]


def token_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one sequence run as a single prefill."""
    blocks = -(-len(ids) // BLOCK)
    caches = allocate_kv_cache(model.config, blocks, BLOCK, torch.float32)
    batch = build_batch([], [SequenceSlice(ids, 0, list(range(blocks)), True)], BLOCK)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(ids)))
    with torch.no_grad():
        return model.compute_logits(model(batch, caches))


def quality(text_count: int, prompt_count: int) -> dict:
    models: dict[str, LlamaForCausalLM] = {}
    tokenizer: Tokenizer | None = None
    for name, quantization in (("float32", None), ("int8", "int8")):
        models[name], tokenizer = load_model(None, torch.float32, quantization=quantization)
    assert tokenizer is not None
    sequences = [tokenizer.encode(text)[:TEXT_TOKENS] for text in texts(text_count)]
    nll = {name: 0.0 for name in models}
    agree = positions = 0
    for ids in sequences:
        target = torch.tensor(ids[1:])
        tops = {}
        for name, model in models.items():
            logits = token_logits(model, ids)[:-1]
            nll[name] += float(torch.nn.functional.cross_entropy(logits, target,
                                                                 reduction="sum"))
            tops[name] = logits.argmax(-1)
        agree += int((tops["float32"] == tops["int8"]).sum())
        positions += len(ids) - 1
    prompts = [ids[:GREEDY_PROMPT_TOKENS] for ids in sequences[:prompt_count]]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
    outputs = {}
    for name, quantization in (("float32", None), ("int8", "int8")):
        llm = LLM(None, dtype="float32", quantization=quantization, detokenize=False)
        outputs[name] = [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    same_prefix = []
    for a, b in zip(outputs["float32"], outputs["int8"], strict=True):
        same_prefix.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True))
                                 if x != y), len(a)))
    return {"texts": len(sequences), "positions": positions,
            "perplexity": {name: math.exp(total / positions) for name, total in nll.items()},
            "top1_agreement": agree / positions, "prompts": len(prompts),
            "identical": sum(n == GREEDY_TOKENS for n in same_prefix),
            "mean_same_prefix": statistics.mean(same_prefix)}


def w1_run(quantization: str | None, n: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, str(HERE / "offline_throughput.py"), "--workload", "w1",
                   "--n", str(n), "--dtype", "auto", "--json", out.name]
        if quantization:
            command += ["--quantization", quantization]
        subprocess.run(command, check=True, cwd=HERE, stdout=subprocess.DEVNULL)
        row = json.loads(Path(out.name).read_text())[0]
    print(f"W1 {row['dtype']} {quantization or ''}: {row['wall_s']:.1f} s", flush=True)
    return row


def w1_pairs(pairs: int, n: int) -> dict:
    walls: dict[str, list[float]] = {"float": [], "int8": []}
    preemptions: dict[str, list[int]] = {"float": [], "int8": []}
    for _ in range(pairs):
        for name, quantization in (("float", None), ("int8", "int8")):
            row = w1_run(quantization, n)
            walls[name].append(row["wall_s"])
            preemptions[name].append(row["preemptions"])
    ratios = [f / q for f, q in zip(walls["float"], walls["int8"], strict=True)]
    return {"n": n, "dtype": auto_dtype_name(), "walls": walls, "preemptions": preemptions,
            "ratio_of_minima": min(walls["float"]) / min(walls["int8"]),
            "median_pair_ratio": statistics.median(ratios)}


def section(args: argparse.Namespace, kernel: list[dict], judged: dict | None,
            w1: dict | None) -> str:
    model_name, flags = cpu()
    load = Path("/proc/loadavg").read_text().split()[0]
    lines = [f"## --quantization int8 on {cpu_title(model_name, flags)}", "",
             f"`python benchmarks/quantization.py {' '.join(sys.argv[1:])}` at "
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on **{model_name}** (ISA: "
             f"{flags}), load average {load} after; torch threads {torch.get_num_threads()}.",
             "", f"Kernel: SmolLM2-135M's four layer projections x {LAYERS} layers of distinct "
             f"weights, median ms of {args.rounds} alternated rounds (int8 includes quantizing "
             "the rows); speed-up = the float kernel's ms / int8_linear's.", ""]
    bf16 = "oneDNN bf16" in kernel[0]
    lines += ["| rows | float32 panels ms | GFLOP/s | int8_linear ms | GOP/s | speed-up |"
              + (" oneDNN bf16 ms | GFLOP/s | int8 speed-up over bf16 |" if bf16 else ""),
              "|---|---|---|---|---|---|" + ("---|---|---|" if bf16 else "")]
    for r in kernel:
        f, q = r["float32 panels"], r["int8_linear"]
        row = (f"| {r['rows']} | {f['ms']:.1f} | {f['gflops']:.0f} | {q['ms']:.1f} | "
               f"{q['gflops']:.0f} | {f['ms'] / q['ms']:.2f}x |")
        if bf16:
            b = r["oneDNN bf16"]
            row += f" {b['ms']:.1f} | {b['gflops']:.0f} | {b['ms'] / q['ms']:.2f}x |"
        lines.append(row)
    if judged:
        p = judged["perplexity"]
        lines += ["", f"Quality (the bundled model, float32 against int8): {judged['texts']} "
                  f"texts, {judged['positions']:,} positions teacher-forced: perplexity "
                  f"{p['float32']:.3f} (float32) against {p['int8']:.3f} (int8, "
                  f"{p['int8'] / p['float32'] - 1:+.1%}); the int8 model's top token is the "
                  f"float model's at {judged['top1_agreement']:.1%} of positions. Greedy, "
                  f"{judged['prompts']} prompts of {GREEDY_PROMPT_TOKENS} tokens, "
                  f"{GREEDY_TOKENS} tokens each: {judged['identical']} identical, "
                  f"{judged['mean_same_prefix']:.1f} tokens on average before the first "
                  "difference."]
    if w1:
        walls = w1["walls"]
        dtype = w1["dtype"]
        lines += ["", f"W1 ({w1['n']} requests, --dtype auto = {dtype}, KV cache of 1 GiB, "
                  f"benchmarks/offline_throughput.py per run, alternated, {dtype} first): "
                  f"{dtype} {', '.join(f'{s:.1f}' for s in walls['float'])} s; {dtype} + int8 "
                  f"{', '.join(f'{s:.1f}' for s in walls['int8'])} s; preemptions "
                  f"{w1['preemptions']['float']} against {w1['preemptions']['int8']}. "
                  f"int8 is **{w1['ratio_of_minima']:.2f}x** by the ratio of minima, "
                  f"{w1['median_pair_ratio']:.2f}x by the median of the pair ratios."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=2, help="W1 pairs (0: skip W1)")
    parser.add_argument("--n", type=int, default=128, help="W1's first N requests")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if not int8_linear_available():
        print("int8_linear needs the C++ kernels on an AVX2 CPU", file=sys.stderr)
        return 2
    kernel = kernel_rows(args.rows, args.rounds)
    judged = None if args.skip_quality else quality(args.texts, args.prompts)
    if judged:
        print(json.dumps(judged), flush=True)
    w1 = w1_pairs(args.pairs, args.n) if args.pairs else None
    model_name, flags = cpu()
    publish(f"quantization:{cpu_slug(model_name, flags)}", section(args, kernel, judged, w1),
            [{"kernel": kernel, "quality": judged, "w1": w1}], None, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
