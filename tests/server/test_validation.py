"""Bad input, over raw HTTP: each case answers an OpenAI-shaped error with a status and a
message a person can act on, and queues nothing."""

from __future__ import annotations

import json

import httpx
import pytest

from .helpers import LiveServer, wait_for

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
TOOL = {"type": "function", "function": {"name": "get_weather"}}


def post(server: LiveServer, path: str, body: object, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def error_of(response: httpx.Response) -> str:
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]["message"]


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    (COMPLETIONS, {"prompt": "x", "bogus": 1}, 400, "unknown field 'bogus'"),
    (COMPLETIONS, {"prompt": "x", "echo": "yes"}, 400, "field 'echo'"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"x5": 1}}, 400,
     "'logit_bias' keys are token ids (strings of digits), got 'x5'"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400,
     "'logit_bias' has token id 99999999, outside the vocabulary"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"9" * 40: 1}}, 400,
     "outside the vocabulary"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": "a lot"}}, 400, "logit_bias"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL]},
     400, '"auto" tool choice needs a tool-call parser'),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL, TOOL],
            "tool_choice": "none"}, 400, "tools name the function 'get_weather' twice"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": "all"}, 400,
     "field 'tools'"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}],
            "tool_choice": "none"}, 400, "tools.0.type"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
            "tools": [{"type": "function", "function": {"description": "no name"}}]}, 400,
     "tools.0.function.name"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, 400,
     "remove it (the server's template is set where it starts: --chat-template FILE)"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "service_tier": "premium"}, 400,
     "field 'service_tier' is not supported"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "extra": 1}]}, 400,
     "unknown field 'messages.0.extra'"),
    (CHAT, {"messages": []}, 400, "'messages'"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    (COMPLETIONS, {}, 400, "field 'prompt' is required"),
    (COMPLETIONS, {"prompt": ""}, 400, "'prompt' is empty"),
    (COMPLETIONS, {"prompt": []}, 400, "'prompt' is empty"),
    (COMPLETIONS, {"prompt": [1, 99999999]}, 400, "outside the vocabulary"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "field 'temperature'"),
    (COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "field 'temperature'"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens 0 asks for no token"),
    (COMPLETIONS, {"prompt": "x", "max_queue_delay": 0}, 400,
     "field 'max_queue_delay': input should be greater than 0 (got 0)"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, 400, "field 'max_tokens'"),
    # vLLM's: "must be a non-empty string if provided" (the chaos pass: "" was taken)
    (COMPLETIONS, {"prompt": "x", "cache_salt": ""}, 400,
     "field 'cache_salt': string should have at least 1 character"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}, 400,
     "field 'cache_salt'"),
    (RESPONSES, {"input": "x", "cache_salt": ""}, 400, "cache_salt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 10**12}, 400, "field 'max_tokens'"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "field 'top_p'"),
    (COMPLETIONS, {"prompt": "x", "n": 1000}, 400, "1 prompt(s) x n=1000 is 1000 sequences; "
     "this server accepts at most 512 per request (--max-sequences-per-request)"),
    (COMPLETIONS, {"prompt": "x", "ignore_eos": "yes"}, 400, "field 'ignore_eos'"),
    # vLLM's --max-logprobs, 20 by default, names itself (tests/server/test_vllm_compat.py)
    (COMPLETIONS, {"prompt": "x", "logprobs": 50}, 400, "'logprobs' is 50, more than this "
     "server gives: at most 20 (--max-logprobs)"),
    (COMPLETIONS, {"prompt": "x", "logprobs": -2}, 400, "field 'logprobs'"),
    (COMPLETIONS, {"prompt": "x", "logprobs": -1}, 400, "'logprobs' is -1 (-1: the whole "
     "vocabulary"),  # vLLM's -1, beyond the default --max-logprobs
    (COMPLETIONS, {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "'stream_options' is only allowed"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "'top_logprobs' needs 'logprobs'"),
    (COMPLETIONS, {"prompt": [5] * 300}, 400, "This model's maximum context length is 256 "
     "tokens (max_model_len). However, your request has 300 tokens of input, which leaves no "
     "room"),
    # past the whole context: refused as vLLM refuses it (one that only overruns what the
    # prompt leaves is served cut short: test_a_max_tokens_past_the_prompts_room_...)
    (COMPLETIONS, {"prompt": [5] * 200, "max_tokens": 300}, 400, "'max_tokens' is too large: "
     "300. This model's maximum context length is 256 tokens (max_model_len) and your request "
     "has 200 tokens of input (300 > 256 - 200); ask for at most 56 tokens"),
    (COMPLETIONS, {"prompt": [[5] * 10, [5] * 255], "max_tokens": 257}, 400,
     "has 255 tokens of input (prompt 1 of the list) (257 > 256 - 255); ask for at most 1 "
     "token"),
    (COMPLETIONS, {"prompt": "x", "priority": 3}, 400, "priority scheduling is not enabled"),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-9"}, 404, "the model 'gpt-9' does not exist"),
    (COMPLETIONS, ["not", "an", "object"], 400, "must be a JSON object"),
    (COMPLETIONS, {"prompt": "x", "stop": ""}, 400, "'stop' must hold non-empty strings"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a", ""]}, 400, "'stop' must hold non-empty"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [2, 99999999]}, 400,
     "'stop_token_ids' has token id 99999999, outside the vocabulary"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0] (user) has no 'content'"),
    (CHAT, {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": None}]}, 400,
     "messages[1] (user) has no 'content'"),
    (COMPLETIONS, {"prompt": "x", "n": None, "frobnicate": None}, 400,
     "unknown field 'frobnicate'"),  # null for a field it does not know is no pass
    # vLLM's extras are served at their defaults only (test_vllm_extras_at_their_defaults)
    (COMPLETIONS, {"prompt": "x", "use_beam_search": True}, 400,
     "field 'use_beam_search' is not supported by this server"),
    # QA (fuzz): compared with ==, true was best_of 1 and 0 was use_beam_search false
    (COMPLETIONS, {"prompt": "x", "best_of": True}, 400,
     "field 'best_of' is not supported by this server"),
    (COMPLETIONS, {"prompt": "x", "use_beam_search": 0}, 400,
     "field 'use_beam_search' is not supported by this server"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"1" * 19: 1}}, 400, "outside the vocabulary"),
    (COMPLETIONS, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (COMPLETIONS, {"prompt": "x", "allowed_token_ids": [1, 99999999]}, 400,
     "'allowed_token_ids' has token id 99999999, outside the vocabulary"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 21}, 400, "'prompt_logprobs' is 21, "
     "more than this server gives: at most 20 (--max-logprobs)"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "echo": "yes"}, 400, "echo"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}],
            "guided_json": {"type": "string"}}, 400,
     "'guided_json': the schema's root must be an object"),  # ({}: any object)
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "guided_regex": "a+"}, 400,
     "field 'guided_regex' is not supported by this server"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, 400,
     "field 'add_special_tokens' is not supported by this server"),
    (COMPLETIONS, {"prompt": "x", "request_id": ""}, 400,
     "'request_id' must be 1-128 printable ASCII characters"),
    (COMPLETIONS, {"prompt": None}, 400, "field 'prompt'"),  # nor for a required one
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400,
     "send exactly one of 'prompt' and 'messages'"),
    ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "the model 'gpt-9' does not exist"),
    ("/detokenize", {"tokens": [1, -3]}, 400, "'tokens' has token id -3, outside"),
    ("/detokenize", {"tokens": "hello"}, 400, "field 'tokens'"),
    (COMPLETIONS, {"prompt": "x", "session": {"id": "a/b"}}, 400, "field 'session.id'"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, '(got "yes")'),  # JSON, not repr
    (COMPLETIONS, {"prompt": "x", "max_tokens": True}, 400, "(got true)"),
    (COMPLETIONS, {"prompt": "x", "session": "abc"}, 400,
     "field 'session': input should be a JSON object"),
    (COMPLETIONS, {"prompt": [1, "a"]}, 400, "field 'prompt' must be a string, a list of "
                                             "strings, a list of token ids or a list of"),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "field 'messages.0.content' must be a string or a list of text parts"),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {}}]}]}, 400,
     "unknown field 'messages.0.content.0.cache_control'"),
    (CHAT, {"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, 400,
     "field 'messages.0.tool_call_id'"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "verbosity": "low"}, 400,
     "field 'verbosity' is not supported"),
    (CHAT, {"messages": [{"role": "assistant", "content": "", "refusal": "no"}]}, 400,
     "field 'messages.0.refusal' is not supported"),
    # a replayed call as OpenAI writes one (QA: {"a": 1} went to the template)
    (CHAT, {"messages": [{"role": "user", "content": "x"},
                         {"role": "assistant", "tool_calls": [{"a": 1}]}]}, 400,
     "field 'messages.1.tool_calls': tool call 0 must be"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": 7}}]}]},
     400, "tool call 0 must be"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "tool", "function": {"name": "f", "arguments": "{}"}}]}]},
     400, "tool call 0 must be"),
    # QA (fuzz): pydantic's names of a union's members were the field ("field
    # 'tool_choice.literal['none','auto','required']'", "'guided_json.dict[str,any]'")
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {}}}, 400,
     "field 'tool_choice.function.name' is required"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tool_choice": 1.5}, 400,
     'field \'tool_choice\' must be "none", "auto", "required" or {"type": "function"'),
    (COMPLETIONS, {"prompt": "x", "guided_json": 5}, 400,
     "field 'guided_json' must be a JSON schema: an object, or its JSON text"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"json": 5}}, 400,
     "field 'structured_outputs.json' must be a JSON schema"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"json": "null"}}, 400,
     "'structured_outputs.json': a JSON schema must be an object, got null"),  # was JSON mode
    # QA (fuzz): the engine's names of structured outputs ("choices must be ... got
    # ('',)"; "JSON output ends at EOS" for a call the client forced)
    (COMPLETIONS, {"prompt": "x", "guided_choice": [""]}, 400,
     "'guided_choice' must be a list of at most 4096 non-empty strings, got [\"\"]"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"choice": ["a"]}, "min_tokens": 1},
     400, "the choices 'structured_outputs.choice' gives end at EOS: min_tokens must be 0"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
            "tool_choice": "required", "ignore_eos": True}, 400,
     "the JSON output 'tool_choice' asks for ends at EOS: ignore_eos cannot be true"),
])
def test_bad_request(server, path, body, status, needle):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    assert needle in error_of(response)
    for field in ("guided_choice", "structured_outputs", "tool_choice"):  # named: the param
        if f"'{field}" in needle:
            assert response.json()["error"]["param"].startswith(field)


