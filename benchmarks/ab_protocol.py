"""The A/B protocol of issue 16 shared by offline_ab.py and online_ab.py.

Two engines run alternately on one machine, in pairs (the peer first in each pair). A noisy,
shared machine makes any single run meaningless, so each figure is reported as:

- each side's best (the minimum of a time, the maximum of a rate) and its median;
- the ratio of bests ("fastest against fastest");
- the median of the pair ratios (each pair ran under the same conditions).

Ratios are always "kvserve's speed over the peer's": above 1.0 kvserve is faster (for a time
or a latency, peer / kvserve; for a rate, kvserve / peer).

Every run records how loaded the machine was: the 1-minute load average before it and the
steal time during it (from /proc/stat; the share of CPU time the hypervisor gave to others).
Tables name the CPU they ran on (model and vector ISA flags): a table is true of that CPU
only. The roofline fraction is the workload's matmul work at this machine's measured bf16
peak (benchmarks/machine_peaks.py), over the run's wall time.
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.cpu_name import CpuFields, read_cpuinfo, with_generation

# SmolLM2-135M: 30 layers of Q/K/V/O (576x576, 2 x 576x192, 576x576) and SwiGLU (3 x 576x1536),
# 106.2 M multiply-adds per token, 2 FLOPs each; the 49,152 x 576 LM head's 28.3 M only for
# a token sampled (a prompt's last position, or a decode step), as both engines compute it.
LAYER_FLOPS_PER_TOKEN = 2 * 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
LM_HEAD_FLOPS_PER_TOKEN = 2 * 49152 * 576
MATMUL_FLOPS_PER_TOKEN = LAYER_FLOPS_PER_TOKEN + LM_HEAD_FLOPS_PER_TOKEN
ISA_PREFIXES = ("avx", "amx", "fma")


def shared_bench() -> Path:
    """../shared/bench beside the checkout (the main checkout's sibling, or a worktree's
    under /work/wt), or $KVSERVE_SHARED_BENCH."""
    if "KVSERVE_SHARED_BENCH" in os.environ:
        return Path(os.environ["KVSERVE_SHARED_BENCH"])
    root = Path(__file__).resolve().parents[1]
    for parent in root.parents:
        if (parent / "shared" / "bench").is_dir():
            return parent / "shared" / "bench"
    return root.parent / "shared" / "bench"


def cpu() -> tuple[str, str]:
    """The CPU's model name and its vector ISA flags (avx*, amx*, fma), from /proc/cpuinfo; a
    bare AMD name ("AMD EPYC") gets its generation from the CPU family (kvserve.cpu_name)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            found = read_cpuinfo(cpuinfo.read())
    except OSError:
        found = CpuFields()
    flags = " ".join(f for f in found.flags if f.startswith(ISA_PREFIXES))
    return with_generation(found.model or "unknown CPU", found.family, flags,
                           found.model_number), flags


# The vector tiers a kernel dispatches on, best first: (flag that marks it, slug, label).
# Cloud CPUs often report a bare model name ("AMD EPYC" for a Zen 3 with AVX2 only, a Zen 4 and
# a Zen 5 with AVX512-BF16), so a table is keyed by the name (with its generation, cpu()) and
# the tier.
ISA_TIERS = (("amx_bf16", "amx", "AMX"), ("avx512_bf16", "avx512-bf16", "AVX512-BF16"),
             ("avx512f", "avx512", "AVX-512"), ("avx2", "avx2", "AVX2"))


def isa_tier(flags: str) -> tuple[str, str]:
    """(slug, label) of the best vector tier in ``flags``; ("", "") below AVX2."""
    present = set(flags.split())
    return next(((slug, label) for flag, slug, label in ISA_TIERS if flag in present),
                ("", ""))


def cpu_slug(model: str, flags: str = "") -> str:
    """A marker-safe name for a CPU: "AMD EPYC 9R14" -> "amd-epyc-9r14", and with its flags
    "AMD EPYC", "avx avx2 fma" -> "amd-epyc-avx2"."""
    base = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "unknown-cpu"
    tier = isa_tier(flags)[0]
    return f"{base}-{tier}" if tier else base


