"""Headless Chromium against a live `minisgl serve --visualize` on a tiny model.

The page's own "Send demo requests" button sends the workload (short and long prompts,
shared prefixes); a small --chunked-prefill-size forces chunking. The test then pauses
and walks back through the server's ring buffer with the arrow keys, as a user would,
and checks the DOM shows a waiting request, an EXTEND step with a chunked request, a
DECODE step with several requests, and finished requests with their TTFT split.
Screenshots land in tests/artifacts/ (gitignored).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

from minisgl.utils import free_port

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent / "artifacts"
REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"headless Chromium not found at {CHROMIUM}"),
]


@contextlib.contextmanager
def _serve(tiny_model: str, *flags: str) -> Iterator[str]:
    """`minisgl serve --visualize` on the tiny model, as a subprocess; yields its URL."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "minisgl", "serve", "--model", tiny_model, "--port", str(port), "--visualize",
           "--device", "cpu", "--log-level", "warning", *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # type: ignore[union-attr]
            if "server ready" in line:
                break
            assert time.monotonic() < deadline, "server did not start in time"
        else:
            pytest.fail(f"server exited with code {proc.wait()} before it was ready")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def live_server(tiny_model: str) -> Iterator[str]:
    with _serve(tiny_model, "--chunked-prefill-size", "32", "--max-total-tokens", "4096", "--max-running-requests", "8") as url:
        yield url


@contextlib.contextmanager
def _open_live_page(page: Any) -> Iterator[Any]:
    """A LiveApp serving a fresh SnapshotHub, the page open on its /visualizer and connected;
    yields the hub to add snapshots to."""
    from test_visualizer_sse import LiveApp

    from minisgl.visualizer.sse import SnapshotHub

    hub = SnapshotHub()
    app = LiveApp(hub)
    try:
        page.goto(app.url + "/visualizer")
        page.wait_for_selector('#conn-status[data-state="open"]', timeout=15000)
        yield hub
    finally:
        app.stop()


def _console_errors(page: Any) -> list:
    """Console errors and uncaught exceptions, collected from now on (a 404 asset shows here too)."""
    errors: list = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return errors


def _frame_facts(page: Any) -> Dict[str, Any]:
    """What the panels show for the step on screen."""
    return page.evaluate(
        """() => ({
            step: Number(document.getElementById('step-num').textContent),
            mode: document.getElementById('batch-mode').dataset.mode,
            waiting: document.querySelectorAll('#waiting-queue .req-card').length,
            chunked: [...document.querySelectorAll('#batch .batch-req[data-decode="0"]')]
                .filter(r => Number(r.dataset.numChunks) > 1).map(r => r.querySelector('.label').textContent),
            batch: document.querySelectorAll('#batch .batch-req').length,
            decoding: document.querySelectorAll('#batch .batch-req[data-decode="1"]').length,
            // the grey-blue segment is the radix hit only: never a decoding request's context
            decode_hits: [...document.querySelectorAll('#batch .batch-req[data-decode="1"]')]
                .filter(r => r.dataset.cachedLen !== "0" || r.querySelector('.seg.prefix').title !== 'cached prefix (radix hit) 0').length,
            hit: Math.max(0, ...[...document.querySelectorAll('#batch .batch-req[data-decode="0"]')]
                .map(r => Number(r.dataset.cachedLen))),
        })"""
    )


