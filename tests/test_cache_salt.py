"""A request's own radix namespace (SGLang's `extra_key`, the OpenAI routes' `cache_salt`): through
the in-process Engine, what a tenant notices is `meta_info["cached_tokens"]` — a prompt reuses
cached K/V only of requests that sent the same key (and ran the same LoRA adapter)."""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List

import pytest

from minisgl import Engine
from minisgl.lora.lora_config import parse_lora_paths
from minisgl.mem_cache.namespace import key_tag, namespace, split_namespace
from test_lora import make_adapter

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 2}


@pytest.fixture(scope="module")
def engine(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    adapter = make_adapter(tiny_model, str(tmp_path_factory.mktemp("salt") / "a"), seed=1)
    with Engine(tiny_model, device="cpu", max_total_tokens=4096, lora_paths=[f"a={adapter}"]) as e:
        yield e


def _cached(engine: Any, prompt: List[int], **kwargs: Any) -> int:
    return engine.generate(input_ids=prompt, sampling_params=GREEDY, **kwargs)["meta_info"]["cached_tokens"]


def test_the_encoding_is_one_to_one(tmp_path: Any) -> None:
    """SGLang's concatenation would make key "a" on the base model and adapter "a" without a key one namespace."""
    pairs = [(None, None), ("a", None), (None, "a"), ("a", "a"), ("ab", None), (None, "ab"), ("a", "b"), (None, "\0a"), ("a", "b\0c")]
    assert len({namespace(lora_id, key) for lora_id, key in pairs}) == len(pairs)
    assert all(split_namespace(namespace(lora_id, key)) == (lora_id, key) for lora_id, key in pairs)
    assert namespace("a", "") == "a" and namespace(None, None) is None  # ("" is no key, SGLang's `if value:`)
    with pytest.raises(ValueError, match="holds a NUL character"):  # (what keeps the encoding one-to-one)
        parse_lora_paths([f"a\0b={tmp_path}"])
    assert key_tag("tenant-1") == key_tag("tenant-1") != key_tag("tenant-2") and "tenant" not in key_tag("tenant-1")


def test_same_prompt_other_salt_is_not_cached_same_salt_is(engine: Any) -> None:
    prompt = list(range(20, 60))
    engine.flush_cache()
    assert _cached(engine, prompt, extra_key="tenant-1") == 0
    assert _cached(engine, prompt, extra_key="tenant-2") == 0  # another tenant: nothing reused
    assert _cached(engine, prompt) == 0  # no key: not the tenants' K/V either
    assert _cached(engine, prompt, extra_key="tenant-1") == len(prompt) - 1  # its own: all but the last token
    assert _cached(engine, prompt, extra_key="") == len(prompt) - 1  # "" is no key: the keyless entry
    engine.scheduler.check_integrity()


def test_salt_and_adapter_make_one_namespace(engine: Any) -> None:
    prompt = list(range(100, 130))
    engine.flush_cache()
    assert _cached(engine, prompt, extra_key="s", lora_path="a") == 0
    assert _cached(engine, prompt, extra_key="s") == 0  # same salt, base model
    assert _cached(engine, prompt, lora_path="a") == 0  # same adapter, no salt
    assert _cached(engine, prompt, extra_key="a") == 0  # a key equal to the adapter's name is not the adapter
    assert _cached(engine, prompt, extra_key="s", lora_path="a") == len(prompt) - 1
    engine.scheduler.check_integrity()


def test_a_batch_takes_one_key_per_prompt_and_n_samples_warm_their_own_namespace(engine: Any) -> None:
    prompt = list(range(300, 330))
    engine.flush_cache()
    outs = engine.generate(input_ids=[prompt, prompt], sampling_params=GREEDY, extra_key=["x", "y"])
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0]
    outs = engine.generate(input_ids=[prompt, prompt], sampling_params=GREEDY, extra_key=["y", "z"])
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [len(prompt) - 1, 0]
    outs = engine.generate(input_ids=[prompt, prompt], sampling_params=GREEDY, extra_key="x")  # one key for all
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [len(prompt) - 1] * 2
    # n > 1: the prefix warm-up prefills under the samples' key, so both find the prompt cached
    fresh = list(range(400, 430))
    outs = engine.generate(input_ids=fresh, sampling_params={**GREEDY, "n": 2}, extra_key="w", lora_path="a")
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [len(fresh) - 1] * 2
    assert _cached(engine, fresh, lora_path="a") == 0 and _cached(engine, fresh, extra_key="w") == 0
    engine.scheduler.check_integrity()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"extra_key": 7}, "extra_key must be a string"),
        ({"extra_key": ["x"]}, "lists are per prompt of a batch"),
        ({"input_ids": [[1, 2, 3], [4, 5, 6]], "extra_key": ["x"]}, "`extra_key` must have 2 entries for a batch of 2 prompts"),
        ({"input_ids": [[1, 2, 3], [4, 5, 6]], "extra_key": ["x", 3]}, "extra_key must be a string"),
        ({"extra_key": "k" * 1025}, "has 1025 characters; at most 1024"),
    ],
)
def test_bad_keys_are_refused_before_anything_is_queued(engine: Any, kwargs: Dict[str, Any], message: str) -> None:
    kwargs = {"input_ids": [1, 2, 3], **kwargs}
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        engine.generate(sampling_params=GREEDY, **kwargs)
    with pytest.raises(ValueError, match="extra_key must be a string"):
        engine.add_request(input_ids=[1, 2, 3], sampling_params=GREEDY, extra_key=b"x")
    assert not engine.scheduler.waiting_queue and engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)["output_ids"]


