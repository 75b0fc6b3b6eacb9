"""``--dtype``: vLLM's spellings, and what ``auto`` picks on this CPU (docs/dtype.md).

``auto`` takes the model's own dtype where the CPU computes it natively, as vLLM does:

    the checkpoint's dtype          this CPU                         auto
    ----------------------          --------                         ----
    float32 (or random weights)     any                              float32
    bfloat16, float16, quantized    AMX or AVX512-BF16 in its flags  bfloat16
    bfloat16, float16, quantized    neither                          float32

A 16-bit checkpoint runs in bfloat16 on a CPU (float16 has no fast CPU path; vLLM's CPU
backend casts it too). Without native bf16 a CPU emulates it, slower than float32, so
``auto`` falls back to float32 there. A quantized GGUF (the bundled SmolLM2 is Q4_1) is
dequantised and then treated as a 16-bit checkpoint, as vLLM's ``auto`` does: the bundled
model was published in bfloat16, and 4-bit weights lose nothing more in bfloat16. The one
answer bfloat16 used to change was a tie made by rounding the logits, which the LM head now
breaks exactly (kvserve.model.logits; docs/dtype.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvserve.flags import DTYPES
from kvserve.model.kernel_info import cpu_info

_DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float": torch.float32, "float32": torch.float32}
_NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
_GGUF_F32, _GGUF_F16, _GGUF_BF16 = 0, 1, 30  # GGMLQuantizationType
_GGUF_FLOATS = {_GGUF_F32: "float32", _GGUF_F16: "float16", _GGUF_BF16: "bfloat16"}


def native_bf16(flags: frozenset[str] | None = None) -> str | None:
    """The flag by which this CPU computes bf16 natively (AMX first), or None."""
    flags = cpu_info().flags if flags is None else flags
    return next((flag for flag in _NATIVE_BF16_FLAGS if flag in flags), None)


def checkpoint_dtype(path: str | Path | None) -> str:
    """The dtype a model stores its weights in: "float32", "bfloat16", "float16" or
    "quantized" (a GGUF with any quantized tensor). ``None`` is the bundled model. A path
    the loader will refuse anyway counts as float32 here, so the loader's error is the one
    reported."""
    from kvserve.model.loader import default_model_path

    resolved = default_model_path() if path is None else Path(path)
    if (resolved / "config.json").is_file():
        try:
            config = json.loads((resolved / "config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "float32"  # the loader names what is wrong with it
        if not isinstance(config, dict):
            return "float32"
        stored = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        return "float32" if stored == "float" else stored
    if resolved.suffix.lower() != ".gguf" or not resolved.is_file():
        return "float32"
    from kvserve.model.gguf_file import open_gguf

    types = {int(tensor.tensor_type) for tensor in open_gguf(resolved).tensors}
    if types - set(_GGUF_FLOATS):
        return "quantized"
    return next((_GGUF_FLOATS[t] for t in (_GGUF_BF16, _GGUF_F16) if t in types), "float32")


def resolve_dtype(name: str | torch.dtype, stored: str = "float32",
                  flags: frozenset[str] | None = None,
                  device: torch.device | None = None) -> tuple[torch.dtype, str]:
    """The torch dtype for ``--dtype name`` and why, given the checkpoint's dtype
    (:func:`checkpoint_dtype`) and the CPU's flags (default: this CPU's). On a CUDA
    ``device`` ``auto`` takes a 16-bit checkpoint in bfloat16 (float16 on a GPU without
    bf16), as vLLM does there."""
    if isinstance(name, torch.dtype):
        return name, "as given"
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    if name != "auto":
        return _DTYPES[name], f"--dtype {name}"
    if stored == "float32":
        return torch.float32, "auto: the checkpoint is float32"
    if stored in ("float64", "double"):  # wider still: no 16-bit rounding (the model pass:
        # a float64 one ran in bf16 where a float32 one stays float32)
        return torch.float32, f"auto: the checkpoint is {stored}, computed in float32"
    if device is not None and device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"auto: the checkpoint is {stored} and the GPU has bf16"
        return torch.float16, f"auto: the checkpoint is {stored} and the GPU has no bf16"
    flag = native_bf16(flags)
    if flag is not None:
        return torch.bfloat16, f"auto: the checkpoint is {stored} and this CPU has {flag}"
    return torch.float32, (f"auto: the checkpoint is {stored} but this CPU has no native bf16 "
                           f"({' or '.join(_NATIVE_BF16_FLAGS)}), so float32 is faster")


def auto_dtype_name(stored: str = "quantized") -> str:
    """The dtype ``--dtype auto`` loads a checkpoint stored as ``stored`` in on this CPU, as
    a name ("bfloat16", "float32"); the default is the bundled model's (quantized)."""
    return str(resolve_dtype("auto", stored)[0]).removeprefix("torch.")