def test_live_page_shows_waiting_chunked_extend_decode_batch_and_ttft(live_server: str) -> None:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        errors = _console_errors(page)
        page.goto(live_server + "/visualizer")
        page.wait_for_selector('#conn-status[data-state="open"]', timeout=15000)
        page.click("#btn-demo")
        page.wait_for_function("document.getElementById('demo-status').textContent === 'demo done'", timeout=120000)
        # every demo request finished; the live stream listed each with its TTFT split
        page.wait_for_function("document.querySelectorAll('#finished .finished-req').length >= 7", timeout=10000)
        ttft_text = page.inner_text("#finished .finished-req")
        assert "TTFT" in ttft_text and "queue" in ttft_text and "forward" in ttft_text
        assert all(float(v) > 0 for v in page.eval_on_selector_all("#finished .finished-req", "els => els.map(e => e.dataset.ttft)"))
        assert page.locator("#timeline .tl-step[data-mode='EXTEND'][data-chunked='1']").count() >= 1
        assert page.locator("#timeline .tl-step[data-mode='DECODE']").count() >= 1
        page.screenshot(path=str(ARTIFACTS / "visualizer_live.png"), full_page=True)

        # pause and walk back through the ring buffer, one step per key press
        page.keyboard.press("Space")
        page.wait_for_selector('#view-status[data-live="0"]')
        seen = {"waiting": None, "chunked_extend": None, "decode_batch": None, "radix_hit": None}
        for _ in range(400):
            facts = _frame_facts(page)
            assert facts["decode_hits"] == 0, facts
            if facts["hit"] > 0 and seen["radix_hit"] is None:  # F and G reuse D's prefix
                seen["radix_hit"] = facts["step"]
            if facts["waiting"] > 0 and seen["waiting"] is None:
                seen["waiting"] = facts["step"]
            if facts["mode"] == "EXTEND" and facts["chunked"] and seen["chunked_extend"] is None:
                seen["chunked_extend"] = facts["step"]
                assert any("chunk " in label and "/" in label for label in facts["chunked"])
                page.screenshot(path=str(ARTIFACTS / "visualizer_chunked_step.png"), full_page=True)
            if facts["mode"] == "DECODE" and facts["decoding"] >= 2 and seen["decode_batch"] is None:
                seen["decode_batch"] = facts["step"]
            if all(v is not None for v in seen.values()):
                break
            before = facts["step"]
            page.keyboard.press("ArrowLeft")
            if _frame_facts(page)["step"] == before and page.inner_text("#view-status").startswith("PAUSED · 1/"):
                break  # the oldest step in the ring buffer
        assert all(v is not None for v in seen.values()), f"not shown while stepping back: {seen}"
        page.keyboard.press("ArrowRight")
        assert page.inner_text("#view-status").startswith("PAUSED")
        assert errors == []  # (the favicon request was one, on every load)
        browser.close()


def test_demo_is_served_whole_when_the_chunk_outgrows_the_context(tiny_model: str) -> None:
    """The default chunk (2048) at or above the context: prefix + tail once went past the
    context, as did E's prompt with its 48 tokens of output, and the page said "demo done"
    over 400s (3 of 7 on the README's own server)."""
    from playwright.sync_api import sync_playwright

    with _serve(tiny_model, "--chunked-prefill-size", "2048", "--context-length", "512") as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        errors = _console_errors(page)
        page.goto(url + "/visualizer")
        page.wait_for_selector('#conn-status[data-state="open"]', timeout=15000)
        page.click("#btn-demo")
        page.wait_for_function("document.getElementById('demo-status').textContent.startsWith('demo done')", timeout=120000)
        status = page.inner_text("#demo-status")
        assert "refused" not in status and "--chunked-prefill-size 256" in status, status
        page.wait_for_function("document.querySelectorAll('#finished .finished-req').length >= 7", timeout=10000)
        assert errors == []
        browser.close()


def test_a_verify_step_shows_its_drafts_taken_and_rejected(tiny_model: str) -> None:
    """`--speculative-algorithm NGRAM` and a prompt that repeats itself: the timeline has VERIFY
    steps; clicking one whose drafts were taken shows, per request, its decode token followed by
    one segment per draft (taken solid, rejected hatched), the counts in its label, the running
    accept length, and the legend's draft swatches."""
    import httpx
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with _serve(tiny_model, "--speculative-algorithm", "NGRAM", "--max-total-tokens", "2048") as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        errors = _console_errors(page)
        page.goto(url + "/visualizer")
        page.wait_for_selector('#conn-status[data-state="open"]', timeout=15000)
        assert "draft, accepted" in page.inner_text("#panel-batch .legend") and "VERIFY" in page.inner_text("#panel-timeline h2")
        params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
        for rid, ids in (("loop-a", [11, 12, 13, 14, 15] * 4), ("loop-b", [21, 22, 23] * 5)):
            r = httpx.post(url + "/generate", json={"input_ids": ids, "rid": rid, "sampling_params": params}, timeout=120)
            assert r.status_code == 200 and r.json()["meta_info"]["spec_verify_ct"] > 0, r.text
        page.wait_for_function("document.querySelectorAll('#finished .finished-req').length >= 2", timeout=10000)
        bars = "#timeline .tl-step[data-mode='TARGET_VERIFY']"
        assert page.locator(bars).count() >= 3
        assert page.inner_text("#spec-accept").startswith("accept len ")
        page.click(f"{bars}:not([data-accepted='0'])")  # a step that took drafts (clicking pauses on it)
        page.wait_for_selector('#view-status[data-live="0"]')
        assert page.inner_text("#batch-mode") == "VERIFY"
        rows = page.eval_on_selector_all(
            "#batch .batch-req",
            """els => els.map(r => ({draft: Number(r.dataset.draftLen), accepted: Number(r.dataset.acceptedLen),
                                    label: r.querySelector('.label').textContent,
                                    fits: r.querySelector('.label').scrollWidth <= r.querySelector('.label').clientWidth,
                                    segs: [...r.querySelectorAll('.stackbar .seg')].map(s => s.className),
                                    widths: [...r.querySelectorAll('.seg.draft')].map(s => s.getBoundingClientRect().width)}))""",
        )
        assert sum(r["accepted"] for r in rows) > 0, rows
        for r in rows:
            drafts = ["seg draft accepted"] * r["accepted"] + ["seg draft rejected"] * (r["draft"] - r["accepted"])
            # the decode token, then the drafts in order; each draft wide enough to count
            assert r["segs"] == ["seg prefix", "seg computed", "seg decode", *drafts], r
            assert all(w >= 4 for w in r["widths"]), r
            assert r["fits"], r  # (the label column is narrow: not cut to "+3/3 draft…")
            assert f"+{r['accepted']}/{r['draft']} drafts" in r["label"] if r["draft"] else "no drafts" in r["label"]
        page.screenshot(path=str(ARTIFACTS / "visualizer_verify_step.png"), full_page=True)
        assert errors == []
        browser.close()


