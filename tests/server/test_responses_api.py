"""OpenAI's Responses API (docs/responses-api.md): /v1/responses answers as the chat endpoint
would (same prompt, same tokens), in the Response object's shape and the typed stream
events the official SDK reads; the store keeps responses for previous_response_id and GET
only where the operator turned it on, each for its own tenant's keys."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvserve.server.auth import ApiKey
from kvserve.server.errors import APIError
from kvserve.server.response_store import ResponseStore

from .helpers import LiveServer, wait_for

TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                       "required": ["city"], "additionalProperties": False}}
PICK = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    with LiveServer(max_model_len=256) as server:
        server.state.responses = ResponseStore(enabled=True, capacity=4)
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def post(live: LiveServer, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(live.url + "/v1/responses", json={"model": "tiny", **body},
                      headers=headers, timeout=60)


def test_a_response_is_the_chat_answer_in_the_response_shape(client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
    response = client.responses.create(
        model="tiny", instructions="Be brief.", max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}],
        extra_body={"ignore_eos": True})
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 6
    assert response.usage.total_tokens == chat.usage.prompt_tokens + 6
    # cut by max_output_tokens: incomplete, as OpenAI says it
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert response.instructions == "Be brief." and response.max_output_tokens == 6
    assert response.model_extra["kvserve"]["num_preemptions"] == 0
    assert response.tool_choice == "auto"  # OpenAI's echo with no tools too


def test_a_stream_sends_the_typed_events_in_order(client):
    events = list(client.responses.create(model="tiny", input="Hello", max_output_tokens=5,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 5
    whole = client.responses.create(model="tiny", input="Hello", max_output_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert whole.output_text == text
    ids = {event.item_id for event in events if hasattr(event, "item_id")}
    assert ids == {final.output[0].id}


def test_the_sdk_stream_helper_gets_a_completed_response(client):
    with client.responses.stream(model="tiny", input="Hi", max_output_tokens=40,
                                 temperature=0, text={"format": {
                                     "type": "json_schema", "name": "pick",
                                     "schema": PICK}}) as stream:
        deltas = [event.delta for event in stream
                  if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert json.loads(final.output_text)["answer"] in ("yes", "no") and "".join(deltas) == \
        final.output_text
    assert final.text.format.type == "json_schema"


def test_a_named_function_answers_with_a_function_call_item(client):
    response = client.responses.create(model="tiny", input="Weather?", tools=[TOOL],
                                       tool_choice={"type": "function",
                                                    "name": "get_weather"},
                                       max_output_tokens=60, temperature=0)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert response.status == "completed"
    # streamed: the arguments delta by delta, the same call
    events = list(client.responses.create(model="tiny", input="Weather?", tools=[TOOL],
                                          tool_choice={"type": "function",
                                                       "name": "get_weather"},
                                          max_output_tokens=60, temperature=0, stream=True))
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments
    # the call and its output sent back as input items: the conversation goes on
    follow = client.responses.create(
        model="tiny", max_output_tokens=3, temperature=0, input=[
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > response.usage.input_tokens


def test_previous_response_id_continues_the_conversation_from_the_cache(client, live):
    first = client.responses.create(model="tiny", input="x " * 40, max_output_tokens=4,
                                    temperature=0)
    second = client.responses.create(model="tiny", input="And then?", max_output_tokens=4,
                                     temperature=0, previous_response_id=first.id)
    # the whole conversation again, its leading blocks found in the prefix cache
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 32
    assert second.previous_response_id == first.id
    # the same as sending the conversation outright
    outright = _sent_outright(client, first)
    assert outright.usage.input_tokens == second.usage.input_tokens
    assert outright.output_text == second.output_text
    assert client.responses.retrieve(second.id).output_text == second.output_text
    # instructions are the request's own: the next one does not inherit them (OpenAI's)
    briefed = client.responses.create(model="tiny", input="x " * 40, max_output_tokens=4,
                                      temperature=0, instructions="Answer in French.")
    after = client.responses.create(model="tiny", input="And then?", max_output_tokens=4,
                                    temperature=0, previous_response_id=briefed.id)
    assert after.usage.input_tokens == _sent_outright(client, briefed).usage.input_tokens


def _sent_outright(client, first):
    """The conversation that chains onto ``first`` with "And then?", sent whole."""
    return client.responses.create(model="tiny", max_output_tokens=4, temperature=0,
                                   input=[{"role": "user", "content": "x " * 40},
                                          {"role": "assistant", "content": first.output_text},
                                          {"role": "user", "content": "And then?"}])


def test_the_store_keeps_the_latest_and_forgets_deleted(client, live):
    ids = [client.responses.create(model="tiny", input=f"n{i}", max_output_tokens=1).id
           for i in range(5)]  # capacity 4: the first is dropped
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[1]).id == ids[1]
    client.responses.delete(ids[1])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    refused = post(live, {"input": "more", "previous_response_id": ids[1]})
    assert refused.status_code == 404 and refused.json()["error"]["param"] == \
        "previous_response_id"
    unstored = client.responses.create(model="tiny", input="not kept", store=False,
                                       max_output_tokens=1)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_stored_response_is_its_tenants_only():
    keys = [ApiKey("key-a", "A"), ApiKey("key-b", "B")]
    with LiveServer(keys=keys, max_model_len=256) as live:
        live.state.responses = ResponseStore(enabled=True)
        made = post(live, {"input": "secret", "max_output_tokens": 2}, key="key-a")
        assert made.status_code == 200, made.text
        response_id = made.json()["id"]
        url = f"{live.url}/v1/responses/{response_id}"
        assert httpx.get(url, headers={"Authorization": "Bearer key-a"}).status_code == 200
        other = httpx.get(url, headers={"Authorization": "Bearer key-b"})
        assert other.status_code == 404  # not 403: another tenant learns nothing
        chained = post(live, {"input": "go on", "previous_response_id": response_id},
                       key="key-b")
        assert chained.status_code == 404
        assert httpx.delete(url, headers={"Authorization": "Bearer key-b"}).status_code == 404
        assert httpx.get(url).status_code == 401


def test_one_tenant_cannot_push_out_anothers_responses():
    """QA: the store was one list: another tenant's requests evicted these."""
    keys = [ApiKey("key-a", "A"), ApiKey("key-b", "B")]
    with LiveServer(keys=keys, max_model_len=256) as live:
        live.state.responses = ResponseStore(enabled=True, capacity=2)
        mine = post(live, {"input": "mine", "max_output_tokens": 1}, key="key-a").json()["id"]
        theirs = [post(live, {"input": f"t{i}", "max_output_tokens": 1}, key="key-b").json()
                  ["id"] for i in range(3)]
        url = f"{live.url}/v1/responses/"
        assert httpx.get(url + mine, headers={"Authorization": "Bearer key-a"}
                         ).status_code == 200
        assert httpx.get(url + theirs[0], headers={"Authorization": "Bearer key-b"}
                         ).status_code == 404  # B's own oldest: B's capacity is 2


