"""End-to-end LoRA loading while serving: `python -m minisgl serve --enable-lora --max-lora-rank 4
--lora-target-modules all --max-loaded-loras 2` as real processes, adapters loaded and unloaded
through SGLang's routes (POST /load_lora_adapter, /unload_lora_adapter) while requests run, with
/v1/models and "model": "BASE:ADAPTER" following them. The oracle is PEFT's greedy continuation
(tests/test_lora.py's helpers)."""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Iterator, List, Tuple

import httpx
import openai
import pytest

from test_lora import _edited_adapter, make_adapter, peft_greedy
from test_server_e2e import Server  # (the e2e tests' server process, its log and readiness wait)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = [5, 17, 42, 99, 7, 300, 12]
LONG_PROMPT = list(range(60, 100))  # 40 tokens: a radix hit covers 39


@pytest.fixture(scope="module")
def served(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[Server, Dict[str, str]]]:
    root = tmp_path_factory.mktemp("lora-dyn-e2e")
    adapters = {
        "A": make_adapter(tiny_model, str(root / "A"), seed=31),
        "B": make_adapter(tiny_model, str(root / "B"), seed=32),  # same shape, other weights
        "r8": make_adapter(tiny_model, str(root / "r8"), seed=33, r=8),
    }
    adapters["dora"] = _edited_adapter(adapters["A"], root / "dora", use_dora=True)
    s = Server(tiny_model, str(root / "server.log"), "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "all",
               "--max-loaded-loras", "2")  # fmt: skip
    yield s, adapters
    s.stop()


def _post(server: Server, route: str, **body: Any) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=120)


def _generate(server: Server, prompt: List[int], lora: Any = None, n: int = 6) -> httpx.Response:
    return _post(server, "/generate", input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": n}, lora_path=lora)


def _models(server: Server) -> List[Tuple[str, str, Any]]:
    return [(m["id"], m["root"], m["parent"]) for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]]


def test_load_serve_unload_and_load_again_over_http(served: Any, tiny_model: str) -> None:
    server, adapters = served
    base = _generate(server, PROMPT).json()["output_ids"]
    assert _models(server) == [(tiny_model, tiny_model, None)]
    r = _post(server, "/load_lora_adapter", lora_name="a", lora_path=adapters["A"])
    assert r.status_code == 200 and r.json() == {"success": True, "error_message": None, "loaded_adapters": {"a": adapters["A"]}}
    assert _models(server) == [(tiny_model, tiny_model, None), ("a", adapters["A"], tiny_model)]
    want_a = peft_greedy(tiny_model, adapters["A"], PROMPT, 6)[0]
    out = _generate(server, PROMPT, "a").json()
    assert out["output_ids"] == want_a != base
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    done = client.completions.create(model=f"{tiny_model}:a", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].text == out["text"]
    assert _generate(server, LONG_PROMPT, "a").json()["meta_info"]["cached_tokens"] == 0
    assert _generate(server, LONG_PROMPT, "a").json()["meta_info"]["cached_tokens"] == len(LONG_PROMPT) - 1

    r = _post(server, "/unload_lora_adapter", lora_name="a")
    assert r.status_code == 200 and r.json() == {"success": True, "error_message": None, "loaded_adapters": {}}
    assert _models(server) == [(tiny_model, tiny_model, None)]
    r = _generate(server, PROMPT, "a")
    assert r.status_code == 400 and r.json()["error"]["message"] == "LoRA adapter 'a' is not loaded; no adapter is loaded"
    r = _post(server, "/v1/completions", model=f"{tiny_model}:a", prompt="hi", max_tokens=2)
    assert r.status_code == 400 and "LoRA adapter 'a' is not loaded" in r.json()["error"]["message"]
    assert _generate(server, PROMPT).json()["output_ids"] == base  # the base model untouched

    # the same name, other weights: the prompt cached under the old "a" is not reused
    assert _post(server, "/load_lora_adapter", lora_name="a", lora_path=adapters["B"]).status_code == 200
    again = _generate(server, LONG_PROMPT, "a").json()
    assert again["meta_info"]["cached_tokens"] == 0
    assert again["output_ids"] == peft_greedy(tiny_model, adapters["B"], LONG_PROMPT, 6)[0]
    assert _post(server, "/unload_lora_adapter", lora_name="a").status_code == 200


