"""tool_choice "auto" with a tool-call parser (server/tool_parsers.py, vLLM's
--enable-auto-tool-choice --tool-call-parser): the calls a model writes in its own format
come out as OpenAI's tool_calls, content before them as content, text without a call that
parses as the answer; a stream sends content as it comes and holds back only what may begin
a call, then each call from when its name is whole, its arguments as they are written."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvserve.server.tool_parsers import CallSoFar, ParsedCalls, Scanned, make_parser

from .helpers import LiveServer, scripted_engine

WEATHER = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Plain text.", "Plain text.", ()),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, (("get_weather", '{"city": "Oslo"}'),)),
    (f"Let me look.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>"
     '{"name": "now", "arguments": {}}</tool_call>', "Let me look.\n",  # as written
     (("get_weather", '{"city": "Oslo"}'), ("now", "{}"))),
    (f"<tool_call>{WEATHER}", None, (("get_weather", '{"city": "Oslo"}'),)),  # unclosed
    ('<tool_call>{"name": "get_weather", "arguments": {"ci', '<tool_call>{"name": '
     '"get_weather", "arguments": {"ci', ()),  # cut short: the text, as vLLM
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
     ()),  # no name
    ('<tool_call>{"name": "f", "arguments": "Paris"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "Paris"}</tool_call>', ()),  # QA: not JSON
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     (("f", '{"a": 1}'),)),  # an object's JSON text: taken
    # the block's JSON read whole: a closing tag in a string is text (QA: whole, the answer
    # was text; streamed, a call)
    ('<tool_call>{"name": "f", "arguments": {"q": "</tool_call>"}}</tool_call>', None,
     (("f", '{"q": "</tool_call>"}'),)),
    ('<tool_call>{"name": "f", "arguments": {}} junk</tool_call>',
     '<tool_call>{"name": "f", "arguments": {}} junk</tool_call>', ()),
    # both keys: the first written, as a stream reads it (QA: the stream joined the two)
    ('<tool_call>{"name": "f", "parameters": {"a": 1}, "arguments": {"b": 2}}</tool_call>',
     None, (("f", '{"a": 1}'),)),
])
def test_hermes_reads_calls_after_content(text, content, calls):
    parsed = make_parser("hermes").parse(text)
    assert (parsed.content, parsed.calls) == (content, calls)


DEEP = '{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"


@pytest.mark.parametrize(("name", "text"), [
    ("hermes", f"<tool_call>{DEEP}</tool_call>"),  # QA: RecursionError, a 500
    ("llama3_json", DEEP),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>'),  # QA: sent
    ("llama3_json", '{"name": "f", "parameters": {"a": 1e400}}'),  # Infinity
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": -Infinity}"}</tool_call>'),
    # a lone surrogate: no UTF-8 answer carries it (QA: a 500 when whole)
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": "\\udc00"}}]'),
    ("pythonic", "[f(x='\\ud800')]"),
    ("hermes", '<tool_call>{"name": "\\udc00", "arguments": {}}</tool_call>'),  # in its name
    ("llama3_json", '{"name": "\\ud800", "parameters": {}}'),
    ("mistral", "[TOOL_CALLS]hello there friend[ARGS]{}"),  # prose is no function's name
])
def test_a_call_a_strict_json_parser_cannot_read_is_left_as_text(name, text):
    parsed = make_parser(name).parse(text)
    assert (parsed.content, parsed.calls) == (text, ())


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     (("get_weather", '{"city": "Oslo"}'),)),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}',
     None, (("a", "{}"), ("b", '{"x": 1}'))),
    ("The weather is fine.", "The weather is fine.", ()),
    # text after the calls is not the answer, as the stream and vLLM's parser leave it (QA:
    # the whole answer was that text, the stream the call)
    ('{"name": "a", "parameters": {}} and more', None, (("a", "{}"),)),
    ('{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}}', None,
     (("a", "{}"), ("b", "{}"))),
    ('{"name": "a", "parameters": {}}; {"name": "b", "param', None, (("a", "{}"),)),
    ('{"city": "Oslo"}', '{"city": "Oslo"}', ()),
])
def test_llama3_json_reads_an_answer_that_is_calls(text, content, calls):
    parsed = make_parser("llama3_json").parse(text)
    assert (parsed.content, parsed.calls) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
     '{"name": "now", "arguments": {}}]', None,
     (("get_weather", '{"city": "Oslo"}'), ("now", "{}"))),
    ('Let me see.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]now[ARGS]{}',
     "Let me see.", (("get_weather", '{"city": "Oslo"}'), ("now", "{}"))),  # newer form
    ('[TOOL_CALLS]{"name": "now", "arguments": {}}', None, (("now", "{}"),)),
    ("[TOOL_CALLS] [{\"name\": \"f\", \"argu", "[TOOL_CALLS] [{\"name\": \"f\", \"argu",
     ()),  # cut short: the text
    ("[TOOL_CALLS]f[ARGS]not json", "[TOOL_CALLS]f[ARGS]not json", ()),
    # a marker inside a string is text (QA: the call was lost)
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"q": "see [ARGS] and [TOOL_CALLS]"}}]',
     None, (("f", '{"q": "see [ARGS] and [TOOL_CALLS]"}'),)),
    ('[TOOL_CALLS]f[ARGS]{"q": "a [TOOL_CALLS] b"}[TOOL_CALLS]g[ARGS]{}', None,
     (("f", '{"q": "a [TOOL_CALLS] b"}'), ("g", "{}"))),
    ('[TOOL_CALLS] [{"name": "", "arguments": {}}]',
     '[TOOL_CALLS] [{"name": "", "arguments": {}}]', ()),  # QA: a call to ""
    ('[TOOL_CALLS][ARGS]{}', '[TOOL_CALLS][ARGS]{}', ()),
    ("No call.", "No call.", ()),
    # what follows the calls read and is none is left, as the stream leaves it (QA: the
    # whole answer was the text, where the stream had sent the calls)
    ('[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{"y": ', None, (("f", '{"x": 1}'),)),
    ('[TOOL_CALLS]f[ARGS]{"x": 1} [TOOL_CALLS][{"city": 1}]', None, (("f", '{"x": 1}'),)),
    # name{...}: the brace parts the name from its arguments, vLLM's fallback (QA: text)
    ('[TOOL_CALLS]get_weather{"city": "Oslo"}', None, (("get_weather", '{"city": "Oslo"}'),)),
    ('[TOOL_CALLS]f{"x": 1}[TOOL_CALLS]g[ARGS]{}', None, (("f", '{"x": 1}'), ("g", "{}"))),
    ("[TOOL_CALLS] I think {x}", "[TOOL_CALLS] I think {x}", ()),  # prose is no name
])
def test_mistral_reads_calls_after_its_marker(text, content, calls):
    parsed = make_parser("mistral").parse(text)
    assert (parsed.content, parsed.calls) == (content, calls)


@pytest.mark.parametrize(("text", "calls"), [
    ('[get_weather(city="Oslo", days=3, exact=True, tags=("a",)), now()]',
     (("get_weather", '{"city": "Oslo", "days": 3, "exact": true, "tags": ["a"]}'),
      ("now", "{}"))),
    ("<|python_start|>[f(x=None, y={'k': [1.5]})]<|python_end|>",
     (("f", '{"x": null, "y": {"k": [1.5]}}'),)),
    ("[f(1)]", ()),  # a positional argument: no call
    ('[os.system("rm")]', ()),  # not a plain name: never a call, never run
    ("[f(x=g())]", ()),  # not a literal
    ("[f(x={1, 2})]", ()),  # a set: no JSON value
    ("[f(x=1e999)]", ()),  # infinite
    ("[f(**k)]", ()),
    ("Hello [f()]", ()),
    ("[" * 3000 + "]" * 3000, ()),  # too deep for the parser: text, not a 500
    ("[f(x=", ()),
    ("[f(a=1, a=2)]", ()),  # QA: taken, a=2
    ("[f(x={None: 1, 1: 2, True: 3})]", ()),  # QA: a value lost
    ("[f(x={'k': [{'j': 1}]})]", (("f", '{"x": {"k": [{"j": 1}]}}'),)),
])
def test_pythonic_reads_an_answer_that_is_a_list_of_calls(text, calls):
    parsed = make_parser("pythonic").parse(text)
    assert parsed.calls == calls
    assert parsed.content == (None if calls else text)


@pytest.mark.parametrize(("name", "text", "end"), [
    ("hermes", "Sure, I", 7),
    ("hermes", "Sure <tool", 5),  # may begin a call: held back
    ("hermes", "Sure <tool_call>{", 5),
    ("hermes", "a < b", 5),
    ("llama3_json", "  ", 0),
    ("llama3_json", "{", 0),
    ("llama3_json", "<|python", 0),
    ("llama3_json", "The answer", 10),
    ("mistral", "Sure [TOOL", 5),
    ("mistral", "Sure [TOOL_CALLS][", 5),
    ("mistral", "a [b] c", 7),
    ("pythonic", " [", 0),
    ("pythonic", "<|python_st", 0),
    ("pythonic", "Hello", 5),
])
def test_a_stream_holds_back_only_what_may_begin_a_call(name, text, end):
    assert make_parser(name).content_end(text) == end


STREAMED = [
    ("hermes", f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>"
               '{"arguments": {"q": "a \\"}\\" [x]", "n": [1, {"b": null}], "f": -1.5e3},'
               ' "name": "search"}</tool_call>'),  # the name after the arguments
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "now"}</tool_call>'),  # no arguments: {}
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 12}} ; '
                    '{"name": "b", "arguments": {"y": true}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "now", "arguments": {}}]'),
    ("mistral", 'See.[TOOL_CALLS]get_weather[ARGS]{"city": "a [TOOL_CALLS] b"}'
                "[TOOL_CALLS]now[ARGS]{}"),
    ("mistral", '[TOOL_CALLS]{"name": "now", "arguments": {"t": 1}}'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"q": "</tool_call>"}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "parameters": {"a": 1}, "arguments": {"b": 2}}'
               "</tool_call>"),
    # a call's field written twice: its first, whole as streamed (QA: the whole answer
    # called g, or passed {"b": 2}, where the stream had f and {"a": 1})
    ("hermes", '<tool_call>{"name": "f", "name": "g", "arguments": {"a": 1}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}'
               "</tool_call>"),
    ("llama3_json", '{"name": "f", "name": "g", "parameters": {"a": 1}}'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "name": "g", "arguments": {"a": 1}}]'),
    # inside the arguments a key written twice is json's, its last, as the client reads the
    # streamed text (QA: the whole answer passed {"name": "a"}, the stream {"name": "b"})
    ("hermes", '<tool_call>{"name": "f", "arguments": {"name": "a", "name": "b", '
               '"o": {"arguments": 1, "arguments": 2}}}</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"parameters": 1, "parameters": 2}}]'),
    # text after the calls, or a call on a line of its own: the stream and the whole answer
    # agree, as vLLM's parser reads them (QA: the whole answer was text, the stream a call)
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}} Done.'),
    ("llama3_json", '{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {"y": 2}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}] ok'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1} and that is all'),
    ("mistral", ' [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}] [TOOL_CALLS]'),
    ("mistral", 'See.[TOOL_CALLS]get_weather{"city": "a {b}"}[TOOL_CALLS]g[ARGS]{"y": 2}'),
]


@pytest.mark.parametrize(("name", "text"), STREAMED)
def test_a_streamed_call_grows_into_the_whole_answers_call(name, text):
    """Read at every length of the answer, a call's name is whole or absent and its
    arguments only grow; at the end they are the whole answer's (the same JSON)."""
    parser = make_parser(name)
    before: list[CallSoFar] = []
    for end in range(len(text) + 1):
        calls = parser.calls_so_far(text[:end])
        assert len(calls) >= len(before) - 1  # the last may lose its unfinished name
        for old, new in zip(before, calls, strict=False):
            assert old.name is None or new.name == old.name
            assert new.arguments.startswith(old.arguments) and (new.done or not old.done)
        before = [call for call in calls if call.name is not None or call.done]
    whole = parser.parse(text).calls
    assert [(c.name, json.loads(c.arguments), c.done) for c in before] == [
        (call_name, json.loads(arguments), True) for call_name, arguments in whole]


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": 7',
])
def test_a_stream_never_starts_a_call_the_whole_answer_leaves_as_text(text):
    """QA: arguments that are no object streamed a call (with arguments "") where the whole
    answer was text: the name is told only once the arguments can be a call's."""
    parser = make_parser("hermes")
    assert parser.parse(text).calls == ()
    assert all(call.name is None for end in range(len(text) + 1)
               for call in parser.calls_so_far(text[:end]))


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="choose one of hermes, llama3_json, mistral, "
                                         "pythonic"):
        make_parser("granite")


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
SAID = f"Checking.<tool_call>{WEATHER}</tool_call>"


