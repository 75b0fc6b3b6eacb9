"""``--device`` (docs/device.md): names, refusals, and the seams a GPU run goes through.

No test here has a GPU (CI has none); what runs on one is benchmarks/device_check.py. These
pin what can be checked on the CPU: the choice and its errors, the options a GPU refuses, the
dtype ``auto`` picks there, and that every tensor the step builds on the CPU is moved (the
``meta`` device stands in for a GPU: it has shapes and a device, no values).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvserve import flags
from kvserve.cli import main
from kvserve.engine.data_parallel import ray_gpus_per_replica, replica_launchers
from kvserve.engine.engine_process import EngineSpec
from kvserve.model import paged_kernel
from kvserve.model.device import check_device_options, replica_gpus, resolve_device
from kvserve.model.dtype import resolve_dtype
from kvserve.model.input_batch import SequenceSlice, build_batch
from kvserve.model.kv_cache import allocate_kv_cache
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import dummy_weights
from tests.server.helpers import TINY


def test_cpu_and_auto_without_cuda_resolve_to_the_cpu():
    assert resolve_device("cpu") == (torch.device("cpu"), "--device cpu")
    device, why = resolve_device("auto")
    assert device == torch.device("cpu")  # the project's torch is a CPU build
    assert why.startswith("auto: no CUDA device")


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "cpu:0", "", "cuda:"])
def test_an_unknown_device_is_named(name):
    with pytest.raises(ValueError, match=f"unknown device {name!r}"):
        resolve_device(name)


def test_cuda_without_a_cuda_device_says_so():
    with pytest.raises(ValueError, match=r"--device cuda: this torch .* sees no CUDA device"):
        resolve_device("cuda")


def test_cuda_indices_are_checked_against_the_devices_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto")[0] == torch.device("cuda")
    assert resolve_device("cuda:1")[0] == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_each_local_replica_gets_a_gpu_of_its_own(monkeypatch):
    """--data-parallel-size N on --device cuda: replica i sees the i-th visible GPU alone (its
    CUDA_VISIBLE_DEVICES), as vLLM's data-parallel ranks do; every replica sat on cuda:0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert replica_gpus(2, "cuda") == ["0", "1"] and replica_gpus(3, "auto") == ["0", "1", "2"]
    assert replica_gpus(2, "cuda:1") is None and replica_gpus(1, "cuda") is None  # as named
    launchers = replica_launchers(2, "mp", "cuda")
    env = [launcher.environment(EngineSpec(dict)) for launcher in launchers]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5, 7")  # the ones this process may use
    assert replica_gpus(2, "cuda") == ["5", "7"]
    with pytest.raises(ValueError, match=r"--data-parallel-size 3 on --device cuda gives "
                                         r"each replica a GPU of its own, and this machine "
                                         r"has 2; give --device cuda:0"):
        replica_gpus(3, "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU: no pinning
    assert "CUDA_VISIBLE_DEVICES" not in replica_launchers(2, "mp", "auto")[0].environment(
        EngineSpec(dict))


def test_a_gpu_refuses_the_options_that_need_the_cpu_kernels():
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="--batch-invariant needs the CPU kernels"):
        check_device_options(cuda, batch_invariant=True)
    with pytest.raises(ValueError, match="--quantization int8 runs on the CPU kernels"):
        check_device_options(cuda, quantization="int8")
    check_device_options(cuda)  # nothing asked: nothing refused
    check_device_options(torch.device("cpu"), batch_invariant=True, quantization="int8")


