"""Unit tests of the OpenAI layer and the TokenizerManager, without model processes.

The app runs in-process (FastAPI TestClient) with a real TokenizerManager whose ZMQ
peers do not exist: every request tested here is rejected before it would be sent,
or is fed outputs directly through `_handle_batch_output` as the detokenizer would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from typing import Any, Dict, List, Optional, Tuple

import pytest
from fastapi.testclient import TestClient

from minisgl.entrypoints.http_server import create_app
from minisgl.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from minisgl.managers.io_struct import AbortReq, BatchStrOutput, GenerateReqInput, GetLoadReqOutput, TokenizedGenerateReqInput
from minisgl.managers.tokenizer_manager import AsyncDynamicBatchTokenizer, ReqAbortedError, TokenizerManager, coalesce_streaming_chunks
from minisgl.sampling.sampling_params import SamplingParams
from minisgl.models.model_config import default_sampling_params
from minisgl.server_args import PortArgs, ServerArgs, resolve_server_args
from minisgl.utils import get_tokenizer

CONTEXT_LEN = 64


_OPEN_MANAGERS: List[TokenizerManager] = []


@pytest.fixture(autouse=True)
def _close_tokenizer_managers() -> Any:
    """Close every TokenizerManager a test made, failed or not: a PUSH socket with messages
    queued for the absent scheduler would otherwise block zmq's Context.__del__ forever."""
    yield
    while _OPEN_MANAGERS:
        _OPEN_MANAGERS.pop().close()


def _make_tm(model: str, tmp_path: Any, **overrides: Any) -> TokenizerManager:
    args = resolve_server_args(ServerArgs(model_path=model, device="cpu", **overrides))
    tokenizer = get_tokenizer(model)
    tm = TokenizerManager(args, PortArgs.init_new(str(tmp_path)), tokenizer, CONTEXT_LEN, len(tokenizer))
    _OPEN_MANAGERS.append(tm)
    return tm


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
    # OpenAI: "integer or null, defaults to 16" (the SDK sends the null for max_tokens=None): it
    # ran to the end of the context, minutes on a CPU. Chat's null stays "no limit".
    assert CompletionRequest(model="m", prompt="hi", max_tokens=None).to_sampling_params()["max_new_tokens"] == 16
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(model="m", messages=msgs, max_tokens=None).to_sampling_params()["max_new_tokens"] is None


def test_chat_falls_back_to_the_generation_config_then_the_builtin_default() -> None:
    """SGLang's get_param: the request's value, else generation_config's, else the built-in
    default. A model shipping temperature 0.6 / top_k 20 was sampled at 1.0 over all tokens."""
    gen_cfg = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": 2}
    defaults = default_sampling_params(gen_cfg)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    msgs = [{"role": "user", "content": "hi"}]
    p = ChatCompletionRequest(model="m", messages=msgs, top_p=0.5).to_sampling_params(defaults)
    assert (p["temperature"], p["top_p"], p["top_k"], p["min_p"], p["repetition_penalty"]) == (0.6, 0.5, 20, 0.0, 1.0)
    assert ChatCompletionRequest(model="m", messages=msgs, temperature=0).to_sampling_params(defaults)["temperature"] == 0
    # Hugging Face's top_k 0 is "no top-k" (SGLang's -1); a non-number is left to the default
    assert default_sampling_params({"top_k": 0, "temperature": "hot", "min_p": 0.05}) == {"top_k": -1, "min_p": 0.05}


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_explicit_null_means_the_default_for_fields_openai_documents_as_nullable(route: str) -> None:
    nulls = {"n": None, "presence_penalty": None, "frequency_penalty": None, "logprobs": None, "stream": None}
    if route == "chat":
        req: Any = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **nulls)
        assert req.logprobs is False
    else:
        req = CompletionRequest(model="m", prompt="hi", echo=None, **nulls)
        assert req.logprobs is None and req.echo is False
    assert (req.n, req.presence_penalty, req.frequency_penalty, req.stream) == (1, 0.0, 0.0, False)
    with pytest.raises(ValueError):  # a null model is still an error: it has no default
        ChatCompletionRequest(model=None, messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_an_unsupported_field_that_asks_for_nothing_is_accepted(route: str) -> None:
    """Clients that fill every field send `"user": null`, `"tools": null` or a plain-text
    response_format: nothing minisgl cannot do. Any real value of them stays a 400."""
    asks_nothing = {"user": None, "tools": None, "tool_choice": None, "best_of": None, "response_format": {"type": "text"}}
    if route == "chat":
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **asks_nothing)
        make = lambda **kw: ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)  # noqa: E731
    else:
        CompletionRequest(model="m", prompt="hi", suffix=None, **asks_nothing)
        make = lambda **kw: CompletionRequest(model="m", prompt="hi", **kw)  # noqa: E731
    for field, value in [("user", "alice"), ("response_format", {"type": "structural_tag"}), ("functions", [])]:
        with pytest.raises(ValueError, match=field):
            make(**{field: value})


def test_text_parts_are_joined_with_a_space_as_sglang_does() -> None:
    parts = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": parts}])
    assert req.messages[0].text() == "Tell me a story"


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
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": [{"role": "function", "content": "x"}]}, "role"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 3.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": "4"}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 'tool_choice "auto" (the default when tools are given)'),
        ({"functions": [{"name": "f"}]}, "'functions'"),
        ({"response_format": {"type": "grammar"}}, "response_format type 'grammar' is not supported"),
        # (another type's fields: the type is named, not its unknown fields)
        ({"response_format": {"type": "grammar", "structures": [], "lark": "x"}}, "type 'grammar' is not supported"),
        ({"response_format": {"type": "structural_tag"}}, 'structural_tag needs "structures"'),
        ({"response_format": {"type": "json_object", "triggers": ["<"]}}, "['triggers'] belong to type structural_tag"),
        ({"response_format": {"type": "json_schema"}}, "response_format json_schema needs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "name"),
        ({"response_format": {"type": "json_object"}, "regex": "a+"}, "both constrain the output"),
        ({"regex": "a+", "ebnf": 'root ::= "a"'}, "Only one of regex, json_schema, ebnf, or structural_tag"),
        ({"json_schema": "{not json"}, "json_schema must be the JSON text of a JSON schema"),
        ({"logit_bias": {"1": 200}}, "logit_bias values must be in [-100, 100]"),
        ({"logit_bias": {"one": 2}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"99999999": 2}}, "outside the vocabulary"),
        ({"logit_bias": {"1": "2"}}, "logit_bias"),
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
    err = _chat(client, functions=[]).json()["error"]
    assert err["param"] == "functions" and "not supported" in err["message"]
    err = client.post("/v1/completions", json={"model": client.model, "prompt": "a", "tools": []}).json()["error"]
    assert err["param"] == "tools" and "not supported" in err["message"]  # (chat's field only)
    # a batch whose n is not an int: a 400 naming it (check_same_n hashed it first: a 500)
    for params in ({"n": [1], "max_new_tokens": 1}, [{"n": {}}, {"n": 1}]):
        r = client.post("/generate", json={"text": ["a", "b"], "sampling_params": params})
        assert r.status_code == 400 and "n must be an integer" in r.json()["error"]["message"], r.text
    # SGLang's /generate fields minisgl does not build say so too
    r = client.post("/generate", json={"text": "hi", "session_params": {"id": "s"}})
    assert r.status_code == 400 and "'session_params': it is not supported by minisgl" in r.json()["error"]["message"]
    r = client.post("/generate", json={"text": "hi", "lora_path": "adapter"})  # (built; this server has no adapter)
    assert r.status_code == 400 and "LoRA is not enabled: start the server with --lora-paths" in r.json()["error"]["message"]


def test_generate_takes_the_nulls_sglangs_own_clients_send(tiny_model: str, tmp_path: Any) -> None:
    """sglang.bench_serving sends "lora_path": null and SGLang's nullable logprob fields as null;
    its frontend sends "regex": null in sampling_params: all ask for the default."""
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", "ok", 1, {"type": "length", "length": 1})])
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1, "regex": None, "json_schema": None, "sampling_seed": 7},
            "stream": False, "lora_path": None, "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None}  # fmt: skip
    with client:
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        obj = seen[0]
        assert (obj.return_logprob, obj.logprob_start_len, obj.top_logprobs_num) == (False, -1, 0)
        assert obj.lora_path is None
        r = client.post("/generate", json={"text": "hi", "lora_path": "adapter"})  # a real value reaches the TokenizerManager
        assert r.status_code == 200 and seen[-1].lora_path == "adapter"


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"logprob_start_len": 0}, "logprob_start_len needs return_logprob to be true"),
        ({"logprob_start_len": -2, "return_logprob": True}, "logprob_start_len"),
        ({"logprob_start_len": 1.5, "return_logprob": True}, "logprob_start_len"),
        ({"logprob_start_len": 50, "return_logprob": True}, "logprob_start_len=50 is higher than the number of input tokens"),
        ({"logprob_start_len": 0, "return_logprob": [True, False], "text": ["a", "b"]}, "needs return_logprob to be true"),
        ({"logprob_start_len": [0], "return_logprob": True, "text": ["a", "b"]}, "`logprob_start_len` must have 2 entries"),
        ({"top_logprobs_num": [1, 30], "return_logprob": True, "text": ["a", "b"]}, "top_logprobs_num must be in [0, 20]"),
    ],
)
def test_a_bad_logprob_start_len_is_a_400_that_names_it(client: TestClient, body: Dict[str, Any], needle: str) -> None:
    """Prompt logprobs need return_logprob (SGLang drops the field silently) and a position inside the prompt."""
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}, **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_a_body_without_a_json_content_type_says_to_send_one(client: TestClient, route: str) -> None:
    """`curl -d '{...}'` without -H sends application/x-www-form-urlencoded: FastAPI then does not
    parse JSON, and pydantic's message ("Input should be a valid dictionary") hid why."""
    body = json.dumps({"model": client.model, "prompt": "hi", "text": "hi", "messages": []})
    r = client.post(route, content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text
    assert "x-www-form-urlencoded" in r.json()["error"]["message"]


def test_bad_json_is_400_not_422(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=["a", "list"])
    assert r.status_code == 400 and "valid dictionary" in r.json()["error"]["message"]
    nested = b"[" * 100_000 + b"]" * 100_000  # past the JSON parser's recursion limit: it was a 500
    for route in ("/abort_request", "/v1/completions", "/generate"):
        r = client.post(route, content=nested, headers={"content-type": "application/json"})
        assert r.status_code == 400, (route, r.text)


@pytest.mark.parametrize(
    "prompt, needle",
    [("", "The prompt cannot be empty."), ([], "The prompt cannot be an empty list."),
     ([[]], "A token-id prompt cannot be empty."), ([1, "a"], "Invalid parameter 'prompt"), ([10**9], "vocabulary")],
)  # fmt: skip
def test_bad_completion_prompts(guarded_client: TestClient, prompt: Any, needle: str) -> None:
    """Each a 400 saying what is wrong with the prompt, before anything reaches the scheduler."""
    r = guarded_client.post("/v1/completions", json={"model": guarded_client.model, "prompt": prompt})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], (prompt, r.text)


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


