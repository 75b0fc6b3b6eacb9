"""Issue 16.4 and 17.5: --dtype takes vLLM's spellings in every command, and ``auto`` (the
default) picks the checkpoint's own dtype where the CPU computes bf16 natively, else float32,
a quantized checkpoint counting as 16-bit (docs/dtype.md)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvserve.cli import build_parser
from kvserve.flags import DTYPES
from kvserve.model.dtype import auto_dtype_name, checkpoint_dtype, native_bf16, resolve_dtype

AVX512_BF16 = frozenset({"avx512f", "avx512_bf16"})
AMX = frozenset({"amx_tile", "amx_bf16", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize(("name", "stored", "flags", "expected", "why"), [
    ("auto", "quantized", AVX512_BF16, torch.bfloat16, "quantized and this CPU has avx512_bf16"),
    ("auto", "quantized", AMX, torch.bfloat16, "quantized and this CPU has amx_bf16"),
    ("auto", "quantized", AVX2, torch.float32, "quantized but this CPU has no native bf16"),
    ("auto", "bfloat16", AVX512_BF16, torch.bfloat16, "this CPU has avx512_bf16"),
    ("auto", "bfloat16", AMX, torch.bfloat16, "this CPU has amx_bf16"),
    ("auto", "float16", AVX2, torch.float32, "no native bf16"),
    ("auto", "float32", AMX, torch.float32, "the checkpoint is float32"),
    # wider than float32: not rounded to 16 bits (the model pass: it ran in bf16)
    ("auto", "float64", AMX, torch.float32, "the checkpoint is float64, computed in float32"),
    ("half", "float32", AVX2, torch.float16, "--dtype half"),
    ("float16", "float32", AVX2, torch.float16, "--dtype float16"),
    ("bfloat16", "float32", AVX2, torch.bfloat16, "--dtype bfloat16"),
    ("float", "bfloat16", AMX, torch.float32, "--dtype float"),
    ("float32", "bfloat16", AMX, torch.float32, "--dtype float32"),
])
def test_resolve_dtype(name, stored, flags, expected, why):
    dtype, reason = resolve_dtype(name, stored, flags)
    assert dtype == expected and why in reason


def test_an_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; choose one of auto, half"):
        resolve_dtype("fp8")


def test_auto_dtype_name_is_resolve_dtypes_choice_on_this_cpu():
    assert auto_dtype_name("float32") == "float32"  # a float32 checkpoint stays float32
    assert auto_dtype_name() == ("bfloat16" if native_bf16() else "float32")


def test_the_bundled_model_is_quantized():
    assert checkpoint_dtype(None) == "quantized"  # Q4_1: auto means bfloat16 where native


@pytest.mark.parametrize("command", ["generate", "serve", "calibrate"])
def test_every_model_command_takes_every_spelling_and_defaults_to_auto(command):
    parser = build_parser()
    assert parser.parse_args([command]).dtype == "auto"
    for name in DTYPES:
        assert parser.parse_args([command, "--dtype", name]).dtype == name


def test_build_engine_logs_the_dtype_and_why(caplog):
    from kvserve.engine.llm import build_engine
    from tests.server.helpers import TINY

    with caplog.at_level(logging.INFO, logger="kvserve.engine.llm"):
        engine = build_engine(TINY, num_kv_blocks=8)
    assert "dtype float32 (auto: the checkpoint is float32)" in caplog.messages
    runner = engine.executor
    assert runner.model.embed_tokens.weight.dtype == torch.float32  # type: ignore[attr-defined]
