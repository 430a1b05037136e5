"""return_hidden_states on the HTTP side, in process: /generate (cumulative and incremental
streams), the OpenAI routes' `hidden_states` (SGLang's process_hidden_states_from_ret and its
stream chunk), and the refusals, over a stand-in scheduler.

The app runs under FastAPI's TestClient with a real TokenizerManager; the stand-in answers a
request as the detokenizer would, one BatchStrOutput per output token: the first carries the
prompt's entry ([n, H] rows) and every later one a decode step's [H] row, with values that name
their position (so a wrong slice or a lost message shows). tests/test_hidden_states_e2e.py runs
the real processes and the model.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np
import pytest
from fastapi.testclient import TestClient

from minisgl.entrypoints.http_server import create_app
from minisgl.managers.io_struct import BatchStrOutput, HiddenStateRows, TokenizedGenerateReqInput
from minisgl.managers.tokenization import RETURN_HIDDEN_STATES_DISABLED
from minisgl.managers.tokenizer_manager import TokenizerManager
from minisgl.server_args import PortArgs, ServerArgs, resolve_server_args
from minisgl.utils import get_tokenizer

CONTEXT_LEN = 256


def prompt_entry(input_ids: List[int]) -> List[List[float]]:
    return [[float(t), 0.5] for t in input_ids]


def decode_row(step: int) -> List[float]:
    return [float(step), -0.25]


def expected(input_ids: List[int], max_new_tokens: int) -> List[Any]:
    """What a request that asked gets in all: the prompt's entry, then steps 1 .. k - 1."""
    return [prompt_entry(input_ids)] + [decode_row(k) for k in range(1, max_new_tokens)]


def _tm(model: str, tmp_path: Any, big_entry: Any = None, **overrides: Any) -> TokenizerManager:
    """A TokenizerManager whose scheduler is a stand-in that answers every generation request
    (`big_entry`: an [n, H] float32 array sent as every asking request's prompt entry instead)."""
    args = resolve_server_args(ServerArgs(model_path=model, device="cpu", **{"enable_return_hidden_states": True, **overrides}))
    tokenizer = get_tokenizer(model)
    tm = TokenizerManager(args, PortArgs.init_new(str(tmp_path)), tokenizer, CONTEXT_LEN, len(tokenizer))

    def send(msg: Any) -> None:
        if not isinstance(msg, TokenizedGenerateReqInput):
            return
        loop = asyncio.get_running_loop()
        steps = msg.sampling_params.max_new_tokens
        for k in range(steps):  # one message per token, as a stream gets them
            # (float32 rows, as the detokenizer passes them on: the prompt's rows with the first output)
            first = np.array(prompt_entry(msg.input_ids), dtype=np.float32) if big_entry is None else big_entry
            hidden = HiddenStateRows(first if k == 0 else np.array([decode_row(k)], dtype=np.float32),
                                     prompt_rows=len(first) if k == 0 else 0)  # fmt: skip
            out = BatchStrOutput(
                rids=[msg.rid], finished_reasons=[{"type": "length", "length": steps} if k == steps - 1 else None],
                output_strs=[f"t{k} "], output_ids=[[10 + k]], prompt_tokens=[len(msg.input_ids)], completion_tokens=[k + 1],
                cached_tokens=[0], output_hidden_states=[hidden if msg.return_hidden_states else None],
            )  # fmt: skip
            loop.call_later(0.005 * (k + 1), tm._dispatch, out)
        if steps == 0:  # (an n > 1 request's prefix warm-up: finished at once)
            done = BatchStrOutput(
                rids=[msg.rid], finished_reasons=[{"type": "length", "length": 0}], output_strs=[""], output_ids=[[]],
                prompt_tokens=[len(msg.input_ids)], completion_tokens=[0], cached_tokens=[0],
            )  # fmt: skip
            loop.call_soon(tm._dispatch, done)

    tm._send_to_scheduler = send  # type: ignore[method-assign]
    return tm


