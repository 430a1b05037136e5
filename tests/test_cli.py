"""`minisgl generate`: the first command a new user runs prints the Engine's completion."""

from __future__ import annotations

import os
import subprocess
import sys

from minisgl import Engine


def test_generate_prints_the_engines_greedy_completion(tiny_model: str) -> None:
    prompt = "The with statement"
    engine = Engine(tiny_model, device="cpu")
    expected = engine.generate(prompt, {"max_new_tokens": 6, "temperature": 0})["text"]
    engine.shutdown()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl", "generate", "--model", tiny_model, "--prompt", prompt, "--max-new-tokens", "6", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == expected + "\n"


def test_serve_help_lists_sglang_flags() -> None:
    proc = subprocess.run([sys.executable, "-m", "minisgl", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for flag in ("--model-path", "--page-size", "--chunked-prefill-size", "--enable-mixed-chunk", "--visualize", "--api-key"):
        assert flag in proc.stdout
