"""W1/W2/W3 of ../shared/WORKLOADS.md as simulator traces, drawn in the documented order
(reimplemented here and checked against the first ids the document gives).

Greedy, ignore_eos, exact max_tokens; prompts are token ids. W3 at another rate keeps the
same requests and stretches or squeezes the same arrival draw (W3's gaps x 4 / rate).
Request ids are zero-padded so that the simulator's order for equal arrival times (by id)
is the draw's order, as when a benchmark submits the prompts in a list.
"""

from __future__ import annotations

import numpy as np

from kvserve.sim.trace import TraceRequest

W1_FIRST_IDS = [36058, 12649, 36180, 27207, 35725]
W3_FIRST_IDS = [33454, 26203, 39617, 11871, 7233]
W3_RATE = 4.0


def w1_trace(n: int = 128) -> list[TraceRequest]:
    """numpy default_rng(0): 128 lengths in [64, 512], then each prompt; max_tokens 128."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(64, 513, size=128)
    prompts = [rng.integers(1000, 40000, size=int(length)).tolist() for length in lengths]
    assert prompts[0][:5] == W1_FIRST_IDS, "W1 generator drifted from WORKLOADS.md"
    return [TraceRequest(f"w1-{i:03d}", 0.0, 128, prompt_token_ids=tuple(p), max_tokens=128,
                         ignore_eos=True) for i, p in enumerate(prompts[:n])]


def w3_trace(n: int = 200, rate: float = W3_RATE) -> list[TraceRequest]:
    """numpy default_rng(1): 200 lengths, 200 max_tokens in [32, 256], 200 exponential gaps
    at 4 req/s, then each prompt; the first request arrives at t=0."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(64, 513, size=200)
    max_tokens = rng.integers(32, 257, size=200)
    gaps = rng.exponential(1.0 / W3_RATE, size=200)
    arrivals = (np.cumsum(gaps) - gaps[0]) * (W3_RATE / rate)
    prompts = [rng.integers(1000, 40000, size=int(length)).tolist() for length in lengths]
    assert prompts[0][:5] == W3_FIRST_IDS, "W3 generator drifted from WORKLOADS.md"
    return [TraceRequest(f"w3-{i:03d}", float(arrivals[i]), int(max_tokens[i]),
                         prompt_token_ids=tuple(prompts[i]), max_tokens=int(max_tokens[i]),
                         ignore_eos=True) for i in range(n)]
