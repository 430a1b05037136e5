"""End-to-end return_hidden_states: `python -m minisgl serve --enable-return-hidden-states` as
real processes (one server for the module), /generate with httpx and the OpenAI routes with the
official openai client.

The oracle is transformers on the same tiny random model (output_hidden_states[-1], the
final-norm rows of the prompt and the generated tokens). The server chunks prompts longer than
16 tokens, so the long prompt crosses the chunked path through the real processes. The hidden
states cross two process boundaries as JSON (scheduler -> detokenizer -> HTTP process) and then
the HTTP response: every number the client reads is still exactly a float32 (a value cut short
in a decimal on the way would not be).
"""

from __future__ import annotations

import json
from typing import Any, Iterator, List

import httpx
import numpy as np
import openai
import pytest
import torch

from test_server_e2e import Server  # (the e2e tests' server process, its log and readiness wait)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GREEDY = {"temperature": 0, "ignore_eos": True}
ATOL = 1e-5


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("srv") / "hidden.log")
    # no radix cache: a prompt sent twice computes its whole prompt both times (a hit shortens the
    # prompt's entry, which tests/test_hidden_states.py covers), so the answers compare whole
    s = Server(tiny_model, log, "--enable-return-hidden-states", "--chunked-prefill-size", "16", "--disable-radix-cache")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(tiny_model: str) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(tiny_model)


def hf_rows(hf: Any, ids: List[int]) -> np.ndarray:
    with torch.no_grad():
        return hf[0](torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].numpy()


def assert_float32_exact(values: List[float]) -> None:
    array = np.asarray(values, dtype=np.float64)
    assert np.array_equal(array.astype(np.float32).astype(np.float64), array), "a value is not a float32 any more"


def generate(server: Server, **body: Any) -> Any:
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_equals_transformers_through_chunks_and_decode_steps(server: Server, hf: Any) -> None:
    prompt = list(range(100, 137))  # 37 tokens: 3 chunks of at most 16
    out = generate(server, input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 5}, return_hidden_states=True)
    hidden = out["meta_info"]["hidden_states"]
    assert len(hidden) == 5 and len(hidden[0]) == len(prompt)
    rows = hidden[0] + hidden[1:]
    assert_float32_exact([v for row in rows for v in row])
    ref = hf_rows(hf, prompt + out["output_ids"][:-1])
    np.testing.assert_allclose(np.asarray(rows), ref, atol=ATOL)
    # a cumulative stream (the server's default): its last chunk is the same answer
    r = httpx.post(server.url + "/generate", json={"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 5},
                                                   "return_hidden_states": True, "stream": True}, timeout=120)  # fmt: skip
    chunks = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
    assert chunks[-1]["meta_info"]["hidden_states"] == hidden and chunks[-1]["output_ids"] == out["output_ids"]


def test_a_batch_where_one_prompt_asks(server: Server, hf: Any) -> None:
    prompts = [list(range(10, 19)), list(range(40, 52))]
    outs = generate(server, input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 3}, return_hidden_states=[True, False])
    assert "hidden_states" not in outs[1]["meta_info"]
    hidden = outs[0]["meta_info"]["hidden_states"]
    ref = hf_rows(hf, prompts[0] + outs[0]["output_ids"][:-1])
    np.testing.assert_allclose(np.asarray(hidden[0] + hidden[1:]), ref, atol=ATOL)


def test_the_openai_routes_carry_the_last_decode_row(server: Server, hf: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    prompt = "The quick brown fox"
    ids = hf[1](prompt)["input_ids"]
    extra = {"ignore_eos": True, "return_hidden_states": True}
    done = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
    choice = done.choices[0].model_dump()
    output_ids = generate(server, text=prompt, sampling_params={**GREEDY, "max_new_tokens": 4})["output_ids"]
    ref = hf_rows(hf, ids + output_ids[:-1])
    assert_float32_exact(choice["hidden_states"])
    np.testing.assert_allclose(np.asarray(choice["hidden_states"]), ref[-1], atol=ATOL)
    stream = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0, stream=True, extra_body=extra)
    chunks = [c.model_dump() for c in stream]
    assert chunks[-1]["choices"][0]["hidden_states"] == choice["hidden_states"]
    # chat: beside the message, and in a stream the delta of a chunk after the finish
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="default", messages=messages, max_tokens=3, temperature=0, extra_body=extra)
    assert len(chat.choices[0].model_dump()["hidden_states"]) == hf[0].config.hidden_size
    chat_chunks = [c.model_dump() for c in client.chat.completions.create(
        model="default", messages=messages, max_tokens=3, temperature=0, stream=True, extra_body=extra)]  # fmt: skip
    assert chat_chunks[-1]["choices"][0]["delta"]["hidden_states"] == chat.choices[0].model_dump()["hidden_states"]
    plain = client.completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0)
    assert "hidden_states" not in plain.choices[0].model_dump(exclude_unset=True)
