"""What ``kvserve bench serve`` sends: one :class:`BenchRequest` per request, with the time it
is due (seconds from the start; None: as soon as a concurrency slot frees)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

_TEXT = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river light stone "
         "music garden window paper story water table city night")
_WORDS = tuple(_TEXT.split(" "))


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str | list[int]
    num_prompt_tokens: int  # as generated (text: a word count, close to the token count)
    max_tokens: int
    arrival_time: float | None = None
    priority: int | None = None
    cancel_after: float | None = None  # a trace's client timeout: seconds after it is sent
    # a trace's (tenant, session id): the turn is sent once its session's previous turn has
    # ended, as a chat client sends its next message (the simulator's closed loop)
    session: tuple[str, str] | None = None


# The longest prompt or answer a flag may ask for, and the most prompt tokens a drawn
# workload may hold (QA: a 10^20-token prompt was built in memory until the run was killed).
MAX_LEN = 10_000_000
MAX_WORKLOAD_TOKENS = 100_000_000


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64:512' -> (64, 512); a ValueError naming ``flag`` else."""
    low, colon, high = text.partition(":")
    try:
        lo, hi = int(low), int(high if colon else low)  # QA: "1:" was taken as 1
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not N or LOW:HIGH") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{flag} {text!r}: need 1 <= LOW <= HIGH")
    if hi > MAX_LEN:
        raise ValueError(f"{flag} {text!r}: at most {MAX_LEN:,} tokens")
    return lo, hi


def random_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    seed: int, text: bool) -> list[BenchRequest]:
    """Prompt and output lengths uniform in their ranges; token ids in [1000, 40000) (under
    every common vocabulary) or random common words."""
    rng = random.Random(seed)
    requests = []
    for index in range(num):
        length = rng.randint(*input_len)
        if text:
            prompt: str | list[int] = " ".join(rng.choice(_WORDS) for _ in range(length))
        else:
            prompt = [rng.randrange(1000, 40000) for _ in range(length)]
        requests.append(BenchRequest(index, prompt, length, rng.randint(*output_len)))
    return requests


def trace_requests(path: str | Path, seed: int, max_tokens_cap: int | None = None,
                   num: int | None = None) -> list[BenchRequest]:
    """A kvserve trace (JSONL), or a server's recording directory (its requests, sent when
    the server received them), in arrival order (a trace's lines may come in any): token
    ids, arrival times, max_tokens / output_len, priority, and each client's timeout
    (``cancel_time``: the client goes away then). ``max_tokens_cap`` caps the lines that
    give no max_tokens (bench's --output-len; QA: its random workload's default, 256, cut
    every such line); ``num``: the first this many (vLLM's --num-prompts of a dataset)."""
    from kvserve.sim.trace import read_trace

    if Path(path).is_dir():
        from kvserve.sim.recording import load_recording

        rows = sorted(load_recording(path).trace, key=lambda r: r.received)
        start = rows[0].received if rows else 0.0
        rows = [dataclasses.replace(
            r, arrival_time=r.received - start, received_time=None,
            cancel_time=None if r.cancel_time is None else r.cancel_time - start)
            for r in rows]
    else:
        rows = sorted(read_trace(path), key=lambda r: r.arrival_time)  # stable
    requests = []
    for index, row in enumerate(rows[:num]):
        ids = row.synthesise_prompt(seed)
        # output_len tokens and then EOS: that many with ignore_eos, the answer's length
        # whatever the served model says (a recording's request ends as it ended)
        max_tokens = row.max_tokens or max_tokens_cap
        if not row.ignore_eos:
            max_tokens = min(max_tokens or row.output_len + 1, row.output_len + 1)
        elif max_tokens is None:
            raise ValueError(f"{path}: request {row.request_id or index} has ignore_eos and no "
                             "max_tokens: it runs to the model's length, which this client "
                             "does not know; give --output-len N to cap such lines")
        cancel_after = None if row.cancel_time is None else \
            max(0.0, row.cancel_time - row.arrival_time)
        session = None if row.session_id is None else (row.tenant, row.session_id)
        requests.append(BenchRequest(index, ids, len(ids), max(1, max_tokens),
                                     row.arrival_time, row.priority or None, cancel_after,
                                     session))
    return requests


def poisson_arrivals(requests: list[BenchRequest], rate: float, seed: int,
                     burstiness: float = 1.0) -> list[BenchRequest]:
    """Arrival times at a mean of ``rate`` req/s, the first at 0: gaps drawn from a gamma
    distribution of shape ``burstiness`` and mean 1/rate, as vLLM's bench draws them (1.0:
    exponential gaps, a Poisson process; below 1 burstier, above 1 steadier)."""
    rng = random.Random(seed + 1)
    now, out = 0.0, []
    for position, request in enumerate(requests):
        if position:
            now += rng.expovariate(rate) if burstiness == 1.0 else \
                rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(dataclasses.replace(request, arrival_time=now))
    return out
