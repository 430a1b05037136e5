"""The TokenizerManager, the native routes and the request checks at their edges: a non-stream
answer assembled from several messages, caps that accept exactly their bound, per-prompt
fields of a batch, the context gate's limits, the control routes' refusals (each test fails on
a one-line change that the other tests let through). No model processes: outputs are fed as
the detokenizer would send them."""

from __future__ import annotations

import asyncio
from typing import Any, List

import pytest
from fastapi.testclient import TestClient

from minisgl.entrypoints.http_server import create_app
from minisgl.managers.io_struct import BatchStrOutput, FlushCacheReqOutput, GenerateReqInput, TokenizedGenerateReqInput
from minisgl.managers.tokenization import validate_context_length
from minisgl.managers.tokenizer_manager import (
    MAX_STOP_REGEX_CHARS, MAX_STOP_REGEXES, MAX_STOP_STRINGS, MAX_SUB_REQUESTS, MAX_TOP_LOGPROBS_NUM, TokenizerManager,
)  # fmt: skip
from minisgl.sampling.sampling_params import SamplingParams
from test_openai_protocol import CONTEXT_LEN, _make_tm, _out, _recording_tm, _scripted_client, _str_out

LENGTH = {"type": "length", "length": 2}


def _with_logprobs(out: BatchStrOutput, lp: float, tid: int) -> BatchStrOutput:
    out.output_token_logprobs_val, out.output_token_logprobs_idx = [[lp]], [[tid]]
    out.output_top_logprobs_val, out.output_top_logprobs_idx = [[[lp]]], [[[tid]]]
    return out


def test_a_non_streaming_answer_sent_in_several_messages_is_returned_whole(tiny_model: str, tmp_path: Any) -> None:
    """The scheduler sends a non-streaming request's tokens every 50 tokens: the answer is every
    message's text, ids and logprobs, not the last message's (each message read as it comes)."""

    async def run() -> None:
        tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        try:
            obj = GenerateReqInput(text="hi", sampling_params={"max_new_tokens": 2}, return_logprob=True, top_logprobs_num=1, rid="w")
            result = asyncio.ensure_future(tm.generate_request(obj).__anext__())
            while not sent:
                assert not result.done(), result.result()  # (refused before it was sent)
                await asyncio.sleep(0.01)
            tm._handle_batch_output(_with_logprobs(_str_out("w", "Hel", [5], 1), -0.5, 5))
            await asyncio.sleep(0.05)  # the handler wakes and reads the first message
            tm._handle_batch_output(_with_logprobs(_str_out("w", "lo", [6], 2, LENGTH), -1.5, 6))
            out = await asyncio.wait_for(result, 5)
            assert out["text"] == "Hello" and out["output_ids"] == [5, 6]
            assert out["meta_info"]["output_token_logprobs"] == [(-0.5, 5, None), (-1.5, 6, None)]
            assert out["meta_info"]["output_top_logprobs"] == [[(-0.5, 5, None)], [(-1.5, 6, None)]]
            assert out["meta_info"]["e2e_latency"] > 0  # SGLang's meta_info field
        finally:
            tm.close()

    asyncio.run(run())


def test_a_non_streaming_request_whose_client_left_is_aborted_at_its_next_message(tiny_model: str, tmp_path: Any) -> None:
    """Not only when no message came for wait_timeout: a long answer's messages keep coming."""

    class GoneClient:
        async def is_disconnected(self) -> bool:
            return True

    async def run() -> None:
        tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        tm.wait_timeout = 60.0
        try:
            obj = GenerateReqInput(text="hi", sampling_params={"max_new_tokens": 60}, rid="gone")
            result = asyncio.ensure_future(tm.generate_request(obj, GoneClient()).__anext__())
            while not sent:
                assert not result.done(), result.result()  # (refused before it was sent)
                await asyncio.sleep(0.01)
            tm._handle_batch_output(_str_out("gone", "x" * 50, [5] * 50, 50))  # 50 of its 60 tokens
            with pytest.raises(ValueError, match="disconnected"):
                await asyncio.wait_for(result, 5)
            assert [m.rid for m in sent if not isinstance(m, TokenizedGenerateReqInput)] == ["gone"]  # its abort
        finally:
            tm.close()

    asyncio.run(run())


