"""What this machine runs: the CPU, the instruction sets it has, and the kernel each op of the
model uses (``kvserve info``, and the boot log of ``kvserve serve`` and ``kvserve generate``).

The choices are not made here; this module reports the ones the code makes
(docs/kernels.md):

- projections and the LM head (:class:`kvserve.model.llama.Linear`): the kernel
  :func:`projection_kernel` picks (bf16 weights packed once for oneDNN where oneDNN runs bf16,
  which then picks AMX or AVX512-BF16 itself; kvserve's panel GEMMs; or torch's
  ``F.linear``), which KVSERVE_PROJECTIONS may override;
- attention (:mod:`kvserve.model.paged_kernel`): the C++ kernel, compiled with
  ``-march=native``, whose paths are AVX512-BF16 dot products (bf16 caches, head_dim 64 or
  128), AVX-512 intrinsics, or loops the compiler vectorises; the torch path (gather + SDPA)
  when the extension is not built or the dtype is neither float32 nor bfloat16;
- RMSNorm (+ residual), SwiGLU, RoPE + K/V write (:mod:`kvserve.model.layer_ops`): fused C++
  loops vectorised by the compiler for the ISA the build found, or torch ops;
- the loop over the layers: a step of a bf16 model whose projections run on the pair panels
  (few enough rows) loops in C++ (csrc/layer_stack.cpp,
  :func:`kvserve.model.llama.build_layer_stack`), unless KVSERVE_LAYER_STACK=0; other steps
  run the modules;
- sampling: torch (:mod:`kvserve.model.sampler`).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.cpu_name import read_cpuinfo, with_generation

# The instruction sets that matter to the kernels here or to oneDNN/ATen, in /proc/cpuinfo's
# spelling. amx_* pick kernels (the int8 path's tiles, the projections' and the prefill
# attention's rules below; docs/kernels.md, "AMX").
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
OPS = ("projections", "lm_head", "attention", "rms_norm", "silu_and_mul", "rope_kv_write",
       "layer_loop", "sampling")
LAYER_STACK_ENV = "KVSERVE_LAYER_STACK"
OFF_WORDS = ("0", "false", "no", "off")  # a KVSERVE_* switch turned off (QA: "false" was on)


@dataclass(frozen=True)
class CpuInfo:
    model: str
    logical_cpus: int
    flags: frozenset[str] = field(default_factory=frozenset)
    # x86's CPU family: a bare "AMD EPYC" is a Zen 3 or Zen 4 (25) or a Zen 5 (26)
    family: int | None = None
    # x86's model number: a bare Intel Xeon of family 6 is a Sapphire Rapids (143), say
    model_number: int | None = None

    @property
    def name(self) -> str:
        """The model name, with its generation where the name alone is bare (cpu_name)."""
        return with_generation(self.model, self.family, self.flags, self.model_number)

    def isa(self) -> dict[str, bool]:
        """Each of ISA_FLAGS: whether this CPU has it."""
        return {flag: flag in self.flags for flag in ISA_FLAGS}


def parse_cpuinfo(text: str) -> CpuInfo:
    """The model name and flags of the first processor in /proc/cpuinfo's text, and the number
    of processors it lists."""
    cpu = read_cpuinfo(text)
    return CpuInfo(cpu.model or platform.processor() or platform.machine(), cpu.processors or
                   (os.cpu_count() or 0), frozenset(cpu.flags), cpu.family, cpu.model_number)


def cpu_info(path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's CPU (without /proc/cpuinfo: the platform's name, no flags)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return parse_cpuinfo(file.read())
    except OSError:
        return parse_cpuinfo("")


def _vector_isa(compiled_isa: tuple[str, ...]) -> str:
    if "avx512f" in compiled_isa:
        return "AVX-512"
    return "AVX2" if "avx2" in compiled_isa else "baseline x86-64 / scalar"


def packs_float32(flags: frozenset[str]) -> bool:
    """Whether float32 projections run through oneDNN's packed weights on a CPU with these
    flags: where AVX2 is its best vector tier (no AVX-512). There MKL's sgemm, which F.linear
    calls, is slow at the few rows of a decode step; measured on a Zen 3 (AMD EPYC, AVX2, 2
    cores, 2026-12-02), oneDNN's packed float32 was 2.1-3.2x faster on SmolLM2's LM head at 2-128
    rows and 1.0-3.3x on its layer projections at 1-256 rows (0.86-1.14x at 1,024-2,048 rows).
    Elsewhere F.linear stays until measured there."""
    return torch.backends.mkldnn.is_available() and "avx2" in flags and "avx512f" not in flags


PROJECTIONS_ENV = "KVSERVE_PROJECTIONS"
# hybrid-dpbf16: calls of at most this many rows run on the AVX512-BF16 panels, larger ones on
# oneDNN (on a Zen 4 the panels lead oneDNN up to 128 rows: docs/kernels.md)
HYBRID_PANEL_ROWS = 128
# ... but for a weight of more than HYBRID_PANEL_COLUMNS outputs (an LM head: 49,152) only up
# to HYBRID_WIDE_PANEL_ROWS: there oneDNN leads from 64 rows, by more inside a model step,
# and the panels lead below (1.3-1.6x at 1-16 rows on a Zen 4; docs/kernels.md)
HYBRID_PANEL_COLUMNS = 8192
HYBRID_WIDE_PANEL_ROWS = 32


# On an AMX build oneDNN runs the tiles, and the panels lead only in the smallest calls: a
# layer projection's up to AMX_PANEL_ROWS rows (1.42x oneDNN at 1 row, 1.04x at 8, 0.62x at
# 16 on an Emerald Rapids), an LM head's never (0.99x at 1 row, 0.86x at 4; docs/kernels.md)
AMX_PANEL_ROWS = 8
AMX_WIDE_PANEL_ROWS = 0
# hybrid-amx: the same panels read by kvserve's own AMX-BF16 tiles (csrc/panel_amx.h) up to
# AMX_TILE_PANEL_ROWS rows, oneDNN above: with the weights cold, as in a model step, the tiles
# streamed 30 layers' projections at 1.3-1.4x oneDNN's speed at 1-8 rows, 1.5-1.6x at 16-32,
# 1.05-1.3x at 64-512, level at 1,024 and 0.6x at 2,048 (an Emerald Rapids;
# benchmarks/panel_linear.py --between-mb 5, docs/kernels.md). An LM head keeps
# oneDNN alone (AMX_WIDE_PANEL_ROWS: no second copy of its 49,152 columns).
AMX_TILE_PANEL_ROWS = 512
# the tiles step through k 32 at a time: a weight whose in_features is not a multiple runs
# hybrid-dpbf16's rows instead
AMX_TILE_K = 32


def hybrid_panel_rows(out_features: int, amx: bool = False, tiles: bool = False) -> int:
    """Up to how many rows a hybrid projection of ``out_features`` outputs runs on the panels
    (more: oneDNN): hybrid-dpbf16's AVX512-BF16 panels on a build with AMX or without, or
    with ``tiles`` hybrid-amx's AMX tiles; 0: never (no panels packed)."""
    wide = out_features > HYBRID_PANEL_COLUMNS
    if tiles:
        return AMX_WIDE_PANEL_ROWS if wide else AMX_TILE_PANEL_ROWS
    if amx:
        return AMX_WIDE_PANEL_ROWS if wide else AMX_PANEL_ROWS
    return HYBRID_WIDE_PANEL_ROWS if wide else HYBRID_PANEL_ROWS
