#!/usr/bin/env python
"""Run kvserve's AVX-512 kernel code under an x86 emulator, on a CPU without AVX-512.

The AVX-512 paths of the C++ kernels run, and are tested (tests/model), only where the CPU
has AVX-512; a change made on an AVX2 machine leaves them compile-checked at best. This
script runs what can be lifted out of the extension into a flat binary under BochsCPU
(bochscpu-python, in the dev extra) on an emulated Sapphire Rapids (see below) and compares it
with a reference:

- ``panels``: csrc/panel_dpbf16.h's loops (``panel_rows``) with ``NativeDot`` (vdpbf16ps) and
  with ``WidenDot`` (its AVX-512F stand-in), over many shapes, against the same chain of
  float32 FMAs done exactly in numpy (bit for bit), all of a weight's panels in one call (its
  register blocks of several panels), with sentinels past the call's columns;
- ``tiles``: csrc/attention_tile.h's dispatch (``dots``, ``accumulate_values``) as an AVX-512
  build runs it: ``FloatDot<Vec16>`` for float32 and bfloat16 keys, ``Bf16Dot`` (vdpbf16ps)
  for bf16 queries and keys, ``accumulate_simd<Vec16>``; head_dim 64, 128 and sizes known at
  run time; groups of 1-7 rows; 1-40 keys; against float64 sums within float32 rounding;
  csrc/attention_gemm.h's prefill tile (``pack_keys`` + ``scores_packed``,
  ``pack_value_pairs`` + ``probability_pairs`` + ``accumulate_pairs``) the same way; and
  ``exp_nonpositive16`` (csrc/fast_math.h) against the scalar ``exp_nonpositive`` compiled
  for this CPU, bit for bit, as the header promises;
- ``invariant``: csrc/invariant_blocks.h, invariant_linear.cpp's register blocks
  (``F32Step``, ``Bf16Step``), within float32 rounding, each row bit-identical alone and in
  its batch;
- ``softmax``: csrc/attention_softmax.h, paged_attention.cpp's online-softmax step
  (``row_max``, ``exponentiate_row``), against numpy;
- ``int8``: csrc/int8_blocks.h (``--quantization int8``): the rows quantized per group of 64
  and summed against int8 panels by the AVX512-VNNI path (vpdpwssd) and by the AVX2 path
  (vpmaddwd), bit-identical to each other and within float32 rounding of a float64 reference
  on numpy's own quantization, with sentinels past each panel's columns;
- ``amx``: int8_blocks.h's AMX-INT8 path (``tdpbssd``). The emulator has no AMX, so this
  build defines ``KVSERVE_AMX_MODEL`` and csrc/amx_tiles.h turns the tile instructions into a
  software model of them written from the ISA's description; the rest (quantization, the
  AVX-512 FMAs and masked stores) runs as emulated Sapphire Rapids code. The check pins the
  model to the ISA (its TDPBSSD against numpy over several tile shapes, and a fault on a
  configuration the CPU refuses), then the path bit-identical to the AVX2 path over the
  engine's own quad panels (``quantization.pack_int8(weight, "quads")``), sentinels intact.

BochsCPU runs every CPU model of Bochs, but bochscpu fixes the model to a Cannon Lake i3
(AVX-512 without AVX512-BF16 or VNNI, so vdpbf16ps and vpdpwssd fault with #UD). The script
runs a patched copy of the wheel's library: in ``BX_CPU_C::initialize``'s switch over the
model, the Cannon Lake case (``call create_corei3_cnl_cpuid@plt; jmp``) calls
``create_sapphire_rapids_cpuid@plt`` instead, the case just before it in the same switch. The
emulated CPU is then a Sapphire Rapids (a Xeon w9-3475X: AVX-512, AVX512-BF16, AVX512-VNNI,
AVX512-FP16; no AMX, which this build of Bochs leaves out), and the code is compiled for
``-march=cannonlake -mavx512bf16 -mavx512vnni``. Where those bytes are not found (another
wheel), the Cannon Lake runs and the vdpbf16ps, VNNI and AMX checks are skipped and say so.
What it cannot run: the real AMX instructions (only the model, which shares the author's
reading of the ISA with the kernel: a real AMX CPU runs tests/model/test_quantization.py's
AMX test instead), anything that needs torch at run time, and the real CPUs' rounding of
vdpbf16ps (the emulator follows the ISA's pseudo-code: two float32 multiply-adds per lane,
odd element first).

    python tools/avx512_check.py [--only panels|tiles|invariant|softmax|int8|amx] [--cases 60]

Needs g++, binutils, numpy, bochscpu-python (the dev extra) and kvserve with torch (its
headers; the engine's own weight packing): run it with the project's virtualenv. Prints one
line per case and a summary per check; exits 1 on any mismatch. The bochscpu-python 0.4.0
wheel needs glibc 2.38's ``__isoc23_*`` symbols; on an older glibc the script builds a
two-function shim and re-runs itself with it preloaded. tests/model/test_avx512_emulated.py runs it.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

CSRC = Path(__file__).resolve().parent.parent / "src" / "kvserve" / "model" / "csrc"
PANEL_ENTRY = """
#include "panel_dpbf16.h"
#define PANEL_ENTRY(NAME, DOT)                                                           \
  extern "C" void NAME(const uint16_t* x, int64_t rows, const uint16_t* panels,          \
                       int64_t k_pairs, float* out, int64_t ldo, int64_t ncols) {        \
    kvserve::dpbf16::panel_rows<kvserve::dpbf16::DOT>(x, rows, panels, k_pairs, out, ldo, \
                                                      ncols);                            \
  }
PANEL_ENTRY(panel_rows_widen, WidenDot)
#if defined(__AVX512BF16__)
PANEL_ENTRY(panel_rows_native, NativeDot)
#endif
"""
TILE_ENTRY = """
#include "attention_tile.h"
using kvserve::dots;
using kvserve::accumulate_values;
using BF16 = c10::BFloat16;
#define TILE_ENTRIES(T, NAME, D)                                                              \\
  extern "C" void dots_##NAME##_##D(const float* q, int group, int head_dim,                 \\
                                    const T* const* rows, long off, int count, float* scores, \\
                                    int stride) {                                             \\
    dots<T, D>(q, nullptr, group, head_dim, rows, off, count, scores, stride);                \\
  }                                                                                           \\
  extern "C" void acc_##NAME##_##D(float* acc, int group, int head_dim, const T* const* rows, \\
                                   long off, int count, const float* probs, int stride) {     \\
    accumulate_values<T, D>(acc, group, head_dim, rows, off, count, probs, stride);           \\
  }
