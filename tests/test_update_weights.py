"""Updating the weights while serving (SGLang's update_weights_from_disk / _from_tensor,
get_weights_by_name, weight_version): the in-process Engine, tp_size 1 and 2.

Two tiny models of one shape, A and B (different seeds): an Engine on A, updated to B, must
answer as a fresh Engine on B does; a refused update must leave A's answers."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch

from minisgl import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The quick brown fox", "Hello there, my friend", "1 2 3 4 5 6 7 8"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
ENGINE_ARGS: Dict[str, Any] = dict(device="cpu", max_total_tokens=2048)


@pytest.fixture(scope="module")
def models(tiny_model_factory: Callable[..., str]) -> Tuple[str, str]:
    """A and B: the same untied Llama shape (the LM head packed on its own), different weights."""
    return tiny_model_factory("llama", seed=1), tiny_model_factory("llama", seed=2)


def greedy_ids(engine: Engine) -> List[List[int]]:
    return [out["output_ids"] for out in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def reference(models: Tuple[str, str]) -> Dict[Tuple[str, str], List[List[int]]]:
    """(model, dtype) -> a fresh Engine's greedy answers."""
    refs = {}
    for dtype in ("float32", "bfloat16"):
        for path in models:
            with Engine(path, dtype=dtype, **ENGINE_ARGS) as e:
                refs[(path, dtype)] = greedy_ids(e)
    a, b = models
    assert refs[(a, "float32")] != refs[(b, "float32")], "A and B must answer differently for the tests to mean anything"
    return refs


