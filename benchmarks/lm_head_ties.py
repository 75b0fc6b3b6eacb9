#!/usr/bin/env python
"""What breaking the bf16 LM head's rounding ties costs (kvserve.model.logits).

The bundled model's LM head in bfloat16, timed at 1-256 rows (a decode step's sequences) on
hidden states made by the model's own final norm, three ways alternately: the head and a
plain ``.float()`` (what ``compute_logits`` did before), ``compute_logits`` (the fused C++
``widen_logits`` finds the tied rows in that cast), and the same with the torch fallback
(no C++ extension). Then a greedy step's tokens both ways: ``compute_logits`` and the
sampler's argmax (``sampler.greedy_tokens``), against ``LlamaForCausalLM.greedy_tokens`` (the
C++ ``greedy_rows``, no float32 logits; what a step of plain greedy rows runs). Each figure is
the median of ``--rounds`` alternated rounds. Run it under the bench lock:

    flock /tmp/kvserve-bench.lock python benchmarks/lm_head_ties.py --write-docs
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import torch

from ab_protocol import cpu
from docs_section import publish
from kvserve.model import logits as logits_module
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import load_model_weights
from kvserve.model.sampler import greedy_tokens

ROWS = (1, 16, 64, 128, 256)


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


@contextlib.contextmanager
def torch_fallback() -> Iterator[None]:
    """widen_logits through torch ops, as without the C++ extension."""
    handles = logits_module.paged_kernel.handles
    logits_module.paged_kernel.handles = lambda dtype: False
    try:
        yield
    finally:
        logits_module.paged_kernel.handles = handles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    config, weights = load_model_weights(None, torch.bfloat16)
    model = LlamaForCausalLM.from_weights(config, weights)
    head = model.lm_head
    rows_out = []
    with torch.no_grad():
        for rows in ROWS:
            ids = torch.randint(0, config.vocab_size, (rows,))
            hidden = model.norm(model.embed_tokens(ids) * 8)
            plain, fused, fallback, via_logits, direct = [], [], [], [], []
            for _ in range(args.rounds):
                plain.append(timed(lambda h=hidden: head(h).float(), args.repeats))
                fused.append(timed(lambda h=hidden: model.compute_logits(h), args.repeats))
                with torch_fallback():
                    fallback.append(timed(lambda h=hidden: model.compute_logits(h), args.repeats))
                via_logits.append(timed(lambda h=hidden: greedy_tokens(model.compute_logits(h)),
                                        args.repeats))
                direct.append(timed(lambda h=hidden: model.greedy_tokens(h), args.repeats))
            assert torch.equal(model.greedy_tokens(hidden),
                               greedy_tokens(model.compute_logits(hidden)))
            rows_out.append({"rows": rows, "head_ms": statistics.median(plain) * 1e3,
                             "fused_ms": statistics.median(fused) * 1e3,
                             "torch_ms": statistics.median(fallback) * 1e3,
                             "greedy_via_logits_ms": statistics.median(via_logits) * 1e3,
                             "greedy_direct_ms": statistics.median(direct) * 1e3})
    model_name, flags = cpu()
    load = Path("/proc/loadavg").read_text().split()[0]
    lines = ["## What breaking bf16 rounding ties in the LM head costs", "",
             f"`python benchmarks/lm_head_ties.py --write-docs` at "
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on **{model_name}** "
             f"(ISA: {flags}), load average {load} after; torch threads "
             f"{torch.get_num_threads()}. The bundled SmolLM2-135M's LM head (49,152 x 576, "
             f"bf16, oneDNN packed): the head and `.float()` (before), `compute_logits` with "
             f"the fused C++ `widen_logits` tie check (kvserve/model/logits.py), and with its "
             f"torch fallback; a greedy step's tokens through compute_logits and the "
             f"sampler's argmax, and through `greedy_tokens` (C++ `greedy_rows`, the same "
             f"tokens, checked); median of {args.rounds} alternated rounds of {args.repeats} "
             f"calls.", "",
             "| rows | head + .float() ms | compute_logits ms (C++) | extra | "
             "compute_logits ms (torch fallback) | extra | greedy: compute_logits + argmax "
             "ms | greedy: greedy_tokens ms (greedy_rows) | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        lines.append(f"| {r['rows']} | {r['head_ms']:.3f} | {r['fused_ms']:.3f} | "
                     f"{r['fused_ms'] / r['head_ms'] - 1:+.1%} | {r['torch_ms']:.3f} | "
                     f"{r['torch_ms'] / r['head_ms'] - 1:+.1%} | "
                     f"{r['greedy_via_logits_ms']:.3f} | {r['greedy_direct_ms']:.3f} | "
                     f"{r['greedy_via_logits_ms'] / r['greedy_direct_ms']:.2f}x |")
    publish("lm_head_ties", "\n".join(lines), rows_out, None, args.write_docs)


if __name__ == "__main__":
    main()
