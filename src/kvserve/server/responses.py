"""Response bodies in OpenAI's shapes (completions, chat, their stream chunks), plus the
``kvserve`` extension object that tells a client how its request was scheduled."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.core import RequestMetrics
from kvserve.engine.text import Tokenizer


@dataclass
class Choice:
    """One generated sequence: a (prompt, sample) pair of the HTTP request."""

    index: int
    request_id: str
    num_prompt_tokens: int
    text: str = ""
    num_output_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)


def kvserve_ext(request_id: str, metrics: RequestMetrics | None) -> dict[str, Any]:
    """How the scheduler treated one request (seconds and token counts)."""
    if metrics is None:
        return {"request_id": request_id}
    return {"request_id": request_id,
            "queue_time": metrics.queue_time,
            "prefix_hit_tokens": metrics.num_cached_tokens,
            "num_preemptions": metrics.num_preemptions,
            "num_recomputed_tokens": metrics.num_recomputed_tokens,
            "num_swaps": metrics.num_swaps,
            "longest_stall": metrics.longest_stall}


def kvserve_total(request_id: str, choices: list[Choice]) -> dict[str, Any]:
    """The extension for a whole response: one request's, or the sum over choices (times:
    the worst)."""
    exts = [kvserve_ext(c.request_id, c.metrics) for c in choices]
    if len(exts) == 1:
        return {**exts[0], "request_id": request_id}
    queue_times = [e["queue_time"] for e in exts if e.get("queue_time") is not None]
    return {"request_id": request_id,
            "queue_time": max(queue_times) if queue_times else None,
            "prefix_hit_tokens": sum(e.get("prefix_hit_tokens", 0) for e in exts),
            "num_preemptions": sum(e.get("num_preemptions", 0) for e in exts),
            "num_recomputed_tokens": sum(e.get("num_recomputed_tokens", 0) for e in exts),
            "num_swaps": sum(e.get("num_swaps", 0) for e in exts),
            "longest_stall": max(e.get("longest_stall", 0.0) for e in exts)}


def usage(choices: list[Choice], num_prompt_tokens: int) -> dict[str, int]:
    completion = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion}


def completion_logprobs(tokenizer: Tokenizer, entries: list[tuple[int, dict[int, float]]],
                        offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in entries:
        text = tokenizer.decode([token_id])
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        token_logprobs.append(entry.get(token_id))
        top.append({tokenizer.decode([t]): lp for t, lp in _ranked(entry)})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, entries: list[tuple[int, dict[int, float]]],
                  num_top: int) -> dict[str, Any]:
    content = []
    for token_id, entry in entries:
        text = tokenizer.decode([token_id])
        content.append({
            "token": text, "logprob": entry.get(token_id), "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t_text := tokenizer.decode([t])), "logprob": lp,
                              "bytes": list(t_text.encode())}
                             for t, lp in _ranked(entry)[:num_top]]})
    return {"content": content}


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
