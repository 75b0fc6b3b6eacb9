"""The C++ extension, built on first use: the paged attention kernel (csrc/paged_attention.cpp)
and the fused per-layer elementwise ops behind :mod:`kvserve.model.layer_ops`
(csrc/layer_ops.cpp).

It reads K and V in place through the block tables (no gather into a padded copy), one pass
over each request's context with an online softmax for all its query heads, on torch's
intra-op threads (``torch.get_num_threads()``), requests (or, for small batches, request x kv
head pairs) handed out longest first.

The extension is compiled with ``torch.utils.cpp_extension.load`` (needs a C++ compiler and
``ninja``; -O3 -march=native) into torch's extensions cache (``$TORCH_EXTENSIONS_DIR``, by
default ``~/.cache/torch_extensions``), keyed by the source, its directory, the flags and the
CPU, so a later process loads it in well under a second; the first build takes 30-40 s on the
2-core machine (minutes when the machine is busy).
Nothing here raises at import: :func:`available` builds or loads it on first call and says
whether the kernel can be used, :func:`unavailable_reason` why not.

    if paged_kernel.available():
        out = paged_kernel.decode_attention(q, k_cache, v_cache, block_tables, context_lens)
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvserve.model.input_batch import ForwardBatch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "layer_ops.cpp", CSRC / "invariant_linear.cpp",
           CSRC / "panel_linear.cpp", CSRC / "int8_linear.cpp", CSRC / "layer_stack.cpp"]
HEADERS = [CSRC / "layer_ops.h", CSRC / "fast_math.h", CSRC / "attention_tile.h",
           CSRC / "panel_dpbf16.h", CSRC / "attention_softmax.h", CSRC / "invariant_blocks.h",
           CSRC / "attention_gemm.h", CSRC / "invariant_linear.h", CSRC / "panel_linear.h",
           CSRC / "int8_linear.h", CSRC / "int8_blocks.h", CSRC / "amx_tiles.h",
           CSRC / "prefetch.h", CSRC / "attention_amx.h", CSRC / "panel_amx.h", CSRC / "ops.h",
           CSRC / "layer_stack.h"]
# -fno-trapping-math: only floating-point exception flags stop being preserved (no
# reassociation, no change to contraction). It lets gcc if-convert the clamp and select
# around exp_nonpositive, so silu_and_mul vectorises (with trapping math it ran one element
# at a time: 5% of W1-32 on a Zen 3; same values now). The softmax's sum in one attention
# loop, an omp simd reduction, now vectorises too and adds in lanes: last-bit differences.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-fno-trapping-math"]
LDFLAGS = ["-fopenmp"]
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels compute on (caches, activations)

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None
_tried = False


def _put_ninja_on_path() -> None:
    """torch runs plain ``ninja``: this environment's (the pip package's) first on PATH, so
    every process of one environment builds with one ninja (QA: a Ray worker found the
    venv's and a plain start the system's, of another version, and each switch rebuilt
    every kernel: ninja drops a build log another version wrote); the PATH's where the
    environment has none."""
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # the PyPI package

        candidates.insert(0, Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for directory in candidates:
        ours = directory / "ninja"
        if ours.exists():
            found = shutil.which("ninja")
            if found is None or Path(found).resolve() != ours.resolve():
                os.environ["PATH"] = f"{directory}{os.pathsep}{os.environ.get('PATH', '')}"
            return


def _cpu_signature() -> str:
    signature = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features", "model name")):
                    signature += line
    except OSError:
        signature += platform.processor()
    return signature


def build_name() -> str:
    """The build's name, and so its directory: a hash of what the build depends on."""
    # The name carries the source's and flags' hash: an edited kernel never loads a stale build,
    # and processes with different sources do not fight over one build directory.
    # The CPU's feature flags too: -march=native output must not load on another CPU model
    # that shares this cache directory (a network home, a container image).
    # And the sources' directory: ninja rebuilds when build.ninja's source paths change, so
    # two checkouts of one source sharing a build directory would rebuild in turn; likewise
    # the compiler torch writes there ($CXX, QA: one process with it set, one without).
    key = b"".join(path.read_bytes() for path in SOURCES + HEADERS) + \
        " ".join(CFLAGS).encode() + _cpu_signature().encode() + str(CSRC).encode() + \
        os.environ.get("CXX", "").encode()
    return f"kvserve_paged_attention_{hashlib.sha256(key).hexdigest()[:12]}"


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError("no C++ compiler on PATH (set CXX or install g++)")
    _put_ninja_on_path()
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    name = build_name()
    build_directory = Path(cpp_extension._get_build_directory(name, False))
    if not (build_directory / f"{name}.so").exists():  # QA: a minute of silence at boot
        logger.info("building kvserve's C++ kernels for this CPU in %s: two to three "
                    "minutes on two cores, once (later starts load the build)",
                    build_directory)
    with build_lock(build_directory):
        return cpp_extension.load(
            name=name,
            sources=[str(path) for path in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            build_directory=str(build_directory),
            verbose=False,
        )


@contextmanager
def build_lock(build_directory: Path) -> Iterator[None]:
    """Holds the build directory for one process at a time, by a lock the OS drops when its
    holder dies, and clears what a killed build left.

    torch's own lock is a file named ``lock`` that the building process removes when done;
    a build killed meanwhile (a timeout, Ctrl-C twice) leaves it, and every later process
    that loads the extension then waits for it forever. Under this lock no other kvserve
    process can be inside torch's, so a ``lock`` file found here is such a leftover.
    """
    with open(build_directory / "kvserve-build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_directory / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a killed build", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load() -> ModuleType | None:
    global _module, _error, _tried
    if _tried:
        return _module
    with _lock:
        if not _tried:
            try:
                _module = _build()
            except Exception as exc:  # a missing tool or a failed build: fall back, keep why
                _error = f"{type(exc).__name__}: {exc}".strip()
                logger.warning("paged attention kernel unavailable: %s", _error.splitlines()[0])
            _tried = True
    return _module


def available() -> bool:
    """True if the kernel is built (building it now if needed); never raises."""
    return _load() is not None


def handles(dtype: torch.dtype) -> bool:
    """True if the kernels are built and compute on ``dtype`` (float32, bfloat16); other
    dtypes (float16) take the torch path."""
    return dtype in DTYPES and available()


def runs(tensor: torch.Tensor) -> bool:
    """:func:`handles` for ``tensor``'s dtype, and only on the CPU: the kernels are CPU code,
    so a tensor on a GPU (``--device cuda``) takes the torch path."""
    return tensor.is_cpu and handles(tensor.dtype)


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None if it is True or was not asked yet)."""
    return _error


def _kernel() -> ModuleType:
    module = _load()
    if module is None:
        raise RuntimeError(f"paged attention kernel unavailable: {_error}")
    return module


def compiled_isa() -> list[str]:
    """The instruction sets the built kernels were compiled for, of avx2, fma, avx512f,
    avx512_bf16 and amx_bf16 (``-march=native``: what the building CPU has); raises if it is
    not built."""
    return list(_kernel().compiled_isa())


def layer_ops() -> ModuleType:
    """The extension module, for :mod:`kvserve.model.layer_ops`' fused ops (csrc/layer_ops.cpp)."""
    return _kernel()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """One query per request over its paged context.

    q: [num_decodes, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim], contiguous, float32 or bfloat16; block_tables: [num_decodes,
    max_blocks] (padding ignored); context_lens: [num_decodes] (a request attends to its first
    context_len tokens, its own included). Query head h reads kv head
    h // (num_heads // num_kv_heads). Returns [num_decodes, num_heads, head_dim] in q's dtype;
    scale defaults to 1/sqrt(head_dim). Accumulates in float32.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _kernel().decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def step_layout(batch: ForwardBatch) -> tuple[Any, ...]:
    """The step's rows as :func:`step_attention` and the layer stack take them (csrc/ops.h's
    StepLayout): num_decodes, the decodes' block tables and context lengths, then the
    chunks' first rows, row counts, context lengths and block tables."""
    chunks = batch.prefills
    return (batch.num_decodes, batch.decode_block_tables, batch.decode_context_lens,
            [c.start for c in chunks], [c.num_tokens for c in chunks],
            [c.context_len for c in chunks], [c.block_table for c in chunks])