def state_dict_of(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


# "float32": the CPU path with oneDNN-packed linear weights (rebuilt by an update); "bfloat16": plain parameters
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_from_disk_answers_as_a_fresh_engine_on_the_new_weights(models: Tuple[str, str], reference: Any, dtype: str) -> None:
    a, b = models
    with Engine(a, dtype=dtype, **ENGINE_ARGS) as e:
        assert greedy_ids(e) == reference[(a, dtype)]
        if dtype == "float32":
            assert e.model_runner.model.lm_head.packed_weight is not None  # (the packed path is the one tested)
        ok, message, paused = e.update_weights_from_disk(b, weight_version="step-1")
        assert ok and paused == 0, message
        assert message == "Succeeded to update model weights. Weight version updated to step-1."
        assert greedy_ids(e) == reference[(b, dtype)]
        assert e.generate(PROMPTS[0], GREEDY)["meta_info"]["weight_version"] == "step-1"
        ok, message, _ = e.update_weights_from_disk(a)  # and back: nothing of B's is left
        assert ok, message
        assert greedy_ids(e) == reference[(a, dtype)]


def test_a_prompt_cached_before_the_update_is_not_reused(models: Tuple[str, str]) -> None:
    a, b = models
    prompt = "A long shared prefix that the radix cache keeps " * 3
    with Engine(a, **ENGINE_ARGS) as e:
        e.generate(prompt, GREEDY)
        assert e.generate(prompt, GREEDY)["meta_info"]["cached_tokens"] > 0  # cached with A's weights
        assert e.snapshot()["memory"]["evictable"] > 0
        assert e.update_weights_from_disk(b)[0]
        assert e.snapshot()["memory"]["evictable"] == 0  # the flushed tree shows as empty (visualizer, widget)
        first = e.generate(prompt, GREEDY)
        assert first["meta_info"]["cached_tokens"] == 0  # K/V of A's weights is gone
        assert e.generate(prompt, GREEDY)["meta_info"]["cached_tokens"] > 0  # B's own K/V is cached again


def test_requests_in_flight_finish_with_the_old_weights_first(models: Tuple[str, str], reference: Any) -> None:
    """SGLang's model_update_lock: the update waits for the requests in flight; they end with A's
    answer (no mix of A's and B's K/V), and the next ones get B's."""
    a, b = models
    with Engine(a, **ENGINE_ARGS) as e:
        rids = [e.add_request(p, GREEDY) for p in PROMPTS]
        e.step()
        e.step()  # prefilled and decoding with A's weights
        assert e.update_weights_from_disk(b)[0]
        assert [e.get_result(r)["output_ids"] for r in rids] == reference[(a, "float32")]
        assert greedy_ids(e) == reference[(b, "float32")]


def test_abort_all_requests_ends_the_requests_in_flight(models: Tuple[str, str]) -> None:
    a, b = models
    with Engine(a, **ENGINE_ARGS) as e:
        rid = e.add_request(PROMPTS[0], {"max_new_tokens": 64, "ignore_eos": True})
        e.step()
        assert e.update_weights_from_disk(b, abort_all_requests=True)[0]
        out = e.get_result(rid)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(out["output_ids"]) < 64


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_from_tensor_with_the_new_state_dict(models: Tuple[str, str], reference: Any, dtype: str) -> None:
    a, b = models
    new = state_dict_of(b)
    with Engine(a, dtype=dtype, **ENGINE_ARGS) as e:
        ok, message = e.update_weights_from_tensor(list(new.items()))
        assert ok, message
        assert greedy_ids(e) == reference[(b, dtype)]


def test_update_from_tensor_in_buckets_and_a_partial_fused_tensor(models: Tuple[str, str], reference: Any) -> None:
    """Buckets (flush only with the last), and q_proj alone: the rest of qkv_proj stays as it was."""
    a, b = models
    new = list(state_dict_of(b).items())
    with Engine(a, **ENGINE_ARGS) as e:
        q_name = "model.layers.0.self_attn.q_proj.weight"
        k_before = e.get_weights_by_name("model.layers.0.self_attn.k_proj.weight")
        assert e.update_weights_from_tensor([(q_name, dict(new)[q_name])])[0]
        assert e.get_weights_by_name(q_name, 2) == dict(new)[q_name][:2].tolist()
        assert e.get_weights_by_name("model.layers.0.self_attn.k_proj.weight") == k_before
        half = len(new) // 2
        assert e.update_weights_from_tensor(new[:half], flush_cache=False)[0]
        assert e.update_weights_from_tensor(new[half:], weight_version="bucketed")[0]
        assert greedy_ids(e) == reference[(b, "float32")]
        assert e.weight_version == "bucketed"


def test_get_weights_by_name(models: Tuple[str, str]) -> None:
    a, b = models
    new = state_dict_of(b)
    with Engine(a, **ENGINE_ARGS) as e:
        assert e.update_weights_from_disk(b)[0]
        for name in ("model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight",
                     "model.layers.1.mlp.down_proj.weight", "lm_head.weight", "model.norm.weight"):  # fmt: skip
            got = e.get_weights_by_name(name, truncate_size=3)
            assert got == new[name][:3].tolist(), name  # (lm_head: a packed weight, read back dense)
        assert len(e.get_weights_by_name("model.embed_tokens.weight")) == 100  # SGLang's default: 100 rows
        with pytest.raises(ValueError, match="names no parameter"):
            e.get_weights_by_name("model.layers.9.mlp.up_proj.weight")
        with pytest.raises(ValueError, match="truncate_size"):
            e.get_weights_by_name("model.norm.weight", truncate_size=-1)


def _copy_model(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: str, **changes: Any) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def bad_checkpoints(models: Tuple[str, str], tiny_model_factory: Callable[..., str],
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Tuple[str, str]]]:  # fmt: skip
    """name -> (checkpoint directory, a phrase the refusal must hold)."""
    from safetensors.torch import save_file

    a, b = models
    root = tmp_path_factory.mktemp("bad")
    wider = tiny_model_factory("llama", seed=3, intermediate_size=192)
    # shapes that disagree with a config.json that claims the served shape
    lying = _copy_model(wider, str(root / "lying"))
    _edit_config(lying, intermediate_size=128)
    truncated = _copy_model(b, str(root / "truncated"))
    with open(os.path.join(truncated, "model.safetensors"), "r+b") as f:
        f.truncate(1000)
    missing_tensor = _copy_model(b, str(root / "missing_tensor"))
    tensors = state_dict_of(b)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, os.path.join(missing_tensor, "model.safetensors"), metadata={"format": "pt"})
    yield {
        "other shape": (wider, "intermediate_size 192 (served: 128)"),
        "other architecture": (tiny_model_factory("qwen2", seed=2), "architecture"),
        "shapes unlike its config": (lying, "shape mismatch"),
        "missing directory": (str(root / "nowhere"), "does not exist"),
        "bad file": (truncated, "Failed to update weights"),
        "missing tensor": (missing_tensor, "model.layers.1.mlp.up_proj.weight"),
    }