TILE_ENTRIES(float, f32, 64)
TILE_ENTRIES(float, f32, 128)
TILE_ENTRIES(float, f32, 0)
TILE_ENTRIES(BF16, bf16, 64)
TILE_ENTRIES(BF16, bf16, 128)
TILE_ENTRIES(BF16, bf16, 0)
#if defined(__AVX512BF16__)
#include "attention_gemm.h"
#define BF16_ENTRIES(D)                                                                       \
  extern "C" void dots_bf16q_##D(const BF16* q, int group, int head_dim,                     \
                                 const BF16* const* rows, long off, int count, float* scores, \
                                 int stride) {                                               \
    static const float unused = 0.0f;                                                         \
    dots<BF16, D>(&unused, q, group, head_dim, rows, off, count, scores, stride);            \
  }                                                                                           \
  extern "C" void packed_scores_##D(const BF16* q, int nrows, const BF16* const* rows,       \
                                    long off, int count, uint32_t* packed, int packed_stride, \
                                    float* scores, int stride) {                              \
    kvserve::pack_keys<D>(rows, off, count, packed, packed_stride);                           \
    kvserve::scores_packed<D>(q, nrows, packed, packed_stride, count, scores, stride);       \
  }                                                                                           \
  extern "C" void pair_acc_##D(float* acc, int nrows, const BF16* const* rows, long off,     \
                               int count, uint32_t* packed, const int* visible,               \
                               const float* probs, int stride, uint32_t* pairs) {             \
    kvserve::pack_value_pairs<D>(rows, off, count, packed);                                   \
    kvserve::probability_pairs(probs, nrows, stride, count, pairs, stride / 2);               \
    kvserve::accumulate_pairs<D>(acc, nrows, packed, visible, pairs, stride / 2);             \
  }
BF16_ENTRIES(64)
BF16_ENTRIES(128)
#endif
extern "C" void exp16(const float* x, float* out, int n) {
  for (int i = 0; i < n; i += 16)
    _mm512_storeu_ps(out + i, kvserve::exp_nonpositive16(_mm512_loadu_ps(x + i)));
}
"""
INVARIANT_ENTRY = """
#include "invariant_blocks.h"
// invariant_linear.cpp's loop over rows and columns without the tensors: out [rows, n] float32.
template <typename T>
void run(const T* x, const T* w, int64_t rows, int64_t n, int64_t k, float* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    kvserve::with_constant<4>(static_cast<int>(rows - r0 < 4 ? rows - r0 : 4), [&](auto rn) {
      kvserve::for_chunks<4>(static_cast<int>(n), [&](int c, auto cn) {
        kvserve::invariant::block<T, decltype(rn)::value, decltype(cn)::value>(
            x + r0 * k, w + c * k, k, out + r0 * n + c, n);
      });
    });
  }
}
extern "C" void invariant_f32(const float* x, const float* w, int64_t rows, int64_t n,
                              int64_t k, float* out) {
  run<float>(x, w, rows, n, k, out);
}
extern "C" void invariant_bf16(const c10::BFloat16* x, const c10::BFloat16* w, int64_t rows,
                               int64_t n, int64_t k, float* out) {
  run<c10::BFloat16>(x, w, rows, n, k, out);
}
"""
SOFTMAX_ENTRY = """
#include "attention_softmax.h"
extern "C" void softmax_step_64(float* scores, int rows, int stride, const int* visible,
                                float* m, float* l, float* acc) {
  kvserve::softmax_step<64>(scores, rows, stride, visible, m, l, acc, 64);
}
"""
INT8_ENTRY = """
#include "int8_blocks.h"
// int8_linear.cpp's call without the tensors or threads: rows quantized, then each panel.
template <bool Vnni>
void run(const float* x, int64_t rows, int64_t k, const int8_t* panels, const float* scales,
         float* out, int64_t n, int64_t ldo, int16_t* q, float* sx) {
  using namespace kvserve::int8;
  const int64_t k_pairs = (k + 1) / 2, ldq = 2 * k_pairs, ldg = (k + kGroup - 1) / kGroup;
  for (int64_t t = 0; t < rows; ++t) quantize_row(x + t * k, k, q + t * ldq, sx + t * ldg);
  for (int64_t p = 0; p * kPanel < n; ++p) {
    const int ncols = static_cast<int>(n - p * kPanel < kPanel ? n - p * kPanel : kPanel);
    const int8_t* panel = panels + p * k_pairs * 2 * kPanel;
#if defined(KVSERVE_INT8_VNNI)
    if (Vnni) {
      panel_rows_vnni(q, rows, ldq, sx, ldg, panel, k_pairs, scales + p * kPanel,
                      out + p * kPanel, ldo, ncols);
      continue;
    }
#endif
    panel_rows_avx2(q, rows, ldq, sx, ldg, panel, k_pairs, scales + p * kPanel,
                    out + p * kPanel, ldo, ncols);
  }
}
#define INT8_ENTRY(NAME, VNNI)                                                            \
  extern "C" void NAME(const float* x, int64_t rows, int64_t k, const int8_t* panels,     \
                       const float* scales, float* out, int64_t n, int64_t ldo, int16_t* q, \
                       float* sx) {                                                       \
    run<VNNI>(x, rows, k, panels, scales, out, n, ldo, q, sx);                            \
  }
INT8_ENTRY(int8_rows_avx2, false)
#if defined(KVSERVE_INT8_VNNI)
INT8_ENTRY(int8_rows_vnni, true)
#endif
"""
AMX_ENTRY = INT8_ENTRY + """
// int8_linear_quads's call without the tensors or threads (amx_tiles.h's software model:
// built with -DKVSERVE_AMX_MODEL): rows quantized to int8, scales per block of 16 as
// [groups][16], then each quad panel.
extern "C" void amx_rows(const float* x, int64_t rows, int64_t k, const int8_t* panels,
                         const float* scales, float* out, int64_t n, int64_t ldo, int8_t* qa,
                         float* sx) {
  using namespace kvserve::int8;
  const int64_t groups = (k + kGroup - 1) / kGroup, ldqa = groups * kGroup;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t block = t / kAmxRows * kAmxRows;
    quantize_row_int8(x + t * k, k, qa + t * ldqa, ldqa, sx + block * groups + t - block,
                      kAmxRows);
  }
  KVSERVE_TILE_LOADCONFIG(kAmxConfig.bytes);
  for (int64_t p = 0; p * kPanel < n; ++p) {
    const int ncols = static_cast<int>(n - p * kPanel < kPanel ? n - p * kPanel : kPanel);
    amx_panel_rows(qa, rows, ldqa, sx, panels + p * groups * kTileBytes, scales + p * kPanel,
                   out + p * kPanel, ldo, ncols);
  }
  KVSERVE_TILE_RELEASE();
}
// One TDPBSSD of the model on tiles 0 (c), 1 (a), 2 (b) under `config`; c back in c.
extern "C" void amx_dpbssd(const uint8_t* config, const int8_t* a, int64_t lda, const int8_t* b,
                           int64_t ldb, int32_t* c, int64_t ldc) {
  KVSERVE_TILE_LOADCONFIG(config);
  KVSERVE_TILE_LOADD(0, c, ldc);
  KVSERVE_TILE_LOADD(1, a, lda);
  KVSERVE_TILE_LOADD(2, b, ldb);
  KVSERVE_TILE_DPBSSD(0, 1, 2);
  KVSERVE_TILE_STORED(0, c, ldc);
  KVSERVE_TILE_RELEASE();
}
"""
EXP_NATIVE = """
#include "fast_math.h"
extern "C" void exp_scalar(const float* x, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = kvserve::exp_nonpositive(x[i]);
}
"""
# the entries' names; the rest of a file is dropped
ENTRY_PREFIXES = ("panel_rows_", "dots_", "acc_", "packed_scores_", "pair_acc_", "exp16",
                  "invariant_", "softmax_", "int8_rows_", "amx_")
LINKER_SCRIPT = """SECTIONS { . = 0x400000;
.text : { *(.text*) *(.rodata*) *(.data*) *(.bss*) *(.init_array*) *(.fini_array*) }
/DISCARD/ : { *(.eh_frame*) *(.gcc_except_table*) *(.comment) *(.note*) } }"""
# What torch's headers make a translation unit refer to without calling it here: the iostream
# static initializer (never run: the image's constructors are not called) and the memory
# functions gcc may call for a copy. Compiled with -fno-builtin so the loops stay loops.
STUBS = """#include <stddef.h>
void* memcpy(void* to, const void* from, size_t n) {
  unsigned char* a = to; const unsigned char* b = from; while (n--) *a++ = *b++; return to; }