# What KVSERVE_PROJECTIONS may ask for: auto (the rules of projection_kernel), amx
# (hybrid-amx), hybrid (hybrid-dpbf16), panels (the build's best panel GEMM for the dtype),
# panels-avx2, onednn, torch (F.linear, the reference).
PROJECTION_CHOICES = ("auto", "amx", "hybrid", "panels", "panels-avx2", "onednn", "torch")


def checked_choice(value: str) -> str:
    """``value`` if it is one of PROJECTION_CHOICES, else ValueError naming the variable and
    the values it takes."""
    if value not in PROJECTION_CHOICES:
        raise ValueError(f"{PROJECTIONS_ENV}={value!r} is not one of "
                         f"{', '.join(PROJECTION_CHOICES)}")
    return value


PREFILL_ATTENTION_ENV = "KVSERVE_PREFILL_ATTENTION"
# What KVSERVE_PREFILL_ATTENTION may ask for: auto (prefill_attention_kernel's rule), kernel
# (the C++ paged kernel), flash (torch's flash attention over the gathered context), amx (the
# C++ AMX-BF16 tiles of csrc/attention_amx.h).
PREFILL_ATTENTION_CHOICES = ("auto", "kernel", "flash", "amx")
# flash: a prefill chunk of at least this many rows (fewer: the C++ kernel, as decodes)
FLASH_PREFILL_ROWS = 16
# amx: the same for the AMX tiles (csrc/attention_amx.h pads a chunk to 16 rows per head, yet
# from 8 rows beats the kernel: 1.26x at 8 rows over 512 keys, 0.90x at 4, 0.45x at 1;
# docs/kernels.md)
AMX_PREFILL_ROWS = 8
# amx: the head_dim csrc/attention_amx.h computes (another runs flash instead)
AMX_PREFILL_HEAD_DIM = 64


