"""Issue 16 item 1: ``kvserve info`` and the boot log name the CPU, its ISA flags, whether the
C++ kernels are built and the kernel each op uses (docs/kernels.md)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvserve.cli import main
from kvserve.engine.llm import LLM
from kvserve.model import kernel_info, paged_kernel
from kvserve.model.kernel_info import (
    OPS,
    PROJECTIONS_ENV,
    cpu_info,
    op_kernels,
    parse_cpuinfo,
    projection_kernel,
)
from kvserve.model.quantization import int8_linear_available
from tests.model.reference import TINY

AMX_XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 \
avx512_fp16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu
"""
ALL_ISA = ("avx2", "fma", "avx512f", "avx512_bf16")


def test_cpuinfo_gives_the_first_processor_and_counts_them() -> None:
    cpu = parse_cpuinfo(AMX_XEON)
    assert (cpu.model, cpu.logical_cpus) == ("Intel(R) Xeon(R) Platinum 8480+", 2)
    assert [flag for flag, found in cpu.isa().items() if not found] == []
    assert cpu.isa()["amx_bf16"] and cpu.isa()["avx512_fp16"]
    zen4 = parse_cpuinfo("processor : 0\nmodel name : AMD EPYC\nflags : avx2 avx512f "
                         "avx512_bf16\n")
    assert [flag for flag, found in zen4.isa().items() if found] == ["avx2", "avx512f",
                                                                    "avx512_bf16"]
    # a bare name is shown with its generation: a Zen 4 (family 25) and a Zen 5 (26) both
    # say AMD EPYC
    zen5 = parse_cpuinfo("processor : 0\nmodel name : AMD EPYC\ncpu family : 26\nflags : "
                         "avx2 avx512f avx512_bf16\n")
    assert (zen5.family, zen5.name, zen4.name) == (26, "AMD EPYC Zen 5", "AMD EPYC")
    emerald = parse_cpuinfo("processor : 0\nmodel name : Intel(R) Xeon(R) Processor\n"
                            "cpu family : 6\nmodel : 207\nflags : avx512f amx_bf16\n")
    assert (emerald.model_number, emerald.name) == (207, "Intel(R) Xeon(R) Processor "
                                                         "Emerald Rapids")
    assert cpu.name == cpu.model  # a full name says enough


def test_bf16_on_an_avx512_bf16_build_uses_the_panels_onednn_and_the_bf16_dot_products() -> None:
    ops = op_kernels(torch.bfloat16, True, ALL_ISA, onednn_bf16=True)
    assert list(ops) == list(OPS)
    # no AMX: every call on the AVX512-BF16 panels, the head's too (one copy of the weights)
    assert ops["projections"].startswith("C++ AVX512-BF16 panel GEMM (panel_linear_bf16")
    assert "oneDNN" not in ops["projections"]
    # hybrid-dpbf16 when asked: the panels up to 128 rows (the head 32), oneDNN above
    hybrid = op_kernels(torch.bfloat16, True, ALL_ISA, onednn_bf16=True, choice="hybrid")
    assert hybrid["projections"].startswith("C++ AVX512-BF16 panel GEMM up to 128 rows")
    assert "oneDNN packed bf16 above" in hybrid["projections"]
    # an AMX build: the panels on kvserve's own tiles up to 512 rows, not the head
    amx = op_kernels(torch.bfloat16, True, (*ALL_ISA, "amx_bf16"), onednn_bf16=True)
    assert amx["projections"].startswith("C++ AMX-BF16 tiles up to 512 rows")
    assert "not the LM head" in amx["projections"] and "on AMX tiles" in amx["projections"]
    assert amx["lm_head"].startswith("oneDNN packed bf16")
    # ... or, asked for hybrid-dpbf16, the AVX512-BF16 panels only up to 8 rows
    asked = op_kernels(torch.bfloat16, True, (*ALL_ISA, "amx_bf16"), onednn_bf16=True,
                       choice="hybrid")
    assert asked["projections"].startswith("C++ AVX512-BF16 panel GEMM up to 8 rows")
    assert asked["lm_head"].startswith("oneDNN packed bf16")
    assert ops["lm_head"] == ops["projections"]
    assert ops["attention"].startswith("C++ AVX512-BF16")
    assert ops["rms_norm"] == ops["silu_and_mul"] == ops["rope_kv_write"] == "C++ fused (AVX-512)"
    assert ops["sampling"].startswith("C++ argmax_rows (greedy rows)")
    assert "greedy_rows" in ops["sampling"]  # bf16 plain greedy steps (llama.greedy_tokens)
    assert "greedy_rows" not in op_kernels(torch.float32, True, ALL_ISA,
                                           onednn_bf16=True)["sampling"]
    assert op_kernels(torch.bfloat16, False, (), onednn_bf16=True)["sampling"] == "torch"


