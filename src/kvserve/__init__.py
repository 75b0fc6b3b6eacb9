"""kvserve: an LLM serving engine built around one transparent, pluggable scheduler.

Importing kvserve changes nothing in the process: no environment variable, no library-wide
switch. The ``kvserve`` command sets its process defaults when it starts (:mod:`kvserve.cli`),
the server its metrics exposition when it is built (:func:`kvserve.server.app.build_app`).
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names are, for type checkers
    from kvserve.core import SamplingParams
    from kvserve.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]

# vLLM's two offline names, as ``from vllm import LLM, SamplingParams`` gives them; loaded on
# first use, so that importing kvserve (the simulator, the core) does not import torch.
_LAZY = {"LLM": "kvserve.engine.llm", "SamplingParams": "kvserve.core"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
