"""`kvserve serve` for an operator coming from `vllm serve` (QA, docs/vllm-compat.md): vLLM's
environment variables, its flags' several values, the flags taken as no-ops or refused with
what to do instead, and the model directory's generation_config.json and chat template."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from kvserve.cli import build_parser, main
from kvserve.flags import CLIError, engine_args
from kvserve.server.cli_serve import build_state

from .helpers import LiveServer, tiny_model_dir, wait_for


def serve_state(model: str, *flags: str):
    """``kvserve serve MODEL FLAGS``'s server state, its engine on a thread of this process
    (random weights: the model directory's shapes and tokenizer)."""
    return build_state(build_parser().parse_args(
        ["serve", model, "--load-format", "dummy", "--max-model-len", "256",
         "--num-kv-blocks", "32", "--no-engine-process", *flags]))


@pytest.fixture
def model_dir(tmp_path):
    return tiny_model_dir(tmp_path / "tiny")


def test_vllm_api_key_in_the_environment_is_an_operator_key(model_dir, monkeypatch, caplog):
    """SECURITY (QA): VLLM_API_KEY=secret served with no authentication. As vLLM: without
    --api-key it is the key; the log says where the key came from, never the key."""
    monkeypatch.setenv("VLLM_API_KEY", "s3cret-env-key")
    with caplog.at_level(logging.INFO, logger="kvserve"):
        state = serve_state(model_dir)
    assert [(k.key, k.tenant, k.admin) for k in state.keys.keys] == \
        [("s3cret-env-key", "operator", True)]
    assert "an operator key from VLLM_API_KEY" in caplog.text
    assert "s3cret-env-key" not in caplog.text
    with LiveServer(state=state) as live:
        url = live.url + "/v1/models"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer s3cret-env-key"}
                         ).status_code == 200