def test_refused_updates_keep_the_old_weights(models: Tuple[str, str], reference: Any, bad_checkpoints: Any) -> None:
    a, b = models
    with Engine(a, **ENGINE_ARGS) as e:
        for what, (path, phrase) in bad_checkpoints.items():
            ok, message, _ = e.update_weights_from_disk(path, weight_version="bad")
            assert not ok, what
            assert phrase in message and "The served weights are unchanged" in message, (what, message)
            assert greedy_ids(e) == reference[(a, "float32")], what
        assert e.weight_version == "default"
        ok, message, _ = e.update_weights_from_disk(b, load_format="pt")
        assert not ok and "load_format 'pt' is not supported" in message
        new = state_dict_of(b)
        ok, message = e.update_weights_from_tensor([("model.layers.0.mlp.up_proj.weight", new["model.norm.weight"])])
        assert not ok and "does not fit" in message
        ok, message = e.update_weights_from_tensor([("model.layers.7.mlp.up_proj.weight", new["model.norm.weight"])])
        assert not ok and "has no place" in message
        assert greedy_ids(e) == reference[(a, "float32")]
        with pytest.raises(ValueError, match="list of \\(name, torch.Tensor\\) pairs"):
            e.update_weights_from_tensor([("model.norm.weight", [1.0, 2.0])])


def test_non_float_tensors_and_bare_decoder_names_are_refused_by_name(models: Tuple[str, str], reference: Any) -> None:
    """An int or bool tensor would be cast into the weights without a word: refused, naming it. A
    bare decoder's name (no "model.") is refused under the name the model knows it by."""
    a, _ = models
    with Engine(a, **ENGINE_ARGS) as e:
        for bad in (torch.ones(64, dtype=torch.int64), torch.ones(64, dtype=torch.bool)):
            ok, message = e.update_weights_from_tensor([("model.norm.weight", bad)])
            assert not ok and f"tensor 'model.norm.weight' has dtype {bad.dtype}" in message, message
        ok, message = e.update_weights_from_tensor([("layers.0.mlp.up_proj.weight", torch.zeros(3, 3))])
        assert not ok and "checkpoint tensor 'model.layers.0.mlp.up_proj.weight' does not fit" in message, message
        assert greedy_ids(e) == reference[(a, "float32")]


def test_a_bad_expert_index_or_a_failing_read_never_kills_the_engine(tiny_model_factory: Callable[..., str]) -> None:
    """A 4-expert model: expert 4 is no parameter (it was an IndexError in the scheduler, which
    ended the Engine and the server); get_weights_by_name, an update and the start-up loader
    share the check. Any other error of a read answers its caller only."""
    moe = tiny_model_factory("qwen3_moe", seed=1)
    with Engine(moe, **ENGINE_ARGS) as e:
        before = e.generate(PROMPTS[0], GREEDY)["output_ids"]
        name = "model.layers.0.mlp.experts.4.up_proj.weight"
        with pytest.raises(ValueError, match=r"names expert 4, but the config has num_experts=4 \(experts 0..3\)"):
            e.get_weights_by_name(name)
        up = torch.tensor(e.get_weights_by_name("model.layers.0.mlp.experts.3.up_proj.weight"))  # [I, H]: expert 3's fits
        ok, message = e.update_weights_from_tensor([(name, up)])
        assert not ok and "num_experts=4" in message, message

        def broken_read(name: str, truncate_size: int = 100) -> List[object]:
            raise RuntimeError("a bug in the read")

        e.model_runner.get_weights_by_name = broken_read  # (the scheduler's model runner: the Engine's, tp_size 1)
        with pytest.raises(ValueError, match="RuntimeError: a bug in the read"):
            e.get_weights_by_name("model.norm.weight")
        assert e.generate(PROMPTS[0], GREEDY)["output_ids"] == before  # still serving, the same weights