def cpu_title(model: str, flags: str) -> str:
    """"AMD EPYC (AVX2)": the model name and its best vector tier, for a table's heading."""
    label = isa_tier(flags)[1]
    return f"{model} ({label})" if label else model


def kernel_env() -> str:
    """The kernel-choosing environment a run inherits, as a command's prefix
    ("KVSERVE_PROJECTIONS=panels " or ""), so a recorded command says what ran."""
    value = os.environ.get("KVSERVE_PROJECTIONS", "").strip()
    return f"KVSERVE_PROJECTIONS={value} " if value else ""


def fast_dtype(flags: str) -> str:
    """The dtype both engines run in for ``--dtype auto``: bfloat16 where the CPU computes it
    natively (AMX or AVX512-BF16), float32 elsewhere (on AVX2 alone torch emulates bf16)."""
    from kvserve.model.dtype import native_bf16  # the engine's own rule for --dtype auto

    return "bfloat16" if native_bf16(frozenset(flags.split())) else "float32"


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot, from /proc/stat's "cpu" line."""
    try:
        with open("/proc/stat", encoding="utf-8") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    # user nice system idle iowait irq softirq steal guest guest_nice; guests are in user
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


@dataclass
class Conditions:
    """How loaded the machine was around one run: the load average before it, the steal time
    during it and a bf16 matmul's rate just before it (:func:`matmul_probe`; None: not
    measured)."""

    load_before: float
    steal_pct: float = 0.0
    bf16_gflops: float | None = None

    def __str__(self) -> str:
        text = f"{self.load_before:.1f} / {self.steal_pct:.1f}%"
        return text if self.bf16_gflops is None else f"{text} / {self.bf16_gflops:,.0f}"


# The probe before each run: 1024^3 bf16 products for about PROBE_BUDGET_S. On the AMX Xeon
# one hour's matmuls ran at half the speed of the hours before while the load average and the
# steal time looked as usual (docs/benchmarks.md, the seventh session there): the rate of the
# matrix units, shared with whatever else runs on the host, is a condition of its own.
PROBE_SIZE = 1024
PROBE_BUDGET_S = 0.1


def matmul_probe() -> float | None:
    """bf16 GFLOP/s of a PROBE_SIZE matmul now (machine_peaks' measurement, cut to
    PROBE_BUDGET_S), or None where torch is not importable."""
    try:
        import torch

        from machine_peaks import matmul_flops
    except ImportError:
        return None
    return matmul_flops(torch.bfloat16, (PROBE_SIZE,), budget_s=PROBE_BUDGET_S) / 1e9


def measured(run: Callable[[], dict],
             probe: Callable[[], float | None] = matmul_probe) -> tuple[dict, Conditions]:
    """Run ``run()`` and record the matmul probe and the load before it and the steal time
    during it."""
    gflops = probe()
    load = os.getloadavg()[0]
    steal0, total0 = cpu_times()
    result = run()
    steal1, total1 = cpu_times()
    steal = 100.0 * (steal1 - steal0) / (total1 - total0) if total1 > total0 else 0.0
    return result, Conditions(load, steal, gflops)


@dataclass(frozen=True)
class Figure:
    """One figure compared across the two sides: ``key`` in each run's result."""

    key: str
    label: str
    higher_is_better: bool
    fmt: str = "{:.1f}"


