"""A model's recommended sampling defaults: its Hugging Face ``generation_config.json``, as
vLLM applies it (``--generation-config auto``, its default) to the requests that do not set
these fields themselves.

``auto`` reads the model directory's file (a GGUF, the bundled model included, has none: no
defaults), ``vllm`` reads none, a directory reads that directory's; vLLM's
``--override-generation-config`` JSON overrides or extends the result, in the file's own
names. Only the sampling fields vLLM takes from the file are read (``max_new_tokens`` is
the default ``max_tokens``); the file's other keys (token ids, ``do_sample``) are not
sampling defaults and are left alone, as vLLM leaves them; its ``eos_token_id`` (or
config.json's) is read apart, by :func:`model_eos_ids`: every one stops an answer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json's name -> SamplingParams' (and the request body's)
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                   "max_new_tokens": "max_tokens"}


def sampling_defaults(model: str | Path | None, source: str = "auto",
                      overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """SamplingParams field -> default, from ``source`` (``auto``: the directory ``model``
    names, if it is one; ``vllm``: none; else a directory) and ``overrides``. ValueError
    naming the file or the override that cannot be a default (an unknown override, a value
    of the wrong type or out of range)."""
    if not isinstance(source, (str, Path)):  # QA: pathlib's TypeError, naming nothing
        raise TypeError(f"generation_config must be 'auto', 'vllm' or a directory, got "
                        f"{type(source).__name__}")
    if overrides is not None and not isinstance(overrides, Mapping):  # QA: AttributeError
        raise TypeError(f"override_generation_config must be a dict of sampling defaults "
                        f"(e.g. {{'temperature': 0.7}}), got {type(overrides).__name__}")
    config: dict[str, Any] = {}
    if source == "auto":
        if isinstance(model, (str, Path)) and Path(model).is_dir():
            config = _read(Path(model) / GENERATION_CONFIG_FILE, required=False)
    elif source != "vllm":
        folder = Path(source)
        if not folder.is_dir():
            raise ValueError(f"generation config {source!r}: give auto, vllm or a directory "
                             f"holding {GENERATION_CONFIG_FILE}")
        config = _read(folder / GENERATION_CONFIG_FILE, required=True)
    where = {name: str(source) for name in config}
    for name, value in (overrides or {}).items():
        if name not in SAMPLING_FIELDS:
            raise ValueError(f"override generation config: {name!r} is not a sampling "
                             f"default; known: {', '.join(SAMPLING_FIELDS)}")
        config[name], where[name] = value, "the override"
    defaults = {}
    for name, field in SAMPLING_FIELDS.items():
        value = config.get(name)
        if value is None:
            continue
        _check(name, value, where[name])
        defaults[field] = value
    return defaults


def model_eos_ids(model: str | Path | None) -> tuple[int, ...]:
    """A Hugging Face directory's end-of-sequence ids: ``generation_config.json``'s
    ``eos_token_id`` (an id or a list), else ``config.json``'s, as vLLM reads them (QA:
    only the tokenizer's EOS stopped an answer, so a Llama-3-Instruct directory never
    stopped at <|eot_id|>). () for a GGUF, the bundled model, or ids not written as ids."""
    if not isinstance(model, (str, Path)) or not Path(model).is_dir():
        return ()
    for name in (GENERATION_CONFIG_FILE, "config.json"):
        path = Path(model) / name
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # read, and refused by name, where it matters (the model's load)
        ids = data.get("eos_token_id") if isinstance(data, dict) else None
        if ids is None:
            continue
        ids = [ids] if not isinstance(ids, list) else ids
        return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool)
                     and i >= 0)
    return ()


def _read(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ValueError(f"generation config: {path} does not exist")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read it as JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return {name: data[name] for name in SAMPLING_FIELDS if name in data}


# name -> (integer, lowest, highest, lowest excluded), as the request body takes each field
_RANGES = {"temperature": (False, 0.0, 100.0, False), "top_p": (False, 0.0, 1.0, True),
           "top_k": (True, -1, 1 << 20, False), "min_p": (False, 0.0, 1.0, False),
           "repetition_penalty": (False, 0.0, 100.0, True),
           "max_new_tokens": (True, 1, 1 << 20, False)}


def _check(name: str, value: Any, where: str) -> None:
    integer, low, high, open_low = _RANGES[name]
    number = isinstance(value, int) or (isinstance(value, float) and not integer)
    if isinstance(value, bool) or not number or not math.isfinite(value) or \
            not (low < value if open_low else low <= value) or value > high:
        kind = "an integer" if integer else "a number"
        bound = f"> {low:g}" if open_low else f">= {low:g}"
        raise ValueError(f"generation config ({where}): {name} must be {kind} {bound} and "
                         f"<= {high:g}, got {value!r}")