@pytest.fixture(scope="module")
def live():
    from kvserve.server.tool_parsers import make_parser

    with LiveServer(max_model_len=512) as server:
        server.state.tool_parser = make_parser("hermes")
        yield server


def _ask(choice_text: str, **fields) -> dict:
    """A chat whose answer is ``choice_text`` (held to it by a choice constraint: the tiny
    model writes what it is told), with tools and tool_choice auto."""
    return {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}],
            "tools": TOOLS, "max_tokens": 80,
            "extra_body": {"structured_outputs": {"choice": [choice_text]}}, **fields}


def test_auto_answers_with_the_calls_the_model_wrote(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(**_ask(SAID))
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    plain = client.chat.completions.create(**_ask("No call here."))
    assert plain.choices[0].message.content == "No call here."
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls


def _assembled(chunks) -> list[tuple[str, str, str]]:
    """A stream's calls as a client puts them together: (id, name, arguments) by index,
    the id and name from a call's first piece, its arguments the pieces' concatenation."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for piece in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = [piece.id, piece.function.name, ""]
            else:
                assert piece.id is None and piece.function.name is None
            calls[piece.index][2] += piece.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[index]) for index in sorted(calls)]


def test_auto_streams_the_content_then_the_calls(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    two = SAID + '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    chunks = list(client.chat.completions.create(**_ask(two), stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Checking." and "<tool_call>" not in content
    calls = _assembled(chunks)
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    assert calls[0][0] != calls[1][0]
    # the arguments as the model writes them, over several chunks (vLLM's), not whole
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 4
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    one = list(client.chat.completions.create(**_ask(two), stream=True,
                                              parallel_tool_calls=False))
    assert [(name, json.loads(arguments)) for _, name, arguments in _assembled(one)] == [
        ("get_weather", {"city": "Oslo"})]


class EveryAnswerCalls:
    """A parser that reads every answer as its text, then a call of get_weather."""

    keeps_special_tokens = False

    def parse(self, text: str) -> ParsedCalls:
        return ParsedCalls("Checking.", (("get_weather", '{"city": "Oslo"}'),), 0)

    def content_end(self, text: str) -> int:
        return 0

    def calls_so_far(self, text: str, scanned: Scanned | None = None) -> list[CallSoFar]:
        return []


def test_auto_on_the_responses_api_gives_a_message_and_a_function_call():
    with LiveServer(max_model_len=512) as live:
        live.state.tool_parser = EveryAnswerCalls()
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        tools = [{"type": "function", **TOOLS[0]["function"]}]
        reply = client.responses.create(model="tiny", input="weather?", tools=tools,
                                        max_output_tokens=4, extra_body={"ignore_eos": True})
        said, call = reply.output
        assert (said.type, said.content[0].text) == ("message", "Checking.")
        assert (call.type, call.name, call.arguments) == ("function_call", "get_weather",
                                                          '{"city": "Oslo"}')
        events = list(client.responses.create(model="tiny", input="weather?", tools=tools,
                                               max_output_tokens=4, stream=True,
                                               extra_body={"ignore_eos": True}))
        done = [e.item.type for e in events if e.type == "response.output_item.done"]
        assert done == ["message", "function_call"]
        deltas = {e.type: e.delta for e in events if e.type.endswith(".delta")}
        assert deltas == {"response.output_text.delta": "Checking.",  # whole, one delta each
                          "response.function_call_arguments.delta": '{"city": "Oslo"}'}
        assert [e.sequence_number for e in events] == list(range(len(events)))


def test_auto_is_refused_without_a_parser():
    with LiveServer(max_model_len=256) as live:
        body = _ask(SAID)
        body.update(body.pop("extra_body"))
        reply = httpx.post(live.url + "/v1/chat/completions", timeout=60, json=body)
        assert reply.status_code == 400
        assert "--enable-auto-tool-choice" in reply.json()["error"]["message"]


def test_auto_refuses_a_function_name_no_call_can_be_read_to(live):
    """QA: "get weather" was served under auto, and the model's call to it came back as its
    text; a forced call to it is served (no parser reads it)."""
    tools = [{"type": "function", "function": {"name": "get weather", "parameters": {
        "type": "object", "properties": {}}}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": tools,
            "max_tokens": 4}
    reply = httpx.post(live.url + "/v1/chat/completions", timeout=60, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "tools.0.function.name"
    assert error["message"].startswith("'get weather': under tool_choice \"auto\"")
    forced = {**body, "tool_choice": {"type": "function", "function": {"name": "get weather"}}}
    assert httpx.post(live.url + "/v1/chat/completions", timeout=60,
                      json=forced).status_code == 200


def test_parsed_calls_know_where_the_content_ends():
    assert make_parser("hermes").parse(SAID) == ParsedCalls(
        "Checking.", (("get_weather", '{"city": "Oslo"}'),), len("Checking."))


def test_the_tools_go_to_the_chat_template():
    """As vLLM and transformers pass them: a template that renders tools shows the model
    what it may call (the bundled one renders none)."""
    from kvserve.engine.llm import build_engine
    from kvserve.model.tokenizer import load_tokenizer

    from .helpers import TINY

    own = load_tokenizer(None)  # not the tests' shared one
    own.set_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}"
                          "{% if tools %} tools: {{ tools | tojson }}{% endif %}")
    engine = build_engine(TINY, tokenizer=own, num_kv_blocks=64, max_model_len=512)
    with LiveServer(engine) as live:
        def prompt_tokens(**fields) -> int:
            reply = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 1,
                **fields})
            assert reply.status_code == 200, reply.text
            return reply.json()["usage"]["prompt_tokens"]

        bare = prompt_tokens()
        with_tools = prompt_tokens(tools=TOOLS, tool_choice="none")
        assert with_tools - bare > len(own.encode(json.dumps(TOOLS))) // 2  # the tools' JSON
        # vLLM's chat_template_kwargs may give the template its tools (QA: refused) and
        # win over the request's
        assert prompt_tokens(chat_template_kwargs={"tools": TOOLS}) == with_tools
        assert prompt_tokens(tools=TOOLS, tool_choice="none",
                             chat_template_kwargs={"tools": []}) == bare


def test_parallel_tool_calls_false_keeps_the_first_call(live):
    """QA: two calls came back with parallel_tool_calls false (OpenAI answers one)."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    two = SAID + '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    both = client.chat.completions.create(**_ask(two))
    one = client.chat.completions.create(**_ask(two), parallel_tool_calls=False)
    assert len(both.choices[0].message.tool_calls) == 2
    [call] = one.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo"}


def test_streamed_and_whole_answers_carry_the_same_content(live):
    """QA: the text before a call was stripped when whole, not when streamed."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    said = f"  Let me check. {SAID[len('Checking.'):]}"
    whole = client.chat.completions.create(**_ask(said)).choices[0].message.content
    chunks = list(client.chat.completions.create(**_ask(said), stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole == streamed == "  Let me check. "
    blank = "\n" + SAID[len("Checking."):]  # QA: null whole, "\n" streamed
    whole = client.chat.completions.create(**_ask(blank)).choices[0].message.content
    chunks = list(client.chat.completions.create(**_ask(blank), stream=True))
    assert whole is None
    assert not [c for c in chunks if c.choices and c.choices[0].delta.content]
    plain = "\n\nJust text."
    whole = client.chat.completions.create(**_ask(plain)).choices[0].message.content
    chunks = list(client.chat.completions.create(**_ask(plain), stream=True))
    assert whole == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_replayed_call_reaches_the_template_as_an_object():
    """QA: a replayed call's arguments (JSON text in OpenAI's API) were written by the
    template's tojson as a quoted string; vLLM hands the template an object."""
    from kvserve.engine.llm import build_engine
    from kvserve.model.tokenizer import load_tokenizer

    from .helpers import TINY

    own = load_tokenizer(None)
    own.set_chat_template("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                          "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    engine = build_engine(TINY, tokenizer=own, num_kv_blocks=64, max_model_len=512)
    with LiveServer(engine) as live:
        messages = [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": '{"city": "Paris"}'}}]}]
        ids = httpx.post(live.url + "/tokenize", json={"messages": messages,
                                                        "add_generation_prompt": False},
                         timeout=30).json()["tokens"]
        assert own.decode(ids) == '{"city": "Paris"}'
        # none, or "": an empty object, as vLLM's (QA: the template's tojson of Undefined
        # was a 400; "" was shown as a quoted string)
        for missing in ({}, {"arguments": ""}, {"arguments": None}):
            messages[0]["tool_calls"][0]["function"] = {"name": "f", **missing}
            reply = httpx.post(live.url + "/tokenize", timeout=30, json={
                "messages": messages, "add_generation_prompt": False})
            assert reply.status_code == 200, (missing, reply.text)
            assert own.decode(reply.json()["tokens"]) == "{}"
        with_tools = httpx.post(live.url + "/tokenize", timeout=30, json={
            "messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
        assert with_tools.status_code == 200, with_tools.text  # QA: vLLM's field, refused


def test_a_replayed_call_whose_arguments_nest_too_deeply_stays_text(live):
    """QA: the arguments' JSON, read to give the template an object, raised
    RecursionError (a 500) on /tokenize, chat and /v1/responses."""
    deep = "[" * 5000 + "]" * 5000
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c", "type": "function",
                                 "function": {"name": "f", "arguments": deep}}]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    for path, body in (("/tokenize", {"messages": messages}),
                       ("/v1/chat/completions", {"messages": messages, "max_tokens": 1}),
                       ("/v1/responses", {"max_output_tokens": 1, "input": [
                           {"type": "function_call", "call_id": "c", "name": "f",
                            "arguments": deep},
                           {"type": "function_call_output", "call_id": "c",
                            "output": "ok"}]})):
        reply = httpx.post(live.url + path, json=body, timeout=60)
        assert reply.status_code == 200, (path, reply.text[:300])


@pytest.mark.parametrize(("parser", "said"), [
    ("pythonic", '[get_weather(city="Oslo")]'),
    ("mistral", 'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
])
def test_the_other_parsers_answer_with_calls_whole_and_streamed(parser, said):
    from kvserve.server.tool_parsers import make_parser as make_tool_parser

    with LiveServer(max_model_len=512) as server:
        server.state.tool_parser = make_tool_parser(parser)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        whole = client.chat.completions.create(**_ask(said)).choices[0]
        assert whole.finish_reason == "tool_calls"
        [call] = whole.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather", {"city": "Oslo"})
        # Mistral's templates take back only 9 letters and digits (the structured-output
        # pass: the next turn was refused by the template)
        assert (len(call.id) == 9 and call.id.isalnum()) if parser == "mistral" else \
            call.id.startswith("chatcmpl-tool-")
        chunks = list(client.chat.completions.create(**_ask(said), stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        content = "".join(d.content or "" for d in deltas)
        assert content == (whole.message.content or "")
        assert [(name, arguments) for _, name, arguments in _assembled(chunks)] == [
            (call.function.name, call.function.arguments)]


def test_auto_calls_stream_on_the_responses_api_as_items():
    """Each call is a function_call item opened as its name is whole, its arguments in
    deltas as they are written; the message before it closes first; what the deltas add up
    to is what the done events and the final response carry."""
    from kvserve.server.tool_parsers import make_parser as make_tool_parser

    said = ("Let me look." + SAID[len("Checking."):] +
            '<tool_call>{"name": "now", "arguments": {"tz": "UTC"}}</tool_call>')
    with LiveServer(scripted_engine(said, max_model_len=512)) as live:
        live.state.tool_parser = make_tool_parser("hermes")
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        tools = [{"type": "function", **TOOLS[0]["function"]},
                 {"type": "function", "name": "now", "parameters": {"type": "object"}}]
        events = list(client.responses.create(model="tiny", input="weather?", tools=tools,
                                               max_output_tokens=80, stream=True,
                                               include=["message.output_text.logprobs"]))
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events
             if e.type.startswith("response.output_item")]
    assert kinds == [("response.output_item.added", 0), ("response.output_item.done", 0),
                     ("response.output_item.added", 1), ("response.output_item.done", 1),
                     ("response.output_item.added", 2), ("response.output_item.done", 2)]
    deltas: dict[int, str] = {}
    for event in events:
        if event.type == "response.function_call_arguments.delta":
            deltas[event.output_index] = deltas.get(event.output_index, "") + event.delta
    assert len([e for e in events if e.type == "response.function_call_arguments.delta"]) > 4
    done = {e.output_index: e.arguments for e in events
            if e.type == "response.function_call_arguments.done"}
    final = events[-1].response
    message, first, second = final.output
    assert message.content[0].text == "Let me look."
    # its logprobs are the message's tokens', not the calls' after it (the last, ".<",
    # ends the message and begins the call)
    tokens = [e.token for e in message.content[0].logprobs]
    assert "".join(tokens).startswith("Let me look.") and tokens[-1] == ".<"
    assert tokens == [e.token for ev in events if ev.type == "response.output_text.delta"
                      for e in ev.logprobs]
    assert deltas == done == {1: first.arguments, 2: second.arguments}
    assert [(c.name, json.loads(c.arguments)) for c in (first, second)] == [
        ("get_weather", {"city": "Oslo"}), ("now", {"tz": "UTC"})]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(a.id, getattr(a, "call_id", None)) for a in added[1:]] == [
        (c.id, c.call_id) for c in (first, second)]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_calls_that_go_out_whole_keep_their_ids_on_the_responses_stream():
    """QA: a call that reached the stream whole at the end (pythonic's, always) got a new
    call_id each time its item was read (added, done, the final response), and the SDK's
    responses.stream() raised 'Completed output item identity changed'."""
    from kvserve.server.tool_parsers import make_parser as make_tool_parser

    with LiveServer(scripted_engine('[get_weather(city="Oslo"), now()]',
                                    max_model_len=512)) as live:
        live.state.tool_parser = make_tool_parser("pythonic")
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        tools = [{"type": "function", **TOOLS[0]["function"]},
                 {"type": "function", "name": "now", "parameters": {"type": "object"}}]
        events = list(client.responses.create(model="tiny", input="weather?", tools=tools,
                                               max_output_tokens=40, stream=True))
        with client.responses.stream(model="tiny", input="weather?", tools=tools,
                                     max_output_tokens=40) as stream:
            final = stream.get_final_response()
    added = [e.item.call_id for e in events if e.type == "response.output_item.added"]
    done = [e.item.call_id for e in events if e.type == "response.output_item.done"]
    assert added == done == [item.call_id for item in events[-1].response.output]
    assert len(set(added)) == 2
    assert [item.name for item in final.output] == ["get_weather", "now"]


@pytest.mark.parametrize(("name", "text"), STREAMED)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_a_streams_scan_reads_each_chunk_as_a_fresh_read_would(name, text, step):
    """A stream keeps its scan (Scanned) from chunk to chunk, so each chunk scans only what
    is new: at every length, in chunks of ``step`` characters, its calls are the calls read
    afresh; and a scan kept for another text is not taken for this one's."""
    parser = make_parser(name)
    scanned = Scanned()
    for end in [*range(0, len(text), step), len(text)]:
        assert parser.calls_so_far(text[:end], scanned) == parser.calls_so_far(text[:end])
    other = text.replace("1", "23").replace('"f"', '"g"')
    for end in range(len(other) + 1):
        assert parser.calls_so_far(other[:end], scanned) == parser.calls_so_far(other[:end])


class Counting:
    """One of tool_parsers' patterns, wrapped to count what its matches read: the matches,
    or (``chars``) the characters."""

    def __init__(self, pattern, chars: bool = False) -> None:
        self.pattern, self.chars, self.count = pattern, chars, 0

    def match(self, text, at):
        found = self.pattern.match(text, at)
        self.count += (found.end() - at if found else 0) if self.chars else 1
        return found


def counting(monkeypatch, name: str, chars: bool = False) -> Counting:
    from kvserve.server import tool_parsers

    counter = Counting(getattr(tool_parsers, name), chars)
    monkeypatch.setattr(tool_parsers, name, counter)
    return counter


def test_a_long_streamed_call_is_scanned_once_not_once_a_chunk(monkeypatch):
    """QA: a call's arguments of n JSON pieces were scanned whole at every chunk, n^2 / 2
    pieces over the stream (1.5 s of the server's event loop for a 2,000-token list). With
    the stream's scan kept, each piece is read about once."""
    reads = counting(monkeypatch, "_PIECE")
    items = 1500
    text = ('<tool_call>\n{"name": "f", "arguments": {"xs": [' +
            ", ".join(str(i) for i in range(items)) + ']}}\n</tool_call>')
    parser, scanned = make_parser("hermes"), Scanned()
    chunks = range(4, len(text) + 4, 4)
    for end in chunks:
        calls = parser.calls_so_far(text[:end], scanned)
    assert calls == [CallSoFar("f", '{"xs": [' + ", ".join(map(str, range(items))) + "]}",
                               True)]
    pieces = 2 * items + 10  # the numbers and their commas, and the fields around them
    assert reads.count < 2 * pieces + 4 * len(chunks)  # afresh it was ~ pieces * chunks / 2


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_a_long_streamed_string_is_read_once_not_from_its_quote_each_chunk(monkeypatch, name):
    """QA: a string argument the chunk ended inside was read again from its opening quote
    at every chunk: a 20,000-character file took 4 s of the server's event loop (the
    count of reads above did not see it: one read per chunk, each of the whole string)."""
    read = counting(monkeypatch, "_STRING_BODY", chars=True)
    content = "x = 1\\n" * 2500  # 20,000 characters of JSON string body
    call = '{"name": "write", "arguments": {"path": "a.py", "content": "' + content + '"}}'
    text = f"<tool_call>\n{call}\n</tool_call>" if name == "hermes" else call
    parser, scanned = make_parser(name), Scanned()
    for end in range(4, len(text) + 4, 4):
        calls = parser.calls_so_far(text[:end], scanned)
    assert calls == [CallSoFar("write", call[call.index('{"path"'):-1], True)]
    assert read.count < 2 * len(text)  # from the quote each chunk, it was ~ len(content)^2 / 8


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_finished_calls_and_whole_fields_are_read_once_not_once_a_chunk(monkeypatch, name):
    """QA: each chunk walked every finished call and every field of an unfinished object
    again: 100 calls took 10 s of the event loop, a JSON answer of 300 keys on a
    llama3_json server 3 s."""
    keys = counting(monkeypatch, "_STRING")
    records = ", ".join(f'"k{i}": {i}' for i in range(300))
    calls = [f'{{"name": "f{i}", "arguments": {{"i": {i}}}}}' for i in range(100)]
    text = {"hermes": "".join(f"<tool_call>\n{call}\n</tool_call>\n" for call in calls),
            "llama3_json": "{" + records + "}",
            "mistral": "[TOOL_CALLS][" + ", ".join(calls) + "]"}[name]
    parser, scanned = make_parser(name), Scanned()
    chunks = range(4, len(text) + 4, 4)
    for end in chunks:
        found = parser.calls_so_far(text[:end], scanned)
    assert found == parser.calls_so_far(text)
    assert keys.count < 3 * 300 + 2 * len(chunks)  # afresh, ~ the keys so far at every chunk


def test_auto_calls_cut_short_after_them_still_finish_as_tool_calls(live):
    """vLLM's: an answer whose calls were read finishes with tool_calls however it ended
    (the structured-output pass: one cut by max_tokens after its call said length)."""
    text = SAID + " And now a long goodbye to everyone reading this."
    ids = live.state.tokenizer.encode(text, add_special_tokens=False)
    cut = next(n for n in range(len(ids))
               if "</tool_call>" in live.state.tokenizer.decode(ids[:n])) + 2
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    [choice] = client.chat.completions.create(**_ask(text, max_tokens=cut)).choices
    assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]
    assert choice.finish_reason == "tool_calls"
