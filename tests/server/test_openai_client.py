"""The official openai client is the compatibility test (docs/architecture.md, rule 4)."""

from __future__ import annotations

import openai
import pytest

from .helpers import LiveServer, wait_for


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completion_from_text(client, server):
    result = client.completions.create(model="tiny", prompt="Hello, my name is",
                                       max_tokens=6, temperature=0, extra_body={
                                           "ignore_eos": True})
    [choice] = result.choices
    assert choice.finish_reason == "length" and choice.text
    assert result.usage.completion_tokens == 6
    assert result.usage.prompt_tokens == len(server.engine.tokenizer.encode(
        "Hello, my name is"))
    ext = result.model_extra["kvserve"]
    assert ext["num_preemptions"] == 0 and ext["queue_time"] >= 0
    assert set(ext) >= {"prefix_hit_tokens", "num_recomputed_tokens", "longest_stall"}


def test_completion_prompt_forms(client):
    result = client.completions.create(model="tiny", prompt=["one", "two", "three"],
                                       max_tokens=3, n=2,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1, 2, 3, 4, 5]
    assert result.usage.completion_tokens == 18
    result = client.completions.create(model="tiny", prompt=[101, 102, 103], max_tokens=2,
                                       extra_body={"ignore_eos": True})
    assert result.usage.prompt_tokens == 3 and len(result.choices) == 1
    result = client.completions.create(model="tiny", prompt=[[5, 6], [7, 8, 9]], max_tokens=2,
                                       extra_body={"ignore_eos": True})
    assert result.usage.prompt_tokens == 5 and len(result.choices) == 2


def test_greedy_is_deterministic_and_seeds_are_honoured(client):
    def text(**kw):
        return client.completions.create(model="tiny", prompt="abc", max_tokens=8,
                                          extra_body={"ignore_eos": True}, **kw
                                          ).choices[0].text
    assert text(temperature=0) == text(temperature=0)
    assert text(temperature=1.0, seed=7) == text(temperature=1.0, seed=7)
    # n samples are seeded seed + k; at the top of the seed range sample 1 wraps to 0 (it
    # overflowed the range: a 500)
    top = client.completions.create(model="tiny", prompt="abc", max_tokens=8, n=2,
                                     temperature=1.0, seed=(1 << 64) - 1,
                                     extra_body={"ignore_eos": True})
    assert len(top.choices) == 2
    assert top.choices[1].text == text(temperature=1.0, seed=0)


def test_completion_stream_ends_with_usage(client):
    stream = client.completions.create(model="tiny", prompt="Once upon", max_tokens=5,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"
    assert "kvserve" in chunks[-2].model_extra


def test_chat(client):
    result = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi!"}],
        max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True})
    [choice] = result.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 4
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)


def test_chat_stream(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=4,
        stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks[1:] if c.choices[0].delta.content) >= 1


def test_stop_string_ends_the_text(client, server):
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True}
                                     ).choices[0].text
    stop = full[3:6]
    result = client.completions.create(model="tiny", prompt="abc", max_tokens=12,
                                       temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == full[:full.index(stop)]


def test_models_health_version(client, server):
    import httpx

    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert "version" in httpx.get(server.url + "/version").json()


def test_priority_through_extra_body():
    with LiveServer(scheduling_policy="priority") as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        result = client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                           extra_body={"priority": -3, "ignore_eos": True})
        assert result.usage.completion_tokens == 2
        wait_for(live.idle, what="idle")


def test_chat_stream_with_several_choices_and_logprobs(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=3, n=2,
        temperature=1.0, seed=3, stream=True, logprobs=True, top_logprobs=1,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 6
    with_logprobs = [c for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(with_logprobs) == 6


def test_streamed_completion_logprob_offsets_continue(client):
    stream = client.completions.create(model="tiny", prompt="abc", max_tokens=4, logprobs=0,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    text, offsets = "", []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            offsets += chunk.choices[0].logprobs.text_offset
            assert offsets[-1] == len(text)
            text += chunk.choices[0].text
    assert len(offsets) == 4