def prefill_attention_choice() -> str:
    """KVSERVE_PREFILL_ATTENTION, checked (``auto`` when unset)."""
    value = os.environ.get(PREFILL_ATTENTION_ENV, "").strip().lower() or "auto"
    if value not in PREFILL_ATTENTION_CHOICES:
        raise ValueError(f"{PREFILL_ATTENTION_ENV}={value!r} is not one of "
                         f"{', '.join(PREFILL_ATTENTION_CHOICES)}")
    return value


def prefill_attention_kernel(dtype: torch.dtype, flags: frozenset[str],
                             choice: str = "auto", compiled_isa: tuple[str, ...] = ()) -> str:
    """What a CPU prefill chunk of FLASH_PREFILL_ROWS rows or more (AMX_PREFILL_ROWS for amx)
    runs on where the C++ kernel is built: ``kernel`` (csrc's paged prefill tiles), ``flash``
    (torch's scaled_dot_product_attention over the gathered context, 4-D so ATen takes its
    flash attention, whose bf16 products are oneDNN brgemm calls: AMX tiles where the CPU has
    them) or ``amx`` (csrc/attention_amx.h: kvserve's own AMX-BF16 tiles, read straight from
    the paged cache; bf16, head_dim 64, where the build compiled it). ``auto``: amx for bf16
    where the build has it (2-4x flash at 16-1,000 rows on an AMX Xeon, docs/kernels.md),
    else flash for bf16 on a CPU with amx_bf16 (1.1-2.5x the kernel there), the kernel
    elsewhere (no other CPU measured flash yet). ValueError where ``amx`` is asked for and
    this build has no AMX path; ``amx`` for another dtype than bf16 is flash."""
    if choice == "auto":
        if dtype == torch.bfloat16 and "amx_bf16" in compiled_isa:
            return "amx"
        return "flash" if dtype == torch.bfloat16 and "amx_bf16" in flags else "kernel"
    if choice == "amx" and "amx_bf16" not in compiled_isa:
        raise ValueError(f"{PREFILL_ATTENTION_ENV}=amx needs a build with AMX-BF16 tiles "
                         f"(a CPU with amx_bf16); this one compiled "
                         f"{' '.join(compiled_isa) or 'no C++ kernels'}")
    if choice == "amx" and dtype != torch.bfloat16:
        return "flash"  # the tiles compute bf16 only; flash takes any dtype
    return choice


def projection_choice() -> str:
    """KVSERVE_PROJECTIONS, checked (``auto`` when unset)."""
    return checked_choice(os.environ.get(PROJECTIONS_ENV, "").strip().lower() or "auto")