def test_float32_and_narrower_builds_report_their_own_paths() -> None:
    assert op_kernels(torch.float32, True, ALL_ISA, True)["attention"].startswith(
        "C++ AVX-512 intrinsics")
    assert op_kernels(torch.float32, True, ALL_ISA, True)["projections"] == \
        "torch F.linear float32"
    avx2 = op_kernels(torch.bfloat16, True, ("avx2", "fma"), onednn_bf16=False)
    assert avx2["attention"].startswith("C++ AVX2 + FMA intrinsics")  # a Zen 3, say
    assert avx2["rms_norm"] == "C++ fused (AVX2)"
    assert avx2["projections"].endswith("activations widened to float32)")  # bf16 panels
    assert op_kernels(torch.float32, True, ("avx2", "fma"), False, packs_fp32=True)[
        "projections"].startswith("C++ AVX2 panel GEMM")
    assert op_kernels(torch.float32, False, (), False, packs_fp32=True)[
        "projections"].startswith("oneDNN packed float32")  # the extension not built
    no_fma = op_kernels(torch.float32, True, ("avx2",), onednn_bf16=False)
    assert no_fma["attention"] == "C++ compiler-vectorised loops (AVX2)"
    assert op_kernels(torch.bfloat16, True, ("avx2",), onednn_bf16=False)["projections"] == \
        "torch F.linear bfloat16"  # no panel GEMM without FMA


ZEN3 = ("avx2", "fma")
BF16, F32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize(("dtype", "isa", "onednn_bf16", "packs_fp32", "choice", "kernel"), [
    (BF16, ALL_ISA, True, False, "auto", "panels-dpbf16"),   # Zen 4: every call on panels
    (BF16, (*ALL_ISA, "amx_bf16"), True, False, "auto", "hybrid-amx"),  # AMX: the tiles
    (BF16, (*ALL_ISA, "amx_bf16"), True, False, "amx", "hybrid-amx"),
    (BF16, ("avx2", "fma", "avx512f"), True, False, "auto", "onednn"),  # no bf16 panels built
    (BF16, ALL_ISA, True, False, "onednn", "onednn"),
    (BF16, ALL_ISA, True, False, "hybrid", "hybrid-dpbf16"),
    (BF16, (*ALL_ISA, "amx_bf16"), True, False, "hybrid", "hybrid-dpbf16"),
    (BF16, ALL_ISA, True, False, "panels", "panels-dpbf16"),  # ... its own panels when asked
    (BF16, ALL_ISA, True, False, "panels-avx2", "panels-avx2"),
    (F32, ALL_ISA, True, False, "auto", "torch"),            # float32 on AVX-512: MKL
    (F32, ALL_ISA, True, False, "panels", "panels-avx2"),    # no bf16 dot for float32 rows
    (F32, ALL_ISA, True, False, "onednn", "onednn"),
    (BF16, ZEN3, False, True, "auto", "panels-avx2"),        # Zen 3: the AVX2 panels
    (F32, ZEN3, False, True, "auto", "panels-avx2"),
    (BF16, ZEN3, False, True, "panels", "panels-avx2"),
    (F32, ZEN3, False, True, "torch", "torch"),
    (BF16, ("avx2", "fma", "avx512f"), False, False, "auto", "panels-avx2"),  # AVX-512, no bf16
    (BF16, ("avx2",), False, False, "auto", "torch"),        # no FMA: no panels
    (torch.float16, ALL_ISA, True, False, "auto", "torch"),
])
def test_projection_kernel_rules(dtype, isa, onednn_bf16, packs_fp32, choice, kernel) -> None:
    assert projection_kernel(dtype, True, isa, onednn_bf16, packs_fp32, choice) == kernel


