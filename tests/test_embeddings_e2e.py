"""End-to-end embeddings: `python -m minisgl serve --is-embedding` as real processes, driven by
the official openai client (one server for the module; starts cost seconds).

The oracle is transformers on the same tiny random model (the final-norm hidden state at the
last prompt token, L2-normalised). The server chunks prompts longer than 16 tokens, so the
long inputs here also cross the chunked path through the real processes.
"""

from __future__ import annotations

import base64
from typing import Any, Iterator, List

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from test_server_e2e import Server  # (the e2e tests' server process, its log and readiness wait)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the bank of the river",
    "Hello",
    "def main(): return 42",
]


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tiny_model, str(tmp_path_factory.mktemp("srv") / "embed.log"), "--is-embedding", "--chunked-prefill-size", "16")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf(tiny_model: str) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model)
    return model, tokenizer


def reference(hf: Any, text: str) -> np.ndarray:
    model, tokenizer = hf
    ids = tokenizer(text)["input_ids"]
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    return F.normalize(hidden, dim=-1).numpy()


def flush(server: Server) -> None:
    """Empty the radix cache: the next request computes its whole prompt, in the same passes as
    the last one did, so its floats are the same bits (a prefix hit computes the last token in a
    pass of another shape: the same vector up to float32 rounding, ~1e-7)."""
    assert httpx.post(server.url + "/flush_cache", timeout=60).status_code == 200


def test_float_and_base64_decode_to_the_same_vector_as_transformers(client: openai.OpenAI, server: Server, hf: Any) -> None:
    flush(server)
    as_floats = client.embeddings.create(model=server.model, input=TEXTS[0], encoding_format="float")
    flush(server)
    # no format named: the client asks for base64 and decodes it (the openai SDK's default)
    decoded = client.embeddings.create(model=server.model, input=TEXTS[0])
    flush(server)
    raw = httpx.post(server.url + "/v1/embeddings", json={"model": server.model, "input": TEXTS[0], "encoding_format": "base64"}, timeout=60)
    from_bytes = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    vector = np.array(as_floats.data[0].embedding, dtype=np.float32)
    assert np.array_equal(np.array(decoded.data[0].embedding, dtype=np.float32), vector)
    assert np.array_equal(from_bytes, vector)
    assert vector.shape == (64,)
    np.testing.assert_allclose(vector, reference(hf, TEXTS[0]), atol=1e-5)
    assert as_floats.object == "list" and as_floats.data[0].object == "embedding" and as_floats.data[0].index == 0


def test_a_batch_keeps_its_order_and_counts_usage(client: openai.OpenAI, server: Server, hf: Any) -> None:
    r = client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2]
    for text, d in zip(TEXTS, r.data):
        np.testing.assert_allclose(np.array(d.embedding), reference(hf, text), atol=1e-5)
    tokens = [len(hf[1](t)["input_ids"]) for t in TEXTS]
    assert tokens[0] > 16  # (the premise: the first input is chunked)
    assert r.usage.prompt_tokens == sum(tokens) and r.usage.total_tokens == sum(tokens)
    ids: List[List[int]] = [hf[1](t)["input_ids"] for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model=server.model, input=ids, encoding_format="float")
    for a, b in zip(by_ids.data, r.data[:2]):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)


def test_the_400s_reach_the_client_as_bad_request_errors(client: openai.OpenAI, server: Server) -> None:
    cases = [
        (lambda: client.embeddings.create(model=server.model, input=""), "Input cannot be empty"),
        (lambda: client.embeddings.create(model=server.model, input=["a", ""]), "Input at index 1 cannot be empty"),
        (lambda: client.embeddings.create(model=server.model, input="hi", dimensions=8), "does not support matryoshka"),
        (lambda: client.embeddings.create(model=server.model, input="word " * 3000), "longer than"),
        (lambda: client.embeddings.create(model=server.model, input="hi", extra_body={"pooling": "mean"}), "Unsupported parameter 'pooling'"),
        (lambda: client.completions.create(model=server.model, prompt="hi", max_tokens=2), "--is-embedding"),
        (lambda: client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}]), "--is-embedding"),
    ]
    for call, message in cases:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert message in info.value.message, info.value.message
    r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"]


def test_native_encode_health_and_model_info(server: Server, hf: Any) -> None:
    one = httpx.post(server.url + "/encode", json={"text": TEXTS[1]}, timeout=60).json()
    np.testing.assert_allclose(one["embedding"], reference(hf, TEXTS[1]), atol=1e-5)
    assert one["meta_info"]["prompt_tokens"] == len(hf[1](TEXTS[1])["input_ids"])
    both = httpx.post(server.url + "/encode", json={"text": TEXTS[1:]}, timeout=60).json()
    assert [len(o["embedding"]) for o in both] == [64, 64]
    np.testing.assert_allclose(both[1]["embedding"], reference(hf, TEXTS[2]), atol=1e-5)
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert httpx.get(server.url + "/get_model_info", timeout=60).json()["is_generation"] is False
    load = httpx.get(server.url + "/get_load", timeout=60).json()
    assert load["num_running_reqs"] == 0 and load["protected_tokens"] == 0  # nothing left running or locked
