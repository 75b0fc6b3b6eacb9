// A software prefetch into L2, for the kernels whose speed rests on fetching ahead: the decode
// attention's next keys (attention_tile.h's Ahead) and the bf16 panels' next group
// (panel_dpbf16.h, and panel_amx.h's tiles over the same panels). Freestanding, so
// tools/avx512_check.py can build it into its flat binary.
#pragma once

namespace kvserve {

// prefetcht1: into L1 (t0) it was 0.76x as fast for decode, as it pushes out the tile being
// computed. An asm statement with the address in a register: GCC took a small function whose
// only effect was __builtin_prefetch for one with no effect and dropped the calls (an earlier
// form of this compiled to no prefetches at all), and a memory operand made it store the
// register accumulators around every prefetch. tests/model/test_paged_kernel.py checks that
// the built kernels hold the instruction.
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 (%0)" : : "r"(p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

}  // namespace kvserve