@pytest.mark.parametrize(("dtype", "built", "isa", "choice", "why"), [
    (BF16, True, ZEN3, "onednn", "oneDNN has no native bf16 on this CPU"),
    (F32, True, ("avx2",), "panels", "this build has no AVX2 \\+ FMA panel GEMM"),
    (F32, False, (), "panels-avx2", "the C\\+\\+ extension is not built"),
    (torch.float16, True, ALL_ISA, "panels", "only float32 and bfloat16"),
    (F32, True, ALL_ISA, "hybrid", "only a bfloat16 model has it"),
    (BF16, True, ALL_ISA, "hybrid", "it needs oneDNN's native bf16"),  # onednn_bf16 False
    (BF16, False, ALL_ISA, "hybrid", "the C\\+\\+ extension is not built"),
    (BF16, True, ALL_ISA, "amx", "this build has no AMX-BF16 tiles"),
    (F32, True, (*ALL_ISA, "amx_bf16"), "amx", "only a bfloat16 model has it"),
])
def test_a_projection_kernel_this_machine_lacks_is_refused(dtype, built, isa, choice,
                                                          why) -> None:
    with pytest.raises(ValueError, match=f"^{PROJECTIONS_ENV}={choice} cannot project .*{why}"):
        projection_kernel(dtype, built, isa, False, True, choice)


def test_a_chosen_kernel_is_reported_with_the_variable_that_chose_it() -> None:
    ops = op_kernels(BF16, True, ALL_ISA, onednn_bf16=True, choice="panels")
    assert ops["projections"] == ops["lm_head"]
    assert ops["projections"].startswith("C++ AVX512-BF16 panel GEMM")
    assert ops["projections"].endswith(f"[{PROJECTIONS_ENV}=panels]")