def test_null_means_the_default_for_an_optional_field(server):
    """As OpenAI's API and vLLM take them: ``"n": null`` is one choice, ``"stream": null``
    no stream."""
    response = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 2, "n": None,
                                          "stream": None, "min_tokens": None,
                                          "ignore_eos": None, "stream_options": None})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    response = post(server, CHAT, {"messages": [{"role": "user", "content": "x"},
                                                {"role": "assistant", "content": None},
                                                {"role": "user", "content": "y"}],
                                   "max_tokens": 2, "logprobs": None})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"] is None


def test_an_assistant_message_read_back_from_an_sdk_is_sent_again_as_is(server):
    """OpenAI's SDK (message.model_dump()) and vLLM's answers carry refusal, tool_calls,
    function_call, audio, annotations and reasoning_content with nothing in them: a saved
    history came back as a 400 naming 'refusal'."""
    answer = {"role": "assistant", "content": "y", "refusal": None, "tool_calls": [],
              "function_call": None, "audio": None, "annotations": [],
              "reasoning_content": None}
    response = post(server, CHAT, {"messages": [{"role": "user", "content": "x"}, answer,
                                                {"role": "user", "content": "z"}],
                                   "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_a_developer_message_is_the_system_prompt(server):
    """OpenAI's developer role is the system prompt under its newer name: the template's own
    default system prompt gave way to it (it was rendered as a turn of its own after it)."""
    def ids(role: str) -> list[int]:
        return post(server, "/tokenize", {"messages": [{"role": role, "content": "be brief"},
                                                       {"role": "user", "content": "x"}]}
                    ).json()["tokens"]

    assert ids("developer") == ids("system")


def test_a_model_is_retrieved_by_name_and_health_answers_head(server):
    response = httpx.get(server.url + "/v1/models/tiny")
    assert response.status_code == 200
    assert response.json()["id"] == "tiny" and response.json()["max_model_len"] == 256
    assert (response.json()["root"], response.json()["parent"]) == ("tiny", None)  # vLLM's
    [permission] = response.json()["permission"]  # as vLLM's card (QA: absent)
    assert permission["object"] == "model_permission" and permission["allow_sampling"]
    response = httpx.get(server.url + "/v1/models/gpt-9")
    assert response.status_code == 404 and "'gpt-9' does not exist" in error_of(response)
    assert httpx.head(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ping").status_code == 200  # vLLM's name for it
    assert httpx.post(server.url + "/ping").status_code == 200
    assert httpx.head(server.url + "/metrics").status_code == 200


def test_tokenize_counts_what_the_endpoints_would_queue(server):
    """vLLM's /tokenize and /detokenize: a completions prompt's ids, a chat's ids through
    the template (what the chat endpoint queues: usage.prompt_tokens), and back."""
    text = "The capital of France"
    reply = post(server, "/tokenize", {"prompt": text})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 256
    completion = post(server, COMPLETIONS, {"prompt": text, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == body["count"]
    back = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    messages = [{"role": "user", "content": text}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    answer = post(server, CHAT, {"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == answer["usage"]["prompt_tokens"] > body["count"]
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert bare.json()["count"] < chat["count"]


def test_bad_json(server):
    response = httpx.post(server.url + COMPLETIONS, content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in error_of(response)


@pytest.mark.parametrize("body", [{"prompt": "x", "Q" * 1_000_000: 1},
                                  {"prompt": "x", "model": "Q" * 1_000_000}])
def test_a_refusal_quotes_a_huge_value_with_its_middle_left_out(server, body):
    """QA: an unknown field's name (in the message and the param) and a model's name came
    back whole: a 1 MB name, a 2 MB answer."""
    response = httpx.post(server.url + COMPLETIONS, json=body, timeout=60)
    assert response.status_code in (400, 404) and len(response.content) < 3000
    error = response.json()["error"]
    assert "characters left out" in error["message"]
    assert error["message"].endswith(("remove it", "'tiny'"))  # what to do is kept
    assert len(error["param"]) <= 1100


def test_unknown_route_is_an_openai_error(server):
    response = httpx.get(server.url + "/v1/nothing")
    assert response.status_code == 404 and "not found" in error_of(response)


def test_nothing_was_queued(server):
    wait_for(server.idle, what="idle")
    assert server.state.engine.stats.num_finished.get("abort", 0) == 0


def test_body_too_large():
    with LiveServer(max_body_bytes=1000) as live:
        response = post(live, COMPLETIONS, {"prompt": "x" * 5000})
        assert response.status_code == 413
        assert "at most 1000 bytes" in error_of(response)

        def chunks():
            yield b'{"prompt": "'
            yield b"y" * 5000
            yield b'"}'
        # no Content-Length: the limit is enforced while reading
        response = httpx.post(live.url + COMPLETIONS, content=chunks())
        assert response.status_code == 413


def test_a_body_that_never_arrives_whole_is_a_408():
    """QA (fuzz): a body declared longer than sent held its connection with no end (a
    slow-client hole); past the read deadline the answer is 408 and the server serves on."""
    import socket

    with LiveServer() as live:
        live.state.body_read_timeout = 0.5
        host, port = live.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
            answer = ""
            while "}}" not in answer:  # the whole JSON error, however the packets split
                piece = raw.recv(4096).decode()
                if not piece:
                    break
                answer += piece
        assert answer.startswith("HTTP/1.1 408") and "did not arrive whole within 0.5 s" \
            in answer
        assert '"type":"invalid_request_error"' in answer  # OpenAI's type, as every refusal
        assert post(live, COMPLETIONS, {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_api_keys_and_priority_limits(tmp_path):
    from kvserve.server.auth import ApiKey, load_keys

    keys_file = tmp_path / "keys.json"
    keys_file.write_text('{"keys": [{"key": "tenant-a", "tenant": "a", '
                         '"most_urgent_priority": 5, "default_priority": 10}]}')
    keys = [ApiKey("root", "operator", admin=True), *load_keys(keys_file)]
    with LiveServer(keys=keys, scheduling_policy="priority") as live:
        body = {"prompt": "x", "max_tokens": 2}
        missing = post(live, COMPLETIONS, body)
        assert missing.status_code == 401 and "missing API key" in error_of(missing)
        wrong = post(live, COMPLETIONS, body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "invalid API key" in error_of(wrong)
        assert missing.headers["WWW-Authenticate"] == wrong.headers["WWW-Authenticate"] \
            == "Bearer"  # RFC 9110 (QA)
        tenant = {"Authorization": "Bearer tenant-a"}
        assert post(live, COMPLETIONS, body, headers=tenant).status_code == 200
        assert post(live, COMPLETIONS, {**body, "priority": 5}, headers=tenant
                    ).status_code == 200
        escalate = post(live, COMPLETIONS, {**body, "priority": 1}, headers=tenant)
        assert escalate.status_code == 403
        assert "more urgent than tenant 'a' may ask for" in error_of(escalate)
        root = {"Authorization": "Bearer root"}
        assert post(live, COMPLETIONS, {**body, "priority": -100}, headers=root
                    ).status_code == 200
        abort = post(live, "/v1/abort", {"request_id": "x"}, headers=tenant)
        assert abort.status_code == 403 and "admin key" in error_of(abort)
        assert post(live, "/v1/abort", {"request_id": "x"}, headers=root).json() == {
            "aborted": [], "not_found": ["x"]}
        assert httpx.get(live.url + "/v1/models").status_code == 401
        assert httpx.get(live.url + "/health").status_code == 200
        # two Authorization headers: which one was meant is a guess, so neither is taken,
        # not even when both name a key (an admin one here)
        for second in ("Bearer tenant-a", "Bearer root"):
            both = [("Authorization", "Bearer root"), ("Authorization", second)]
            twice = httpx.post(live.url + "/v1/abort", json={"request_id": "x"},
                               headers=both)
            assert twice.status_code == 401
            assert "the request has 2 Authorization headers: send one" in error_of(twice)
            assert httpx.get(live.url + "/v1/models", headers=both).status_code == 401


def test_priority_source_key_refuses_a_body_priority():
    from kvserve.server.auth import ApiKey

    keys = [ApiKey("k", "t", most_urgent_priority=None, default_priority=4)]
    with LiveServer(keys=keys, scheduling_policy="priority", priority_source="key") as live:
        headers = {"Authorization": "Bearer k"}
        ok = post(live, COMPLETIONS, {"prompt": "x", "max_tokens": 1}, headers=headers)
        assert ok.status_code == 200
        refused = post(live, COMPLETIONS, {"prompt": "x", "max_tokens": 1, "priority": 0},
                       headers=headers)
        assert refused.status_code == 403
        assert "priority is set by your API key" in error_of(refused)


@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, {"prompt": [5] * 300}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 300}]}, "messages"),
])
def test_a_prompt_over_the_context_names_the_field_it_came_in(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["message"].endswith(f"shorten the {param}")


def test_a_sampling_refusal_names_its_field_as_param(server):
    response = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 2, "min_tokens": 5})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "min_tokens"
    assert error["message"] == "min_tokens must be an integer in [0, max_tokens=2], got 5"


def test_browsers_may_call_the_api_as_vllm_allows_them():
    """CORS as vLLM's defaults: any origin, answered before the key check (a browser's
    preflight carries no key); it was a 405. --allowed-origins narrows it; [] turns it off."""
    from kvserve.server.app import Cors
    from kvserve.server.auth import ApiKey

    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with LiveServer(keys=[ApiKey("k", "t")]) as live:
        answer = httpx.options(live.url + "/v1/chat/completions", headers=preflight)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "*"
        reply = httpx.get(live.url + "/v1/models", headers={
            "Origin": "https://app.example", "Authorization": "Bearer k"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "*"
        # a browser's script may read the request's id and a 503's Retry-After
        exposed = reply.headers["access-control-expose-headers"].lower()
        assert "x-request-id" in exposed and "retry-after" in exposed
    with LiveServer(cors=Cors(origins=("https://app.example",))) as live:
        allowed = httpx.options(live.url + "/v1/completions", headers=preflight)
        other = httpx.options(live.url + "/v1/completions",
                              headers={**preflight, "Origin": "https://evil.example"})
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    with LiveServer(cors=Cors(origins=())) as live:
        assert httpx.options(live.url + "/v1/completions", headers=preflight).status_code == 405


def test_the_request_id_comes_back_as_a_header_and_must_be_ascii(server):
    """The X-Request-Id header came back on streamed responses only; a UTF-8 id was read as
    Latin-1 and came back garbled ('cafÃ©'), now it is a 400."""
    reply = httpx.post(server.url + COMPLETIONS, headers={"X-Request-Id": "plain-1"},
                       json={"prompt": "x", "max_tokens": 1})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "plain-1"
    assert reply.json()["id"] == "cmpl-plain-1"
    refused = httpx.post(server.url + COMPLETIONS, headers={"X-Request-Id": "bad-1"},
                         json={"prompt": "x", "max_tokens": -1})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"
    # the body's id too (the tenants pass: only a header's came back on a refusal)
    for body in ({"max_tokens": -1}, {"max_tokens": 1, "n": 2, "temperature": 0}):
        refused = httpx.post(server.url + COMPLETIONS,
                             json={"prompt": "x", "request_id": "body-bad", **body})
        assert refused.status_code == 400 and refused.headers["x-request-id"] == "body-bad"
    utf8 = httpx.post(server.url + COMPLETIONS, headers={"X-Request-Id": "café".encode()},
                      json={"prompt": "x", "max_tokens": 1})
    assert utf8.status_code == 400
    assert "1-128 printable ASCII characters" in error_of(utf8)
    # two ids: which was meant? (the first was taken silently; two keys are a 401)
    two = httpx.post(server.url + COMPLETIONS, json={"prompt": "x", "max_tokens": 1},
                     headers=[("X-Request-Id", "one"), ("X-Request-Id", "two")])
    assert two.status_code == 400 and "2 X-Request-Id headers; send one" in error_of(two)


def test_include_stop_str_in_output_over_http(server):
    body = {"prompt": "hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = post(server, COMPLETIONS, body).json()["choices"][0]["text"]
    stop = text[2:5]
    assert len(stop) == 3, text
    for include, expected in ((False, text[:text.index(stop)]),
                              (True, text[:text.index(stop) + 3])):
        reply = post(server, COMPLETIONS, {**body, "stop": stop,
                                           "include_stop_str_in_output": include})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected


def test_vllm_chat_template_fields(server):
    """vLLM's add_generation_prompt and chat_template_kwargs (they were 400 unknown field):
    without the generation prompt the assistant's opening is not in the prompt; a
    template's own variables pass through; the server's own may not be set."""
    messages = [{"role": "user", "content": "hi"}]

    def prompt_tokens(**extra: object) -> int:
        reply = post(server, CHAT, {"messages": messages, "max_tokens": 1, **extra})
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"]

    with_opening = prompt_tokens()
    assert prompt_tokens(add_generation_prompt=False) < with_opening
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == with_opening
    bad = post(server, CHAT, {"messages": messages, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400
    assert "'chat_template_kwargs' may not set 'messages'" in error_of(bad)


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats (a 400 unknown field before)."""
    import json

    with httpx.stream("POST", server.url + COMPLETIONS, timeout=30, json={
            "prompt": "hi", "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 3
    assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"]
               for e in events)
    # each chunk its own choice's count and prompt, as vLLM's (the streaming pass: the
    # choices' counts were added up, and the prompts' too)
    with httpx.stream("POST", server.url + COMPLETIONS, timeout=30, json={
            "prompt": ["hi", "a longer prompt"], "max_tokens": 3, "ignore_eos": True,
            "n": 2, "temperature": 1, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    seen: dict[int, list[int]] = {}
    prompts: dict[int, set[int]] = {}
    for e in events[:-1]:
        [choice] = e["choices"]
        seen.setdefault(choice["index"], []).append(e["usage"]["completion_tokens"])
        prompts.setdefault(choice["index"], set()).add(e["usage"]["prompt_tokens"])
    assert all(counts == [1, 2, 3] for counts in seen.values()) and len(seen) == 4
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3]  # n=2 per prompt
    last = events[-1]["usage"]  # the whole answer's, once
    assert last["completion_tokens"] == 12 and last["prompt_tokens"] == sum(
        next(iter(prompts[i])) for i in (0, 2))


def test_vllm_extras_at_their_defaults_are_served(server):
    """vLLM's own request fields at vLLM's defaults (what LangChain's VLLMOpenAI and eval
    harnesses send) were 400 "unknown field"; its body request_id names the request where no
    X-Request-Id is sent; completions honour add_special_tokens."""
    defaults = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                "use_beam_search": False, "length_penalty": 1.0, "prompt_logprobs": None,
                "allowed_token_ids": None, "bad_words": [], "guided_json": None,
                "truncate_prompt_tokens": None, "return_tokens_as_token_ids": False,
                "response_format": {"type": "text"}, "echo": False}
    reply = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 1, **defaults,
                                       "add_special_tokens": True, "request_id": "body-7"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["id"] == "cmpl-body-7" and reply.headers["x-request-id"] == "body-7"
    chat = post(server, CHAT, {"messages": [{"role": "user", "content": "x"}],
                               "max_tokens": 1, **defaults, "add_special_tokens": False,
                               "continue_final_message": False, "chat_template": None,
                               "documents": None})
    assert chat.status_code == 200, chat.text
    header = httpx.post(server.url + COMPLETIONS, headers={"X-Request-Id": "head-7"},
                        json={"prompt": "x", "max_tokens": 1, "request_id": "body-8"})
    assert header.json()["id"] == "cmpl-head-7"  # the header goes first
    # skip_special_tokens false is honoured (special tokens' text kept), not refused
    kept = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 3, "ignore_eos": True,
                                      "temperature": 0, "skip_special_tokens": False})
    assert kept.status_code == 200, kept.text


def test_the_chat_role_chunk_carries_the_usage_under_continuous_usage_stats(server):
    """vLLM's role chunk carries usage (no completion tokens yet); it was null here."""
    import json

    with httpx.stream("POST", server.url + CHAT, timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    role = events[0]
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert role["usage"]["completion_tokens"] == 0
    assert role["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"] > 0


def test_prompt_logprobs_and_echo_as_vllm_gives_them(server):
    """vLLM's prompt_logprobs and OpenAI's echo (lm-eval's loglikelihood: echo, logprobs,
    max_tokens 1) were 400s: the prompt's tokens, each with its logprob from the model (G8;
    none for the first), before the answer's; streamed, the prompt's text comes first."""
    import json

    prompt = "The capital of France is"
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    plain = post(server, COMPLETIONS, {**body, "prompt_logprobs": 2}).json()["choices"][0]
    computed = plain["prompt_logprobs"]
    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert len(computed) == len(tokenized) and computed[0] is None
    for token_id, entry in zip(tokenized[1:], computed[1:], strict=True):
        own = entry[str(token_id)]
        assert own["logprob"] <= 0 and own["rank"] >= 1
        assert sorted(v["rank"] for k, v in entry.items() if k != str(token_id))[:2] == [1, 2]
    echoed = post(server, COMPLETIONS, {**body, "echo": True, "logprobs": 1,
                                        "max_tokens": 1}).json()["choices"][0]
    assert echoed["text"].startswith(prompt) and "prompt_logprobs" not in echoed
    logprobs = echoed["logprobs"]
    assert len(logprobs["tokens"]) == len(tokenized) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:len(tokenized)] == pytest.approx(
        [entry[str(t)]["logprob"] for t, entry in zip(tokenized[1:], computed[1:],
                                                        strict=True)], abs=1e-5)
    assert logprobs["text_offset"][0] == 0 and "".join(logprobs["tokens"]) == echoed["text"]
    with httpx.stream("POST", server.url + COMPLETIONS, timeout=30,
                      json={**body, "echo": True, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(e["choices"][0]["text"] for e in events)
    assert events[0]["choices"][0]["text"].startswith(prompt)
    assert streamed == prompt + plain["text"]
    # vLLM's echo without generation: max_tokens 0 scores the prompt and returns no token
    for stream in (False, True):
        reply = post(server, COMPLETIONS, {**body, "echo": True, "logprobs": 1,
                                           "max_tokens": 0, "stream": stream,
                                           "stream_options": {"include_usage": True}
                                           if stream else None})
        assert reply.status_code == 200, reply.text
        if stream:
            events = [json.loads(line[6:]) for line in reply.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            tokens = [t for e in events if e["choices"]
                      for t in e["choices"][0]["logprobs"]["tokens"]]
            used = events[-1]["usage"]
        else:
            choice = reply.json()["choices"][0]
            text, tokens, used = choice["text"], choice["logprobs"]["tokens"], \
                reply.json()["usage"]
        assert text == prompt and len(tokens) == len(tokenized)
        assert used["completion_tokens"] == 0
    refused = post(server, COMPLETIONS, {**body, "max_tokens": 0})
    assert refused.status_code == 400 and "only with 'echo': true" in error_of(refused)
    chat = post(server, CHAT, {"messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert chat["prompt_logprobs"][0] is None and all(
        len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # its own token only


def test_a_max_tokens_past_the_prompts_room_is_served_cut_short_as_vllm(server):
    """QA (vLLM compat): a chat client's fixed max_tokens on a long history, prompt +
    max_tokens past max_model_len, was a 400 here; vLLM 0.32 serves it cut short to the
    context (finish_reason "length"), each prompt of a list to its own room."""
    one = post(server, COMPLETIONS, {"prompt": [5] * 200, "max_tokens": 100,
                                     "ignore_eos": True}).json()
    assert one["usage"]["completion_tokens"] == 56
    assert one["choices"][0]["finish_reason"] == "length"
    both = post(server, COMPLETIONS, {"prompt": [[5] * 10, [5] * 250], "max_tokens": 8,
                                      "ignore_eos": True}).json()
    lengths = [len(c["text"]) > 0 for c in both["choices"]]
    assert both["usage"]["completion_tokens"] == 8 + 6 and all(lengths)
    body = {"messages": [{"role": "user", "content": "hi " * 200}],
            "max_completion_tokens": 255, "ignore_eos": True}
    chat = post(server, CHAT, body).json()
    assert chat["usage"]["total_tokens"] == 256
    assert chat["choices"][0]["finish_reason"] == "length"
    # a min_tokens past the room is refused, as vLLM's (it was cut to the room, QA)
    refused = post(server, CHAT, {**body, "min_tokens": 255})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_tokens"
    assert "more than the prompt leaves of this model's context" in \
        refused.json()["error"]["message"]


def test_a_context_overflow_reads_as_vllms_and_openais(server):
    """Agent frameworks trim their history on "This model's maximum context length is N
    tokens" or on OpenAI's code (QA: litellm matched neither)."""
    response = post(server, CHAT, {"messages": [{"role": "user", "content": "hi " * 400}]})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["message"].startswith("This model's maximum context length is 256 tokens")
    assert error["param"] == "messages"


def test_a_tool_using_history_and_vllms_default_extras_are_served(server):
    """An agent replays its history: the assistant's tool calls and the tool's answer go to
    the template as in vLLM (QA: role 'tool' was a 400); vLLM's own defaults for its newer
    fields and OpenAI's cache key and safety identifier are accepted."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}
    body = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "18 C and sunny", "tool_call_id": "call_1"}],
        "max_tokens": 2, "include_reasoning": True, "mm_processor_kwargs": None,
        "thinking_token_budget": None, "prompt_cache_key": "agent-7",
        "safety_identifier": "user-9"}
    response = post(server, CHAT, body)
    assert response.status_code == 200, response.text
    rendered = post(server, "/tokenize", {"messages": body["messages"]}).json()
    assert rendered["count"] == response.json()["usage"]["prompt_tokens"]
    text = post(server, "/detokenize", {"tokens": rendered["tokens"]}).json()["prompt"]
    assert "18 C and sunny" in text and "tool" in text  # the tool's turn, rendered


def test_continue_final_message_goes_on_with_the_assistants_reply(server):
    """vLLM's continue_final_message: the final assistant message is left open (no end of
    turn), so the model continues it (QA: a 400, and an assistant message last opened a
    new turn, which repeated it)."""
    start = [{"role": "user", "content": "Name a fruit."},
             {"role": "assistant", "content": "The fruit I name is"}]
    body = {"messages": start, "add_generation_prompt": False,
            "continue_final_message": True}
    ids = post(server, "/tokenize", body).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text.endswith("The fruit I name is")
    closed = post(server, "/tokenize", {"messages": start, "add_generation_prompt": False})
    assert len(closed.json()["tokens"]) > len(ids)  # the end of turn, which stays off here
    reply = post(server, CHAT, {**body, "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(ids)
    for bad, needle in (
            ({"messages": start, "continue_final_message": True},
             "cannot be used with add_generation_prompt"),
            ({"messages": [{"role": "user", "content": " "}], "add_generation_prompt": False,
              "continue_final_message": True}, "the final message ('user') is empty"),
            ({**body, "chat_template_kwargs": {"continue_final_message": False}},
             "may not set 'continue_final_message'")):
        refused = post(server, CHAT, {**bad, "max_tokens": 2})
        assert refused.status_code == 400 and needle in error_of(refused), refused.text


def test_logit_bias_and_allowed_token_ids_steer_the_tokens(server):
    """OpenAI's logit_bias (token id strings, clamped to [-100, 100] as vLLM) and vLLM's
    allowed_token_ids reach the sampler, greedy included, in completions and chat."""
    def tokens(path: str, **fields: object) -> list[int]:
        body = {"max_tokens": 4, "ignore_eos": True, "temperature": 0, "return_token_ids": True,
                **fields}
        body.update({"prompt": "hello"} if path == COMPLETIONS else
                    {"messages": [{"role": "user", "content": "hello"}]})
        reply = post(server, path, body)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]

    assert tokens(COMPLETIONS, logit_bias={"42": 1000}) == [42] * 4  # 1000 -> 100: enough
    # leading zeros: token 42 still (QA: refused as "outside the vocabulary" past 18 digits)
    assert tokens(COMPLETIONS, logit_bias={"0" * 30 + "42": 100}) == [42] * 4
    assert set(tokens(CHAT, allowed_token_ids=[40, 41])) <= {40, 41}
    assert set(tokens(COMPLETIONS, temperature=1.0, seed=1, allowed_token_ids=[7])) == {7}
    first = tokens(CHAT)[0]
    assert tokens(CHAT, logit_bias={str(first): -100})[0] != first
    wait_for(server.idle, what="an empty server")


def test_bad_words_are_never_generated(server):
    """vLLM's bad_words, tokenized by the server (the engine process has no tokenizer): a
    word greedy decoding wrote, banned, is not written again, at the start or after a
    space; a blank word is a 400 naming the field."""
    body = {"prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}
    plain = post(server, COMPLETIONS, body).json()["choices"][0]
    word = plain["text"].split()[0]
    banned = post(server, COMPLETIONS, {**body, "bad_words": [word]})
    assert banned.status_code == 200, banned.text
    text = banned.json()["choices"][0]["text"]
    assert word not in text.split() and text != plain["text"]
    refused = post(server, COMPLETIONS, {**body, "bad_words": ["ok", " "]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words"
    wait_for(server.idle, what="an empty server")


def test_a_choice_constrained_output_is_one_of_the_choices(server):
    """vLLM's structured output by choice (structured_outputs.choice, or the older
    guided_choice): the text is one whole choice, ended by EOS, sampled or greedy, in
    completions and chat; the other constraints are refused by name."""
    colours = ["red", "green", "light blue"]
    reply = post(server, COMPLETIONS, {"prompt": "My favourite colour is", "n": 4, "seed": 3,
                                       "temperature": 1.5, "guided_choice": colours})
    assert reply.status_code == 200, reply.text
    for choice in reply.json()["choices"]:
        assert choice["text"] in colours and choice["finish_reason"] == "stop"
    chat = post(server, CHAT, {"messages": [{"role": "user", "content": "Pick a colour"}],
                               "temperature": 0, "structured_outputs": {"choice": colours}})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] in colours
    for body, status, needle in [
        ({"guided_choice": colours, "ignore_eos": True}, 400, "ignore_eos cannot be true"),
        ({"structured_outputs": {"regex": "a+"}}, 400,
         "field 'structured_outputs.regex' is not supported"),
        ({"structured_outputs": {}}, 400, "'structured_outputs' needs 'choice'"),
        ({"structured_outputs": {"choice": ["a"]}, "guided_choice": ["b"]}, 400, "not both"),
        ({"guided_choice": []}, 400, "guided_choice"),
        ({"guided_choice": [""]}, 400, "'guided_choice' must be a list"),
    ]:
        refused = post(server, COMPLETIONS, {"prompt": "x", **body})
        assert refused.status_code == status and needle in error_of(refused), refused.text
    wait_for(server.idle, what="an empty server")


def test_a_whole_number_written_as_a_float_is_that_integer(server):
    """`"max_tokens": 5.0` (as `budget / 2` makes it in a client) was a 400 under strict
    validation; OpenAI's API and vLLM take it. 5.5 and "5" stay errors."""
    reply = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 5.0, "n": 2.0,
                                       "ignore_eos": True, "seed": 1.0, "temperature": 1})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 10
    for value in (5.5, "5"):
        refused = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": value})
        assert refused.status_code == 400
        assert "field 'max_tokens': input should be a valid integer" in error_of(refused)


def test_tools_with_tool_choice_none_are_ignored_as_vllm_ignores_them(server):
    """OpenAI SDK code that always sends its tools, with tool_choice "none" where it wants
    text, was a 400; vLLM serves it without rendering the tools. Likewise OpenAI's
    service_tier "default" and a reasoning_effort (this model does not reason)."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0, "return_token_ids": True}
    plain = post(server, CHAT, base).json()
    for extra in ({"tools": [tool], "tool_choice": "none"}, {"service_tier": "default"},
                  {"reasoning_effort": "low"},
                  # QA (Responses pass): OpenAI's newer values were 400s
                  {"service_tier": "flex"}, {"reasoning_effort": "none"},
                  {"prompt_cache_retention": "24h"}):
        reply = post(server, CHAT, {**base, **extra})
        assert reply.status_code == 200, (extra, reply.text)
        body = reply.json()
        assert body["prompt_token_ids"] == plain["prompt_token_ids"]  # tools not rendered
        assert body["choices"][0]["message"]["content"] == \
            plain["choices"][0]["message"]["content"]


def test_a_method_the_path_does_not_take_is_a_405_naming_the_ones_it_does(server):
    """RFC 9110: a 405 carries Allow (QA: the error handler dropped starlette's)."""
    reply = httpx.get(server.url + COMPLETIONS, timeout=30)
    assert reply.status_code == 405 and "POST" in reply.headers["Allow"]
    assert reply.json()["error"]["message"].startswith("GET /v1/completions")


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server):
    """vLLM's return_tokens_as_token_ids: every token in the logprobs is "token_id:N", the
    top lists too (completions and chat)."""
    body = {"max_tokens": 3, "ignore_eos": True, "temperature": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    reply = post(server, COMPLETIONS, {**body, "prompt": "hello", "logprobs": 2}).json()
    choice = reply["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(name.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"]
               for name in top)
    chat = post(server, CHAT, {**body, "messages": [{"role": "user", "content": "hello"}],
                               "logprobs": True, "top_logprobs": 2}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(top["token"].startswith("token_id:") for entry in content
               for top in entry["top_logprobs"])


def test_a_request_read_once_the_shutdown_began_is_a_503(server):
    """As vLLM's: nothing new is queued once a shutdown began (kvserve serve's SIGTERM)."""
    server.state.shutting_down = True
    try:
        refused = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 2})
    finally:
        server.state.shutting_down = False
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert not server.state.ids_in_use  # nothing held for it
    assert post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_json_mode_answers_one_json_object(server):
    """OpenAI's response_format json_object (vLLM's structured_outputs json_object): the
    answer is one JSON object, ended at EOS, sampled or greedy."""
    import json as json_module

    messages = [{"role": "user", "content": "Describe a cat as JSON"}]
    for body in ({"response_format": {"type": "json_object"}, "temperature": 0},
                 {"structured_outputs": {"json_object": True}, "temperature": 1.0, "seed": 5,
                  "n": 2}):
        reply = post(server, CHAT, {"messages": messages, "max_tokens": 200, **body})
        assert reply.status_code == 200, reply.text
        for choice in reply.json()["choices"]:
            if choice["finish_reason"] == "stop":
                assert isinstance(json_module.loads(choice["message"]["content"]), dict)
            else:  # cut by max_tokens: still the beginning of one object
                from kvserve.model.json_mode import read
                text = choice["message"]["content"]
                assert text.lstrip().startswith("{") and read(text.encode()) is not None
    for body, needle in [
        ({"response_format": {"type": "json_schema"}}, "type json_schema needs them"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "type json_schema needs them"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}}}},
         "'response_format': schema.properties.a: 'pattern' is not supported"),
        ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}},
         "give one structured output, not 'response_format' and 'guided_json'"),
        ({"guided_json": "{not json"}, "'guided_json': the JSON schema is not JSON"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True},
         "ignore_eos cannot be true"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"json_object": True, "choice": ["a"]}},
         "give one structured output, not 'structured_outputs.choice' and "
         "'structured_outputs.json_object'"),
    ]:
        refused = post(server, CHAT, {"messages": messages, **body})
        assert refused.status_code == 400 and needle in error_of(refused), refused.text
    wait_for(server.idle, what="an empty server")


