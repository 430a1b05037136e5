"""Custom logit processors (sampling/custom_logit_processor.py): the string format, the flag, the
request plumbing (Engine, /generate, the OpenAI routes), the order in sampling, and a failing
processor costing its own request only."""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional

import dill
import pytest
import torch

from minisgl import Engine
from minisgl.sampling.custom_logit_processor import (
    CustomLogitProcessor, DisallowedTokensLogitsProcessor, LogitProcessorGroup, apply_custom_logit_processors,
)  # fmt: skip
from minisgl.sampling.sampling_params import SamplingParams

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPT = "The quick brown fox"


class ForceTokenProcessor(CustomLogitProcessor):
    """Every row samples custom_params["token_id"] (SGLang's DeterministicLogitProcessor)."""

    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[List[Dict[str, Any]]] = None) -> torch.Tensor:
        for i, params in enumerate(custom_param_list or []):
            logits[i, :] = float("-inf")
            logits[i, params["token_id"]] = 0.0
        return logits


class RaisingProcessor(CustomLogitProcessor):
    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[List[Dict[str, Any]]] = None) -> torch.Tensor:
        raise RuntimeError("boom from the client")


class WrongShapeProcessor(CustomLogitProcessor):
    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[List[Dict[str, Any]]] = None) -> torch.Tensor:
        return logits[:, :-1]


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Any:
    with Engine(tiny_model, device="cpu", max_total_tokens=2048, enable_custom_logit_processor=True) as e:
        yield e


