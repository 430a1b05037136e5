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


def test_only_the_radix_hit_is_shown_as_cached_prefix_not_earlier_chunks_or_context(engine: Any) -> None:
    """A batch row's prefix is all KV already there; the grey-blue "cached prefix (radix hit)"
    is only what this round found in the tree, the tokens usage reports as cached_tokens."""
    prefix = demo_input_ids(40, 7)
    engine.add_request(input_ids=prefix + demo_input_ids(5, 8), sampling_params=SP, rid="D")
    engine.run_until_idle()
    engine.get_result("D")
    engine.add_request(input_ids=prefix + demo_input_ids(50, 9), sampling_params=SP, rid="F")  # 90 tokens, chunk 32
    rows = []
    for _ in range(4):  # two chunks, then decode steps
        snap = engine.step()
        rows += [(r, render_panels(snap)["batch"]) for r in (snap["batch"] or {}).get("reqs", []) if r["rid"] == "F"]
    got = [(r["prefix_len"], r["cached_len"], r["extend_len"], r["is_decode"]) for r, _ in rows]
    assert got[:3] == [(40, 40, 32, False), (72, 40, 18, False), (90, 0, 1, True)]
    engine.run_until_idle()
    assert engine.get_result("F")["meta_info"]["cached_tokens"] == 40
    chunk2, decode = rows[1][1], rows[2][1]
    assert 'title="cached prefix (radix hit) 40"' in chunk2 and 'title="earlier chunks 32"' in chunk2
    assert 'title="cached prefix (radix hit) 0"' in decode and 'title="context 90"' in decode


def test_a_retracted_request_has_waited_since_it_went_back_to_the_queue(tiny_model: str) -> None:
    import random
    import time

    from minisgl import Engine

    small = Engine(tiny_model, device="cpu", max_total_tokens=200, chunked_prefill_size=-1, schedule_conservativeness=0.1)
    try:
        # (test_scheduler_retract's workload: admitted requests reserve only new_token_ratio of
        # their output, so requests of varied lengths outgrow the pool)
        rng = random.Random(0)
        for i in range(64):
            params = {**SP, "max_new_tokens": rng.randrange(4, 36)}
            small.add_request(input_ids=[rng.randrange(10, 400) for _ in range(12)], sampling_params=params, rid=f"r{i}")
        for _ in range(400):
            t0 = time.perf_counter()
            snap = small.step()
            step_ms = (time.perf_counter() - t0) * 1e3
            retracted = {e["rid"] for e in snap["events"] if e["type"] == "retract"}
            if retracted:
                cards = [w for w in snap["waiting_queue"] if w["rid"] in retracted]
                assert cards and all(w["retracted"] and w["waited_ms"] <= step_ms for w in cards)
                break
        else:
            pytest.fail("no request was retracted: the pool is not under pressure")
    finally:
        small.shutdown()


def test_chunk_count_counts_the_budget_mixed_decode_rows_take(tiny_model: str) -> None:
    from minisgl import Engine

    eng = Engine(tiny_model, device="cpu", chunked_prefill_size=32, enable_mixed_chunk=True, max_total_tokens=2048)
    try:
        for i in range(8):
            eng.add_request(input_ids=demo_input_ids(4, i), sampling_params={**SP, "max_new_tokens": 40}, rid=f"d{i}")
        eng.step()
        eng.step()  # the 8 are decoding
        eng.add_request(input_ids=demo_input_ids(100, 99), sampling_params=SP, rid="long")
        progress = []
        for _ in range(8):
            snap = eng.step()
            progress += [(r["chunk_index"], r["num_chunks"], r["extend_len"]) for r in snap["batch"]["reqs"]
                         if r["rid"] == "long" and not r["is_decode"]]  # fmt: skip
        # each chunk is 32 - 8 decode rows = 24 tokens: 24, 24, 24, 24, 4
        assert progress == [(1, 5, 24), (2, 5, 24), (3, 5, 24), (4, 5, 24), (5, 5, 4)]
        assert snap["forward_mode"] in ("MIXED", "DECODE")
        eng.run_until_idle()
    finally:
        eng.shutdown()


def test_the_widget_outlines_retract_and_abort_steps_and_shows_request_slots() -> None:
    """The docs promise both for page and widget; the page's CSS outlines a bar by its
    data-events, which the widget's timeline did not write."""
    from test_visualizer_sse import make_snapshot

    from minisgl.visualizer.snapshot import step_summary

    snap = make_snapshot(7, events=[{"type": "retract", "rid": "b", "detail": ""}, {"type": "abort", "rid": "w", "detail": ""}])
    panels = render_panels(snap, [step_summary(make_snapshot(6)), step_summary(snap)])
    assert 'data-step="7"' in panels["timeline"] and 'data-events="abort retract"' in panels["timeline"]
    assert 'data-events=""' in panels["timeline"]  # step 6: nothing happened
    assert '<b class="req-slots">2 / 64</b>' in panels["memory"]
    # a waiting card's prefix is the last match the scheduler made, not the tree now: said so
    assert "prompt 300 tok · matched 0" in panels["waiting"] and "last matched this request" in panels["waiting"]


def test_a_waiting_request_shows_the_priority_it_named(tiny_model: str) -> None:
    from minisgl import Engine
    from minisgl.visualizer.render import render_waiting
    from minisgl.visualizer.snapshot import validate_snapshot

    with Engine(tiny_model, device="cpu", max_total_tokens=1024, max_running_requests=1, enable_priority_scheduling=True) as e:
        e.add_request("one", SP, rid="run", priority=3)
        e.add_request("two", SP, rid="named", priority=-2)
        e.add_request("three", SP, rid="unnamed")  # (the scheduler's default: the least important)
        snap = e.step()
        assert validate_snapshot(snap) == []
        assert {w["rid"]: w["priority"] for w in snap["waiting_queue"]} == {"named": -2, "unnamed": None}
        html = render_waiting(snap)
        assert '<span class="badge">priority -2</span>' in html and html.count("priority") == 1
        e.run_until_idle()


