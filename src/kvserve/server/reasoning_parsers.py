"""Reasoning parsers (vLLM's ``--reasoning-parser NAME``, docs/structured-outputs.md): a
model that thinks before it answers writes ``<think> ... </think>`` and then its answer; the
parser splits the text, the thinking going out as the message's ``reasoning`` (vLLM's field,
once ``reasoning_content``) and the rest as its ``content``.

- ``deepseek_r1``: the model always thinks, its template often opening ``<think>`` in the
  prompt: the text up to ``</think>`` is reasoning (a leading ``<think>`` dropped); without
  ``</think>`` (cut short) it is all reasoning (DeepSeek R1 and its Llama distills, QwQ).
- ``qwen3``: thinking may be off (``enable_thinking`` false in the template): an answer
  that opens with ``<think>`` thinks up to ``</think>`` (all of it, cut short); any other
  answer is content.

Either reads the prompt's end too (:meth:`ThinkParser.for_prompt`): a template that opened
``<think>`` there (DeepSeek R1's, Qwen3 2507's) has the answer begin inside its thinking; one
that wrote ``<think></think>`` there (Qwen3's with thinking off) has an answer that does not
think at all, split by neither.

A structured answer (JSON, a choice, a forced call) thinks first and is held to its form
from the end of its thinking on, as vLLM's (SamplingParams.think_markers).

:class:`ReasoningStream` splits a streamed answer as it comes, holding back only what may be
the first characters of ``</think>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvserve.model.detokenizer import held_length

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkParser:
    name: str
    # the answer begins inside its thinking: text before </think> is reasoning even
    # without <think> (deepseek_r1: always; either: where the prompt opened <think>)
    opened: bool

    def for_prompt(self, tail: str) -> ThinkParser | None:
        """This parser for an answer to a prompt ending in ``tail`` (its last tokens as
        text): None where the prompt closed the thinking (the answer does not think)."""
        tail = tail.rstrip()
        if tail.endswith(END):
            return None
        return replace(self, opened=True) if tail.endswith(START) else self

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer, each as written (whitespace kept, as
        vLLM's, so that a stream's pieces add up to them) and None where empty."""
        reasoning, content = split_text(self, text, finished=True)
        return _or_none(reasoning), _or_none(content)

    def thought(self, text: str) -> bool:
        """Whether the answer's thinking closed (its </think> written)."""
        body = text.lstrip()
        return (body.startswith(START) or self.opened) and END in body


def make_parser(name: str) -> ThinkParser:
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(PARSERS)}")
    return ThinkParser(name, opened=name == "deepseek_r1")


@dataclass
class ReasoningStream:
    """One streamed answer split as it comes: :meth:`feed` takes the whole text so far and
    gives the new reasoning and content since the last call."""

    parser: ThinkParser
    reasoning_sent: int = 0  # characters of the reasoning so far sent
    content_sent: int = 0
    _content: str = field(default="", init=False)

    @property
    def content(self) -> str:
        """The content so far (what a tool-call parser reads)."""
        return self._content

    def feed(self, whole: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, new content) since the last call."""
        reasoning, content = self._split(whole, finished)
        new_reasoning = reasoning[self.reasoning_sent:]
        new_content = content[self.content_sent:]
        self.reasoning_sent, self.content_sent = len(reasoning), len(content)
        self._content = content
        return new_reasoning, new_content

    def _split(self, whole: str, finished: bool) -> tuple[str, str]:
        return split_text(self.parser, whole, finished)


def split_text(parser: ThinkParser, whole: str, finished: bool) -> tuple[str, str]:
    """The reasoning and content of an answer so far (``finished``: all of it), as
    written; while it goes on, what may be the first characters of a marker is held back.
    One rule for a stream and a whole answer, so the one adds up to the other."""
    body = whole.lstrip()
    if not finished and START.startswith(body):  # "<thi": which way it goes is open
        return "", ""
    opened = body.startswith(START)
    if not opened and not parser.opened:
        return "", whole  # it did not think
    if opened:
        body = body[len(START):]
    at = body.find(END)
    if at >= 0:
        return body[:at], body[at + len(END):]
    held = 0 if finished else held_length(body, END)
    return body[:len(body) - held], ""  # still thinking (or cut short)


def _or_none(text: str) -> str | None:
    return text or None
