"""The Responses API's store (docs/responses-api.md): responses kept for
GET /v1/responses/{id} and previous_response_id, each tenant's most recent ``capacity``, in
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
    input_items: list[dict[str, Any]]  # its own input, as items (GET .../input_items)


@dataclass
class ResponseStore:
    """Responses kept for GET /v1/responses/{id} and previous_response_id: each tenant's
    most recent ``capacity`` (one tenant's requests never push out another's, QA), in
    memory (lost with the process, as vLLM's)."""

    enabled: bool = False
    capacity: int = DEFAULT_STORE_CAPACITY  # per tenant (without keys: for everyone)
    kept: dict[str | None, OrderedDict[str, Stored]] = field(default_factory=dict)

    def put(self, response_id: str, stored: Stored) -> None:
        mine = self.kept.setdefault(stored.owner, OrderedDict())
        mine[response_id] = stored
        while len(mine) > self.capacity:
            mine.popitem(last=False)

    def get(self, response_id: str, owner: str | None) -> Stored:
        """The response, or a 404 (also for another tenant's: its id is not told apart)."""
        if not self.enabled:
            raise APIError(404, f"response {response_id!r} not found: the response store is "
                                "off on this server (--enable-responses-store), so no "
                                "response is kept", param="response_id",
                           code="response_not_found")
        stored = self.kept.get(owner, {}).get(response_id)
        if stored is None:
            raise APIError(404, f"response {response_id!r} not found (each tenant's latest "
                                f"{self.capacity} responses are kept, in memory)",
                           param="response_id", code="response_not_found")
        return stored

    def delete(self, response_id: str, owner: str | None) -> None:
        self.get(response_id, owner)
        del self.kept[owner][response_id]

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