@dataclass
class Summary:
    """Both sides' best and median of one figure, and the two ratios (kvserve's speed over
    the peer's: > 1 means kvserve is better)."""

    figure: Figure
    peer: list[float]
    ours: list[float]
    peer_best: float = field(init=False)
    ours_best: float = field(init=False)
    ratio_of_bests: float = field(init=False)
    median_pair_ratio: float = field(init=False)

    def __post_init__(self) -> None:
        if not self.peer or len(self.peer) != len(self.ours):
            raise ValueError(f"{self.figure.key}: need equal, non-empty lists of runs, got "
                             f"{len(self.peer)} and {len(self.ours)}")
        best = max if self.figure.higher_is_better else min
        self.peer_best, self.ours_best = best(self.peer), best(self.ours)
        self.ratio_of_bests = self.ratio(self.peer_best, self.ours_best)
        self.median_pair_ratio = statistics.median(
            self.ratio(p, o) for p, o in zip(self.peer, self.ours, strict=True))

    def ratio(self, peer: float, ours: float) -> float:
        """kvserve's speed over the peer's for one pair of values."""
        if self.figure.higher_is_better:
            return ours / peer if peer else float("inf")
        return peer / ours if ours else float("inf")

    @property
    def peer_median(self) -> float:
        return statistics.median(self.peer)

    @property
    def ours_median(self) -> float:
        return statistics.median(self.ours)


def summarize(figures: Sequence[Figure], peer_runs: Sequence[dict],
              our_runs: Sequence[dict]) -> list[Summary]:
    return [Summary(f, [r[f.key] for r in peer_runs], [r[f.key] for r in our_runs])
            for f in figures]


def summary_table(summaries: Sequence[Summary], peer: str = "vLLM") -> list[str]:
    """Markdown rows: each figure's best and median per side and the two ratios."""
    lines = [f"| figure | {peer} best | {peer} median | kvserve best | kvserve median | "
             "ratio of bests | median of pair ratios |", "|---|---|---|---|---|---|---|"]
    for s in summaries:
        f = s.figure.fmt.format
        lines.append(f"| {s.figure.label} | {f(s.peer_best)} | {f(s.peer_median)} | "
                     f"{f(s.ours_best)} | {f(s.ours_median)} | {s.ratio_of_bests:.2f}x | "
                     f"{s.median_pair_ratio:.2f}x |")
    return lines


def roofline_floor_s(prompt_tokens: int, output_tokens: int, bf16_flops: float) -> float:
    """The least time a run's tokens can take through the model's matmuls at this machine's
    bf16 peak (FLOP/s): every token through the layers, the LM head for each output token
    (until 6 December every prompt token was counted through it too: 1.17x W1's work)."""
    return ((prompt_tokens + output_tokens) * LAYER_FLOPS_PER_TOKEN
            + output_tokens * LM_HEAD_FLOPS_PER_TOKEN) / bf16_flops


def machine_line(model: str, flags: str, peaks: dict[str, float] | None) -> str:
    cores = os.cpu_count()
    text = f"**{model}** ({cores} logical CPUs; ISA: {flags or 'none of avx/amx/fma'})"
    if peaks:
        text += (f"; machine_peaks here: bf16 matmul {peaks['bf16_flops'] / 1e9:,.0f} GFLOP/s, "
                 f"fp32 {peaks['fp32_flops'] / 1e9:,.0f} GFLOP/s, copy "
                 f"{peaks['copy_bytes'] / 1e9:.1f} GB/s")
    return text


# Each peak is the best of this many measurements: one sitting's single bf16 reading on the
# AMX Xeon was 721 GFLOP/s against 2,268-2,386 in the others that day, and the run's
# roofline fractions came out 3x too high (docs/benchmarks.md)
PEAK_TRIES = 2


def measure_peaks(tries: int = PEAK_TRIES) -> dict[str, float]:
    """This machine's peaks, as benchmarks/machine_peaks.py measures them (needs torch), each
    the best of ``tries`` measurements: a peak read low makes every roofline fraction high."""
    import torch

    from machine_peaks import copy_bandwidth, matmul_flops
    return {"bf16_flops": max(matmul_flops(torch.bfloat16, (1024, 2048)) for _ in range(tries)),
            "fp32_flops": max(matmul_flops(torch.float32, (1024, 2048)) for _ in range(tries)),
            "copy_bytes": max(copy_bandwidth() for _ in range(tries))}