def test_update_reaches_every_tensor_parallel_rank(models: Tuple[str, str]) -> None:
    """tp_size 2: each rank loads its slice; the answers equal a fresh tp=2 Engine's on B, and a
    refusal on the ranks leaves both on A."""
    a, b = models
    args = dict(ENGINE_ARGS, tp_size=2)
    with Engine(b, **args) as fresh:
        expected_b = greedy_ids(fresh)
    with Engine(a, **args) as e:
        expected_a = greedy_ids(e)
        assert expected_a != expected_b
        ok, message, _ = e.update_weights_from_disk(os.path.join(b, "nowhere"))
        assert not ok and greedy_ids(e) == expected_a, message
        ok, message, _ = e.update_weights_from_disk(b)
        assert ok, message
        assert greedy_ids(e) == expected_b
        # o_proj is row-parallel: gathered whole from both ranks (SGLang's answer)
        name = "model.layers.0.self_attn.o_proj.weight"
        assert e.get_weights_by_name(name, 4) == state_dict_of(b)[name][:4].tolist()
        assert e.update_weights_from_tensor(list(state_dict_of(a).items()))[0]
        assert greedy_ids(e) == expected_a


def test_model_update_lock_writer_waits_for_readers_and_new_readers_wait_for_it() -> None:
    """The TokenizerManager's model_update_lock (SGLang's RWLock): an update waits for the requests
    in flight, and a request that comes while it waits runs after it."""
    from minisgl.aio_rwlock import RWLock

    async def scenario() -> List[str]:
        lock, order = RWLock(), []

        async def request(name: str, hold: float) -> None:
            async with lock.reader_lock():
                order.append(f"{name} start")
                await asyncio.sleep(hold)
                order.append(f"{name} end")

        async def update() -> None:
            async with lock.writer_lock():
                order.append("update")

        first = asyncio.create_task(request("old", 0.05))
        await asyncio.sleep(0.01)
        writer = asyncio.create_task(update())
        await asyncio.sleep(0.01)
        late = asyncio.create_task(request("new", 0))
        await asyncio.gather(first, writer, late)
        return order

    assert asyncio.run(scenario()) == ["old start", "old end", "update", "new start", "new end"]