# --------------------------------------------------------------------------- the string
def test_to_str_is_sglangs_format_and_from_str_caches_the_class() -> None:
    s = DisallowedTokensLogitsProcessor.to_str()
    assert set(json.loads(s)) == {"callable"}
    first, second = CustomLogitProcessor.from_str(s), CustomLogitProcessor.from_str(s)
    assert type(first) is DisallowedTokensLogitsProcessor and type(second) is type(first)
    assert first is not second  # (a fresh instance each time, as SGLang's)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("not json", "not a serialized processor"),
        (json.dumps({"callable": "zz"}), "not a serialized processor"),  # not hex
        (json.dumps({"other": "00"}), "not a serialized processor"),
        (json.dumps({"callable": "8004"}), "does not load here"),  # a truncated pickle
        (json.dumps({"callable": dill.dumps(len).hex()}), "must hold a subclass"),
        (json.dumps({"callable": dill.dumps(CustomLogitProcessor).hex()}), "CustomLogitProcessor() failed"),  # abstract
    ],
)
def test_from_str_refuses_what_is_not_a_processor_with_a_value_error(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        CustomLogitProcessor.from_str(text)


def test_custom_params_are_type_checked() -> None:
    assert SamplingParams.from_dict({"custom_params": {"token_ids": [1]}}).custom_params == {"token_ids": [1]}
    assert SamplingParams.from_dict({"custom_params": None}).custom_params is None
    for bad, needle in (([1], "must be an object"), ({1: 2}, "must be an object"), ({"__req__": 1}, "__req__"),
                        ({"x": object()}, "must be JSON")):  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            SamplingParams.from_dict({"custom_params": bad})


# --------------------------------------------------------------------------- applying groups
def test_a_failing_group_leaves_its_rows_as_they_were_and_the_others_apply() -> None:
    logits = torch.randn(4, 8)
    before = logits.clone()
    groups = [
        LogitProcessorGroup(RaisingProcessor(), [0, 2], [{}, {}]),
        LogitProcessorGroup(ForceTokenProcessor(), [1], [{"token_id": 5}]),
        LogitProcessorGroup(WrongShapeProcessor(), [3], [{}]),
    ]
    errors = apply_custom_logit_processors(logits, groups)
    assert set(errors) == {0, 2, 3}
    assert "RaisingProcessor failed: RuntimeError: boom from the client" in errors[0]
    assert "shape (1, 7)" in errors[3] and "expected (1, 8)" in errors[3]
    assert torch.equal(logits[[0, 2, 3]], before[[0, 2, 3]])
    assert int(logits[1].argmax()) == 5 and torch.isinf(logits[1]).sum() == 7


# --------------------------------------------------------------------------- through the Engine
def test_disallowed_tokens_change_greedy_output_as_banning_them_with_logit_bias_does(engine: Any) -> None:
    free = engine.generate(PROMPT, GREEDY)["output_ids"]
    banned = sorted(set(free[:3]))  # the tokens it would pick first
    with_processor = engine.generate(
        PROMPT, {**GREEDY, "custom_params": {"token_ids": banned}}, return_logprob=True, top_logprobs_num=5,
        custom_logit_processor=DisallowedTokensLogitsProcessor,
    )  # fmt: skip
    with_bias = engine.generate(PROMPT, {**GREEDY, "logit_bias": {str(t): -100 for t in banned}})
    assert with_processor["output_ids"] == with_bias["output_ids"] != free
    assert not set(with_processor["output_ids"]) & set(banned)
    # logprobs come from the processed logits: a banned id is never among the top ones
    tops = with_processor["meta_info"]["output_top_logprobs"]
    assert len(tops) == 8 and all(entry[1] not in banned for step in tops for entry in step)


def test_a_processor_reads_the_request_from_its_params(engine: Any) -> None:
    """`__req__` is the scheduler's Req: a class defined here forces a token once the output is 3 long."""

    class ForceAtLength(CustomLogitProcessor):
        def __call__(self, logits: torch.Tensor, custom_param_list: Any = None) -> torch.Tensor:
            for i, params in enumerate(custom_param_list):
                if len(params["__req__"].output_ids) == params["at"]:
                    logits[i, :] = float("-inf")
                    logits[i, params["token_id"]] = 0.0
            return logits

    free = engine.generate(PROMPT, GREEDY)["output_ids"]
    token = next(t for t in range(7, 100) if t != free[3])
    params = {**GREEDY, "custom_params": {"at": 3, "token_id": token}}
    out = engine.generate(PROMPT, params, custom_logit_processor=ForceAtLength.to_str())
    assert out["output_ids"][:4] == free[:3] + [token]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_a_failing_processor_aborts_its_own_request_and_the_batch_goes_on(engine: Any) -> None:
    alone = engine.generate(PROMPT, GREEDY)
    ok = engine.add_request(PROMPT, GREEDY)
    raising = engine.add_request("def main():", GREEDY, custom_logit_processor=RaisingProcessor)
    wrong = engine.add_request("In the beginning", GREEDY, custom_logit_processor=WrongShapeProcessor)
    engine.run_until_idle()
    for rid, needle in ((raising, "RuntimeError: boom from the client"), (wrong, "returned a tensor of shape")):
        reason = engine.get_result(rid)["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 400 and needle in reason["message"], reason
    assert engine.get_result(ok)["output_ids"] == alone["output_ids"]
    engine.scheduler.check_memory_when_idle()
    with pytest.raises(ValueError, match="boom from the client"):  # generate() raises the 400, as for any refused request
        engine.generate(PROMPT, GREEDY, custom_logit_processor=RaisingProcessor)
    engine.scheduler.check_memory_when_idle()


@pytest.mark.parametrize(
    "processor, needle",
    [
        ("not json", "not a serialized processor"),
        (json.dumps({"callable": dill.dumps(len).hex()}), "must hold a subclass"),
        (12, "must be a string"),
        (DisallowedTokensLogitsProcessor(), "not an instance"),
    ],
)
def test_bad_processors_are_refused_and_nothing_leaks(engine: Any, processor: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        engine.generate(PROMPT, GREEDY, custom_logit_processor=processor)
    engine.scheduler.check_memory_when_idle()
    assert not engine.rid_to_state


def test_custom_params_need_a_processor(engine: Any) -> None:
    with pytest.raises(ValueError, match="send custom_logit_processor with them"):
        engine.generate(PROMPT, {**GREEDY, "custom_params": {"token_ids": [1]}})
    with pytest.raises(ValueError, match="send custom_logit_processor with them"):  # per prompt of a batch
        engine.generate([PROMPT, "x"], [GREEDY, {**GREEDY, "custom_params": {}}], custom_logit_processor=[ForceTokenProcessor, None])


def test_a_batch_takes_one_processor_per_prompt(engine: Any) -> None:
    free = engine.generate(PROMPT, GREEDY)["output_ids"]
    forced = {**GREEDY, "custom_params": {"token_id": 9}}
    outs = engine.generate([PROMPT, PROMPT], [forced, GREEDY], custom_logit_processor=[ForceTokenProcessor, None])
    assert outs[0]["output_ids"] == [9] * 8 and outs[1]["output_ids"] == free


def test_without_the_flag_the_engine_says_which_one_enables_it(tiny_model: str) -> None:
    with Engine(tiny_model, device="cpu", max_total_tokens=512) as e:
        with pytest.raises(ValueError, match="enable_custom_logit_processor=True.*runs the code the client sends"):
            e.generate(PROMPT, GREEDY, custom_logit_processor=ForceTokenProcessor)
        assert not e.rid_to_state


# --------------------------------------------------------------------------- HTTP
def test_without_the_flag_the_routes_answer_400_naming_it(tiny_model: str, tmp_path: Any) -> None:
    from fastapi.testclient import TestClient

    from minisgl.entrypoints.http_server import create_app
    from test_openai_protocol import _make_tm

    tm = _make_tm(tiny_model, tmp_path)
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as client:
        processor = ForceTokenProcessor.to_str()
        chat = {"model": tm.model_name, "messages": [{"role": "user", "content": "hi"}], "custom_logit_processor": processor}
        for route, body in (("/v1/chat/completions", chat), ("/generate", {"text": "hi", "custom_logit_processor": processor})):
            r = client.post(route, json=body)
            assert r.status_code == 400 and "--enable-custom-logit-processor" in r.text and "runs the code" in r.text, r.text
        r = client.post("/v1/completions", json={"model": tm.model_name, "prompt": "hi", "custom_params": {"a": 1}})
        assert r.status_code == 400 and "send custom_logit_processor with them" in r.text, r.text
    tm.close()


def test_the_routes_pass_both_fields_down(tiny_model: str, tmp_path: Any) -> None:
    from test_openai_protocol import _out, _scripted_client

    outs = [_out("r", "x", 1, {"type": "length", "length": 1})]
    client, seen = _scripted_client(tiny_model, tmp_path, outs)
    processor = ForceTokenProcessor.to_str()
    with client:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for route, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "hi", "max_tokens": 1})):
            body = {"model": client.model, **body, "custom_logit_processor": processor, "custom_params": {"token_id": 3}}
            assert client.post(route, json=body).status_code == 200
        native = {"text": "hi", "sampling_params": {"custom_params": {"token_id": 3}}, "custom_logit_processor": processor}
        assert client.post("/generate", json=native).status_code == 200
    assert len(seen) == 3
    for obj in seen:
        assert obj.custom_logit_processor == processor and obj.sampling_params["custom_params"] == {"token_id": 3}