def test_a_json_schema_holds_the_answer_to_it(server):
    """OpenAI's response_format json_schema (what the SDK's .parse() sends), vLLM's
    structured_outputs.json and guided_json: the answer is an object of the schema, its
    required keys there, each key once, values of their types and enums."""
    import json as json_module

    from kvserve.model.json_mode import DONE, check_schema, read

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "title": "Name"},
                             "age": {"type": "integer"}, "kind": {"enum": ["cat", "dog"]},
                             "owner": {"anyOf": [{"$ref": "#/$defs/Owner"}, {"type": "null"}]}},
              "$defs": {"Owner": {"type": "object", "properties": {"n": {"type": "string"}},
                                  "required": ["n"]}}}
    compiled = check_schema(json_module.dumps(schema))
    messages = [{"role": "user", "content": "A pet as JSON"}]
    for body in ({"response_format": {"type": "json_schema", "json_schema": {
                      "name": "Pet", "schema": schema, "strict": True}}, "temperature": 0},
                 {"structured_outputs": {"json": schema}, "temperature": 1.0, "seed": 2,
                  "n": 2},
                 {"guided_json": json_module.dumps(schema), "temperature": 1.0, "seed": 9}):
        reply = post(server, CHAT, {"messages": messages, "max_tokens": 120, **body})
        assert reply.status_code == 200, reply.text
        for choice in reply.json()["choices"]:
            text = choice["message"]["content"]
            state = read(text.encode(), schema=compiled)
            assert state is not None, text
            if choice["finish_reason"] == "stop":
                assert state.mode == DONE
                pet = json_module.loads(text)
                assert {"name", "age"} <= set(pet) <= set(schema["properties"])
                assert isinstance(pet["age"], int) and pet.get("kind", "cat") in ("cat", "dog")
    wait_for(server.idle, what="an empty server")


