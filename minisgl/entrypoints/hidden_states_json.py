"""Hidden states as JSON (stage 1, the HTTP process's last step for return_hidden_states).
In: the TokenizerManager's response dicts, whose meta_info["hidden_states"] holds float32 numpy
entries (entry 0 [n, H], then [H] each: views of the frames the detokenizer sent). Out: the JSON
text of /generate's answer or stream chunk, in SGLang's layout, the numbers exactly as Python
writes the float32 values (NaN and inf as null).

Why a module of its own: JSON numbers cost ~0.5 us each to write, and a 2,000-token prompt at
H = 1,024 is two million of them (~1 s). Written inline, as one json.dumps on the event loop,
that second stalled every other stream of the server. So a large answer is written in a worker
thread, one row at a time (the event loop takes the GIL between rows, as `json_list_in_pieces`
lets it between embeddings), and a cumulative stream writes each entry once, not once per chunk.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Dict, List, Optional, TypeVar, Union

import numpy as np

from minisgl.managers.io_struct import entry_as_list

T = TypeVar("T")
Dumps = Callable[[Any], str]

# Hidden-state numbers above which a chunk or answer is written off the event loop: ~0.5 us a
# number, so 8,192 (two decode rows at H = 4,096) hold the loop ~4 ms; a thread hop costs ~0.1 ms.
OFF_LOOP_NUMBERS = 8192


def answer_dumps(value: Any) -> str:
    """JSONResponse's encoding (what /generate's other answers use): UTF-8 text, no NaN."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def chunk_dumps(value: Any) -> str:
    """sse_data's encoding of a dict (what /generate's other stream chunks use)."""
    return json.dumps(value, separators=(",", ":"))


def count_numbers(entries: List[np.ndarray]) -> int:
    return sum(entry.size for entry in entries)


def entry_json(entry: np.ndarray, dumps: Dumps) -> str:
    """One entry's JSON ([H] or [n, H]), a row at a time: run in a worker thread, the event loop
    gets the GIL between rows (one json.dumps of an [n, H] entry holds it for all n)."""
    if entry.ndim == 1:
        return dumps(entry_as_list(entry))
    return "[" + ",".join(dumps(entry_as_list(row)) for row in entry) + "]"


def response_json(out: Dict[str, Any], hidden_json: Optional[str], dumps: Dumps) -> str:
    """`out` (a response dict) as JSON, with meta_info["hidden_states"] written as `hidden_json`;
    key for key what dumps(out) writes for lists of numbers (same order, same separators)."""

    def meta_json(meta: Dict[str, Any]) -> str:
        items = (f"{dumps(k)}:{hidden_json if k == 'hidden_states' else dumps(v)}" for k, v in meta.items())
        return "{" + ",".join(items) + "}"

    if hidden_json is None:
        return dumps(out)
    return "{" + ",".join(f"{dumps(k)}:{meta_json(v) if k == 'meta_info' else dumps(v)}" for k, v in out.items()) + "}"


def answer_json(content: Union[Dict[str, Any], List[Dict[str, Any]]]) -> str:
    """/generate's non-streaming answer (one response dict, or a batch's list of them) as the JSON
    JSONResponse would write for the same values as lists (tests/test_hidden_states_http.py)."""

    def one(out: Dict[str, Any]) -> str:
        entries = out["meta_info"].get("hidden_states")
        if entries is None:  # (a prompt of the batch that did not ask)
            return answer_dumps(out)
        return response_json(out, "[" + ",".join(entry_json(e, answer_dumps) for e in entries) + "]", answer_dumps)

    if isinstance(content, list):
        return "[" + ",".join(one(out) for out in content) + "]"
    return one(content)


def answer_numbers(content: Union[Dict[str, Any], List[Dict[str, Any]]]) -> int:
    outs = content if isinstance(content, list) else [content]
    return sum(count_numbers(out["meta_info"].get("hidden_states") or []) for out in outs)


async def off_loop_if_large(fn: Callable[[], T], numbers: int) -> T:
    """fn() in a worker thread when it writes more than OFF_LOOP_NUMBERS numbers, else here (a
    decode step's row or two is cheaper than the thread hop)."""
    if numbers > OFF_LOOP_NUMBERS:
        return await asyncio.to_thread(fn)
    return fn()


class StreamedEntries:
    """A /generate stream's hidden-state JSON, per prompt index: each entry written once and kept
    as text, since a cumulative chunk (SGLang's) resends every entry so far; written again per
    chunk, a 2,000-token prompt's entry cost ~1 s with every token."""

    def __init__(self) -> None:
        self.texts: Dict[int, List[str]] = {}  # index -> its entries' JSON so far
        self.numbers: Dict[int, int] = {}  # index -> the numbers in them

    async def chunk_json(self, out: Dict[str, Any], index: int, cumulative: bool) -> str:
        """`out` (a stream dict whose meta_info["hidden_states"] holds this chunk's new entries, or
        every entry so far when cumulative: the caller's list) as JSON; off the event loop when large."""
        meta = out["meta_info"]
        entries = meta["hidden_states"]
        texts = self.texts.setdefault(index, [])
        new = entries[len(texts) :] if cumulative else entries  # (cumulative: the ones not written yet)
        self.numbers[index] = self.numbers.get(index, 0) + count_numbers(new)
        numbers = self.numbers[index] if cumulative else count_numbers(new)

        def build() -> str:
            written = [entry_json(e, chunk_dumps) for e in new]
            if cumulative:
                texts.extend(written)
            return response_json(out, "[" + ",".join(texts if cumulative else written) + "]", chunk_dumps)

        return await off_loop_if_large(build, numbers)