# --------------------------------------------------------------------------- the page against a synthetic hub
# No model here: a SnapshotHub fed by hand (test_visualizer_sse.make_snapshot) behind the
# real routes, so each test sets up exactly the stream a user would hit.
@pytest.fixture()
def browser_page() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.errors = []  # type: ignore[attr-defined]
        page.on("pageerror", lambda e: page.errors.append(str(e)))  # type: ignore[attr-defined]
        yield page
        browser.close()


def _bars(page: Any) -> list:
    return page.eval_on_selector_all("#timeline .tl-step", "els => els.map(e => Number(e.dataset.step))")


def _wait_step(page: Any, step: int) -> None:
    page.wait_for_function(f"document.getElementById('step-num').textContent === '{step}'", timeout=15000)


def _wait_for_a_reopened_stream(proxy: Any) -> None:
    """EventSource's own retry gets one 502 and closes for good; a second request on the
    stream can only come from the page opening a new one."""
    deadline = time.monotonic() + 20
    while proxy.hits.count("visualizer/events") < 2:
        assert time.monotonic() < deadline, f"the page did not reopen its event stream: {proxy.hits}"
        time.sleep(0.1)


def test_page_starts_over_when_the_server_restarts(browser_page: Any) -> None:
    from test_visualizer_sse import LiveApp, make_snapshot

    from minisgl.visualizer.sse import SnapshotHub

    old_hub = SnapshotHub()
    app = LiveApp(old_hub)
    port = app.port
    try:
        browser_page.goto(app.url + "/visualizer")
        browser_page.wait_for_selector('#conn-status[data-state="open"]', timeout=15000)
        for step in range(1, 31):
            old_hub.add(make_snapshot(step))
        _wait_step(browser_page, 30)
    finally:
        app.stop()
    new_hub = SnapshotHub()  # the restarted server: seq and step count from 1 again
    for step in range(1, 4):
        new_hub.add(make_snapshot(step))
    app = LiveApp(new_hub, port=port)
    try:
        _wait_step(browser_page, 3)  # EventSource reconnected with the old hub's Last-Event-ID
        new_hub.add(make_snapshot(4))
        _wait_step(browser_page, 4)
        browser_page.wait_for_function("document.querySelectorAll('#timeline .tl-step').length === 2", timeout=5000)
        assert _bars(browser_page) == [3, 4]  # the old server's 30 steps are gone, the new ones shown
        assert browser_page.errors == []
    finally:
        app.stop()


