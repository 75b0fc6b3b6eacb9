"""The Responses API's store (docs/responses-api.md): responses kept for
GET /v1/responses/{id} and previous_response_id, each tenant's most recent ``capacity``, in
memory (lost with the process, as vLLM's), each readable only with a key of the tenant that
made it."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvserve.server.errors import APIError, bad_request

DEFAULT_STORE_CAPACITY = 1024
# Each tenant's responses are kept within this many bytes (their JSON's) too: a count alone
# let one client's 4 MiB responses (a thousand tools, kept and echoed) grow the server by
# gigabytes (QA).
DEFAULT_STORE_BYTES = 256 * 2**20


@dataclass
class Stored:
    owner: str | None  # the tenant of the key that made it (None: keys are off)
    response: dict[str, Any]
    # its input's and output's messages, history first, and its own input as items (GET
    # .../input_items); None: not kept (a background response larger than the store keeps,
    # of which only the status is)
    conversation: list[dict[str, Any]] | None
    input_items: list[dict[str, Any]] | None
    # a background response created with stream: its stream's events, for GET ?stream=true
    events: list[str] | None = None

    @property
    def size(self) -> int:
        """Its bytes as JSON (about what it holds in memory, and what a GET sends)."""
        return sum(len(json.dumps(part, ensure_ascii=False).encode())
                   for part in (self.response, self.conversation, self.input_items)) + \
            sum(len(event.encode()) for event in self.events or ())


def _under_way(stored: Stored) -> bool:
    return stored.response.get("status") in ("queued", "in_progress")


@dataclass
class ResponseStore:
    """Responses kept for GET /v1/responses/{id} and previous_response_id: each tenant's
    most recent ``capacity`` (one tenant's requests never push out another's, QA), in
    memory (lost with the process, as vLLM's)."""

    enabled: bool = False
    capacity: int = DEFAULT_STORE_CAPACITY  # per tenant (without keys: for everyone)
    max_bytes: int = DEFAULT_STORE_BYTES  # per tenant too
    kept: dict[str | None, OrderedDict[str, tuple[Stored, int]]] = field(default_factory=dict)
    used: dict[str | None, int] = field(default_factory=dict)  # bytes kept, per tenant

    def put(self, response_id: str, stored: Stored) -> bool:
        """Keep it (replacing what was kept under its id: a background response's whole
        answer after its first), dropping the tenant's oldest ended responses past
        ``capacity`` responses or ``max_bytes``; one under way (a background response's)
        is never dropped (QA: it could not be cancelled, then came back). False where it
        is larger than ``max_bytes`` alone: not kept, and it pushes out none."""
        owner = stored.owner
        mine = self.kept.setdefault(owner, OrderedDict())
        if response_id in mine:
            self.used[owner] -= mine.pop(response_id)[1]
        size = stored.size
        if size > self.max_bytes:
            return False  # it would push out all the others and not fit itself
        mine[response_id] = (stored, size)
        self.used[owner] = self.used.get(owner, 0) + size
        while len(mine) > self.capacity or self.used[owner] > self.max_bytes:
            oldest = next((key for key, (kept, _) in mine.items()
                           if not _under_way(kept) and key != response_id), None)
            if oldest is None:  # only responses under way (and this one): kept over
                break
            self.used[owner] -= mine.pop(oldest)[1]
        return True

    def get(self, response_id: str, owner: str | None) -> Stored:
        """The response, or a 404 (also for another tenant's: its id is not told apart)."""
        if not self.enabled:
            raise APIError(404, f"response {response_id[:100]!r} not found: the response store is "
                                "off on this server (--enable-responses-store), so no "
                                "response is kept", param="response_id",
                           code="response_not_found")
        kept = self.kept.get(owner, {}).get(response_id)
        if kept is None:
            raise APIError(404, f"response {response_id[:100]!r} not found (each tenant's latest "
                                f"{self.capacity} responses within {self.max_bytes:,} "
                                "bytes are kept, in memory)",
                           param="response_id", code="response_not_found")
        return kept[0]

    def items(self, item_ids: set[str], owner: str | None) -> dict[str, dict[str, Any]]:
        """The stored items (inputs' or outputs') of these ids found, by id, the latest
        response's where two hold one (OpenAI's ``item_reference`` names one): one pass over
        the tenant's store, however many a request names (QA: one per reference)."""
        found: dict[str, dict[str, Any]] = {}
        for stored, _ in reversed(self.kept.get(owner, {}).values()):
            for item in (*(stored.response.get("output") or ()), *(stored.input_items or ())):
                item_id = item.get("id")
                if item_id in item_ids and item_id not in found:
                    found[item_id] = item
            if len(found) == len(item_ids):
                break
        return found

    def delete(self, response_id: str, owner: str | None) -> None:
        self.get(response_id, owner)
        _, size = self.kept[owner].pop(response_id)
        self.used[owner] -= size

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
            stored = self.get(response_id, owner)
        except APIError as error:
            raise APIError(404, f"previous response {response_id[:100]!r} not found",
                           param="previous_response_id", code=error.code) from None
        if _under_way(stored):
            raise bad_request(f"previous response {response_id[:100]!r} is still under way "
                              "(background): wait until GET /v1/responses/{id} says it "
                              "completed", param="previous_response_id")
        if stored.conversation is None:  # QA: continued with no history at all
            raise bad_request(f"previous response {response_id[:100]!r} was larger than this "
                              "server's store keeps, so its conversation was not kept: send "
                              "the whole conversation as 'input' instead",
                              param="previous_response_id")
        return list(stored.conversation)