def projection_kernel(dtype: torch.dtype, built: bool, compiled_isa: tuple[str, ...],
                      onednn_bf16: bool, packs_fp32: bool, choice: str = "auto") -> str:
    """The kernel :class:`kvserve.model.llama.Linear` projects ``dtype`` with: ``panels-avx2``
    (csrc/panel_linear.cpp), ``panels-dpbf16`` (csrc/panel_dpbf16.h), ``onednn`` (weights
    packed once for oneDNN) or ``torch`` (``F.linear``), given whether the C++ extension is
    built, the instruction sets it was compiled for, whether oneDNN runs bf16 natively here,
    whether float32 packs here (:func:`packs_float32`) and the choice asked for
    (KVSERVE_PROJECTIONS). ``auto``: bf16 where oneDNN runs bf16 natively (AMX,
    AVX512-BF16): on a build with AMX-BF16 oneDNN, with the smaller calls on the same weights
    packed in panels read by kvserve's own tiles (``hybrid-amx``, up to 512 rows: 1.05-1.6x
    oneDNN there; both packings kept, :func:`hybrid_panel_rows`); on a build with
    AVX512-BF16 but no AMX every call on the panels' AVX512-BF16 dot products
    (``panels-dpbf16``: level with oneDNN at 256-2,048 rows on a Zen 4, 1.03-1.9x at 1-128,
    one copy of the weights; ``hybrid-dpbf16``, oneDNN above 128 rows, was what auto ran
    before 6 December); elsewhere oneDNN; docs/kernels.md. Else bf16
    on the AVX2 panels (activations widened); float32 on the AVX2 panels where AVX2 is the
    CPU's best tier, else F.linear (MKL). ``hybrid`` asks for ``hybrid-dpbf16`` wherever it
    can run (KVSERVE_PROJECTIONS=hybrid on an AMX build: up to 8 rows), ``amx`` for
    ``hybrid-amx``. ValueError where the choice cannot run here."""
    avx2_panels = built and "avx2" in compiled_isa and "fma" in compiled_isa
    tiles = "amx_bf16" in compiled_isa
    if checked_choice(choice) == "auto":
        if dtype == torch.bfloat16 and onednn_bf16:
            if built and "avx512_bf16" in compiled_isa:
                return "hybrid-amx" if tiles else "panels-dpbf16"
            return "onednn"
        if dtype == torch.bfloat16:
            return "panels-avx2" if avx2_panels else "torch"
        if dtype == torch.float32 and packs_fp32:
            return "panels-avx2" if avx2_panels else "onednn"
        return "torch"
    if choice == "torch":
        return "torch"
    if dtype not in (torch.float32, torch.bfloat16):
        why = "only float32 and bfloat16 have other kernels than torch"
    elif choice == "onednn":
        if torch.backends.mkldnn.is_available() and (onednn_bf16 or dtype == torch.float32):
            return "onednn"
        why = "oneDNN has no native bf16 on this CPU" if torch.backends.mkldnn.is_available() \
            else "this torch has no oneDNN"
    elif not built:
        why = "the C++ extension is not built"
    elif choice in ("hybrid", "amx"):
        if choice == "amx" and not tiles:
            why = "this build has no AMX-BF16 tiles (a CPU with amx_bf16)"
        elif dtype == torch.bfloat16 and onednn_bf16 and "avx512_bf16" in compiled_isa:
            return "hybrid-amx" if choice == "amx" else "hybrid-dpbf16"
        else:
            why = ("only a bfloat16 model has it" if dtype != torch.bfloat16 else
                   "it needs oneDNN's native bf16 and a build with AVX512-BF16")
    elif choice == "panels" and dtype == torch.bfloat16 and "avx512_bf16" in compiled_isa:
        return "panels-dpbf16"
    elif avx2_panels:
        return "panels-avx2"
    else:
        why = "this build has no AVX2 + FMA panel GEMM"
    raise ValueError(f"{PROJECTIONS_ENV}={choice} cannot project "
                     f"{str(dtype).removeprefix('torch.')} here: {why}")