def step_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   batch: ForwardBatch, amx_prefill: bool, min_tile_rows: int,
                   match_decode: bool = False, scale: float | None = None) -> torch.Tensor:
    """One step's attention in one call: its decodes by :func:`decode_attention`, then each
    prefill chunk by :func:`amx_prefill_attention` (``amx_prefill`` and min_tile_rows rows or
    more) or :func:`prefill_attention` (with ``match_decode``). q: [T, num_heads, head_dim]
    in the batch's row order; returns the same shape."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _kernel().step_attention(q, k_cache, v_cache, *step_layout(batch), amx_prefill,
                                    min_tile_rows, scale, match_decode)


@functools.cache
def amx_bf16_status() -> str:
    """Why this process cannot run the bf16 AMX tile kernels (:func:`amx_prefill_attention`,
    ``panel_linear_amx``): "" where it can; else a build without them, or Linux refusing the
    tile state (said once as a warning on a build that has them)."""
    status = str(_kernel().amx_bf16_status())
    if status and "amx_bf16" in compiled_isa():
        logger.warning("the AMX-BF16 tiles cannot run here (%s): prefill attention runs on "
                       "torch's flash attention, the projections on the AVX512-BF16 panels "
                       "and oneDNN", status)
    return status


def panel_amx_runs() -> bool:
    """Whether this process runs ``panel_linear_amx`` (csrc/panel_amx.h)."""
    return available() and amx_bf16_status() == ""


def amx_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, context_len: int,
                          scale: float | None = None) -> torch.Tensor:
    """:func:`prefill_attention` on AMX-BF16 tiles (csrc/attention_amx.h): bfloat16 q and
    caches, head_dim 64; the keys and values read straight from the paged cache. Its sums
    differ from the C++ kernel's and flash's in order only (float32 throughout, probabilities
    rounded to bf16 before the value products, as both do)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _kernel().amx_prefill_attention(q, k_cache, v_cache, block_table, int(context_len),
                                           scale)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_table: torch.Tensor, context_len: int,
                      scale: float | None = None, match_decode: bool = False) -> torch.Tensor:
    """Causal attention for one prefill chunk: the last n tokens of a context_len-token context.

    q: [n, num_heads, head_dim]; query i sits at position context_len - n + i and sees keys
    0 ..= that position (this chunk's K and V already written). block_table: [num_blocks].
    Returns [n, num_heads, head_dim] in q's dtype. ``match_decode`` (--batch-invariant): each
    row's sums in the order a decode step adds them, so a token's output is bit-identical
    whether a prefill or a decode computed it (the repacked tiles of csrc/attention_gemm.h,
    faster, sum in another order).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _kernel().prefill_attention(q, k_cache, v_cache, block_table, int(context_len),
                                       scale, match_decode)
