"""The Messages API stream's content blocks (stage 1, the Anthropic Messages API). In: the chat path's
ChatDeltas of one choice. Out: Anthropic's content-block events (type + fields).

A block opens when its first piece arrives and closes when another kind of piece comes, or at
the finish (Anthropic's order; `index` counts the blocks from 0):

    thinking:  content_block_start {thinking: "", signature: ""}, content_block_delta (thinking_delta) ..., content_block_stop
    text:      content_block_start {text: ""}, content_block_delta (text_delta) ..., content_block_stop
    tool_use:  content_block_start {id, name, input: {}}, content_block_delta (input_json_delta) ..., content_block_stop

The chat path sends a choice's reasoning, then its text, then its calls, each call's id and
name before its arguments (tool_call_stream.py); so one block is open at a time. The writer in
serving.py adds message_start before them and message_delta, message_stop after.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from minisgl.entrypoints.anthropic.convert import SIGNATURE, tool_use_id
from minisgl.entrypoints.openai.serving_chat import ChatDelta

Event = Tuple[str, Dict[str, Any]]  # (type, its fields but type)


class StreamedBlocks:
    """One choice's content blocks as its deltas come (`feed`); `finish_reason` and `matched` once it ends.

    A cut call: when max_tokens cuts an answer whose call was already streaming, the chat path
    sends the whole answer's text as content just before the finish (a cut answer is no call).
    That text is the call's own, already sent as input_json_delta: it is held for one delta and
    dropped when the finish is a cut, so the tool_use block ends with the partial input it
    streamed (Anthropic's way: stop_reason max_tokens), not followed by its text again."""

    def __init__(self) -> None:
        self.count = 0  # blocks opened so far (the open one's index is count - 1)
        self.kind: Optional[str] = None  # the open block's type
        self.after_call: List[ChatDelta] = []  # text deltas right after a call, until the next delta says whether the call was cut
        self.finish_reason: Optional[str] = None
        self.matched: Any = None

    def feed(self, d: ChatDelta) -> List[Event]:
        if self.kind == "tool_use" and (d.delta.content or d.delta.reasoning_content) and d.finish_reason is None:
            self.after_call.append(d)
            return []
        events: List[Event] = []
        if self.after_call and d.finish_reason not in ("length", "abort"):
            for held in self.after_call:
                events += self._feed(held)
        self.after_call = []
        return events + self._feed(d)

    def _feed(self, d: ChatDelta) -> List[Event]:
        delta, events = d.delta, []
        if delta.reasoning_content:
            events += self._open("thinking", {"thinking": "", "signature": SIGNATURE})
            events += self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content})
        elif delta.content and delta.role is None:
            events += self._open("text", {"text": ""})
            events += self._delta({"type": "text_delta", "text": delta.content})
        for call in delta.tool_calls or []:
            if call.id is not None:  # a new call: its id and name come first
                events += self._close()
                events += self._open("tool_use", {"id": tool_use_id(call.id), "name": call.function.name or "", "input": {}})
            if call.function.arguments:
                events += self._delta({"type": "input_json_delta", "partial_json": call.function.arguments})
        if d.finish_reason is not None:
            self.finish_reason, self.matched = d.finish_reason, d.matched_stop
            events += self._close()
        return events

    def _open(self, kind: str, block: Dict[str, Any]) -> List[Event]:
        if self.kind == kind and kind != "tool_use":
            return []
        events = self._close()
        self.kind, self.count = kind, self.count + 1
        return events + [("content_block_start", {"index": self.count - 1, "content_block": {"type": kind, **block}})]

    def _delta(self, delta: Dict[str, Any]) -> List[Event]:
        return [("content_block_delta", {"index": self.count - 1, "delta": delta})]

    def _close(self) -> List[Event]:
        if self.kind is None:
            return []
        self.kind = None
        return [("content_block_stop", {"index": self.count - 1})]
