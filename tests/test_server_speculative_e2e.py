"""End-to-end: `minisgl serve --speculative-algorithm NGRAM` as real processes (free ports).

The oracle is a second server on the same tiny model without the flag: greedy requests must get
the same tokens and text on every route (native /generate, batched and streamed; the OpenAI chat
and completions routes, streamed and not), since speculation only changes how many tokens a pass
gives, never which. The prompts repeat themselves, so drafts are accepted (asserted through
meta_info), and a route that quietly stopped speculating would fail here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Dict, Iterator, List

import httpx
import openai
import pytest

from test_server_e2e import Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SPEC_FLAGS = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5",
              "--speculative-ngram-max-match-window-size", "6")  # fmt: skip
GREEDY = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
LOOPS = [[11, 12, 13, 14, 15] * 4, [21, 22, 23] * 5, list(range(30, 60))]
TEXTS = ["one two three one two three one two", "The quick brown fox"]


@pytest.fixture(scope="module")
def servers(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Server]]:
    folder = tmp_path_factory.mktemp("spec-srv")
    started: Dict[str, Server] = {}
    try:
        started["plain"] = Server(tiny_model, str(folder / "plain.log"))
        started["spec"] = Server(tiny_model, str(folder / "spec.log"), *SPEC_FLAGS)
        yield started
    finally:
        for s in started.values():
            s.stop()


def generate(server: Server, body: Dict[str, Any]) -> Any:
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_gives_the_tokens_of_a_server_without_speculation(servers: Dict[str, Server]) -> None:
    for ids in LOOPS:
        body = {"input_ids": ids, "sampling_params": GREEDY}
        plain, spec = generate(servers["plain"], body), generate(servers["spec"], body)
        assert (spec["output_ids"], spec["text"]) == (plain["output_ids"], plain["text"])
        meta = spec["meta_info"]
        assert meta["completion_tokens"] == 32 and meta["finish_reason"] == plain["meta_info"]["finish_reason"]
        # drafts were checked and taken: fewer passes than tokens
        assert 0 < meta["spec_verify_ct"] < 31 and meta["spec_accept_length"] > 1.0, meta
        assert "spec_verify_ct" not in plain["meta_info"] and "spec_accept_length" not in plain["meta_info"]
    for text in TEXTS:
        body = {"text": text, "sampling_params": GREEDY}
        plain, spec = generate(servers["plain"], body), generate(servers["spec"], body)
        assert (spec["output_ids"], spec["text"]) == (plain["output_ids"], plain["text"])
        assert spec["meta_info"]["spec_verify_ct"] > 0


def test_a_batch_verifies_together_and_each_gets_its_own_tokens(servers: Dict[str, Server]) -> None:
    body = {"input_ids": LOOPS, "sampling_params": GREEDY}
    plain, spec = generate(servers["plain"], body), generate(servers["spec"], body)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert all(o["meta_info"]["spec_accept_length"] > 1.0 for o in spec[:2])  # (the two loops)


def test_a_streamed_generate_ends_with_the_whole_output(servers: Dict[str, Server]) -> None:
    body = {"input_ids": LOOPS[0], "sampling_params": {**GREEDY, "max_new_tokens": 40}, "stream": True}
    expected = generate(servers["plain"], {**body, "stream": False})
    chunks: List[Dict[str, Any]] = []
    with httpx.stream("POST", servers["spec"].url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    assert chunks[-1]["output_ids"] == expected["output_ids"] and chunks[-1]["text"] == expected["text"]
    # cumulative (SGLang's native stream), growing by up to 5 tokens a pass
    lengths = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 40 and len(chunks) < 40
    assert chunks[-1]["meta_info"]["spec_accept_length"] > 1.0


def _client(s: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_chat_and_completions_answer_as_without_speculation(servers: Dict[str, Server]) -> None:
    texts: Dict[str, List[str]] = {}
    for name, server in servers.items():
        client, out = _client(server), []
        for prompt in TEXTS:
            messages = [{"role": "user", "content": prompt}]
            chat = client.chat.completions.create(model=server.model, messages=messages, max_tokens=24, temperature=0)
            streamed = client.chat.completions.create(model=server.model, messages=messages, max_tokens=24, temperature=0, stream=True)
            out += [chat.choices[0].message.content, "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)]
            done = client.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0)
            streamed = client.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0, stream=True)
            out += [done.choices[0].text, "".join(c.choices[0].text for c in streamed if c.choices)]
            assert done.usage.completion_tokens == chat.usage.completion_tokens == 24
        texts[name] = out
    assert texts["spec"] == texts["plain"]
    assert all(texts["spec"][i] == texts["spec"][i + 1] for i in range(0, len(texts["spec"]), 2))  # streamed = not


def test_server_info_shows_the_flags(servers: Dict[str, Server]) -> None:
    info = httpx.get(servers["spec"].url + "/get_server_info", timeout=30).json()
    assert (info["speculative_algorithm"], info["speculative_num_draft_tokens"]) == ("NGRAM", 5)
    assert (info["speculative_ngram_min_match_window_size"], info["speculative_ngram_max_match_window_size"]) == (1, 6)
    assert httpx.get(servers["plain"].url + "/get_server_info", timeout=30).json()["speculative_algorithm"] is None


def test_serve_help_lists_the_speculative_flags() -> None:
    proc = subprocess.run([sys.executable, "-m", "minisgl", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for flag in ("--speculative-algorithm", "--speculative-num-draft-tokens", "--speculative-ngram-min-match-window-size",
                 "--speculative-ngram-max-match-window-size"):  # fmt: skip
        assert flag in proc.stdout, flag
    assert "NGRAM" in proc.stdout
