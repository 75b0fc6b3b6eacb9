"""The chat endpoint's prompt: the messages through the model's template (server/prompts.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvserve.model.tokenizer import Tokenizer, load_tokenizer
from kvserve.server.errors import APIError
from kvserve.server.prompts import chat_ids
from kvserve.server.protocol import ChatMessage


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


@pytest.mark.parametrize(("template", "kwargs", "message", "param"), [
    ("{{ 1 + 'a' }}", None, "cannot apply the chat template: TypeError", "messages"),
    ("{{ messages[0].nothing.deeper }}", None, "UndefinedError", "messages"),
    ("{{ ''.__class__.__mro__ }}", None, "SecurityError", "messages"),
    ("{{ raise_exception('no') }}", None, "cannot apply the chat template: chat template "
                                          "error: no", "messages"),
    ("{{ 1 + x }}", {"x": "a"}, "with 'chat_template_kwargs': TypeError",
     "chat_template_kwargs"),
])
def test_a_template_failing_on_a_request_is_a_400(tokenizer, template, kwargs, message, param):
    """QA (chat templates pass): a TypeError, an undefined attribute or the sandbox's refusal
    while rendering was a 500 with a traceback (a 400 only with chat_template_kwargs set), as
    vLLM answers 400."""
    state = SimpleNamespace(tokenizer=Tokenizer(tokenizer._tokenizer, chat_template=template))
    with pytest.raises(APIError) as caught:
        chat_ids(state, [ChatMessage(role="user", content="hi")], template_kwargs=kwargs)
    assert caught.value.status == 400 and message in caught.value.message
    assert caught.value.param == param