def _client(tm: TokenizerManager) -> Iterator[TestClient]:
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as c:
        yield c
    tm.close()


@pytest.fixture()
def served(tiny_model: str, tmp_path: Any) -> Iterator[Tuple[TestClient, TokenizerManager]]:
    tm = _tm(tiny_model, tmp_path)
    for c in _client(tm):
        yield c, tm


def events(response: Any) -> List[Any]:
    """The SSE events of a stream, parsed (without the final [DONE])."""
    lines = [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# --------------------------------------------------------------------------- /generate
def test_generate_returns_every_entry_only_to_prompts_that_asked(served: Any) -> None:
    c, tm = served
    ids = [[3, 4, 5], [6, 7]]
    r = c.post("/generate", json={"input_ids": ids[0], "sampling_params": {"max_new_tokens": 4}, "return_hidden_states": True})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["hidden_states"] == expected(ids[0], 4)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3}, "return_hidden_states": [False, True]}
    outs = c.post("/generate", json=body).json()
    assert "hidden_states" not in outs[0]["meta_info"]
    assert outs[1]["meta_info"]["hidden_states"] == expected(ids[1], 3)
    # null asks for the default, as for SGLang's other nullable /generate fields
    r = c.post("/generate", json={"input_ids": ids[0], "sampling_params": {"max_new_tokens": 2}, "return_hidden_states": None})
    assert r.status_code == 200 and "hidden_states" not in r.json()["meta_info"]


def test_a_cumulative_stream_carries_every_entry_so_far(served: Any) -> None:
    """SGLang's /generate stream: each chunk's hidden states are the whole list so far."""
    c, _ = served
    ids = [3, 4, 5]
    r = c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4}, "return_hidden_states": True, "stream": True})
    chunks = [e["meta_info"]["hidden_states"] for e in events(r)]
    whole = expected(ids, 4)
    assert chunks[-1] == whole
    assert all(chunk == whole[: len(chunk)] for chunk in chunks) and len(chunks[0]) >= 1


def test_an_incremental_stream_carries_what_each_chunk_adds(tiny_model: str, tmp_path: Any) -> None:
    """--incremental-streaming-output: the new entries only (SGLang sends the whole list there too:
    docs/server.md); the chunks' entries together are the whole list."""
    tm = _tm(tiny_model, tmp_path, incremental_streaming_output=True)
    for c in _client(tm):
        ids = [3, 4, 5]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}, "return_hidden_states": True, "stream": True}
        chunks = [e["meta_info"]["hidden_states"] for e in events(c.post("/generate", json=body))]
        assert [entry for chunk in chunks for entry in chunk] == expected(ids, 4)
        assert chunks[0][0] == prompt_entry(ids)


def test_the_answer_is_the_json_of_the_values_as_lists_and_non_finite_values_are_null() -> None:
    """/generate's answer is written from float32 rows, a row at a time (hidden_states_json): byte for
    byte what JSONResponse writes for the same values as Python lists (key order, separators, each
    number's shortest repr), NaN and inf as null, and a prompt of the batch that did not ask as is."""
    from starlette.responses import JSONResponse

    from minisgl.entrypoints.hidden_states_json import answer_json

    rows = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    rows[1, 2], rows[3, 0] = np.nan, -np.inf
    meta = {"id": "a", "finish_reason": None, "prompt_tokens": 3, "output_token_logprobs": [[-0.5, 7, "é"]]}
    asked = {"text": "é\n", "output_ids": [7], "meta_info": {**meta, "hidden_states": [rows[:3], rows[3]], "e2e_latency": 0.25}}
    plain = {"text": "b", "output_ids": [8], "meta_info": dict(meta), "index": 1}
    as_lists = [[[v if np.isfinite(v) else None for v in row] for row in rows[:3].tolist()],
                [None if i == 0 else v for i, v in enumerate(rows[3].tolist())]]  # fmt: skip
    want = {**asked, "meta_info": {**asked["meta_info"], "hidden_states": as_lists}}
    assert answer_json(asked) == JSONResponse(want).body
    assert answer_json([asked, plain]) == JSONResponse([want, plain]).body
    assert json.loads(answer_json(asked))["meta_info"]["hidden_states"][0][1][2] is None