def test_the_snapshot_tags_the_key_and_never_shows_it(engine: Any) -> None:
    from minisgl.visualizer.snapshot import validate_snapshot

    engine.flush_cache()
    rids = [engine.add_request(input_ids=list(range(50, 70)), sampling_params=GREEDY, extra_key=k) for k in ("secret-salt", None)]
    waiting = engine.snapshot()
    assert [r["cache_key"] for r in waiting["waiting_queue"]] == [key_tag("secret-salt"), None]
    snap = engine.step()
    assert validate_snapshot(snap) == []
    assert [r["cache_key"] for r in snap["batch"]["reqs"]] == [key_tag("secret-salt"), None]
    assert [r["cache_key"] for r in snap["running_batch"]] == [key_tag("secret-salt"), None]
    untagged = {**snap, "running_batch": [{k: v for k, v in r.items() if k != "cache_key"} for r in snap["running_batch"]]}
    assert "running_batch[0]: missing key 'cache_key'" in validate_snapshot(untagged)
    engine.run_until_idle()
    for rid in rids:
        engine.get_result(rid)
    radix = engine.snapshot()["radix"]
    assert sorted(str(c["cache_key"]) for c in radix["tree"]["children"]) == sorted(["None", key_tag("secret-salt")])
    assert [c["lora_id"] for c in radix["tree"]["children"]] == [None, None]
    assert "secret-salt" not in json.dumps(engine.snapshot()) and "secret-salt" not in engine.scheduler.tree_cache.format_tree()
    assert f"key={key_tag('secret-salt')}" in engine.scheduler.tree_cache.format_tree()
    # the Jupyter widget's panels show the tag where the page does (tests/test_visualizer_browser.py)
    from minisgl.visualizer.render import render_batch, render_memory, render_running, render_waiting

    tag = key_tag("secret-salt")
    assert f"key {tag}" in render_waiting(waiting) and f" · key {tag}" in render_batch(snap)
    assert render_running(snap).count(f" · key {tag}") == 1 and f" · key {tag}" in render_memory(engine.snapshot())


def test_the_tree_shares_one_namespace_string_per_request(engine: Any) -> None:
    """Req.extra_key is built once: every node a request inserts holds the same string object
    (built per call, each new leaf held its own copy of a possibly long key)."""
    key = "tenant-" + "x" * 500
    engine.generate(input_ids=list(range(40, 80)), sampling_params={**GREEDY, "max_new_tokens": 3}, extra_key=key)
    nodes = [n for n in engine.scheduler.tree_cache._all_nodes() if n.extra_key is not None and n.extra_key.endswith(key)]
    assert nodes and len({id(n.extra_key) for n in nodes}) == 1
