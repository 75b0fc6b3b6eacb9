"""Issue 16 item 1: the AVX-512, AVX512-BF16, AVX512-VNNI and AMX-INT8 kernel code is checked on
every x86 machine the tests run on, not only where the CPU has those instructions (AMX through
a software model of its tile instructions, which the emulator lacks):
tools/avx512_check.py runs it under an x86 emulator against references (docs/kernels.md,
"Checking AVX-512 code on a CPU without it")."""

from __future__ import annotations

import importlib.util
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "avx512_check.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bochscpu") is None or platform.machine() != "x86_64"
    or shutil.which("g++") is None or shutil.which("objcopy") is None,
    reason="needs x86-64, g++, binutils and bochscpu-python (the dev extra)")


def test_the_avx512_kernels_match_their_references_under_the_emulator() -> None:
    result = subprocess.run([sys.executable, str(TOOL), "--cases", "30"], capture_output=True,
                            text=True, timeout=600)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-4000:]
    summaries = re.findall(r"^(\w+): (\d+) of (\d+) cases match$", result.stdout, re.MULTILINE)
    assert [name for name, _, _ in summaries] == ["panels", "tiles", "invariant", "softmax",
                                                  "int8", "amx"], report[-4000:]
    assert all(passed == total and int(total) > 0 for _, passed, total in summaries)
    # vdpbf16ps and vpdpwssd ran too (the Sapphire Rapids model), not only their stand-ins
    assert "panels panel_rows_native" in result.stdout
    assert "tiles bf16q" in result.stdout and "tiles packed" in result.stdout
    assert "invariant bf16" in result.stdout
    assert "int8 avx2 = vnni" in result.stdout  # --quantization int8's VNNI path = AVX2's
    # its AMX path, through amx_tiles.h's software model of the tiles, = AVX2's too
    assert "amx tdpbssd model" in result.stdout and "amx = avx2" in result.stdout