def test_a_large_answer_is_written_off_the_event_loop(tiny_model: str, tmp_path: Any, monkeypatch: Any) -> None:
    """A 300 x 1,024 prompt entry (300,000 JSON numbers; a 2,000-token prompt's took ~1 s) is
    written in a worker thread: held at its first row, the answer waits while /health (any other
    request, any stream's next chunk) is served. Written on the event loop, as one json.dumps,
    /health would wait for it: the held row times out, and the test fails, in 3 s."""
    import threading

    from minisgl.entrypoints import hidden_states_json

    entry = np.random.default_rng(2).standard_normal((300, 1024)).astype(np.float32)
    writing, resume = threading.Event(), threading.Event()
    held: Dict[str, Any] = {}
    real = hidden_states_json.entry_as_list

    def held_row(row: Any) -> Any:  # the first row waits until the test has had its /health
        if not writing.is_set():
            writing.set()
            held["resumed"] = resume.wait(timeout=3)
        return real(row)

    monkeypatch.setattr(hidden_states_json, "entry_as_list", held_row)
    tm = _tm(tiny_model, tmp_path, big_entry=entry)
    for c in _client(tm):
        result: Dict[str, Any] = {}
        body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}, "return_hidden_states": True}
        thread = threading.Thread(target=lambda: result.update(r=c.post("/generate", json=body)))
        thread.start()
        assert writing.wait(timeout=10)
        assert c.get("/health").status_code == 200  # (served while the answer is mid-write)
        resume.set()
        thread.join()
        assert held["resumed"], "the answer was written on the event loop: /health waited for it"
        hidden = result["r"].json()["meta_info"]["hidden_states"]
        assert np.array_equal(np.array(hidden[0], dtype=np.float32), entry)


# --------------------------------------------------------------------------- OpenAI routes
def test_a_completion_choice_carries_the_last_decode_row(served: Any) -> None:
    c, tm = served
    prompt = "hello there"
    ids = tm.tokenizer.encode(prompt)
    body = {"model": tm.model_name, "prompt": prompt, "max_tokens": 4, "return_hidden_states": True}
    choice = c.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["hidden_states"] == expected(ids, 4)[-1] == decode_row(3)
    # one output token: only the prompt's entry, which SGLang's OpenAI routes never return
    one = c.post("/v1/completions", json={**body, "max_tokens": 1}).json()["choices"][0]
    assert one["hidden_states"] == []
    plain = c.post("/v1/completions", json={**body, "return_hidden_states": False}).json()["choices"][0]
    assert "hidden_states" not in plain
    # n > 1: every choice its own
    choices = c.post("/v1/completions", json={**body, "n": 2}).json()["choices"]
    assert [ch["hidden_states"] for ch in choices] == [decode_row(3)] * 2


def test_a_chat_choice_carries_it_beside_its_message(served: Any) -> None:
    c, tm = served
    body = {"model": tm.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "return_hidden_states": True}
    choice = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["hidden_states"] == decode_row(2) and "hidden_states" not in choice["message"]
    plain = c.post("/v1/chat/completions", json={**body, "return_hidden_states": False}).json()["choices"][0]
    assert "hidden_states" not in plain


