"""What a chat choice's text becomes in its message: the reasoning a reasoning parser splits
off (``--reasoning-parser``, server/reasoning_parsers.py), the content, and the tool calls
(server/tool_calls.py), whole or delta by delta. The Responses API reads the same split."""

from __future__ import annotations

from typing import Any

from kvserve.server.reasoning_parsers import ReasoningStream, ThinkParser
from kvserve.server.tool_calls import ToolCalls
from kvserve.server.tool_parsers import ToolParser


class ChatAnswer:
    def __init__(self, req: Any, role: str, tool_parser: ToolParser | None,
                 reasoning: ThinkParser | None) -> None:
        self.role = role
        self.tools = ToolCalls.of(req, role, tool_parser)
        # a structured answer (JSON, a choice, a forced call) thinks first too: its form
        # holds from the end of its thinking on (SamplingParams.think_markers)
        self.reasoning = reasoning
        self.shows_reasoning = getattr(req, "include_reasoning", None) is not False
        self.streams: dict[str, ReasoningStream] = {}

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; content None where a thinking answer
        has none (vLLM's), "" kept where the model said nothing without thinking."""
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text)

    def thought(self, text: str) -> bool:
        """Whether the answer's thinking is over (its </think> written)."""
        return self.reasoning is not None and self.reasoning.thought(text)

    def message(self, choice_id: str, text: str) -> dict[str, Any]:
        """A whole answer's message."""
        reasoning, content = self.split(text)
        message = self.tools.message(choice_id, content or "") if self.tools is not None \
            else {"role": self.role, "content": content}
        if self.reasoning is not None:
            if message.get("content") == "":
                message["content"] = None  # all thinking: no content, as vLLM's
            if self.shows_reasoning:
                message["reasoning"] = reasoning  # vLLM's field (reasoning_content before)
        return message

    def delta(self, choice_id: str, text: str, whole: str,
              finished: bool) -> dict[str, Any] | None:
        """A streamed chunk's delta (``text`` its new text, ``whole`` the answer's so far);
        None where nothing goes out yet."""
        reasoning = ""
        if self.reasoning is not None:
            stream = self.streams.setdefault(choice_id, ReasoningStream(self.reasoning))
            reasoning, text = stream.feed(whole, finished)
            whole = stream.content
        if self.tools is not None:
            delta = self.tools.delta(choice_id, text, whole, finished)
        else:
            delta = {"content": text} if text or self.reasoning is None or finished else None
        if reasoning and self.shows_reasoning:
            delta = {"reasoning": reasoning, **(delta or {})}
        return delta

    def finish_reason(self, choice_id: str, reason: str | None) -> str | None:
        return reason if self.tools is None else self.tools.finish_reason(choice_id, reason)
