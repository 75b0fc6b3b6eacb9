"""Issue 15 item 1: a calibration records the CPU it ran on and the simulator warns when it
prices a run on another; ``--hardware cpu-local`` is this machine's measured peaks, cached
per CPU (docs/fidelity.md, "Per machine")."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvserve.sim import machine
from kvserve.sim.presets import get_hardware

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni
processor\t: 1
model name\t: ignored: only the first entry counts
"""
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd asimddp bf16 i8mm sve sve2\n"
PEAKS = {"bf16_flops": 5e11, "fp32_flops": 2e11, "memory_bandwidth": 4e10,
         "memory_bytes": 8 << 30}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cpuinfo_gives_the_model_and_the_matmul_extensions_in_a_fixed_order():
    assert machine.parse_cpuinfo(ZEN4) == {
        "model": "AMD EPYC 9R14",
        "isa": ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_bf16"]}
    assert machine.parse_cpuinfo(GRAVITON) == {
        "model": "", "isa": ["asimd", "asimddp", "bf16", "i8mm", "sve", "sve2"]}


def test_a_zen_4_and_a_zen_5_of_one_name_are_two_cpus():
    """Both report "AMD EPYC" with the same matmul extensions: the family tells them apart
    (a Zen 4's calibration priced a Zen 5's runs without a warning); a calibration from
    before the family was recorded still matches either."""
    zen4 = machine.parse_cpuinfo("cpu family\t: 25\n" + ZEN4)
    zen5 = machine.parse_cpuinfo("cpu family\t: 26\n" + ZEN4)
    assert (zen4["family"], zen5["family"]) == (25, 26)
    assert not machine.same_cpu(zen4, zen5)
    assert machine.cpu_key(zen4) != machine.cpu_key(zen5)
    assert machine.same_cpu({k: v for k, v in zen4.items() if k != "family"}, zen5)
    bare = machine.parse_cpuinfo("cpu family\t: 26\n" + ZEN4.replace("EPYC 9R14", "EPYC"))
    assert machine.describe_cpu(bare).startswith("AMD EPYC Zen 5 (")


def test_a_sapphire_and_an_emerald_rapids_of_one_name_are_two_cpus():
    """Both report the bare "Intel(R) Xeon(R) Processor" with AMX: the model number tells
    them apart, in the name and in whether a calibration is the machine's own."""
    xeon = ZEN4.replace("AMD EPYC 9R14", "Intel(R) Xeon(R) Processor")
    sapphire = machine.parse_cpuinfo("cpu family\t: 6\nmodel\t\t: 143\n" + xeon)
    emerald = machine.parse_cpuinfo("cpu family\t: 6\nmodel\t\t: 207\n" + xeon)
    assert (sapphire["model_number"], emerald["model_number"]) == (143, 207)
    assert not machine.same_cpu(sapphire, emerald)
    assert machine.same_cpu({k: v for k, v in sapphire.items() if k != "model_number"}, emerald)
    assert machine.describe_cpu(emerald).startswith("Intel(R) Xeon(R) Processor Emerald Rapids (")


def test_cpus_differ_by_model_or_by_extension_and_key_their_own_cache_files():
    zen4 = {**machine.parse_cpuinfo(ZEN4), "logical_cpus": 2}
    no_bf16 = {**zen4, "isa": [f for f in zen4["isa"] if f != "avx512_bf16"]}
    assert machine.same_cpu(zen4, dict(zen4))
    assert not machine.same_cpu(zen4, no_bf16)
    assert not machine.same_cpu(zen4, {**zen4, "model": "Intel Xeon"})
    assert machine.cpu_key(zen4).startswith("amd-epyc-9r14-")
    assert machine.cpu_key(zen4) != machine.cpu_key(no_bf16)
    assert machine.cpu_key(zen4) != machine.cpu_key({**zen4, "logical_cpus": 64})


def test_cpu_local_measures_once_per_cpu_then_reads_the_cache(cache, capsys):
    calls = []

    def measure():
        calls.append(1)
        return dict(PEAKS)

    hardware = machine.local_hardware(measure)
    assert calls == [1]
    # it says so, where it caches, and how to measure again (it measured 10 s in silence)
    said = capsys.readouterr().err
    assert "measuring this machine's matmul and copy peaks" in said
    assert str(machine.peaks_path(machine.cpu_identity())) in said
    assert hardware.name == "cpu-local"
    assert hardware.peak_flops == {"fp32": 2e11, "bf16": 5e11, "fp16": 2e11}
    assert (hardware.memory_bandwidth, hardware.memory_bytes) == (4e10, 8 << 30)
    # the preset's roofline conventions stay: measured rates, efficiency 1.0, no overhead
    assert (hardware.compute_efficiency, hardware.memory_efficiency,
            hardware.step_overhead_s) == (1.0, 1.0, 0.0)
    path = machine.peaks_path(machine.cpu_identity())
    assert path.parent == cache / "machine-peaks"
    assert json.loads(path.read_text())["cpu"] == machine.cpu_identity()
    assert machine.local_hardware(measure) == hardware
    assert calls == [1] and not capsys.readouterr().err  # the second call read the cache


def test_a_cache_file_of_another_cpu_is_measured_over(cache):
    path = machine.peaks_path(machine.cpu_identity())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": machine.PEAKS_FORMAT, "cpu": {"model": "other"},
                                **PEAKS, "bf16_flops": 1.0}))
    assert machine.local_hardware(lambda: dict(PEAKS)).peak_flops["bf16"] == 5e11