def describe_projections(kernel: str, dtype: torch.dtype, choice: str = "auto",
                         amx: bool = False) -> str:
    """A line for ``kvserve info`` and the boot log naming :func:`projection_kernel`'s pick
    (``amx``: on a build with AMX)."""
    name = str(dtype).removeprefix("torch.")
    if kernel == "panels-avx2":
        text = ("C++ AVX2 panel GEMM (panel_linear: weights packed at load in panels of 16 "
                "columns, bf16-stored where they are bf16 numbers" +
                (", activations widened to float32)" if dtype == torch.bfloat16 else ")"))
    elif kernel == "panels-dpbf16":
        text = ("C++ AVX512-BF16 panel GEMM (panel_linear_bf16: weights packed at load in "
                "panels of 16 columns by pairs of k, vdpbf16ps)")
    elif kernel == "hybrid-dpbf16":
        rows, head = hybrid_panel_rows(1, amx), hybrid_panel_rows(HYBRID_PANEL_COLUMNS + 1, amx)
        text = (f"C++ AVX512-BF16 panel GEMM up to {rows} rows (panel_linear_bf16, vdpbf16ps; "
                + (f"the LM head up to {head}" if head else "not the LM head") +
                "), oneDNN packed bf16 " + ("on AMX tiles " if amx else "") +
                "above (both packed at load)")
    elif kernel == "hybrid-amx":
        text = (f"C++ AMX-BF16 tiles up to {AMX_TILE_PANEL_ROWS} rows (panel_linear_amx over "
                "weights packed in panels of 16 columns by pairs of k; not the LM head), "
                "oneDNN packed bf16 on AMX tiles above (both packed at load)")
    elif kernel == "onednn" and dtype == torch.bfloat16:
        text = "oneDNN packed bf16 (weights packed at load; oneDNN picks AMX or AVX512-BF16 " \
               "itself)"
    elif kernel == "onednn":
        text = "oneDNN packed float32 (weights packed at load" + \
               ("; MKL's sgemm is slow at small batches on this CPU)" if choice == "auto"
                else ")")
    else:
        text = f"torch F.linear {name}"
    return text if choice == "auto" else f"{text} [{PROJECTIONS_ENV}={choice}]"


def layer_stack_enabled() -> bool:
    """``KVSERVE_LAYER_STACK=0`` runs every step's layers through the modules (to time ops
    one by one, benchmarks/profile_offline.py, or to compare); else the steps that
    :func:`describe_layer_loop` names loop in C++."""
    return os.environ.get(LAYER_STACK_ENV, "1").strip().lower() not in OFF_WORDS


def describe_layer_loop(kernel: str, dtype: torch.dtype, fused: bool, amx: bool) -> str:
    """Which steps loop over the layers in C++ (csrc/layer_stack.cpp) for this projection
    kernel: steps of a bf16 model whose projections all run on the pair panels, with their
    prefill chunks (if any) on the C++ kernel or the AMX tiles."""
    modules = "Python (the modules, one call per op)"
    if not fused or dtype != torch.bfloat16 or kernel not in (
            "hybrid-amx", "hybrid-dpbf16", "panels-dpbf16"):
        return modules
    if not layer_stack_enabled():
        return f"{modules} [{LAYER_STACK_ENV}={os.environ[LAYER_STACK_ENV]}]"
    rows = {"hybrid-amx": f"up to {AMX_TILE_PANEL_ROWS} rows",
            "hybrid-dpbf16": f"up to {hybrid_panel_rows(1, amx)} rows",
            "panels-dpbf16": "of any rows"}[kernel]
    return (f"C++ for steps {rows} (layer_stack: the same kernels, no Python between "
            "them; not where a prefill chunk takes torch's flash attention), the modules above")


