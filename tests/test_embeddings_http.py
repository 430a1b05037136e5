"""/v1/embeddings and /encode in process: the OpenAI layer and the TokenizerManager over a
stand-in scheduler.

The app runs under FastAPI's TestClient with a real TokenizerManager whose sends go to a
stand-in: an embedding request is answered with a BatchEmbeddingOutput built from its ids
(later inputs of a batch answered first), any generation request fails the test. So these
check what the HTTP side owns (input checks, the two server kinds, answer order, usage,
base64) in milliseconds; tests/test_embeddings_e2e.py runs the real processes.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any, Iterator, List, Optional, Tuple

import pytest
from fastapi.testclient import TestClient

from minisgl.entrypoints.http_server import create_app
from minisgl.managers.io_struct import BatchEmbeddingOutput, TokenizedEmbeddingReqInput, TokenizedGenerateReqInput
from minisgl.managers.tokenizer_manager import TokenizerManager
from minisgl.server_args import PortArgs, ServerArgs, resolve_server_args
from minisgl.utils import get_tokenizer

CONTEXT_LEN = 64
HIDDEN = 64


def fake_embedding(ids: List[int], dimensions: Optional[int]) -> List[float]:
    """What the stand-in scheduler answers: values a float32 holds exactly, telling inputs apart."""
    return [len(ids) * 0.25, float(ids[0]), -0.5, 0.1][:dimensions]


def _tm(model: str, tmp_path: Any, answer: Any = None, **overrides: Any) -> Tuple[TokenizerManager, List[Any]]:
    """A TokenizerManager (embedding server unless is_embedding=False) whose scheduler is a stand-in.
    `answer(msg, i)` -> (finish_reason, embedding) overrides the normal answer."""
    matryoshka = overrides.pop("matryoshka_dimensions", None)
    args = resolve_server_args(ServerArgs(model_path=model, device="cpu", **{"is_embedding": True, **overrides}))
    tokenizer = get_tokenizer(model)
    tm = TokenizerManager(
        args, PortArgs.init_new(str(tmp_path)), tokenizer, CONTEXT_LEN, len(tokenizer), hidden_size=HIDDEN,
        is_matryoshka=matryoshka is not None, matryoshka_dimensions=matryoshka,
    )  # fmt: skip
    sent: List[Any] = []

    def send(msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            raise RuntimeError(f"generation request rid={msg.rid} reached the scheduler")
        sent.append(msg)
        if not isinstance(msg, TokenizedEmbeddingReqInput):
            return
        finish, embedding = ({"type": "length", "length": 0}, fake_embedding(msg.input_ids, msg.dimensions))
        if answer is not None:
            finish, embedding = answer(msg, len(sent))
        out = BatchEmbeddingOutput(
            rids=[msg.rid], finished_reasons=[finish], embeddings=[embedding], prompt_tokens=[len(msg.input_ids)],
            cached_tokens=[0],
        )  # fmt: skip
        # the later a request was sent, the sooner it is answered: a batch comes back out of order
        asyncio.get_running_loop().call_later(max(0.05 - 0.01 * len(sent), 0), tm._dispatch, out)

    tm._send_to_scheduler = send  # type: ignore[method-assign]
    return tm, sent


def _client(tm: TokenizerManager) -> Iterator[TestClient]:
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as c:
        yield c
    tm.close()


@pytest.fixture()
def served(tiny_model: str, tmp_path: Any) -> Iterator[Tuple[TestClient, List[Any], TokenizerManager]]:
    tm, sent = _tm(tiny_model, tmp_path)
    for c in _client(tm):
        yield c, sent, tm


def _embed(c: TestClient, tm: TokenizerManager, **body: Any) -> Any:
    return c.post("/v1/embeddings", json={"model": tm.model_name, **body})


# --------------------------------------------------------------------------- answers
def test_a_batch_is_answered_in_input_order_with_usage(served: Any) -> None:
    c, sent, tm = served
    texts = ["one", "two words here", "and a third, longer input"]
    r = _embed(c, tm, input=texts)
    assert r.status_code == 200, r.text
    body = r.json()
    lengths = [len(tm.tokenizer.encode(t)) for t in texts]
    assert body["object"] == "list" and body["model"] == tm.model_name
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and all(d["object"] == "embedding" for d in body["data"])
    # the stand-in answered the last input first: each answer is still at its input's place
    assert [d["embedding"][0] for d in body["data"]] == [n * 0.25 for n in lengths]
    assert body["usage"] == {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}
    assert [len(m.input_ids) for m in sent] == lengths and all(m.sampling_params.max_new_tokens == 0 for m in sent)


def test_dynamic_batch_tokenizer_metrics_and_the_user_log_line(tiny_model: str, tmp_path: Any, caplog: Any) -> None:
    """Texts tokenized together (--enable-dynamic-batch-tokenizer) still each get their own
    answer; a served embedding counts in /metrics' request counters (no generation tokens);
    `user` goes to the request log with --log-requests."""
    tm, sent = _tm(tiny_model, tmp_path, enable_dynamic_batch_tokenizer=True, log_requests=True)
    for c in _client(tm):
        with caplog.at_level("INFO", logger="minisgl.serving"):
            r = _embed(c, tm, input=["alpha beta", "gamma"], user="alice")
        assert r.status_code == 200, r.text
        assert [len(m.input_ids) for m in sent] == [len(tm.tokenizer.encode(t)) for t in ("alpha beta", "gamma")]
        assert list(tm.dynamic_batch_tokenizer.batch_sizes) == [2]
        assert "user='alice'" in caplog.text
        value = lambda name: tm.metrics.registry.get_sample_value(name, tm.metrics.labels)  # noqa: E731
        assert value("sglang:num_requests_total") == 2
        assert value("sglang:prompt_tokens_total") == sum(len(m.input_ids) for m in sent)
        assert value("sglang:generation_tokens_total") == 0


def test_base64_is_the_little_endian_float32_bytes_of_the_floats(served: Any) -> None:
    c, _, tm = served
    floats = _embed(c, tm, input="hello there").json()["data"][0]["embedding"]
    encoded = _embed(c, tm, input="hello there", encoding_format="base64").json()["data"][0]["embedding"]
    assert isinstance(encoded, str)
    raw = base64.b64decode(encoded)
    assert len(raw) == 4 * len(floats)
    decoded = list(struct.unpack(f"<{len(floats)}f", raw))
    # 0.1 is not a float32: the bytes carry float32(0.1), as OpenAI's do; the rest exactly
    assert decoded == [struct.unpack("<f", struct.pack("<f", x))[0] for x in floats]
    assert decoded[:3] == floats[:3]


def test_token_id_inputs_single_and_batch(served: Any) -> None:
    c, sent, tm = served
    r = _embed(c, tm, input=[5, 6, 7])
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    assert r.json()["data"][0]["embedding"][:2] == [0.75, 5.0]
    r = _embed(c, tm, input=[[9, 8], [4]])
    assert [d["embedding"][:2] for d in r.json()["data"]] == [[0.5, 9.0], [0.25, 4.0]]
    assert [m.input_ids for m in sent] == [[5, 6, 7], [9, 8], [4]]


def test_native_encode_answers_sglang_s_shape(served: Any) -> None:
    c, _, tm = served
    one = c.post("/encode", json={"text": "hi there", "rid": "enc-1"}).json()
    assert set(one) == {"embedding", "meta_info"} and one["meta_info"]["id"] == "enc-1"
    assert one["meta_info"]["prompt_tokens"] == len(tm.tokenizer.encode("hi there"))
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    batch = c.post("/encode", json={"input_ids": [[3, 4], [5]]}).json()
    assert isinstance(batch, list) and [o["embedding"][1] for o in batch] == [3.0, 5.0]
    r = c.post("/encode", json={"text": "hi", "input_ids": [1]})
    assert r.status_code == 400 and "Exactly one of `text` and `input_ids`" in r.json()["error"]["message"]


def test_dimensions_on_a_matryoshka_model(tiny_model: str, tmp_path: Any) -> None:
    tm, sent = _tm(tiny_model, tmp_path, matryoshka_dimensions=(2, 3))
    for c in _client(tm):
        r = _embed(c, tm, input="hi", dimensions=2)
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 2
        assert sent[-1].dimensions == 2
        for bad, message in ((5, "only supports [2, 3] matryoshka dimensions"), (0, "greater than 0")):
            r = _embed(c, tm, input="hi", dimensions=bad)
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert len(sent) == 1


# --------------------------------------------------------------------------- 400s (nothing reaches the scheduler)
@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"input": ""}, 400, "Input cannot be empty"),
        ({"input": "   "}, 400, "Input cannot be empty or whitespace only"),
        ({"input": []}, 400, "Input cannot be empty"),
        ({"input": ["a", " "]}, 400, "Input at index 1 cannot be empty or whitespace only"),
        ({"input": [[1, 2], []]}, 400, "Input at index 1 cannot be empty"),
        ({"input": ["a", 1]}, 400, "Invalid parameter 'input"),
        ({"input": "hi", "encoding_format": "hex"}, 400, "encoding_format"),
        ({"input": "hi", "temperature": 0}, 400, "Unsupported parameter 'temperature'"),
        ({"input": "hi", "dimensions": 8}, 400, "does not support matryoshka representation"),
        ({"input": [[1], [10**6]]}, 400, "outside the vocabulary"),
        ({"input": "word " * 200}, 400, "is longer than the model's context length (64 tokens)"),
        ({"input": "hi", "model": "other"}, 404, "The model `other` does not exist"),
        ({"input": ["a"] * 2049}, 400, "At most 2048 inputs per request (OpenAI's limit), got 2049"),
        ({"input": [[1]] * 2049}, 400, "At most 2048 inputs per request"),
    ],
    ids=["empty", "blank", "empty-list", "blank-item", "empty-ids", "mixed", "format", "unknown-field", "dimensions",
         "vocab", "too-long", "model", "too-many-texts", "too-many-id-lists"],  # fmt: skip
)
def test_bad_requests_are_clear_errors(served: Any, body: Any, status: int, message: str) -> None:
    c, sent, tm = served
    r = c.post("/v1/embeddings", json={"model": tm.model_name, **body})
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == status
    assert sent == []  # (a batch with one bad input sends none of it)


def test_an_embedding_server_refuses_the_generation_routes(served: Any) -> None:
    c, _, tm = served
    chat = {"model": tm.model_name, "messages": [{"role": "user", "content": "hi"}]}
    for route, body in (
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/completions", {"model": tm.model_name, "prompt": "hi"}),
        ("/generate", {"text": "hi"}),
        ("/generate", {"text": "hi", "stream": True}),
    ):
        r = c.post(route, json=body)
        assert r.status_code == 400, (route, r.text)
        assert "embedding server (started with --is-embedding)" in r.json()["error"]["message"]
    assert c.get("/get_model_info").json()["is_generation"] is False


def test_a_generation_server_refuses_embeddings(tiny_model: str, tmp_path: Any) -> None:
    tm, sent = _tm(tiny_model, tmp_path, is_embedding=False)
    for c in _client(tm):
        for r in (_embed(c, tm, input="hi"), c.post("/encode", json={"text": "hi"})):
            assert r.status_code == 400
            assert r.json()["error"]["message"] == (
                "This model does not appear to be an embedding model by default. Please add `--is-embedding` when "
                "launching the server or try another model."
            )
        assert c.get("/get_model_info").json()["is_generation"] is True
    assert sent == []


def test_an_embedding_that_ends_without_one_is_an_error(tiny_model: str, tmp_path: Any) -> None:
    """An abort (a full queue's 503; /abort_request's, no status) has no embedding: an error, never
    a 200 with a null vector nor a 500."""

    def answer(msg: Any, i: int) -> Any:
        if i == 1:
            return {"type": "abort", "message": "The request queue is full.", "status_code": 503}, None
        return {"type": "abort", "message": "Aborted", "status_code": None}, None

    tm, _ = _tm(tiny_model, tmp_path, answer=answer)
    for c in _client(tm):
        r = _embed(c, tm, input="hi")
        assert r.status_code == 503 and r.json()["error"]["message"] == "The request queue is full."
        r = _embed(c, tm, input="hi")
        assert r.status_code == 400 and "The embedding of input 0 was not computed: Aborted" in r.json()["error"]["message"]


def test_health_generate_probes_with_an_embedding(tiny_model: str, tmp_path: Any) -> None:
    tm, sent = _tm(tiny_model, tmp_path)

    async def run() -> bool:
        return await tm.health_generate(timeout=5)

    assert asyncio.run(run()) is True
    assert [type(m) for m in sent] == [TokenizedEmbeddingReqInput] and sent[0].input_ids == [0]
    assert tm.rid_to_state == {}
    tm.close()
