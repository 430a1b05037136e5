"""Unit tests of the OpenAI layer and the TokenizerManager, without model processes.

The app runs in-process (FastAPI TestClient) with a real TokenizerManager whose ZMQ
peers do not exist: every request tested here is rejected before it would be sent,
or is fed outputs directly through `_handle_batch_output` as the detokenizer would.
"""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List

import pytest
from fastapi.testclient import TestClient

from minisgl.entrypoints.http_server import create_app
from minisgl.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from minisgl.managers.io_struct import BatchStrOutput, GenerateReqInput
from minisgl.managers.tokenizer_manager import AsyncDynamicBatchTokenizer, TokenizerManager, coalesce_streaming_chunks
from minisgl.server_args import PortArgs, ServerArgs, resolve_server_args
from minisgl.utils import get_tokenizer

CONTEXT_LEN = 64


def _make_tm(model: str, tmp_path: Any, **overrides: Any) -> TokenizerManager:
    args = resolve_server_args(ServerArgs(model_path=model, device="cpu", **overrides))
    tokenizer = get_tokenizer(model)
    return TokenizerManager(args, PortArgs.init_new(str(tmp_path)), tokenizer, CONTEXT_LEN, len(tokenizer))


@pytest.fixture(scope="module")
def tokenizer(tiny_model: str) -> Any:
    return get_tokenizer(tiny_model)


@pytest.fixture()
def client(tiny_model: str, tmp_path: Any) -> TestClient:
    tm = _make_tm(tiny_model, tmp_path)
    app = create_app(tm.server_args, tm, is_healthy=lambda: True)
    with TestClient(app) as c:
        c.model = tm.model_name  # type: ignore[attr-defined]
        yield c
    tm.close()


# --------------------------------------------------------------------------- to_sampling_params
def test_max_completion_tokens_wins_and_defaults_follow_sglang() -> None:
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5, max_completion_tokens=7)
    params = req.to_sampling_params()
    assert params["max_new_tokens"] == 7
    assert (params["temperature"], params["top_p"], params["top_k"], params["min_p"]) == (1.0, 1.0, -1, 0.0)
    assert params["repetition_penalty"] == 1.0
    no_limit = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}]).to_sampling_params()
    assert no_limit["max_new_tokens"] is None  # the scheduler clamps to the context


def test_sampling_fields_map_onto_sglang_keys() -> None:
    req = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}], temperature=0, top_p=0.5, top_k=3, min_p=0.1,
        frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.2, stop=["a"], stop_token_ids=[7],
        seed=11, n=2, ignore_eos=True, skip_special_tokens=False, max_tokens=4,
    )  # fmt: skip
    p = req.to_sampling_params()
    assert p["temperature"] == 0 and p["top_p"] == 0.5 and p["top_k"] == 3 and p["min_p"] == 0.1
    assert p["frequency_penalty"] == 0.5 and p["presence_penalty"] == -0.5 and p["repetition_penalty"] == 1.2
    assert p["stop"] == ["a"] and p["stop_token_ids"] == [7] and p["seed"] == 11 and p["n"] == 2
    assert p["ignore_eos"] is True and p["skip_special_tokens"] is False and p["max_new_tokens"] == 4


def test_completion_max_tokens_defaults_to_16() -> None:
    assert CompletionRequest(model="m", prompt="hi").to_sampling_params()["max_new_tokens"] == 16


# --------------------------------------------------------------------------- HTTP errors
def _chat(client: TestClient, **body: Any) -> Any:
    payload = {"model": client.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    payload.update(body)
    return client.post("/v1/chat/completions", json=payload)


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"messages": []}, "Messages cannot be empty"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 3.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": "4"}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "'tools'"),
        ({"tool_choice": "auto"}, "'tool_choice'"),
        ({"response_format": {"type": "json_object"}}, "'response_format'"),
        ({"logit_bias": {"1": 2}}, "'logit_bias'"),
        ({"functions": []}, "'functions'"),
        ({"made_up_field": 1}, "'made_up_field'"),
        ({"messages": [{"role": "user", "content": "word " * 200}]}, "context length"),
        ({"max_tokens": 60}, "maximum context length"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ],
)
def test_bad_chat_requests_are_400_with_an_openai_error_body(client: TestClient, body: Dict[str, Any], needle: str) -> None:
    r = _chat(client, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"]
    assert err["code"] == 400 and err["type"] == "BadRequestError"


def test_unsupported_field_names_the_param(client: TestClient) -> None:
    err = _chat(client, tools=[]).json()["error"]
    assert err["param"] == "tools" and "not supported" in err["message"]


def test_bad_json_is_400_not_422(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=["a", "list"])
    assert r.status_code == 400


def test_bad_completion_prompts(client: TestClient) -> None:
    for prompt in ("", [], [[]], [1, "a"]):
        r = client.post("/v1/completions", json={"model": client.model, "prompt": prompt})
        assert r.status_code == 400, (prompt, r.text)
    r = client.post("/v1/completions", json={"model": client.model, "prompt": [10**9]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


def test_unknown_model_is_404(client: TestClient) -> None:
    r = _chat(client, model="gpt-4")
    assert r.status_code == 404
    assert "gpt-4" in r.json()["error"]["message"]


def test_native_generate_rejects_unknown_sampling_keys(client: TestClient) -> None:
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "bogus": 1}})
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]