def test_info_refuses_a_kvserve_projections_it_cannot_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(PROJECTIONS_ENV, "fastest")
    assert main(["info"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvserve info: error: {PROJECTIONS_ENV}='fastest' is not one of auto, "
                   "amx, hybrid, panels, panels-avx2, onednn, torch"]


def test_info_shows_a_choice_that_runs_one_dtype_only_as_refused_for_the_other(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """QA (docs check): KVSERVE_PROJECTIONS=hybrid, a bf16 kernel, made `kvserve info` exit
    2 on its float32 rows, though generate runs it and docs/kernels.md says info prints the
    pick. Now the float32 rows say why they refuse; only a choice no dtype runs is exit 2."""
    from kvserve.model.kernel_info import kernel_report

    monkeypatch.setenv(PROJECTIONS_ENV, "hybrid")
    try:
        kernel_report().ops(BF16)
    except ValueError as error:  # no AVX512-BF16 build here: hybrid runs nowhere
        assert main(["info"]) == 2
        assert str(error) in capsys.readouterr().err
        return
    assert main(["info", "--json"]) == 0
    ops = json.loads(capsys.readouterr().out)["ops"]
    assert ops["float32"] == {"refused": f"{PROJECTIONS_ENV}=hybrid cannot project float32 "
                                         "here: only a bfloat16 model has it"}
    assert ops["bfloat16"]["projections"].endswith(f"[{PROJECTIONS_ENV}=hybrid]")


@pytest.mark.parametrize(("dtype", "built"), [(torch.bfloat16, False), (torch.float16, True)])
def test_without_the_kernels_every_op_is_torch(dtype: torch.dtype, built: bool) -> None:
    ops = op_kernels(dtype, built, ALL_ISA if built else (), onednn_bf16=False)
    assert ops["attention"] == "torch (gather + scaled_dot_product_attention)"
    assert ops["rms_norm"] == ops["silu_and_mul"] == ops["rope_kv_write"] == "torch ops"


def test_info_json_describes_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cpu = cpu_info()
    assert report["cpu"] == {"model": cpu.model, "family": cpu.family,
                             "model_number": cpu.model_number, "name": cpu.name,
                             "logical_cpus": cpu.logical_cpus, "isa": cpu.isa()}
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert report["extension"]["built"] == paged_kernel.available()
    if paged_kernel.available():
        # -march=native: the build has exactly the paths this CPU's flags allow (amx_bf16
        # too: this test failed on the H200 machine's AMX Xeon host, 2026-12-04).
        assert report["extension"]["compiled_isa"] == [
            flag for flag in (*ALL_ISA, "amx_bf16") if flag in cpu.flags]
    assert list(report["ops"]) == ["float32", "bfloat16"]
    for dtype, ops in report["ops"].items():
        assert ops == kernel_info.kernel_report().ops(getattr(torch, dtype))
    # --quantization int8: its kernel where this machine runs it, else the reason it cannot
    expected = "int8_linear [--quantization int8]" if int8_linear_available() \
        else "--quantization int8 needs"
    assert report["quantization"]["int8"].startswith(expected)
    # what --dtype auto picks for the bundled model here (docs/dtype.md)
    from kvserve.model.dtype import auto_dtype_name

    assert report["dtype_auto"]["dtype"] == auto_dtype_name()
    assert report["dtype_auto"]["why"].startswith("auto: the checkpoint is 16-bit or quantized")


def test_info_text_names_cpu_isa_and_each_op(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    cpu = cpu_info()
    assert lines[0] == f"CPU          {cpu.name} ({cpu.logical_cpus} logical CPUs)"
    found = " ".join(flag for flag, present in cpu.isa().items() if present)
    assert lines[1] == f"ISA found    {found}"
    assert lines[4].startswith("C++ kernels  built" if paged_kernel.available()
                               else "C++ kernels  not built")
    assert lines[6].startswith("quantization int8_linear" if int8_linear_available()
                               else "quantization --quantization int8 needs")
    from kvserve.model.dtype import auto_dtype_name

    assert lines[7].startswith(f"dtype auto   {auto_dtype_name()} (the checkpoint is 16-bit "
                               "or quantized")
    report = kernel_info.kernel_report()
    for dtype in ("float32", "bfloat16"):
        start = lines.index(f"{dtype}:")
        ops = report.ops(getattr(torch, dtype))
        assert lines[start + 1:start + 1 + len(OPS)] == [
            f"  {op:<14} {ops[op]}" for op in OPS]


def test_an_engine_logs_the_cpu_and_its_kernels_at_boot(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.engine.llm"):
        LLM(TINY, dtype="bfloat16", num_kv_blocks=8)
    messages = [record.getMessage() for record in caplog.records]
    report = kernel_info.kernel_report()
    assert messages[-2:] == kernel_info.boot_lines(report, torch.bfloat16)
    assert messages[-2].startswith(f"CPU: {report.cpu.name}, ")
    assert "bfloat16 kernels: projections " in messages[-1]


def test_prefill_chunks_go_to_amx_tiles_or_torchs_flash_attention_for_bf16_on_amx_only(
        ) -> None:
    """Issue 16 item 1: on an AMX Xeon torch's flash attention (oneDNN brgemm on the tiles)
    was 1.1-2.5x the C++ prefill kernel at 16-640 rows, and kvserve's own AMX tiles
    (csrc/attention_amx.h) 1.2-2.5x flash (docs/kernels.md): bf16 prefill chunks take the
    tiles where the build compiled them, flash on an AMX CPU whose build did not; elsewhere
    the kernel stays, as nothing measured either there. KVSERVE_PREFILL_ATTENTION overrides
    the rule; amx where the build has no AMX path is refused."""
    from kvserve.model.kernel_info import (
        AMX_PREFILL_ROWS,
        FLASH_PREFILL_ROWS,
        prefill_attention_kernel,
    )

    amx = frozenset({"avx512_bf16", "amx_bf16"})
    built_amx = (*ALL_ISA, "amx_bf16")
    assert prefill_attention_kernel(BF16, amx, "auto", built_amx) == "amx"
    assert prefill_attention_kernel(BF16, amx) == "flash"  # no AMX path in the build
    assert prefill_attention_kernel(F32, amx, "auto", built_amx) == "kernel"  # no fp32 tiles
    assert prefill_attention_kernel(BF16, frozenset({"avx512_bf16"})) == "kernel"  # a Zen 4
    assert prefill_attention_kernel(BF16, amx, "kernel", built_amx) == "kernel"
    assert prefill_attention_kernel(BF16, amx, "flash", built_amx) == "flash"
    assert prefill_attention_kernel(BF16, amx, "amx", built_amx) == "amx"
    # the tiles take bf16 only: asked for float32, flash (which takes any dtype) runs
    assert prefill_attention_kernel(F32, amx, "amx", built_amx) == "flash"
    assert "torch's flash attention" in op_kernels(F32, True, built_amx, True, flags=amx,
                                                   prefill="amx")["attention"]
    assert prefill_attention_kernel(F32, frozenset(), "flash") == "flash"
    with pytest.raises(ValueError, match="KVSERVE_PREFILL_ATTENTION=amx needs a build with "
                                         "AMX-BF16 tiles"):
        prefill_attention_kernel(BF16, amx, "amx", ALL_ISA)
    on_amx = op_kernels(BF16, True, built_amx, True, flags=amx)["attention"]
    assert on_amx.endswith(f"prefill chunks of {AMX_PREFILL_ROWS}+ rows: C++ AMX-BF16 tiles "
                           "(head_dim 64; others torch's flash attention)")
    flash = op_kernels(BF16, True, ALL_ISA, True, flags=amx)["attention"]
    assert f"prefill chunks of {FLASH_PREFILL_ROWS}+ rows: torch's flash attention" in flash
    assert "flash" not in op_kernels(BF16, True, ALL_ISA, True, flags=amx - {"amx_bf16"})[
        "attention"]
    asked = op_kernels(F32, True, ALL_ISA, True, prefill="flash")["attention"]
    assert asked.endswith("[KVSERVE_PREFILL_ATTENTION=flash]")
    # the kernel asked for where auto would take flash: the line says who chose it
    kernel = op_kernels(BF16, True, ALL_ISA, True, flags=amx, prefill="kernel")["attention"]
    assert kernel.endswith("[KVSERVE_PREFILL_ATTENTION=kernel]") and "flash" not in kernel
    with pytest.raises(ValueError, match="KVSERVE_PREFILL_ATTENTION=amx"):
        op_kernels(BF16, True, ALL_ISA, True, flags=amx, prefill="amx")
    # not built: every op is torch's already, flash or not
    assert op_kernels(BF16, False, (), True, flags=amx)["attention"] == \
        "torch (gather + scaled_dot_product_attention)"


def test_a_prefill_attention_choice_not_known_is_refused(monkeypatch) -> None:
    from kvserve.model.kernel_info import PREFILL_ATTENTION_ENV, prefill_attention_choice

    monkeypatch.setenv(PREFILL_ATTENTION_ENV, " Flash ")
    assert prefill_attention_choice() == "flash"
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "tiles")
    with pytest.raises(ValueError, match="KVSERVE_PREFILL_ATTENTION='tiles' is not one of "
                                         "auto, kernel, flash, amx"):
        prefill_attention_choice()


def test_the_layer_loop_line_names_the_steps_that_loop_in_cpp(monkeypatch) -> None:
    """docs/kernels.md, "The layers in one C++ call": bf16 steps whose projections run on
    the pair panels, up to the panels' rows; not float32, not
    oneDNN-only, not without the C++ kernels; KVSERVE_LAYER_STACK=0 says so."""
    from kvserve.model.kernel_info import LAYER_STACK_ENV, describe_layer_loop

    bf16 = torch.bfloat16
    assert describe_layer_loop("hybrid-amx", bf16, True, True).startswith(
        "C++ for steps up to 512 rows")
    assert "of any rows" in describe_layer_loop("panels-dpbf16", bf16, True, False)
    assert describe_layer_loop("hybrid-dpbf16", bf16, True, False).startswith(
        "C++ for steps up to 128 rows")
    for kernel, dtype, fused in (("onednn", bf16, True), ("hybrid-amx", bf16, False),
                                 ("panels-avx2", torch.float32, True)):
        assert describe_layer_loop(kernel, dtype, fused, True).startswith("Python")
    for off in ("0", "false", "off"):  # as KVSERVE_HUGE_PAGES reads it (QA: only "0")
        monkeypatch.setenv(LAYER_STACK_ENV, off)
        assert describe_layer_loop("hybrid-amx", bf16, True, True).endswith(
            f"[{LAYER_STACK_ENV}={off}]")


def test_the_kernels_build_with_this_environments_ninja_whatever_the_path_finds_first(
        tmp_path, monkeypatch) -> None:
    """QA: a Ray worker's PATH found the venv's ninja, a plain start the system's (another
    version), and each switch rebuilt every kernel in the shared build directory."""
    import os
    import shutil
    from pathlib import Path

    ninja = pytest.importorskip("ninja")
    ours = Path(ninja.BIN_DIR) / "ninja"
    if not ours.exists():
        pytest.skip("the ninja package has no binary in this environment")
    other = tmp_path / "bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\nexit 1\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}:/usr/bin:/bin")
    paged_kernel._put_ninja_on_path()
    assert Path(shutil.which("ninja")).resolve() == ours.resolve()
    path = os.environ["PATH"]
    paged_kernel._put_ninja_on_path()  # once is enough: the PATH does not grow
    assert os.environ["PATH"] == path


def test_info_says_on_stderr_what_the_kernels_build_says() -> None:
    """QA: the first ``kvserve info`` on a machine (docs/new-cpu.md's first command) built
    the kernels for six minutes without a word: its log went nowhere."""
    import subprocess
    import sys

    script = ("import logging, sys\n"  # a build that logs, then fails: no real one runs
              "from kvserve.model import kernel_info\n"
              "def building():\n"
              "    logging.getLogger('kvserve.model').info('building the kernels')\n"
              "    raise ValueError('stop here')\n"
              "kernel_info.kernel_report = building\n"
              "from kvserve.cli import main\n"
              "sys.exit(main(['info']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "INFO kvserve.model: building the kernels" in done.stderr


def test_the_build_is_named_by_the_compiler_too(monkeypatch) -> None:
    """QA: a process with CXX set rewrote the build of one without it, in its directory
    (torch writes the compiler into build.ninja): each rebuilt the other's in turn."""
    monkeypatch.delenv("CXX", raising=False)
    plain = paged_kernel.build_name()
    monkeypatch.setenv("CXX", "g++")
    assert paged_kernel.build_name() != plain
    monkeypatch.setenv("CXX", "")
    assert paged_kernel.build_name() == plain  # unset or empty: the one default build