@pytest.mark.parametrize(("bf16", "expected"), [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_dtype_on_a_gpu_is_its_16_bit_type(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)
    cuda = torch.device("cuda")
    dtype, why = resolve_dtype("auto", "quantized", device=cuda)
    assert dtype == expected and "the GPU" in why
    assert resolve_dtype("auto", "float32", device=cuda)[0] == torch.float32
    assert resolve_dtype("float32", "quantized", device=cuda)[0] == torch.float32


def test_the_cli_takes_the_device_names_and_refuses_others():
    parser = flags.argparse.ArgumentParser()
    flags.add_model_flags(parser)
    assert flags.engine_args(parser.parse_args([]))["device"] == "auto"
    for name in ("cpu", "cuda", "cuda:3"):
        assert flags.engine_args(parser.parse_args(["--device", name]))["device"] == name
    for name in ("tpu", "cuda:x", "cuda:"):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["--device", name])
        assert exit_info.value.code == 2


def test_generate_on_cuda_without_one_is_a_one_line_error(capsys):
    assert main(["generate", "--device", "cuda", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sees no CUDA device" in err[0], err


def test_info_says_what_auto_runs_on(capsys):
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device_auto"]["device"] == "cpu"


def test_the_engine_logs_its_device_and_runs_on_the_cpu_when_told(caplog):
    from kvserve.engine.llm import build_engine

    with caplog.at_level(logging.INFO, logger="kvserve.engine.llm"):
        engine = build_engine(TINY, device="cpu", num_kv_blocks=8)
    assert "device cpu (--device cpu)" in caplog.messages
    assert engine.executor.device == torch.device("cpu")  # type: ignore[attr-defined]


def test_a_batch_moves_every_tensor_and_stays_put_on_the_cpu():
    decode = SequenceSlice([5], 20, [3, 7], samples=True)
    prefill = SequenceSlice([1, 2, 3], 0, [4], samples=True)
    batch = build_batch([decode], [prefill], block_size=16)
    assert batch.to(torch.device("cpu")) is batch
    moved = batch.to(torch.device("meta"))
    tensors = [value for value in vars(moved).values() if isinstance(value, torch.Tensor)]
    tensors += [chunk.block_table for chunk in moved.prefills]
    assert len(tensors) == 7 and all(t.device.type == "meta" for t in tensors)
    assert (moved.num_decodes, moved.prefills[0].context_len) == (1, 3)


def test_the_kernels_run_only_on_cpu_tensors():
    on_cpu = torch.zeros(2, dtype=torch.float32)
    assert paged_kernel.runs(on_cpu) == paged_kernel.handles(torch.float32)
    assert not paged_kernel.runs(torch.zeros(2, device="meta"))


def test_the_kv_cache_and_the_network_go_to_the_device_with_a_tied_head_tied():
    meta = torch.device("meta")
    caches = allocate_kv_cache(TINY, 4, 16, torch.float32, meta)
    assert len(caches) == TINY.num_layers
    assert all(t.device == meta and t.shape == (4, 16, TINY.num_kv_heads, TINY.head_dim)
               for pair in caches for t in pair)
    model = LlamaForCausalLM.from_weights(TINY, dummy_weights(TINY, torch.float32, 0),
                                          device=meta)
    assert all(p.device == meta for p in model.parameters())
    assert all(b.device == meta for b in model.buffers())  # the rotary tables
    assert all(m.packed is None and m.panels is None and m.pair_panels is None
               for m in model.modules() if hasattr(m, "packed"))  # nothing packed for the CPU
    assert TINY.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight


def test_a_step_reads_nothing_back_from_the_device():
    """A GPU step queues its kernels and returns; reading a device value back mid-forward
    (the torch path sized each group of 32 decodes by ``int(lens.max())``) waits for the
    queue to drain, 30 layers x 8 groups a step: the H200 check (2026-12-04) ran W1 at 91 ms
    a step. The ``meta`` device has no values to read, so any such read fails here."""
    meta = torch.device("meta")
    model = LlamaForCausalLM.from_weights(TINY, dummy_weights(TINY, torch.float32, 0),
                                          device=meta)
    caches = allocate_kv_cache(TINY, 64, 16, torch.float32, meta)
    decodes = [SequenceSlice([5], 20 + i, [(4 * i + b) % 64 for b in range(4)], True)
               for i in range(40)]  # two groups of decodes
    prefills = [SequenceSlice([1, 2, 3], 0, [4], samples=True),
                SequenceSlice([7, 8], 16, [5, 6], samples=True)]  # a whole prompt, a chunk
    batch = build_batch(decodes, prefills, block_size=16).to(meta)
    hidden = model.forward(batch, caches)
    assert hidden.device == meta and hidden.shape[0] == 40 + 2  # the rows that sample


def test_a_ray_replica_asks_for_a_gpu_on_cuda_and_on_auto_where_the_cluster_has_one():
    assert ray_gpus_per_replica("cuda", 0) == 1  # Ray then waits for one, as vLLM's ranks
    assert ray_gpus_per_replica("auto", 4) == 1  # asking for none would hide the GPUs
    assert ray_gpus_per_replica("auto", 0) == 0
    assert ray_gpus_per_replica("cpu", 4) == 0
    assert ray_gpus_per_replica("cuda:1", 4) == 0