void* memmove(void* to, const void* from, size_t n) {
  unsigned char* a = to; const unsigned char* b = from;
  if (a < b) { while (n--) *a++ = *b++; } else { while (n--) a[n] = b[n]; } return to; }
void* memset(void* to, int c, size_t n) { unsigned char* a = to; while (n--) *a++ = c; return to; }
int __cxa_atexit(void (*f)(void*), void* p, void* d) { (void)f; (void)p; (void)d; return 0; }
void* __dso_handle = 0;
void _ZNSt8ios_base4InitC1Ev(void* self) { (void)self; }
void _ZNSt8ios_base4InitD1Ev(void* self) { (void)self; }
"""
SHIM = """#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
unsigned long long __isoc23_strtoull(const char* s, char** e, int b) { return strtoull(s, e, b); }
int __isoc23_sscanf(const char* s, const char* f, ...) {
  va_list a; va_start(a, f); int r = vsscanf(s, f, a); va_end(a); return r; }
"""
FLAGS = ["-O3", "-std=c++17", "-fno-trapping-math", "-fno-pic", "-fno-pie", "-fno-exceptions",
         "-fno-asynchronous-unwind-tables", "-fno-stack-protector", "-ffunction-sections",
         "-fdata-sections", "-w", f"-I{CSRC}"]

CODE_VA, RETURN_VA, STACK_VA, DATA_VA, PML4 = 0x400000, 0x300000, 0x200000, 0x10000000, 0x100000
PAGE = 4096
SENTINEL = np.float32(12345.0)


# BX_CPU_C::initialize's case for the Cannon Lake model: call create_corei3_cnl_cpuid@plt;
# jmp to the join. And the Sapphire Rapids case before it: call create_sapphire_rapids_cpuid@plt;
# mov bx_cpu,%rbx (the join itself). Both in bochscpu-python 0.4.0's library.
CANNON_LAKE_CASE = bytes.fromhex("e85c67faff" "e931fdffff")
SAPPHIRE_RAPIDS_CASE = bytes.fromhex("e8466efaff" "488b1d17d13f00")


def scratch_dir(prefix: str) -> Path:
    """A temporary directory removed when this process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def preload_shim_if_needed() -> None:
    """On a glibc older than 2.38 (the wheel's library wants its __isoc23_* functions),
    re-run this script with a two-function shim preloaded; the child removes it at exit."""
    if os.environ.get("KVSERVE_BOCHS_SHIM"):
        atexit.register(shutil.rmtree, os.environ["KVSERVE_BOCHS_SHIM"], ignore_errors=True)
        return
    name, _, version = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")
    if name != "glibc" or tuple(int(part) for part in version.split(".")[:2]) >= (2, 38):
        return
    directory = Path(tempfile.mkdtemp(prefix="isoc23-shim-"))
    (directory / "shim.c").write_text(SHIM)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "shim.c", "-o", "shim.so"],
                   cwd=directory, check=True)
    env = dict(os.environ, LD_PRELOAD=str(directory / "shim.so"),
               KVSERVE_BOCHS_SHIM=str(directory))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def call_target(data: bytes, at: int) -> int:
    """Where the rel32 ``call`` at offset ``at`` goes (as a file offset, which is the virtual
    address in this library's text)."""
    return at + 5 + int.from_bytes(data[at + 1:at + 5], "little", signed=True)


def patched_copy() -> Path | None:
    """A copy of the installed bochscpu package whose CPU is the Sapphire Rapids model, in a
    directory to put first on sys.path (None where the patterns are not in this wheel)."""
    import importlib.util

    spec = importlib.util.find_spec("bochscpu")
    if spec is None or spec.origin is None:
        raise SystemExit("avx512_check: pip install bochscpu-python first")
    root = scratch_dir("bochscpu-spr-")
    shutil.copytree(Path(spec.origin).parent, root / "bochscpu")
    patched = 0
    for library in (root / "bochscpu").glob("_bochscpu*.so"):
        data = bytearray(library.read_bytes())
        cannon_lake, sapphire_rapids = data.find(CANNON_LAKE_CASE), data.find(SAPPHIRE_RAPIDS_CASE)
        if cannon_lake < 0 or sapphire_rapids < 0:
            continue
        rel = call_target(data, sapphire_rapids) - (cannon_lake + 5)
        data[cannon_lake + 1:cannon_lake + 5] = rel.to_bytes(4, "little", signed=True)
        library.write_bytes(bytes(data))
        patched += 1
    return root if patched else None


def import_bochscpu() -> tuple[Any, bool]:
    """bochscpu (the patched copy where it can be made) and whether its CPU is the Sapphire
    Rapids (vdpbf16ps and vpdpwssd run)."""
    preload_shim_if_needed()
    root = patched_copy()
    if root is not None:
        sys.path.insert(0, str(root))
    try:
        import bochscpu
        import bochscpu.cpu
        import bochscpu.memory
    except ImportError as error:
        raise SystemExit(f"avx512_check: bochscpu-python does not load: {error}") from error
    if root is None:
        print("Sapphire Rapids model: this bochscpu's library lacks the expected bytes; the "
              "vdpbf16ps and VNNI checks are skipped")
    return bochscpu, root is not None


def torch_includes() -> list[str] | None:
    try:
        from torch.utils.cpp_extension import include_paths
    except ImportError:
        return None
    import sysconfig

    return [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]


