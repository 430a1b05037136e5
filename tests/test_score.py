"""Scoring (SGLang's /v1/score and Engine.score): scores against transformers, the query's K/V
reused from the radix cache, and every refusal with the field it names.

The numerics run through the in-process Engine on the tiny Qwen3 model, transformers on the same
weights as the oracle (the last position's softmax, restricted to the labels or not). The HTTP
refusals run the app in process over a stand-in scheduler that fails the test if anything reaches
it: each is refused before a prompt is sent. tests/test_server_e2e.py scores over a real server.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Tuple

import pytest
import torch
from fastapi.testclient import TestClient

from minisgl.entrypoints.http_server import create_app
from minisgl.managers.tokenizer_manager import TokenizerManager
from minisgl.server_args import PortArgs, ServerArgs, resolve_server_args
from minisgl.utils import ParamError, get_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

QUERY = "Is the following city the capital of France? City:"
ITEMS = [" Paris", " London", " a small town in the mountains"]
LABELS = [5, 17, 300]  # three ids of the tiny vocabulary (512)


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Any]:
    from minisgl import Engine

    eng = Engine(tiny_model, device="cpu")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_model: str) -> Tuple[Any, Any]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(tiny_model)


def hf_scores(model: Any, prompts: List[List[int]], apply_softmax: bool) -> List[List[float]]:
    """The oracle: the next-token distribution after each whole prompt, read at the labels."""
    out = []
    for ids in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()  # [vocab]
        probs = torch.softmax(logits[LABELS], 0) if apply_softmax else torch.softmax(logits, 0)[LABELS]
        out.append(probs.tolist())
    return out


@pytest.mark.parametrize("apply_softmax", [False, True])
@pytest.mark.parametrize("item_first", [False, True])
def test_text_scores_match_transformers(engine: Any, hf: Tuple[Any, Any], apply_softmax: bool, item_first: bool) -> None:
    """Text query and items: each prompt is the two strings joined (item first with item_first),
    tokenized whole; the scores are transformers' probabilities at its last position."""
    model, tokenizer = hf
    scores = engine.score(QUERY, ITEMS, LABELS, apply_softmax=apply_softmax, item_first=item_first)
    texts = [item + QUERY if item_first else QUERY + item for item in ITEMS]
    expected = hf_scores(model, [tokenizer(t)["input_ids"] for t in texts], apply_softmax)
    assert len(scores) == len(ITEMS) and all(len(s) == len(LABELS) for s in scores)
    for ours, theirs in zip(scores, expected):
        assert ours == pytest.approx(theirs, abs=1e-4)
    if apply_softmax:  # a distribution over the labels
        assert all(sum(s) == pytest.approx(1.0, abs=1e-9) for s in scores)
    else:  # three ids out of 512: far from all of the mass
        assert all(sum(s) < 0.5 for s in scores)


@pytest.mark.parametrize("apply_softmax", [False, True])
@pytest.mark.parametrize("item_first", [False, True])
def test_token_id_scores_match_transformers(engine: Any, hf: Tuple[Any, Any], apply_softmax: bool, item_first: bool) -> None:
    """Token-id query and items: the id lists are joined as they are."""
    model, _ = hf
    query, items = [11, 42, 7, 99], [[3], [250, 251], [60, 61, 62]]
    scores = engine.score(query, items, LABELS, apply_softmax=apply_softmax, item_first=item_first)
    expected = hf_scores(model, [item + query if item_first else query + item for item in items], apply_softmax)
    for ours, theirs in zip(scores, expected):
        assert ours == pytest.approx(theirs, abs=1e-4)


def test_a_single_string_item_and_async_score(engine: Any) -> None:
    """`items` as one string is one item (SGLang's), and async_score answers what score does."""
    import asyncio

    one = engine.score(QUERY, ITEMS[0], LABELS)
    assert len(one) == 1
    assert asyncio.run(engine.async_score(QUERY, [ITEMS[0]], LABELS))[0] == pytest.approx(one[0], abs=1e-6)