def _calibration(tmp_path, cpu):
    path = tmp_path / "cm.json"
    meta = {} if cpu is None else {"cpu": cpu}
    path.write_text(json.dumps({"format": "kvserve-cost-model/1", "meta": meta,
                                "coefficients": {"fixed_s": 0.01, "per_token_s": 1e-6}}))
    return path


def test_a_calibration_from_another_cpu_is_named_in_a_warning(tmp_path):
    other = {"model": "Intel Xeon Platinum 8480", "isa": ["avx512f", "amx_bf16"],
             "logical_cpus": 112}
    warning = machine.calibration_cpu_warning(_calibration(tmp_path, other))
    assert warning is not None and warning.startswith("warning: ")
    assert "calibrated on Intel Xeon Platinum 8480 (avx512f, amx_bf16; 112 CPUs)" in warning
    assert machine.describe_cpu(machine.cpu_identity()) in warning
    assert machine.calibration_cpu_warning(_calibration(tmp_path, machine.cpu_identity())) \
        is None
    assert machine.calibration_cpu_warning(_calibration(tmp_path, None)) is None  # old file
    # a meta.cpu edited into other shapes says nothing (the calibration pass: a TypeError)
    for odd in ({"model": 5, "isa": "avx2"}, {"model": "X", "isa": [1, None]},
                {"model": "X", "isa": "avx2"}, {"model": "X", "isa": 5},
                {"model": "X", "isa": True}):
        assert machine.calibration_cpu_warning(_calibration(tmp_path, odd)) is None
    # a GPU's calibration made on another host is the GPU's step times, not its CPU's
    path = _calibration(tmp_path, other)
    data = json.loads(path.read_text())
    data["meta"]["device"] = "NVIDIA H100 80GB HBM3 (cuda:0)"
    path.write_text(json.dumps(data))
    assert machine.calibration_cpu_warning(path) is None
    data["meta"]["device"] = "cpu"
    path.write_text(json.dumps(data))
    assert machine.calibration_cpu_warning(path) is not None


def test_simulate_warns_on_stderr_and_still_runs(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["workload", "gen", "-n", "5", "--rate", "10", "--seed", "1",
                 "-o", str(trace)]) == 0
    capsys.readouterr()
    other = {"model": "Apple M3", "isa": [], "logical_cpus": 8}
    assert main(["simulate", "--trace", str(trace), "--quiet", "--cost-model", "calibrated",
                 "--calibration", str(_calibration(tmp_path, other))]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was calibrated on Apple M3 (no extensions listed; 8 CPUs)" \
        in err[0]


def test_simulate_on_cpu_local_prices_with_the_cached_peaks_and_echoes_them(tmp_path, cache):
    path = machine.peaks_path(machine.cpu_identity())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": machine.PEAKS_FORMAT,
                                "cpu": machine.cpu_identity(), **PEAKS}))
    trace, report = tmp_path / "t.jsonl", tmp_path / "r.json"
    assert main(["workload", "gen", "-n", "5", "--rate", "10", "--seed", "1",
                 "-o", str(trace)]) == 0
    assert main(["simulate", "--trace", str(trace), "--quiet", "--model", "smollm2-135m",
                 "--hardware", "cpu-local", "--report", str(report)]) == 0
    deployment = json.loads(report.read_text())["config"]["deployment"]
    assert deployment["hardware"] == "cpu-local"
    assert deployment["hardware_measured"] == {
        "peak_flops": {"fp32": 2e11, "bf16": 5e11, "fp16": 2e11},
        "memory_bandwidth": 4e10, "memory_bytes": 8 << 30}
    # the static preset (the documented machine's figures) is unchanged for library users
    assert get_hardware("cpu-local").peak_flops["bf16"] == 408e9