def test_models_retrieve_the_served_model_or_404(client: TestClient) -> None:
    """`client.models.retrieve(name)` (GET /v1/models/{model}) was a bare 404."""
    card = client.get(f"/v1/models/{client.model}").json()  # the name is a path: slashes and all
    assert card["id"] == client.model and card["object"] == "model" and card["max_model_len"] == CONTEXT_LEN
    assert client.get("/v1/models/default").json()["id"] == client.model
    r = client.get("/v1/models/not-served")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


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
        # non-ASCII keys are a 401 like any wrong key (compare_digest refuses non-ASCII str: a 500)
        assert c.get("/v1/models", headers={"Authorization": "Bearer s\u00e9kret".encode()}).status_code == 401
        assert c.get("/visualizer/history", params={"api_key": "s\u00e9kret"}).status_code in (401, 404)
        healthy["ok"] = False
        assert c.get("/health").status_code == 503
        assert c.get("/health_generate").status_code == 503  # keyless too, and dead means no probe
    tm.close()


def test_metrics_and_cors_preflights_pass_the_api_key_as_sglangs_do(tiny_model: str, tmp_path: Any) -> None:
    """A Prometheus scrape config and a browser preflight carry no key (SGLang exempts /metrics
    and OPTIONS, and answers CORS for any origin)."""
    tm = _make_tm(tiny_model, tmp_path, api_key="sekret")
    load = GetLoadReqOutput(0, 0, 0, 100, 0, 0, 100, 0.0, 0.0, 0.7)

    async def get_load() -> Any:
        return load

    tm.get_load = get_load  # type: ignore[method-assign]
    app = create_app(tm.server_args, tm, is_healthy=lambda: True)
    with TestClient(app) as c:
        assert c.get("/metrics").status_code == 200
        preflight = {"Origin": "http://elsewhere.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
        r = c.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://elsewhere.example")
        r = c.get("/v1/models", headers={"Origin": "http://elsewhere.example", "Authorization": "Bearer sekret"})
        assert r.status_code == 200 and "access-control-allow-origin" in r.headers
        assert c.get("/v1/models", headers={"Origin": "http://elsewhere.example"}).status_code == 401  # still guarded
        # SGLang's info routes and methods (its frontend GETs /flush_cache, reads /get_model_info at connect)
        auth = {"Authorization": "Bearer sekret"}
        info = c.get("/get_model_info", headers=auth).json()
        assert info["model_path"] == tiny_model and info["is_generation"] is True
        server = c.get("/get_server_info", headers=auth).json()
        assert server["max_total_num_tokens"] == 100 and "api_key" not in server and server["context_len"] == tm.context_len
        assert c.get("/server_info", headers=auth).status_code == 200
        assert c.put("/generate", headers=auth, json={"text": "hi", "sampling_params": {"max_new_tokens": 1.5}}).status_code == 400
    tm.close()


def test_a_non_ascii_api_key_works(tiny_model: str, tmp_path: Any) -> None:
    tm = _make_tm(tiny_model, tmp_path, api_key="cl\u00e9")
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as c:
        assert c.get("/v1/models", headers={"Authorization": "Bearer cl\u00e9".encode()}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer cle"}).status_code == 401
    tm.close()


def test_bearer_matches_utf8_clients_and_latin1_browsers() -> None:
    """(The TestClient re-encodes every header as UTF-8, so the browser's form is checked here.)"""
    from minisgl.entrypoints.http_server import bearer_matches

    assert bearer_matches("Bearer cl\u00e9".encode("utf-8"), "cl\u00e9")  # curl, the openai client
    assert bearer_matches("Bearer cl\u00e9".encode("latin-1"), "cl\u00e9")  # a browser's fetch
    assert not bearer_matches(b"Bearer cle", "cl\u00e9") and not bearer_matches(b"Bearer cl\xe9x", "cl\u00e9")
    assert bearer_matches("Bearer \u043a\u043b\u044e\u0447".encode(), "\u043a\u043b\u044e\u0447")  # beyond Latin-1: UTF-8 only


def test_server_url_brackets_an_ipv6_host() -> None:
    from urllib.parse import urlsplit

    from minisgl.entrypoints.http_server import server_url

    assert server_url("127.0.0.1", 30000) == "http://127.0.0.1:30000"
    assert server_url("::1", 30000) == "http://[::1]:30000" and urlsplit(server_url("::1", 30000)).port == 30000


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
    from minisgl.managers.io_struct import LOGPROB_META_KEYS

    none = {key: [] for key in LOGPROB_META_KEYS}  # every dict the TokenizerManager makes has all of them
    prompt = {"input_token_logprobs": [(None, 7, None), (-3.0, 8, None)], "input_top_logprobs": [None, [(-0.1, 9, None)]]}
    a = {"text": "a", "output_ids": [1], "meta_info": {**none, "output_token_logprobs": [(-1.0, 1, None)], "output_top_logprobs": [[(-1.0, 1, None)]], "x": 1, **prompt}}
    b = {"text": "b", "output_ids": [2], "meta_info": {**none, "output_token_logprobs": [(-2.0, 2, None)], "output_top_logprobs": [[(-2.0, 2, None)]], "x": 2}}
    out = coalesce_streaming_chunks([a, b])
    assert out["text"] == "ab" and out["output_ids"] == [1, 2]
    assert out["meta_info"]["output_token_logprobs"] == [(-1.0, 1, None), (-2.0, 2, None)] and out["meta_info"]["x"] == 2
    # the prompt's logprobs come once, in the first chunk: the coalesced chunk keeps them
    assert out["meta_info"]["input_token_logprobs"] == prompt["input_token_logprobs"]
    assert out["meta_info"]["input_top_logprobs"] == prompt["input_top_logprobs"]


def test_dynamic_batch_tokenizer_batches_concurrent_texts(tokenizer: Any) -> None:
    texts = [f"prompt number {i} about lists" for i in range(8)]

    async def run() -> List[List[int]]:
        batcher = AsyncDynamicBatchTokenizer(tokenizer)
        try:
            results = await asyncio.gather(*(batcher.encode(t) for t in texts))
        finally:
            batcher.close()
        assert list(batcher.batch_sizes) == [8]  # one batched tokenizer call for all eight
        return list(results)

    results = asyncio.run(run())
    assert results == [tokenizer.encode(t, add_special_tokens=False) for t in texts]


# --------------------------------------------------------------------------- /generate input checks
def _recording_tm(tiny_model: str, tmp_path: Any, refuse_generate: bool = True) -> Tuple[TokenizerManager, List[Any]]:
    """A TokenizerManager that records what it sends to the scheduler. With `refuse_generate`
    a request that would reach the scheduler fails at once (a 500), instead of waiting
    forever for a scheduler that does not exist: a check that comes too late fails fast."""
    tm = _make_tm(tiny_model, tmp_path)
    tm.warmups_sent = []  # type: ignore[attr-defined]
    sent: List[Any] = []

    def send(msg: Any) -> None:
        if refuse_generate and isinstance(msg, TokenizedGenerateReqInput):
            raise RuntimeError(f"rid={msg.rid} reached the scheduler")
        if isinstance(msg, TokenizedGenerateReqInput) and "-prefix-" in msg.rid and msg.sampling_params.max_new_tokens == 0:
            # an n > 1 request's prefix warm-up: prefilled and finished at once, as a scheduler would
            tm.warmups_sent.append(msg)  # type: ignore[attr-defined]
            asyncio.get_running_loop().call_soon(tm._dispatch, _str_out(msg.rid, "", [], 0, {"type": "length", "length": 0}))
            return
        sent.append(msg)

    tm._send_to_scheduler = send  # type: ignore[method-assign]
    return tm, sent


@pytest.fixture()
def guarded_client(tiny_model: str, tmp_path: Any) -> TestClient:
    """`client`, but a request that reaches the scheduler is a 500 rather than a hang."""
    tm, _ = _recording_tm(tiny_model, tmp_path)
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as c:
        c.model = tm.model_name  # type: ignore[attr-defined]
        yield c
    tm.close()


@pytest.mark.parametrize(
    "sampling_params, needle",
    [
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),  # used to kill the scheduler
        ({"seed": "x"}, "seed must be an integer"),  # used to kill the scheduler
        ({"max_new_tokens": "abc"}, "max_new_tokens must be an integer"),
        ({"temperature": "0.5"}, "temperature must be a number"),
        ({"stop": 5}, "stop must be a string or a list of strings"),
        ({"stop": [""]}, "stop strings must not be empty"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids must be a list of integers"),
        ({"ignore_eos": "no"}, "ignore_eos must be true or false"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"n": True}, "n must be an integer"),
        ({"n": 0}, "n must be in [1, 128]"),  # answered 200 with [] (no sub-request) while the Engine refused it
        ({"n": 5000}, "n must be in [1, 128]"),  # 5,000 requests from one client stalled the others
        ({"temperature": 1e300, "min_new_tokens": 2}, "at most 3.403e+38"),  # inf in float32: NaN logprobs, a 400 at the end
        ({"temperature": -1}, "temperature must be a finite number >= 0"),
    ],
)
def test_native_generate_type_checks_sampling_params_before_the_scheduler(
    tiny_model: str, tmp_path: Any, sampling_params: Dict[str, Any], needle: str
) -> None:
    tm, sent = _recording_tm(tiny_model, tmp_path)
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as c:
        for stream in (False, True):
            r = c.post("/generate", json={"text": "hi", "sampling_params": sampling_params, "stream": stream})
            assert r.status_code == 400, r.text
            assert needle in r.json()["error"]["message"]
    assert sent == [] and tm.rid_to_state == {}  # nothing reached the scheduler, nothing left behind
    tm.close()


@pytest.mark.parametrize("stream", [False, True])
def test_native_generate_caps_top_logprobs_num_as_openai_does(guarded_client: TestClient, stream: bool) -> None:
    """Unbounded, it was clamped to the vocabulary: one request's answer was 30 MB (246 MB with
    n=8), and the HTTP process stalled every other stream while it encoded the JSON."""
    body = {"text": "hi", "return_logprob": True, "top_logprobs_num": 10**9, "stream": stream}
    r = guarded_client.post("/generate", json=body)
    assert r.status_code == 400 and "top_logprobs_num must be in [0, 20]" in r.json()["error"]["message"]


def test_one_bad_entry_fails_a_batch_before_any_prompt_is_sent(tiny_model: str, tmp_path: Any) -> None:
    async def run() -> None:
        tm, sent = _recording_tm(tiny_model, tmp_path)
        try:
            obj = GenerateReqInput(text=["a", "b"], sampling_params=[{"max_new_tokens": 2}, {"max_new_tokens": 2.5}])
            with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
                await tm.generate_request(obj).__anext__()
            assert sent == [] and tm.rid_to_state == {}
            # a prompt-level fault (an id outside the vocabulary) in the last of many: the siblings
            # were prefilled, then aborted one by one
            ids = GenerateReqInput(input_ids=[[1, 2, 3]] * 50 + [[999_999]], sampling_params={"max_new_tokens": 2})
            with pytest.raises(ValueError, match="999999"):
                await tm.generate_request(ids).__anext__()
            assert sent == [] and tm.rid_to_state == {}
        finally:
            tm.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"text": "hi", "rid": ["a", "b"]}, "`rid` must be a string for a single prompt"),
        ({"input_ids": [5, 6], "rid": ["a"]}, "`rid` must be a string for a single prompt"),
        ({"text": ["hi", "yo"], "rid": ["a", "a"]}, "must not repeat"),
        ({"text": "hi", "top_logprobs_num": 3}, "top_logprobs_num needs return_logprob"),
        ({"text": "hi", "rid": ""}, "`rid` must not be empty"),  # the scheduler reads "" as no rid: unabortable
        ({"text": ["hi", "yo"], "rid": ["a", ""]}, "`rid` must not be empty"),
        # a rid rides in every step's messages and snapshots: a few 4 MB ones filled GBs
        ({"text": ["hi", "yo"], "rid": ["a", "r" * 257]}, "`rid` takes at most 256 characters, got 257"),
        ({"text": "hi", "return_logprob": [True]}, "A single prompt takes one `sampling_params` dict"),
        ({"text": ["hi", "yo"], "return_logprob": [True]}, "`return_logprob` must have 2 entries"),
        ({"text": ["a", "b"], "rid": ["x"]}, "`rid` must be a list of 2 ids"),
        # SGLang's rule: result i*n + j is sample j of prompt i, so every prompt has the same n
        ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {}]}, "parallel_sample_num should be the same"),
    ],
)
def test_native_generate_shape_errors_are_400(guarded_client: TestClient, body: Dict[str, Any], needle: str) -> None:
    r = guarded_client.post("/generate", json={"sampling_params": {"max_new_tokens": 2}, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_abort_request_with_a_non_string_rid_is_400(guarded_client: TestClient) -> None:
    r = guarded_client.post("/abort_request", json={"rid": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"


def test_native_generate_mid_stream_error_is_an_error_event_then_done(tiny_model: str, tmp_path: Any) -> None:
    async def first_token_then_error(obj: Any, request: Any = None) -> Any:
        yield {"text": "a", "output_ids": [5], "meta_info": {"id": "r", "finish_reason": None}}
        raise ValueError("boom after the headers")

    tm = _make_tm(tiny_model, tmp_path)
    tm.generate_request = first_token_then_error  # type: ignore[method-assign]
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as c:
        r = c.post("/generate", json={"text": "hi", "stream": True})
    assert r.status_code == 200
    events = [e[len("data: ") :] for e in r.text.strip().split("\n\n")]
    assert len(events) == 3 and json.loads(events[0])["text"] == "a"
    assert json.loads(events[1])["error"]["message"] == "boom after the headers"
    assert events[2] == "[DONE]"  # as docs/server.md and SGLang: the error event, then [DONE]
    tm.close()


# --------------------------------------------------------------------------- abort of n > 1
def test_abort_of_the_parent_rid_aborts_every_sample(tiny_model: str, tmp_path: Any) -> None:
    from minisgl.managers.io_struct import AbortReq

    async def run() -> None:
        tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        try:
            obj = GenerateReqInput(text="hello", rid="par", sampling_params={"max_new_tokens": 50, "n": 2})
            gen = tm.generate_request(obj)
            first = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0.05)
            assert sorted(tm.rid_to_state) == ["par-0", "par-1"]
            tm.abort_request("par")
            # one exact abort per sample: the scheduler matches exact rids
            assert [m.rid for m in sent if isinstance(m, AbortReq)] == ["par-0", "par-1"]
            tm.abort_request("pa")  # not a parent of anything in flight: nothing is sent
            assert len([m for m in sent if isinstance(m, AbortReq)]) == 2
            for j in range(2):  # the scheduler's answer: both samples end as aborted
                tm._handle_batch_output(_str_out(f"par-{j}", "", [], 0, {"type": "abort", "message": "Abort"}))
            outs = [await asyncio.wait_for(first, 5)] + [out async for out in gen]
            assert sorted(o["index"] for o in outs) == [0, 1]
            assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
        finally:
            tm.close()  # linger 0: what was queued for the absent scheduler cannot block the exit

    asyncio.run(run())


# --------------------------------------------------------------------------- accepted but unsupported
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_stream_options_without_stream_is_400(guarded_client: TestClient, route: str) -> None:
    body: Dict[str, Any] = {"model": guarded_client.model, "max_tokens": 2, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"})
    r = guarded_client.post(route, json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"] == "stream_options is only allowed when stream is true" and err["param"] == "stream_options"


def test_empty_stop_string_is_400_on_the_openai_routes(guarded_client: TestClient) -> None:
    for stop in ("", [""], ["x", ""]):
        r = _chat(guarded_client, stop=stop)
        assert r.status_code == 400 and "stop strings must not be empty" in r.json()["error"]["message"], r.text


def test_message_name_reaches_the_template_or_is_refused(guarded_client: TestClient, tiny_model: str, tmp_path: Any) -> None:
    # the tiny model's template never reads `name`: a 400, not a silently dropped field
    r = _chat(guarded_client, messages=[{"role": "user", "content": "hi", "name": "alice"}])
    assert r.status_code == 400 and "messages[].name" in r.json()["error"]["message"]
    # a template that reads it gets the whole message, name included (as transformers/SGLang do)
    from minisgl.entrypoints.openai.serving_chat import OpenAIServingChat

    tm = _make_tm(tiny_model, tmp_path)
    tm.tokenizer.chat_template = "{% for m in messages %}[{{ m.get('name', m['role']) }}] {{ m['content'] }}\n{% endfor %}"
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi", "name": "alice"}, {"role": "user", "content": "yo"}])
    assert OpenAIServingChat(tm)._apply_chat_template(req) == "[alice] hi\n[user] yo\n"
    tm.close()


def test_too_large_max_tokens_names_the_field_sent(guarded_client: TestClient) -> None:
    r = _chat(guarded_client, max_tokens=CONTEXT_LEN + 1)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens is too large")
    r = _chat(guarded_client, max_tokens=None, max_completion_tokens=CONTEXT_LEN + 1)
    assert r.json()["error"]["message"].startswith("max_completion_tokens is too large")


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/completions", {"prompt": "hi \ud800 there"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \udfff"}]}),
        ("/v1/completions", {"prompt": "hi", "stop": "\ud800"}),
        ("/generate", {"text": "\ud800", "sampling_params": {"max_new_tokens": 2}}),
    ],
    ids=["prompt", "chat-content", "stop", "native"],
)
def test_lone_surrogates_are_400_not_500(guarded_client: TestClient, route: str, body: Dict[str, Any]) -> None:
    """JSON's "\\ud800" is valid JSON but not Unicode: the tokenizer raised a TypeError (a 500)."""
    common = {} if route == "/generate" else {"model": guarded_client.model, "max_tokens": 2}
    payload = json.dumps({**common, **body})  # ensure_ascii keeps the escape
    r = guarded_client.post(route, content=payload.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_lone_surrogates_in_echoed_fields_are_4xx_not_500(guarded_client: TestClient) -> None:
    """A wrong model name is quoted in the 404, a rid in every answer: neither may fail to encode."""
    body = json.dumps({"model": "x\ud800", "prompt": "hi", "max_tokens": 2})
    r = guarded_client.post("/v1/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 404 and "x\\ud800" in r.json()["error"]["message"], r.text
    body = json.dumps({"text": "hi", "rid": "r\ud800", "sampling_params": {"max_new_tokens": 2}})
    r = guarded_client.post("/generate", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and "`rid` must be valid Unicode" in r.json()["error"]["message"], r.text


def test_chat_max_tokens_beyond_the_context_is_clamped_under_auto_truncate(tiny_model: str, tmp_path: Any) -> None:
    """sglang-facts 10.1: the chat route's "too large" check holds only without auto-truncate."""
    tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
    tm.server_args = dataclasses.replace(tm.server_args, allow_auto_truncate=True)

    async def run() -> None:
        from minisgl.entrypoints.openai.serving_chat import OpenAIServingChat

        req = ChatCompletionRequest(model=tm.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=5000)
        task = asyncio.ensure_future(OpenAIServingChat(tm).handle_request(req, None))
        while not sent and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        assert sent, task.result()  # (a refusal would have finished the task with a 400)

    asyncio.run(run())
    (msg,) = [m for m in sent if isinstance(m, TokenizedGenerateReqInput)]
    assert len(msg.input_ids) + msg.sampling_params.max_new_tokens == CONTEXT_LEN


def test_a_prompt_the_scheduler_would_refuse_is_a_400_before_any_stream(tiny_model: str, tmp_path: Any) -> None:
    """Prompts between the scheduler's max_req_input_len and the context used to stream 200 + an error event."""
    tm, _ = _recording_tm(tiny_model, tmp_path)
    tm.max_req_input_len = CONTEXT_LEN - 6
    ids = list(range(10, 10 + CONTEXT_LEN - 3))
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as c:
        for stream in (False, True):
            r = c.post("/v1/completions", json={"model": tm.model_name, "prompt": ids, "max_tokens": 1, "stream": stream})
            assert r.status_code == 400, r.text
            assert f"longer than this server accepts ({CONTEXT_LEN - 7} tokens" in r.json()["error"]["message"]


def test_auto_truncate_keeps_room_to_generate(tiny_model: str, tmp_path: Any) -> None:
    from minisgl.managers.tokenization import validate_context_length
    from minisgl.sampling.sampling_params import SamplingParams

    req = TokenizedGenerateReqInput(rid="r", input_text=None, input_ids=list(range(100)), sampling_params=SamplingParams(max_new_tokens=5))
    validate_context_length(req, CONTEXT_LEN, allow_auto_truncate=True, max_req_input_len=CONTEXT_LEN - 6)
    assert len(req.input_ids) == CONTEXT_LEN - 7 and req.sampling_params.max_new_tokens == 5


def test_dynamic_batch_tokenizer_fails_only_the_text_at_fault(tokenizer: Any) -> None:
    """A batched call that raises is retried text by text: the others in its batch go on."""

    class Picky:
        def __call__(self, texts: List[str], **kw: Any) -> Any:
            if any("poison" in t for t in texts):
                raise TypeError("cannot tokenize poison")
            return tokenizer(texts, **kw)

        def encode(self, text: str, **kw: Any) -> List[int]:
            if "poison" in text:
                raise TypeError("cannot tokenize poison")
            return tokenizer.encode(text, **kw)

    texts = ["alpha beta", "poison", "gamma delta"]

    async def run() -> List[Any]:
        batcher = AsyncDynamicBatchTokenizer(Picky())
        try:
            return await asyncio.gather(*(batcher.encode(t) for t in texts), return_exceptions=True)
        finally:
            batcher.close()

    good0, bad, good2 = asyncio.run(run())
    assert isinstance(bad, TypeError)
    assert good0 == tokenizer.encode("alpha beta", add_special_tokens=False)
    assert good2 == tokenizer.encode("gamma delta", add_special_tokens=False)


def test_a_disconnected_rid_stays_in_flight_until_the_scheduler_lets_it_go(tiny_model: str, tmp_path: Any) -> None:
    """The scheduler runs the request until its abort lands: a new request reusing the rid in
    the meantime got the old one's outputs (its abort and text); now it is a duplicate."""
    from minisgl.managers.io_struct import AbortReq

    tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)

    async def run() -> None:
        gen = tm.generate_request(GenerateReqInput(text="hello", sampling_params={"max_new_tokens": 8}, rid="dup", stream=True))
        first = asyncio.ensure_future(gen.__anext__())
        while not any(isinstance(m, TokenizedGenerateReqInput) for m in sent):
            await asyncio.sleep(0.01)
        tm._handle_batch_output(_str_out("dup", "old", [5], 1))
        assert (await first)["text"] == "old"
        await gen.aclose()  # the client went away mid-stream
        for _ in range(100):  # (the inner generator's finally runs from asyncio's finalizer hook)
            if any(isinstance(m, AbortReq) for m in sent):
                break
            await asyncio.sleep(0.01)
        assert [m.rid for m in sent if isinstance(m, AbortReq)] == ["dup"]
        with pytest.raises(ValueError, match="Duplicate request ID"):
            again = GenerateReqInput(text="again", sampling_params={"max_new_tokens": 8}, rid="dup")
            await asyncio.wait_for(tm.generate_request(again).__anext__(), timeout=5)
        tm._handle_batch_output(_str_out("dup", " more", [6], 2))  # still decoding: read by nobody
        tm._handle_batch_output(_str_out("dup", "", [], 2, {"type": "abort", "message": "Abort"}))
        assert "dup" not in tm.rid_to_state  # the abort came back: the rid is free again

    asyncio.run(run())


def test_a_disconnect_aborts_its_own_rid_once_and_no_one_elses_samples(tiny_model: str, tmp_path: Any) -> None:
    """Client A runs rid `job` with n = 2 (samples job-0, job-1); client B, non-streaming,
    reuses `job` (accepted: only the samples are registered) and goes away. B's abort must
    hit `job` alone, once: it also aborted A's samples, and counted itself twice."""
    from minisgl.managers.io_struct import AbortReq

    tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
    tm.wait_timeout = 0.05  # how often a waiting request asks whether its client is still there

    class GoneClient:
        async def is_disconnected(self) -> bool:
            return True

    def aborts() -> List[str]:
        return sorted(m.rid for m in sent if isinstance(m, AbortReq))

    async def run() -> None:
        a = tm.generate_request(GenerateReqInput(text="a", sampling_params={"max_new_tokens": 8, "n": 2}, rid="job"))
        a_first = asyncio.ensure_future(a.__anext__())
        while sum(isinstance(m, TokenizedGenerateReqInput) for m in sent) < 2:
            await asyncio.sleep(0.01)
        b = tm.generate_request(GenerateReqInput(text="b", sampling_params={"max_new_tokens": 8}, rid="job"), GoneClient())
        with pytest.raises(ValueError, match="disconnected"):
            await asyncio.wait_for(b.__anext__(), timeout=5)
        assert aborts() == ["job"]
        assert tm.metrics.num_aborted_requests_total.labels(**tm.metrics.labels)._value.get() == 1
        a_first.cancel()

    asyncio.run(run())


def test_a_late_control_reply_is_not_handed_to_the_next_caller(tiny_model: str, tmp_path: Any) -> None:
    """A /get_load that timed out (a scheduler step longer than the timeout) is still answered
    later: that answer must be dropped, not returned to the next /get_load, which would then
    read the previous step's load (and every later caller one reply behind)."""
    from minisgl.managers.io_struct import GetLoadReqInput, GetLoadReqOutput

    tm, sent = _recording_tm(tiny_model, tmp_path)

    async def run() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await tm._control_request(GetLoadReqInput(), GetLoadReqOutput, timeout=0.05)
        second = asyncio.ensure_future(tm._control_request(GetLoadReqInput(), GetLoadReqOutput, timeout=5))
        while sum(isinstance(m, GetLoadReqInput) for m in sent) < 2:
            await asyncio.sleep(0.01)
        def load(running: int) -> GetLoadReqOutput:
            return GetLoadReqOutput(running, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0)

        tm._dispatch(load(1))  # the late answer to the first
        tm._dispatch(load(2))  # the answer to the second
        assert (await second).num_running_reqs == 2

    asyncio.run(run())


def test_an_n_request_prefills_its_prompt_once_before_its_samples(tiny_model: str, tmp_path: Any) -> None:
    """SGLang's prefix warm-up: one max_new_tokens=0 copy per prompt, awaited, then the n samples
    (which then find the prompt cached); kept out of the request metrics."""
    tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)

    async def run() -> None:
        gen = tm.generate_request(GenerateReqInput(text=["a b", "c d e"], sampling_params={"max_new_tokens": 8, "n": 2}, rid=["p", "q"]))
        task = asyncio.ensure_future(gen.__anext__())
        while sum(isinstance(m, TokenizedGenerateReqInput) for m in sent) < 4:
            await asyncio.sleep(0.01)
        warm = tm.warmups_sent  # type: ignore[attr-defined]
        samples = [m for m in sent if isinstance(m, TokenizedGenerateReqInput)]
        assert sorted(w.rid.split("-prefix-")[0] for w in warm) == ["p", "q"]
        assert all(w.sampling_params.max_new_tokens == 0 and not w.return_logprob for w in warm)
        assert sorted(tuple(w.input_ids) for w in warm) == sorted({tuple(m.input_ids) for m in samples})
        assert sorted(m.rid for m in samples) == ["p-0", "p-1", "q-0", "q-1"]
        assert all(w.rid not in tm.rid_to_state for w in warm)  # finished and forgotten
        task.cancel()
        await asyncio.sleep(0)

    asyncio.run(run())
    assert tm.metrics.registry.get_sample_value("sglang:num_requests_total", tm.metrics.labels) in (None, 0.0)
    tm.close()


def test_aborting_a_rid_never_hits_another_clients_rid_that_looks_like_a_sample(tiny_model: str, tmp_path: Any) -> None:
    """`job` must not abort another client's single request `job-1`; the n > 1 samples of `multi` it must."""
    from minisgl.managers.io_struct import AbortReq

    tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)

    async def run() -> None:
        single = tm.generate_request(GenerateReqInput(text="a", sampling_params={"max_new_tokens": 8}, rid="job-1"))
        multi = tm.generate_request(GenerateReqInput(text="b", sampling_params={"max_new_tokens": 8, "n": 2}, rid="multi"))
        tasks = [asyncio.ensure_future(g.__anext__()) for g in (single, multi)]
        while sum(isinstance(m, TokenizedGenerateReqInput) for m in sent) < 3:
            await asyncio.sleep(0.01)
        tm.abort_request("job")  # nobody's request: nothing to abort
        assert [m for m in sent if isinstance(m, AbortReq)] == []
        tm.abort_request("multi")
        assert sorted(m.rid for m in sent if isinstance(m, AbortReq)) == ["multi-0", "multi-1"]
        for task in tasks:
            task.cancel()

    asyncio.run(run())


