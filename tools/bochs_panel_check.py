#!/usr/bin/env python
"""Run csrc/panel_dpbf16.h's loops under an x86 emulator, on a CPU without AVX-512.

The AVX512-BF16 panel GEMM (panel_linear_bf16) can only be run and tested where the CPU has
AVX512-BF16 (tests/model/test_layers.py does, there). On any other x86 machine this script
checks what can be checked: it compiles the header's loops (``panel_rows``) with the
``WidenDot`` stand-in for vdpbf16ps (AVX-512F FMAs on the widened halves; the emulator has
AVX-512F but not AVX512-BF16) into a flat binary, runs it under BochsCPU
(``pip install bochscpu-python``) over many shapes, and compares each output with float64 sums
over the same bf16 values. So the layout, the register blocks, the row remainders and the
masked stores of partial panels are checked; the one intrinsic it does not run is
``_mm512_dpbf16_ps`` itself.

    python tools/bochs_panel_check.py [--cases 40]

Prints one line per case and exits 1 on any mismatch. The bochscpu-python 0.4.0 wheel needs
glibc 2.38's ``__isoc23_*`` symbols; on an older glibc the script builds a two-function shim
and re-runs itself with it preloaded. Not part of the test suite (it needs that wheel and
takes a minute).
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HEADER_DIR = Path(__file__).resolve().parent.parent / "src" / "kvserve" / "model" / "csrc"
ENTRY = """
#include "panel_dpbf16.h"
extern "C" void entry(const uint16_t* x, int64_t rows, const uint16_t* panel, int64_t k_pairs,
                      float* out, int64_t ldo, int ncols) {
  kvserve::dpbf16::panel_rows<kvserve::dpbf16::WidenDot>(x, rows, panel, k_pairs, out, ldo,
                                                          ncols);
}
"""
LINKER_SCRIPT = """SECTIONS { . = 0x400000; .text : { *(.text*) *(.rodata*) *(.data*) *(.bss*) }
/DISCARD/ : { *(.eh_frame*) *(.comment) *(.note*) } }"""
SHIM = """#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
unsigned long long __isoc23_strtoull(const char* s, char** e, int b) { return strtoull(s, e, b); }
int __isoc23_sscanf(const char* s, const char* f, ...) {
  va_list a; va_start(a, f); int r = vsscanf(s, f, a); va_end(a); return r; }
"""

CODE_VA, RETURN_VA, STACK_VA, DATA_VA, PML4 = 0x400000, 0x300000, 0x200000, 0x10000000, 0x100000


def import_bochscpu():
    try:
        import bochscpu
        import bochscpu.cpu
        import bochscpu.memory
    except ImportError as error:
        if "__isoc23" not in str(error) or os.environ.get("KVSERVE_BOCHS_SHIM"):
            raise SystemExit(f"bochs_panel_check: bochscpu-python does not load: {error}") \
                from error
        shim = Path(tempfile.mkdtemp()) / "isoc23_shim.so"
        source = shim.with_suffix(".c")
        source.write_text(SHIM)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", str(source), "-o", str(shim)],
                       check=True)
        env = dict(os.environ, LD_PRELOAD=str(shim), KVSERVE_BOCHS_SHIM="1")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    import bochscpu
    return bochscpu


def build(workdir: Path) -> bytes:
    """The entry point and the header's loops as a flat binary loaded at CODE_VA."""
    (workdir / "entry.cpp").write_text(ENTRY)
    (workdir / "flat.ld").write_text(LINKER_SCRIPT)
    subprocess.run(["g++", "-O3", "-mavx512f", "-std=c++17", "-ffreestanding", "-fno-pic",
                    "-fno-pie", "-fno-exceptions", "-fno-asynchronous-unwind-tables",
                    "-fno-stack-protector", f"-I{HEADER_DIR}", "-c", "entry.cpp", "-o",
                    "entry.o"], cwd=workdir, check=True)
    subprocess.run(["ld", "-T", "flat.ld", "-e", "entry", "--oformat", "binary", "-o",
                    "entry.bin", "entry.o"], cwd=workdir, check=True)
    return (workdir / "entry.bin").read_bytes()