# --------------------------------------------------------------------------- speculative decoding
def test_a_verify_step_shows_each_rows_drafts_and_how_many_the_request_took(tiny_model: str) -> None:
    """--speculative-algorithm NGRAM on a repetitive prompt: each TARGET_VERIFY row says how many
    drafts it carried and how many the request took, which is exactly what its output grew by
    beyond one token; the panels draw one segment per draft, the taken ones solid."""
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=2048, speculative_algorithm="NGRAM") as e:
        snap = e.snapshot()
        assert snap["speculative"] == {"algorithm": "NGRAM", "num_draft_tokens": 4, "decode_rows": 0, "decode_tokens": 0,
                                       "accept_length": None}  # fmt: skip
        rid = e.add_request(input_ids=[11, 12, 13, 14, 15] * 4, sampling_params={**SP, "max_new_tokens": 40})
        out_len, verify_rows, decode_rows = 0, [], []
        while e.has_unfinished_requests():
            snap = e.step()
            assert validate_snapshot(snap) == []
            [row] = snap["batch"]["reqs"]
            if snap["forward_mode"] == "TARGET_VERIFY":
                assert row["is_decode"] and 0 <= row["accepted_len"] <= row["draft_len"] <= 3  # (4 draft tokens: 3 guesses)
                assert row["extend_len"] == 1 + row["draft_len"]
                assert row["output_len"] - out_len == row["accepted_len"] + 1, row
                verify_rows.append(row)
                html = render_panels(snap)["batch"]
                assert html.count('class="seg draft accepted"') == row["accepted_len"]
                assert html.count('class="seg draft rejected"') == row["draft_len"] - row["accepted_len"]
                assert '<span class="mode-tag" data-mode="TARGET_VERIFY">VERIFY</span>' in html
                assert f'+{row["accepted_len"]}/{row["draft_len"]} drafts' in html
            else:
                assert row["draft_len"] == row["accepted_len"] == 0
            if snap["forward_mode"] in ("TARGET_VERIFY", "DECODE"):
                decode_rows.append(row["output_len"] - out_len)  # (the tokens the decoding pass gave)
            out_len = row["output_len"]
        assert sum(r["accepted_len"] for r in verify_rows) > 10, "few drafts taken: the prompt did not speculate"
        spec = snap["speculative"]
        # every decoding pass counts (a plain decode step gives one token), as SGLang's spec_verify_ct
        assert spec["decode_rows"] == len(decode_rows) and spec["decode_tokens"] == sum(decode_rows)
        meta = e.get_result(rid)["meta_info"]
        assert meta["spec_verify_ct"] == len(decode_rows) and spec["accept_length"] == pytest.approx(sum(decode_rows) / len(decode_rows))
        assert meta["spec_accept_length"] == pytest.approx((sum(decode_rows) + 1) / len(decode_rows))  # (+ the prefill's token)
        assert f'accept len {spec["accept_length"]:.2f}' in render_panels(snap)["batch"]


def test_without_speculation_the_snapshot_says_null_and_rows_carry_no_drafts(engine: Any) -> None:
    engine.add_request(input_ids=demo_input_ids(10, 11), sampling_params=SP, rid="plain")
    snaps = [engine.step() for _ in range(2)]
    engine.run_until_idle()
    engine.get_result("plain")
    assert [s["forward_mode"] for s in snaps] == ["EXTEND", "DECODE"]
    assert all(s["speculative"] is None for s in snaps)
    assert [(r["draft_len"], r["accepted_len"]) for s in snaps for r in s["batch"]["reqs"]] == [(0, 0), (0, 0)]
    assert "accept len" not in render_panels(snaps[1])["batch"] and "seg draft" not in render_panels(snaps[1])["batch"]


def test_draft_counts_are_checked() -> None:
    from test_visualizer_sse import make_snapshot

    def with_rows(mode: str, draft: Any, accepted: Any) -> Dict[str, Any]:
        snap = make_snapshot(3, mode=mode)
        for r in snap["batch"]["reqs"]:
            r.update(draft_len=draft, accepted_len=accepted, extend_len=1 + (draft if isinstance(draft, int) else 0))
        return snap

    assert validate_snapshot(with_rows("TARGET_VERIFY", 3, 2)) == []
    assert any("exceeds draft_len" in p for p in validate_snapshot(with_rows("TARGET_VERIFY", 2, 3)))
    assert any("only TARGET_VERIFY carries drafts" in p for p in validate_snapshot(with_rows("DECODE", 2, 0)))
    assert any("must be ints" in p for p in validate_snapshot(with_rows("TARGET_VERIFY", "2", 0)))
    missing = make_snapshot(3)
    del missing["batch"]["reqs"][0]["accepted_len"]
    assert validate_snapshot(missing) == ["batch.reqs[0]: missing key 'accepted_len'"]
    spec = {**make_snapshot(3), "speculative": {"algorithm": "NGRAM", "num_draft_tokens": 4, "decode_rows": 2,
                                                "decode_tokens": 5, "accept_length": "2.5"}}  # fmt: skip
    assert any("accept_length must be a number or null" in p for p in validate_snapshot(spec))
    assert any("'speculative'" in p for p in validate_snapshot({**make_snapshot(3), "speculative": 2.5}))