TIME = {"type": "function", "function": {"name": "get_time"}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}}


def test_a_named_tool_choice_answers_its_call(server):
    """tool_choice naming a function (LangChain's with_structured_output by function
    calling) or "required" with one tool: the answer is that call, its arguments held to
    the function's parameters, in OpenAI's shape, whole or streamed delta by delta."""
    import json as json_module

    from kvserve.model.json_mode import check_schema, read

    parameters = check_schema(json_module.dumps(WEATHER["function"]["parameters"]))
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 60,
            "temperature": 0, "tools": [TIME, WEATHER], "tool_choice": named}
    whole = post(server, CHAT, body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    message = choice["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1
    call = message["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    arguments = call["function"]["arguments"]
    assert read(arguments.encode(), schema=parameters) is not None, arguments
    if choice["finish_reason"] == "stop":
        assert "city" in json_module.loads(arguments)
    with httpx.stream("POST", server.url + CHAT, timeout=60,
                      json={**body, "stream": True}) as reply:
        events = [json_module.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["index"] == 0
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    assert all(set(c) == {"index", "function"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == arguments
    assert [e for e in events if e["choices"]][-1]["choices"][0]["finish_reason"] == \
        choice["finish_reason"]  # the stream ends with it, as the whole answer says
    one = post(server, CHAT, {**body, "tools": [WEATHER], "tool_choice": "required"})
    required = one.json()["choices"][0]
    assert required["message"]["tool_calls"][0]["function"]["arguments"] == arguments
    # vLLM's finish reasons: stop where the function was named, tool_calls where required
    assert required["finish_reason"] == ("tool_calls" if choice["finish_reason"] == "stop"
                                         else choice["finish_reason"])
    assert not arguments[:1].isspace()  # the arguments start with their brace (QA)
    for extra, needle in [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "names the function 'nope', which is not among the tools"),
        ({"tools": None, "tool_choice": named}, "'tool_choice' needs 'tools'"),
        ({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"day": {"type": "string", "format": "date"}}}}}]},
         "'tools.0.function.parameters': schema.properties.day: 'format' is not supported"),
        ({"response_format": {"type": "json_object"}},
         "a tool_choice that asks for a call makes the answer that call: 'response_format' "
         "cannot be given with it"),
    ]:
        refused = post(server, CHAT, {**body, **extra})
        assert refused.status_code == 400 and needle in error_of(refused), refused.text
    wait_for(server.idle, what="an empty server")