def test_a_query_scored_again_comes_from_the_radix_cache(tiny_model: str) -> None:
    """The items of one call are one prefill batch: each computes the query (no sharing inside a
    batch, as in SGLang). Scored again, every prompt but its last token is found in the radix
    tree: the cache's hit rate goes from 0 to what the second call adds."""
    from minisgl import Engine

    with Engine(tiny_model, device="cpu") as eng:
        first = eng.score(QUERY, ITEMS, LABELS)
        assert eng.get_load().cache_hit_rate == 0.0
        lengths = [len(eng.tokenizer(QUERY + item)["input_ids"]) for item in ITEMS]
        for again, before in zip(eng.score(QUERY, ITEMS, LABELS), first):
            assert again == pytest.approx(before, abs=1e-5)
        # cached / (cached + computed) over both calls: the second computed each last token only
        cached = sum(n - 1 for n in lengths)
        assert eng.get_load().cache_hit_rate == pytest.approx(cached / (2 * sum(lengths)))


def test_scoring_leaves_the_sampling_generator_alone(tiny_model: str) -> None:
    """Score requests are greedy (temperature 0): they draw nothing from the Engine's generator, so
    a sampled generation after a score call is the one it would have been without it."""
    from minisgl import Engine

    params = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}
    runs = []
    for with_score in (False, True):
        with Engine(tiny_model, device="cpu", random_seed=7) as eng:
            first = eng.generate("Once upon a time", params)["output_ids"]
            if with_score:
                eng.score(QUERY, ITEMS, LABELS)
            runs.append((first, eng.generate("Once upon a time", params)["output_ids"]))
    assert runs[0][0] == runs[1][0]  # (the same seed: the same first generation)
    assert runs[1][1] == runs[0][1]


@pytest.mark.parametrize(
    ("kwargs", "param", "needle"),
    [
        ({"query": QUERY, "items": ITEMS}, "label_token_ids", "label_token_ids must be provided"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": []}, "label_token_ids", "at least one token id"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": [5, 512]}, "label_token_ids", "Token ID 512 is out of vocabulary (vocab size: 512)"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": [-1]}, "label_token_ids", "Token ID -1 is out of vocabulary"),
        ({"query": QUERY, "label_token_ids": LABELS}, "items", "items must be provided"),
        ({"query": None, "items": ITEMS, "label_token_ids": LABELS}, "query", "Invalid combination of query/items types"),
        ({"query": QUERY, "items": [[1, 2]], "label_token_ids": LABELS}, "items", "Invalid combination"),
        ({"query": [1, 2], "items": ITEMS, "label_token_ids": LABELS}, "items", "Invalid combination"),
        ({"query": [1, 2], "items": [[3], [9999]], "label_token_ids": LABELS}, "items", "token id 9999 is outside the vocabulary"),
        ({"query": [1, 600], "items": [[3]], "label_token_ids": LABELS}, "query", "token id 600 is outside the vocabulary"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": LABELS, "item_first": "yes"}, "item_first", "true or false"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": LABELS, "apply_softmax": 1}, "apply_softmax", "true or false"),
        # (found by the generation path, which names input_ids and text: the route's name instead)
        ({"query": [1] * 3000, "items": [[2]], "label_token_ids": LABELS}, "items", "longer than the model's context length (2048"),
        ({"query": "a " * 3000, "items": ["b"], "label_token_ids": LABELS}, "items", "longer than the model's context length (2048"),
    ],
)
def test_engine_refusals_name_the_field(engine: Any, kwargs: Any, param: str, needle: str) -> None:
    """The server's field names (the 400's `param`), from score and async_score alike."""
    import asyncio

    with pytest.raises(ParamError) as e:
        engine.score(**kwargs)
    assert e.value.param == param and needle in str(e.value)
    with pytest.raises(ParamError) as e:
        asyncio.run(engine.async_score(**kwargs))
    assert e.value.param == param and needle in str(e.value)


def test_no_items_score_nothing(engine: Any) -> None:
    """SGLang's answer to empty items: an empty list, with nothing queued."""
    assert engine.score(QUERY, [], LABELS) == [] and engine.score(QUERY, "", LABELS) == []
    assert not engine.has_unfinished_requests()


