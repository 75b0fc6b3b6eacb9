"""Issue 17.5: simulate and plan take --dtype in vLLM's spellings (auto: the presets' bf16),
and fp8 KV as --kv-cache-dtype, which halves the KV bytes of a bf16 deployment."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvserve.flags import DTYPES
from kvserve.sim.presets import WEIGHT_DTYPES

PLAN = ["plan", "--model", "llama-3.1-8b", "--prompt-len", "1000", "--output-len", "24",
        "--json"]


def plan(capsys, *argv: str) -> dict:
    assert main([*PLAN, *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_simulator_knows_every_engine_spelling():
    assert set(DTYPES) <= set(WEIGHT_DTYPES)


@pytest.mark.parametrize(("spelling", "preset"), [
    ("auto", "bf16"), ("half", "fp16"), ("float16", "fp16"), ("bfloat16", "bf16"),
    ("float", "fp32"), ("float32", "fp32"),
    ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32")])  # as reports print them (QA)
def test_plan_takes_vllm_spellings(capsys, spelling, preset):
    assert plan(capsys, "--dtype", spelling)["dtype"] == preset


def test_default_plan_is_bf16_and_fp8_kv_halves_the_bytes_per_token(capsys):
    default = plan(capsys)
    assert default["dtype"] == "bf16" and default["kv_bytes_per_token"] == 131_072
    fp8 = plan(capsys, "--kv-cache-dtype", "fp8")
    assert fp8["kv_bytes_per_token"] == 65_536
    assert fp8["weight_bytes"] == default["weight_bytes"]  # the weights stay bf16
    assert fp8["num_blocks"] > default["num_blocks"]


def test_simulate_echoes_a_kv_cache_dtype_only_when_given(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["workload", "gen", "-n", "8", "--rate", "5", "--seed", "1",
                 "-o", str(trace)]) == 0
    reports = {}
    for name, extra in (("default", []), ("fp8", ["--kv-cache-dtype", "fp8_e4m3"])):
        path = tmp_path / f"{name}.json"
        assert main(["simulate", "--trace", str(trace), "--quiet", "--report", str(path),
                     *extra]) == 0
        reports[name] = json.loads(path.read_text())["config"]
    assert "kv_cache_dtype" not in reports["default"]["deployment"]
    assert reports["fp8"]["deployment"]["kv_cache_dtype"] == "fp8_e4m3"
    assert reports["fp8"]["cost_model"]["kv_dtype"] == "fp8"
    assert reports["fp8"]["cache"]["num_blocks"] > reports["default"]["cache"]["num_blocks"]