# --------------------------------------------------------------------------- over HTTP, one server
@pytest.fixture(scope="module")
def adapters(models: Tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Tuple[str, str]:
    """Two LoRA adapters of A's shape (they serve on B too): different deltas."""
    from test_lora import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    return make_adapter(models[0], str(root / "one"), seed=21), make_adapter(models[0], str(root / "two"), seed=22)


@pytest.fixture(scope="module")
def server(models: Tuple[str, str], adapters: Tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from test_server_e2e import Server  # (the e2e tests' server process, its log and readiness wait)

    s = Server(models[0], str(tmp_path_factory.mktemp("srv") / "server.log"), "--weight-version", "A",
               "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "all", "--lora-paths", f"one={adapters[0]}")  # fmt: skip
    yield s
    s.stop()


def http_greedy_ids(url: str, prompts: List[str] = PROMPTS, params: Dict[str, Any] = GREEDY) -> List[List[int]]:
    import httpx

    r = httpx.post(f"{url}/generate", json={"text": prompts, "sampling_params": params}, timeout=60)
    assert r.status_code == 200, r.text
    return [out["output_ids"] for out in r.json()]


def test_http_update_from_disk_get_weights_and_refusals(server: Any, models: Tuple[str, str], reference: Any) -> None:
    import httpx

    a, b = models
    url = server.url
    assert http_greedy_ids(url) == reference[(a, "float32")]
    assert httpx.get(f"{url}/get_weight_version").json() == {"weight_version": "A"}
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": b, "weight_version": "B"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "message": "Succeeded to update model weights. Weight version updated to B.",
                        "num_paused_requests": 0}  # fmt: skip
    assert http_greedy_ids(url) == reference[(b, "float32")]
    out = httpx.post(f"{url}/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}, timeout=60).json()
    assert out["meta_info"]["weight_version"] == "B"
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["model_path"] == b and info["weight_version"] == "B"
    assert httpx.get(f"{url}/get_server_info").json()["model_path"] == b  # (the two agree: SGLang's server_args move)
    # SGLang's OpenAI answers name the weights in `metadata` (not streamed chunks: SGLang's have none)
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": a, "messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2}, timeout=60).json()  # fmt: skip
    assert chat["metadata"] == {"weight_version": "B"}
    completion = httpx.post(f"{url}/v1/completions", json={"model": a, "prompt": "hi", "max_tokens": 2}, timeout=60).json()
    assert completion["metadata"] == {"weight_version": "B"}
    # the Responses API's `metadata` is the request's own, echoed: no weight_version in it
    response = httpx.post(f"{url}/v1/responses", json={"model": a, "input": "hi", "max_output_tokens": 2,
                                                       "metadata": {"run": "7"}}, timeout=60).json()  # fmt: skip
    assert response["metadata"] == {"run": "7"}
    # the completions route serves B too, under the name it had (the served name stays)
    text_b = httpx.post(f"{url}/v1/completions", json={"model": a, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0},
                        timeout=60).json()["choices"][0]["text"]  # fmt: skip
    assert text_b == httpx.post(f"{url}/generate", json={"text": PROMPTS[1], "sampling_params": dict(GREEDY, ignore_eos=False)},
                                timeout=60).json()["text"]  # fmt: skip

    r = httpx.post(f"{url}/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 4}, timeout=60)
    assert r.status_code == 200 and r.json() == state_dict_of(b)["model.norm.weight"][:4].tolist()
    r = httpx.post(f"{url}/get_weights_by_name", json={"name": "model.layers.0.nope.weight"}, timeout=60)
    assert r.status_code == 400 and "names no parameter" in r.json()["error"]["message"]

    # refused: 400 with SGLang's body, and B is still served
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": os.path.join(b, "nowhere")}, timeout=60)
    assert r.status_code == 400 and r.json()["success"] is False
    assert "does not exist" in r.json()["message"]
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": a, "keep_pause": True}, timeout=60)
    assert r.status_code == 400 and "keep_pause" in r.json()["error"]["message"]  # (an SGLang option minisgl lacks)
    r = httpx.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": ["not base64!"]}, timeout=60)
    assert r.status_code == 400 and "not base64" in r.json()["message"]
    assert http_greedy_ids(url) == reference[(b, "float32")]
    assert httpx.get(f"{url}/get_weight_version").json() == {"weight_version": "B"}

    # from tensors: A's state dict, as safetensors in base64 (never a pickle)
    from minisgl.models.weight_update import serialize_named_tensors

    body = {"serialized_named_tensors": [serialize_named_tensors(list(state_dict_of(a).items()))], "weight_version": "A2"}
    r = httpx.post(f"{url}/update_weights_from_tensor", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert http_greedy_ids(url) == reference[(a, "float32")]


def test_http_update_waits_for_the_requests_in_flight(server: Any, models: Tuple[str, str]) -> None:
    """A stream running when the update comes ends with the old weights' answer, whole; the
    update answers after it; a request sent while the update waits is answered by the new
    weights, under the new weight_version (SGLang's model_update_lock: without it, that request
    would join the stream's batch on the old weights)."""
    import httpx

    a, b = models
    long = {"temperature": 0.0, "max_new_tokens": 600, "ignore_eos": True}  # (runs past the late request)
    with Engine(b, **ENGINE_ARGS) as e:
        expected_b = e.generate(PROMPTS[0], long)["output_ids"]
    with Engine(a, **ENGINE_ARGS) as e:
        expected_a = greedy_ids(e)
    url = server.url
    assert httpx.post(f"{url}/update_weights_from_disk", json={"model_path": b}, timeout=60).json()["success"]
    results: Dict[str, Any] = {}

    def update() -> None:
        results["update"] = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": a, "weight_version": "A3"}, timeout=120)

    def late() -> None:
        results["late"] = httpx.post(f"{url}/generate", json={"text": PROMPTS, "sampling_params": GREEDY}, timeout=120)

    threads: List[threading.Thread] = []
    with httpx.stream("POST", f"{url}/generate", json={"text": PROMPTS[0], "sampling_params": long, "stream": True},
                      timeout=120) as r:  # fmt: skip
        chunks: List[Dict[str, Any]] = []
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunks.append(json.loads(line[len("data:"):]))
            if not threads:  # the stream runs: now the update comes, then (while it waits) another request
                threads.append(threading.Thread(target=update))
                threads[0].start()
                time.sleep(0.3)
                threads.append(threading.Thread(target=late))
                threads[1].start()
                time.sleep(0.3)
                results["late sent while the update waited"] = "update" not in results
    for thread in threads:
        thread.join(timeout=120)
    assert results["late sent while the update waited"]
    assert results["update"].status_code == 200, results["update"].text
    assert chunks[-1]["output_ids"] == expected_b  # all of it B's: no step ran on A's weights
    assert results["late"].status_code == 200, results["late"].text
    assert [out["output_ids"] for out in results["late"].json()] == expected_a  # the new weights answered it
    assert {out["meta_info"]["weight_version"] for out in results["late"].json()} == {"A3"}


def test_http_a_request_waiting_for_an_update_resolves_its_adapter_after_it(server: Any, models: Tuple[str, str],
                                                                            adapters: Tuple[str, str]) -> None:  # fmt: skip
    """SGLang's order: the reader lock, then the LoRA name. A request naming adapter "one" waits
    behind an update; meanwhile "one" is unloaded and loaded again from another adapter. The
    request resolves the name when it runs, and gets the adapter loaded then (resolved before
    the wait, it held the unloaded adapter's id: a 400 "not loaded")."""
    import httpx

    a, b = models
    url = server.url
    long = {"temperature": 0.0, "max_new_tokens": 1000, "ignore_eos": True}  # (time for the unload and load)
    results: Dict[str, Any] = {}

    def update() -> None:
        results["update"] = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": b}, timeout=120)

    def lora_request() -> None:
        results["lora"] = httpx.post(f"{url}/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "one"},
                                     timeout=120)  # fmt: skip

    threads: List[threading.Thread] = []
    with httpx.stream("POST", f"{url}/generate", json={"text": PROMPTS[0], "sampling_params": long, "stream": True},
                      timeout=120) as r:  # fmt: skip
        for line in r.iter_lines():
            if threads or not line.startswith("data:"):
                continue
            for target in (update, lora_request):
                threads.append(threading.Thread(target=target))
                threads[-1].start()
                time.sleep(0.3)
            unload = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "one"}, timeout=60)
            assert unload.status_code == 200, unload.text
            load = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "one", "lora_path": adapters[1]}, timeout=60)
            assert load.status_code == 200, load.text
            results["swapped while the stream ran"] = not results
    for thread in threads:
        thread.join(timeout=120)
    assert results["swapped while the stream ran"], results
    assert results["update"].status_code == 200, results["update"].text
    assert results["lora"].status_code == 200, results["lora"].text
    again = httpx.post(f"{url}/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "one"}, timeout=60)
    assert results["lora"].json()["output_ids"] == again.json()["output_ids"]  # B with the second adapter
    assert httpx.post(f"{url}/update_weights_from_disk", json={"model_path": a}, timeout=60).json()["success"]


def test_http_update_weights_from_tensor_refuses_a_body_over_its_cap(server: Any) -> None:
    """A body over MAX_UPDATE_WEIGHTS_BODY_BYTES is refused from its Content-Length, before it is
    read (a 2 GiB body is announced, a few bytes sent); a chunked one, whose size is unknown, too."""
    import http.client
    from urllib.parse import urlsplit

    from minisgl.entrypoints.http_server import MAX_UPDATE_WEIGHTS_BODY_BYTES

    host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
    for headers in ({"Content-Length": str(2 * MAX_UPDATE_WEIGHTS_BODY_BYTES)}, {"Transfer-Encoding": "chunked"}):
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.putrequest("POST", "/update_weights_from_tensor")
        conn.putheader("Content-Type", "application/json")
        for key, value in headers.items():
            conn.putheader(key, value)
        conn.endheaders()
        start = b'{"serialized_named_tensors": ["'
        conn.send(start if "Content-Length" in headers else b"%x\r\n%s\r\n" % (len(start), start))  # (one chunk of many)
        response = conn.getresponse()
        body = json.loads(response.read())
        conn.close()
        assert response.status == 400, body
        message = body["error"]["message"]
        assert ("smaller buckets" in message) if "Content-Length" in headers else ("Content-Length" in message), message