def test_a_finished_samples_rid_reused_by_another_client_is_not_aborted_with_its_parent(tiny_model: str, tmp_path: Any) -> None:
    """Sample `x-0` finishes while `x-1` runs; another client then sends its own request `x-0`.
    Aborting `x` must hit `x-1` only: the sample table still listed `x-0`."""
    tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)

    async def run() -> None:
        multi = tm.generate_request(GenerateReqInput(text="b", sampling_params={"max_new_tokens": 8, "n": 2}, rid="x"))
        first = asyncio.ensure_future(multi.__anext__())
        while sum(isinstance(m, TokenizedGenerateReqInput) for m in sent) < 2:
            await asyncio.sleep(0.01)
        tm._handle_batch_output(_str_out("x-0", "done", [5], 1, {"type": "length", "length": 1}))
        await asyncio.wait_for(first, 5)  # sample 0's answer; sample 1 still runs
        other = asyncio.ensure_future(
            tm.generate_request(GenerateReqInput(text="c", sampling_params={"max_new_tokens": 8}, rid="x-0")).__anext__()
        )
        while sum(isinstance(m, TokenizedGenerateReqInput) for m in sent) < 3:
            await asyncio.sleep(0.01)
        tm.abort_request("x")
        assert [m.rid for m in sent if isinstance(m, AbortReq)] == ["x-1"]
        other.cancel()
        await multi.aclose()

    try:
        asyncio.run(run())
    finally:
        tm.close()