def build_flat(workdir: Path, source: str, isa: list[str],
               includes: list[str]) -> tuple[bytes, dict[str, int]]:
    """``source`` compiled for ``isa`` and linked at CODE_VA: the image and its symbols."""
    (workdir / "entry.cpp").write_text(source)
    (workdir / "stubs.c").write_text(STUBS)
    (workdir / "flat.ld").write_text(LINKER_SCRIPT)
    subprocess.run(["g++", *FLAGS, *isa, *includes, "-c", "entry.cpp", "-o", "entry.o"],
                   cwd=workdir, check=True)
    subprocess.run(["gcc", "-O1", "-fno-builtin", "-ffreestanding", "-fno-pic", "-fno-pie",
                    "-fno-tree-loop-distribute-patterns", "-fno-asynchronous-unwind-tables",
                    "-c", "stubs.c", "-o", "stubs.o"], cwd=workdir, check=True)
    # the extern "C" entry points (named by their prefixes) are kept; --gc-sections drops all
    # they do not reach, such as the extension's tensor functions and its module init
    defined = subprocess.run(["nm", "--defined-only", "-g", "entry.o"], cwd=workdir, check=True,
                             capture_output=True, text=True).stdout.split("\n")
    entries = [f"--undefined={fields[2]}" for fields in map(str.split, defined)
               if len(fields) == 3 and fields[1] == "T" and fields[2].startswith(ENTRY_PREFIXES)]
    subprocess.run(["ld", "--no-warn-rwx-segments", "--gc-sections", *entries, "-T", "flat.ld",
                    "-o", "entry.elf", "entry.o", "stubs.o"], cwd=workdir, check=True)
    subprocess.run(["objcopy", "-O", "binary", "entry.elf", "entry.bin"], cwd=workdir,
                   check=True)
    symbols = {}
    for line in subprocess.run(["nm", "entry.elf"], cwd=workdir, check=True,
                               capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "Tt":
            symbols[parts[2]] = int(parts[0], 16)
    return (workdir / "entry.bin").read_bytes(), symbols


class Machine:
    """One emulated long-mode CPU (CPL 3, identity-mapped pages) that calls a function of a
    flat image with the SysV ABI."""

    def __init__(self, bochscpu: Any, image: bytes, symbols: dict[str, int]) -> None:
        self.bx, self.image, self.symbols = bochscpu, image, symbols

    @staticmethod
    def addresses(sizes: list[int]) -> list[int]:
        """Where :meth:`call` places buffers of these sizes (a free page after each)."""
        out, va = [], DATA_VA
        for size in sizes:
            out.append(va)
            va += (size // PAGE + 2) * PAGE
        return out

    def call(self, symbol: str, args: list[int], buffers: list[bytes]) -> list[bytes]:
        """Run ``symbol(*args)`` with the buffers at :meth:`addresses`; the buffers after."""
        bx = self.bx
        session = bx.Session()

        def missing(gpa: int) -> None:
            raise RuntimeError(f"page fault at {gpa:#x}")

        session.missing_page_handler = missing
        table = bx.memory.PageMapLevel4Table()
        hosts = []

        def map_range(va: int, size: int) -> None:
            for page in range(va - va % PAGE, va + max(size, 1), PAGE):
                host = bx.memory.allocate_host_page()
                hosts.append(host)
                bx.memory.page_insert(page, host)
                table.insert(page, page, 1)

        addresses = self.addresses([len(b) for b in buffers])
        map_range(CODE_VA, len(self.image))
        map_range(RETURN_VA, PAGE)
        map_range(STACK_VA, 4 * PAGE)
        for address, data in zip(addresses, buffers, strict=True):
            map_range(address, len(data))
        for host, gpa in table.commit(PML4):
            bx.memory.page_insert(gpa, host)

        def write(va: int, data: bytes) -> None:
            if data and not bx.memory.virt_write(PML4, va, list(data)):
                raise RuntimeError(f"cannot write at {va:#x}")

        write(CODE_VA, self.image)
        write(RETURN_VA, b"\xf4" * 16)  # hlt: a #GP at CPL 3, which ends the run
        for address, data in zip(addresses, buffers, strict=True):
            write(address, data)
        values = [value & 0xFFFFFFFFFFFFFFFF for value in args]
        # the return address, then arguments 7 onwards; rsp + 8 16-byte aligned, as the ABI has
        # it after a call (GCC may keep 16-byte temporaries on the stack with aligned stores)
        rsp = STACK_VA + 3 * PAGE - 8
        write(rsp, struct.pack(f"<{1 + len(values[6:])}Q", RETURN_VA, *values[6:]))

        state = bx.State()
        bx.cpu.set_long_mode(state)
        state.cr0 = state.cr0 | 0x2                                  # MP
        state.cr4 = state.cr4 | (1 << 9) | (1 << 10) | (1 << 18)     # OSFXSR, OSXMMEXCPT, OSXSAVE
        state.xcr0 = 0xE7                                            # x87 SSE AVX opmask ZMM
        state.mxcsr = 0x1F80                                         # exceptions masked
        state.cr3, state.rsp, state.rip = PML4, rsp, self.symbols[symbol]
        code_segment, data_segment = bx.Segment(), bx.Segment()
        for segment, selector, attr in ((code_segment, 0x33, 0x22FB),
                                        (data_segment, 0x2B, 0xCF3)):
            segment.present, segment.selector, segment.base = True, selector, 0
            segment.limit, segment.attr = 0xFFFFFFFF, attr
        state.cs = code_segment
        state.ds = state.ss = state.es = state.fs = state.gs = data_segment
        registers = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
        for register, value in zip(registers, values[:6], strict=False):
            setattr(state, register, value)
        session.cpu.state = state
        stopped: list[tuple[int, int]] = []

        def exception(sess: Any, cpu_id: int, vector: int, error: int) -> None:
            stopped.append((vector, sess.cpu.rip))
            sess.stop()

        hook = bx.Hook()
        hook.exception = exception
        session.run([hook])
        vector, rip = stopped[0]
        if not RETURN_VA <= rip < RETURN_VA + 16:
            raise RuntimeError(f"{symbol}: exception {vector} at rip {rip:#x} (not a return)")
        out = [bytes(bx.memory.virt_read(PML4, address, len(data)))
               for address, data in zip(addresses, buffers, strict=True)]
        for host in hosts:
            bx.memory.release_host_page(host)
        return out


def bf16_bits(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def rounded_bf16_bits(values: np.ndarray) -> np.ndarray:
    """bf16 bits of finite values rounded to nearest even (vcvtneps2bf16's rounding)."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


# --- panels ----------------------------------------------------------------------------------

def pack_pair_panels(weight: np.ndarray) -> np.ndarray:
    """The engine's own packing (llama.pack_pair_panels) of bf16 bits [n, k]:
    [ceil(n / 16), k / 2, 16, 2], so the layout checked is the one the engine makes."""
    import torch

    from kvserve.model.llama import pack_pair_panels as pack

    bits = torch.from_numpy(np.ascontiguousarray(weight).view(np.int16)).view(torch.bfloat16)
    return pack(bits).view(torch.int16).numpy().view(np.uint16)


def widen_dot_chain(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """WidenDot's sums exactly: per pair of k, the high (odd k) product then the low one,
    each added to the float32 sum with one rounding (a bf16 x bf16 product is exact in
    float32, and a float32 sum plus it is exact in float64 before the rounding)."""
    acc = np.zeros((x.shape[0], weight.shape[0]), np.float32)
    for q in range(x.shape[1] // 2):
        for kk in (2 * q + 1, 2 * q):
            product = np.outer(x[:, kk], weight[:, kk]).astype(np.float64)
            acc = (acc.astype(np.float64) + product).astype(np.float32)
    return acc


def isa(sapphire_rapids: bool) -> list[str]:
    """What the code is compiled for: the Cannon Lake's instruction sets, plus AVX512-BF16 and
    AVX512-VNNI where the emulated CPU is the Sapphire Rapids."""
    return ["-march=cannonlake", "-mtune=generic"] + (
        ["-mavx512bf16", "-mavx512vnni"] if sapphire_rapids else [])


def check_panels(machine: Machine, bf16: bool, scratch: Path, cases: int,
                 includes: list[str]) -> tuple[int, int]:
    rng = np.random.default_rng(0)
    shapes = [(rows, n, pairs) for rows in (1, 2, 5, 12, 13, 24, 25) for n, pairs in
              ((16, 4), (5, 8), (21, 3), (40, 36), (131, 5))]
    shapes += [(int(rng.integers(1, 40)), int(rng.integers(1, 50)), int(rng.integers(1, 40)))
               for _ in range(max(0, cases - len(shapes)))]
    shapes = shapes[:max(cases, 1)]
    entries = ["panel_rows_widen"] + (["panel_rows_native"] if bf16 else [])
    passed = total = 0
    for rows, n, pairs in shapes:
        k = 2 * pairs
        x = bf16_bits(rng.standard_normal((rows, k)))
        weight = bf16_bits(rng.standard_normal((n, k)))
        panels = pack_pair_panels(weight)
        expected = widen_dot_chain(widen(x), widen(weight))
        for entry in entries:
            # all the panels in one call (register blocks of several panels), out in rows
            # n + 16 wide (ldo): sentinels past its n columns
            sentinel = np.full((rows, n + 16), SENTINEL)
            addresses = Machine.addresses([x.nbytes, panels.nbytes, sentinel.nbytes])
            result = machine.call(entry, [addresses[0], rows, addresses[1], pairs,
                                          addresses[2], n + 16, n],
                                  [x.tobytes(), panels.tobytes(), sentinel.tobytes()])[2]
            out = np.frombuffer(result, np.float32).reshape(rows, n + 16)
            wrote_past = not np.all(out[:, n:] == SENTINEL)
            got = out[:, :n]
            ok = np.array_equal(got, expected) and not wrote_past
            passed += ok
            total += 1
            verdict = "bit-identical" if ok else "wrote past its columns" if wrote_past else \
                "MISMATCH"
            print(f"panels {entry} rows={rows:3d} n={n:3d} k={k:3d}: {verdict}")
    return passed, total


# --- attention tiles -------------------------------------------------------------------------

def native_exp(scratch: Path, includes: list[str]) -> Callable[[np.ndarray], np.ndarray]:
    """exp_nonpositive compiled for this CPU, as the extension compiles it."""
    (scratch / "exp_native.cpp").write_text(EXP_NATIVE)
    library = scratch / "exp_native.so"
    subprocess.run(["g++", "-O3", "-march=native", "-std=c++17", "-fno-trapping-math", "-shared",
                    "-fPIC", f"-I{CSRC}", *includes, "exp_native.cpp", "-o", str(library)],
                   cwd=scratch, check=True)
    function = ctypes.CDLL(str(library)).exp_scalar

    def run(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty_like(x)
        function(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                 ctypes.c_int(x.size))
        return out

    return run


def within_rounding(got: np.ndarray, expected: np.ndarray, magnitude: np.ndarray,
                    terms: int) -> bool:
    """|got - expected| within float32 rounding of a sum of ``terms`` products whose absolute
    values sum to ``magnitude``."""
    return bool(np.all(np.abs(got - expected) <= 1e-6 * magnitude * terms ** 0.5 + 1e-30))


class TileCase:
    """One GQA group's query rows against ``count`` key/value rows of a cache block, the rows
    reached through a table of pointers (in reverse memory order), as the kernel sees them."""

    def __init__(self, rng: np.random.Generator, dtype: str, head_dim: int, group: int,
                 count: int) -> None:
        self.dtype, self.head_dim, self.group, self.count = dtype, head_dim, group, count
        self.off = int(rng.integers(0, 3)) * head_dim  # the row's head within the block
        width = self.off + head_dim + 16
        block = rng.standard_normal((count, width)).astype(np.float32)
        if dtype == "f32":
            self.block_bytes, self.row_bytes = block[::-1].copy(), 4 * width
            self.keys = block[:, self.off:self.off + head_dim].astype(np.float64)
        else:
            bits = bf16_bits(block)
            self.block_bytes, self.row_bytes = bits[::-1].copy(), 2 * width
            self.keys = widen(bits)[:, self.off:self.off + head_dim].astype(np.float64)
        self.stride = count + 5

    def pointers(self, block_address: int) -> bytes:
        return np.array([block_address + self.row_bytes * (self.count - 1 - t)
                         for t in range(self.count)], np.uint64).tobytes()


def check_tiles(machine: Machine, bf16: bool, scratch: Path, cases: int,
                includes: list[str]) -> tuple[int, int]:
    rng = np.random.default_rng(1)
    configs = [("f32", 64, 64), ("f32", 128, 128), ("f32", 0, 48), ("bf16", 64, 64),
               ("bf16", 128, 128), ("bf16", 0, 96)]
    if bf16:
        configs += [("bf16q", 64, 64), ("bf16q", 128, 128), ("packed", 64, 64),
                    ("packed", 128, 128)]
    passed = total = 0
    for index in range(max(cases, len(configs))):
        kind, d, head_dim = configs[index % len(configs)]
        case = TileCase(rng, "f32" if kind == "f32" else "bf16", head_dim,
                        int(rng.integers(1, 8)), int(rng.integers(1, 41)))
        check = tile_packed if kind == "packed" else tile_dots_and_values
        ok = check(machine, rng, case, kind, d)
        passed += ok
        total += 1
        print(f"tiles {kind:6s} head_dim={head_dim:3d} (D={d:3d}) rows={case.group} "
              f"keys={case.count:2d} off={case.off:3d}: "
              f"{'within float32 rounding' if ok else 'MISMATCH'}")
    reference = native_exp(scratch, includes)
    x = np.concatenate([-rng.exponential(8.0, 4096), -np.linspace(0, 100, 4096),
                        np.array([0.0, -0.0, -87.0, -87.5, -1e-30, -200.0])]).astype(np.float32)
    x = np.concatenate([x, np.zeros((-len(x)) % 16, np.float32)])
    addresses = Machine.addresses([x.nbytes, x.nbytes])
    out = machine.call("exp16", [*addresses, len(x)], [x.tobytes(), bytes(x.nbytes)])[1]
    ok = np.array_equal(np.frombuffer(out, np.float32), reference(x))
    print(f"tiles exp_nonpositive16 on {len(x)} values: "
          f"{'bit-identical to exp_nonpositive' if ok else 'MISMATCH'}")
    return passed + ok, total + 1


def tile_dots_and_values(machine: Machine, rng: np.random.Generator, case: TileCase,
                         kind: str, d: int) -> bool:
    """dots (FloatDot, or Bf16Dot for bf16 queries) and accumulate_values over the case."""
    q = rng.standard_normal((case.group, case.head_dim)).astype(np.float32)
    if kind == "bf16q":
        q_bits = bf16_bits(q)
        q, q_bytes = widen(q_bits), q_bits.tobytes()
    else:
        q_bytes = q.tobytes()
    scores = np.full((case.group, case.stride), SENTINEL)
    sizes = [len(q_bytes), case.block_bytes.nbytes, 8 * case.count, scores.nbytes]
    addresses = Machine.addresses(sizes)
    args = [addresses[0], case.group, case.head_dim, addresses[2], case.off, case.count,
            addresses[3], case.stride]
    name = "bf16" if kind == "bf16q" else case.dtype
    out = machine.call(f"dots_{kind if kind == 'bf16q' else name}_{d}", args,
                       [q_bytes, case.block_bytes.tobytes(), case.pointers(addresses[1]),
                        scores.tobytes()])[3]
    got = np.frombuffer(out, np.float32).reshape(case.group, case.stride)
    q64 = q.astype(np.float64)
    ok = within_rounding(got[:, :case.count], q64 @ case.keys.T, np.abs(q64) @ np.abs(case.keys).T,
                         case.head_dim) and bool(np.all(got[:, case.count:] == SENTINEL))
    if kind == "bf16q":
        return ok
    acc = rng.standard_normal((case.group, case.head_dim)).astype(np.float32)
    probs = rng.random((case.group, case.stride)).astype(np.float32)
    out = machine.call(f"acc_{name}_{d}", args,
                       [acc.tobytes(), case.block_bytes.tobytes(), case.pointers(addresses[1]),
                        probs.tobytes()])[0]
    got_acc = np.frombuffer(out, np.float32).reshape(case.group, case.head_dim)
    p = probs[:, :case.count].astype(np.float64)
    return ok and within_rounding(got_acc, acc + p @ case.keys,
                                  np.abs(acc) + p @ np.abs(case.keys), case.count)


def tile_packed(machine: Machine, rng: np.random.Generator, case: TileCase, kind: str,
                d: int) -> bool:
    """attention_gemm.h's prefill tile: keys packed in pairs, scores by vdpbf16ps for a block
    of rows (the padding keys' scores, zeros, included); values packed in pairs of keys, the
    probabilities rounded to bf16 (to nearest even), and vdpbf16ps by blocks of rows up to
    each row's visible keys: the float32 sums of those bf16 products."""
    rows = case.group * 4  # a tile of queries times the group
    q_bits = bf16_bits(rng.standard_normal((rows, d)))
    chunks = -(-case.count // 16)
    packed_stride = 16 * chunks + 16
    stride = 16 * chunks + 3
    packed = np.zeros((d // 2, packed_stride), np.uint32)
    scores = np.full((rows, stride), SENTINEL)
    addresses = Machine.addresses([q_bits.nbytes, case.block_bytes.nbytes, 8 * case.count,
                                   packed.nbytes, scores.nbytes])
    out = machine.call(f"packed_scores_{d}",
                       [addresses[0], rows, addresses[2], case.off, case.count, addresses[3],
                        packed_stride, addresses[4], stride],
                       [q_bits.tobytes(), case.block_bytes.tobytes(),
                        case.pointers(addresses[1]), packed.tobytes(), scores.tobytes()])[4]
    got = np.frombuffer(out, np.float32).reshape(rows, stride)
    q = widen(q_bits).astype(np.float64)
    ok = within_rounding(got[:, :case.count], q @ case.keys.T, np.abs(q) @ np.abs(case.keys).T,
                         d)
    ok &= bool(np.all(got[:, case.count:16 * chunks] == 0.0))
    ok &= bool(np.all(got[:, 16 * chunks:] == SENTINEL))
    acc = rng.standard_normal((rows, d)).astype(np.float32)
    visible = rng.integers(1, case.count + 1, rows).astype(np.int32)
    probs = rng.random((rows, stride)).astype(np.float32)
    for r in range(rows):
        probs[r, visible[r]:] = 0.0  # past a row's visible keys its probabilities are zero
    packed_values = np.zeros((-(-case.count // 2), d), np.uint32)
    pairs = np.zeros((rows, stride // 2), np.uint32)
    addresses = Machine.addresses([acc.nbytes, case.block_bytes.nbytes, 8 * case.count,
                                   packed_values.nbytes, visible.nbytes, probs.nbytes,
                                   pairs.nbytes])
    out = machine.call(f"pair_acc_{d}",
                       [addresses[0], rows, addresses[2], case.off, case.count, addresses[3],
                        addresses[4], addresses[5], stride, addresses[6]],
                       [acc.tobytes(), case.block_bytes.tobytes(), case.pointers(addresses[1]),
                        packed_values.tobytes(), visible.tobytes(), probs.tobytes(),
                        pairs.tobytes()])[0]
    got_acc = np.frombuffer(out, np.float32).reshape(rows, d)
    p = widen(rounded_bf16_bits(probs[:, :case.count])).astype(np.float64)
    return ok and within_rounding(got_acc, acc + p @ case.keys,
                                  np.abs(acc) + p @ np.abs(case.keys), case.count)


def invariant_rows(machine: Machine, dtype: str, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The emulated invariant_linear of rows x against w: [len(x), len(w)] float32."""
    out = np.zeros((len(x), len(w)), np.float32)
    addresses = Machine.addresses([x.nbytes, w.nbytes, out.nbytes])
    result = machine.call(f"invariant_{dtype}",
                          [addresses[0], addresses[1], len(x), len(w), x.shape[1], addresses[2]],
                          [np.ascontiguousarray(x).tobytes(), w.tobytes(), out.tobytes()])[2]
    return np.frombuffer(result, np.float32).reshape(len(x), len(w))


def check_invariant(machine: Machine, bf16: bool, scratch: Path, cases: int,
                    includes: list[str]) -> tuple[int, int]:
    """invariant_blocks.h (F32Step; Bf16Step, vdpbf16ps, where patched): within float32
    rounding of float64 sums, each row bit-identical alone and in the batch
    (--batch-invariant's promise)."""
    rng = np.random.default_rng(2)
    dtypes = ["f32"] + (["bf16"] if bf16 else [])
    passed = total = 0
    for index in range(max(cases // 3, 2 * len(dtypes))):
        dtype = dtypes[index % len(dtypes)]
        rows, n = int(rng.integers(1, 11)), int(rng.integers(1, 23))
        k = int(rng.choice([16, 32, 40, 64, 70, 96]))
        x = rng.standard_normal((rows, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        if dtype == "bf16":
            x_bytes, w_bytes = bf16_bits(x), bf16_bits(w)
            x, w = widen(x_bytes), widen(w_bytes)
        else:
            x_bytes, w_bytes = x, w

        batch = invariant_rows(machine, dtype, x_bytes, w_bytes)
        alone = np.concatenate([invariant_rows(machine, dtype, x_bytes[r:r + 1], w_bytes)
                                for r in range(rows)])
        x64, w64 = x.astype(np.float64), w.astype(np.float64)
        ok = within_rounding(batch, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, k)
        ok &= bool(np.array_equal(alone, batch))
        passed += ok
        total += 1
        print(f"invariant {dtype:4s} rows={rows:2d} n={n:2d} k={k:3d}: "
              f"{'within float32 rounding, rows alone = batch' if ok else 'MISMATCH'}")
    return passed, total


def check_softmax(machine: Machine, bf16: bool, scratch: Path, cases: int,
                  includes: list[str]) -> tuple[int, int]:
    """attention_softmax.h's online-softmax step against numpy (softmax_case)."""
    rng = np.random.default_rng(3)
    results = [softmax_case(machine, rng, stride=(16, 48, 20, 64)[index % 4])
               for index in range(max(cases // 3, 4))]
    return sum(results), len(results)


def softmax_case(machine: Machine, rng: np.random.Generator, stride: int) -> bool:
    """softmax_step<64> on up to 6 rows of scores, a running max and sum already under way
    (or not: -inf), and a row that sees none of the tile's keys; stride a multiple of 16
    takes the AVX-512 exponentials, another the loop."""
    rows, dim = int(rng.integers(1, 7)), 64
    scores = (rng.standard_normal((rows, stride)) * 4).astype(np.float32)
    visible = rng.integers(1, stride + 1, rows).astype(np.int32)
    visible[rng.integers(0, rows)] = 0 if rows > 1 else visible[0]
    m = np.where(rng.random(rows) < 0.5, -np.inf, rng.standard_normal(rows) * 4)
    m = m.astype(np.float32)
    l_sum = (rng.random(rows) * 3).astype(np.float32)
    acc = rng.standard_normal((rows, dim)).astype(np.float32)
    buffers = [scores, visible, m, l_sum, acc]
    addresses = Machine.addresses([b.nbytes for b in buffers])
    out = machine.call("softmax_step_64",
                       [addresses[0], rows, stride, addresses[1], addresses[2], addresses[3],
                        addresses[4]], [b.tobytes() for b in buffers])
    got = [np.frombuffer(o, b.dtype).reshape(b.shape) for o, b in zip(out, buffers, strict=True)]
    ok = True
    for r in range(rows):
        n = int(visible[r])
        if n == 0:  # sees nothing: its probabilities are zero, its state unchanged
            ok &= bool(np.all(got[0][r] == 0) and got[2][r] == m[r] and got[3][r] == l_sum[r]
                       and np.array_equal(got[4][r], acc[r]))
            continue
        m_new = max(float(m[r]), float(scores[r, :n].max()))
        alpha = np.exp(np.float64(m[r]) - m_new)
        p = np.exp((scores[r, :n] - np.float32(m_new)).astype(np.float64))  # float32 difference
        ok &= bool(np.allclose(got[0][r, :n], p, rtol=1e-6, atol=1e-30))
        ok &= bool(np.all(got[0][r, n:] == 0)) and got[2][r] == np.float32(m_new)
        ok &= bool(np.isclose(got[3][r], l_sum[r] * alpha + p.sum(), rtol=1e-5))
        ok &= bool(np.allclose(got[4][r], acc[r] * alpha, rtol=1e-6, atol=1e-30))
    print(f"softmax stride={stride:2d} rows={rows} visible={visible.tolist()}: "
          f"{'within float32 rounding' if ok else 'MISMATCH'}")
    return ok


# --- int8 --------------------------------------------------------------------------------------

def check_int8(machine: Machine, sapphire_rapids: bool, scratch: Path, cases: int,
               includes: list[str]) -> tuple[int, int]:
    """int8_blocks.h: the VNNI path (where the CPU is the Sapphire Rapids) bit-identical to
    the AVX2 path, both within float32 rounding of a float64 reference, nothing written past
    a panel's columns."""
    import torch

    from kvserve.model.quantization import (
        int8_linear_reference,
        pack_int8,
        quantize_groups,
        quantize_int8,
    )

    rng = np.random.default_rng(4)
    shapes = [(1, 16, 64), (12, 16, 64), (13, 17, 65), (5, 40, 130), (24, 33, 199), (7, 5, 7)]
    shapes += [(int(rng.integers(1, 30)), int(rng.integers(1, 50)), int(rng.integers(1, 300)))
               for _ in range(max(0, cases // 3 - len(shapes)))]
    entries = ["int8_rows_avx2"] + (["int8_rows_vnni"] if sapphire_rapids else [])
    passed = total = 0
    for rows, n, k in shapes:
        x = (rng.standard_normal((rows, k)) * rng.random((rows, 1)) * 8).astype(np.float32)
        if rows > 2:
            x[1] = 0
        weight = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
        # pairs, whatever this machine's default layout (quads where the CPU has AMX)
        panels, scales = (t.numpy() for t in pack_int8(weight, "pairs"))
        # the engine's own quantization and float64 reference (kvserve.model.quantization)
        q_weight, w_scale = quantize_int8(weight)
        expected = int8_linear_reference(torch.from_numpy(x), q_weight, w_scale).numpy()
        # the sum of the terms' magnitudes, bounded with each row's largest group scale
        qx, x_scales = (t.double().numpy() for t in quantize_groups(torch.from_numpy(x)))
        magnitude = (np.abs(qx) @ np.abs(q_weight.double().numpy()).T) * \
            x_scales.max(1)[:, None] * w_scale.double().numpy()[None, :]
        ldo = n + 16
        outputs = {}
        for entry in entries:
            buffers = [x.tobytes(), panels.tobytes(), scales.tobytes(),
                       np.full((rows, ldo), SENTINEL).tobytes(),
                       bytes(2 * rows * 2 * (-(-k // 2))), bytes(4 * rows * -(-k // 64))]
            addresses = Machine.addresses([len(b) for b in buffers])
            result = machine.call(entry, [addresses[0], rows, k, addresses[1], addresses[2],
                                          addresses[3], n, ldo, addresses[4], addresses[5]],
                                  buffers)[3]
            outputs[entry] = np.frombuffer(result, np.float32).reshape(rows, ldo)
        avx2 = outputs["int8_rows_avx2"]
        ok = bool(np.all(avx2[:, n:] == SENTINEL))
        ok &= bool(np.all(np.abs(avx2[:, :n] - expected) <= 4 * 2.0**-24 * magnitude + 1e-30))
        same = all(np.array_equal(out, avx2) for out in outputs.values())
        ok &= same
        passed += ok
        total += 1
        paths = " = ".join(e.removeprefix("int8_rows_") for e in entries)
        print(f"int8 {paths} rows={rows:2d} n={n:2d} k={k:3d}: "
              f"{'bit-identical, within float32 rounding' if ok else 'MISMATCH'}")
    return passed, total


# --- amx ---------------------------------------------------------------------------------------

def tile_config(shapes: dict[int, tuple[int, int]]) -> bytes:
    """LDTILECFG's 64 bytes, palette 1: tile -> (rows, bytes per row)."""
    config = bytearray(64)
    config[0] = 1
    for tile, (rows, colsb) in shapes.items():
        config[16 + 2 * tile:18 + 2 * tile] = colsb.to_bytes(2, "little")
        config[48 + tile] = rows
    return bytes(config)


def dpbssd_reference(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """TDPBSSD as the ISA defines it: c[m][n] += sum over dwords j of a's row m and bytes i of
    a[m][4 j + i] * b[j][4 n + i], signed (int8 a [M, 4 K], b [K, 4 N], int32 c [M, N])."""
    k4 = a.shape[1]
    as_k = b.reshape(k4 // 4, -1, 4).transpose(0, 2, 1).reshape(k4, -1)  # [4 K, N]
    return c + a.astype(np.int64) @ as_k.astype(np.int64)


def check_amx(machine: Machine, sapphire_rapids: bool, scratch: Path, cases: int,
              includes: list[str]) -> tuple[int, int]:
    """int8_blocks.h's AMX-INT8 path (amx_tiles.h's software model of the tile instructions,
    with the Sapphire Rapids' AVX-512 for the rest): the model's TDPBSSD against the ISA's
    definition in numpy, its refusal of an invalid configuration, and the path bit-identical
    to the AVX2 path over quad panels (quantization.pack_int8 layout="quads")."""
    if not sapphire_rapids:
        print("amx: skipped (the AMX path's AVX-512 needs the Sapphire Rapids model)")
        return 0, 0
    import torch

    from kvserve.model.quantization import pack_int8

    rng = np.random.default_rng(5)
    passed = total = 0
    for rows, quads, n in [(16, 16, 16), (1, 1, 1), (5, 3, 7), (16, 7, 9), (11, 16, 2)]:
        a = rng.integers(-128, 128, (rows, 4 * quads), dtype=np.int8)
        b = rng.integers(-128, 128, (quads, 4 * n), dtype=np.int8)
        c = rng.integers(-2**20, 2**20, (rows, n), dtype=np.int32)
        config = tile_config({0: (rows, 4 * n), 1: (rows, 4 * quads), 2: (quads, 4 * n)})
        buffers = [config, a.tobytes(), b.tobytes(), c.tobytes()]
        addresses = Machine.addresses([len(x) for x in buffers])
        got = machine.call("amx_dpbssd", [addresses[0], addresses[1], 4 * quads, addresses[2],
                                          4 * n, addresses[3], 4 * n], buffers)[3]
        ok = np.array_equal(np.frombuffer(got, np.int32).reshape(rows, n),
                            dpbssd_reference(a, b, c))
        passed += ok
        total += 1
        print(f"amx tdpbssd model rows={rows:2d} k={4 * quads:2d} n={n:2d}: "
              f"{'as the ISA defines' if ok else 'MISMATCH'}")
    # a configuration the CPU refuses (a's bytes per row not 4 x b's rows) must fault
    config = tile_config({0: (4, 16), 1: (4, 32), 2: (4, 16)})
    buffers = [config, bytes(256), bytes(256), bytes(256)]
    addresses = Machine.addresses([len(x) for x in buffers])
    try:
        machine.call("amx_dpbssd", [addresses[0], addresses[1], 64, addresses[2], 64,
                                    addresses[3], 64], buffers)
        refused = False
    except RuntimeError as error:  # ud2: the model's #UD, as the CPU's
        refused = "exception 6 " in str(error)
    passed += refused
    total += 1
    print(f"amx tdpbssd model, mismatched shapes: {'faults' if refused else 'RAN (wrong)'}")

    shapes = [(1, 16, 64), (16, 16, 64), (17, 17, 65), (5, 40, 130), (33, 33, 199), (7, 5, 7)]
    shapes += [(int(rng.integers(1, 40)), int(rng.integers(1, 50)), int(rng.integers(1, 300)))
               for _ in range(max(0, cases // 3 - len(shapes)))]
    for rows, n, k in shapes:
        x = (rng.standard_normal((rows, k)) * rng.random((rows, 1)) * 8).astype(np.float32)
        if rows > 2:
            x[1] = 0
        weight = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
        ldo, groups, padded = n + 16, -(-k // 64), -(-rows // 16) * 16
        outputs = []
        for entry, layout in (("int8_rows_avx2", "pairs"), ("amx_rows", "quads")):
            panels, scales = (t.numpy() for t in pack_int8(weight, layout))
            buffers = [x.tobytes(), panels.tobytes(), scales.tobytes(),
                       np.full((rows, ldo), SENTINEL).tobytes(), bytes(2 * rows * (k + 1)),
                       bytes(padded * groups * 64), bytes(4 * padded * groups)]
            addresses = Machine.addresses([len(b) for b in buffers])
            # int8_rows_avx2 takes the int16 rows and scales; amx_rows the int8 rows and scales
            rows_and_scales = addresses[5:7] if entry == "amx_rows" else addresses[4:7:2]
            args = [addresses[0], rows, k, addresses[1], addresses[2], addresses[3], n, ldo,
                    *rows_and_scales]
            result = machine.call(entry, args, buffers)[3]
            outputs.append(np.frombuffer(result, np.float32).reshape(rows, ldo))
        avx2, amx = outputs
        ok = bool(np.all(amx[:, n:] == SENTINEL)) and np.array_equal(amx, avx2)
        passed += ok
        total += 1
        print(f"amx = avx2 rows={rows:2d} n={n:2d} k={k:3d}: "
              f"{'bit-identical' if ok else 'MISMATCH'}")
    return passed, total


Check = Callable[[Machine, bool, Path, int, list[str]], tuple[int, int]]
# name: (the entry source, extra compiler flags, whether it needs torch's headers, the check)
CHECKS: dict[str, tuple[str, list[str], bool, Check]] = {
    "panels": (PANEL_ENTRY, [], True, check_panels),
    "tiles": (TILE_ENTRY, [], True, check_tiles),
    "invariant": (INVARIANT_ENTRY, [], True, check_invariant),
    "softmax": (SOFTMAX_ENTRY, [], True, check_softmax),
    "int8": (INT8_ENTRY, [], True, check_int8),
    "amx": (AMX_ENTRY, ["-DKVSERVE_AMX_MODEL"], True, check_amx),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=tuple(CHECKS))
    parser.add_argument("--cases", type=int, default=60, help="cases per check")
    args = parser.parse_args()
    bochscpu, bf16 = import_bochscpu()
    includes = torch_includes()
    failed = False
    with tempfile.TemporaryDirectory() as scratch, \
            ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        builds = {}  # compiled side by side: most of the run is g++ on torch's headers
        for name, (source, flags, needs_torch, _) in CHECKS.items():
            if args.only not in (None, name):
                continue
            if needs_torch and includes is None:
                print(f"{name}: skipped (torch is needed: run it with the project's "
                      "virtualenv)")
                continue
            workdir = Path(scratch) / name
            workdir.mkdir()
            builds[name] = (workdir, pool.submit(build_flat, workdir, source,
                                                 [*isa(bf16), *flags], includes or []))
        for name, (workdir, build) in builds.items():
            machine = Machine(bochscpu, *build.result())
            passed, total = CHECKS[name][3](machine, bf16, workdir, args.cases, includes or [])
            print(f"{name}: {passed} of {total} cases match")
            failed |= passed != total
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
