"""--reasoning-parser (server/reasoning_parsers.py, vLLM's): a thinking model's
<think>...</think> goes out as the chat message's ``reasoning``, the rest as its content,
whole or streamed as it comes."""

from __future__ import annotations

import json

import openai
import pytest

from kvserve.server.reasoning_parsers import ReasoningStream, make_parser

from .helpers import LiveServer, scripted_engine


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), [
    ("deepseek_r1", "<think>\nHmm, 2+2.\n</think>\n\nIt is 4.", "\nHmm, 2+2.\n",
     "\n\nIt is 4."),  # as written, as vLLM's: a stream's pieces add up to them
    ("deepseek_r1", "Hmm, 2+2.</think>It is 4.", "Hmm, 2+2.", "It is 4."),  # opened in
    # the prompt, as R1's template does
    ("deepseek_r1", "Still thinking", "Still thinking", None),  # cut short
    ("deepseek_r1", "<think></think>Just 4.", None, "Just 4."),
    ("deepseek_r1", "<think>\n\n</think>\n\nHello.", "\n\n", "\n\nHello."),  # QA
    ("deepseek_r1", "<think>only thinking</think>", "only thinking", None),
    ("qwen3", "<think>a</think>b", "a", "b"),
    ("qwen3", "No thinking here.", None, "No thinking here."),  # enable_thinking false
    ("qwen3", "<think>unfinished", "unfinished", None),
    ("qwen3", "x</think>y", None, "x</think>y"),  # not opened: it did not think
])
def test_the_thinking_is_split_off(name, text, reasoning, content):
    assert make_parser(name).split(text) == (reasoning, content)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", ["<think>\nHmm, 2+2.\n</think>\n\nIt is 4.",
                                  "Hmm.</think>Four.", "Plain answer, no thinking.",
                                  "<think>cut sho", "<think>\n\n</think>\n\nHello there.",
                                  "  <think>a</think>", "<think>a</thi"])
def test_a_stream_adds_up_to_the_whole_split(name, text):
    """Fed one character at a time, the pieces add up to what the whole answer splits into
    (up to the whitespace a stream sends as it comes), and no piece of </think> leaks."""
    parser = make_parser(name)
    stream = ReasoningStream(parser)
    reasoning = content = ""
    for end in range(1, len(text) + 1):
        new_reasoning, new_content = stream.feed(text[:end], end == len(text))
        reasoning, content = reasoning + new_reasoning, content + new_content
        assert "</" not in reasoning[-3:] or end == len(text)
    whole_reasoning, whole_content = parser.split(text)
    assert (reasoning, content) == (whole_reasoning or "", whole_content or "")
    assert "<think>" not in reasoning and "</think>" not in reasoning
    if whole_reasoning is not None:  # it thought: no marker in the answer either
        assert "<think>" not in content and "</think>" not in content


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="choose one of deepseek_r1, qwen3"):
        make_parser("granite")


SAID = "<think>The user greets me.</think>Hello!"


@pytest.fixture(scope="module")
def client():
    with LiveServer(scripted_engine(SAID, max_model_len=512)) as live:
        live.state.reasoning_parser = make_parser("deepseek_r1")
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)


def _chat(client, **fields):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], **{"max_tokens": 40,
                                                                       **fields})