def test_the_store_keeps_a_tenant_within_its_bytes_too():
    """QA: bounded by count only, one client's 4 MiB responses (a thousand tools, kept and
    echoed) grew the server by gigabytes."""
    from kvserve.server.response_store import Stored

    def stored(owner: str, text: str) -> Stored:
        return Stored(owner, {"output_text": text}, [], [])

    size = stored("A", "x" * 1000).size
    store = ResponseStore(enabled=True, capacity=100, max_bytes=3 * size)
    for index in range(5):
        store.put(f"a{index}", stored("A", "x" * 1000))
    store.put("b0", stored("B", "x" * 1000))
    assert list(store.kept["A"]) == ["a2", "a3", "a4"] and store.used["A"] == 3 * size
    store.delete("a3", "A")
    assert store.used["A"] == 2 * size
    store.put("huge", stored("A", "x" * 10_000))  # alone past the bound: not kept
    assert list(store.kept["A"]) == ["a2", "a4"] and store.used["A"] == 2 * size
    assert list(store.kept["B"]) == ["b0"]
    with pytest.raises(APIError, match=f"latest 100 responses within {3 * size:,} bytes"):
        store.get("a3", "A")


def test_without_the_store_nothing_is_kept_and_chaining_says_why():
    with LiveServer(max_model_len=256) as live:
        made = post(live, {"input": "hello", "max_output_tokens": 2})
        assert made.status_code == 200 and made.json()["store"] is False  # served, as vLLM
        gone = httpx.get(f"{live.url}/v1/responses/{made.json()['id']}")
        assert gone.status_code == 404 and "store is off" in gone.json()["error"]["message"]
        chained = post(live, {"input": "more", "previous_response_id": made.json()["id"]})
        assert chained.status_code == 400
        assert "--enable-responses-store" in chained.json()["error"]["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "bogus": 1}, "bogus"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input"),  # QA
    ({}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input.0.type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools.0.name"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": ["hi"]}, "input.0"),
    ({"input": 7}, "input"),
    ({"input": "x", "max_output_tokens": 9000}, "max_output_tokens"),  # past the context
    ({"input": "a " * 3000}, "input"),  # a long string is taken, and too long for 256
    ({"input": "x", "tools": [{"type": "file_search", "name": "f"}]}, "tools.0.type"),
    ({"input": "x", "tools": [TOOL]}, "tool_choice"),  # auto: no tool-call parser
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                        "schema": {"type": "string", "pattern": "a"}}}},
     "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "model": "other"}, None),
    ({"input": "x", "tools": [{"name": "f"}]}, "tools.0.type"),  # QA: "tool type None"
    ({"input": "x", "text": {"format": {"type": "json_object", "schema": {}}}},
     "text.format.schema"),  # QA: taken, the schema ignored
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 1}]},
     "input.0.arguments"),
    # QA: taken, the id an object, the status "banana", an output of no call
    ({"input": [{"role": "user", "content": "x", "id": {"a": 1}}]}, "input.0.id"),
    ({"input": [{"role": "user", "content": "x", "status": "banana"}]}, "input.0.status"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "c9", "output": "ok"}]}, "input"),
    # QA (Responses pass): a call with no output was taken; OpenAI answers 400
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     "input"),
    # QA (fuzz): "min_tokens must be an integer in [0, max_tokens=2]"
    ({"input": "x", "max_output_tokens": 2, "min_tokens": 5}, "min_tokens"),
])
def test_bad_requests_name_the_field(live, body, param):
    response = httpx.post(live.url + "/v1/responses", json=body, timeout=60)
    expected = 404 if body.get("model") == "other" else 400
    assert response.status_code == expected, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    assert error["message"] and "literal[" not in error["message"]
    assert "max_tokens" not in error["message"]
    assert "None" not in error["message"]
    if param == "input.0.arguments":  # "" is arguments too (QA: "non-empty")
        assert "must be a string" in error["message"]
    if body.get("input") == "a " * 3000:  # refused for its tokens, not its characters
        assert "tokens" in error["message"] and "4096" not in error["message"]


