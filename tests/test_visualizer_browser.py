"""Headless Chromium against a live `minisgl serve --visualize` on a tiny model.

The page's own "Send demo requests" button sends the workload (short and long prompts,
shared prefixes); a small --chunked-prefill-size forces chunking. The test then pauses
and walks back through the server's ring buffer with the arrow keys, as a user would,
and checks the DOM shows a waiting request, an EXTEND step with a chunked request, a
DECODE step with several requests, and finished requests with their TTFT split.
Screenshots land in tests/artifacts/ (gitignored).
"""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def live_server(tiny_model: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "minisgl", "serve", "--model", tiny_model, "--port", str(port), "--visualize",
           "--device", "cpu", "--chunked-prefill-size", "32", "--max-total-tokens", "4096",
           "--max-running-requests", "8", "--log-level", "warning"]  # fmt: skip
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
        })"""
    )


def test_live_page_shows_waiting_chunked_extend_decode_batch_and_ttft(live_server: str) -> None:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
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
        seen = {"waiting": None, "chunked_extend": None, "decode_batch": None}
        for _ in range(400):
            facts = _frame_facts(page)
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
        browser.close()
