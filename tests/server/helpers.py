"""Factories for the server tests: a tiny random-weight model with the real tokenizer (loads in
about a second, steps in milliseconds), and a live server on a free 127.0.0.1 port."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from kvserve.engine.engine import Engine
from kvserve.model.config import ModelConfig

TINY = ModelConfig(name="tiny", vocab_size=49152, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=2048, eos_token_id=2)


@functools.cache
def tokenizer() -> Any:
    from kvserve.model.tokenizer import load_tokenizer

    return load_tokenizer(None)


def make_engine(num_kv_blocks: int = 256, **settings: Any) -> Engine:
    from kvserve.engine.llm import build_engine

    settings.setdefault("max_model_len", 1024)
    return build_engine(TINY, tokenizer=tokenizer(), num_kv_blocks=num_kv_blocks,
                        record_events=True, **settings)


def wait_for(condition: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        time.sleep(0.01)
