"""The Responses stream's output items (stage 1, the Responses API). In: the chat path's ChatDeltas
of one choice. Out: the Responses events (type + fields) that build its output items, and the items.

An item opens when its first piece arrives and closes when another kind of piece comes, or at
the finish (OpenAI's order):

    reasoning:      output_item.added, content_part.added, reasoning_text.delta ..., reasoning_text.done,
                    content_part.done, output_item.done
    message:        output_item.added, content_part.added, output_text.delta ..., output_text.done,
                    content_part.done, output_item.done
    function_call:  output_item.added, function_call_arguments.delta ..., function_call_arguments.done,
                    output_item.done

The chat path sends a choice's reasoning, then its text, then its calls, each call's name
before its arguments (tool_call_stream.py); so one item is open at a time. The writer in
serving_responses.py numbers the events and adds response.created / .completed around them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from minisgl.entrypoints.openai.responses_convert import (
    call_item, message_item, new_id, output_logprobs, reasoning_item, text_part,
)  # fmt: skip
from minisgl.entrypoints.openai.serving_chat import ChatDelta

Event = Tuple[str, Dict[str, Any]]  # (type, its fields but type and sequence_number)


def _short(tokens: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The text events' logprobs: token, logprob and the top ones' token and logprob (as the SDK types them, no bytes)."""
    return [{"token": t["token"], "logprob": t["logprob"], "top_logprobs": [{"token": x["token"], "logprob": x["logprob"]} for x in t["top_logprobs"]]}
            for t in tokens]  # fmt: skip


class StreamedOutput:
    """One choice's output items as its deltas come (`feed`), closed by `finish`."""

    def __init__(self, with_logprobs: bool) -> None:
        self.with_logprobs = with_logprobs
        self.items: List[Dict[str, Any]] = []  # every item opened so far, in output order
        self.kind: Optional[str] = None  # the open item's: "reasoning", "message", "function_call"
        self.text: List[str] = []  # the open item's text (or arguments) so far
        self.logprobs: List[Dict[str, Any]] = []  # the open message's tokens so far
        self.finish_reason: Optional[str] = None

    def feed(self, d: ChatDelta) -> List[Event]:
        delta, events = d.delta, []
        if delta.role is not None:  # (the role delta: an item opens with its first text instead)
            return events
        if delta.reasoning_content:
            events += self._open("reasoning")
            self.text.append(delta.reasoning_content)
            events.append(("response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": delta.reasoning_content}))
        tokens = output_logprobs(d.logprobs) if self.with_logprobs else []
        if delta.content or tokens:
            events += self._open("message")
            self.text.append(delta.content or "")
            self.logprobs += tokens
            events.append(("response.output_text.delta", {**self._where(), "content_index": 0, "delta": delta.content or "", "logprobs": _short(tokens)}))
        for call in delta.tool_calls or []:
            if call.id is not None:  # a new call: its id and name come first
                events += self._close("completed")
                self.kind, self.text = "function_call", []
                self.items.append(call_item(new_id("fc"), call.id, call.function.name or "", "", "in_progress"))
                events.append(("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(self.items[-1])}))
            if call.function.arguments:
                self.text.append(call.function.arguments)
                events.append(("response.function_call_arguments.delta", {**self._where(), "delta": call.function.arguments}))
        if d.finish_reason is not None:
            events += self.finish(d.finish_reason)
        return events

    def finish(self, finish_reason: str) -> List[Event]:
        """Close what is open; an answer with no text and no call still gets its (empty) message."""
        self.finish_reason = finish_reason
        status = "incomplete" if finish_reason == "length" else "completed"
        events = self._close(status)
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            events += self._open("message") + self._close(status)
        return events

    # --- items
    def _where(self) -> Dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _open(self, kind: str) -> List[Event]:
        if self.kind == kind:
            return []
        events = self._close("completed")
        self.kind, self.text, self.logprobs = kind, [], []
        if kind == "reasoning":
            self.items.append(reasoning_item(new_id("rs"), [], "in_progress"))
            part: Dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            self.items.append(message_item(new_id("msg"), [], "in_progress"))
            part = text_part("", [] if self.with_logprobs else None)
        return events + [
            ("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(self.items[-1])}),
            ("response.content_part.added", {**self._where(), "content_index": 0, "part": part}),
        ]

    def _close(self, status: str) -> List[Event]:
        if self.kind is None:
            return []
        item, text, where = self.items[-1], "".join(self.text), self._where()
        if self.kind == "function_call":
            # (chat's stream cannot take back a call it began: one cut short by the finish stays, as sent)
            item.update(arguments=text, status="completed")
            events = [("response.function_call_arguments.done", {**where, "arguments": text})]
        elif self.kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item.update(content=[part], status=status)
            events = [("response.reasoning_text.done", {**where, "content_index": 0, "text": text}),
                      ("response.content_part.done", {**where, "content_index": 0, "part": part})]  # fmt: skip
        else:
            part = text_part(text, self.logprobs if self.with_logprobs else None)
            item.update(content=[part], status=status)
            events = [("response.output_text.done", {**where, "content_index": 0, "text": text, "logprobs": _short(self.logprobs)}),
                      ("response.content_part.done", {**where, "content_index": 0, "part": part})]  # fmt: skip
        self.kind = None
        return events + [("response.output_item.done", {"output_index": where["output_index"], "item": dict(item)})]