def test_a_chat_answer_carries_the_reasoning_apart(client):
    message = _chat(client).choices[0].message
    assert (message.model_extra["reasoning"], message.content) == ("The user greets me.",
                                                                   "Hello!")
    chunks = list(_chat(client, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(d.model_extra.get("reasoning") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (streamed, content) == ("The user greets me.", "Hello!")
    assert chunks[-1].choices[0].finish_reason == "stop"
    hidden = _chat(client, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.content == "Hello!" and "reasoning" not in hidden.model_extra


def test_an_answer_held_to_a_form_thinks_first(client):
    """vLLM's reasoning-aware structured outputs: the form holds from the end of the
    thinking on, so the thinking is the reasoning and the form's text the content (a choice
    the scripted text spells)."""
    reply = _chat(client, extra_body={"structured_outputs": {"choice": ["Hello!"]}})
    message = reply.choices[0].message
    assert (message.model_extra["reasoning"], message.content) == ("The user greets me.",
                                                                   "Hello!")


def test_a_named_call_cut_short_while_thinking_is_no_call(client):
    """QA: the answer ended in its thinking and the call went out with arguments "", which
    no client reads as JSON; there is no call, only the reasoning and finish_reason
    length, whole and streamed."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    named = {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}},
             "max_tokens": 12}  # its thinking, not its end
    [choice] = _chat(client, **named).choices
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.model_extra["reasoning"]
    chunks = list(_chat(client, stream=True, **named))
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_json_answer_thinks_before_its_object_on_the_real_sampler():
    """The tiny model never writes </think>: with the thinking open (deepseek_r1) nothing
    holds it, so all it writes is reasoning; where the template closed the thinking in the
    prompt, the JSON holds from the first token and nothing is split off."""
    from kvserve.engine.llm import build_engine
    from kvserve.model.tokenizer import load_tokenizer

    from .helpers import TINY

    own = load_tokenizer(None)
    own.set_chat_template(THINKING_TEMPLATE)
    engine = build_engine(TINY, tokenizer=own, num_kv_blocks=64, max_model_len=512)
    with LiveServer(engine) as live:
        live.state.reasoning_parser = make_parser("deepseek_r1")
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        json_mode = {"response_format": {"type": "json_object"}, "temperature": 0}
        message = _chat(client, **json_mode).choices[0].message
        assert message.content is None
        assert not message.model_extra["reasoning"].lstrip().startswith("{")  # not held
        closed = _chat(client, **json_mode,
                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        message = closed.choices[0].message
        assert message.content.startswith("{") and "reasoning" not in message.model_extra


# Qwen3's way: thinking opened by the model, or closed in the prompt when turned off; with
# open_think the prompt opens it (DeepSeek R1's, Qwen3 2507's)
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}"
    "<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% elif open_think is defined %}<think>\n{% endif %}"
    "{% endif %}")


@pytest.mark.parametrize(("parser", "kwargs", "reasoning", "content"), [
    ("deepseek_r1", {}, "x", "y"),
    ("deepseek_r1", {"enable_thinking": False}, None, "x</think>y"),  # closed: not split
    ("qwen3", {}, None, "x</think>y"),  # not opened, by the prompt or the answer
    ("qwen3", {"open_think": True}, "x", "y"),  # opened by the prompt
])
def test_the_prompts_end_says_whether_the_answer_thinks(parser, kwargs, reasoning,
                                                         content):
    from kvserve.engine.llm import build_engine
    from kvserve.model.tokenizer import load_tokenizer

    from .helpers import TINY, ScriptedExecutor

    own = load_tokenizer(None)
    own.set_chat_template(THINKING_TEMPLATE)
    engine = build_engine(TINY, tokenizer=own, num_kv_blocks=64, max_model_len=512)
    engine.executor = ScriptedExecutor(engine.executor, own.encode("x</think>y"),
                                       TINY.eos_token_id)
    with LiveServer(engine) as live:
        live.state.reasoning_parser = make_parser(parser)
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        message = _chat(client, extra_body={"chat_template_kwargs": kwargs}).choices[0].message
        assert (message.model_extra.get("reasoning"), message.content) == (reasoning, content)


def test_the_prompt_decides_the_answers_thinking():
    parser = make_parser("qwen3")
    assert parser.for_prompt("<|assistant|>") is parser
    assert parser.for_prompt("<|assistant|><think>\n").opened
    assert parser.for_prompt("<|assistant|><think>\n\n</think>\n\n") is None
    assert make_parser("deepseek_r1").for_prompt("x").opened


def test_a_replayed_reasoning_is_taken_and_left_out_of_the_prompt(client):
    """A client sends back the assistant message it got (vLLM's reasoning field, or the
    older reasoning_content): taken, not rendered (QA: reasoning_content was refused)."""
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "and?"}]
    with_reasoning = [plain[0], {**plain[1], "reasoning": "The user greets me.",
                                 "reasoning_content": "The user greets me."}, plain[2]]
    tokens = [client.chat.completions.create(model="tiny", messages=m, max_tokens=1)
              .usage.prompt_tokens for m in (plain, with_reasoning)]
    assert tokens[0] == tokens[1]


def test_the_tool_parser_reads_the_content_after_the_thinking():
    from kvserve.server.tool_parsers import make_parser as make_tool_parser

    said = '<think>Weather, so a call.</think><tool_call>{"name": "f", "arguments": {}}' \
           '</tool_call>'
    with LiveServer(scripted_engine(said, max_model_len=512)) as live:
        live.state.reasoning_parser = make_parser("deepseek_r1")
        live.state.tool_parser = make_tool_parser("hermes")
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        message = _chat(client, tools=tools).choices[0].message
        assert message.model_extra["reasoning"] == "Weather, so a call."
        assert [call.function.name for call in message.tool_calls] == ["f"]
        assert message.content is None


def test_the_responses_api_gives_a_reasoning_item_then_the_message(client):
    whole = client.responses.create(model="tiny", input="hi", max_output_tokens=40)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user greets me."
    assert message.type == "message" and whole.output_text == "Hello!"
    details = whole.usage.output_tokens_details
    assert 0 < details.reasoning_tokens < whole.usage.output_tokens
    events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=40,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index(
        "response.reasoning_text.done") < kinds.index("response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, said) == ("The user greets me.", "Hello!")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]


def test_a_plain_answer_with_tools_streams_as_it_comes_on_the_responses_api():
    """QA: with tools (every agent has some) and auto, a plain answer came in one delta at
    the end on /v1/responses (chat streamed it)."""
    from kvserve.server.tool_parsers import make_parser as make_tool_parser

    with LiveServer(scripted_engine("Hello there, my good friend.", max_model_len=512)) as live:
        live.state.tool_parser = make_tool_parser("hermes")
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        tools = [{"type": "function", "name": "f", "parameters": {}}]
        events = list(client.responses.create(model="tiny", input="hi", tools=tools,
                                              max_output_tokens=40, stream=True))
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert len(deltas) > 3 and "".join(deltas) == "Hello there, my good friend."
        assert events[-1].type == "response.completed"


@pytest.mark.parametrize("said", ["<think>\n\n</think>\n\nHello there.",
                                  "<think>abc</think>The answer is long and goes on and on.",
                                  "<think>only thinking</think>"])
def test_a_responses_stream_agrees_with_its_whole_answer(said):
    """QA: whitespace-only thinking made the SDK's stream helper raise (a reasoning item
    streamed at index 0 and missing from the final output, the message added twice); a cut
    answer's finished thinking flipped to incomplete; all thinking left an empty message."""
    with LiveServer(scripted_engine(said, max_model_len=512)) as live:
        live.state.reasoning_parser = make_parser("deepseek_r1")
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        with client.responses.stream(model="tiny", input="hi", max_output_tokens=12) as stream:
            events = list(stream)
        final = events[-1].response
        added = [(e.output_index, e.item.type) for e in events
                 if e.type == "response.output_item.added"]
        done = {e.output_index: e.item for e in events if e.type == "response.output_item.done"}
        assert added == [(i, item.type) for i, item in enumerate(final.output)]
        assert [done[i].model_dump() for i in range(len(final.output))] == \
            [item.model_dump() for item in final.output]
        for kind, part in (("reasoning_text", "reasoning"), ("output_text", "message")):
            deltas = "".join(e.delta for e in events if e.type == f"response.{kind}.delta")
            items = [item for item in final.output if item.type == part]
            assert deltas == "".join(c.text for item in items for c in item.content)
        if said.endswith("</think>"):
            assert [item.type for item in final.output] == ["reasoning"]
            message = _chat(client).choices[0].message
            assert message.content is None and message.model_extra["reasoning"]
        if "long" in said:  # cut while answering: the thinking had finished
            assert final.output[0].status == "completed" and final.status == "incomplete"


def test_the_tokens_of_held_text_keep_their_logprobs_in_a_stream(client):
    """QA: the chunks the parser held back (a marker's) went out with none of their
    tokens' logprobs or ids: a stream had fewer logprob entries than the whole answer."""
    whole = _chat(client, logprobs=True).choices[0].logprobs.content
    chunks = list(_chat(client, logprobs=True, stream=True,
                        extra_body={"return_token_ids": True}))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs
                for entry in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole]
    ids = [i for c in chunks if c.choices for i in c.choices[0].model_extra.get("token_ids")
           or ()]
    assert len(ids) == len(whole)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_thinks_first(stream):
    said = '<think>The user wants f.</think>\n{"city": "Paris"}'
    with LiveServer(scripted_engine(said, max_model_len=512)) as live:
        live.state.reasoning_parser = make_parser("deepseek_r1")
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
        named = {"type": "function", "function": {"name": "f"}}
        reply = _chat(client, tools=tools, tool_choice=named, stream=stream)
        if not stream:
            message = reply.choices[0].message
            reasoning, calls = message.model_extra["reasoning"], message.tool_calls
            arguments = calls[0].function.arguments
        else:
            chunks = [c for c in reply if c.choices]
            assert chunks[-1].choices[0].finish_reason == "stop"  # the EOS chunk's
            deltas = [c.choices[0].delta for c in chunks]
            reasoning = "".join(d.model_extra.get("reasoning") or "" for d in deltas)
            arguments = "".join(call.function.arguments or "" for d in deltas
                                for call in d.tool_calls or [])
            assert not "".join(d.content or "" for d in deltas).strip()
            # the call goes out once the thinking is over, and no delta is empty (QA: the
            # call went out first, then an empty delta a thinking token)
            calls = [i for i, d in enumerate(deltas) if d.tool_calls]
            thoughts = [i for i, d in enumerate(deltas) if d.model_extra.get("reasoning")]
            assert max(thoughts) < min(calls)
            assert all(d.tool_calls[0].function.arguments for d in deltas[min(calls) + 1:]
                       if d.tool_calls)
        events = list(client.responses.create(
            model="tiny", input="hi", max_output_tokens=40, stream=True,
            tools=[{"type": "function", "name": "f", "parameters": tools[0]["function"][
                "parameters"]}], tool_choice={"type": "function", "name": "f"}))
        final = events[-1].response
        assert [item.type for item in final.output] == ["reasoning", "function_call"]
        added = [(e.output_index, e.item.type) for e in events
                 if e.type == "response.output_item.added"]
        assert added == [(0, "reasoning"), (1, "function_call")]
        assert json.loads(final.output[1].arguments) == {"city": "Paris"}
        assert reasoning == "The user wants f."
        assert json.loads(arguments) == {"city": "Paris"}