def op_kernels(dtype: torch.dtype, built: bool, compiled_isa: tuple[str, ...],
               onednn_bf16: bool, packs_fp32: bool = False,
               choice: str = "auto", flags: frozenset[str] = frozenset(),
               prefill: str = "auto") -> dict[str, str]:
    """The kernel each op runs for ``dtype``, given whether the C++ extension is built, the
    instruction sets it was compiled for, whether oneDNN runs bf16 on this CPU, whether
    float32 projections are packed here (:func:`packs_float32`), KVSERVE_PROJECTIONS's
    choice (:func:`projection_kernel`; ValueError where it cannot run here), the CPU's flags
    and KVSERVE_PREFILL_ATTENTION's choice (:func:`prefill_attention_kernel`)."""
    from kvserve.model.paged_kernel import DTYPES

    fused = built and dtype in DTYPES
    vector = _vector_isa(compiled_isa)
    kernel = projection_kernel(dtype, built, compiled_isa, onednn_bf16, packs_fp32, choice)
    amx = "amx_bf16" in compiled_isa
    projections = describe_projections(kernel, dtype, choice, amx)
    lm_head = projections
    if kernel == "hybrid-amx" or (
            kernel == "hybrid-dpbf16" and not hybrid_panel_rows(HYBRID_PANEL_COLUMNS + 1, amx)):
        lm_head = describe_projections("onednn", dtype, choice)  # no panels for the head
    prefill_kernel = prefill_attention_kernel(dtype, flags, prefill, compiled_isa)
    if not fused:
        attention = "torch (gather + scaled_dot_product_attention)"
    elif dtype == torch.bfloat16 and "avx512_bf16" in compiled_isa:
        attention = ("C++ AVX512-BF16 dot products + AVX-512 (head_dim 64/128: prefill tiles as "
                     "packed-key products; others AVX-512)")
    elif "avx512f" in compiled_isa:
        attention = "C++ AVX-512 intrinsics (head_dim a multiple of 16; else vectorised loops)"
    elif "avx2" in compiled_isa and "fma" in compiled_isa:
        attention = "C++ AVX2 + FMA intrinsics (head_dim a multiple of 8; else vectorised loops)"
    else:
        attention = f"C++ compiler-vectorised loops ({vector})"
    if fused and prefill_kernel == "flash":
        attention += (f"; prefill chunks of {FLASH_PREFILL_ROWS}+ rows: torch's flash attention "
                      "(oneDNN brgemm, AMX tiles where the CPU has them)")
    elif fused and prefill_kernel == "amx":
        attention += (f"; prefill chunks of {AMX_PREFILL_ROWS}+ rows: C++ AMX-BF16 tiles "
                      f"(head_dim {AMX_PREFILL_HEAD_DIM}; others torch's flash attention)")
    if fused and prefill != "auto":  # asked for, as KVSERVE_PROJECTIONS's tag (kernel too)
        attention += f" [{PREFILL_ATTENTION_ENV}={prefill}]"
    elementwise = f"C++ fused ({vector})" if fused else "torch ops"
    plain = ", C++ greedy_rows (a step of plain greedy rows)" if dtype == torch.bfloat16 else ""
    return {"projections": projections, "lm_head": lm_head, "attention": attention,
            "rms_norm": elementwise, "silu_and_mul": elementwise, "rope_kv_write": elementwise,
            "layer_loop": describe_layer_loop(kernel, dtype, fused, amx),
            "sampling": (f"C++ argmax_rows (greedy rows){plain}, torch (sampled rows)" if built
                         else "torch")}


