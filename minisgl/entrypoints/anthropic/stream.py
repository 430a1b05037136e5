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

from minisgl.entrypoints.anthropic.convert import SIGNATURE, partial_input, tool_use_id
from minisgl.entrypoints.openai.serving_chat import ChatDelta

Event = Tuple[str, Dict[str, Any]]  # (type, its fields but type)


class StreamedBlocks:
    """One choice's content blocks as its deltas come (`feed`); `finish_reason` and `matched` once it ends.

    A tool_use block cannot be taken back once sent, and only the finish says whether the calls
    the chat path streamed are the answer's: `tool_calls` (they are), `length` (a cut call: the
    non-streamed answer is a tool_use block of its partial input too, Anthropic's way, with
    stop_reason max_tokens) or `stop` (the whole answer's parse refused them: text after the
    calls, arguments that are no object, ...; the answer is then text, the calls' markup with it).
    So from a choice's first call on its deltas are held until the finish, then sent as the
    finish says: the calls for tool_calls and length (the text the chat path sends with a cut
    answer is the call's own, already in its input), the text alone otherwise. The stream is
    then the non-streamed answer, block for block; the price: a call's input arrives whole at
    the end, not as the model writes it."""

    def __init__(self) -> None:
        self.count = 0  # blocks opened so far (the open one's index is count - 1)
        self.kind: Optional[str] = None  # the open block's type
        self.held: Optional[List[ChatDelta]] = None  # from the first call delta on, until the finish
        self.finish_reason: Optional[str] = None
        self.matched: Any = None

    def feed(self, d: ChatDelta) -> List[Event]:
        if self.held is None and d.delta.tool_calls:
            self.held = []
        if self.held is None:
            return self._feed(d)
        if d.finish_reason is None:
            self.held.append(d)
            return []
        # which held deltas are the answer: all of them / the calls / the text
        keep = {"tool_calls": lambda h: True, "length": lambda h: bool(h.delta.tool_calls)}.get(d.finish_reason, lambda h: not h.delta.tool_calls)
        events: List[Event] = []
        for held in self.held:
            if keep(held):
                events += self._feed(held)
        self.held = None
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


def folded(events: List[Event]) -> List[Dict[str, Any]]:
    """The content blocks `events` add up to (what the SDK's stream helper builds): the
    non-streamed answer built the stream's way, where only a stream's reading of the answer
    holds (a call cut by max_tokens: its partial input)."""
    blocks: List[Dict[str, Any]] = []
    inputs: Dict[int, str] = {}
    for kind, fields in events:
        if kind == "content_block_start":
            blocks.append(dict(fields["content_block"]))
        elif kind == "content_block_delta":
            block, delta = blocks[fields["index"]], fields["delta"]
            if delta["type"] == "input_json_delta":
                inputs[fields["index"]] = inputs.get(fields["index"], "") + delta["partial_json"]
            else:
                key = "text" if delta["type"] == "text_delta" else "thinking"
                block[key] += delta[key]
    for index, text in inputs.items():
        blocks[index]["input"] = partial_input(text)
    return blocks
