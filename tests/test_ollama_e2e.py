"""End-to-end: the Ollama API of a real `python -m minisgl serve`, driven by the official `ollama`
Python client (`ollama.Client(host=...)`). One server for the module (test_server_e2e's Server),
with --api-key (the client sends it as `Authorization: Bearer`)."""

from __future__ import annotations

from typing import Iterator

import httpx
import ollama
import openai
import pytest

from test_server_e2e import Server, _metric, wait_until_freed

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "sekret"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("srv")
    s = Server(tiny_model, str(folder / "server.log"), "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"authorization": f"Bearer {KEY}"}, timeout=120)


def _user(text: str) -> list:
    return [{"role": "user", "content": text}]


def _chat_completion(server: Server, **kwargs: object) -> openai.types.chat.ChatCompletion:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=server.model, messages=_user(PROMPT), temperature=0, **kwargs)  # fmt: skip


def test_chat_says_what_chat_completions_says_for_the_same_greedy_prompt(server: Server, client: ollama.Client) -> None:
    expected = _chat_completion(server, max_tokens=8)
    answer = client.chat(model=server.model, messages=_user(PROMPT), options={"temperature": 0, "num_predict": 8})
    assert answer.message.role == "assistant" and answer.message.content == expected.choices[0].message.content
    assert (answer.prompt_eval_count, answer.eval_count) == (expected.usage.prompt_tokens, expected.usage.completion_tokens)
    assert answer.done and answer.done_reason == ("length" if expected.choices[0].finish_reason == "length" else "stop")
    assert 0 < answer.prompt_eval_duration + answer.eval_duration <= answer.total_duration < 120 * 10**9 and answer.load_duration == 0


def test_a_streamed_chat_adds_up_to_the_whole_one(server: Server, client: ollama.Client) -> None:
    whole = client.chat(model=server.model, messages=_user(PROMPT), options={"temperature": 0, "num_predict": 8})
    chunks = list(client.chat(model=server.model, messages=_user(PROMPT), options={"temperature": 0, "num_predict": 8}, stream=True))
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True] and len(chunks) > 2
    assert "".join(c.message.content or "" for c in chunks) == whole.message.content
    assert (chunks[-1].eval_count, chunks[-1].done_reason) == (whole.eval_count, whole.done_reason) and chunks[-1].eval_duration > 0


def test_generate_says_what_chat_completions_says(server: Server, client: ollama.Client) -> None:
    expected = _chat_completion(server, max_tokens=6)
    answer = client.generate(model=server.model, prompt=PROMPT, options={"temperature": 0, "num_predict": 6})
    assert answer.response == expected.choices[0].message.content and answer.eval_count == expected.usage.completion_tokens
    streamed = list(client.generate(model=server.model, prompt=PROMPT, options={"temperature": 0, "num_predict": 6}, stream=True))
    assert "".join(c.response or "" for c in streamed) == answer.response and streamed[-1].done
    raw = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).completions.create(
        model=server.model, prompt=PROMPT, max_tokens=6, temperature=0)  # fmt: skip
    assert client.generate(model=server.model, prompt=PROMPT, raw=True, options={"temperature": 0, "num_predict": 6}).response == raw.choices[0].text


def test_list_show_ps_and_version(server: Server, client: ollama.Client) -> None:
    (model,) = client.list().models
    assert model.model == server.model and model.size and model.details.family == "qwen3"
    shown = client.show(server.model)
    assert shown.capabilities == ["completion"] and shown.modelinfo["qwen3.context_length"] > 0 and shown.details == model.details
    assert client.ps().models[0].model == server.model
    assert httpx.get(server.url + "/api/version", headers={"authorization": f"Bearer {KEY}"}).json()["version"]
    assert httpx.head(server.url + "/").status_code == 200  # (the CLI's probe, no key)


def test_errors_are_ollamas(server: Server, client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3.2", messages=_user("x"))
    assert e.value.status_code == 404 and "model 'llama3.2' not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=server.model, messages=_user("x"), options={"num_gpu": 1})
    assert e.value.status_code == 400 and "num_gpu" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server.url).list()
    assert e.value.status_code == 401
    # bad input hurts no one else: the next request is answered
    assert client.chat(model=server.model, messages=_user("x"), options={"num_predict": 1}).eval_count == 1


def test_a_client_that_hangs_up_aborts_its_chat(server: Server) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    aborted_before = _metric(server, "sglang:num_aborted_requests_total", headers)
    body = {"model": server.model, "messages": _user(PROMPT), "options": {"num_predict": 1500}}
    with httpx.stream("POST", server.url + "/api/chat", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"done":false' in line:
                break  # got a token: hang up mid-stream
    load = wait_until_freed(server, headers=headers)
    assert load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0
    # (freed is not enough: an answer that ran to its end frees too; the hang-up aborted it)
    assert _metric(server, "sglang:num_aborted_requests_total", headers) == aborted_before + 1