@dataclass(frozen=True)
class KernelReport:
    cpu: CpuInfo
    torch_version: str
    aten_cpu_capability: str
    threads: int
    onednn_bf16: bool
    extension_built: bool
    extension_error: str | None
    compiled_isa: tuple[str, ...]

    choice: str = "auto"  # KVSERVE_PROJECTIONS
    prefill: str = "auto"  # KVSERVE_PREFILL_ATTENTION

    def ops(self, dtype: torch.dtype) -> dict[str, str]:
        return op_kernels(dtype, self.extension_built, self.compiled_isa, self.onednn_bf16,
                          packs_float32(self.cpu.flags), self.choice, self.cpu.flags,
                          self.prefill)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``kvserve info --json``."""
        return {
            "cpu": {"model": self.cpu.model, "family": self.cpu.family,
                    "model_number": self.cpu.model_number, "name": self.cpu.name,
                    "logical_cpus": self.cpu.logical_cpus, "isa": self.cpu.isa()},
            "torch": {"version": self.torch_version,
                      "aten_cpu_capability": self.aten_cpu_capability,
                      "threads": self.threads, "onednn_bf16": self.onednn_bf16},
            "extension": {"built": self.extension_built, "error": self.extension_error,
                          "compiled_isa": list(self.compiled_isa)},
            "ops": {name: self._ops_or_refusal(dtype) for name, dtype in
                    (("float32", torch.float32), ("bfloat16", torch.bfloat16))},
        }

    def _ops_or_refusal(self, dtype: torch.dtype) -> dict[str, str]:
        """The ops' kernels, or ``{"refused": why}`` where a KVSERVE_ choice cannot run
        this dtype (QA: KVSERVE_PROJECTIONS=hybrid, bf16 only, made `kvserve info` exit 2
        on its float32 rows instead of printing the bf16 pick)."""
        try:
            return self.ops(dtype)
        except ValueError as error:
            return {"refused": str(error)}


def onednn_runs_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and \
        bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def kernel_report() -> KernelReport:
    """This machine's report; builds (or loads) the C++ extension if that was not done yet."""
    from kvserve.model import paged_kernel

    built = paged_kernel.available()
    compiled = tuple(paged_kernel.compiled_isa()) if built else ()
    return KernelReport(cpu_info(), torch.__version__,
                        torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(),
                        onednn_runs_bf16(), built, paged_kernel.unavailable_reason(),
                        compiled, projection_choice(), prefill_attention_choice())


def isa_line(cpu: CpuInfo) -> str:
    isa = cpu.isa()
    found = " ".join(flag for flag, present in isa.items() if present) or "none of interest"
    missing = " ".join(flag for flag, present in isa.items() if not present)
    return f"{found}" + (f" (not found: {missing})" if missing else "")


def describe_quantization(quantization: str) -> str:
    """The projections' kernel under ``--quantization`` (:mod:`kvserve.model.quantization`)."""
    from kvserve.model import paged_kernel

    ops = paged_kernel.layer_ops() if paged_kernel.available() else None
    path = ops.int8_linear_path() if ops is not None else "none"
    sums = {"amx": "AMX-INT8 tdpbssd", "avx512_vnni": "AVX512-VNNI vpdpwssd",
            "avx2": "AVX2 vpmaddwd"}.get(path, path)
    if ops is not None and path != "amx" and cpu_info().isa().get("amx_int8"):
        sums += f" (AMX-INT8 unused: {ops.int8_amx_unavailable()})"
    return (f"int8_linear [--quantization {quantization}]: W8A8 int8 (weights per column at "
            f"load, rows per token and group of 64 each step), exact int32 sums by {sums}; LM "
            "head in the model's dtype")


def boot_lines(report: KernelReport, dtype: torch.dtype,
               quantization: str | None = None) -> list[str]:
    """What the server and ``kvserve generate`` log at start-up."""
    ops = report.ops(dtype)
    if quantization is not None:
        ops["projections"] = describe_quantization(quantization)
    built = "built" if report.extension_built else f"not built ({report.extension_error})"
    return [f"CPU: {report.cpu.name}, {report.cpu.logical_cpus} logical CPUs, "
            f"{report.threads} torch threads; ISA: {isa_line(report.cpu)}",
            f"C++ kernels {built}; {str(dtype).removeprefix('torch.')} kernels: "
            + "; ".join(f"{op} {kernel}" for op, kernel in ops.items())]
