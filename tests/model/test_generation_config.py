"""A model's generation_config.json as vLLM applies it (--generation-config)."""

from __future__ import annotations

import json
import re

import pytest

from kvserve.model.generation_config import sampling_defaults
from kvserve.model.loader import default_model_path

# A Hugging Face file as transformers writes it: token ids and switches beside the sampling
# fields, which alone are defaults
FILE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6,
        "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
        "max_new_tokens": 64, "transformers_version": "4.57.6"}
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
            "repetition_penalty": 1.1, "max_tokens": 64}


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(FILE))
    return folder


def test_auto_reads_the_model_directory_s_file(model_dir):
    assert sampling_defaults(model_dir) == DEFAULTS
    assert sampling_defaults(str(model_dir), "auto") == DEFAULTS


def test_a_gguf_and_a_directory_without_the_file_have_no_defaults(tmp_path):
    assert sampling_defaults(default_model_path()) == {}  # the bundled model: unchanged
    assert sampling_defaults(None) == {}
    assert sampling_defaults(tmp_path) == {}


def test_vllm_reads_none_a_directory_reads_its_own_and_overrides_go_last(model_dir,
                                                                         tmp_path):
    assert sampling_defaults(model_dir, "vllm") == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.2}')
    assert sampling_defaults(model_dir, str(other)) == {"temperature": 0.2}
    assert sampling_defaults(model_dir, "auto", {"temperature": 0.5, "max_new_tokens": 8}) \
        == {**DEFAULTS, "temperature": 0.5, "max_tokens": 8}
    assert sampling_defaults(model_dir, "vllm", {"top_k": 5}) == {"top_k": 5}
    # null in the file is no default
    (other / "generation_config.json").write_text('{"temperature": null, "top_p": 0.5}')
    assert sampling_defaults(None, str(other)) == {"top_p": 0.5}


@pytest.mark.parametrize(("source", "overrides", "message"), [
    ("auto", {"do_sample": False}, "override generation config: 'do_sample' is not a "
                                   "sampling default; known: temperature, top_p, top_k, "
                                   "min_p, repetition_penalty, max_new_tokens"),
    ("auto", {"temperature": "hot"}, "generation config (the override): temperature must "
                                     "be a number >= 0 and <= 100, got 'hot'"),
    ("auto", {"top_p": 0}, "top_p must be a number > 0 and <= 1, got 0"),
    ("auto", {"max_new_tokens": 1.5}, "max_new_tokens must be an integer >= 1"),
    ("auto", {"top_k": True}, "top_k must be an integer >= -1"),
    ("/no/such/dir", None, "generation config '/no/such/dir': give auto, vllm or a "
                           "directory holding generation_config.json"),
])
def test_what_cannot_be_a_default_is_named(model_dir, source, overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        sampling_defaults(model_dir, source, overrides)


def test_a_bad_file_is_named(model_dir, tmp_path):
    (model_dir / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match=re.escape("generation config (auto): temperature "
                                                   "must be a number >= 0 and <= 100, got -1")):
        sampling_defaults(model_dir)
    (model_dir / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config\.json: cannot read it as JSON"):
        sampling_defaults(model_dir)
    with pytest.raises(ValueError, match=r"generation_config\.json does not exist"):
        sampling_defaults(None, str(tmp_path))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"overrides": "temperature=0"}, "override_generation_config must be a dict of sampling "
                                     "defaults (e.g. {'temperature': 0.7}), got str"),
    ({"overrides": [("temperature", 0)]}, "override_generation_config must be a dict"),
    ({"source": 5}, "generation_config must be 'auto', 'vllm' or a directory, got int"),
])
def test_arguments_of_the_wrong_kind_are_named(kwargs, message):
    """QA (offline API fuzz): AttributeError and pathlib's TypeError, naming neither."""
    with pytest.raises(TypeError, match=re.escape(message)):
        sampling_defaults(None, **kwargs)


def test_a_model_that_is_not_a_path_is_named():
    from kvserve.engine.llm import LLM

    with pytest.raises(TypeError, match=r"model must be a path .* got int"):
        LLM(5)  # QA: pathlib's "expected str, bytes or os.PathLike object"


def test_the_models_end_of_sequence_ids_stop_every_answer(tmp_path):
    """QA (model files pass): only the tokenizer's EOS stopped an answer; a directory whose
    generation config lists more (Llama-3-Instruct's <|eot_id|>) never stopped at them.
    vLLM adds them to each request's stop ids unless it ignores EOS."""
    from kvserve.core import SamplingParams
    from kvserve.model.generation_config import model_eos_ids
    from tests.server.helpers import make_engine

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert model_eos_ids(tmp_path) == (2, 7)  # config.json's, without a generation config
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 118]}))
    assert model_eos_ids(tmp_path) == (2, 118)  # the generation config's first
    assert model_eos_ids(None) == () and model_eos_ids(tmp_path / "none") == ()
    engine = make_engine(num_kv_blocks=16)
    engine.extra_eos_ids = (118,)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, stop_token_ids=(9,)))
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    requests = engine.scheduler.requests
    assert requests["a"].sampling_params.stop_token_ids == (9, 118)
    assert requests["b"].sampling_params.stop_token_ids == ()
    # held back below min_tokens all the same, as vLLM's all_stop_token_ids (sampler)
    assert requests["b"].sampling_params.extra_eos_token_ids == (118,)


def test_a_model_that_names_no_end_of_sequence_is_warned(caplog):
    """The model pass: a GGUF without tokenizer.ggml.eos_token_id loaded without a word, and
    every answer ran to max_tokens through its chat template's end-of-turn token."""
    import copy
    import logging

    from kvserve.engine.llm import build_engine
    from tests.server.helpers import TINY, tokenizer

    silent = copy.copy(tokenizer())
    silent.eos_token_id = None
    with caplog.at_level(logging.WARNING, logger="kvserve.engine.llm"):
        build_engine(TINY, num_kv_blocks=16, tokenizer=tokenizer())
        assert "names no end-of-sequence token" not in caplog.text
        build_engine(TINY, num_kv_blocks=16, tokenizer=silent)
    assert "the model names no end-of-sequence token: an answer stops only at its " \
           "max_tokens, a stop string or stop_token_ids" in caplog.text