def test_timeline_has_one_bar_per_step_and_aborts_without_ttft_render(browser_page: Any) -> None:
    from test_visualizer_sse import _finished, make_snapshot

    from minisgl.visualizer.snapshot import merge_snapshots, step_summary

    with _open_live_page(browser_page) as hub:
        aborted = {**_finished("w"), "finish_reason": {"type": "abort"}, "schedule_ms": None, "forward_ms": None,
                   "ttft_ms": None, "output_len": 0}  # fmt: skip
        for step in range(1, 4):
            hub.add(make_snapshot(step, finished=[aborted] if step == 3 else []))
        _wait_step(browser_page, 3)
        row = browser_page.locator('#finished .finished-req[data-rid="w"]')
        assert row.get_attribute("data-ttft") == "" and "TTFT –" in row.inner_text()
        # one update standing for step 4 run, then republished twice (an arrival, an abort)
        ran, idle = make_snapshot(4), {**make_snapshot(4, mode="IDLE"), "batch": None}
        update = {**merge_snapshots([ran, idle, idle]), "seq": 100, "missed_steps": 0}
        update["steps"] = [step_summary(s) for s in (ran, idle, idle)]  # as an older hub merged them
        browser_page.evaluate("u => onUpdate(u)", update)
        browser_page.wait_for_function("document.querySelectorAll('#timeline .tl-step').length === 4", timeout=5000)
        assert _bars(browser_page) == [1, 2, 3, 4]
        assert browser_page.locator('#timeline .tl-step[data-step="4"]').get_attribute("data-mode") == "DECODE"
        # clicking a bar while live pauses on that step
        browser_page.click('#timeline .tl-step[data-step="2"]')
        browser_page.wait_for_selector('#view-status[data-live="0"]', timeout=5000)
        _wait_step(browser_page, 2)
        assert browser_page.errors == []


def test_a_page_slower_than_the_stream_shows_the_newest_step_and_every_event(browser_page: Any) -> None:
    # At a few hundred requests a drawing costs more than the 50 ms between updates: drawing
    # each one queued a backlog that left the LIVE view seconds behind the server.
    from test_visualizer_sse import LiveApp, make_snapshot

    from minisgl.visualizer.sse import SnapshotHub

    hub = SnapshotHub()
    hub.add(make_snapshot(1))
    app = LiveApp(hub)
    try:
        browser_page.goto(app.url + "/visualizer")
        _wait_step(browser_page, 1)
        updates = [{**make_snapshot(step, events=[{"type": "arrive", "rid": f"r{step}", "detail": ""}]),
                    "seq": step, "missed_steps": 0} for step in range(2, 52)]  # fmt: skip
        drawn = browser_page.evaluate("""us => {
            window.drawn = 0;
            const draw = render;
            render = (s) => { window.drawn += 1; draw(s); };
            for (const u of us) onUpdate(u);  // 50 updates arrive before the page can draw one
            return window.drawn;
        }""", updates)  # fmt: skip
        assert drawn == 0
        _wait_step(browser_page, 51)
        assert browser_page.evaluate("window.drawn") <= 2
        shown = browser_page.eval_on_selector_all("#events .event", "els => els.map(e => e.dataset.rid)")
        assert shown == [f"r{step}" for step in range(2, 52)]  # the undrawn updates' events are not lost
        assert browser_page.errors == []
    finally:
        app.stop()


def test_the_page_reconnects_after_an_http_error_and_pause_while_down_stays_live(browser_page: Any) -> None:
    # A server restarting behind a reverse proxy: the proxy answers 502 meanwhile. An
    # EventSource closes for good on an HTTP error; the page opened a new one.
    from test_visualizer_sse import LiveApp, make_snapshot

    from minisgl.visualizer.sse import SnapshotHub

    old_hub = SnapshotHub()
    old_hub.add(make_snapshot(7))
    app = LiveApp(old_hub)
    port = app.port
    try:
        browser_page.goto(app.url + "/visualizer")
        _wait_step(browser_page, 7)
    finally:
        app.stop()
    proxy = LiveApp(None, port=port)
    try:
        browser_page.wait_for_selector('#conn-status[data-state="error"]', timeout=15000)
        browser_page.click("#btn-pause")  # /visualizer/history answers 502: the page stays live
        browser_page.wait_for_function("document.getElementById('demo-status').textContent.includes('502')", timeout=5000)
        assert browser_page.inner_text("#view-status") == "LIVE" and browser_page.inner_text("#btn-pause") == "Pause"
        _wait_for_a_reopened_stream(proxy)
    finally:
        proxy.stop()
    new_hub = SnapshotHub()
    new_hub.add(make_snapshot(3))
    app = LiveApp(new_hub, port=port)
    try:
        browser_page.wait_for_selector('#conn-status[data-state="open"]', timeout=15000)
        _wait_step(browser_page, 3)
        assert browser_page.errors == []
    finally:
        app.stop()


