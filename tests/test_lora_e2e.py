"""End-to-end multi-LoRA: `python -m minisgl serve --lora-paths a=... b=...` as real processes, /generate
with httpx and the OpenAI routes with the official openai client. The oracle is PEFT's greedy
continuation on the same tiny model and adapters (tests/test_lora.py's helpers)."""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import httpx
import openai
import pytest

from test_lora import make_adapter, peft_greedy
from test_server_e2e import Server  # (the e2e tests' server process, its log and readiness wait)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = [5, 17, 42, 99, 7, 300, 12]


@pytest.fixture(scope="module")
def served(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[Server, Dict[str, str]]]:
    root = tmp_path_factory.mktemp("lora-e2e")
    adapters = {"a": make_adapter(tiny_model, str(root / "a"), seed=1), "b": make_adapter(tiny_model, str(root / "b"), seed=2)}
    s = Server(tiny_model, str(root / "server.log"), "--lora-paths", *(f"{n}={p}" for n, p in adapters.items()))
    yield s, adapters
    s.stop()


def _generate(server: Server, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=120)


def test_generate_and_completions_run_the_named_adapter(served: Any, tiny_model: str) -> None:
    server, adapters = served
    want = {name: peft_greedy(tiny_model, path, PROMPT, 6)[0] for name, path in adapters.items()}
    base = _generate(server, input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 6}).json()
    assert base["output_ids"] not in want.values()
    texts = {}
    for name in adapters:
        r = _generate(server, input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 6}, lora_path=name)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want[name]
        texts[name] = r.json()["text"]
    # a batch with one adapter per prompt
    r = _generate(server, input_ids=[PROMPT, PROMPT], sampling_params={**GREEDY, "max_new_tokens": 6}, lora_path=["b", None])
    assert [o["output_ids"] for o in r.json()] == [want["b"], base["output_ids"]]

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    out = client.completions.create(model=f"{tiny_model}:a", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == texts["a"]
    assert out.model == f"{tiny_model}:a"  # (SGLang answers with the model as the client sent it)
    out = client.completions.create(model=tiny_model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "lora_path": "b"})
    assert out.choices[0].text == texts["b"]
    # the model's adapter wins over the lora_path field (SGLang's precedence)
    out = client.completions.create(model="default:a", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "lora_path": "b"})
    assert out.choices[0].text == texts["a"]
    chat = client.chat.completions.create(model=f"{tiny_model}:a", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    assert chat.model == f"{tiny_model}:a" and chat.choices[0].message.content is not None


def test_unknown_adapters_are_400s_listing_the_loaded_ones(served: Any, tiny_model: str) -> None:
    server, _ = served
    r = _generate(server, input_ids=PROMPT, sampling_params={"max_new_tokens": 2}, lora_path="zzz")
    assert r.status_code == 400 and "the loaded adapters are: a, b" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": f"{tiny_model}:zzz", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and "LoRA adapter 'zzz' is not loaded; the loaded adapters are: a, b" in err["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": "other:a", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 404  # (the base model must be this server's)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # bad requests hurt nobody


def test_cache_salt_and_extra_key_keep_tenants_apart_over_http(served: Any, tiny_model: str) -> None:
    """The tenant-visible effect of a salt: cached_tokens (usage.prompt_tokens_details on the OpenAI
    routes, meta_info on /generate) counts only K/V of requests with the same salt and adapter."""
    server, _ = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    prompt = list(range(400, 430))

    def completion(**extra: Any) -> int:
        out = client.completions.create(model=tiny_model, prompt=prompt, max_tokens=1, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    assert completion(cache_salt="t1") == 0
    assert completion(cache_salt="t2") == 0 and completion() == 0  # other tenant, no tenant: nothing reused
    assert completion(cache_salt="t1") == len(prompt) - 1
    assert completion(cache_salt="t", extra_key="1") == len(prompt) - 1  # SGLang's key: cache_salt + extra_key
    assert completion(cache_salt="t1", lora_path="a") == 0  # the salt under an adapter: its own namespace
    gen = _generate(server, input_ids=[prompt, prompt], sampling_params={"max_new_tokens": 1}, extra_key=["t1", "t9"])
    assert [o["meta_info"]["cached_tokens"] for o in gen.json()] == [len(prompt) - 1, 0]
    chat = [{"role": "user", "content": "tell me about salt"}]
    first = client.chat.completions.create(model=tiny_model, messages=chat, max_tokens=1, extra_body={"cache_salt": "c"})
    other = client.chat.completions.create(model=tiny_model, messages=chat, max_tokens=1, extra_body={"cache_salt": "d"})
    again = client.chat.completions.create(model=tiny_model, messages=chat, max_tokens=1, extra_body={"cache_salt": "c"})
    assert first.usage.prompt_tokens_details.cached_tokens == other.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_bad_salts_and_keys_are_400s(served: Any, tiny_model: str) -> None:
    server, _ = served
    for route, field, body in (
        ("/v1/completions", "cache_salt", {"model": tiny_model, "prompt": "hi", "max_tokens": 1, "cache_salt": 5}),
        ("/v1/chat/completions", "extra_key", {"model": tiny_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "extra_key": ["a"]}),
        ("/generate", "extra_key", {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "extra_key": 5}),
    ):  # fmt: skip
        r = httpx.post(server.url + route, json=body, timeout=60)
        assert r.status_code == 400, (route, r.text)
        err = r.json()["error"]
        assert err["param"].split(".")[0] == field and "Input should be a valid string" in err["message"], r.text
    r = _generate(server, text=["a", "b"], sampling_params={"max_new_tokens": 1}, extra_key=["x"])
    assert r.status_code == 400 and "`extra_key` must have 2 entries for a batch of 2 prompts" in r.json()["error"]["message"]
    r = _generate(server, text="a", sampling_params={"max_new_tokens": 1}, extra_key=["x"])
    assert r.status_code == 400 and "lists are per prompt of a batch" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
