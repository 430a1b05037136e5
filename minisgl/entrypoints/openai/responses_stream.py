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
    call_item, cut, message_item, output_logprobs, reasoning_item, text_part,
)  # fmt: skip
from minisgl.entrypoints.openai.serving_base import new_id
from minisgl.entrypoints.openai.serving_chat import ChatDelta

Event = Tuple[str, Dict[str, Any]]  # (type, its fields but type and sequence_number)


def _short(tokens: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The text events' logprobs: token, logprob and the top ones' token and logprob (as the SDK types them, no bytes)."""
    return [{"token": t["token"], "logprob": t["logprob"], "top_logprobs": [{"token": x["token"], "logprob": x["logprob"]} for x in t["top_logprobs"]]}
            for t in tokens]  # fmt: skip


class StreamedOutput:
    """One choice's output items as its deltas come (`feed`), closed by `finish`.

    Logprobs: a message's are its answer's tokens, as the non-streamed response's (serving_responses.py
    answer_tokens). A reasoning delta's tokens go nowhere (the items of reasoning carry none). The
    chat path sends the tokens of text it holds back (a `<think>` tag, the blanks after `</think>`,
    blanks that may start a tag) as an empty content delta; they are held here, and go to the
    message when it opens if no reasoning came before it, else are dropped: they were the
    reasoning's tags."""

    def __init__(self, with_logprobs: bool) -> None:
        self.with_logprobs = with_logprobs
        self.items: List[Dict[str, Any]] = []  # every item opened so far, in output order
        self.kind: Optional[str] = None  # the open item's: "reasoning", "message", "function_call"
        self.text: List[str] = []  # the open item's text (or arguments) so far
        self.logprobs: List[Dict[str, Any]] = []  # the open message's tokens so far
        self.held: List[Dict[str, Any]] = []  # tokens of empty content deltas, until a message opens
        self.after_call: List[ChatDelta] = []  # text deltas right after a call, until the next says whether the call was cut
        self.finish_reason: Optional[str] = None

    def feed(self, d: ChatDelta) -> List[Event]:
        """The events of one ChatDelta. Text right after a call is held for one delta: the chat path
        sends a cut answer's text (its calls' too) as content just before the finish, and the call's
        output_item.done must then say "incomplete"."""
        if self.kind == "function_call" and (d.delta.content or d.delta.reasoning_content) and d.finish_reason is None:
            self.after_call.append(d)
            return []
        events: List[Event] = []
        if self.after_call:
            events += self._close("incomplete" if cut(d.finish_reason) else "completed")
            for held in self.after_call:
                events += self._feed(held)
            self.after_call = []
        return events + self._feed(d)

    def _feed(self, d: ChatDelta) -> List[Event]:
        delta, events = d.delta, []
        if delta.role is not None:  # (the role delta: an item opens with its first text instead)
            return events
        tokens = output_logprobs(d.logprobs) if self.with_logprobs else []
        if delta.reasoning_content:
            events += self._open("reasoning")
            self.held = []  # (the start tag's)
            self.text.append(delta.reasoning_content)
            events.append(("response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": delta.reasoning_content}))
        elif delta.content or (tokens and self.kind == "message"):
            if self.kind != "message":
                tokens = ([] if self._reasoned() else self.held) + tokens
                self.held = []
            events += self._open("message")
            self.text.append(delta.content or "")
            self.logprobs += tokens
            events.append(("response.output_text.delta", {**self._where(), "content_index": 0, "delta": delta.content or "", "logprobs": _short(tokens)}))
        elif tokens:
            self.held += tokens
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
        """Close what is open (incomplete when the finish cut it, and so every call: responses_convert.cut);
        an answer with no text and no call still gets its (empty) message."""
        self.finish_reason = finish_reason
        status = "incomplete" if cut(finish_reason) else "completed"
        events = self._close(status)
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            if not self._reasoned():
                self.logprobs = self.held
            events += self._open("message", keep_logprobs=True) + self._close(status)
        if status == "incomplete":  # (the calls' done events went out as they closed: the final response says it)
            for item in self.items:
                if item["type"] == "function_call":
                    item["status"] = status
        return events

    # --- items
    def _reasoned(self) -> bool:
        return any(item["type"] == "reasoning" for item in self.items)

    def _where(self) -> Dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _open(self, kind: str, keep_logprobs: bool = False) -> List[Event]:
        if self.kind == kind:
            return []
        events = self._close("completed")
        self.kind, self.text = kind, []
        if not keep_logprobs:
            self.logprobs = []
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
            item.update(arguments=text, status=status)
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