def test_a_page_reopening_its_stream_to_the_same_server_keeps_its_timeline(browser_page: Any) -> None:
    # A proxy's 502 for a moment while the server stays up: the reopened stream starts with the
    # hub's latest update again, which is no reason to wipe the timeline and finished list.
    from test_visualizer_sse import LiveApp, _finished, make_snapshot

    from minisgl.visualizer.sse import SnapshotHub

    hub = SnapshotHub()
    hub.close = lambda: None  # type: ignore[method-assign]  # the server stays up: its hub lives on
    hub.add(make_snapshot(3))
    app = LiveApp(hub)
    port = app.port
    try:
        browser_page.goto(app.url + "/visualizer")
        _wait_step(browser_page, 3)
        hub.add(make_snapshot(4, finished=[_finished("done")]))
        hub.add(make_snapshot(5))
        _wait_step(browser_page, 5)
    finally:
        app.stop()
    proxy = LiveApp(None, port=port)
    try:
        _wait_for_a_reopened_stream(proxy)
        time.sleep(0.5)  # that 502 reaches the page (it is counted before it is sent)
    finally:
        proxy.stop()
    app = LiveApp(hub, port=port)
    try:
        browser_page.wait_for_selector('#conn-status[data-state="open"]', timeout=30000)
        hub.add(make_snapshot(6))
        _wait_step(browser_page, 6)
        assert _bars(browser_page) == [3, 4, 5, 6]
        assert browser_page.locator('#finished .finished-req[data-rid="done"]').count() == 1
        assert browser_page.errors == []
    finally:
        app.stop()


def test_requests_whose_grammar_compiles_are_cards_in_the_waiting_column(browser_page: Any) -> None:
    """Structured output: a request waits in the grammar queue before the waiting queue; the
    page shows it there as a "compiling" card and counts it apart."""
    from test_visualizer_sse import make_snapshot

    with _open_live_page(browser_page) as hub:
        hub.add({**make_snapshot(1), "grammar_queue": [{"rid": "g", "grammar": "json_schema", "waited_ms": 2.0}]})
        _wait_step(browser_page, 1)
        card = browser_page.locator('#waiting-queue .req-card[data-rid="g"]')
        assert card.get_attribute("data-grammar") == "json_schema" and "compiling json_schema" in card.inner_text()
        assert browser_page.locator("#waiting-count").inner_text() == "1 + 1 compiling"  # (make_snapshot's "w" waits)
        hub.add(make_snapshot(2))  # compiled: it left the grammar queue
        _wait_step(browser_page, 2)
        assert browser_page.locator('#waiting-queue .req-card[data-rid="g"]').count() == 0
        assert browser_page.locator("#waiting-count").inner_text() == "1"
        assert browser_page.errors == []


def test_a_waiting_card_shows_the_priority_its_request_named(browser_page: Any) -> None:
    from test_visualizer_sse import make_snapshot

    with _open_live_page(browser_page) as hub:
        snap = make_snapshot(1)
        snap["waiting_queue"] = [{**snap["waiting_queue"][0], "rid": "p", "priority": 7}, {**snap["waiting_queue"][0], "rid": "q"}]
        hub.add(snap)
        _wait_step(browser_page, 1)
        assert "priority 7" in browser_page.locator('#waiting-queue .req-card[data-rid="p"]').inner_text()
        assert "priority" not in browser_page.locator('#waiting-queue .req-card[data-rid="q"]').inner_text()
        assert browser_page.errors == []


def test_requests_and_tree_nodes_show_their_adapter_and_key_tag(browser_page: Any) -> None:
    """A request's namespace on the page: its LoRA adapter and the tag of its extra_key / cache_salt
    (the snapshot holds only the tag), on its waiting card, its running row and the tree's nodes."""
    from test_visualizer_sse import make_snapshot

    with _open_live_page(browser_page) as hub:
        snap = make_snapshot(1)
        snap["waiting_queue"] = [{**snap["waiting_queue"][0], "rid": "k", "lora_id": "a", "cache_key": "0123456789abcdef"}]
        snap["running_batch"][0] = {**snap["running_batch"][0], "cache_key": "fedcba9876543210"}
        tree = snap["radix"]["tree"]
        tree["children"][0] = {**tree["children"][0], "lora_id": "a", "cache_key": "0123456789abcdef"}
        hub.add(snap)
        _wait_step(browser_page, 1)
        card = browser_page.locator('#waiting-queue .req-card[data-rid="k"]').inner_text()
        assert "lora a" in card and "key 0123456789abcdef" in card
        running = browser_page.locator(".running-req").all_inner_texts()
        assert "key fedcba9876543210" in running[0] and "key" not in running[1]
        node = browser_page.locator(f'.rnode[data-node="{tree["children"][0]["id"]}"]').inner_text()
        assert "lora a · key 0123456789abcdef" in node
        assert browser_page.errors == []
