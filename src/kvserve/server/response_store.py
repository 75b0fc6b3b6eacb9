"""The Responses API's store (docs/responses-api.md): responses kept for
GET /v1/responses/{id} and previous_response_id, the most recent ``capacity`` of them, in
memory (lost with the process, as vLLM's), each readable only with a key of the tenant that
made it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvserve.server.errors import APIError, bad_request

DEFAULT_STORE_CAPACITY = 1024


@dataclass
class Stored:
    owner: str | None  # the tenant of the key that made it (None: keys are off)
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # its input's and output's messages, history first


@dataclass
class ResponseStore:
    """Responses kept for GET /v1/responses/{id} and previous_response_id: the most
    recent ``capacity``, in memory (lost with the process, as vLLM's)."""

    enabled: bool = False
    capacity: int = DEFAULT_STORE_CAPACITY
    kept: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def put(self, response_id: str, stored: Stored) -> None:
        self.kept[response_id] = stored
        while len(self.kept) > self.capacity:
            self.kept.popitem(last=False)

    def get(self, response_id: str, owner: str | None) -> Stored:
        """The response, or a 404 (also for another key's: its id is not told apart)."""
        stored = self.kept.get(response_id)
        if stored is None or (stored.owner is not None and stored.owner != owner):
            raise APIError(404, f"response {response_id!r} not found (responses are kept "
                                f"in memory, the latest {self.capacity})",
                           param="response_id", code="response_not_found")
        return stored

    def delete(self, response_id: str, owner: str | None) -> None:
        self.get(response_id, owner)
        del self.kept[response_id]

    def history(self, response_id: str | None, owner: str | None) -> list[dict[str, Any]]:
        if response_id is None:
            return []
        if not self.enabled:
            raise bad_request("'previous_response_id' needs the response store, which is off "
                              "on this server (--enable-responses-store, or "
                              "VLLM_ENABLE_RESPONSES_API_STORE=1); send the whole "
                              "conversation as 'input' instead",
                              param="previous_response_id")
        try:
            return list(self.get(response_id, owner).conversation)
        except APIError as error:
            raise APIError(404, f"previous response {response_id!r} not found",
                           param="previous_response_id", code=error.code) from None