def test_the_request_size_caps_take_their_bound_itself() -> None:
    """top_logprobs 20 (OpenAI's maximum), 64 stop strings, 64 stop regexes of 4,096 characters and
    4,096 generations are allowed; one more is not."""

    def check(**kw: Any) -> None:
        obj = GenerateReqInput(**kw)
        obj.normalize_batch_and_arguments()
        TokenizerManager._validate_request_shape(obj)

    check(text="hi", return_logprob=True, top_logprobs_num=MAX_TOP_LOGPROBS_NUM)
    check(text="hi", sampling_params={"stop": ["s"] * MAX_STOP_STRINGS})
    check(text="hi", sampling_params={"stop_regex": ["s"] * MAX_STOP_REGEXES})
    check(text="hi", sampling_params={"stop_regex": "s" * MAX_STOP_REGEX_CHARS})
    check(text=["hi"] * (MAX_SUB_REQUESTS // 128), sampling_params={"n": 128})
    for kw in (
        dict(text="hi", return_logprob=True, top_logprobs_num=MAX_TOP_LOGPROBS_NUM + 1),
        dict(text="hi", sampling_params={"stop": ["s"] * (MAX_STOP_STRINGS + 1)}),
        dict(text="hi", sampling_params={"stop_regex": ["s"] * (MAX_STOP_REGEXES + 1)}),
        dict(text="hi", sampling_params={"stop_regex": ["s" * MAX_STOP_REGEX_CHARS, "t"]}),
        dict(text=["hi"] * (MAX_SUB_REQUESTS // 128) + ["one more"], sampling_params={"n": 128}),
    ):
        with pytest.raises(ValueError):
            check(**kw)


def test_a_batch_passes_its_logprob_and_stream_settings_to_every_prompt(tiny_model: str, tmp_path: Any) -> None:
    """/v1/completions with a list of prompts, logprobs=k and stream: each prompt streams with its top-k."""

    async def run() -> None:
        tm, sent = _recording_tm(tiny_model, tmp_path, refuse_generate=False)
        try:
            obj = GenerateReqInput(text=["a", "b"], sampling_params={"max_new_tokens": 2}, return_logprob=True, top_logprobs_num=2, stream=True)
            first = asyncio.ensure_future(tm.generate_request(obj).__anext__())
            while len(sent) < 2:
                assert not first.done(), first.result()
                await asyncio.sleep(0.01)
            assert [(m.return_logprob, m.top_logprobs_num, m.stream) for m in sent] == [(True, 2, True)] * 2
            tm._handle_batch_output(_str_out(obj.rid[1], "x", [5], 1))  # a token of a prompt still running
            out = await asyncio.wait_for(first, 5)  # streamed at once, before the batch finished
            assert out["index"] == 1 and out["text"] == "x"
            first.cancel()
        finally:
            tm.close()

    asyncio.run(run())


def test_native_generate_with_n_returns_every_sample(tiny_model: str, tmp_path: Any) -> None:
    outs = [_out("r-0", "a", 1, LENGTH, index=0), _out("r-1", "b", 1, LENGTH, index=1)]
    client, _ = _scripted_client(tiny_model, tmp_path, outs)
    with client:
        body = client.post("/generate", json={"text": "hi", "sampling_params": {"n": 2}}).json()
    assert [o["text"] for o in body] == ["a", "b"]


def test_the_api_key_in_the_query_opens_the_visualizer_only(tiny_model: str, tmp_path: Any) -> None:
    """?api_key= exists for the visualizer's EventSource; everywhere else the key goes in the header."""
    tm = _make_tm(tiny_model, tmp_path, api_key="sekret")
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as c:
        assert c.get("/v1/models", params={"api_key": "sekret"}).status_code == 401
        assert c.post("/v1/completions", params={"api_key": "sekret"}, json={}).status_code == 401


def test_flush_cache_that_could_not_flush_is_a_400(tiny_model: str, tmp_path: Any) -> None:
    tm = _make_tm(tiny_model, tmp_path)

    async def refused() -> FlushCacheReqOutput:
        return FlushCacheReqOutput(success=False, message="Requests are running: cannot flush.")

    tm.flush_cache = refused  # type: ignore[method-assign]
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as c:
        r = c.post("/flush_cache")
    assert r.status_code == 400 and r.text == "Requests are running: cannot flush."


@pytest.mark.parametrize("where", ["negative", "vocab_size"])
def test_token_ids_just_outside_the_vocabulary_are_400(tiny_model: str, tmp_path: Any, where: str) -> None:
    """An id equal to the vocabulary size, or negative, would index past (or wrap around) the embedding."""
    tm, sent = _recording_tm(tiny_model, tmp_path)
    token = -1 if where == "negative" else tm.vocab_size
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as c:
        for route, body in (("/generate", {"input_ids": [5, token]}), ("/v1/completions", {"model": tm.model_name, "prompt": [5, token], "max_tokens": 1})):
            r = c.post(route, json=body)
            assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"], (route, r.text)
    assert sent == []


def test_the_context_gate_lets_a_request_fill_the_context_exactly() -> None:
    """A prompt of limit - 1 tokens with room to generate is served; prompt + max_new_tokens may
    equal the context (SGLang 0.5.23's `>`); one more token either way is a 400."""

    def req(prompt_len: int, max_new: int) -> TokenizedGenerateReqInput:
        return TokenizedGenerateReqInput(rid="r", input_text=None, input_ids=list(range(prompt_len)), sampling_params=SamplingParams(max_new_tokens=max_new))

    validate_context_length(req(CONTEXT_LEN - 1, 1), CONTEXT_LEN, allow_auto_truncate=False)
    validate_context_length(req(10, CONTEXT_LEN - 10), CONTEXT_LEN, allow_auto_truncate=False)
    validate_context_length(req(CONTEXT_LEN - 7, 1), CONTEXT_LEN, allow_auto_truncate=False, max_req_input_len=CONTEXT_LEN - 6)
    for r, limit in ((req(CONTEXT_LEN, 0), None), (req(10, CONTEXT_LEN - 9), None), (req(CONTEXT_LEN - 6, 1), CONTEXT_LEN - 6)):
        with pytest.raises(ValueError):
            validate_context_length(r, CONTEXT_LEN, allow_auto_truncate=False, max_req_input_len=limit)


@pytest.fixture(scope="module")
def bos_model(tiny_model_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with a Llama-style tokenizer: it puts a BOS (<|endoftext|>, id 0: the
    vocabulary is full) before every text it encodes with special tokens, and its chat template
    writes {{ bos_token }} itself."""
    import shutil

    from tokenizers import processors

    from minisgl.utils import get_tokenizer

    path = str(tmp_path_factory.mktemp("bos") / "model")
    shutil.copytree(tiny_model_factory("llama"), path)
    tok = get_tokenizer(path)
    tok.bos_token = "<|endoftext|>"
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_text_prompt_gets_the_bos_and_a_chat_prompt_only_the_templates(bos_model: str, tmp_path: Any, dynamic: bool) -> None:
    """SGLang (and vLLM) encode a text prompt with the tokenizer's special tokens: a Llama model
    sees its <s>. A chat prompt is the rendered template, which writes the BOS itself: one, not two.
    Token-id prompts are sent as they are."""
    from minisgl.utils import get_tokenizer

    tm = _make_tm(bos_model, tmp_path, enable_dynamic_batch_tokenizer=dynamic)
    sent: List[Any] = []

    def send(msg: Any) -> None:  # record what would reach the scheduler, then fail fast (no scheduler)
        sent.append(msg)
        raise RuntimeError("recorded")

    tm._send_to_scheduler = send  # type: ignore[method-assign]
    body = {"model": tm.model_name, "max_tokens": 1}
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True), raise_server_exceptions=False) as c:
        c.post("/v1/completions", json={**body, "prompt": "hi there"})
        c.post("/v1/completions", json={**body, "prompt": [5, 6]})
        c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi there"}]})
        c.post("/generate", json={"text": "hi there", "sampling_params": {"max_new_tokens": 1}})
        counted = c.post("/v1/tokenize", json={"prompt": "hi there"}).json()["tokens"]  # what a completion takes
        bare = c.post("/v1/tokenize", json={"prompt": "hi there", "add_special_tokens": False}).json()["tokens"]
    tm.close()
    plain = get_tokenizer(bos_model).encode("hi there", add_special_tokens=False)
    completion, ids_prompt, chat, native = (msg.input_ids for msg in sent)
    assert completion == native == counted == [0] + plain and bare == plain
    assert ids_prompt == [5, 6]
    assert chat[0] == 0 and chat.count(0) == 1