def test_api_key_flag_wins_over_vllm_api_key(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    state = serve_state(model_dir, "--api-key", "from-flag")
    assert [k.key for k in state.keys.keys] == ["from-flag"]
    monkeypatch.setenv("VLLM_API_KEY", "")  # empty: no key, as vLLM
    assert not serve_state(model_dir).keys.enabled


def test_a_bad_vllm_api_key_is_one_line_that_does_not_show_it(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_API_KEY", "two words")
    assert main(["serve", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert err == ("kvserve serve: error: VLLM_API_KEY: a key must be a non-empty string "
                   "of printable ASCII without spaces (it travels in an HTTP header)\n")


def test_several_api_keys_after_one_flag_and_repeated():
    args = build_parser().parse_args(["serve", "--api-key", "k1", "k2", "--api-key", "k3"])
    assert args.api_key == ["k1", "k2", "k3"] and args.model is None


def test_several_served_model_names_all_accepted_the_first_reported(model_dir):
    """vLLM's nargs='+': the second name was read as the model path (QA). Every name is a
    request's model; the first is the responses' and the metrics'; /v1/models lists them
    all, the first first, as vLLM's does; an answer carries the name it was asked by
    (vLLM's _get_model_name)."""
    state = serve_state(model_dir, "--served-model-name", "alpha", "beta")
    assert (state.model_name, state.model_names) == ("alpha", ("alpha", "beta"))
    with LiveServer(state=state) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["alpha", "beta"]
        assert client.models.retrieve("beta").id == "beta"
        for name in ("alpha", "beta"):
            reply = client.completions.create(model=name, prompt="hi", max_tokens=2)
            assert reply.model == name
        unnamed = httpx.post(live.url + "/v1/completions", json={"prompt": "hi",
                                                                  "max_tokens": 1})
        assert unnamed.json()["model"] == "alpha"
        with pytest.raises(openai.NotFoundError, match="this server serves 'alpha', 'beta'"):
            client.completions.create(model="gamma", prompt="hi", max_tokens=2)
        metrics = httpx.get(live.url + "/metrics").text
        assert 'vllm:num_requests_running{engine="0",model_name="alpha"}' in metrics
        assert 'model_name="beta"' not in metrics


def test_the_model_as_given_is_accepted_as_vllm_serves_it(model_dir):
    """vLLM serves a model under the path as given; kvserve lists its short name, and took
    the path as an unknown model (404) from a client moved from vLLM."""
    state = serve_state(model_dir)
    assert state.model_aliases == (model_dir,) and model_dir not in state.model_names
    with LiveServer(state=state) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == [state.model_name]
        reply = client.completions.create(model=model_dir, prompt="hi", max_tokens=2)
        assert reply.model == model_dir  # the name it was asked by, as vLLM's (QA)
        chunks = list(client.completions.create(model=model_dir, prompt="hi", max_tokens=2,
                                                stream=True))
        assert {chunk.model for chunk in chunks} == {model_dir}
        short = client.completions.create(model=state.model_name, prompt="hi", max_tokens=2)
        assert short.model == state.model_name
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=model_dir + "x", prompt="hi", max_tokens=2)
    assert serve_state(model_dir, "--served-model-name", "alpha").model_aliases == ()


@pytest.mark.parametrize("flag", ["--served-model-name", "--api-key"])
def test_a_model_path_read_as_a_flag_s_value_is_refused_with_the_order_that_works(
        model_dir, capsys, flag):
    """Both take every word after them, so `--api-key KEY MODEL` (one key, then the model,
    as before several values were taken) would serve the bundled model: refused."""
    assert main(["serve", flag, "a", model_dir]) == 2
    err = capsys.readouterr().err
    assert err == (f"kvserve serve: error: {flag} took {model_dir!r}, which is a model on "
                   f"disk: {flag} takes every word after it, so give the model first "
                   f"(kvserve serve {model_dir} {flag} ...)\n")
    state = serve_state(model_dir, flag, "a", "b")  # the model first: both values are the flag's
    assert (state.model_names, [k.key for k in state.keys.keys]) == \
        ((("a", "b"), []) if flag == "--served-model-name" else (("tiny",), ["a", "b"]))


@pytest.mark.parametrize(("flag", "value"), [
    ("--served-model-name", "/models/typo.gguf"), ("--api-key", "models/typo.GGUF"),
    ("--served-model-name", "./models/llama-typo"), ("--served-model-name", "~/llama"),
    ("--served-model-name", "..")])
def test_a_mistyped_model_path_read_as_a_flag_s_value_is_refused(capsys, flag, value):
    """The docs check: a model path that does not exist, swallowed by the flag, served the
    bundled model under that name; only one on disk was refused."""
    assert main(["serve", flag, "a", value]) == 2
    err = capsys.readouterr().err
    assert err == (f"kvserve serve: error: {flag} took {value!r}, which looks like a model "
                   f"path: {flag} takes every word after it, so give the model first "
                   f"(kvserve serve {value} {flag} ...)\n")


def test_a_served_name_in_a_hub_s_org_slash_model_form_is_a_name():
    """vLLM's usual served names (``org/model``) are not taken for paths."""
    from kvserve.server.cli_serve import _check_model_not_swallowed

    args = build_parser().parse_args(
        ["serve", "--served-model-name", "HuggingFaceTB/SmolLM2-135M", "smol"])
    _check_model_not_swallowed(args)  # raises CLIError for a path
    assert args.model is None and args.served_model_name == ["HuggingFaceTB/SmolLM2-135M",
                                                             "smol"]


def test_model_flag_is_the_positional_model_with_a_warning(model_dir, caplog):
    """vLLM still takes --model (deprecated) beside the positional model (QA: refused)."""
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        state = build_state(build_parser().parse_args(
            ["serve", "--model", model_dir, "--load-format", "dummy", "--max-model-len",
             "256", "--num-kv-blocks", "32", "--no-engine-process"]))
    assert (state.model_name, state.engine.info.max_model_len) == ("tiny", 256)
    assert f"--model is deprecated, as in vLLM: give the model as the positional argument " \
           f"(kvserve serve {model_dir} ...)" in caplog.text
    assert serve_state(model_dir, "--model", model_dir).model_name == "tiny"  # both agree
    # one directory however spelled (QA: "m" and "m/" were refused as two models)
    assert serve_state(model_dir, "--model", model_dir + "/").model_name == "tiny"


def test_model_given_twice_differently_is_one_line(capsys):
    assert main(["serve", "/models/a.gguf", "--model", "/models/b.gguf"]) == 2
    assert capsys.readouterr().err == ("kvserve serve: error: the model is given twice, "
                                       "/models/a.gguf and --model /models/b.gguf: give one "
                                       "(as the positional argument)\n")
    # before the unit check (QA: "--model a b" said "b" looked like a size's unit)
    assert main(["serve", "--model", "a", "b"]) == 2
    assert "the model is given twice, b and --model a" in capsys.readouterr().err


def test_vllm_cpu_kvcache_space_sizes_the_kv_cache_unless_a_flag_does(model_dir, monkeypatch,
                                                                       caplog):
    """vLLM's CPU KV cache size, GiB: the TINY model's KV block is 2 x 2 layers x 16 tokens
    x 2 heads x 16 x 4 bytes = 8 KiB, so 0.001 GiB (1,073,741 bytes) holds 131 of them."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.001")
    argv = ["serve", model_dir, "--load-format", "dummy", "--max-model-len", "256",
            "--no-engine-process"]
    with caplog.at_level(logging.INFO, logger="kvserve"):
        state = build_state(build_parser().parse_args(argv))
    assert state.engine.info.num_kv_blocks == 131
    assert "KV cache memory: 0.001 GiB from VLLM_CPU_KVCACHE_SPACE (neither " \
           "--kv-cache-memory nor --num-kv-blocks given)" in caplog.text
    state = build_state(build_parser().parse_args([*argv, "--kv-cache-memory", "256KiB"]))
    assert state.engine.info.num_kv_blocks == 32  # the flag wins
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # vLLM's "not set": kvserve's default
    assert "kv_cache_memory" not in engine_args(build_parser().parse_args(argv))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert engine_args(build_parser().parse_args(argv))["kv_cache_memory"] == 2 << 30
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "512KiB")  # QA: logged "512KiB GiB"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvserve"):
        assert engine_args(build_parser().parse_args(argv))["kv_cache_memory"] == 512 << 10
    assert "KV cache memory: 512KiB from VLLM_CPU_KVCACHE_SPACE" in caplog.text


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("VLLM_CPU_KVCACHE_SPACE", "lots", "VLLM_CPU_KVCACHE_SPACE 'lots': give the KV cache's "
                                       "size in GiB, like 4"),
    ("VLLM_CPU_KVCACHE_SPACE", "-1", "VLLM_CPU_KVCACHE_SPACE '-1': give the KV cache's "),
    ("VLLM_LOGGING_LEVEL", "loud", "VLLM_LOGGING_LEVEL 'loud': give one of DEBUG, INFO, "
                                   "WARNING, ERROR, CRITICAL"),
    ("VLLM_CONFIGURE_LOGGING", "yes", "VLLM_CONFIGURE_LOGGING 'yes': give 1 (kvserve "
                                      "configures its log, the default) or 0"),
])
def test_a_bad_vllm_variable_is_one_line(monkeypatch, capsys, variable, value, message):
    monkeypatch.setenv(variable, value)
    assert main(["serve", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvserve serve: error: {message}") and err.count("\n") == 1, err


LOGGING_PROBE = """
from kvserve.flags import configure_logging
import logging
configure_logging("%(levelname)s %(name)s: %(message)s")
logging.getLogger("kvserve.server").debug("kvserve debug")
logging.getLogger("kvserve.server").info("kvserve info")
logging.getLogger("kvserve.server").warning("kvserve warning")
logging.getLogger("other").info("other info")
"""


@pytest.mark.parametrize(("environment", "lines"), [
    ({}, ["INFO kvserve.server: kvserve info", "WARNING kvserve.server: kvserve warning",
          "INFO other: other info"]),
    ({"VLLM_LOGGING_LEVEL": "debug"},
     ["DEBUG kvserve.server: kvserve debug", "INFO kvserve.server: kvserve info",
      "WARNING kvserve.server: kvserve warning", "INFO other: other info"]),
    ({"VLLM_LOGGING_LEVEL": "WARNING"},
     ["WARNING kvserve.server: kvserve warning", "INFO other: other info"]),
    # nothing configured: Python's last resort prints warnings alone, bare
    ({"VLLM_CONFIGURE_LOGGING": "0", "VLLM_LOGGING_LEVEL": "DEBUG"}, ["kvserve warning"]),
])
def test_vllm_logging_variables(environment, lines):
    """VLLM_LOGGING_LEVEL sets kvserve's loggers' level (not other libraries'); with
    VLLM_CONFIGURE_LOGGING=0 kvserve configures nothing, as vLLM."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    result = subprocess.run([sys.executable, "-c", LOGGING_PROBE], capture_output=True,
                            text=True, env={**env, **environment}, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == lines


ROLES = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def chat_prompt_ids(live, content: str = "hi") -> list[int]:
    """The ids /v1/chat/completions would queue for one user message (vLLM's /tokenize)."""
    reply = httpx.post(live.url + "/tokenize",
                       json={"messages": [{"role": "user", "content": content}]})
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def test_a_model_directory_s_chat_template_jinja_serves_chat(tmp_path):
    """QA: chat answered 400 "this tokenizer has no chat template" for a directory whose
    template is chat_template.jinja (newer transformers write it there)."""
    from .helpers import tokenizer

    state = serve_state(tiny_model_dir(tmp_path / "m", chat_template=ROLES))
    with LiveServer(state=state) as live:
        assert chat_prompt_ids(live) == tokenizer().encode("<user>hi")
        reply = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0) \
            .chat.completions.create(model="m", max_tokens=2,
                                     messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.prompt_tokens == len(tokenizer().encode("<user>hi"))


def test_a_model_without_a_chat_template_is_said_at_boot(tmp_path, caplog):
    """QA (prompts pass): a model without a template booted without a word, and its first
    chat was a 400; the boot log says so now (completions still serve)."""
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        serve_state(tiny_model_dir(tmp_path / "bare"))
    assert "the model has no chat template: chat completions, the Responses API and " \
           "/tokenize of messages answer 400 (give one with --chat-template FILE)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        serve_state(tiny_model_dir(tmp_path / "m", chat_template=ROLES))
    assert "no chat template" not in caplog.text


@pytest.mark.parametrize("form", ["file", "text"])
def test_chat_template_flag_replaces_the_model_s(tmp_path, form, caplog):
    from .helpers import tokenizer

    model = tiny_model_dir(tmp_path / "m", chat_template=ROLES)
    mine = "{{ '[' + messages[0]['content'] + ']' }}"
    if form == "file":
        (tmp_path / "mine.jinja").write_text(mine)
        mine = str(tmp_path / "mine.jinja")
    with caplog.at_level(logging.INFO, logger="kvserve"):
        state = serve_state(model, "--chat-template", mine)
    assert "chat template: --chat-template's, in place of the model's" in caplog.text
    with LiveServer(state=state) as live:
        assert chat_prompt_ids(live) == tokenizer().encode("[hi]")


@pytest.mark.parametrize(("value", "message"), [
    ("no/such/template.jinja", "--chat-template 'no/such/template.jinja': no such file, and "
                               "not a template (a Jinja template holds {{ or {%)"),
    ("{% for %}", "--chat-template: the chat template is not valid Jinja: "),
])
def test_a_bad_chat_template_is_one_line_before_the_model_loads(capsys, value, message):
    assert main(["serve", "/nonexistent/model", "--chat-template", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvserve serve: error: {message}") and err.count("\n") == 1, err


def test_a_broken_model_chat_template_is_one_line_before_the_model_loads(tmp_path, capsys):
    """A model directory's chat_template.jinja that is not Jinja made every chat a 500 with
    a traceback (QA); now serve refuses it at start, naming it and the way out."""
    model = tiny_model_dir(tmp_path / "m", chat_template="{% for m in messages %}{{ m }")
    assert main(["serve", model, "--load-format", "dummy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve serve: error: the model's chat template is not valid "
                          "Jinja: ") and "give one that is with --chat-template FILE" in err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize("template", [42, {"default": "x"}, ["{{ 'x' }}"]])
def test_a_chat_template_of_another_type_is_one_line_naming_the_file(tmp_path, capsys,
                                                                     template):
    """The model pass: a tokenizer_config.json chat_template that was a number, an object
    or a list of strings ended serve in a traceback (jinja's, lru_cache's, an .get on str)."""
    model = tiny_model_dir(tmp_path / "m", tokenizer_config={"chat_template": template})
    assert main(["serve", model, "--load-format", "dummy"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer_config.json: chat_template must be a string or a list of " in err, err
    assert err.count("\n") == 1, err
    named = tiny_model_dir(tmp_path / "n", tokenizer_config={"chat_template": [
        {"name": "tool_use", "template": "t"}, {"name": "default", "template": "{{ 'd' }}"}]})
    from kvserve.model.tokenizer import Tokenizer
    assert Tokenizer.from_file(f"{named}/tokenizer.json").chat_template == "{{ 'd' }}"


GENERATION_CONFIG = {"eos_token_id": 2, "temperature": 0.25, "top_p": 0.5, "top_k": 7,
                     "min_p": 0.05, "repetition_penalty": 1.2, "max_new_tokens": 5}


def test_sampling_params_take_the_defaults_a_request_leaves_unset():
    from kvserve.server.prompts import sampling_params
    from kvserve.server.protocol import ChatCompletionRequest, parse_body

    defaults = {"temperature": 0.25, "top_p": 0.5, "top_k": 7, "min_p": 0.05,
                "repetition_penalty": 1.2, "max_tokens": 5}
    req = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                             "temperature": 0.9, "top_k": -1})
    params = sampling_params(req, True, 5, 0, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p,
            params.repetition_penalty) == (0.9, 0.5, -1, 0.05, 1.2)
    plain = sampling_params(req, True, 5, 0)  # no generation config: SamplingParams' own
    assert (plain.top_p, plain.min_p, plain.repetition_penalty) == (1.0, 0.0, 1.0)


def test_the_model_s_generation_config_gives_its_sampling_defaults(tmp_path, caplog):
    """vLLM's --generation-config auto (its default): the directory's generation_config.json
    gives the requests that do not set them their sampling fields and, from max_new_tokens,
    their max_tokens; the boot log names them. kvserve never read it (QA)."""
    model = tiny_model_dir(tmp_path / "m", generation_config=GENERATION_CONFIG,
                           chat_template=ROLES)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        state = serve_state(model, "--enable-log-requests")
        assert state.sampling_defaults == {"temperature": 0.25, "top_p": 0.5, "top_k": 7,
                                           "min_p": 0.05, "repetition_penalty": 1.2,
                                           "max_tokens": 5}
        assert "sampling defaults from the model's generation_config.json, for the requests " \
               "that do not set them: temperature=0.25, top_p=0.5, top_k=7, min_p=0.05, " \
               "repetition_penalty=1.2, max_tokens=5 (--generation-config vllm: none)" \
               in caplog.text
        with LiveServer(state=state) as live:
            url = live.url + "/v1/chat/completions"
            hi = [{"role": "user", "content": "hi"}]
            reply = httpx.post(url, json={"messages": hi, "ignore_eos": True}).json()
            assert reply["usage"]["completion_tokens"] == 5
            reply = httpx.post(url, json={"messages": hi, "ignore_eos": True, "max_tokens": 9,
                                          "temperature": 0.75}).json()
            assert reply["usage"]["completion_tokens"] == 9  # the request's own go first
            # a completion's default stays OpenAI's 16, as vLLM's completions request has
            # it as its own default (QA: the config's max_new_tokens was taken)
            reply = httpx.post(live.url + "/v1/completions",
                               json={"prompt": "hi", "ignore_eos": True}).json()
            assert reply["usage"]["completion_tokens"] == 16
    queued = [r.getMessage() for r in caplog.records if " queued: " in r.getMessage()]
    assert [line.split(", sequences 1, ")[1].rsplit(", seed", 1)[0] for line in queued] == [
        "max_tokens 5, temperature 0.25, top_p 0.5, top_k 7",
        "max_tokens 9, temperature 0.75, top_p 0.5, top_k 7",
        "max_tokens 16, temperature 0.25, top_p 0.5, top_k 7"]


def test_generation_config_vllm_ignores_the_file_and_an_override_extends_it(tmp_path):
    model = tiny_model_dir(tmp_path / "m", generation_config=GENERATION_CONFIG)
    assert serve_state(model, "--generation-config", "vllm").sampling_defaults == {}
    state = serve_state(model, "--override-generation-config",
                        '{"temperature": 0.5, "max_new_tokens": 3}')
    assert (state.sampling_defaults["temperature"], state.sampling_defaults["max_tokens"],
            state.sampling_defaults["top_k"]) == (0.5, 3, 7)
    state = serve_state(model, "--generation-config", "vllm", "--override-generation-config",
                        '{"temperature": 0.5}')
    assert state.sampling_defaults == {"temperature": 0.5}


def test_an_override_or_a_directory_s_max_new_tokens_caps_every_request(tmp_path):
    """vLLM's override_max_tokens: max_new_tokens from --override-generation-config or
    --generation-config DIR caps a request's own max_tokens and a completion's 16 (QA: a
    completion took 16 where vLLM gives 3); from the model's own file it is chat's default
    only (the test above: a request's 9 stands)."""
    model = tiny_model_dir(tmp_path / "m", generation_config=GENERATION_CONFIG,
                           chat_template=ROLES)
    assert serve_state(model).max_tokens_cap is None
    assert serve_state(model, "--generation-config", str(model)).max_tokens_cap == 5
    state = serve_state(model, "--override-generation-config", '{"max_new_tokens": 3}')
    assert state.max_tokens_cap == 3
    with LiveServer(state=state) as live:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/completions", {"prompt": "hi", "max_tokens": 9}),
                           ("/v1/chat/completions", {"messages": [
                               {"role": "user", "content": "hi"}], "max_tokens": 9})):
            reply = httpx.post(live.url + path, json={**body, "ignore_eos": True}).json()
            assert reply["usage"]["completion_tokens"] == 3, (path, body)


def test_the_bundled_model_has_no_generation_config():
    """A GGUF carries no generation_config.json: its defaults are unchanged."""
    from kvserve.server.cli_serve import _sampling_defaults

    assert _sampling_defaults(build_parser().parse_args(["serve"])) == {}


@pytest.mark.parametrize(("flags", "message"), [
    (["--override-generation-config", "[1]"], "argument --override-generation-config: '[1]' "
                                              "is not a JSON object"),
    (["--override-generation-config", '{"do_sample": false}'],
     "override generation config: 'do_sample' is not a sampling default"),
    (["--generation-config", "/no/such/dir"], "generation config '/no/such/dir': give auto, "
                                              "vllm or a directory"),
    (["--response-role", " "], "--response-role must not be empty"),
])
def test_bad_sampling_default_flags_are_one_line(capsys, flags, message):
    assert exit_code(["serve", "/nonexistent/model", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def exit_code(argv: list[str]) -> int:
    """``kvserve ARGV``'s exit code, a usage error's (argparse exits) or the command's."""
    try:
        return main(argv)
    except SystemExit as exit:
        return int(exit.code or 0)


def test_the_offline_llm_s_default_sampling_params_are_the_generation_config_s(tmp_path):
    from kvserve.core import SamplingParams
    from kvserve.engine.llm import LLM

    model = tiny_model_dir(tmp_path / "m", generation_config={"temperature": 0,
                                                               "max_new_tokens": 3})
    llm = LLM(model, load_format="dummy", num_kv_blocks=32, max_model_len=256)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0, max_tokens=3)
    [default] = llm.generate("Hello", use_tqdm=False)
    [explicit] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3),
                              use_tqdm=False)
    assert default.token_ids == explicit.token_ids
    plain = LLM(model, load_format="dummy", num_kv_blocks=32, max_model_len=256,
                generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_response_role_names_a_chat_answer_s_role(model_dir):
    state = serve_state(model_dir, "--response-role", "bot", "--chat-template", ROLES)
    with LiveServer(state=state) as live:
        url = live.url + "/v1/chat/completions"
        hi = [{"role": "user", "content": "hi"}]
        reply = httpx.post(url, json={"messages": hi, "max_tokens": 2}).json()
        assert reply["choices"][0]["message"]["role"] == "bot"
        with httpx.stream("POST", url, json={"messages": hi, "max_tokens": 2,
                                             "stream": True}) as events:
            first = next(line for line in events.iter_lines() if line)
        assert '"delta":{"role":"bot","content":""}' in first.replace(" ", "")


def test_max_logprobs_bounds_what_a_request_may_ask(model_dir):
    """vLLM's --max-logprobs (default 20, OpenAI's limit): beyond it a 400 naming the limit;
    above 20 the answers carry as many as asked."""
    state = serve_state(model_dir, "--max-logprobs", "30", "--chat-template", ROLES)
    assert state.max_logprobs == 30
    with LiveServer(state=state) as live:
        reply = httpx.post(live.url + "/v1/completions", json={
            "prompt": "hello there", "max_tokens": 1, "logprobs": 25, "prompt_logprobs": 30})
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert len(choice["logprobs"]["top_logprobs"][0]) in (25, 26)  # + the sampled one
        assert len(choice["prompt_logprobs"][1]) in (30, 31)  # + the prompt's own token
        chat = httpx.post(live.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "logprobs": True, "top_logprobs": 31})
        assert chat.status_code == 400
        assert chat.json()["error"]["message"] == (
            "'top_logprobs' is 31, more than this server gives: at most 30 (--max-logprobs)")
        assert chat.json()["error"]["param"] == "top_logprobs"
    assert serve_state(model_dir, "--max-logprobs", "-1").max_logprobs == 49152  # vocabulary


def test_minus_one_logprobs_are_the_whole_vocabulary_within_max_logprobs(model_dir):
    """vLLM's servers take -1 for logprobs, top_logprobs and prompt_logprobs: the whole
    vocabulary, which --max-logprobs must allow (-1 there too); else a 400 naming both."""
    with LiveServer(state=serve_state(model_dir)) as live:
        reply = httpx.post(live.url + "/v1/completions", json={
            "prompt": "hello there", "max_tokens": 1, "prompt_logprobs": -1})
        assert reply.status_code == 400
        assert reply.json()["error"]["message"] == (
            "'prompt_logprobs' is -1 (-1: the whole vocabulary, 49152), more than this server "
            "gives: at most 20 (--max-logprobs)")
    with LiveServer(state=serve_state(model_dir, "--max-logprobs", "-1", "--chat-template",
                                      ROLES)) as live:
        reply = httpx.post(live.url + "/v1/completions", json={
            "prompt": "hello there", "max_tokens": 1, "prompt_logprobs": -1, "logprobs": -1})
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert len(choice["prompt_logprobs"][1]) == 49152
        assert len(choice["logprobs"]["top_logprobs"][0]) == 49152
        chat = httpx.post(live.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "logprobs": True, "top_logprobs": -1})
        assert chat.status_code == 200, chat.text
        assert len(chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 49152


def test_the_engine_refuses_more_logprobs_than_its_max_logprobs(model_dir):
    from kvserve.core import SamplingParams
    from kvserve.engine.llm import LLM

    llm = LLM(model_dir, load_format="dummy", num_kv_blocks=32, max_model_len=256)
    with pytest.raises(ValueError, match=r"logprobs 21 is more than this engine gives "
                                         r"\(max_logprobs 20\)"):
        llm.generate("hi", SamplingParams(max_tokens=1, logprobs=21), use_tqdm=False)
    wide = LLM(model_dir, load_format="dummy", num_kv_blocks=32, max_model_len=256,
               max_logprobs=40)
    [result] = wide.generate("hi", SamplingParams(max_tokens=1, logprobs=40), use_tqdm=False)
    assert len(result.logprobs[0]) in (40, 41)


class UvicornServer:
    """``kvserve serve``'s uvicorn configuration (uvicorn_config: root path, TLS) around a
    built state, on a free 127.0.0.1 port on a thread."""

    def __init__(self, state, *flags: str) -> None:
        import socket
        import threading

        import uvicorn

        from kvserve.server.app import build_app
        from kvserve.server.cli_serve import uvicorn_config

        args = build_parser().parse_args(["serve", "--uvicorn-log-level", "warning", *flags])
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(build_app(state), args))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), what="uvicorn")
        assert self.server.started

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


def test_root_path_serves_behind_a_proxy_that_strips_it(model_dir):
    """vLLM's --root-path (uvicorn's root_path): the proxy strips the prefix, so the API is
    served without it, and what the server names carries it."""
    with UvicornServer(serve_state(model_dir), "--root-path", "/llm") as live:
        base = f"http://127.0.0.1:{live.port}"
        assert httpx.get(base + "/health").status_code == 200
        missing = httpx.get(base + "/nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "GET /llm/nope: not found"


def test_ssl_files_serve_https(model_dir, tmp_path):
    """--ssl-keyfile / --ssl-certfile: uvicorn's TLS, with a self-signed certificate."""
    cryptography = pytest.importorskip("cryptography")
    del cryptography
    key_file, cert_file = self_signed(tmp_path)
    flags = ("--ssl-keyfile", key_file, "--ssl-certfile", cert_file)
    state = serve_state(model_dir, *flags)  # the files are checked there
    with UvicornServer(state, *flags) as live:
        reply = httpx.get(f"https://127.0.0.1:{live.port}/health", verify=cert_file)
        assert reply.status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{live.port}/health")


def self_signed(folder) -> tuple[str, str]:
    """A key and a self-signed certificate for 127.0.0.1, made with cryptography."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_file, cert_file = folder / "key.pem", folder / "cert.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_file), str(cert_file)


@pytest.mark.parametrize(("flags", "message"), [
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-certfile", "/no/such/cert.pem"], "--ssl-certfile /no/such/cert.pem: no such file"),
    (["--ssl-certfile", "NOTPEM"], "--ssl-certfile NOTPEM: cannot load the certificate and key"),
    (["--root-path", "llm"], "--root-path 'llm': a path starts with /"),
])
def test_bad_server_flags_are_one_line_before_the_model_loads(tmp_path, capsys, flags,
                                                              message):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    argv = [str(garbage) if part == "NOTPEM" else part for part in flags]
    assert main(["serve", "/nonexistent/model", *argv]) == 2
    err = capsys.readouterr().err.replace(str(garbage), "NOTPEM")
    assert err.startswith(f"kvserve serve: error: {message}") and err.count("\n") == 1, err


def test_max_log_len_is_taken_and_changes_nothing(caplog):
    from kvserve.server.cli_serve import _vllm_noops

    args = build_parser().parse_args(["serve", "--max-log-len", "100"])
    assert args.max_log_len == 100
    caplog.set_level(logging.INFO, logger="kvserve.server")
    _vllm_noops(args)  # says so in one line, as every no-op does (QA: it said nothing)
    assert [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("--max-log-len 100: vLLM's, does nothing here")]


@pytest.mark.parametrize(("flags", "line"), [
    # the value is named with its flag, never left over as the model path (QA)
    (["--gpu-memory-utilization", "0.9", "/models/m.gguf"],
     "vLLM's --gpu-memory-utilization 0.9 is not taken here: the KV cache is sized by "
     "--kv-cache-memory (e.g. 4GiB) or --num-kv-blocks (see kvserve serve --help)"),
    (["--enable-lora", "--lora-modules", "sql=/lora/sql"],
     "vLLM's --enable-lora is not taken here: there are no LoRA adapters: serve a model "
     "directory with the adapter merged"),
    (["--lora_modules", "sql=/lora/sql"], "vLLM's --lora-modules sql=/lora/sql is not taken "
                                          "here: there are no LoRA adapters"),
    (["--middleware", "my.Middleware"], "vLLM's --middleware my.Middleware is not taken "
                                        "here: no ASGI middleware is loaded from the command "
                                        "line"),
    (["--limit-mm-per-prompt", "image=2"], "vLLM's --limit-mm-per-prompt image=2 is not taken "
                                           "here: there is no multimodal input: text models "
                                           "only"),
    (["-tp", "2"], "vLLM's --tensor-parallel-size 2 is not taken here: there is no tensor "
                   "parallelism; --data-parallel-size runs replicas"),
    (["--pipeline-parallel-size", "4"], "vLLM's --pipeline-parallel-size 4 is not taken "
                                        "here: there is no pipeline parallelism"),
    (["--kv-cache-dtype", "fp8"], "vLLM's --kv-cache-dtype fp8 is not taken here: the "
                                  "engine's KV cache is in the model's dtype (--dtype); "
                                  "kvserve simulate --kv-cache-dtype models an fp8 one"),
    (["--logprobs-mode", "processed_logprobs"], "vLLM's --logprobs-mode processed_logprobs is "
                                                "not taken here: logprobs are the model's own "
                                                "distribution (raw_logprobs)"),
    (["--tokenizer-mode", "mistral"], "vLLM's --tokenizer-mode mistral is not taken here: the "
                                      "tokenizer is the model's own"),
    # the model pass: "unrecognized arguments", no hint (vLLM's GGUF guide passes it)
    (["--tokenizer", "/base/model"], "vLLM's --tokenizer /base/model is not taken here: the "
                                     "tokenizer is the model's own: a GGUF file carries its "
                                     "vocabulary"),
    (["-q", "awq"], "argument --quantization/-q: 'awq' is not supported here: --quantization "
                    "int8 quantizes the projections at load (dynamic W8A8, "
                    "docs/quantization.md); a checkpoint quantized ahead (awq, gptq, fp8, "
                    "...) cannot be loaded: serve its float weights"),
])
def test_vllm_flags_refused_say_what_to_do_instead(capsys, flags, line):
    assert exit_code(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvserve serve: error: {line}") and err.count("\n") == 1, err


def test_vllm_flags_with_nothing_to_do_here_are_taken_and_each_says_why(model_dir, caplog):
    flags = ["--trust-remote-code", "--tokenizer-mode", "auto", "--enforce-eager",
             "--max-seq-len-to-capture", "8192", "-O3", "--disable-custom-all-reduce",
             "-tp", "1", "--pipeline-parallel-size", "1",
             "--disable-frontend-multiprocessing", "--download-dir", "/cache",
             "--revision", "main", "--kv-cache-dtype", "auto", "--disable-log-requests"]
    with caplog.at_level(logging.INFO, logger="kvserve"):
        state = serve_state(model_dir, *flags)
    assert state.model_name == "tiny"
    said = [r.getMessage() for r in caplog.records if ": vLLM's, does nothing here: " in
            r.getMessage()]
    assert said == [
        "--trust-remote-code: vLLM's, does nothing here: no model code is run: kvserve "
        "implements the Llama family itself",
        "--tokenizer-mode auto: vLLM's, does nothing here: the tokenizer is the model's own "
        "(auto is the only mode)",
        "--enforce-eager: vLLM's, does nothing here: there are no CUDA graphs or "
        "torch.compile here: every step runs eagerly",
        "--max-seq-len-to-capture 8192: vLLM's, does nothing here: there are no CUDA graphs "
        "or torch.compile here: every step runs eagerly",
        "--compilation-config 3: vLLM's, does nothing here: there are no CUDA graphs or "
        "torch.compile here: every step runs eagerly",
        "--disable-custom-all-reduce: vLLM's, does nothing here: there is no tensor "
        "parallelism, so no all-reduce",
        "--tensor-parallel-size 1: vLLM's, does nothing here: one engine holds the whole "
        "model (--data-parallel-size runs replicas)",
        "--pipeline-parallel-size 1: vLLM's, does nothing here: one engine holds the whole "
        "model (--data-parallel-size runs replicas)",
        "--disable-frontend-multiprocessing: vLLM's, does nothing here: the API server "
        "already runs in one process, as vLLM V1's, and the engine in its own "
        "(--no-engine-process runs it on a thread instead)",
        "--download-dir /cache: vLLM's, does nothing here: nothing is downloaded: the model "
        "is a path",
        "--revision main: vLLM's, does nothing here: nothing is downloaded: the model is a "
        "path",
        "--kv-cache-dtype auto: vLLM's, does nothing here: the KV cache is in the model's "
        "dtype (--dtype), as auto asks"]


def test_a_command_that_defines_a_vllm_flag_takes_it():
    """simulate models --gpu-memory-utilization and --tensor-parallel-size: not refused."""
    args = build_parser().parse_args(["simulate", "--trace", "t.jsonl",
                                      "--gpu-memory-utilization", "0.8",
                                      "--tensor-parallel-size", "2"])
    assert (args.gpu_memory_utilization, args.tensor_parallel_size) == (0.8, 2)


@pytest.mark.parametrize(("flags", "parser"), [
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "HermesParser"),
    (["--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"], "Llama3JsonParser"),
    ([], None)])
def test_auto_tool_choice_flags_set_the_parser(model_dir, flags, parser):
    state = serve_state(model_dir, *flags)
    assert (type(state.tool_parser).__name__ if state.tool_parser else None) == parser


def test_auto_tool_choice_without_a_parser_is_one_line(capsys):
    assert main(["serve", "--load-format", "dummy", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


def test_a_parser_alone_is_taken_as_vllm_takes_it(model_dir, caplog):
    """QA: vLLM starts with --tool-call-parser alone (auto stays off)."""
    state = serve_state(model_dir, "--tool-call-parser", "hermes")
    assert state.tool_parser is None and "auto stays refused" in caplog.text


def test_a_text_prompt_gets_the_tokenizers_bos_by_default_as_vllms():
    """vLLM's add_special_tokens is true for a text prompt (completions, /tokenize, the
    offline API): a Llama's BOS went missing here (QA: false by default)."""
    from tokenizers import processors

    from kvserve.engine.engine import encode_prompt
    from kvserve.engine.llm import build_engine
    from kvserve.model.tokenizer import load_tokenizer

    from .helpers import TINY, LiveServer

    own = load_tokenizer(None)
    bos = own.bos_token_id
    bos_text = own._tokenizer.id_to_token(bos)
    own._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos_text} $A", special_tokens=[(bos_text, bos)])
    bare = own.encode("hello there")
    assert encode_prompt(own, "hello there") == [bos, *bare]  # LLM.generate's
    engine = build_engine(TINY, tokenizer=own, num_kv_blocks=64, max_model_len=256)
    with LiveServer(engine) as live:
        def prompt_tokens(**fields: object) -> int:
            reply = httpx.post(live.url + "/v1/completions", timeout=60, json={
                "prompt": "hello there", "max_tokens": 1, **fields})
            return reply.json()["usage"]["prompt_tokens"]

        assert prompt_tokens() == len(bare) + 1
        assert prompt_tokens(add_special_tokens=False) == len(bare)
        # truncate_prompt_tokens keeps the BOS, as vLLM's tokenizer truncates (QA: cut off)
        cut = httpx.post(live.url + "/v1/completions", timeout=60, json={
            "prompt": "hello there", "max_tokens": 1, "truncate_prompt_tokens": 2,
            "return_token_ids": True}).json()
        assert cut["choices"][0]["prompt_token_ids"] == [bos, bare[-1]]
        tokens = httpx.post(live.url + "/tokenize", json={"prompt": "hello there"}).json()
        assert tokens["tokens"] == [bos, *bare] and tokens["token_strs"] is None
        # vLLM's return_token_strs (QA: refused as an unknown field)
        strs = httpx.post(live.url + "/tokenize", json={"prompt": "hello there",
                                                         "return_token_strs": True}).json()
        assert strs["token_strs"] == [live.state.tokenizer.id_to_token(i)
                                      for i in strs["tokens"]]
        assert len(strs["token_strs"]) == strs["count"]


def test_invocations_answers_a_chat_or_a_completion_by_its_body():
    """vLLM's SageMaker route (QA: a 404 for a SageMaker deployment moved from vLLM)."""
    with LiveServer(max_model_len=256) as live:
        chat = httpx.post(live.url + "/invocations", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
        text = httpx.post(live.url + "/invocations", timeout=60,
                          json={"prompt": "hi", "max_tokens": 2, "stream": True})
        assert text.status_code == 200 and text.text.rstrip().endswith("data: [DONE]")
        assert '"object":"text_completion"' in text.text.replace(" ", "")
        for body in ({"input": "hi"}, {"prompt": "a", "messages": []}, [1]):
            refused = httpx.post(live.url + "/invocations", json=body)
            assert refused.status_code == 400 and "exactly one of them" in refused.text
        wait_for(live.idle, what="an idle server")


def test_more_vllm_flags_with_nothing_to_do_here_are_taken(model_dir, caplog):
    """QA (an operator's vLLM command lines): each was "unrecognized arguments"."""
    flags = ["--enable-request-id-headers", "--enable-server-load-tracking",
             "--enable-log-outputs", "--async-scheduling",
             "--distributed-executor-backend", "mp", "--disable-sliding-window",
             "--show-hidden-metrics-for-version", "0.9", "--cuda-graph-sizes", "1", "2",
             "--guided-decoding-backend", "xgrammar", "--api-server-count", "1"]
    with caplog.at_level(logging.INFO, logger="kvserve"):
        serve_state(model_dir, *flags)
    said = [r.getMessage().split(":")[0] for r in caplog.records
            if ": vLLM's, does nothing here: " in r.getMessage()]
    assert said == ["--enable-request-id-headers", "--enable-server-load-tracking",
                    "--enable-log-outputs", "--async-scheduling",
                    "--distributed-executor-backend mp", "--disable-sliding-window",
                    "--show-hidden-metrics-for-version 0.9", "--cuda-graph-sizes 1 2",
                    "--structured-outputs-config xgrammar", "--api-server-count 1"]
    assert exit_code(["serve", model_dir, "--api-server-count", "4"]) == 2


@pytest.mark.parametrize(("text", "count"), [
    ("2048", 2048), ("4k", 4000), ("25.6k", 25600), ("4K", 4096), ("1m", 1_000_000),
    ("2M", 2 * 1024 ** 2), (" 8k ", 8000)])
def test_token_counts_read_as_vllms_human_readable_ints(text, count):
    from kvserve.flags import parse_token_count

    assert parse_token_count(text) == count
    args = build_parser().parse_args(["serve", "--max-model-len", text,
                                      "--max-num-batched-tokens", text])
    assert args.max_model_len == args.max_num_batched_tokens == count


@pytest.mark.parametrize(("text", "needle"), [
    ("4.5K", "a binary unit (K) takes a whole number"), ("1.5", "not a whole number"),
    ("0.0001k", "not a whole number"), ("4x", "not a count of tokens"), ("", "not a count")])
def test_a_count_that_is_not_one_is_refused_by_name(capsys, text, needle):
    assert exit_code(["serve", "--max-model-len", text]) == 2
    assert needle in capsys.readouterr().err


def test_a_config_file_is_read_as_flags_and_the_command_line_wins(tmp_path, model_dir):
    """vLLM's --config: a YAML mapping of serve's flags (QA: unrecognized)."""
    from kvserve.cli import _subparser_named, with_config_file

    serve = _subparser_named(build_parser(), "serve")
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {model_dir}\nmax-model-len: 4k\nmax_num_seqs: 8\n"
                      "enable-prefix-caching: false\nserved-model-name: [a, b]\n"
                      "enable-log-requests: true\n")
    argv = with_config_file(["serve", "--config", str(config), "--max-num-seqs", "4"], serve)
    args = build_parser().parse_args(argv)
    assert (args.model, args.max_model_len, args.max_num_seqs) == (model_dir, 4000, 4)
    assert args.enable_prefix_caching is False and args.served_model_name == ["a", "b"]
    assert args.enable_log_requests is True
    own = with_config_file(["serve", "/other/model", f"--config={config}"], serve)
    assert build_parser().parse_args(own).model == "/other/model"
    # flags go before a "--" (QA: after it they were read as positionals); model: null is none
    config.write_text("model: null\nmax-num-seqs: 8\n")
    assert with_config_file(["serve", "--config", str(config), "--", "x"], serve) == \
        ["serve", "--max-num-seqs=8", "--", "x"]
    # a value that starts with "-" reaches its flag's own check (QA: "expected one argument")
    config.write_text("swap-space: -1GiB\n")
    assert with_config_file(["serve", "--config", str(config)], serve) == \
        ["serve", "--swap-space=-1GiB"]
    with pytest.raises(CLIError, match="give one --config file"):
        with_config_file(["serve", "--config", str(config), "--config", str(config)], serve)


@pytest.mark.parametrize(("text", "needle"), [
    ("max-model-len: [", "not YAML"), ("- a\n- b\n", "a mapping of flags to values"),
    ("no-such-flag: 1\n", "'no-such-flag' is not a flag of kvserve serve"),
    # QA: a quoted 'no' became "--enable-prefix-caching no", "no" the model; a list model
    ("enable-prefix-caching: 'no'\n", "enable-prefix-caching takes true or false, got 'no'"),
    ("model: [a, b]\n", "model must be a path, got ['a', 'b']"),
    # QA (CLI fuzz): a nested config ignored; a list's second value became the model; a
    # value starting with "-" read as a flag ("expected one argument")
    ("config: other.yaml\n", "'config' is not a flag of kvserve serve"),
    ("max-model-len: [4096, 8192]\n", "max-model-len takes one value, got a list"),
    # the flags pass: the command line's pointer, not "is not a flag" (a vLLM config's)
    ("gpu-memory-utilization: 0.9\n", "vLLM's --gpu-memory-utilization 0.9 is not taken "
                                       "here: the KV cache is sized by --kv-cache-memory")])
def test_a_config_file_that_cannot_be_read_is_one_line(tmp_path, capsys, text, needle):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve serve: error: --config ") and needle in err
    assert err.count("\n") == 1
    assert main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "No such file or directory" in capsys.readouterr().err


def test_usage_details_token_ids_and_load_as_vllms_flags_ask(model_dir):
    """--enable-force-include-usage, --enable-prompt-tokens-details,
    --return-tokens-as-token-ids and GET /load (QA: refused or 404)."""
    state = serve_state(model_dir, "--enable-force-include-usage",
                        "--enable-prompt-tokens-details", "--return-tokens-as-token-ids")
    with LiveServer(state=state) as live:
        body = {"prompt": "the same long prompt " * 8, "max_tokens": 2, "logprobs": 1}
        first = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
        again = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert all(t.startswith("token_id:") for t in again["choices"][0]["logprobs"]["tokens"])
        named = httpx.post(live.url + "/v1/completions", timeout=60,
                           json={**body, "return_tokens_as_token_ids": False}).json()
        assert not named["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
        with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                          json={"prompt": "hi", "max_tokens": 2, "stream": True}) as reply:
            events = [line for line in reply.iter_lines() if line.startswith("data: {")]
        assert '"usage"' in events[-1] and '"choices":[]' in events[-1].replace(" ", "")
        assert not any('"usage"' in event for event in events[:-1])
        # continuous_usage_stats is asked for under the flag, include_usage or not, as vLLM
        # reads it (the streaming pass: ignored)
        with httpx.stream("POST", live.url + "/v1/completions", timeout=60, json={
                "prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {
                    "include_usage": False, "continuous_usage_stats": True}}) as reply:
            events = [line for line in reply.iter_lines() if line.startswith("data: {")]
        assert all('"usage"' in event for event in events)
        assert httpx.get(live.url + "/load").json() == {"server_load": 0}


