"""minisgl.Engine shapes: seeded n samples, a streamed batch's indices, a params list of the
wrong length, collecting a request only once it finished."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import pytest

from minisgl import Engine

SAMPLED = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Any]:
    with Engine(tiny_model, device="cpu", max_total_tokens=2048) as e:
        yield e


def test_seeded_samples_of_one_prompt_differ_and_repeat(engine: Any) -> None:
    """As the server: sample j of a seeded n > 1 request uses seed + j, so the n answers differ
    from each other and the same call gives the same n answers again."""
    first = [o["output_ids"] for o in engine.generate("same prompt", {**SAMPLED, "n": 2, "seed": 1234})]
    again = [o["output_ids"] for o in engine.generate("same prompt", {**SAMPLED, "n": 2, "seed": 1234})]
    assert first == again and first[0] != first[1]


def test_a_streamed_batch_tags_each_chunk_with_its_prompt(engine: Any) -> None:
    prompts = ["one", "two three"]
    whole = engine.generate(prompts, {**SAMPLED, "temperature": 0})
    texts: Dict[int, List[str]] = {0: [], 1: []}
    for chunk in engine.generate(prompts, {**SAMPLED, "temperature": 0}, stream=True):
        texts[chunk["index"]].append(chunk["text"])  # (each the text so far)
    assert [texts[i][-1] for i in (0, 1)] == [w["text"] for w in whole]
    assert all(whole[i]["text"].startswith(t) for i in (0, 1) for t in texts[i])


def test_a_sampling_params_list_of_the_wrong_length_is_refused(engine: Any) -> None:
    """Not zipped down to the shorter list, which silently drops prompts."""
    with pytest.raises(ValueError, match="must have 2 entries"):
        engine.generate(["one", "two"], [{**SAMPLED, "temperature": 0}])
    with pytest.raises(ValueError, match="parallel_sample_num should be the same"):  # SGLang's rule
        engine.generate(["one", "two"], [{**SAMPLED, "n": 2}, SAMPLED])
    assert engine.rid_to_state == {}


def test_a_request_is_collected_only_once_finished_and_its_rid_is_taken_until_then(engine: Any) -> None:
    rid = engine.add_request("still running", {**SAMPLED, "temperature": 0}, rid="busy")
    with pytest.raises(ValueError, match="has not finished"):
        engine.get_result(rid)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("another", {**SAMPLED, "temperature": 0}, rid="busy")
    engine.run_until_idle()
    assert len(engine.get_result(rid)["output_ids"]) == SAMPLED["max_new_tokens"]