def test_what_openai_writes_in_replayed_items_is_taken(client):
    """QA: a replayed assistant message's phase, a call's caller, namespace and async, an
    output's name, caller and namespace (OpenAI's fields, in the SDK's
    ``model_dump(by_alias=True)``) were refused as unknown."""
    response = client.responses.create(model="tiny", max_output_tokens=2, input=[
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "phase": "final_answer", "id": "msg_1",
         "status": "completed",
         "content": [{"type": "output_text", "text": "hello", "annotations": [],
                      "logprobs": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
         "caller": None, "namespace": None, "async": None},
        {"type": "function_call_output", "call_id": "c1", "output": "ok", "name": "f",
         "caller": None, "namespace": None}])
    assert response.usage.input_tokens > 10


def test_the_request_fields_openai_echoes_are_echoed(client):
    response = client.responses.create(model="tiny", input="hi", max_output_tokens=1,
                                       prompt_cache_key="k1", safety_identifier="u1")
    assert (response.prompt_cache_key, response.safety_identifier) == ("k1", "u1")


def test_a_stored_responses_input_items_are_listed(client, live):
    made = client.responses.create(model="tiny", max_output_tokens=1, input=[
        {"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    listed = client.responses.input_items.list(made.id)
    assert [item.content[0].text for item in listed.data] == ["two", "one"]  # desc
    ascending = httpx.get(f"{live.url}/v1/responses/{made.id}/input_items",
                          params={"order": "asc", "limit": 1}).json()
    assert ascending["has_more"] is True and len(ascending["data"]) == 1
    assert ascending["data"][0]["content"] == [{"type": "input_text", "text": "one"}]
    after = httpx.get(f"{live.url}/v1/responses/{made.id}/input_items",
                      params={"order": "asc", "after": ascending["last_id"]}).json()
    assert [item["content"][0]["text"] for item in after["data"]] == ["two"]
    text = client.responses.create(model="tiny", max_output_tokens=1, input="plain")
    [item] = client.responses.input_items.list(text.id).data
    assert (item.role, item.content[0].text) == ("user", "plain")
    called = client.responses.create(model="tiny", max_output_tokens=1, input=[
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": None},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}])
    assert all(item.id for item in client.responses.input_items.list(called.id).data)
    for limit in ("²", "0", "101", "x"):  # QA: "²" isdigit and int() failed, a 500
        refused = httpx.get(f"{live.url}/v1/responses/{made.id}/input_items",
                            params={"limit": limit})
        assert refused.status_code == 400 and "'limit' must be" in refused.text


def test_nothing_is_left_behind(client, live):
    client.responses.create(model="tiny", input="last", max_output_tokens=2)
    assert live.idle()


@pytest.mark.parametrize(("flag", "env", "enabled"), [
    (False, None, False), (True, None, True), (False, "1", True), (False, "true", True),
    (False, "0", False)])
def test_the_store_is_turned_on_by_the_flag_or_vllms_variable(monkeypatch, flag, env, enabled):
    import argparse

    from kvserve.server.cli_serve import _response_store

    if env is None:
        monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE", raising=False)
    else:
        monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", env)
    store = _response_store(argparse.Namespace(enable_responses_store=flag,
                                               responses_store_size=8,
                                               responses_store_memory=1 << 20))
    assert store.enabled is enabled and (store.capacity, store.max_bytes) == (8, 1 << 20)


def test_text_and_calls_of_one_turn_replay_as_one_assistant_message(client):
    """QA: a message item then its function_call became two assistant turns (more tokens
    than chat's one message with content and tool_calls)."""
    items = client.responses.create(model="tiny", max_output_tokens=1, input=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me check."},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    chat = client.chat.completions.create(model="tiny", max_tokens=1, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert items.usage.input_tokens == chat.usage.prompt_tokens


def test_a_background_response_is_polled_to_its_end(client, live):
    """OpenAI's background mode (with the store): answered at once, queued; GET reads it
    until it completes, with the same answer a request would have had."""
    made = client.responses.create(model="tiny", input="Say hi.", max_output_tokens=6,
                                   temperature=0, background=True)
    assert made.background is True and made.status in ("queued", "in_progress")
    deadline = time.monotonic() + 60
    while (now := client.responses.retrieve(made.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response never ended"
        time.sleep(0.05)
    assert now.status in ("completed", "incomplete") and now.background is True
    plain = client.responses.create(model="tiny", input="Say hi.", max_output_tokens=6,
                                    temperature=0)
    assert now.output_text == plain.output_text
    assert now.usage.output_tokens == plain.usage.output_tokens
    chained = client.responses.create(model="tiny", input="Again.", max_output_tokens=2,
                                      previous_response_id=now.id)
    assert chained.status in ("completed", "incomplete")
    wait_for(live.idle, what="nothing left under way")


def test_a_background_response_can_be_cancelled_and_frees_its_request():
    from .helpers import slow_engine

    with LiveServer(slow_engine(0.02, max_model_len=256)) as live:
        live.state.responses = ResponseStore(enabled=True)
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        made = client.responses.create(model="tiny", input="Go on.", background=True,
                                       max_output_tokens=200, extra_body={"ignore_eos": True})
        chain = post(live, {"input": "next", "previous_response_id": made.id})
        assert chain.status_code == 400 and "still under way" in chain.text
        cancelled = client.responses.cancel(made.id)
        assert cancelled.status == "cancelled" and cancelled.error is None
        assert client.responses.retrieve(made.id).status == "cancelled"
        assert client.responses.cancel(made.id).status == "cancelled"  # again: as it is
        wait_for(live.idle, what="the cancelled request's blocks freed")
        deleted = client.responses.create(model="tiny", input="Go on.", background=True,
                                          max_output_tokens=200,
                                          extra_body={"ignore_eos": True})
        client.responses.delete(deleted.id)
        wait_for(live.idle, what="the deleted request's blocks freed")
        plain = post(live, {"input": "hi", "max_output_tokens": 1}).json()
        refused = httpx.post(f"{live.url}/v1/responses/{plain['id']}/cancel")
        assert refused.status_code == 400 and "not created in the background" in refused.text


def test_a_streamed_background_response_can_be_streamed_again(client, live):
    """background with stream (OpenAI's, vLLM's): the request streams the events, which
    are kept; GET ?stream=true&starting_after=N sends those after N again."""
    events = list(client.responses.create(model="tiny", input="Name a color.",
                                          background=True, stream=True, max_output_tokens=8,
                                          temperature=0))
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert events[0].response.status == "queued" and events[0].response.background is True
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    made = events[-1].response
    again = list(client.responses.retrieve(made.id, stream=True, starting_after=3))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[4:]]
    assert [e.sequence_number for e in client.responses.retrieve(made.id, stream=True)] == \
        list(range(len(events)))
    polled = client.responses.retrieve(made.id)
    assert polled.status == made.status and polled.output_text == made.output_text
    last = len(events) - 1  # after the last event: none; past it, a 400 (QA: an empty 200)
    assert list(client.responses.retrieve(made.id, stream=True, starting_after=last)) == []
    past = httpx.get(f"{live.url}/v1/responses/{made.id}?stream=true&starting_after="
                     f"{last + 1}", timeout=60)
    assert past.status_code == 400 and f"the stream ended at event {last}" in past.text
    wait_for(live.idle, what="nothing left under way")


@pytest.mark.parametrize(("query", "needle"), [
    ("stream=true", "has no events to stream"),  # made in the background, not streamed
    ("stream=maybe", "'stream' must be true or false"),
    ("stream=true&starting_after=x", "'starting_after' must be"),
])
def test_streaming_a_response_again_is_refused_where_it_cannot_be(client, live, query, needle):
    made = client.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                   background=True)
    wait_for(lambda: client.responses.retrieve(made.id).status not in ("queued", "in_progress"),
             what="its end")
    refused = httpx.get(f"{live.url}/v1/responses/{made.id}?{query}", timeout=60)
    assert refused.status_code == 400 and needle in refused.text


def test_a_streamed_background_response_outlives_its_reader_and_is_followed_live():
    """The request's reader going away stops nothing; a GET stream follows the response
    under way to its end; cancelled, the stream ends with the response cancelled."""
    from .helpers import slow_engine

    with LiveServer(slow_engine(0.02, max_model_len=256)) as live:
        live.state.responses = ResponseStore(enabled=True)
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        body = {"model": "tiny", "input": "Go on.", "background": True, "stream": True,
                "max_output_tokens": 30, "ignore_eos": True}
        with httpx.stream("POST", live.url + "/v1/responses", json=body, timeout=60) as reply:
            first = next(reply.iter_lines())
        assert first == "event: response.created"
        [response_id] = list(live.state.responses.kept[None])  # (its id: the store's one)
        events = list(client.responses.retrieve(response_id, stream=True, starting_after=0))
        assert events[0].sequence_number == 1 and events[-1].type == "response.incomplete"
        assert events[-1].response.usage.output_tokens == 30
        asked = {**body, "max_output_tokens": 200, "extra_body": {"ignore_eos": True}}
        del asked["ignore_eos"]
        with client.responses.create(**asked) as stream:
            cancelled_id = next(iter(stream)).response.id  # response.created's
        follower = client.responses.retrieve(cancelled_id, stream=True)
        assert client.responses.cancel(cancelled_id).status == "cancelled"
        last = list(follower)[-1]
        assert (last.type, last.response.status) == ("response.failed", "cancelled")
        wait_for(live.idle, what="nothing left running")


def test_background_needs_the_store():
    with LiveServer(max_model_len=256) as live:
        refused = post(live, {"input": "hi", "background": True})
        assert refused.status_code == 400 and "--enable-responses-store" in refused.text


def test_a_background_response_under_way_is_never_pushed_out_and_always_ends_readable():
    """QA: a running background response could be evicted by newer ones (then neither read
    nor cancelled, and back later); one larger than the store keeps stayed queued for ever,
    or was a 404 at once while it ran."""
    from .helpers import slow_engine

    with LiveServer(slow_engine(0.02, max_model_len=256)) as live:
        store = live.state.responses = ResponseStore(enabled=True, capacity=2)
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        slow = {"background": True, "max_output_tokens": 100, "extra_body": {"ignore_eos": True}}
        running = client.responses.create(model="tiny", input="Go on.", **slow)
        newer = [post(live, {"input": f"n{i}", "max_output_tokens": 1}).json()["id"]
                 for i in range(3)]
        wait_for(lambda: client.responses.retrieve(running.id).status == "in_progress",
                 what="its first token")  # from queued; pinned (never pushed out)
        assert [httpx.get(f"{live.url}/v1/responses/{i}").status_code for i in newer] == \
            [404, 404, 200]  # the ended ones went, oldest first (it counts, kept)
        assert client.responses.cancel(running.id).status == "cancelled"
        # one whose whole answer is more than the store keeps: failed, said why
        ongoing = client.responses.create(model="tiny", input="Go on.",
                                          **{**slow, "max_output_tokens": 200})
        # its queued self fits (and what says it failed), its whole answer alone does not
        store.max_bytes = store.kept[None][ongoing.id][1] + 400
        deadline = time.monotonic() + 60
        while (now := client.responses.retrieve(ongoing.id)).status in ("queued",
                                                                          "in_progress"):
            assert time.monotonic() < deadline, "never ended"
            time.sleep(0.05)
        assert now.status == "failed" and now.error.code == "response_too_large"
        assert now.usage.output_tokens == 200
        # its conversation was not kept: chaining on it or listing its input says so (QA:
        # a chain went on with no history, the list was empty)
        chained = post(live, {"input": "and?", "max_output_tokens": 1,
                              "previous_response_id": ongoing.id})
        assert chained.status_code == 400 and "conversation was not kept" in chained.text
        listed = httpx.get(f"{live.url}/v1/responses/{ongoing.id}/input_items")
        assert listed.status_code == 400 and "input items were not kept" in listed.text
        store.max_bytes = 10  # even the queued response is too large: refused, nothing runs
        refused = post(live, {"input": "x", "background": True, "max_output_tokens": 5})
        assert refused.status_code == 400 and "--responses-store-memory" in refused.text
        wait_for(live.idle, what="nothing left running")


def test_truncation_auto_drops_the_oldest_items_until_the_conversation_fits(live):
    """OpenAI's truncation "auto": a conversation longer than the context loses its
    oldest items, as few as fit; "disabled" (the default) is the context's 400."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant",
              "content": f"turn {i}: " + "words " * 20} for i in range(20)]
    turns.append({"role": "user", "content": "and now?"})
    body = {"input": turns, "max_output_tokens": 4, "instructions": "Be brief."}
    refused = post(live, body)
    assert refused.status_code == 400 and "maximum context length" in refused.text
    made = post(live, {**body, "truncation": "auto"})
    assert made.status_code == 200, made.text
    answer = made.json()
    assert answer["truncation"] == "auto" and answer["usage"]["input_tokens"] + 4 <= 256
    fewer = post(live, {**body, "truncation": "auto", "input": turns[1:]}).json()
    assert fewer["usage"]["input_tokens"] == answer["usage"]["input_tokens"]  # the same cut
    # a tool's output is never left without its call
    called = [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
              {"type": "function_call_output", "call_id": "c", "output": "words " * 60},
              *turns[-9:]]
    assert post(live, {"input": called, "max_output_tokens": 4,
                       "truncation": "auto"}).status_code == 200
    alone = post(live, {"input": "words " * 400, "truncation": "auto"})
    assert alone.status_code == 400  # the last item alone is too long: nothing to drop
    # an answer that would overrun what the input leaves is OpenAI's 400 here too (the
    # chat endpoints cut it short, as vLLM's do; review)
    over = post(live, {"input": "words " * 100, "max_output_tokens": 200})
    assert over.status_code == 400 and "'max_output_tokens' is too large" in over.text, \
        over.text
    wait_for(live.idle, what="nothing left running")


def test_a_cut_conversation_never_starts_with_a_tools_output():
    from kvserve.server.responses_api import _from

    conversation = [{"role": "user", "content": "a"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
                    {"role": "tool", "tool_call_id": "c", "content": "out"},
                    {"role": "tool", "tool_call_id": "d", "content": "out"},
                    {"role": "user", "content": "b"}]
    assert _from(conversation, 1)[0]["role"] == "assistant"
    assert _from(conversation, 2) == conversation[4:]  # the outputs go with their call
    assert _from(conversation[:4], 3) == conversation[3:4]  # the last item always stays


def test_an_input_of_reasoning_alone_says_there_is_nothing_to_answer(live):
    refused = post(live, {"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]})
    assert refused.status_code == 400 and "holds nothing to answer" in refused.text


def test_logprobs_come_with_the_message_when_included(client):
    """include message.output_text.logprobs (and top_logprobs N): the message's part
    carries each token's logprob and its N likeliest, chat's values, whole or streamed."""
    asked = {"model": "tiny", "input": "Name a color.", "max_output_tokens": 6,
             "temperature": 0, "top_logprobs": 2, "include": ["message.output_text.logprobs"]}
    response = client.responses.create(**asked)
    [part] = response.output[0].content
    assert response.top_logprobs == 2
    assert len(part.logprobs) == response.usage.output_tokens == 6
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in part.logprobs)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Name a color."}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in part.logprobs] == [
        (e.token, round(e.logprob, 4)) for e in chat]
    events = list(client.responses.create(**asked, stream=True))
    streamed = [entry for e in events if e.type == "response.output_text.delta"
                for entry in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [e.token for e in streamed] == [e.token for e in done.logprobs] == [
        e.token for e in part.logprobs]
    plain = client.responses.create(model="tiny", input="Name a color.", max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs == 0


@pytest.mark.parametrize(("fields", "needle"), [
    ({"include": ["file_search_call.results"]}, "'file_search_call.results'"),
    ({"top_logprobs": 21}, "top_logprobs"),
])
def test_logprobs_asked_wrongly_are_refused(live, fields, needle):
    response = post(live, {"model": "tiny", "input": "x", **fields})
    assert response.status_code == 400 and needle in response.json()["error"]["message"]


def test_a_thinking_answers_logprobs_are_its_messages_tokens_only():
    from kvserve.server.reasoning_parsers import make_parser

    from .helpers import scripted_engine

    said = "<think>Red or blue.</think>Blue is calm."
    asked = {"model": "tiny", "input": "Name a color.", "max_output_tokens": 40,
             "include": ["message.output_text.logprobs"]}
    with LiveServer(scripted_engine(said, max_model_len=256)) as server:
        server.state.reasoning_parser = make_parser("deepseek_r1")
        reply = httpx.post(server.url + "/v1/responses", timeout=60, json=asked).json()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        events = list(client.responses.create(**asked, stream=True))
    reasoning, message = reply["output"]
    assert reasoning["content"][0]["text"] == "Red or blue."
    text = message["content"][0]["text"]
    assert text == "Blue is calm." and reply["status"] == "completed"  # ended by its EOS
    # the message's tokens only: no </think> (QA: in the first streamed delta), no EOS
    # (QA: in .done and the response, in no delta; OpenAI lists none)
    tokens = [e["token"] for e in message["content"][0]["logprobs"]]
    assert "".join(tokens) == text and "" not in tokens
    streamed = [e.token for ev in events if ev.type == "response.output_text.delta"
                for e in ev.logprobs]
    [done] = [ev for ev in events if ev.type == "response.output_text.done"]
    assert streamed == [e.token for e in done.logprobs] == tokens


def test_a_message_ending_inside_a_characters_bytes_keeps_its_last_tokens_logprobs():
    """QA: "✓" is three tokens here; a message ending in one lost its last token's
    logprobs in the answer and in .done (the prefix one token short decoded as "✓\ufffd",
    as long as the text), where the deltas and chat had them all."""
    from .helpers import scripted_engine

    said = "Done ✓✓"
    asked = {"model": "tiny", "input": "Tick.", "max_output_tokens": 40,
             "include": ["message.output_text.logprobs"]}
    with LiveServer(scripted_engine(said, max_model_len=256)) as server:
        reply = httpx.post(server.url + "/v1/responses", timeout=60, json=asked).json()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        events = list(client.responses.create(**asked, stream=True))
    part = reply["output"][0]["content"][0]
    assert part["text"] == said
    assert len(part["logprobs"]) == reply["usage"]["output_tokens"] - 1 == 6  # not the EOS
    assert sum(len(e["bytes"]) for e in part["logprobs"]) == len(said.encode())
    streamed = [e.token for ev in events if ev.type == "response.output_text.delta"
                for e in ev.logprobs]
    [done] = [ev for ev in events if ev.type == "response.output_text.done"]
    assert len(streamed) == len(done.logprobs) == 6


def test_the_answer_echoes_the_settings_it_was_served_with():
    """QA: temperature 1.0, top_p 1.0 and max_output_tokens null were echoed where the
    model's generation config (or --override-generation-config) served 0.0, 0.5 and 7; a
    verbosity and a summary asked for were echoed as medium and null."""
    with LiveServer(max_model_len=256) as server:
        server.state.sampling_defaults = {"temperature": 0.0, "top_p": 0.5, "max_tokens": 7}
        served = post(server, {"input": "hi"}).json()
        asked = post(server, {"input": "hi", "temperature": 0.7, "top_p": 0.9,
                              "max_output_tokens": 3, "text": {"verbosity": "low"},
                              "reasoning": {"summary": "auto"}}).json()
    assert (served["temperature"], served["top_p"], served["max_output_tokens"]) == \
        (0.0, 0.5, 7)
    assert served["usage"]["output_tokens"] <= 7
    assert (asked["temperature"], asked["top_p"], asked["max_output_tokens"]) == (0.7, 0.9, 3)
    assert asked["text"]["verbosity"] == "low" and asked["reasoning"]["summary"] == "auto"
    assert served["text"]["verbosity"] == "medium"  # OpenAI's default, none asked


def test_an_answer_larger_than_the_store_keeps_says_it_was_not_stored():
    with LiveServer(max_model_len=256) as server:
        server.state.responses = ResponseStore(enabled=True, capacity=4, max_bytes=20_000)
        kept = post(server, {"input": "hi", "max_output_tokens": 1}).json()
        huge = post(server, {"input": "hi", "max_output_tokens": 1, "tool_choice": "none",
                             "tools": [{"type": "function", "name": "f",
                                        "description": "d" * 25_000}]}).json()
        assert kept["store"] is True and huge["store"] is False
        assert httpx.get(f"{server.url}/v1/responses/{huge['id']}").status_code == 404


def test_a_background_response_ended_by_its_queue_deadline_says_so():
    """QA: polled, it read failed with code "aborted" and an operator's abort, where
    every other mode answers queue_timeout (retry later)."""
    from .helpers import slow_engine

    with LiveServer(slow_engine(0.01, max_model_len=256, max_num_seqs=1)) as server:
        server.state.responses = ResponseStore(enabled=True, capacity=4)
        blocker = post(server, {"input": "Go on.", "background": True,
                                "max_output_tokens": 200, "ignore_eos": True}).json()
        wait_for(lambda: server.state.engine.stats.num_running == 1, what="the blocker")
        late = post(server, {"input": "q", "background": True, "max_output_tokens": 2,
                             "max_queue_delay": 0.05}).json()
        wait_for(lambda: httpx.get(f"{server.url}/v1/responses/{late['id']}").json()[
            "status"] == "failed", what="the deadline")
        error = httpx.get(f"{server.url}/v1/responses/{late['id']}").json()["error"]
        assert error["code"] == "queue_timeout" and error["message"].startswith(
            "queue timeout")
        httpx.post(f"{server.url}/v1/responses/{blocker['id']}/cancel")
        wait_for(server.idle, what="idle")


def test_openais_newer_values_are_taken_and_the_tier_served_is_named(live):
    """QA (Responses pass): reasoning.effort "none", service_tier "flex" and
    prompt_cache_retention were 400s; there is nothing here for them to set, and the answer
    names the tier it was served in, "default", as OpenAI names the tier used."""
    reply = post(live, {"input": "hi", "max_output_tokens": 2, "service_tier": "flex",
                        "reasoning": {"effort": "none"}, "prompt_cache_retention": "24h"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["service_tier"] == "default"


def test_a_conversation_too_long_is_named_in_the_responses_words(live):
    """QA (Responses pass): the 400 said "shorten the messages", a chat word."""
    reply = post(live, {"input": "a " * 3000, "truncation": "disabled"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"
    assert "messages" not in reply.json()["error"]["message"], reply.text


def test_an_item_reference_reads_the_stored_item_it_names(live):
    """QA (Responses pass): OpenAI's item_reference (SDKs send earlier turns' items so when
    they are stored) was a 400; it stands for the stored item of that id, an earlier
    response's output or input item."""
    first = post(live, {"input": "Say hi", "max_output_tokens": 3, "temperature": 0}).json()
    [answer] = first["output"]
    [asked] = httpx.get(f"{live.url}/v1/responses/{first['id']}/input_items",
                        timeout=30).json()["data"]
    by_reference = post(live, {"input": [
        {"type": "item_reference", "id": asked["id"]},
        {"id": answer["id"]},  # its type is optional, as OpenAI's
        {"role": "user", "content": "Again"}], "max_output_tokens": 1})
    spelled = post(live, {"input": [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": answer["content"][0]["text"]},
        {"role": "user", "content": "Again"}], "max_output_tokens": 1})
    assert by_reference.status_code == 200, by_reference.text
    assert by_reference.json()["usage"]["input_tokens"] == \
        spelled.json()["usage"]["input_tokens"]
    missing = post(live, {"input": [{"type": "item_reference", "id": "msg_none"}]})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "input.0.id"