def test_quiet_paths_drop_their_access_lines_and_query_keys_are_masked():
    from kvserve.server.cli_serve import AccessLogFilter

    quiet = AccessLogFilter(("/health", "/metrics"))

    def line(path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:1", "GET", path, "1.1", 200), None)

    assert not quiet.filter(line("/health")) and not quiet.filter(line("/metrics?x=1"))
    assert not quiet.filter(line("/metrics/"))  # served as /metrics (the review)
    slashed = AccessLogFilter(("/metrics/",))  # given with the slash (the second review)
    assert not slashed.filter(line("/metrics")) and slashed.filter(line("/"))
    assert quiet.filter(line("/v1/models"))
    # QA (docs pass): under --root-path uvicorn's line carries the prefix, and was logged
    rooted = AccessLogFilter(("/health",), "/llm/")
    assert not rooted.filter(line("/llm/health")) and not rooted.filter(line("/health"))
    assert rooted.filter(line("/llm/v1/models"))
    # the dashboard pass: the server's own log held the operator's key from ?key=
    page = line("/dashboard/events?x=1&key=sk-op&monkey=2")
    assert AccessLogFilter(()).filter(page)
    assert page.getMessage() == ('127.0.0.1:1 - "GET /dashboard/events?x=1&key=***&monkey=2 '
                                 'HTTP/1.1" 200')
    args = build_parser().parse_args(["serve", "--disable-access-log-for-endpoints",
                                      "/health, /ping"])
    assert args.disable_access_log_for_endpoints == ("/health", "/ping")


def test_keys_vllm_always_sends_are_there_null_where_nothing_fills_them():
    """QA (vLLM compat diff): clients that index dicts (resp["system_fingerprint"],
    message["refusal"], usage["prompt_tokens_details"]) met a KeyError here; vLLM and
    OpenAI send them, null. A completions stream chunk carries stop_reason on every chunk."""
    with LiveServer(max_model_len=256) as live:
        chat = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
        with httpx.stream("POST", live.url + "/v1/completions", timeout=60, json={
                "prompt": "hi", "max_tokens": 3, "ignore_eos": True,
                "stream": True}) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
    assert chat["system_fingerprint"] is None
    assert chat["usage"]["prompt_tokens_details"] is None
    message = chat["choices"][0]["message"]
    assert all(message[key] is None for key in ("refusal", "annotations", "audio",
                                                  "function_call"))
    assert chunks and all("stop_reason" in c["choices"][0] for c in chunks)


def test_threads_per_replica_holds_for_an_engine_on_the_servers_thread(model_dir):
    """QA: with --no-engine-process the flag was taken and ignored (2 torch threads)."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        serve_state(str(model_dir), "--threads-per-replica", "1")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
