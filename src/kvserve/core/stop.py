"""When a request stops (spec H2, J2): checked after each appended token."""

from __future__ import annotations

from kvserve.core.request import Request, RequestStatus

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED
KV_CAPACITY = "kv_capacity"  # stop_reason of a sequence the whole KV pool cannot hold (J2)
# stop_reasons of a request the waiting queue ended before it ran (the server's 503s)
QUEUE_TIMEOUT = "queue_timeout"  # K4: it waited past its queue deadline
DISPLACED = "displaced"  # K5: a more urgent arrival took its place in the full queue
QUEUE_ENDS = (QUEUE_TIMEOUT, DISPLACED)


def ended_in_queue(finish_reason: str | None, stop_reason: object) -> bool:
    """Whether the waiting queue ended a request before it ran (the server's 503): an abort
    with a queue's stop reason. A stop string of the same text finishes "stop" (the
    streaming pass: ``stop: ["displaced"]`` turned an answer into a 503)."""
    return finish_reason == "abort" and stop_reason in QUEUE_ENDS


def check_stop(request: Request, token_id: int,
               length_limit: int) -> tuple[RequestStatus | None, int | None]:
    """(finished status or None, stop reason) after ``token_id`` was appended.

    In order: fewer than min_tokens -> continue; EOS (unless ignore_eos) -> stopped; a stop
    token id -> stopped with that id as the reason; max_tokens or ``length_limit`` (the model
    length, or what the whole KV pool can hold) -> length. The length limit applies even
    below min_tokens: a sequence can never outgrow it.
    """
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    at_length_limit = len(request.prompt_token_ids) + num_output >= length_limit
    if num_output < params.min_tokens:
        return (_LENGTH if at_length_limit else None), None
    if token_id == params.eos_token_id and not params.ignore_eos:
        return _STOPPED, None
    if token_id in params.stop_token_ids:
        return _STOPPED, token_id
    if num_output >= params.max_tokens or at_length_limit:
        return _LENGTH, None
    return None, None


def length_stop_reason(request: Request, length_limit: int,
                       max_model_len: int) -> str | None:
    """The stop_reason of a request that finished with "length" (J2): ``"kv_capacity"`` when
    it stopped because the whole KV pool can hold no more of it (``length_limit`` below
    ``max_model_len``) and not because of max_tokens; otherwise None, as in vLLM."""
    if length_limit >= max_model_len or request.num_tokens < length_limit:
        return None
    if len(request.output_token_ids) >= request.sampling_params.max_tokens:
        return None
    return KV_CAPACITY
