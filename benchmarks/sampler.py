#!/usr/bin/env python
"""What sampling at temperature 1 costs per row: the sampler alone on random logits the size
of SmolLM2's vocabulary (49,152), 8 and 64 rows, default parameters (no top-k/top-p).

    python benchmarks/sampler.py [--write-docs]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from docs_section import publish
from kvserve.core import SamplingParams
from kvserve.model.sampler import Sampler, SamplingRow

VOCAB = 49152


def per_row_ms(num_rows: int, repeats: int = 30) -> float:
    logits = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    rows = [SamplingRow(SamplingParams(), list(range(10)), 5) for _ in range(num_rows)]
    sampler = Sampler(0)
    sampler(logits, rows)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, rows)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times) / num_rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    figures = {n: per_row_ms(n) for n in (8, 64)}
    section = "\n".join([
        "## Sampling", "",
        f"`python benchmarks/sampler.py {' '.join(sys.argv[1:])}`".replace(" `", "`")
        + f" ({torch.get_num_threads()} threads): the sampler alone at temperature 1 on "
        f"{VOCAB:,}-entry logits, median of 30 calls.", "",
        "| rows | ms per row |", "|---|---|",
        *(f"| {n} | {ms:.3f} |" for n, ms in figures.items())])
    publish("sampler", section, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