def test_an_unload_waits_for_the_adapter_s_running_request(served: Any, tiny_model: str) -> None:
    """SGLang's unload: new requests naming the adapter are 400s at once, the one already running
    finishes with the adapter's tokens, and only then does the unload answer: the server, asked
    right after that answer, runs nothing (an unload that answered early would find the request,
    160 tokens long, still running)."""
    server, adapters = served
    n = 160
    want = peft_greedy(tiny_model, adapters["A"], PROMPT, n)[0]
    assert _post(server, "/load_lora_adapter", lora_name="w", lora_path=adapters["A"]).status_code == 200
    done: Dict[str, Any] = {}

    def run(key: str, call: Any) -> None:
        done[key] = call()
        done[key + "_then"] = httpx.get(server.url + "/get_load", timeout=30).json()  # what runs once it answered

    long_request = threading.Thread(target=run, args=("gen", lambda: _generate(server, PROMPT, "w", n=n)))
    long_request.start()
    deadline = time.monotonic() + 60
    while httpx.get(server.url + "/get_load", timeout=30).json()["num_running_reqs"] == 0:  # (until it runs)
        assert time.monotonic() < deadline and long_request.is_alive()
        time.sleep(0.01)
    unload = threading.Thread(target=run, args=("unload", lambda: _post(server, "/unload_lora_adapter", lora_name="w")))
    unload.start()
    refused = None
    while refused is None or refused.status_code != 400:  # the name goes at once, the running request stays
        refused = _generate(server, PROMPT, "w", n=1)
        assert time.monotonic() < deadline
    assert "LoRA adapter 'w' is not loaded" in refused.json()["error"]["message"]
    long_request.join(120)
    unload.join(120)
    assert done["gen"].status_code == 200 and done["gen"].json()["output_ids"] == want
    assert done["unload"].status_code == 200 and done["unload"].json()["loaded_adapters"] == {}
    assert done["unload_then"]["num_running_reqs"] == done["unload_then"]["num_waiting_reqs"] == 0  # the request had ended


def test_refused_loads_and_unloads_are_400s_that_hurt_nobody(served: Any, tiny_model: str) -> None:
    server, adapters = served
    assert _post(server, "/load_lora_adapter", lora_name="q1", lora_path=adapters["A"]).status_code == 200

    def refused(route: str, message: str, **body: Any) -> None:
        r = _post(server, route, **body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400 and message in err["message"], (body, err)

    for body, message in (
        ({"lora_name": "q1", "lora_path": adapters["B"]}, "LoRA adapter 'q1' is already loaded"),
        ({"lora_name": "x", "lora_path": "/no/such/dir"}, "is not a directory"),
        ({"lora_name": "x", "lora_path": adapters["dora"]}, "use_dora=True is not supported"),
        ({"lora_name": "x", "lora_path": adapters["r8"]}, "rank 8, above --max-lora-rank 4: restart the server with --max-lora-rank 8"),
        ({"lora_name": "x"}, "lora_path"),  # a missing field
        ({"lora_name": "x", "lora_path": adapters["A"], "pinned": "yes"}, "pinned"),
        ({"lora_name": "x", "lora_path": adapters["A"], "lora_id": "mine"}, "lora_id"),  # (the server mints it)
    ):  # fmt: skip
        refused("/load_lora_adapter", message, **body)
    assert _post(server, "/load_lora_adapter", lora_name="q2", lora_path=adapters["B"], pinned=True).status_code == 200
    refused("/load_lora_adapter", "the maximum number of loaded LoRA adapters is 2 (--max-loaded-loras), loaded: q1, q2",
            lora_name="q3", lora_path=adapters["A"])  # fmt: skip
    refused("/unload_lora_adapter", "LoRA adapter 'zz' is not loaded; the loaded adapters are: q1, q2", lora_name="zz")
    refused("/unload_lora_adapter", "lora_name")
    # nothing was disturbed: both adapters and the base model answer as before
    assert [m[0] for m in _models(server)] == [tiny_model, "q1", "q2"]
    assert _generate(server, PROMPT, "q1").json()["output_ids"] == peft_greedy(tiny_model, adapters["A"], PROMPT, 6)[0]
    assert _generate(server, PROMPT, "q2").json()["output_ids"] == peft_greedy(tiny_model, adapters["B"], PROMPT, 6)[0]
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    for name in ("q1", "q2"):
        assert _post(server, "/unload_lora_adapter", lora_name=name).status_code == 200
