"""Every exception the core raises, so callers can map each to an answer (HTTP status, exit
code) without importing the module that raised it."""


class ConfigError(ValueError):
    """A configuration value is out of range, of the wrong type, or unknown (A4)."""


class RequestError(ValueError):
    """A request or its parameters are invalid. Nothing about it was recorded anywhere."""


class RequestRejected(RequestError):
    """A valid request that this scheduler can never serve (J1): too long for max_model_len
    or for the whole KV pool. The server answers 400."""


class QueueFullError(RequestError):
    """The waiting queue is at its request or token limit (K4). The server answers 503 with
    Retry-After; the request may succeed later. ``limit`` names the limit that refused it
    (``max_num_queued_reqs`` or ``max_num_queued_tokens``, vLLM's rejection reasons)."""

    def __init__(self, message: str, limit: str = "") -> None:
        super().__init__(message)
        self.limit = limit

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # the limit survives pickling
        return (QueueFullError, (str(self), self.limit))


class InvariantError(AssertionError):
    """The scheduler's state broke one of the invariants I1-I4: a bug, never bad input."""


def without_request_id(error: BaseException) -> str:
    """``error``'s message without the ``request <id>: `` its core messages start with: a
    caller that knows which request it sent (an HTTP client, ``prompts[i]`` offline) is not
    shown the internal id."""
    text = str(error)
    head, sep, rest = text.partition(": ")
    return rest if sep and head.startswith("request ") else text
