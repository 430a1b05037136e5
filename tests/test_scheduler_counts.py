"""What a user reads off a request through the Engine: how many tokens it got, cached_tokens,
an abort's exact cut, when stream chunks come (sglang-facts.md §6.3, §6.8), and why the
scheduler admits nothing (BATCH_FULL after NO_TOKEN, §1.4)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from minisgl import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Any]:
    eng = Engine(tiny_model, device="cpu", max_total_tokens=2048, chunked_prefill_size=32, context_length=256)
    yield eng
    eng.shutdown()


def test_an_abort_while_decoding_keeps_exactly_the_tokens_made_before_it(engine: Any) -> None:
    base = engine.generate("decode then abort", GREEDY)["output_ids"]
    rid = engine.add_request("decode then abort", GREEDY)
    for _ in range(3):  # prefill (1 token) + 2 decodes: 3 tokens exist when the abort arrives
        engine.step()
    engine.abort(rid)
    engine.run_until_idle()
    out = engine.get_result(rid)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    # the token sampled in the step after the abort is not part of the answer
    assert out["output_ids"] == base[:3]
    assert out["meta_info"]["completion_tokens"] == 3


def test_a_chunked_prompt_counts_no_cache_hit_of_its_own_chunks(engine: Any) -> None:
    engine.flush_cache()
    prompt = list(range(300, 400))  # 100 tokens through 32-token chunks: 4 passes
    out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2})
    assert out["meta_info"]["cached_tokens"] == 0
    again = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2})
    assert again["meta_info"]["cached_tokens"] == 99  # everything but the last prompt token


def test_a_retracted_requests_second_prefill_is_not_a_cache_hit(tiny_model: str) -> None:
    # Two requests with the same prompt in a pool too small for both outputs: the second is
    # retracted, and by the time it is prefilled again (prompt + what it had generated) the
    # first has finished and cached those very tokens. Its own tokens are not a cache hit:
    # it reports the prompt prefix it reused on arrival, as SGLang's retracted_stain does.
    engine = Engine(tiny_model, device="cpu", max_total_tokens=64, chunked_prefill_size=-1, schedule_conservativeness=0.01)
    params = {**GREEDY, "max_new_tokens": 40}
    prompt = list(range(10, 20))
    a = engine.add_request(input_ids=prompt, sampling_params=params)
    engine.step(snapshot=False)
    b = engine.add_request(input_ids=prompt, sampling_params=params)
    engine.run_until_idle()
    assert engine.scheduler.num_retracted_reqs_total >= 1
    outs = {rid: engine.get_result(rid) for rid in (a, b)}
    assert outs[a]["output_ids"] == outs[b]["output_ids"] and len(outs[a]["output_ids"]) == 40
    assert outs[a]["meta_info"]["cached_tokens"] == 0
    assert outs[b]["meta_info"]["cached_tokens"] == len(prompt) - 1


@pytest.mark.parametrize("start, ok", [(10, True), (11, False)])
def test_logprob_start_len_may_equal_the_prompt_length(engine: Any, start: int, ok: bool) -> None:
    # SGLang refuses logprob_start_len > len(prompt) only: == len(prompt) asks for output logprobs alone
    from minisgl import SamplingParams
    from minisgl.managers.io_struct import TokenizedGenerateReqInput

    params = SamplingParams(**{**GREEDY, "max_new_tokens": 3})
    params.normalize(engine.tokenizer)
    rid = f"start-{start}"
    engine._enqueue([TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=list(range(40, 50)), sampling_params=params,
                                               return_logprob=True, logprob_start_len=start)])  # fmt: skip
    engine.run_until_idle()
    out = engine.get_result(rid)
    if ok:
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        assert len(out["meta_info"]["output_token_logprobs"]) == 3
    else:
        finish = out["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and finish["status_code"] == 400 and "logprob_start_len=11" in finish["message"]


@pytest.mark.parametrize("where", ["request", "server"])
def test_the_first_token_streams_at_once_then_every_interval(tiny_model: str, where: str) -> None:
    kwargs = {"stream_interval": 4} if where == "server" else {}
    engine = Engine(tiny_model, device="cpu", max_total_tokens=1024, **kwargs)
    params = {**GREEDY, "max_new_tokens": 10, **({"stream_interval": 4} if where == "request" else {})}
    chunks = list(engine.generate("streaming text", params, stream=True))
    # SGLang: a chunk when len(output_ids) % interval == 1 -> tokens 1, 5, 9, then the finish
    assert [len(c["output_ids"]) for c in chunks] == [1, 5, 9, 10]  # (each chunk: everything so far)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


# SGLang 0.5.23's batch_is_full after NO_TOKEN: when the head of the queue does not fit while
# requests run, admission waits for a request to leave instead of retrying every step.
def test_no_token_with_requests_running_waits_for_one_to_leave(tiny_model: str) -> None:
    engine = Engine(tiny_model, device="cpu", max_total_tokens=200, chunked_prefill_size=-1)
    engine.add_request(input_ids=list(range(10, 20)), sampling_params={**GREEDY, "max_new_tokens": 2}, rid="a1")
    engine.add_request(input_ids=list(range(30, 50)), sampling_params={**GREEDY, "max_new_tokens": 40}, rid="a2")
    engine.add_request(input_ids=list(range(100, 200)), sampling_params={**GREEDY, "max_new_tokens": 60}, rid="big")
    snaps = []
    while engine.has_unfinished_requests():
        snaps.append(engine.step())
    # a step that tried the queue, admitted nothing and ran out of KV while a2 still runs ...
    tried = [i for i, s in enumerate(snaps) if s["adder"]["stop_reason"] == "NO_TOKEN" and not s["adder"]["admitted"]]
    assert tried, "the scenario must reach a NO_TOKEN with nothing admitted"
    i = tried[0]
    # ... marks the batch full: the next step does not try again, as long as nobody left
    assert snaps[i + 1]["adder"]["stop_reason"] == "BATCH_FULL"
    assert "NO_TOKEN" in snaps[i + 1]["adder"]["stop_detail"]
    assert len(engine.get_result("big")["output_ids"]) == 60
