"""Response bodies in OpenAI's shapes (completions, chat, their stream chunks), plus the
``kvserve`` extension object that tells a client how its request was scheduled."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.core import RequestMetrics
from kvserve.engine.engine import PromptLogprob
from kvserve.engine.text import Tokenizer

_REPLACEMENT = "\ufffd"  # what a token holding part of a character decodes to alone


@dataclass
class Choice:
    """One generated sequence: a (prompt, sample) pair of the HTTP request."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the output's, the last one included
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    text_offsets: TextOffsets | None = None  # a stream's, as its chunks go out
    echo: str = ""  # the prompt's text, with echo: before the answer's
    # With prompt_logprobs (or echo and logprobs): the engine's, on the first chunk (G8)
    prompt_logprobs: list[PromptLogprob | None] | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


def kvserve_ext(request_id: str, metrics: RequestMetrics | None) -> dict[str, Any]:
    """How the scheduler treated one request (seconds and token counts)."""
    if metrics is None:
        return {"request_id": request_id}
    ext = {"request_id": request_id,
           "queue_time": metrics.queue_time,
           "prefix_hit_tokens": metrics.num_cached_tokens,
           "num_preemptions": metrics.num_preemptions,
           "num_recomputed_tokens": metrics.num_recomputed_tokens,
           "num_swaps": metrics.num_swaps,
           "longest_stall": metrics.longest_stall}
    if metrics.session_held_tokens is not None:  # a session turn: what its next one finds
        ext["session_held_tokens"] = metrics.session_held_tokens
    return ext


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


@dataclass
class TextOffsets:
    """Where each output token's text starts in a choice's text (the completions API's
    ``text_offset``), token by token, across a stream's chunks. A character whose UTF-8
    bytes are split over tokens (each alone decodes to U+FFFD) is counted once, complete:
    its tokens get the offset where it starts, and text before it in the same token counts
    at once, so the offsets index the text the client receives."""

    start: int = 0  # the offset where the pending tokens' text starts
    pending: list[int] = field(default_factory=list)  # tokens ending in an incomplete char

    def next(self, tokenizer: Tokenizer, token_id: int, alone: str) -> int:
        """The offset of ``token_id`` (``alone``: its text decoded alone, a special token's
        as written, as vLLM counts it: QA, an echoed <|im_start|> counted 0 characters)."""
        pending = self.pending
        before = self.start + len(_decoded(tokenizer, pending).rstrip(_REPLACEMENT)) \
            if pending else self.start
        pending.append(token_id)
        decoded = alone if len(pending) == 1 else _decoded(tokenizer, pending)
        if not decoded.endswith(_REPLACEMENT):
            self.start += len(decoded)
            pending.clear()
        return before


def completion_logprobs(tokenizer: Tokenizer,
                        entries: list[tuple[int, dict[int, float] | None]],
                        offsets_state: TextOffsets | None = None,
                        as_ids: bool = False) -> dict[str, Any]:
    """The completions API's logprobs of ``entries`` (token id, its top logprobs; None for
    an echoed prompt's first token, which has none); their offsets continue
    ``offsets_state`` (a stream's, kept per choice), else start at 0. ``as_ids``: vLLM's
    return_tokens_as_token_ids, each token named ``token_id:N``."""
    state = offsets_state if offsets_state is not None else TextOffsets()
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in entries:
        text = _decoded(tokenizer, [token_id])
        offsets.append(state.next(tokenizer, token_id, text))
        tokens.append(f"token_id:{token_id}" if as_ids else
                      token_string(tokenizer, token_id, text))
        token_logprobs.append(None if entry is None else entry.get(token_id))
        top.append(None if entry is None else
                   {f"token_id:{t}" if as_ids else token_string(tokenizer, t): lp
                    for t, lp in _ranked(entry)})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def _decoded(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    """Tokens' text as logprobs name and count it: special tokens as written, as vLLM's
    (QA: <|im_end|> was '', and two special tokens in one top list collided on it)."""
    return tokenizer.decode(token_ids, skip_special_tokens=False)


def token_string(tokenizer: Tokenizer, token_id: int, text: str | None = None) -> str:
    """A token as the completions API names it: its text decoded alone, or, for a token
    holding part of a UTF-8 character (alone it decodes to U+FFFD), OpenAI's
    ``bytes:\\xe3\\x81`` spelling of its bytes, so two such tokens in one top list do not
    collapse into one U+FFFD key (QA: 2 of 5 entries came back, one with another's
    value)."""
    if text is None:
        text = _decoded(tokenizer, [token_id])
    own = getattr(tokenizer, "token_bytes", None)  # a protocol tokenizer may lack it
    if _REPLACEMENT not in text or own is None:
        return text
    raw = own(token_id)
    if raw == text.encode():
        return text  # the token is U+FFFD itself
    return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def echoed_entries(choice: Choice, num_top: int) -> list[tuple[int, dict[int, float] | None]]:
    """An echoed prompt's tokens as completions logprob entries: each token's own logprob
    and the top ``num_top`` (the engine computed at least as many), None for the first."""
    computed = choice.prompt_logprobs or [None] * len(choice.prompt_token_ids)
    out: list[tuple[int, dict[int, float] | None]] = []
    for token_id, item in zip(choice.prompt_token_ids, computed, strict=True):
        if item is None:
            out.append((token_id, None))
            continue
        entry = item[0]
        kept = dict(_ranked(entry)[:num_top])
        kept.setdefault(token_id, entry[token_id])
        out.append((token_id, kept))
    return out


def vllm_prompt_logprobs(tokenizer: Tokenizer, prompt_token_ids: list[int],
                         computed: list[PromptLogprob | None], num_top: int
                         ) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, then token id ->
    {logprob, rank, decoded_token} for the top ``num_top`` (ranks 1 .. num_top) and the
    prompt's own token (its rank in the vocabulary)."""
    out: list[dict[str, Any] | None] = []
    for token_id, item in zip(prompt_token_ids, computed, strict=True):
        if item is None:
            out.append(None)
            continue
        entry, own_rank = item
        formatted: dict[str, Any] = {}
        for rank, (top_id, logprob) in enumerate(_ranked(entry)[:num_top], 1):
            formatted[str(top_id)] = {"logprob": logprob, "rank": rank,
                                      "decoded_token": _decoded(tokenizer, [top_id])}
        formatted.setdefault(str(token_id), {"logprob": entry[token_id], "rank": own_rank,
                                             "decoded_token": _decoded(tokenizer, [token_id])})
        out.append(formatted)
    return out


def chat_logprobs(tokenizer: Tokenizer, entries: list[tuple[int, dict[int, float]]],
                  num_top: int, as_ids: bool = False) -> dict[str, Any]:
    """The chat API's logprobs; ``as_ids`` as :func:`completion_logprobs`'s (the bytes stay
    the token's own)."""
    def token(token_id: int) -> tuple[str, list[int]]:
        text = _decoded(tokenizer, [token_id])
        own = getattr(tokenizer, "token_bytes", None)  # a protocol tokenizer may lack it
        raw = list(own(token_id) if own is not None and _REPLACEMENT in text
                   else text.encode())
        return (f"token_id:{token_id}" if as_ids else text), raw

    content = []
    for token_id, entry in entries:
        text, raw = token(token_id)
        content.append({
            "token": text, "logprob": entry.get(token_id), "bytes": raw,
            "top_logprobs": [{"token": (top := token(t))[0], "logprob": lp, "bytes": top[1]}
                             for t, lp in _ranked(entry)[:num_top]]})
    return {"content": content}


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
