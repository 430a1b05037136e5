"""When a request ends: stop strings, stop token ids, EOS, max_new_tokens, aborts, over-long prompts.

Every abort path must leave no leaked KV slot or request row: the step that leaves the
scheduler idle runs its idle check (available + evictable + protected == total).
"""

from __future__ import annotations

from typing import Any

import pytest

from minisgl import Engine, SamplingParams
from minisgl.managers.io_struct import TokenizedGenerateReqInput
from minisgl.managers.schedule_batch import FINISH_MATCHED_TOKEN, Req

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, device="cpu", max_total_tokens=2048, chunked_prefill_size=32, context_length=128)


def _assert_no_leak(engine):
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_memory_when_idle()  # raises on a leak


def test_stop_string_spanning_a_token_boundary(engine: Any) -> None:
    tok = engine.tokenizer
    base = engine.generate("Once upon a time", GREEDY)
    pieces = [tok.decode([t]) for t in base["output_ids"]]
    i = next(i for i in range(2, len(pieces) - 1) if pieces[i].strip() and pieces[i + 1].strip())
    stop = pieces[i][-1] + pieces[i + 1][0]  # last char of one token + first char of the next
    out = engine.generate("Once upon a time", {**GREEDY, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"]
    assert out["text"] == base["text"][: base["text"].find(stop)]
    _assert_no_leak(engine)


def test_stop_token_ids_and_max_new_tokens(engine: Any) -> None:
    base = engine.generate("Hello there", GREEDY)
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    stop_id = base["output_ids"][3]
    first = base["output_ids"].index(stop_id)
    out = engine.generate("Hello there", {**GREEDY, "ignore_eos": False, "stop_token_ids": [stop_id]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == base["output_ids"][: first + 1]  # through the stop token
    # ignore_eos skips every token-based stop, stop_token_ids included (SGLang)
    ignored = engine.generate("Hello there", {**GREEDY, "stop_token_ids": [stop_id]})
    assert ignored["output_ids"] == base["output_ids"]


def test_eos_finishes_unless_ignore_eos() -> None:
    params = SamplingParams(max_new_tokens=10)
    params.normalize()
    req = Req("r", None, [5, 6], params, eos_token_ids={7})
    req.output_ids.append(7)
    req.check_finished()
    assert req.finished_reason == FINISH_MATCHED_TOKEN(matched=7) and req.finished_len == 1
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    params.normalize()
    req = Req("r", None, [5, 6], params, eos_token_ids={7})
    req.output_ids.append(7)
    req.check_finished()
    assert not req.finished()


def test_abort_while_waiting(engine: Any) -> None:
    rid = engine.add_request("never runs", GREEDY)
    engine.abort(rid)
    out = engine.get_result(rid)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    _assert_no_leak(engine)


def test_abort_mid_chunk(engine: Any) -> None:
    engine.flush_cache()  # a prompt another test left in the radix cache would not be chunked
    rid = engine.add_request(input_ids=list(range(10, 110)), sampling_params=GREEDY)
    snap = engine.step()
    assert snap["chunked_req"]["rid"] == rid
    engine.abort(rid)
    assert engine.scheduler.chunked_req is None
    aborts = [e["detail"] for e in engine.snapshot()["events"] if e["type"] == "abort" and e["rid"] == rid]
    assert aborts == ["aborted mid-chunk"]  # one event, not two
    out = engine.get_result(rid)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    _assert_no_leak(engine)


def test_abort_while_decoding(engine: Any) -> None:
    rid = engine.add_request("decode then abort", GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort(rid)
    engine.run_until_idle()
    out = engine.get_result(rid)
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert 0 < len(out["output_ids"]) < 12
    _assert_no_leak(engine)


def test_abort_touches_only_the_named_rid(engine: Any) -> None:
    from minisgl.managers.io_struct import AbortReq

    rids = ["req1", "req10", "req1-0", "req1-1", "req1-x", "other"]
    for rid in rids:
        engine.add_request("abort by name", GREEDY, rid=rid)
    engine.scheduler.process_input_requests([AbortReq(rid="")])  # an empty rid aborts nothing
    engine.abort("req1")  # exactly req1: not req10, nor other clients' req1-0 / req1-x
    engine.run_until_idle()
    reasons = {rid: engine.get_result(rid)["meta_info"]["finish_reason"]["type"] for rid in rids}
    assert reasons == {"req1": "abort", "req1-0": "length", "req1-1": "length", "req10": "length", "req1-x": "length",
                       "other": "length"}  # fmt: skip
    _assert_no_leak(engine)


def test_prompt_longer_than_context_is_rejected_and_others_run(engine: Any) -> None:
    # the front gate (the Engine's and the TokenizerManager's) refuses it with a ValueError (a 400)
    with pytest.raises(ValueError, match=r"The input \(200 tokens\) is longer than the model's context length"):
        engine.add_request(input_ids=list(range(10, 210)), sampling_params=GREEDY)
    # the scheduler's own gate, for what reaches it anyway: an abort with status 400, others unharmed
    bad = TokenizedGenerateReqInput(rid="too-long", input_text=None, input_ids=list(range(10, 210)),
                                    sampling_params=SamplingParams(**GREEDY))  # fmt: skip
    bad.sampling_params.normalize(engine.tokenizer)
    engine._enqueue([bad])
    good = engine.add_request("a normal prompt", GREEDY)
    engine.run_until_idle()
    finish = engine.get_result("too-long")["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] == 400 and finish["err_type"] == "BadRequestError"
    assert finish["message"].startswith("Input length (200 tokens) exceeds the maximum allowed length (122 tokens).")
    assert engine.get_result(good)["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    _assert_no_leak(engine)


def test_max_new_tokens_is_clamped_to_the_context(engine: Any) -> None:
    no_limit = {**GREEDY, "max_new_tokens": None}  # "as long as the context allows"
    out = engine.generate(input_ids=list(range(10, 110)), sampling_params=no_limit)
    # max_req_len = context 128 - 1 = 127; 127 - 100 prompt - 1 = 26
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 26}
    with pytest.raises(ValueError, match="Requested token count exceeds the model's maximum context length of 128"):
        engine.generate(input_ids=list(range(10, 110)), sampling_params={**GREEDY, "max_new_tokens": 1000})


def test_queue_full_is_a_503_abort(tiny_model: str, caplog: Any) -> None:
    """...and says so in the log, once a second at most (a 503 left no trace at info level)."""
    import logging

    caplog.set_level(logging.WARNING, logger="minisgl")
    engine = Engine(tiny_model, device="cpu", max_total_tokens=1024, max_queued_requests=1)
    first = engine.add_request("first", GREEDY)
    second = engine.add_request("second", GREEDY)
    third = engine.add_request("third", GREEDY)
    finish = engine.get_result(second)["meta_info"]["finish_reason"]
    assert finish == {"type": "abort", "message": "The request queue is full.", "status_code": 503,
                      "err_type": "ServiceUnavailableError"}  # fmt: skip
    engine.get_result(third)
    warnings = [r.getMessage() for r in caplog.records if "request queue is full" in r.getMessage()]
    assert len(warnings) == 1 and f"rid={second}" in warnings[0] and "--max-queued-requests 1" in warnings[0]
    assert engine.scheduler.num_rejected_queue_full == 2
    engine.run_until_idle()
    assert engine.get_result(first)["meta_info"]["finish_reason"]["type"] == "length"


def test_min_new_tokens_holds_back_the_tokenizers_eos_too(tiny_model: str, tmp_path: Any) -> None:
    """The tokenizer's EOS ends a request even when config.json names another; min_new_tokens
    must hold it back as well (the mask used to cover the config's ids only)."""
    import json
    import shutil

    first = Engine(tiny_model, device="cpu").generate("Once upon a time", {**GREEDY, "max_new_tokens": 1})["output_ids"][0]
    path = shutil.copytree(tiny_model, str(tmp_path / "m"))
    with open(f"{path}/tokenizer_config.json") as f:
        tok_cfg = json.load(f)
    engine = Engine(path, device="cpu")
    tok_cfg["eos_token"] = engine.tokenizer.convert_ids_to_tokens(first)  # greedy's first token is now the EOS
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump(tok_cfg, f)
    engine = Engine(path, device="cpu")
    assert engine.tokenizer.eos_token_id == first and first not in engine.scheduler.model_config.hf_eos_token_ids
    params = {"temperature": 0, "max_new_tokens": 12}
    assert engine.generate("Once upon a time", params)["output_ids"] == [first]  # it does stop the request
    out = engine.generate("Once upon a time", {**params, "min_new_tokens": 3})["output_ids"]
    assert len(out) >= 3 and first not in out[:3]


# Req.check_finished's order (SGLang 0.5.23, sglang-facts §6.3): a stop token that is also the
# last allowed token is a stop, not a length finish.
def _finish_req(**params: Any) -> Req:
    sp = SamplingParams(**params)
    sp.normalize()
    return Req("r", None, [5, 6], sp, eos_token_ids={7})


def test_eos_as_the_last_allowed_token_is_a_stop() -> None:
    req = _finish_req(max_new_tokens=2)
    req.output_ids += [3, 7]
    req.check_finished()
    assert req.finished_reason == FINISH_MATCHED_TOKEN(matched=7)
    assert req.finished_reason.to_json() == {"type": "stop", "matched": 7} and req.finished_len == 2


def test_a_stop_token_id_as_the_last_allowed_token_is_a_stop() -> None:
    req = _finish_req(max_new_tokens=1, stop_token_ids=[4])
    req.output_ids.append(4)
    req.check_finished()
    assert req.finished_reason == FINISH_MATCHED_TOKEN(matched=4)