@pytest.mark.e2e
@pytest.mark.slow
def test_a_class_defined_here_runs_in_a_server_process(tiny_model: str, tmp_path: Any) -> None:
    """dill sends the class by value: the server process has never imported this test."""
    import httpx

    from test_server_e2e import Server

    class EveryTokenIs(CustomLogitProcessor):
        def __call__(self, logits: torch.Tensor, custom_param_list: Any = None) -> torch.Tensor:
            for i, params in enumerate(custom_param_list):
                logits[i] = torch.full_like(logits[i], float("-inf")).index_fill_(0, torch.tensor([params["id"]]), 1.0)
            return logits

    class Raising(CustomLogitProcessor):
        def __call__(self, logits: torch.Tensor, custom_param_list: Any = None) -> torch.Tensor:
            raise RuntimeError("boom from the client")

    server = Server(tiny_model, str(tmp_path / "server.log"), "--enable-custom-logit-processor")
    try:
        body = {"text": PROMPT, "sampling_params": {**GREEDY, "custom_params": {"id": 11}}, "custom_logit_processor": EveryTokenIs.to_str()}
        r = httpx.post(server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == [11] * 8
        bad = {"text": PROMPT, "sampling_params": GREEDY, "custom_logit_processor": Raising.to_str()}
        r = httpx.post(server.url + "/generate", json=bad, timeout=60)
        assert r.status_code == 400 and "boom from the client" in r.text, r.text
        assert httpx.post(server.url + "/generate", json=body, timeout=60).json()["output_ids"] == [11] * 8  # still serving
    finally:
        server.stop()


def test_a_processor_that_undoes_a_grammars_mask_ends_its_request_saying_so(engine: Any) -> None:
    """Processors run after the grammar's mask (SGLang's order): one that raises a masked token
    ends the request with the grammar's 400, which names the processor as a cause."""
    pytest.importorskip("xgrammar")
    params = {**GREEDY, "regex": "a+", "custom_params": {"token_id": engine.tokenizer.encode("b", add_special_tokens=False)[0]}}
    out = engine.generate(PROMPT, params, custom_logit_processor=ForceTokenProcessor.to_str())
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "the sampled token is outside the grammar (the request's custom logit processor" in reason["message"]
    engine.scheduler.check_memory_when_idle()


def test_one_requests_bad_params_cost_it_alone_among_requests_of_the_same_processor(engine: Any) -> None:
    """The rows of one processor string run in one call; when it fails, each row is tried alone,
    so a client's bad token_ids never abort another client's request."""
    alone = engine.generate(PROMPT, {**GREEDY, "custom_params": {"token_ids": [1, 2]}}, custom_logit_processor=DisallowedTokensLogitsProcessor)
    good = engine.add_request(PROMPT, {**GREEDY, "custom_params": {"token_ids": [1, 2]}}, custom_logit_processor=DisallowedTokensLogitsProcessor)
    bad = engine.add_request(PROMPT, {**GREEDY, "custom_params": {"token_ids": [99999]}}, custom_logit_processor=DisallowedTokensLogitsProcessor)
    engine.run_until_idle()
    assert engine.get_result(good)["output_ids"] == alone["output_ids"]
    reason = engine.get_result(bad)["meta_info"]["finish_reason"]
    assert reason["status_code"] == 400 and "outside the vocabulary" in reason["message"]
    engine.scheduler.check_memory_when_idle()


class InfForceProcessor(CustomLogitProcessor):
    def __call__(self, logits: torch.Tensor, custom_param_list: Any = None) -> torch.Tensor:
        logits[:, 7] = float("inf")  # (softmax of +inf is NaN: nothing can be sampled from it)
        return logits


def test_logits_nothing_can_be_sampled_from_are_the_processors_error(engine: Any) -> None:
    with pytest.raises(ValueError, match="NaN, \\+inf, or all -inf.*give it a finite logit"):
        engine.generate(PROMPT, GREEDY, custom_logit_processor=InfForceProcessor)
    engine.scheduler.check_memory_when_idle()


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr is the client's code too")


def test_a_payload_that_is_no_processor_class_is_named_by_its_type_only(engine: Any) -> None:
    payload = json.dumps({"callable": dill.dumps(_BadRepr()).hex()})
    with pytest.raises(ValueError, match="must hold a subclass of minisgl's CustomLogitProcessor, got a _BadRepr"):
        engine.generate(PROMPT, GREEDY, custom_logit_processor=payload)
    assert engine.generate(PROMPT, GREEDY)["meta_info"]["finish_reason"]["type"] == "length"  # (still serving)


class CountingProcessor(CustomLogitProcessor):
    """Records, per call, the output length of each row's request; appends to its own params."""

    calls: List[int] = []

    def __call__(self, logits: torch.Tensor, custom_param_list: Any = None) -> torch.Tensor:
        for params in custom_param_list:
            CountingProcessor.calls.append(len(params["__req__"].output_ids))
            params.setdefault("seen", []).append(1)
        return logits


def test_a_chunked_prompts_discarded_rows_are_not_processed_and_params_are_each_requests_own(tiny_model: str) -> None:
    with Engine(tiny_model, device="cpu", max_total_tokens=2048, chunked_prefill_size=16, enable_custom_logit_processor=True) as e:
        CountingProcessor.calls = []
        out = e.generate(input_ids=list(range(10, 60)), sampling_params={**GREEDY, "max_new_tokens": 3}, custom_logit_processor=CountingProcessor)
        assert len(out["output_ids"]) == 3 and CountingProcessor.calls == [0, 1, 2]  # (not once per 16-token chunk)
        mine: Dict[str, Any] = {"tag": 1}
        e.generate([PROMPT, PROMPT], {**GREEDY, "n": 2, "custom_params": mine}, custom_logit_processor=CountingProcessor)
        assert mine == {"tag": 1}  # (neither shared between the four requests nor written back to the caller)


class _ExitsOnLoad:
    def __reduce__(self) -> Any:
        import sys

        return (sys.exit, (3,))


class ExitsOnInit(CustomLogitProcessor):
    def __init__(self) -> None:
        raise SystemExit(4)

    def __call__(self, logits: torch.Tensor, custom_param_list: Any = None) -> torch.Tensor:
        return logits


def test_a_processor_that_exits_while_loading_is_its_requests_400(engine: Any) -> None:
    for payload, needle in ((json.dumps({"callable": dill.dumps(_ExitsOnLoad()).hex()}), "does not load here: SystemExit: 3"),
                            (ExitsOnInit.to_str(), "ExitsOnInit() failed: SystemExit: 4")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(needle)):
            engine.generate(PROMPT, GREEDY, custom_logit_processor=payload)
    assert engine.generate(PROMPT, GREEDY)["meta_info"]["finish_reason"]["type"] == "length"  # (still serving)


def test_the_thinking_budget_ends_the_thinking_after_n_tokens(engine: Any, tiny_model: str) -> None:
    """SGLang's ThinkingBudgetLogitProcessor, with the tiny vocabulary's ids: thinking begun in the
    prompt (its last token is the start id), budget 3: three free tokens, then a newline and the
    end id forced; a bad budget and another family's ids are the request's error."""
    from minisgl.sampling.custom_logit_processor import Qwen3ThinkingBudgetLogitProcessor, ThinkingBudgetLogitProcessor

    from minisgl.utils import get_tokenizer

    prompt_ids = get_tokenizer(tiny_model).encode(PROMPT, add_special_tokens=False)
    start = prompt_ids[-1]
    assert prompt_ids.count(start) == 1
    free = engine.generate(PROMPT, GREEDY)
    end = next(t for t in range(7, 100) if t not in free["output_ids"] and t != start)

    class TinyBudget(ThinkingBudgetLogitProcessor):
        THINKING_START_TOKEN_ID = start
        THINKING_END_TOKEN_ID = end
        NEW_LINE_TOKEN_ID = 201

    out = engine.generate(PROMPT, {**GREEDY, "custom_params": {"thinking_budget": 3}}, custom_logit_processor=TinyBudget.to_str())
    assert out["output_ids"][:5] == free["output_ids"][:3] + [201, end]
    with pytest.raises(ValueError, match="got thinking_budget='3'"):  # (a budget the client sent is never dropped)
        engine.generate(PROMPT, {**GREEDY, "custom_params": {"thinking_budget": "3"}}, custom_logit_processor=TinyBudget.to_str())
    with pytest.raises(ValueError, match="outside this model's vocabulary"):  # (Qwen3's ids on another vocabulary)
        engine.generate(PROMPT, {**GREEDY, "custom_params": {"thinking_budget": 3}}, custom_logit_processor=Qwen3ThinkingBudgetLogitProcessor.to_str())