def test_a_required_call_finishes_with_tool_calls_and_a_named_one_with_stop(server):
    """A function without arguments (LangChain sends {"properties": {}}) takes only {}, so
    the call ends at once; the finish reason is vLLM's: tool_calls where the call was
    required, stop where the function was named."""
    now = {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}}}}
    body = {"messages": [{"role": "user", "content": "What time is it?"}], "max_tokens": 30,
            "tools": [now]}
    for tool_choice, reason in (("required", "tool_calls"),
                                ({"type": "function", "function": {"name": "now"}}, "stop")):
        reply = post(server, CHAT, {**body, "tool_choice": tool_choice}).json()["choices"][0]
        arguments = reply["message"]["tool_calls"][0]["function"]["arguments"]
        assert arguments.startswith("{") and json.loads(arguments) == {}
        assert reply["finish_reason"] == reason


def test_required_among_several_tools_answers_their_calls(server):
    """tool_choice "required" among several tools (LangChain's tool_choice="any"): the
    answer is one call or more, each of one of the tools with arguments of its parameters
    (one with parallel_tool_calls false), in OpenAI's tool_calls shape, whole or streamed
    (the calls go out whole once the answer is complete); finish_reason tool_calls."""
    def no_arguments(name: str) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {}}}}

    body = {"messages": [{"role": "user", "content": "Time or date?"}], "max_tokens": 200,
            "temperature": 0, "tools": [no_arguments("now"), no_arguments("today")],
            "tool_choice": "required", "parallel_tool_calls": False}
    reply = post(server, CHAT, body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]  # parallel_tool_calls false: one
    assert call["function"]["name"] in ("now", "today")
    assert json.loads(call["function"]["arguments"]) == {}
    # a parameter's unsupported keyword is named where it is, not in the calls' union
    pattern = {"type": "function", "function": {"name": "p", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}}}
    refused = post(server, CHAT, {**body, "tools": [no_arguments("now"), pattern]})
    assert refused.status_code == 400 and error_of(refused).startswith(
        "'tools.1.function.parameters': schema.properties.a: 'pattern' is not supported")
    cut = post(server, CHAT, {**body, "max_tokens": 3}).json()["choices"][0]
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]
    assert cut["message"]["content"].startswith("{")  # cut short: the text as it is
    with httpx.stream("POST", server.url + CHAT, timeout=60,
                      json={**body, "stream": True}) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    calls = [c for e in events if e["choices"]
             for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]) for c in calls] == [(0, call["function"])]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # a nested pydantic model's parameters: their $defs (QA: refused among several)
    item = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}
    order = {"type": "function", "function": {"name": "order", "parameters": {
        "$defs": {"Item": item}, "type": "object", "required": ["item"],
        "properties": {"item": {"$ref": "#/$defs/Item"}}}}}
    nested = post(server, CHAT, {**body, "tools": [no_arguments("now"), order],
                                 "max_tokens": 40})
    assert nested.status_code == 200, nested.text
    for made in nested.json()["choices"][0]["message"].get("tool_calls") or []:
        if made["function"]["name"] == "order":
            assert isinstance(json.loads(made["function"]["arguments"])["item"]["n"], int)