class Machine:
    """One emulated long-mode CPU with identity-mapped pages, calling one flat function."""

    def __init__(self, bochscpu, code: bytes) -> None:
        self.bx = bochscpu
        self.page = bochscpu.memory.page_size()
        self.code = code

    def call(self, buffers: list[bytes], args: list[int | tuple[str, int]],
             read: tuple[int, int]) -> bytes:
        """Run the function with ``args`` (("buf", i) is the address of buffers[i]) in the
        SysV registers; return ``read`` = (buffer index, bytes) afterwards."""
        bx, page = self.bx, self.page
        session = bx.Session()

        def missing(gpa: int) -> None:
            raise RuntimeError(f"page fault at {gpa:#x}")

        session.missing_page_handler = missing
        table = bx.memory.PageMapLevel4Table()
        hosts = []

        def map_range(va: int, size: int) -> None:
            for p in range(va - va % page, va + max(size, 1), page):
                host = bx.memory.allocate_host_page()
                hosts.append(host)
                bx.memory.page_insert(p, host)
                table.insert(p, p, 1)

        map_range(CODE_VA, len(self.code))
        map_range(RETURN_VA, page)
        map_range(STACK_VA, 4 * page)
        addresses, next_va = [], DATA_VA
        for data in buffers:
            addresses.append(next_va)
            map_range(next_va, len(data))
            next_va += (len(data) // page + 2) * page
        for host, gpa in table.commit(PML4):
            bx.memory.page_insert(gpa, host)

        def write(va: int, data: bytes) -> None:
            if data and not bx.memory.virt_write(PML4, va, list(data)):
                raise RuntimeError(f"cannot write at {va:#x}")

        write(CODE_VA, self.code)
        write(RETURN_VA, b"\xf4" * 16)  # hlt: a #GP at CPL 3, which ends the run
        for address, data in zip(addresses, buffers, strict=True):
            write(address, data)
        values = [addresses[arg[1]] if isinstance(arg, tuple) else arg for arg in args]
        rsp = STACK_VA + 3 * page  # the return address, then arguments 7 onwards
        write(rsp, struct.pack(f"<{1 + len(values[6:])}Q", RETURN_VA,
                               *(value & 0xFFFFFFFFFFFFFFFF for value in values[6:])))

        state = bx.State()
        bx.cpu.set_long_mode(state)
        state.cr0 = state.cr0 | 0x2                                  # MP
        state.cr4 = state.cr4 | (1 << 9) | (1 << 10) | (1 << 18)     # OSFXSR, OSXMMEXCPT, OSXSAVE
        state.xcr0 = 0xE7                                            # x87 SSE AVX opmask ZMM
        state.mxcsr = 0x1F80                                         # exceptions masked
        state.cr3, state.rsp, state.rip = PML4, rsp, CODE_VA
        code_segment, data_segment = bx.Segment(), bx.Segment()
        for segment, selector, attr in ((code_segment, 0x33, 0x22FB),
                                        (data_segment, 0x2B, 0xCF3)):
            segment.present, segment.selector, segment.base = True, selector, 0
            segment.limit, segment.attr = 0xFFFFFFFF, attr
        state.cs = code_segment
        state.ds = state.ss = state.es = state.fs = state.gs = data_segment
        registers = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
        for register, value in zip(registers, values[:6], strict=False):
            setattr(state, register, value & 0xFFFFFFFFFFFFFFFF)
        session.cpu.state = state
        stopped: list[tuple[int, int]] = []

        def exception(sess, cpu_id: int, vector: int, error: int) -> None:
            stopped.append((vector, sess.cpu.rip))
            sess.stop()

        hook = bx.Hook()
        hook.exception = exception
        session.run([hook])
        vector, rip = stopped[0]
        if not RETURN_VA <= rip < RETURN_VA + 16:
            raise RuntimeError(f"exception {vector} at rip {rip:#x} (not a return)")
        index, size = read
        out = bytes(bx.memory.virt_read(PML4, addresses[index], size))
        for host in hosts:
            bx.memory.release_host_page(host)
        return out


def pack_pair_panels(weight: np.ndarray) -> np.ndarray:
    """As llama.pack_pair_panels: bf16 bits [n, k] -> [ceil(n / 16), k / 2, 16, 2]."""
    n, k = weight.shape
    padded = np.zeros((-(-n // 16) * 16, k), np.uint16)
    padded[:n] = weight
    return np.ascontiguousarray(padded.reshape(-1, 16, k // 2, 2).transpose(0, 2, 1, 3))


def bf16_bits(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=40)
    args = parser.parse_args()
    bochscpu = import_bochscpu()
    with tempfile.TemporaryDirectory() as scratch:
        machine = Machine(bochscpu, build(Path(scratch)))
    rng = np.random.default_rng(0)
    shapes = [(rows, n, pairs) for rows in (1, 5, 12, 13, 24, 25) for n, pairs in
              ((16, 4), (5, 8), (21, 3), (40, 36))]
    shapes += [(int(rng.integers(1, 40)), int(rng.integers(1, 50)), int(rng.integers(1, 40)))
               for _ in range(max(0, args.cases - len(shapes)))]
    failures = 0
    for rows, n, pairs in shapes[:max(args.cases, 1)]:
        k = 2 * pairs
        x = bf16_bits(rng.standard_normal((rows, k)))
        weight = bf16_bits(rng.standard_normal((n, k)))
        panels = pack_pair_panels(weight)
        expected = widen_dot_chain(widen(x), widen(weight))
        got = np.zeros((rows, n), np.float32)
        for p in range(panels.shape[0]):
            ncols = min(16, n - 16 * p)
            # out points at column 16p of row 0; ldo = n, as panel_linear_bf16 calls it.
            sentinel = np.full((rows, n + 16), np.float32(12345.0))
            out = machine.call(
                [x.tobytes(), panels[p].tobytes(), sentinel.tobytes()],
                [("buf", 0), rows, ("buf", 1), pairs, ("buf", 2), n + 16, ncols],
                (2, sentinel.nbytes))
            result = np.frombuffer(out, np.float32).reshape(rows, n + 16)
            if not np.all(result[:, ncols:] == np.float32(12345.0)):
                raise SystemExit(f"rows={rows} n={n} k={k} panel {p}: wrote past its columns")
            got[:, 16 * p:16 * p + ncols] = result[:, :ncols]
        ok = bool(np.array_equal(got, expected))
        failures += not ok
        print(f"rows={rows:3d} n={n:3d} k={k:3d}: "
              f"{'bit-identical' if ok else 'MISMATCH'}")
    print(f"{len(shapes[:max(args.cases, 1)]) - failures} of "
          f"{len(shapes[:max(args.cases, 1)])} cases match")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
