"""What the visualizer is shown about requests that arrive or are aborted between steps.

Arrivals and aborts of waiting or mid-chunk requests are handled by
process_input_requests, before the next step runs; the snapshot after that step is the
first one anybody sees (Engine.step, the server's publish), so it must carry them. An
abort before any forward has no TTFT: its finished record says null, and the schema
check, render.py and the timeline merge all cope with that.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import pytest

from minisgl.visualizer.render import render_panels
from minisgl.visualizer.snapshot import merge_snapshots, validate_snapshot
from minisgl.visualizer.widget import demo_input_ids

SP = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Any]:
    from minisgl import Engine

    eng = Engine(tiny_model, device="cpu", chunked_prefill_size=32, max_total_tokens=2048, max_running_requests=1)
    yield eng
    eng.shutdown()


def _events(snap: Dict[str, Any]) -> List[tuple]:
    return [(e["type"], e["rid"]) for e in snap["events"]]


def test_arrivals_and_an_abort_while_waiting_show_in_the_next_step_snapshot(engine: Any) -> None:
    engine.add_request(input_ids=demo_input_ids(10, 1), sampling_params=SP, rid="A")
    engine.add_request(input_ids=demo_input_ids(10, 2), sampling_params=SP, rid="B")
    snap = engine.step()
    assert ("arrive", "A") in _events(snap) and ("arrive", "B") in _events(snap)
    assert [w["rid"] for w in snap["waiting_queue"]] == ["B"]  # max_running_requests=1

    engine.abort("B")  # still waiting: aborted at once, between steps
    snap = engine.step()
    assert ("abort", "B") in _events(snap)
    [fin] = [f for f in snap["finished"] if f["rid"] == "B"]
    assert fin["finish_reason"]["type"] == "abort"
    # never ran: no schedule, forward or TTFT, but every key is there
    assert fin["queue_ms"] >= 0 and fin["e2e_ms"] >= fin["queue_ms"]
    assert fin["schedule_ms"] is None and fin["forward_ms"] is None and fin["ttft_ms"] is None
    assert validate_snapshot(snap) == []
    finished = render_panels(snap, [], [fin])["finished"]
    assert 'data-rid="B"' in finished and 'data-ttft=""' in finished and "TTFT –" in finished

    snap = engine.step()  # shown once, not again
    assert ("abort", "B") not in _events(snap)
    engine.run_until_idle()
    engine.get_result("A")
    engine.get_result("B")


def test_an_abort_mid_chunk_shows_its_event_and_a_finished_record(engine: Any) -> None:
    engine.add_request(input_ids=demo_input_ids(100, 3), sampling_params=SP, rid="C")  # 100 > chunk 32
    for _ in range(3):  # a finished request lingers in running_batch for one step
        snap = engine.step()
        if snap["chunked_req"] is not None:
            break
    assert snap["chunked_req"]["rid"] == "C" and snap["chunked_req"]["chunk_index"] == 1
    [row] = [r for r in snap["batch"]["reqs"] if r["rid"] == "C"]
    engine.abort("C")
    # between steps the last step's batch row keeps its chunk progress (it was "1/1" after the abort)
    [again] = [r for r in engine.snapshot()["batch"]["reqs"] if r["rid"] == "C"]
    assert (again["chunk_index"], again["num_chunks"]) == (row["chunk_index"], row["num_chunks"]) == (1, 4)
    snap = engine.step()
    assert ("abort", "C") in _events(snap)
    [fin] = [f for f in snap["finished"] if f["rid"] == "C"]
    assert fin["schedule_ms"] is not None and fin["forward_ms"] is None and fin["ttft_ms"] is None
    assert validate_snapshot(snap) == []
    engine.run_until_idle()
    engine.get_result("C")


def test_finished_times_must_be_numbers_or_null() -> None:
    from test_visualizer_sse import _finished, make_snapshot

    ok = make_snapshot(3, finished=[{**_finished("a"), "ttft_ms": None}])
    assert validate_snapshot(ok) == []
    bad = make_snapshot(3, finished=[{**_finished("a"), "ttft_ms": "soon"}])
    assert any("ttft_ms" in p for p in validate_snapshot(bad))


def test_a_republished_step_is_one_timeline_entry_keeping_its_batch() -> None:
    from test_visualizer_sse import make_snapshot

    ran = make_snapshot(5)  # DECODE, 2 requests
    again = {**make_snapshot(5, mode="IDLE", events=[{"type": "arrive", "rid": "x", "detail": ""}]), "batch": None}
    merged = merge_snapshots([make_snapshot(4), ran, again, again])
    assert [(s["step"], s["forward_mode"], s["batch_size"]) for s in merged["steps"]] == [(4, "DECODE", 2), (5, "DECODE", 2)]
    assert merged["steps"][-1]["event_types"] == ["arrive"]
    assert [e["type"] for e in merged["events"]] == ["arrive", "arrive"]  # every event is still listed