# --------------------------------------------------------------------------- scripted outputs
def _scripted_client(
    tiny_model: str, tmp_path: Any, outs: List[Dict[str, Any]], args: Optional[Dict[str, Any]] = None,
    template: Optional[str] = None, **tm_attrs: Any,
) -> Tuple[TestClient, List[Any]]:
    """An app whose TokenizerManager (ServerArgs `args` changed) answers every request with `outs`
    and records what it got; `template`: its tokenizer's chat template instead (as --chat-template)."""
    if template is not None:
        tokenizer = get_tokenizer(tiny_model)
        tokenizer.chat_template = template
        tm_attrs["tokenizer"] = tokenizer
    tm = _make_tm(tiny_model, tmp_path, **(args or {}))
    for name, value in tm_attrs.items():
        setattr(tm, name, value)
    seen: List[Any] = []

    async def scripted(obj: Any, request: Any = None) -> Any:
        seen.append(obj)
        for out in outs:
            yield dict(out)

    tm.generate_request = scripted  # type: ignore[method-assign]
    client = TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True))
    client.model = tm.model_name  # type: ignore[attr-defined]
    client.tm = tm  # type: ignore[attr-defined]  # (a test changes what it serves: a weight update's version)
    return client, seen


def _sse_events(r: Any) -> List[Tuple[str, Dict[str, Any]]]:
    """(event name, data) of each `event:` + `data:` pair of a named-event SSE stream (the Responses' and the
    Messages API's; chat's stream has data lines only)."""
    events = []
    for block in r.text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append((name[len("event: ") :], json.loads(data[len("data: ") :])))
    return events


