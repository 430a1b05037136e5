"""SchedulerWidget: its buttons drive a real in-process Engine and it shows what engine.snapshot() says."""

from __future__ import annotations

import re
from typing import Any, Dict, Iterator

import pytest

from minisgl.visualizer.widget import SchedulerWidget


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Any]:
    from minisgl import Engine

    eng = Engine(tiny_model, device="cpu", chunked_prefill_size=32, max_total_tokens=2048, max_running_requests=8)
    yield eng
    eng.shutdown()


def _stable(snap: Dict[str, Any]) -> Dict[str, Any]:
    """The snapshot without the fields that change by merely reading it again (clocks)."""
    out = {k: v for k, v in snap.items() if k != "time"}
    out["waiting_queue"] = [{k: v for k, v in r.items() if k != "waited_ms"} for r in snap["waiting_queue"]]
    return out


def _rids(html: str, cls: str) -> list:
    return re.findall(rf'class="[^"]*\b{cls}\b[^"]*" data-rid="([^"]+)"', html)


def test_step_button_advances_the_engine_one_iteration_and_panels_match_the_snapshot(engine: Any) -> None:
    widget = SchedulerWidget(engine)
    widget.reset()
    widget.add_request(20, 4, rid="A")
    widget.add_request(70, 4, rid="B")  # 70 > chunked_prefill_size 32: chunked
    widget.add_request(10, 4, rid="C")
    assert _rids(widget.panels["waiting"], "req-card") == ["A", "B", "C"]
    before = engine.scheduler.forward_ct

    widget.buttons["Step"].click()
    assert engine.scheduler.forward_ct == before + 1 and widget.step_count == 1
    snap = engine.snapshot()
    assert _stable(widget.last_snapshot) == _stable(snap)
    # what the panels show is what the snapshot says
    assert snap["forward_mode"] == "EXTEND"
    assert 'data-mode="EXTEND"' in widget.panels["batch"]
    assert _rids(widget.panels["batch"], "batch-req") == [r["rid"] for r in snap["batch"]["reqs"]] == ["A", "B"]
    chunked = snap["chunked_req"]
    assert chunked["rid"] == "B" and f'chunk {chunked["chunk_index"]}/{chunked["num_chunks"]}' in widget.panels["batch"]
    assert _rids(widget.panels["waiting"], "req-card") == [r["rid"] for r in snap["waiting_queue"]] == ["C"]
    assert f'data-reason="{snap["adder"]["stop_reason"]}"' in widget.panels["adder"]
    assert [s["step"] for s in widget.timeline] == [snap["step"]]


def test_run_n_steps_reaches_decode_then_finishes_with_ttft_and_reset_clears(engine: Any) -> None:
    widget = SchedulerWidget(engine)
    widget.reset()
    for rid, n in (("A", 20), ("B", 70), ("C", 10)):
        widget.add_request(n, 4, rid=rid)
    widget.n_steps.value = 3
    widget.buttons["Run N steps"].click()
    assert widget.step_count == 3
    modes = [s["forward_mode"] for s in widget.timeline]
    assert modes[:3] == ["EXTEND", "EXTEND", "EXTEND"]  # A + B chunk 1, B chunk 2, B chunk 3 + C
    widget.run(100)
    assert not engine.has_unfinished_requests()
    decode_steps = [s for s in widget.timeline if s["forward_mode"] == "DECODE"]
    assert decode_steps and max(s["batch_size"] for s in decode_steps) == 3
    assert sorted(f["rid"] for f in widget.finished) == ["A", "B", "C"]
    assert len(re.findall(r'class="row finished-req"', widget.panels["finished"])) == 3
    assert "TTFT" in widget.panels["finished"]
    widget.max_finished = 2  # a long session draws the newest rows only (every press re-sends them)
    widget.step()
    drawn = re.findall(r'class="row finished-req" data-rid="(\w+)"', widget.panels["finished"])
    assert drawn == [f["rid"] for f in reversed(widget.finished)][:2] and len(widget.finished) == 3
    for rid in ("A", "B", "C"):
        engine.get_result(rid)

    widget.buttons["Reset"].click()
    assert widget.step_count == 0 and widget.timeline == [] and widget.finished == []
    assert widget.last_snapshot["radix"]["total_tokens"] == 0  # the radix cache was flushed


def test_stepping_an_idle_engine_adds_no_second_bar_for_the_same_step(engine: Any) -> None:
    """The page merges a republished step into one bar (merge_step_summaries); so does the widget."""
    widget = SchedulerWidget(engine)
    widget.reset()
    widget.add_request(8, 1, rid="solo")
    widget.step()  # EXTEND: prefilled, and finished (one new token)
    widget.step()  # nothing left: the same step published again, IDLE
    widget.step()
    assert len(widget.timeline) == 1 and widget.timeline[0]["forward_mode"] == "EXTEND"
    assert len(re.findall(r'class="[^"]*\bcurrent\b', widget.panels["timeline"])) == 1
    engine.get_result("solo")


def test_a_button_error_is_shown_in_the_widget(engine: Any) -> None:
    """An Add request past the context raised inside the click callback: only the ipywidgets
    log saw it, and the learner saw nothing happen."""
    widget = SchedulerWidget(engine)
    widget.prompt_len.value = engine.context_len + 10
    widget.buttons["Add request"].click()
    assert "error" in widget._header.value and "context length" in widget._header.value
    assert not engine.has_unfinished_requests()


def test_the_widget_styles_only_itself(engine: Any) -> None:
    """The page's stylesheet, pasted into a notebook as it was, restyled the whole notebook
    (`body` font and background, every `pre`, Bootstrap's `.row` turned into a grid)."""
    widget = SchedulerWidget(engine)
    style = widget._style.value
    css = re.sub(r"/\*.*?\*/", "", style.removeprefix("<style>").removesuffix("</style>"), flags=re.S)
    heads = [h.strip() for h in re.findall(r"([^{}]+)\{[^{}]*\}", css)]
    assert len(heads) > 50  # every rule of the page is there
    for head in heads:
        for selector in head.split(","):
            assert selector.strip().startswith(".minisgl-viz"), f"{selector.strip()!r} reaches outside the widget"
    assert "minisgl-viz" in widget.widget._dom_classes
    # the colour variables the panels use are defined on the widget itself
    assert re.search(r"(^|\})\s*\.minisgl-viz \{[^}]*--extend:", css)


def test_ctrl_c_in_run_still_shows_the_step_it_interrupted(engine: Any, monkeypatch: Any) -> None:
    """Ctrl-C is delivered after the step it lands in: the widget lost that step (its finished
    requests never reached .finished, its bar never reached the timeline)."""
    import os
    import signal

    widget = SchedulerWidget(engine)
    widget.add_request(prompt_len=12, max_new_tokens=2)
    run_step, calls = engine.scheduler.run_step, []

    def hit_by_ctrl_c() -> Any:
        calls.append(1)
        if len(calls) == 2:  # the step that finishes the request (prefill: token 1, decode: token 2)
            os.kill(os.getpid(), signal.SIGINT)
        return run_step()

    monkeypatch.setattr(engine.scheduler, "run_step", hit_by_ctrl_c)
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a backgrounded pytest ignores it)
    try:
        with pytest.raises(KeyboardInterrupt):
            widget.run(10)
    finally:
        signal.signal(signal.SIGINT, interrupt)
    assert widget.step_count == 2 and widget.last_snapshot["step"] == engine.snapshot()["step"]
    assert [f["rid"] for f in widget.finished] == ["r1"]
    widget.reset()
