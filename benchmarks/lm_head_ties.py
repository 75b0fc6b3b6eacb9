#!/usr/bin/env python
"""What breaking the bf16 LM head's rounding ties costs (kvserve.model.logits).

The bundled model's LM head in bfloat16, timed at 1-256 rows (a decode step's sequences) with
and without :func:`break_rounding_ties_`, alternately, on hidden states made by the model's
own final norm. Each figure is the median of ``--rounds`` alternated rounds; the table gives
the head's time, the tie check's extra time and its share. Run it under the bench lock:

    flock /tmp/kvserve-bench.lock python benchmarks/lm_head_ties.py --write-docs
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from ab_protocol import cpu
from docs_section import publish
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import load_model_weights
from kvserve.model.logits import break_rounding_ties_

ROWS = (1, 16, 64, 128, 256)


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    config, weights = load_model_weights(None, torch.bfloat16)
    model = LlamaForCausalLM.from_weights(config, weights)
    head, weight = model.lm_head, model.lm_head.weight
    rows_out = []
    with torch.no_grad():
        for rows in ROWS:
            ids = torch.randint(0, config.vocab_size, (rows,))
            hidden = model.norm(model.embed_tokens(ids) * 8)
            plain, tied = [], []
            for _ in range(args.rounds):
                plain.append(timed(lambda h=hidden: head(h).float(), args.repeats))
                tied.append(timed(lambda h=hidden: break_rounding_ties_(head(h).float(), h,
                                                                        weight), args.repeats))
            a, b = statistics.median(plain), statistics.median(tied)
            rows_out.append({"rows": rows, "head_ms": a * 1e3, "with_ties_ms": b * 1e3})
    model_name, flags = cpu()
    load = Path("/proc/loadavg").read_text().split()[0]
    lines = ["## What breaking bf16 rounding ties in the LM head costs", "",
             f"`python benchmarks/lm_head_ties.py --write-docs` at "
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on **{model_name}** "
             f"(ISA: {flags}), load average {load} after; torch threads "
             f"{torch.get_num_threads()}. The bundled SmolLM2-135M's LM head (49,152 x 576, "
             f"bf16, oneDNN packed) with and without `break_rounding_ties_` "
             f"(kvserve/model/logits.py), median of {args.rounds} alternated rounds of "
             f"{args.repeats} calls.", "",
             "| rows | head ms | head + tie check ms | extra |", "|---|---|---|---|"]
    for r in rows_out:
        extra = r["with_ties_ms"] / r["head_ms"] - 1
        lines.append(f"| {r['rows']} | {r['head_ms']:.3f} | {r['with_ties_ms']:.3f} | "
                     f"{extra:+.1%} |")
    publish("lm_head_ties", "\n".join(lines), rows_out, None, args.write_docs)


if __name__ == "__main__":
    main()