def test_models_lists_the_served_model(client: TestClient) -> None:
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [client.model]
    assert data[0]["max_model_len"] == CONTEXT_LEN


def test_api_key_guards_every_route_but_health(tiny_model: str, tmp_path: Any) -> None:
    tm = _make_tm(tiny_model, tmp_path, api_key="sekret")
    healthy = {"ok": True}
    app = create_app(tm.server_args, tm, is_healthy=lambda: healthy["ok"])
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.post("/v1/completions", json={}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        healthy["ok"] = False
        assert c.get("/health").status_code == 503
    tm.close()


def test_visualizer_routes_absent_without_flag(client: TestClient) -> None:
    assert client.get("/visualizer").status_code == 404


# --------------------------------------------------------------------------- TokenizerManager
def _str_out(rid: str, text: str, ids: List[int], completion: int, finish: Any = None) -> BatchStrOutput:
    return BatchStrOutput(
        rids=[rid], finished_reasons=[finish], output_strs=[text], output_ids=[ids],
        prompt_tokens=[3], completion_tokens=[completion], cached_tokens=[0],
    )  # fmt: skip


def test_stream_coalesces_queued_chunks_and_non_stream_returns_everything(tiny_model: str, tmp_path: Any) -> None:
    async def run() -> None:
        tm = _make_tm(tiny_model, tmp_path)
        for stream in (True, False):
            obj = GenerateReqInput(text="hello", sampling_params={"max_new_tokens": 3}, stream=stream)
            gen = tm.generate_request(obj)
            first = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0.05)  # tokenized and sent; now waiting on the event
            rid = obj.rid
            assert rid in tm.rid_to_state
            # three chunks arrive before the consumer wakes up: one coalesced delta
            tm._handle_batch_output(_str_out(rid, "a", [5], 1))
            tm._handle_batch_output(_str_out(rid, "b", [6], 2))
            tm._handle_batch_output(_str_out(rid, "c", [7], 3, {"type": "length", "length": 3}))
            out = await first
            assert out["text"] == "abc" and out["output_ids"] == [5, 6, 7]
            assert out["meta_info"]["finish_reason"]["type"] == "length"
            assert rid not in tm.rid_to_state
        tm.close()

    asyncio.run(run())


def test_duplicate_rid_in_flight_is_rejected(tiny_model: str, tmp_path: Any) -> None:
    async def run() -> None:
        tm = _make_tm(tiny_model, tmp_path)
        gen1 = tm.generate_request(GenerateReqInput(text="x", rid="same", sampling_params={"max_new_tokens": 1}))
        task = asyncio.ensure_future(gen1.__anext__())
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="already in flight"):
            await tm.generate_request(GenerateReqInput(text="y", rid="same")).__anext__()
        task.cancel()
        await asyncio.sleep(0)
        tm.close()

    asyncio.run(run())


def test_coalesce_concatenates_logprobs() -> None:
    a = {"text": "a", "output_ids": [1], "meta_info": {"output_token_logprobs": [(-1.0, 1)], "output_top_logprobs": [[(-1.0, 1)]], "x": 1}}
    b = {"text": "b", "output_ids": [2], "meta_info": {"output_token_logprobs": [(-2.0, 2)], "output_top_logprobs": [[(-2.0, 2)]], "x": 2}}
    out = coalesce_streaming_chunks([a, b])
    assert out["text"] == "ab" and out["output_ids"] == [1, 2]
    assert out["meta_info"]["output_token_logprobs"] == [(-1.0, 1), (-2.0, 2)] and out["meta_info"]["x"] == 2


def test_dynamic_batch_tokenizer_batches_concurrent_texts(tokenizer: Any) -> None:
    texts = [f"prompt number {i} about lists" for i in range(8)]

    async def run() -> List[List[int]]:
        batcher = AsyncDynamicBatchTokenizer(tokenizer)
        try:
            results = await asyncio.gather(*(batcher.encode(t) for t in texts))
        finally:
            batcher.close()
        assert batcher.batch_sizes == [8]  # one batched tokenizer call for all eight
        return list(results)

    results = asyncio.run(run())
    assert results == [tokenizer.encode(t, add_special_tokens=False) for t in texts]
