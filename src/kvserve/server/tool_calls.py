"""A chat answer that is a tool call (docs/structured-outputs.md). A function named in
tool_choice (or "required" with one tool): the answer is its call, the arguments the text
(the JSON decoder holds them to the function's parameters), streamed delta by delta.
"required" among several tools: the text holds the calls ({"tool_calls": [{"name": ...,
"parameters": {...}}, ...]}), which go out whole once the answer is complete. "auto" with a
tool-call parser (server/tool_parsers.py): the calls the model wrote in its own format, any
content before them streamed as it comes, then each call as vLLM streams it: its id and name
once the name is whole, then its arguments as they are written. Either way in OpenAI's shape,
each call with an id of its own, and vLLM's finish reasons."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

from kvserve.server.protocol import auto_tools, calls_required, forced_tool
from kvserve.server.tool_parsers import (
    CallSoFar,
    ParsedCalls,
    Scanned,
    ToolParser,
    strict_json,
    to_json,
)


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCalls:
    def __init__(self, role: str, name: str | None, required: bool,
                 parser: ToolParser | None = None, parallel: bool = True,
                 new_id: Callable[[], str] = _call_id) -> None:
        self.role = role
        self.new_id = new_id  # a call's id, as the model's chat template takes it back
        self.name = name  # the forced function's; None: calls_required, or auto
        self.required = required  # tool_choice "required": finish_reason tool_calls
        # "auto" (--enable-auto-tool-choice): the calls the parser finds in the text
        self.parser = parser
        self.sent: dict[str, int] = {}  # auto, streamed: each answer's text sent as content
        self.called: set[str] = set()  # auto: the answers that held calls
        # auto, streamed: each answer's calls that went out, as far as they did
        self.streaming: dict[str, list[dict[str, Any]]] = {}
        self.scanned: dict[str, Scanned] = {}  # auto, streamed: each answer's JSON scan
        self.parallel = parallel  # auto: parallel_tool_calls false keeps the first call
        self.opened: set[str] = set()  # named, streamed: the answers whose call went out
        # each answer's calls' ids by place, one id per call however often it is read (QA:
        # the Responses stream read a whole answer's calls three times, three ids each)
        self.call_ids: dict[str, list[str]] = {}

    @classmethod
    def of(cls, req: Any, role: str,
           parser: ToolParser | None = None) -> ToolCalls | None:
        """The tool calls a chat request's answers are (or, with ``parser``, may hold), or
        None (a plain answer)."""
        function = forced_tool(req)
        # the served parser's ids where it has its own (Mistral's templates take back only
        # 9 alphanumeric characters: the structured-output pass), forced calls' too
        new_id = getattr(parser, "new_call_id", _call_id)
        if function is None and not calls_required(req):
            if parser is not None and auto_tools(req):
                return cls(role, None, False, parser,
                           parallel=req.parallel_tool_calls is not False, new_id=new_id)
            return None
        return cls(role, None if function is None else function.name,
                   req.tool_choice == "required", new_id=new_id)

    def message(self, choice_id: str, text: str) -> dict[str, Any]:
        """A whole answer's message."""
        if self.parser is not None and choice_id in self.streaming:
            # streamed: the calls as they went out (a stream commits to a call), after
            # the content it sent
            content = text[:self.sent.get(choice_id, 0)]
            return {"role": self.role, "content": content if content.strip() else None,
                    "tool_calls": [dict(call, function=dict(call["function"]))
                                   for call in self.streaming[choice_id]]}
        if self.parser is not None:
            parsed = self._parse(text)
            if not parsed.calls:
                return {"role": self.role, "content": text}
            self.called.add(choice_id)
            return {"role": self.role, "content": parsed.content,
                    "tool_calls": [self._made(choice_id, index, name, arguments)
                                   for index, (name, arguments) in enumerate(parsed.calls)]}
        if self.name is not None:  # nothing written (cut short while thinking): no call
            return {"role": self.role, "content": None,
                    "tool_calls": [self._call(choice_id, text)] if text else []}
        calls = self._calls(choice_id, text)
        if calls is None:  # cut short (max_tokens): the text as it is
            return {"role": self.role, "content": text}
        return {"role": self.role, "content": None, "tool_calls": calls}

    def delta(self, choice_id: str, text: str, whole: str,
              finished: bool) -> dict[str, Any] | None:
        """A streamed chunk's delta (``text`` its new text, ``whole`` the answer's so far);
        None where nothing goes out yet."""
        if self.parser is not None:
            return self._auto_delta(choice_id, whole, finished)
        if self.name is not None:  # the arguments, delta by delta, from their first text
            # (a thinking answer's first chunks are reasoning: QA, the call went out before
            # it, then an empty delta a token)
            if choice_id not in self.opened:
                if not text:  # nothing yet; or nothing at all: no call, its finish reason
                    return {} if finished else None
                self.opened.add(choice_id)
                return {"tool_calls": [{"index": 0, **self._call(choice_id, text)}]}
            if not text:  # the last chunk (its EOS) still carries the finish reason
                return {} if finished else None
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        if not finished:
            return None
        message = self.message(choice_id, whole)
        delta = {key: value for key, value in message.items() if key != "role"}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **call}
                                   for i, call in enumerate(delta["tool_calls"])]
        return delta

    def _auto_delta(self, choice_id: str, whole: str, finished: bool
                    ) -> dict[str, Any] | None:
        """Auto: the text as content while it surely is, held back where a call may
        begin; each call from when its name is whole, its arguments as they are written
        (a stream commits to a call there: what follows is its arguments, as vLLM's). At
        the end, a stream no call went out in yet: what was held, the calls (and content
        before them) or text."""
        assert self.parser is not None
        sent = self.sent.get(choice_id, 0)
        if finished and choice_id not in self.streaming:
            return self._whole_delta(choice_id, whole, sent)
        delta: dict[str, Any] = {}
        end = self.parser.content_end(whole)
        # blanks alone are held too: before calls they are no content (a whole answer's is
        # null; QA: a stream sent "\n")
        if end > sent and whole[:end].strip() and choice_id not in self.streaming:
            self.sent[choice_id] = end
            delta["content"] = whole[sent:end]
        if end < len(whole):
            scanned = self.scanned.get(choice_id)
            if scanned is None:
                scanned = self.scanned[choice_id] = Scanned()
            pieces = self._call_pieces(choice_id, self.parser.calls_so_far(whole, scanned))
            if pieces:
                delta["tool_calls"] = pieces
        return delta if delta or finished else None

    def _call_pieces(self, choice_id: str, calls: list[CallSoFar]) -> list[dict[str, Any]]:
        """The tool_calls delta pieces for what ``calls`` wrote since the last chunk."""
        if not self.parallel:
            calls = calls[:1]
        streaming = self.streaming.get(choice_id, [])
        pieces: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if index < len(streaming):
                function = streaming[index]["function"]
                if not call.arguments.startswith(function["arguments"]):
                    continue  # read otherwise now: what went out stays (never a non-prefix)
                new = call.arguments[len(function["arguments"]):]
                if new:
                    pieces.append({"index": index, "function": {"arguments": new}})
                function["arguments"] = call.arguments
            elif call.name is not None and index == len(streaming):
                streaming.append(self._made(choice_id, index, call.name, call.arguments))
                pieces.append({"index": index, **streaming[index],
                               "function": dict(streaming[index]["function"])})
            else:  # its name is not whole yet: it and the calls after it wait
                break
        if streaming:
            self.streaming[choice_id] = streaming
            self.called.add(choice_id)
        return pieces

    def _whole_delta(self, choice_id: str, whole: str, sent: int) -> dict[str, Any]:
        """The end of a stream no call went out in yet: the rest of its content, or the
        calls (and the content before them)."""
        parsed = self._parse(whole)
        if not parsed.calls:
            return {"content": whole[sent:]}
        self.called.add(choice_id)
        delta: dict[str, Any] = {}
        before = whole[sent:parsed.content_end]
        if before and parsed.content is not None:
            delta["content"] = before
        delta["tool_calls"] = [{"index": i, **self._made(choice_id, i, name, arguments)}
                               for i, (name, arguments) in enumerate(parsed.calls)]
        return delta

    def _parse(self, text: str) -> ParsedCalls:
        """The parser's reading, with parallel_tool_calls false its first call only (as
        OpenAI answers, and "required" here)."""
        assert self.parser is not None
        parsed = self.parser.parse(text)
        if self.parallel or len(parsed.calls) < 2:
            return parsed
        return dataclasses.replace(parsed, calls=parsed.calls[:1])

    def finish_reason(self, choice_id: str, reason: str | None) -> str | None:
        """vLLM's: tool_calls where the answer made calls in auto (however it ended: the
        structured-output pass, one cut short by max_tokens said length), or where the call
        was required and the answer stopped; stop where it was named."""
        if reason is None:
            return None
        if choice_id in self.called or (self.required and reason == "stop"):
            return "tool_calls"
        return reason

    def _call(self, choice_id: str, arguments: str) -> dict[str, Any]:
        assert self.name is not None
        return self._made(choice_id, 0, self.name, arguments)

    def _calls(self, choice_id: str, text: str) -> list[dict[str, Any]] | None:
        try:  # the grammar's (SamplingParams.json_schema): a list of named calls
            return [self._made(choice_id, index, call["name"], to_json(call["parameters"]))
                    for index, call in enumerate(strict_json(text)["tool_calls"])]
        except ValueError:  # cut short, or nested past what can be read (QA: a 500)
            return None

    def call_id(self, choice_id: str, index: int) -> str:
        """Answer ``choice_id``'s call ``index``'s id, the same however often it is read."""
        ids = self.call_ids.setdefault(choice_id, [])
        while len(ids) <= index:
            ids.append(self.new_id())
        return ids[index]

    def _made(self, choice_id: str, index: int, name: str, arguments: str) -> dict[str, Any]:
        """Answer ``choice_id``'s call ``index`` in OpenAI's shape, with its own id."""
        return {"id": self.call_id(choice_id, index), "type": "function",
                "function": {"name": name, "arguments": arguments}}