def test_an_embedding_engine_refuses_to_score(tiny_model: str) -> None:
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", is_embedding=True) as eng:
        with pytest.raises(ValueError, match="no next-token probabilities to score"):
            eng.score(QUERY, ITEMS, LABELS)


def test_multi_item_scoring_is_refused_by_name(tiny_model: str, capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang's --multi-item-scoring-delimiter is not built: the flag and the Engine keyword say so
    (None, SGLang's default, is taken)."""
    from minisgl import Engine
    from minisgl.cli import main

    with pytest.raises(ValueError, match="multi_item_scoring_delimiter: SGLang's multi-item scoring .* is not built"):
        Engine(tiny_model, device="cpu", multi_item_scoring_delimiter=5)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", tiny_model, "--multi-item-scoring-delimiter", "5"])
    # (exit 2 is argparse's for any bad flag: the message says it is this refusal, with why)
    assert e.value.code == 2
    assert "error: --multi-item-scoring-delimiter: SGLang's multi-item scoring" in capsys.readouterr().err


# --------------------------------------------------------------------------- HTTP refusals


def _app(model: str, tmp_path: Any, **overrides: Any) -> Iterator[TestClient]:
    args = resolve_server_args(ServerArgs(model_path=model, device="cpu", **overrides))
    tokenizer = get_tokenizer(model)
    tm = TokenizerManager(args, PortArgs.init_new(str(tmp_path)), tokenizer, 64, len(tokenizer), hidden_size=64)

    def send(msg: Any) -> None:
        raise AssertionError(f"{type(msg).__name__} reached the scheduler")

    tm._send_to_scheduler = send  # type: ignore[method-assign]
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as client:
        yield client
    tm.close()


@pytest.fixture()
def client(tiny_model: str, tmp_path: Any) -> Iterator[TestClient]:
    yield from _app(tiny_model, tmp_path)


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"query": QUERY, "items": ITEMS}, "label_token_ids", "label_token_ids must be provided"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": [512]}, "label_token_ids", "out of vocabulary"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": list(range(257))}, "label_token_ids", "at most 256 ids"),
        ({"query": QUERY, "label_token_ids": LABELS}, "items", "items must be provided"),
        ({"items": ITEMS, "label_token_ids": LABELS}, "query", "Invalid combination of query/items types"),
        ({"query": [1, 2], "items": ITEMS, "label_token_ids": LABELS}, "items", "Invalid combination"),
        # (pydantic: no branch of the union takes a list mixing strings and id lists)
        ({"query": QUERY, "items": ["a", [1]], "label_token_ids": LABELS}, "items", "'items.list[str].1': Input should be a valid string"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": LABELS, "apply_softmax": "true"}, "apply_softmax", "boolean"),
        ({"query": QUERY, "items": ITEMS, "label_token_ids": LABELS, "multi_item": True}, "multi_item", "multi_item"),
        ({"query": QUERY * 20, "items": ITEMS, "label_token_ids": LABELS}, "items", "longer than"),  # context 64
    ],
)
def test_http_refusals_are_400_naming_the_field(client: TestClient, body: Any, param: str, needle: str) -> None:
    r = client.post("/v1/score", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    # (a pydantic refusal names the union branch too, as on every OpenAI route: items.str)
    assert error["param"].split(".")[0] == param and needle in error["message"] and error["type"] == "BadRequestError"


def test_http_empty_items_unknown_model(client: TestClient) -> None:
    r = client.post("/v1/score", json={"query": QUERY, "items": [], "label_token_ids": LABELS, "model": "default"})
    assert r.status_code == 200
    assert r.json() == {"scores": [], "model": "default", "object": "scoring",
                        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                                  "prompt_tokens_details": {"cached_tokens": 0}}}  # fmt: skip
    r = client.post("/v1/score", json={"query": QUERY, "items": ITEMS, "label_token_ids": LABELS, "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_http_an_embedding_server_refuses_to_score(tiny_model: str, tmp_path: Any) -> None:
    for c in _app(tiny_model, tmp_path, is_embedding=True):
        r = c.post("/v1/score", json={"query": QUERY, "items": ITEMS, "label_token_ids": LABELS})
        assert r.status_code == 400 and "started with --is-embedding" in r.json()["error"]["message"]