def test_streams_send_one_hidden_state_chunk_per_choice_after_the_finish_before_the_usage(served: Any) -> None:
    c, tm = served
    usage = {"stream_options": {"include_usage": True}}
    body = {"model": tm.model_name, "prompt": "hello", "max_tokens": 3, "n": 2, "stream": True, "return_hidden_states": True, **usage}
    got = events(c.post("/v1/completions", json=body))
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 6
    tail = got[-3:-1]
    assert sorted(e["choices"][0]["index"] for e in tail) == [0, 1]
    for e in tail:
        assert e["choices"][0]["hidden_states"] == decode_row(2) and e["choices"][0]["text"] == ""
        assert e["choices"][0]["finish_reason"] is None
    finishes = [i for i, e in enumerate(got) if e["choices"] and e["choices"][0]["finish_reason"] is not None]
    assert len(finishes) == 2 and max(finishes) < len(got) - 3
    assert not any("hidden_states" in e["choices"][0] for e in got[:-3] if e["choices"])

    chat = {"model": tm.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True,
            "return_hidden_states": True}  # fmt: skip
    got = events(c.post("/v1/chat/completions", json=chat))
    assert got[-1]["choices"][0]["delta"] == {"hidden_states": []}  # one token: no decode step ran
    assert got[-2]["choices"][0]["finish_reason"] == "length"
    plain = events(c.post("/v1/chat/completions", json={**chat, "return_hidden_states": False}))
    assert not any("hidden_states" in e["choices"][0]["delta"] for e in plain)


# --------------------------------------------------------------------------- refusals
def test_without_the_flag_every_route_refuses_with_sglang_s_message(tiny_model: str, tmp_path: Any) -> None:
    tm = _tm(tiny_model, tmp_path, enable_return_hidden_states=False)
    for c in _client(tm):
        bodies: Dict[str, Dict[str, Any]] = {
            "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
            "/v1/completions": {"model": tm.model_name, "prompt": "hi", "max_tokens": 2},
            "/v1/chat/completions": {"model": tm.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        }
        for route, body in bodies.items():
            for stream in (False, True):
                r = c.post(route, json={**body, "return_hidden_states": True, "stream": stream})
                assert r.status_code == 400, (route, r.text)
                assert r.json()["error"]["message"] == RETURN_HIDDEN_STATES_DISABLED
            ok = c.post(route, json={**body, "return_hidden_states": False})
            assert ok.status_code == 200, (route, ok.text)
        r = c.post("/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}, "return_hidden_states": [False, True]})
        assert r.status_code == 400 and r.json()["error"]["message"] == RETURN_HIDDEN_STATES_DISABLED
        assert not tm.rid_to_state


def test_bad_values_are_400s_that_name_the_field(served: Any) -> None:
    c, tm = served
    for route, body in (
        ("/generate", {"text": "hi", "return_hidden_states": "yes"}),
        ("/v1/completions", {"model": tm.model_name, "prompt": "hi", "return_hidden_states": 1}),
    ):
        r = c.post(route, json=body)
        assert r.status_code == 400 and "return_hidden_states" in r.text, r.text
    r = c.post("/generate", json={"text": "hi", "return_hidden_states": [True]})
    assert r.status_code == 400 and "lists are per prompt of a batch" in r.json()["error"]["message"]


def test_an_embedding_server_has_no_hidden_states_to_return(tiny_model: str, tmp_path: Any) -> None:
    """SGLang's embedding requests have no return_hidden_states (the embedding is the pooled
    final-norm hidden state): /v1/embeddings and /encode refuse the field by name, /generate is
    an embedding server's refusal."""
    tm = _tm(tiny_model, tmp_path, enable_return_hidden_states=False, is_embedding=True)
    for c in _client(tm):
        r = c.post("/v1/embeddings", json={"model": tm.model_name, "input": "hi", "return_hidden_states": True})
        assert r.status_code == 400 and "return_hidden_states" in r.text
        r = c.post("/encode", json={"text": "hi", "return_hidden_states": True})
        assert r.status_code == 400 and "return_hidden_states" in r.text
        r = c.post("/generate", json={"text": "hi", "return_hidden_states": True})
        assert r.status_code == 400 and "embedding server" in r.json()["error"]["message"]