def _out(rid: str, text: str, completion: int, finish: Any = None, index: Any = None) -> Dict[str, Any]:
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": completion, "cached_tokens": 0,
            "weight_version": "default"}  # (what the TokenizerManager puts in every meta_info)
    out: Dict[str, Any] = {"text": text, "output_ids": [5] * completion, "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def test_chat_requests_carry_the_generation_config_defaults_and_completions_do_not(tiny_model: str, tmp_path: Any) -> None:
    outs = [_out("r", "x", 1, {"type": "length", "length": 1})]
    client, seen = _scripted_client(tiny_model, tmp_path, outs, default_sampling_params={"top_k": 1, "temperature": 0.6})
    with client:
        assert _chat(client).status_code == 200
        assert client.post("/v1/completions", json={"model": client.model, "prompt": "hi"}).status_code == 200
    chat, completion = (obj.sampling_params for obj in seen)
    assert (chat["top_k"], chat["temperature"]) == (1, 0.6)
    assert (completion["top_k"], completion["temperature"]) == (-1, 1.0)  # SGLang: chat only


def test_stream_chunks_spell_out_their_nulls_and_share_one_created(tiny_model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenAI's chunks carry finish_reason/logprobs null until the end, usage null before the
    usage chunk, and one `created` for the whole stream (each chunk took its own clock read)."""
    import itertools
    import time

    clock = itertools.count(1_700_000_000)
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))
    outs = [_out("r", "Hel", 1), _out("r", "lo", 2), _out("r", "", 2, {"type": "length", "length": 2})]
    client, _ = _scripted_client(tiny_model, tmp_path, outs)
    options = {"stream": True, "stream_options": {"include_usage": True}}
    with client:
        chat = client.post("/v1/chat/completions", json={"model": client.model, "messages": [{"role": "user", "content": "hi"}], **options})
        comp = client.post("/v1/completions", json={"model": client.model, "prompt": "hi", **options})
    for r in (chat, comp):
        events = [e[len("data: ") :] for e in r.text.strip().split("\n\n")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len({c["created"] for c in chunks}) == 1
        *content, usage = chunks
        assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
        assert all(c["usage"] is None for c in content)
        assert [c["choices"][0]["finish_reason"] for c in content][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None and c["choices"][0]["logprobs"] is None for c in content[:-1])
    deltas = [c["choices"][0]["delta"] for c in (json.loads(e[len("data: ") :]) for e in chat.text.strip().split("\n\n")[:-2])]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}]


def test_a_completions_batch_may_name_one_rid_per_prompt(tiny_model: str, tmp_path: Any) -> None:
    """SGLang's CompletionRequest takes a list of rids for a list of prompts; minisgl took only
    a string, which a batch refuses. The response id is the first prompt's rid, whole."""
    finish = {"type": "length", "length": 1}
    outs = [_out("job-a", "x", 1, finish, index=0), _out("job-b", "y", 1, finish, index=1)]
    client, seen = _scripted_client(tiny_model, tmp_path, outs)
    with client:
        r = client.post("/v1/completions", json={"model": client.model, "prompt": ["p", "q"], "rid": ["job-a", "job-b"]})
    assert r.status_code == 200, r.text
    assert seen[0].rid == ["job-a", "job-b"]
    assert r.json()["id"] == "job-a"  # not "job": only an n > 1 sample's "-j" is stripped


def test_fail_all_requests_answers_every_waiting_handler(tiny_model: str, tmp_path: Any) -> None:
    """What the server does when a child dies: each request in flight ends here as an abort
    with the reason and a 503, so its handler answers instead of being cancelled into a 500."""

    async def run() -> None:
        tm, _ = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        try:
            streamed = GenerateReqInput(text="a", sampling_params={"max_new_tokens": 50}, stream=True)
            waiting = GenerateReqInput(text="b", sampling_params={"max_new_tokens": 50})
            gen_s, gen_w = tm.generate_request(streamed), tm.generate_request(waiting)
            first_s, first_w = asyncio.ensure_future(gen_s.__anext__()), asyncio.ensure_future(gen_w.__anext__())
            await asyncio.sleep(0.05)
            tm._handle_batch_output(_str_out(streamed.rid, "Hel", [5], 1))
            assert (await asyncio.wait_for(first_s, 5))["text"] == "Hel"
            tm.fail_all_requests("The server is shutting down: minisgl-scheduler (exit code -9) died")
            last = await asyncio.wait_for(gen_s.__anext__(), 5)
            reason = last["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and reason["status_code"] == 503 and "died" in reason["message"]
            assert last["meta_info"]["completion_tokens"] == 1
            with pytest.raises(ReqAbortedError) as e:  # the non-streaming handler answers a 503
                await asyncio.wait_for(first_w, 5)
            assert e.value.status_code == 503 and "died" in e.value.message
            assert tm.rid_to_state == {}
        finally:
            tm.close()

    asyncio.run(run())


def test_health_generate_needs_the_pipeline_to_answer(tiny_model: str, tmp_path: Any) -> None:
    """/health only sees that the processes live; a stuck one answers nothing. The probe is a
    one-token request that must get an answer, and it stays out of the request metrics."""

    async def run() -> None:
        tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        try:
            # nothing answers: a stuck pipeline. A /metrics scrape's load reply meanwhile comes
            # from the scheduler alone, past the stuck part: it used to pass the probe.
            load = GetLoadReqOutput(0, 0, 0, 100, 0, 0, 100, 0.0, 0.0, 0.7)
            asyncio.get_running_loop().call_later(0.1, tm._dispatch, load)
            assert await tm.health_generate(timeout=0.3) is False
            assert tm.rid_to_state == {}  # a failed probe is forgotten (a stuck pipeline never answers its abort)
            probes = [m for m in sent if isinstance(m, TokenizedGenerateReqInput)]
            assert len(probes) == 1 and probes[0].rid.startswith("HEALTH_CHECK_")
            assert probes[0].sampling_params.max_new_tokens == 1
            assert [m.rid for m in sent if isinstance(m, AbortReq)] == [probes[0].rid]

            def answer(msg: Any) -> None:  # a scheduler that works: the one token comes back
                sent.append(msg)
                if isinstance(msg, TokenizedGenerateReqInput):
                    done = _str_out(msg.rid, "x", [5], 1, {"type": "length", "length": 1})
                    asyncio.get_running_loop().call_later(0.05, tm._dispatch, done)

            tm._send_to_scheduler = answer  # type: ignore[method-assign]
            def finished_requests() -> Any:
                name = "sglang:e2e_request_latency_seconds_count"
                return tm.metrics.registry.get_sample_value(name, tm.metrics.labels)

            tm.metrics.e2e_request_latency.labels(**tm.metrics.labels)  # the series exists, at 0
            assert finished_requests() == 0
            assert await tm.health_generate(timeout=5) is True
            await asyncio.sleep(0.1)
            assert not tm._health_checks  # the probe finished by itself
            assert finished_requests() == 0
        finally:
            tm.close()

    asyncio.run(run())


def test_a_big_prompt_is_tokenized_off_the_event_loop(tiny_model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 10 MB prompt took 10 s to tokenize on the event loop: every other stream and /health
    stopped for that long, though the prompt was then refused as too long."""
    import threading
    import time

    from minisgl.managers import tokenization

    real = tokenization.tokenize_one_request
    threads: List[str] = []

    def slow_tokenize(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        time.sleep(0.5)  # what a big prompt costs
        return real(*args)

    monkeypatch.setattr(tokenization, "tokenize_one_request", slow_tokenize)

    async def run() -> None:
        tm, _ = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        tm.max_prompt_chars = 10**9  # as for a long-context model: this prompt could fit, so it is tokenized
        ticks = 0

        async def other_clients() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(other_clients())
        try:
            big = GenerateReqInput(text="word " * 10_000, sampling_params={"max_new_tokens": 1})
            with pytest.raises(ValueError, match="longer than the model's context length"):
                await tm.generate_request(big).__anext__()
            assert threads[-1] != threading.main_thread().name and ticks >= 10  # the loop went on
            small = asyncio.ensure_future(tm.generate_request(GenerateReqInput(text="hi", sampling_params={"max_new_tokens": 1})).__anext__())
            await asyncio.sleep(0.6)
            assert threads[-1] == threading.main_thread().name  # a short one stays inline (no thread hop)
            small.cancel()
        finally:
            ticker.cancel()
            tm.close()

    asyncio.run(run())


async def _run_to_end(tm: TokenizerManager, obj: GenerateReqInput, *outs: BatchStrOutput) -> None:
    """Send `obj`, feed it `outs` as the detokenizer would, and read it to its end (an abort with
    a status raises for a non-streaming request: that is an end too)."""
    gen = tm.generate_request(obj)
    first = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0.05)
    for out in outs:
        tm._handle_batch_output(out)
    try:
        await asyncio.wait_for(first, 5)
        async for _ in gen:
            pass
    except Exception:  # noqa: BLE001
        pass


def test_request_metrics_count_aborts_that_ran_and_time_a_non_streams_first_token(tiny_model: str, tmp_path: Any) -> None:
    """An abort after tokens were generated is a finished request in /metrics (its tokens were
    missing from generation_tokens), one that never ran is not; a non-streaming request's TTFT
    is when its first token existed (the scheduler's prefill), not its first message, which
    comes after 50 tokens or at the end."""

    def sample(name: str, tm: TokenizerManager) -> float:
        return tm.metrics.registry.get_sample_value(name, tm.metrics.labels) or 0.0

    async def run() -> None:
        tm, _ = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        try:
            ran = GenerateReqInput(text="a", sampling_params={"max_new_tokens": 50}, stream=True, rid="ran")
            await _run_to_end(tm, ran, _str_out("ran", "x", [5], 1), _str_out("ran", "yz", [6, 7], 3, {"type": "abort", "message": "Abort"}))
            assert sample("sglang:num_requests_total", tm) == 1 and sample("sglang:generation_tokens_total", tm) == 3
            waited = GenerateReqInput(text="b", sampling_params={"max_new_tokens": 50}, stream=True, rid="waited")
            await _run_to_end(tm, waited, _str_out("waited", "", [], 0, {"type": "abort", "message": "Abort"}))
            assert sample("sglang:num_requests_total", tm) == 1  # never ran: not a request served

            whole = GenerateReqInput(text="c", sampling_params={"max_new_tokens": 3}, rid="whole")
            gen = tm.generate_request(whole)
            first = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0.05)
            await asyncio.sleep(0.8)  # the rest of the generation: the one message comes at the end
            done = _str_out("whole", "xyz", [5, 6, 7], 3, {"type": "length", "length": 3})
            done.time_stats = [{"ttft_ms": 2.0}]
            tm._handle_batch_output(done)
            await asyncio.wait_for(first, 5)
            ttft_sum = sample("sglang:time_to_first_token_seconds_sum", tm)
            e2e_sum = sample("sglang:e2e_request_latency_seconds_sum", tm)
            assert ttft_sum < 0.5 < 0.8 < e2e_sum  # (ttft_sum also holds the stream's, ~0.05 s)
        finally:
            tm.close()

    asyncio.run(run())


def test_log_requests_shows_the_whole_answer_and_clips_huge_text(tiny_model: str, tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """--log-requests logged a stream's last delta as its answer, nothing for a request ending in
    a 503 abort, and a 10 MB prompt as one 10 MB line."""
    import logging

    caplog.set_level(logging.INFO, logger="minisgl")

    async def run() -> None:
        tm = _make_tm(tiny_model, tmp_path, log_requests=True)
        tm._send_to_scheduler = lambda msg: None  # type: ignore[method-assign]

        try:
            huge = GenerateReqInput(text="x " * 5_000, sampling_params={"max_new_tokens": 2}, rid="huge")
            with pytest.raises(ValueError):  # refused as too long, but logged as received first
                await tm.generate_request(huge).__anext__()
            streamed = GenerateReqInput(text="p", sampling_params={"max_new_tokens": 2}, stream=True, rid="s")
            await _run_to_end(tm, streamed, _str_out("s", "Hel", [5], 1), _str_out("s", "lo", [6], 2, {"type": "length", "length": 2}))
            full = GenerateReqInput(text="q", sampling_params={"max_new_tokens": 2}, rid="f")
            await _run_to_end(tm, full, _str_out("f", "", [], 0, {"type": "abort", "message": "The request queue is full.", "status_code": 503}))
        finally:
            tm.close()

    asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("Finish: rid=s ") and line.endswith("out='Hello'") for line in lines), lines
    assert any(line.startswith("Finish: rid=f ") and "'status_code': 503" in line for line in lines), lines
    receive = next(line for line in lines if line.startswith("Receive: rid=huge "))
    assert len(receive) < 3_000 and "more characters" in receive


@pytest.fixture()
def slow_tokenizing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request takes 0.3 s to tokenize, as a big one does: a window for aborts and failures."""
    import time

    from minisgl.managers import tokenization

    real = tokenization.tokenize_one_request

    def slow_tokenize(*args: Any) -> Any:
        time.sleep(0.3)
        return real(*args)

    monkeypatch.setattr(tokenization, "tokenize_one_request", slow_tokenize)


@pytest.mark.parametrize("n", [1, 2])
def test_an_abort_while_the_request_is_tokenized_is_not_lost(tiny_model: str, tmp_path: Any, slow_tokenizing: None, n: int) -> None:
    """A big request is tokenized off the event loop; an /abort_request in that window went to
    the scheduler, which did not know the rid yet, and the request then ran to the end (for
    n > 1 the samples were not even registered, so the abort found nothing)."""
    from minisgl.managers.io_struct import AbortReq

    async def run() -> None:
        tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        try:
            stop = ["never " * 5_000]  # > 20,000 characters: tokenized in a worker thread
            obj = GenerateReqInput(text="hi", sampling_params={"max_new_tokens": 8, "n": n, "stop": stop}, rid="big")
            gen = tm.generate_request(obj)
            first = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0.1)  # tokenizing now
            tm.abort_request("big")
            outs = [await asyncio.wait_for(first, 5)] + [out async for out in gen]
            assert len(outs) == n and all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
            assert not [m for m in sent if isinstance(m, (TokenizedGenerateReqInput, AbortReq))]  # nothing ran
            assert tm.rid_to_state == {} and tm.samples_of == {}
        finally:
            tm.close()

    asyncio.run(run())


def test_a_health_probe_answered_with_a_503_leaves_no_unretrieved_task_error(tiny_model: str, tmp_path: Any) -> None:
    """A probe during a full queue or a shutdown ends in a 503 abort: its task's exception was
    never retrieved, and asyncio logged a traceback per probe."""
    import gc

    async def run() -> None:
        tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        errors: List[Any] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))

        def full_queue(msg: Any) -> None:
            sent.append(msg)
            if isinstance(msg, TokenizedGenerateReqInput):
                reason = {"type": "abort", "message": "The request queue is full.", "status_code": 503}
                asyncio.get_running_loop().call_later(0.05, tm._dispatch, _str_out(msg.rid, "", [], 0, reason))

        tm._send_to_scheduler = full_queue  # type: ignore[method-assign]
        try:
            assert await tm.health_generate(timeout=5) is True  # an answer is an answer
            await asyncio.sleep(0.1)
            gc.collect()
            await asyncio.sleep(0)
            assert not tm._health_checks and errors == []
        finally:
            tm.close()

    asyncio.run(run())


def test_a_request_failed_while_tokenized_is_never_sent(tiny_model: str, tmp_path: Any, slow_tokenizing: None) -> None:
    """fail_all_requests (a dead child) while a big request was tokenized off the loop ended it
    here, and then the request was sent anyway, to run unseen."""
    async def run() -> None:
        tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        try:
            obj = GenerateReqInput(text="hi", sampling_params={"max_new_tokens": 8, "stop": ["never " * 5_000]}, stream=True)
            gen = tm.generate_request(obj)
            first = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0.1)  # tokenizing now
            tm.fail_all_requests("The server is shutting down: minisgl-scheduler (exit code -9) died")
            out = await asyncio.wait_for(first, 5)
            assert out["meta_info"]["finish_reason"]["status_code"] == 503
            await asyncio.sleep(0.4)
            assert not [m for m in sent if isinstance(m, TokenizedGenerateReqInput)] and tm.rid_to_state == {}
        finally:
            tm.close()

    asyncio.run(run())


def test_aborts_reach_their_samples_once_and_count_only_real_requests(tiny_model: str, tmp_path: Any) -> None:
    """Four accounting slips around aborts: a refused retry of an n > 1 rid erased the sample
    table (the client's abort then found nothing and both samples ran to the end); a request whose
    client disconnected after tokens were generated was missing from the request metrics; a
    disconnect followed by /abort_request sent two aborts and counted two; a timed-out health
    probe counted as an aborted request."""
    from minisgl.managers.io_struct import AbortReq

    def sample(name: str, tm: TokenizerManager) -> float:
        return tm.metrics.registry.get_sample_value(name, tm.metrics.labels) or 0.0

    async def run() -> None:
        tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        try:
            def sent_rids() -> List[str]:
                return [m.rid for m in sent if isinstance(m, TokenizedGenerateReqInput)]

            job = tm.generate_request(GenerateReqInput(text="a", sampling_params={"max_new_tokens": 9, "n": 2}, rid="job"))
            first = asyncio.ensure_future(job.__anext__())
            while len(sent_rids()) < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(ValueError, match="Duplicate request ID"):
                await tm.generate_request(GenerateReqInput(text="b", sampling_params={"n": 2}, rid="job")).__anext__()
            tm.abort_request("job")
            assert sorted(m.rid for m in sent if isinstance(m, AbortReq)) == ["job-0", "job-1"]
            for j in range(2):
                tm._handle_batch_output(_str_out(f"job-{j}", "", [], 0, {"type": "abort", "message": "Abort"}))
            await asyncio.wait_for(first, 5)
            await job.aclose()
            sent.clear()

            gone = tm.generate_request(GenerateReqInput(text="c", sampling_params={"max_new_tokens": 9}, stream=True, rid="gone"))
            task = asyncio.ensure_future(gone.__anext__())
            while "gone" not in sent_rids():
                await asyncio.sleep(0.01)
            tm._handle_batch_output(_str_out("gone", "x", [5], 1))
            await asyncio.wait_for(task, 5)
            reading = asyncio.ensure_future(gone.__anext__())
            await asyncio.sleep(0.01)
            reading.cancel()  # the client disconnects (its handler is cancelled): the rid is aborted
            await asyncio.sleep(0.01)
            tm.abort_request("gone")  # and an /abort_request for it arrives before the finish
            assert [m.rid for m in sent if isinstance(m, AbortReq)] == ["gone"]
            tm._handle_batch_output(_str_out("gone", "y", [6], 2, {"type": "abort", "message": "Abort"}))
            assert sample("sglang:num_requests_total", tm) == 1 and sample("sglang:generation_tokens_total", tm) == 2
            aborted = sample("sglang:num_aborted_requests_total", tm)

            assert await tm.health_generate(timeout=0.2) is False  # nothing answers: the probe is cancelled
            await asyncio.sleep(0.05)
            assert sample("sglang:num_aborted_requests_total", tm) == aborted  # a probe, not a request
        finally:
            tm.close()

    asyncio.run(run())


def test_a_prompt_too_long_by_its_characters_alone_is_refused_before_tokenizing(
    guarded_client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 10 MB prompt was tokenized into 3.3M tokens only to be refused: 1.7 GB of the HTTP
    process's memory for one request, kept after it."""
    from minisgl.managers import tokenization

    monkeypatch.setattr(tokenization, "tokenize_one_request", lambda *a: pytest.fail("the tokenizer ran"))
    r = guarded_client.post("/v1/completions", json={"model": guarded_client.model, "prompt": "x" * 2_000_000})
    assert r.status_code == 400
    assert re.search(r"\(2000000 characters, so at least \d+ tokens\) is longer than the model's context length", r.json()["error"]["message"])


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"text": ["hi"] * 40, "sampling_params": {"n": 128, "max_new_tokens": 1}}, "fans out into 5120 generations"),
        ({"text": "hi", "sampling_params": {"stop": ["s"] * 65}}, "stop takes at most 64 strings"),
        ({"text": "hi", "sampling_params": {"stop_token_ids": [7] * 1025}}, "stop_token_ids takes at most 1024 ids"),
        ({"text": "hi", "sampling_params": {"stop_regex": ["a"] * 65}}, "stop_regex takes at most 64 patterns"),
        ({"text": "hi", "sampling_params": {"stop_regex": "a" * 200_000}}, "at most 4096 characters in all, got 200000"),
        ({"text": "hi", "sampling_params": {"logit_bias": {str(t): 1 for t in range(1025)}}}, "logit_bias takes at most 1024 token ids"),
    ],
)
def test_one_request_cannot_ask_for_more_than_a_shared_server_gives(guarded_client: TestClient, body: Dict[str, Any], needle: str) -> None:
    """1000 prompts x n=128 stalled /health for 17 s; 100k stop strings slowed every other
    stream 40x; a million stop_token_ids froze the event loop for 28 s."""
    r = guarded_client.post("/generate", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_a_prompt_with_n_samples_is_tokenized_once(tiny_model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sample tokenized the whole prompt again (n = 128: 128 tokenizations of one long
    prompt, still running in worker threads after the first copy's 400 had gone back)."""
    from minisgl.managers import tokenization

    real = tokenization.tokenize_one_request
    calls: List[Any] = []
    monkeypatch.setattr(tokenization, "tokenize_one_request", lambda *a: calls.append(a) or real(*a))

    async def run() -> None:
        tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        try:
            obj = GenerateReqInput(text=["one prompt", "another"], sampling_params={"max_new_tokens": 4, "n": 3, "seed": 7}, rid=["p", "q"])
            gen = tm.generate_request(obj)
            first = asyncio.ensure_future(gen.__anext__())
            while sum(isinstance(m, TokenizedGenerateReqInput) for m in sent) < 6:
                await asyncio.sleep(0.01)
            assert len(calls) == 2  # once per prompt
            reqs = [m for m in sent if isinstance(m, TokenizedGenerateReqInput)]
            assert [r.rid for r in reqs] == ["p-0", "p-1", "p-2", "q-0", "q-1", "q-2"]
            assert [r.sampling_params.seed for r in reqs] == [7, 8, 9, 7, 8, 9]  # seed + j, as before
            assert reqs[0].input_ids == reqs[2].input_ids != reqs[3].input_ids
            first.cancel()
        finally:
            tm.close()

    asyncio.run(run())


# --------------------------------------------------------------------------- /tokenize, /detokenize
@pytest.mark.parametrize("prefix", ["/v1", ""])
def test_tokenize_and_detokenize_round_trip_with_the_servers_tokenizer(client: TestClient, tokenizer: Any, prefix: str) -> None:
    """SGLang's routes: the ids a text prompt of /v1/completions would take, and back."""
    text = "Hello <|im_start|> w\u00f6rld \U0001F642"
    r = client.post(f"{prefix}/tokenize", json={"model": client.model, "prompt": text})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == CONTEXT_LEN
    batch = client.post(f"{prefix}/tokenize", json={"prompt": [text, "a"]}).json()  # (model is optional)
    assert batch["tokens"] == [body["tokens"], tokenizer.encode("a")] and batch["count"] == [len(t) for t in batch["tokens"]]
    back = client.post(f"{prefix}/detokenize", json={"tokens": body["tokens"], "skip_special_tokens": False}).json()
    assert back == {"text": text}
    skipped = client.post(f"{prefix}/detokenize", json={"tokens": [body["tokens"], [5]]}).json()["text"]
    assert skipped == [tokenizer.decode(body["tokens"], skip_special_tokens=True), tokenizer.decode([5])]
    assert "<|im_start|>" not in skipped[0]
    assert client.post(f"{prefix}/tokenize", json={"prompt": []}).json()["tokens"] == []  # (was a 500)
    big = "many words " * 3000  # past TOKENIZE_OFF_LOOP_CHARS: tokenized in a worker thread
    assert client.post(f"{prefix}/tokenize", json={"prompt": big}).json()["tokens"] == tokenizer.encode(big)


@pytest.mark.parametrize(
    "route, body, status, needle",
    [
        ("/v1/tokenize", {"model": "other", "prompt": "a"}, 404, "other"),
        ("/v1/tokenize", {"prompt": "a\ud800"}, 400, "lone surrogate"),
        ("/v1/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/v1/detokenize", {"tokens": [1, 99999]}, 400, "tokens [99999] are outside the vocabulary"),
        ("/v1/detokenize", {"tokens": [[1], [-1]]}, 400, "outside the vocabulary"),
        ("/v1/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/v1/detokenize", {"model": "other", "tokens": [1]}, 404, "other"),
    ],
)
def test_tokenize_routes_refuse_bad_input_by_name(client: TestClient, route: str, body: Dict[str, Any], status: int, needle: str) -> None:
    r = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text


# --------------------------------------------------------------------------- errors name their field
_NAMED_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"tool_choice": "required"}, "tools"),
        ({"tools": [_NAMED_TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),  # (the tiny model's template reads no reasoning_effort)
        ({"chat_template_kwargs": {"nope": 1}}, "chat_template_kwargs"),
        ({"top_k": 0}, "top_k"),  # (SamplingParams.verify's, in the TokenizerManager)
        ({"messages": [{"role": "user", "content": "x" * 10**6}]}, "messages"),  # (the TokenizerManager's context-length check)
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_chat_400s_name_the_field_as_param(tiny_model: str, tmp_path: Any, body: Dict[str, Any], param: str, stream: bool) -> None:
    """Chat's errors carry the field they are about (OpenAI's `param`), from precheck, the
    conversion and the TokenizerManager's own checks (run here for real)."""
    tm = _make_tm(tiny_model, tmp_path)

    async def checked(obj: Any, request: Any = None) -> Any:
        SamplingParams.from_dict(obj.sampling_params).verify()  # (as _validate_request_shape does)
        await tm._tokenize_one_request(obj)
        yield _out("r", "x", 1, {"type": "length", "length": 1})

    tm.generate_request = checked  # type: ignore[method-assign]
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as client:
        client.model = tm.model_name  # type: ignore[attr-defined]
        r = _chat(client, stream=stream, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_chat_stream_refused_for_its_grammar_names_response_format(tiny_model: str, tmp_path: Any) -> None:
    refused = {"type": "abort", "status_code": 400, "message": "Invalid json_schema: bad", "param": "json_schema"}
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "", 0, refused)])
    with client:
        r = _chat(client, stream=True, response_format={"type": "json_object"})
    first = json.loads(r.text.split("\n\n")[0][len("data: ") :])
    assert first["error"]["param"] == "response_format" and first["error"]["message"] == "Invalid json_schema: bad"


def _checked_client(tiny_model: str, tmp_path: Any) -> TestClient:
    """An app whose TokenizerManager runs its own checks for real (verify, the prompt's length, the
    context gate) and answers a request that passes them with one token."""
    tm = _make_tm(tiny_model, tmp_path)

    async def checked(obj: Any, request: Any = None) -> Any:
        obj.normalize_batch_and_arguments()  # (as generate_request does first: a token-id prompt is one request)
        SamplingParams.from_dict(obj.sampling_params).verify()  # (as _validate_request_shape does)
        await tm._tokenize_one_request(obj)
        yield _out("r", "x", 1, {"type": "length", "length": 1})

    tm.generate_request = checked  # type: ignore[method-assign]
    client = TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True))
    client.model = tm.model_name  # type: ignore[attr-defined]
    return client


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x" * 10**6}, "prompt"),  # (past the characters any context holds: the TokenizerManager's first check)
        ({"prompt": [1] * (CONTEXT_LEN + 8)}, "prompt"),  # (token ids past the context: the gate)
        ({"prompt": "a", "max_tokens": 10**6}, "max_tokens"),  # (a budget no prompt fits beside: the budget's fault)
        ({"prompt": "a", "max_tokens": CONTEXT_LEN}, "max_tokens"),
        ({"prompt": [1] * 20, "max_tokens": CONTEXT_LEN - 10}, "prompt"),  # (each fits alone, not both: OpenAI's param, the prompt)
        ({"prompt": "a", "top_k": 0}, "top_k"),
        ({"prompt": "a", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_completions_400s_name_the_field_as_param(tiny_model: str, tmp_path: Any, body: Dict[str, Any], param: str, stream: bool) -> None:
    """/v1/completions names the field of the engine's errors by its own names (route_param:
    text/input_ids -> prompt, max_new_tokens -> max_tokens), streamed or not."""
    with _checked_client(tiny_model, tmp_path) as client:
        r = client.post("/v1/completions", json={"model": client.model, "stream": stream, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_chat_budget_past_the_context_names_the_field_the_client_sent(tiny_model: str, tmp_path: Any) -> None:
    """With --allow-auto-truncate off the chat precheck refuses it first; the TokenizerManager's gate
    names the same field for a budget that fills the context (max_completion_tokens wins)."""
    with _checked_client(tiny_model, tmp_path) as client:
        for field in ("max_tokens", "max_completion_tokens"):
            r = _chat(client, **{field: CONTEXT_LEN})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def _refusing_client(tiny_model: str, tmp_path: Any, reason: Dict[str, Any]) -> TestClient:
    """An app whose TokenizerManager refuses every request as its non-streaming path does a
    scheduler's abort with a status (ReqAbortedError, carrying the reason's param)."""
    tm = _make_tm(tiny_model, tmp_path)

    async def refuse(obj: Any, request: Any = None) -> Any:
        raise ReqAbortedError(reason["message"], reason["status_code"], reason.get("param"))
        yield  # (a generator, as generate_request)

    tm.generate_request = refuse  # type: ignore[method-assign]
    client = TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True))
    client.model = tm.model_name  # type: ignore[attr-defined]
    return client


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),  # (its grammar is a json_schema)
        ({"json_schema": '{"type": "object"}'}, "json_schema"),  # (SGLang's own field: named as it is)
        ({"regex": "a+"}, "regex"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_refused_for_its_grammar_names_the_field_it_came_from(tiny_model: str, tmp_path: Any, body: Dict[str, Any], param: str,
                                                                          stream: bool) -> None:  # fmt: skip
    """A scheduler's grammar abort names the grammar's key (json_schema); /v1/completions says which
    of its own fields built it, as chat does."""
    key = "json_schema" if param == "response_format" else param
    refused = {"type": "abort", "status_code": 400, "message": "Invalid grammar: bad", "param": key, "err_type": "BadRequestError"}
    client = _scripted_client(tiny_model, tmp_path, [_out("r", "", 0, refused)])[0] if stream else _refusing_client(tiny_model, tmp_path, refused)
    with client:
        r = client.post("/v1/completions", json={"model": client.model, "prompt": "a", "stream": stream, **body})
    error = json.loads(r.text.split("\n\n")[0][len("data: ") :])["error"] if stream else r.json()["error"]
    assert error["param"] == param and error["message"] == "Invalid grammar: bad", r.text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": "x" * 10**6}, "text"),
        ({"input_ids": [1] * (CONTEXT_LEN + 8)}, "input_ids"),
        ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 10**6}}, "max_new_tokens"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_generate_400s_name_the_field_by_its_own_names(tiny_model: str, tmp_path: Any, body: Dict[str, Any], param: str, stream: bool) -> None:
    """/generate's 400 bodies carry `param` too (minisgl's: SGLang's is null), by /generate's names."""
    with _checked_client(tiny_model, tmp_path) as client:
        r = client.post("/generate", json={"stream": stream, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_generate_refused_for_its_grammar_names_its_key_in_the_body_and_in_the_stream(tiny_model: str, tmp_path: Any) -> None:
    """The abort's `param` (minisgl's key of SGLang's finish_reason) reaches /generate's 400 body, and a
    /generate stream passes the finish_reason on whole, param included."""
    refused = {"type": "abort", "status_code": 400, "message": "Invalid regex: bad", "param": "regex", "err_type": "BadRequestError"}
    with _refusing_client(tiny_model, tmp_path, refused) as client:
        r = client.post("/generate", json={"text": "a", "sampling_params": {"regex": "["}})
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "", 0, refused)])
    with client:
        streamed = client.post("/generate", json={"text": "a", "sampling_params": {"regex": "["}, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex", r.text
    chunk = json.loads(streamed.text.split("\n\n")[0][len("data: ") :])
    assert chunk["meta_info"]["finish_reason"] == refused, streamed.text
