"""A CPU's name as the project's tables, boot log and calibrations give it: a bare cloud name
("AMD EPYC", "Intel(R) Xeon(R) Processor") with its generation, read from /proc/cpuinfo's
CPU family (and, for Intel, its model number). A Zen 3 (AVX2 only), a Zen 4 and a Zen 5 (both
AVX512-BF16) all report "AMD EPYC", a Sapphire Rapids and an Emerald Rapids (both AMX) the
bare Xeon name, and nothing measured on one stands for another (docs/benchmarks.md,
"Against vLLM, one table per CPU"). Standard library
only: the simulator and the benchmark scripts use it too."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuFields:
    """What /proc/cpuinfo says of the first processor, and how many it lists."""

    model: str = ""  # x86's "model name"; Arm's "cpu model" or "Hardware" ("" if none)
    family: int | None = None  # x86's "cpu family"
    model_number: int | None = None  # x86's "model"
    flags: tuple[str, ...] = ()  # x86's "flags", Arm's "Features", in the file's order
    processors: int = 0


def read_cpuinfo(text: str) -> CpuFields:
    """/proc/cpuinfo's text as :class:`CpuFields` (the first value of each key: the first
    processor's)."""
    found: dict[str, str] = {}
    processors = 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "processor":
            processors += 1
        else:
            found.setdefault(key, value.strip())

    def number(key: str) -> int | None:
        value = found.get(key, "")
        return int(value) if value.isdigit() else None

    model = next((found[key] for key in ("model name", "cpu model", "hardware")
                  if found.get(key)), "")
    flags = found.get("flags") or found.get("features") or ""
    return CpuFields(model, number("cpu family"), number("model"), tuple(flags.split()),
                     processors)

# Intel's server generations by (family 6) model number, where one number is one generation
# (85 is Skylake, Cascade Lake and Cooper Lake alike, so it is left bare)
INTEL_XEON_GENERATIONS = {106: "Ice Lake", 143: "Sapphire Rapids", 207: "Emerald Rapids",
                          173: "Granite Rapids"}


def with_generation(model: str, family: int | None, flags: str | Iterable[str],
                    model_number: int | None = None) -> str:
    """``model`` with its generation where the name alone says nothing of it (no digit in
    it): AMD's family 25 is a Zen 3 without AVX-512 and a Zen 4 with it, 26 a Zen 5; an Intel
    name of family 6 takes :data:`INTEL_XEON_GENERATIONS`'s by ``model_number`` (/proc/cpuinfo's
    ``model``). ``flags``: /proc/cpuinfo's, as a string or as names."""
    if any(c.isdigit() for c in model) or family is None:
        return model
    if model.startswith("Intel") and family == 6 and model_number in INTEL_XEON_GENERATIONS:
        return f"{model} {INTEL_XEON_GENERATIONS[model_number]}"
    if not model.startswith("AMD"):
        return model
    if family == 25:
        names = flags.split() if isinstance(flags, str) else set(flags)
        zen: str | None = "Zen 4" if "avx512f" in names else "Zen 3"
    else:
        zen = {26: "Zen 5"}.get(family)
    return f"{model} {zen}" if zen else model
