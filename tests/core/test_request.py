"""Spec B: request state, sampling parameter validation, ordering and events."""

import pytest

from kvserve.core import EventType, Request, RequestError, RequestStatus, SamplingParams
from tests.conftest import make_request


def test_num_tokens_is_prompt_plus_output():  # B1
    request = make_request("a", 10)
    request.output_token_ids += [5, 6]
    assert (request.num_prompt_tokens, request.num_output_tokens, request.num_tokens) == (10, 2,
                                                                                         12)
    assert request.all_token_ids[-2:] == [5, 6]
    assert request.token_slice(8, 12) == [*request.prompt_token_ids[8:], 5, 6]
    assert request.token_slice(10, 12) == [5, 6]


@pytest.mark.parametrize(("status", "finished", "reason"), [
    (RequestStatus.WAITING, False, None),
    (RequestStatus.RUNNING, False, None),
    (RequestStatus.PREEMPTED, False, None),
    (RequestStatus.FINISHED_STOPPED, True, "stop"),
    (RequestStatus.FINISHED_LENGTH_CAPPED, True, "length"),
    (RequestStatus.FINISHED_ABORTED, True, "abort"),
    (RequestStatus.FINISHED_IGNORED, True, "length"),
    (RequestStatus.FINISHED_ERROR, True, "error"),
])
def test_status_finish_reasons(status, finished, reason):  # B1
    assert status.is_finished is finished
    assert status.finish_reason == reason


def test_priority_order_is_priority_then_arrival_then_id():  # B2
    a = make_request("b", priority=1, arrival_time=0.0)
    b = make_request("a", priority=0, arrival_time=5.0)
    c = make_request("c", priority=0, arrival_time=1.0)
    d = make_request("a2", priority=0, arrival_time=1.0)
    assert sorted([a, b, c, d], key=Request.sort_key) == [d, c, b, a]


def test_events_carry_timestamps():  # B3
    request = make_request("a")
    request.record(EventType.ARRIVED, 1.5)
    assert [(e.type, e.timestamp) for e in request.events] == [(EventType.ARRIVED, 1.5)]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens must be an integer in [0, max_tokens=4]"),
    ({"temperature": -1.0}, "temperature must be a number >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be an integer >= -1"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative integers"),
    ({"extra_eos_token_ids": "2"}, "extra_eos_token_ids must be a list of token ids"),
    ({"extra_eos_token_ids": [2.5]}, "extra_eos_token_ids must be non-negative integers"),
    ({"stop": [""]}, "stop must be non-empty strings"),
    ({"priority": 1.5}, "priority must be an integer, got 1.5"),
    ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
    ({"logprobs": -2}, "logprobs must be an integer >= 0 (or -1: the whole vocabulary)"),
    ({"max_queue_delay": -1}, "max_queue_delay must be a number of seconds > 0"),
    ({"max_queue_delay": 0}, "max_queue_delay must be a number of seconds > 0"),
    ({"prompt_logprobs": 1.5}, "prompt_logprobs must be an integer >= 0"),
    ({"prompt_logprobs": 0, "session_id": "s"},
     "prompt_logprobs cannot be asked of a session turn"),  # G8
])
def test_bad_sampling_params_are_named(kwargs, message):
    with pytest.raises(RequestError) as error:
        SamplingParams(**kwargs)
    assert message in str(error.value)


def test_sequences_are_normalised_to_tuples():
    params = SamplingParams(stop_token_ids=[3, 4], stop="END")
    assert params.stop_token_ids == (3, 4) and params.stop == ("END",)


@pytest.mark.parametrize(("args", "message"), [
    (("", [1]), "request_id must be a non-empty string"),
    (("a", []), "prompt_token_ids must be a non-empty list"),
])
def test_bad_requests_are_named(args, message):
    with pytest.raises(RequestError, match=message):
        Request(*args)