def test_an_echoed_token_id_prompt_keeps_its_special_tokens(server):
    """QA (detokenization pass): echo of [<|im_start|>, user, ...] dropped <|im_start|>
    (where /detokenize keeps it), and its logprob offsets no longer indexed the text."""
    ids = httpx.post(server.url + "/tokenize",
                     json={"prompt": "<|im_start|>user\nHi"}).json()["tokens"]
    choice = post(server, COMPLETIONS, {"prompt": ids, "echo": True, "logprobs": 0,
                                        "max_tokens": 1, "temperature": 0}).json()["choices"][0]
    assert choice["text"].startswith("<|im_start|>user\nHi")
    logprobs = choice["logprobs"]
    assert logprobs["tokens"][:2] == ["<|im_start|>", "user"]
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        assert choice["text"][offset:offset + len(token)] == token


def test_chat_echo_begins_the_answer_with_the_assistants_message(server):
    """vLLM's chat echo: with the last message the assistant's (continued), the answer's
    content begins with it, whole or streamed (a chunk of its own after the role's); a
    last message of another role echoes nothing (it was a 400)."""
    continued = {"messages": [{"role": "user", "content": "Count."},
                              {"role": "assistant", "content": "One, two,"}],
                 "add_generation_prompt": False, "continue_final_message": True,
                 "max_tokens": 4, "temperature": 0}
    plain = post(server, CHAT, continued).json()["choices"][0]["message"]["content"]
    echoed = post(server, CHAT, {**continued, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "One, two," + plain
    with httpx.stream("POST", server.url + CHAT, timeout=60,
                      json={**continued, "echo": True, "stream": True}) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[1] == {"content": "One, two,"}
    assert "".join(d.get("content") or "" for d in deltas) == "One, two," + plain
    user_last = post(server, CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 2, "temperature": 0, "echo": True}).json()
    alone = post(server, CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 2, "temperature": 0}).json()
    assert user_last["choices"][0]["message"]["content"] == \
        alone["choices"][0]["message"]["content"]


