"""A CPU's name as the project's tables, boot log and calibrations give it: a bare cloud name
("AMD EPYC") with its generation, read from /proc/cpuinfo's CPU family. A Zen 3 (AVX2 only),
a Zen 4 and a Zen 5 (both AVX512-BF16) all report "AMD EPYC", and nothing measured on one
stands for another (docs/benchmarks.md, "Against vLLM, one table per CPU"). Standard library
only: the simulator and the benchmark scripts use it too."""

from __future__ import annotations

from collections.abc import Iterable


def with_generation(model: str, family: int | None, flags: str | Iterable[str]) -> str:
    """``model`` with its Zen generation where the name alone says nothing of it (no digit
    in it): family 25 is a Zen 3 without AVX-512 and a Zen 4 with it, 26 a Zen 5. ``flags``:
    /proc/cpuinfo's, as a string or as names."""
    if not model.startswith("AMD") or any(c.isdigit() for c in model) or family is None:
        return model
    if family == 25:
        names = flags.split() if isinstance(flags, str) else set(flags)
        zen: str | None = "Zen 4" if "avx512f" in names else "Zen 3"
    else:
        zen = {26: "Zen 5"}.get(family)
    return f"{model} {zen}" if zen else model
