"""A chat answer that is a tool call (docs/structured-outputs.md). A function named in
tool_choice (or "required" with one tool): the answer is its call, the arguments the text
(the JSON decoder holds them to the function's parameters), streamed delta by delta.
"required" among several tools: the text holds the calls ({"tool_calls": [{"name": ...,
"parameters": {...}}, ...]}), which go out whole once the answer is complete. Either way in
OpenAI's shape, each call with an id of its own, and vLLM's finish reasons."""

from __future__ import annotations

import json
import uuid
from typing import Any

from kvserve.server.protocol import calls_required, forced_tool


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCalls:
    def __init__(self, role: str, name: str | None, required: bool,
                 choice_ids: list[str]) -> None:
        self.role = role
        self.name = name  # the forced function's; None: calls_required
        self.required = required  # tool_choice "required": finish_reason tool_calls
        self.ids = {choice_id: _call_id() for choice_id in choice_ids} if name else {}

    @classmethod
    def of(cls, req: Any, choice_ids: list[str], role: str) -> ToolCalls | None:
        """The tool calls a chat request's answers are, or None (a plain answer)."""
        function = forced_tool(req)
        if function is None and not calls_required(req):
            return None
        return cls(role, None if function is None else function.name,
                   req.tool_choice == "required", choice_ids)

    def message(self, choice_id: str, text: str) -> dict[str, Any]:
        """A whole answer's message."""
        if self.name is not None:
            return {"role": self.role, "content": None,
                    "tool_calls": [self._call(choice_id, text)]}
        calls = self._calls(text)
        if calls is None:  # cut short (max_tokens): the text as it is
            return {"role": self.role, "content": text}
        return {"role": self.role, "content": None, "tool_calls": calls}

    def delta(self, choice_id: str, text: str, whole: str, first: bool,
              finished: bool) -> dict[str, Any] | None:
        """A streamed chunk's delta (``text`` its new text, ``whole`` the answer's so far);
        None where nothing goes out yet."""
        if self.name is not None:  # the arguments, delta by delta
            return {"tool_calls": [{"index": 0, **self._call(choice_id, text)} if first else
                                   {"index": 0, "function": {"arguments": text}}]}
        if not finished:
            return None
        message = self.message(choice_id, whole)
        delta = {key: value for key, value in message.items() if key != "role"}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **call}
                                   for i, call in enumerate(delta["tool_calls"])]
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        """vLLM's: tool_calls where the call was required, stop where it was named."""
        return "tool_calls" if reason == "stop" and self.required else reason

    def _call(self, choice_id: str, arguments: str) -> dict[str, Any]:
        return {"id": self.ids[choice_id], "type": "function",
                "function": {"name": self.name, "arguments": arguments}}

    @staticmethod
    def _calls(text: str) -> list[dict[str, Any]] | None:
        try:
            calls = json.loads(text)["tool_calls"]
        except ValueError:
            return None
        return [{"id": _call_id(), "type": "function",
                 "function": {"name": call["name"],
                              "arguments": json.dumps(call["parameters"],
                                                      ensure_ascii=False)}}
                for call in calls]