def test_replayed_calls_as_clients_write_them_are_taken(server):
    """Arguments as an object (the template takes one anyway), no id, no type: taken, as
    before the calls' shape was checked."""
    for call in ({"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                 # null as absent (QA: LangChain's "id": null for a call it made up)
                 {"id": None, "type": None, "function": {"name": "get_weather",
                                                         "arguments": None}},
                 {"id": "c1", "type": "function", "function": {"name": "get_weather"}}):
        response = post(server, CHAT, {"max_tokens": 2, "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
        assert response.status_code == 200, (call, response.text)


def test_truncate_prompt_tokens_keeps_a_prompts_last_tokens_as_vllm(server):
    """vLLM's truncate_prompt_tokens (QA: refused here): each prompt cut to its last N
    tokens (a generative model's tokenizer cuts on the left in vLLM), or its first N with
    truncation_side "right"; -1 is the context less one; past the context, a 400."""
    def usage(body):
        reply = post(server, COMPLETIONS, {"max_tokens": 1, "ignore_eos": True,
                                           "temperature": 0, **body})
        assert reply.status_code == 200, reply.text
        return reply.json()

    left = usage({"prompt": [[5] * 3 + [7] * 20, [9] * 4], "truncate_prompt_tokens": 20,
                  "echo": True, "max_tokens": 1})
    assert left["usage"]["prompt_tokens"] == 20 + 4
    whole = usage({"prompt": [7] * 20, "echo": True})
    assert left["choices"][0]["text"] == whole["choices"][0]["text"]  # the last 20 echoed
    right = usage({"prompt": [[5] * 3 + [7] * 20], "truncate_prompt_tokens": 3,
                   "truncation_side": "right", "echo": True})
    assert right["choices"][0]["text"] == usage({"prompt": [5] * 3, "echo": True}
                                                )["choices"][0]["text"]
    longest = usage({"prompt": [5] * 400, "truncate_prompt_tokens": -1})
    assert longest["usage"]["prompt_tokens"] == 255  # max_model_len 256, less one
    chat = post(server, CHAT, {"messages": [{"role": "user", "content": "hi " * 400}],
                               "truncate_prompt_tokens": 100, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == 100
    for value, message in ((257, "cannot be greater than max_model_len = 256"),
                           (0, "leaves no prompt"), (-2, "greater than or equal to -1")):
        reply = post(server, COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": value})
        assert reply.status_code == 400 and message in reply.json()["error"]["message"]
        assert reply.json()["error"]["param"] == "truncate_prompt_tokens"
    reply = post(server, COMPLETIONS, {"prompt": "x", "truncation_side": "middle"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "truncation_side"


def test_an_echo_is_the_prompt_as_sent_unless_truncation_cut_it():
    """QA: with truncate_prompt_tokens set, every echo was the ids decoded (a Llama 3 echo
    gained its <|begin_of_text|>), though the prompt was not cut."""
    from types import SimpleNamespace

    from kvserve.server.generation import _echo_texts

    state = SimpleNamespace(tokenizer=SimpleNamespace(
        decode=lambda ids, skip_special_tokens: f"<decoded {len(ids)}>"))
    whole, cut = [1, 2, 3], [4, 5, 6, 7]
    req = SimpleNamespace(prompt=["kept", "cut"], truncate_prompt_tokens=3)
    assert _echo_texts(state, req, [whole, cut[-3:]], [whole, cut]) == ["kept", "<decoded 3>"]
    req = SimpleNamespace(prompt=[[1, 2, 3]], truncate_prompt_tokens=None)
    assert _echo_texts(state, req, [whole], [whole]) == ["<decoded 3>"]
