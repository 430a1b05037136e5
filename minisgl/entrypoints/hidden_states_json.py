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
import time
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
    """One entry's JSON ([H] or [n, H]), a row at a time: in a worker thread, the event loop gets
    the GIL between rows (one json.dumps of an [n, H] entry holds it for all n). time.sleep(0) hands
    it over at once, rather than at the interpreter's next forced switch (5 ms): measured with a
    1 ms ticker on the loop, its median gap went from 3.9 to 1.4 ms while a 1,500 x 1,024 entry was written."""
    if entry.ndim == 1:
        return dumps(entry_as_list(entry))
    rows: List[str] = []
    for row in entry:
        rows.append(dumps(entry_as_list(row)))
        time.sleep(0)
    return "[" + ",".join(rows) + "]"


def _pieces(out: Dict[str, Any], hidden: Optional[List[str]], dumps: Dumps, pieces: List[str]) -> None:
    """`out` (a response dict) as JSON onto `pieces`, its meta_info["hidden_states"] the entries'
    JSON texts `hidden`: key for key what dumps(out) writes for the values as lists (same order,
    same separators). Pieces, joined once: each copy of a 40 MB answer holds the GIL ~10-30 ms."""
    if hidden is None:
        pieces.append(dumps(out))
        return
    pieces.append("{")
    for i, (key, value) in enumerate(out.items()):
        pieces.append(f"{',' if i else ''}{dumps(key)}:")
        if key != "meta_info":
            pieces.append(dumps(value))
            continue
        pieces.append("{")
        for j, (meta_key, meta_value) in enumerate(value.items()):
            pieces.append(f"{',' if j else ''}{dumps(meta_key)}:")
            if meta_key == "hidden_states":
                pieces.append("[")
                pieces.append(",".join(hidden))
                pieces.append("]")
            else:
                pieces.append(dumps(meta_value))
        pieces.append("}")
    pieces.append("}")


def answer_json(content: Union[Dict[str, Any], List[Dict[str, Any]]]) -> bytes:
    """/generate's non-streaming answer (one response dict, or a batch's list of them): the bytes
    JSONResponse would write for the same values as lists (tests/test_hidden_states_http.py)."""
    outs = content if isinstance(content, list) else [content]
    pieces: List[str] = ["["] if isinstance(content, list) else []
    for i, out in enumerate(outs):
        if i:
            pieces.append(",")
        entries = out["meta_info"].get("hidden_states")  # (None: a prompt of the batch that did not ask)
        _pieces(out, None if entries is None else [entry_json(e, answer_dumps) for e in entries], answer_dumps, pieces)
    if isinstance(content, list):
        pieces.append("]")
    return "".join(pieces).encode()


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

    async def chunk_json(self, out: Dict[str, Any], index: int, cumulative: bool) -> bytes:
        """`out` (a stream dict whose meta_info["hidden_states"] holds this chunk's new entries, or
        every entry so far when cumulative: the caller's list) as one SSE event, `data: <json>`;
        off the event loop when large (bytes: StreamingResponse would encode a str on the loop)."""
        entries = out["meta_info"]["hidden_states"]
        texts = self.texts.setdefault(index, [])
        new = entries[len(texts) :] if cumulative else entries  # (cumulative: the ones not written yet)
        self.numbers[index] = self.numbers.get(index, 0) + count_numbers(new)
        numbers = self.numbers[index] if cumulative else count_numbers(new)

        def build() -> bytes:
            written = [entry_json(e, chunk_dumps) for e in new]
            if cumulative:
                texts.extend(written)
            pieces = ["data: "]
            _pieces(out, texts if cumulative else written, chunk_dumps, pieces)
            pieces.append("\n\n")
            return "".join(pieces).encode()

        return await off_loop_if_large(build, numbers)
