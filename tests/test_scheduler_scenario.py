"""Seed 002's scenario, scripted: the exact batches SGLang's rules produce (docs/scheduler.md).

A (short), B (long, 3 chunks) and C arrive together with chunked_prefill_size 64.
fcfs: A + B chunk 1; B chunk 2; B chunk 3 + C; then decode of A, B, C. Outputs must
equal an unchunked run. With --enable-mixed-chunk, A's decode rides in B's later passes.
"""

from __future__ import annotations

import pytest

from minisgl import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
A = list(range(10, 30))  # 20 tokens
B = list(range(40, 190))  # 150 tokens: chunks of 44 (after A's 20), 64, 42
C = list(range(200, 220))  # 20 tokens


def _run(model: str, **kwargs):
    engine = Engine(model, device="cpu", max_total_tokens=4096, **kwargs)
    for rid, ids in (("A", A), ("B", B), ("C", C)):
        engine.add_request(input_ids=ids, sampling_params=GREEDY, rid=rid)
    batches = []
    while engine.has_unfinished_requests():
        snap = engine.step()
        batches.append((snap["forward_mode"], [(r["rid"], r["extend_len"]) for r in snap["batch"]["reqs"]]))
    outputs = {rid: engine.get_result(rid)["output_ids"] for rid in "ABC"}
    return batches, outputs


@pytest.fixture(scope="module")
def unchunked(tiny_model):
    return _run(tiny_model, chunked_prefill_size=-1)


def test_chunked_batches_follow_sglang_rules(tiny_model, unchunked):
    batches, outputs = _run(tiny_model, chunked_prefill_size=64)
    assert batches[:4] == [
        ("EXTEND", [("A", 20), ("B", 44)]),
        ("EXTEND", [("B", 64)]),
        ("EXTEND", [("B", 42), ("C", 20)]),
        ("DECODE", [("A", 1), ("B", 1), ("C", 1)]),
    ]
    assert all(mode == "DECODE" for mode, _ in batches[3:])
    assert outputs == unchunked[1]


def test_unchunked_run_is_one_prefill(unchunked):
    batches, _ = unchunked
    assert batches[0] == ("EXTEND", [("A", 20), ("B", 150), ("C", 20)])


def test_mixed_chunk_lets_decode_ride_in_prefill(tiny_model, unchunked):
    batches, outputs = _run(tiny_model, chunked_prefill_size=64, enable_mixed_chunk=True)
    assert batches[0] == ("EXTEND", [("A", 20), ("B", 44)])
    # B's second chunk shrinks by the one decode token A contributes
    assert batches[1] == ("MIXED", [("B", 63), ("A", 1)])
    assert batches[2][0] == "MIXED" and ("A", 1) in batches[2][1] and batches[2][1][0] == ("B", 43)
    assert outputs == unchunked[1]


def test_chunk_snapshot_reports_progress(tiny_model):
    engine = Engine(tiny_model, device="cpu", max_total_tokens=4096, chunked_prefill_size=64)
    engine.add_request(input_ids=B, sampling_params=GREEDY, rid="B")
    snap = engine.step()
    assert snap["chunked_req"] == {"rid": "B", "done_tokens": 64, "total_tokens": 150, "chunk_index": 1, "num_chunks": 3}
    # is_chunked counts chunks in flight: back to 0 once this chunk's result is processed
    assert snap["batch"]["reqs"][0]["is_chunked"] == 0
    assert (snap["batch"]["reqs"][0]["chunk_index"], snap["batch"]["reqs"][0]["num_chunks"]) == (1, 3)
    assert [e["type"] for e in snap["events"]] == ["arrive", "chunk"]  # B arrived between steps: shown in the next one
    assert snap["adder"]["stop_reason"] == "OTHER" and "rem_chunk_tokens" in snap["adder"]["stop_detail"]
    engine.run_until_idle()
    assert engine.get_result("B")["meta_info"]["completion_tokens"] == 6
