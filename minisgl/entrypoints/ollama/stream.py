"""Ollama's streamed chunks and timings (stage 1, the Ollama API). In: the chat path's ChatDeltas of
one answer, and the times its outputs arrived. Out: the pieces of Ollama's newline-delimited JSON
chunks, and the final chunk's counts and durations.

A chunk adds to the answer what one delta adds: /api/chat's `message` {role, content, thinking,
tool_calls}, /api/generate's `response` and `thinking`; with logprobs, the tokens it adds. Ollama
sends each tool call whole, its arguments an object, so from the answer's first call delta on the
deltas are held until the finish, which says whether they are calls: `tool_calls`, then one chunk
holds the held text and the calls; any other finish (the whole answer's parse refused them, or
num_predict cut one) the held text alone, as the non-streamed answer has it (the Anthropic
stream's rule, stream.py there).
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional

from minisgl.entrypoints.ollama.convert import done_reason
from minisgl.entrypoints.openai.protocol import UsageInfo
from minisgl.entrypoints.openai.serving_chat import ChatDelta

NS = 1_000_000_000


class Timings:
    """The durations of Ollama's final chunk, in nanoseconds, from three clock reads: the request's
    arrival, its first output (the prompt evaluated: the first token exists), its last."""

    def __init__(self) -> None:
        self.received = time.perf_counter()
        self.first: Optional[float] = None
        self.end: Optional[float] = None

    def first_output(self) -> None:
        self.first = time.perf_counter()

    def finished(self) -> None:
        self.end = time.perf_counter()

    def fields(self, usage: UsageInfo) -> Dict[str, int]:
        """total_duration, load_duration (0: the model is loaded before the server listens, no request
        loads it), prompt_eval_count (the prompt's tokens), prompt_eval_duration (arrival -> first
        output: queueing, tokenization, prefill), eval_count (the answer's tokens), eval_duration
        (first output -> last)."""
        end = self.end if self.end is not None else time.perf_counter()
        first = self.first if self.first is not None else end
        return {"total_duration": int((end - self.received) * NS), "load_duration": 0,
                "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": int((first - self.received) * NS),
                "eval_count": usage.completion_tokens, "eval_duration": int((end - first) * NS)}  # fmt: skip


class StreamedAnswer:
    """One answer's chunks as its deltas come (`feed`: the pieces to send now); `finish_reason` once it ends.
    `chat`: /api/chat's message pieces, else /api/generate's response pieces."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.held: Optional[List[ChatDelta]] = None  # from the first call delta on, until the finish
        self.finish_reason: Optional[str] = None

    def feed(self, d: ChatDelta) -> List[Dict[str, Any]]:
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
        if self.held is None and d.delta.tool_calls:
            self.held = []
        if self.held is None:
            return self._pieces([d], with_calls=False)
        self.held.append(d)
        if d.finish_reason is None:
            return []
        held, self.held = self.held, None
        return self._pieces(held, with_calls=d.finish_reason == "tool_calls")

    def _pieces(self, deltas: List[ChatDelta], with_calls: bool) -> List[Dict[str, Any]]:
        """One piece per delta that adds reasoning or content (or logprobs), and with_calls one piece
        holding the text, the reasoning, the logprobs of `deltas` and their calls, whole (so a
        streamed answer's lines add up to the whole answer's fields)."""
        pieces = []
        calls: Dict[int, Dict[str, Any]] = {}
        text: List[str] = []
        reasoning: List[str] = []
        held_logprobs: List[Dict[str, Any]] = []
        for d in deltas:
            delta = d.delta
            for call in delta.tool_calls or []:  # (a call's id and name come first, then its arguments' pieces)
                entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
                entry["arguments"] += call.function.arguments
            logprobs = [entry.model_dump() for entry in d.logprobs.content or []] if d.logprobs is not None else []
            if delta.role is not None and not delta.content and not delta.reasoning_content and not logprobs:
                continue  # (the role delta: Ollama has no chunk for it)
            if with_calls:
                text.append(delta.content or "")
                reasoning.append(delta.reasoning_content or "")
                held_logprobs += logprobs
                continue
            if delta.reasoning_content or delta.content or logprobs:
                pieces.append(self._piece(delta.content or "", delta.reasoning_content, logprobs))
        if with_calls:
            ollama_calls = [{"id": c["id"], "function": {"index": k, "name": c["name"], "arguments": json.loads(c["arguments"] or "{}")}}
                            for k, c in enumerate(calls[i] for i in sorted(calls))]  # fmt: skip
            piece = self._piece("".join(text), "".join(reasoning) or None, held_logprobs)
            piece["message"]["tool_calls"] = ollama_calls
            pieces.append(piece)
        return pieces

    def _piece(self, content: str, thinking: Optional[str], logprobs: List[Dict[str, Any]]) -> Dict[str, Any]:
        piece: Dict[str, Any] = {"message": {"role": "assistant", "content": content}} if self.chat else {"response": content}
        if thinking:
            (piece["message"] if self.chat else piece)["thinking"] = thinking
        if logprobs:
            piece["logprobs"] = logprobs
        return piece

    @property
    def done_reason(self) -> str:
        return done_reason(self.finish_reason)
