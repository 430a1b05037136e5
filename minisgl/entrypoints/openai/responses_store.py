"""ResponseStore (stage 1, the Responses API). In: finished responses. Out: what GET /v1/responses/{id},
GET .../input_items and `previous_response_id` read back.

OpenAI keeps a response with `store: true` (its default) for 30 days; minisgl keeps it in the
HTTP process's memory, bounded twice: at most `capacity` responses (MAX_STORED_RESPONSES) and at
most `max_bytes` of them (MAX_STORED_BYTES), counted as their compact JSON. Storing one more
forgets the oldest until both hold; one larger than `max_bytes` on its own is not stored at all
(its id is remembered, so that a GET of it says why it is a 404); a restart forgets them all
(docs/server.md, "Responses API"). A count alone is no bound: one response with top_logprobs 20
over a long answer is ~10 MiB of JSON (and several times that as Python objects, which is why an
entry is kept as its JSON bytes and parsed again when read).

Each entry holds the response object as it was sent, the request's own input items, and the
conversation it continues as chat messages (its previous responses' turns, its input, its
output), so a chain of `previous_response_id`s needs only its last response kept.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Dict, List, NamedTuple, Optional

# the bounds of the store (the oldest go first when either is passed)
MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 256 * 1024 * 1024  # (of compact JSON)


class StoredResponse(NamedTuple):
    response: Dict[str, Any]  # the response object as the client got it (JSON-ready)
    input_items: List[Dict[str, Any]]  # this request's input, as items with ids (GET .../input_items)
    # the conversation for a next turn: chat messages (role, content, tool_calls, ...) without the
    # instructions (OpenAI does not carry them over), this response's output last
    conversation: List[Dict[str, Any]]


class ResponseStore:
    """Stored responses by id, in insertion order, as compact JSON; bounded by count and by bytes
    (the oldest go first)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        if capacity < 1 or max_bytes < 1:
            raise ValueError(f"a response store keeps at least one response and one byte, got capacity {capacity}, max_bytes {max_bytes}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._entries: "OrderedDict[str, bytes]" = OrderedDict()
        self.bytes = 0  # the entries' total size
        # ids of responses too large to store, with their size (as many as `capacity`: for the 404's message)
        self._too_large: "OrderedDict[str, int]" = OrderedDict()

    def put(self, entry: StoredResponse) -> bool:
        """Store `entry` (forgetting the oldest as the bounds need); False when it alone is over max_bytes."""
        response_id = entry.response["id"]
        blob = json.dumps(entry._asdict(), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        self.delete(response_id)
        if len(blob) > self.max_bytes:
            self._too_large[response_id] = len(blob)
            while len(self._too_large) > self.capacity:
                self._too_large.popitem(last=False)
            return False
        self._entries[response_id] = blob
        self.bytes += len(blob)
        while len(self._entries) > self.capacity or self.bytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.bytes -= len(oldest)
        return True

    def get(self, response_id: str) -> Optional[StoredResponse]:
        blob = self._entries.get(response_id)
        return StoredResponse(**json.loads(blob)) if blob is not None else None

    def too_large(self, response_id: str) -> Optional[int]:
        """The size of a response that was not stored for being over max_bytes, else None."""
        return self._too_large.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Whether it was stored (and is now gone)."""
        blob = self._entries.pop(response_id, None)
        if blob is None:
            return False
        self.bytes -= len(blob)
        return True

    def __len__(self) -> int:
        return len(self._entries)
