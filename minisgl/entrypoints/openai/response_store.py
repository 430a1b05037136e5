"""ResponseStore (stage 1, the Responses API). In: finished responses. Out: what GET /v1/responses/{id},
GET .../input_items and `previous_response_id` read back.

OpenAI keeps a response with `store: true` (its default) for 30 days; minisgl keeps it in the
HTTP process's memory, at most `capacity` of them (MAX_STORED_RESPONSES by default): storing one
more forgets the oldest, and a restart forgets them all (docs/server.md, "Responses API"). Each
entry holds the response object as it was sent, the request's own input items, and the
conversation it continues as chat messages (its previous responses' turns, its input, its
output), so a chain of `previous_response_id`s needs only its last response kept.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, NamedTuple, Optional

# how many stored responses the server keeps (the oldest go first); a few MB of text at most
MAX_STORED_RESPONSES = 1024


class StoredResponse(NamedTuple):
    response: Dict[str, Any]  # the response object as the client got it (JSON-ready)
    input_items: List[Dict[str, Any]]  # this request's input, as items with ids (GET .../input_items)
    # the conversation for a next turn: chat messages (role, content, tool_calls, ...) without the
    # instructions (OpenAI does not carry them over), this response's output last
    conversation: List[Dict[str, Any]]


class ResponseStore:
    """Stored responses by id, in insertion order; bounded (the oldest go first)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        if capacity < 1:
            raise ValueError(f"a response store keeps at least one response, got capacity {capacity}")
        self.capacity = capacity
        self._entries: "OrderedDict[str, StoredResponse]" = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response["id"]] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)  # (the oldest)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Whether it was stored (and is now gone)."""
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
