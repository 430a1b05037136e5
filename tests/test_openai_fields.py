"""What a user of the OpenAI routes reads in each field, fed scripted outputs (no model
processes): matched_stop, usage with n and cached tokens, ids, echo, logprobs=0, choice order,
abort events, the pass-through sampling fields (each test fails on a one-line change of the
serving code that the other tests let through)."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest
from fastapi.testclient import TestClient

from test_openai_protocol import _chat, _out, _scripted_client

from minisgl.server_args import ServerArgs, resolve_server_args

LENGTH = {"type": "length", "length": 1}


def _events(r: Any) -> List[Any]:
    """The SSE events of a response: parsed JSON, and "[DONE]" as is."""
    raw = [e[len("data: ") :] for e in r.text.strip().split("\n\n")]
    return [e if e == "[DONE]" else json.loads(e) for e in raw]


def _post(client: TestClient, route: str, **body: Any) -> Any:
    payload: Dict[str, Any] = {"model": client.model}
    payload.update({"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else {"prompt": "hi"})
    payload.update(body)
    return client.post("/v1/chat/completions" if route == "chat" else "/v1/completions", json=payload)


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("matched", ["END", 7])
def test_a_stop_says_which_stop_matched(tiny_model: str, tmp_path: Any, route: str, matched: Any) -> None:
    """SGLang's matched_stop (the stop string or stop token id that ended the answer), streamed or not."""
    outs = [_out("r", "ok", 1, {"type": "stop", "matched": matched})]
    client, _ = _scripted_client(tiny_model, tmp_path, outs)
    with client:
        whole = _post(client, route).json()["choices"][0]
        streamed = _events(_post(client, route, stream=True))
    assert whole["finish_reason"] == "stop" and whole["matched_stop"] == matched
    last = [e for e in streamed if e != "[DONE]" and e["choices"] and e["choices"][0]["finish_reason"]][-1]
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["matched_stop"] == matched


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_usage_reports_the_cached_prompt_tokens(tiny_model: str, tmp_path: Any, route: str) -> None:
    out = _out("r", "ok", 1, LENGTH)
    out["meta_info"]["cached_tokens"] = 2
    client, _ = _scripted_client(tiny_model, tmp_path, [out])
    with client:
        usage = _post(client, route).json()["usage"]
        streamed = _events(_post(client, route, stream=True, stream_options={"include_usage": True}))
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2}
    assert streamed[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_n_samples_count_the_prompt_once_and_answer_under_the_clients_rid(tiny_model: str, tmp_path: Any, route: str) -> None:
    outs = [_out("job-0", "a", 1, LENGTH, index=0), _out("job-1", "b", 1, LENGTH, index=1)]
    client, _ = _scripted_client(tiny_model, tmp_path, outs)
    with client:
        body = _post(client, route, n=2, rid="job").json()
    assert body["id"] == "job"  # the rid the client chose, not its first sample's "job-0"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_an_abort_with_a_status_mid_stream_is_an_error_event_then_done(tiny_model: str, tmp_path: Any, route: str) -> None:
    """A 503 abort (queue full, a dead child) after the headers: OpenAI's error envelope with its
    code, then [DONE], and never a chunk that presents the abort as a finish_reason."""
    reason = {"type": "abort", "message": "The request queue is full.", "status_code": 503}
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "Hel", 1), _out("r", "", 1, reason)])
    with client:
        events = _events(_post(client, route, stream=True))
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "The request queue is full.", "type": "ServiceUnavailableError", "param": None, "code": 503}}
    assert not any(c != "[DONE]" and "choices" in c and c["choices"][0]["finish_reason"] for c in events)


def test_a_stream_without_include_usage_has_no_usage_chunk(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "Hel", 1), _out("r", "lo", 2, LENGTH)])
    with client:
        for route in ("chat", "completions"):
            for options in ({}, {"stream_options": {"include_usage": False}}):
                chunks = _events(_post(client, route, stream=True, **options))[:-1]
                assert all(c["choices"] and c["usage"] is None for c in chunks), (route, options, chunks)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_puts_each_choices_usage_so_far_on_its_chunks(tiny_model: str, tmp_path: Any, route: str) -> None:
    """SGLang's and vLLM's stream_options.continuous_usage_stats (GuideLLM's throughput probe reads it)."""
    outs = [_out("r-0", "Hel", 1, index=0), _out("r-1", "A", 1, index=1), _out("r-0", "lo", 2, LENGTH, index=0),
            _out("r-1", "B", 2, LENGTH, index=1)]  # fmt: skip
    client, _ = _scripted_client(tiny_model, tmp_path, outs)
    options = {"include_usage": True, "continuous_usage_stats": True}
    with client:
        events = _events(_post(client, route, n=2, stream=True, stream_options=options))[:-1]
    *chunks, final = events
    seen = {(c["choices"][0]["index"], c["usage"]["completion_tokens"], c["usage"]["total_tokens"]) for c in chunks}
    assert {(0, 1, 4), (0, 2, 5), (1, 1, 4), (1, 2, 5)} <= seen  # (prompt: 3 tokens, once per choice)
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 4 and final["usage"]["prompt_tokens"] == 3


def test_a_completions_stream_ends_with_its_finish_reason_even_with_no_text_left(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "Hel", 1), _out("r", "", 1, LENGTH)])
    with client:
        chunks = _events(_post(client, "completions", stream=True))[:-1]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_echo_prepends_each_choices_own_prompt_once(tiny_model: str, tmp_path: Any) -> None:
    """A batch of prompts with n = 2: choice i * n + j echoes prompt i; a stream echoes it in its first chunk only."""
    outs = [_out(f"r{k}", f"<{k}>", 1, LENGTH, index=k) for k in range(4)]
    client, _ = _scripted_client(tiny_model, tmp_path, outs)
    with client:
        choices = _post(client, "completions", prompt=["P", "Q"], n=2, echo=True).json()["choices"]
    assert [c["text"] for c in choices] == ["P<0>", "P<1>", "Q<2>", "Q<3>"]
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "Hel", 1), _out("r", "lo", 2, LENGTH)])
    with client:
        chunks = _events(_post(client, "completions", prompt="Say: ", echo=True, stream=True))[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Say: Hello"


def test_completions_logprobs_zero_returns_the_chosen_tokens_logprobs(tiny_model: str, tmp_path: Any) -> None:
    """OpenAI's logprobs=0: each chosen token's logprob, no alternatives (top_logprobs entries null, as SGLang's)."""
    out = _out("r", "x", 1, LENGTH)
    out["meta_info"].update(output_token_logprobs=[(-0.5, 5, None)], output_top_logprobs=[])
    client, seen = _scripted_client(tiny_model, tmp_path, [out])
    with client:
        lp = _post(client, "completions", logprobs=0).json()["choices"][0]["logprobs"]
    assert seen[0].return_logprob is True and seen[0].top_logprobs_num == 0
    assert lp["token_logprobs"] == [-0.5] and lp["top_logprobs"] == [None] and lp["text_offset"] == [0]


def test_echo_of_a_token_id_prompt_leaves_its_special_tokens_out(tiny_model: str, tmp_path: Any) -> None:
    """A token-id prompt that starts with a BOS echoes the text, not "<bos>text" (SGLang decodes
    it with skip_special_tokens, as the text of a string prompt would read)."""
    from minisgl.utils import get_tokenizer

    tok = get_tokenizer(tiny_model)
    ids = tok.encode("hello there", add_special_tokens=False)
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "!", 1, LENGTH)])
    with client:
        text = _post(client, "completions", prompt=[tok.all_special_ids[0]] + ids, echo=True).json()["choices"][0]["text"]
    assert text == tok.decode(ids) + "!"


def test_completions_echo_with_logprobs_puts_the_prompt_tokens_first(tiny_model: str, tmp_path: Any) -> None:
    """OpenAI's echo + logprobs (lm-eval-harness scores continuations with it): the prompt's
    tokens come first, the very first with null logprob and top_logprobs, then the completion's;
    text offsets run over the echoed text. Streamed, the first chunk carries the prompt's."""
    from minisgl.utils import get_tokenizer

    tok = get_tokenizer(tiny_model)
    t5, t6, t7, t8 = (tok.decode([i]) for i in (5, 6, 7, 8))
    out = _out("r", t8, 1, LENGTH)
    out["meta_info"].update(
        input_token_logprobs=[(None, 5, None), (-2.0, 6, None)], input_top_logprobs=[None, [(-1.0, 7, None)]],
        output_token_logprobs=[(-0.5, 8, None)], output_top_logprobs=[[(-0.5, 8, None)]],
    )  # fmt: skip
    client, seen = _scripted_client(tiny_model, tmp_path, [out])
    with client:
        whole = _post(client, "completions", prompt=t5 + t6, echo=True, logprobs=1).json()["choices"][0]
        streamed = _events(_post(client, "completions", prompt=t5 + t6, echo=True, logprobs=1, stream=True))
        _post(client, "completions", logprobs=1)
    assert [(obj.return_logprob, obj.logprob_start_len) for obj in seen] == [(True, 0), (True, 0), (True, -1)]
    lp = whole["logprobs"]
    assert whole["text"] == t5 + t6 + t8 and lp["tokens"] == [t5, t6, t8]
    assert lp["token_logprobs"] == [None, -2.0, -0.5]
    assert lp["top_logprobs"] == [None, {t7: -1.0}, {t8: -0.5}]
    assert lp["text_offset"] == [0, len(t5), len(t5 + t6)]  # the completion starts after the echoed prompt
    assert streamed[0]["choices"][0]["logprobs"] == lp


def _serving(tokenizer: Any) -> Any:
    """The completions layer over a bare tokenizer (text_offsets needs nothing else)."""
    from types import SimpleNamespace

    from minisgl.entrypoints.openai.serving_completions import OpenAIServingCompletions

    return OpenAIServingCompletions(SimpleNamespace(tokenizer=tokenizer))


def test_text_offsets_point_at_each_token_in_the_text(tiny_model: str) -> None:
    """A character split over byte tokens (each printed as U+FFFD) begins where the character
    does, and every later token is found at its offset (summing token_str lengths drifted by
    3 per emoji, and the echoed prompt's offsets then ran past the completion's)."""
    from minisgl.utils import get_tokenizer

    tok = get_tokenizer(tiny_model)
    text = "Emoji \U0001F642 then the end. Caf\u00e9 na\u00efve \u65e5\u672c"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and any(tok.decode([i]) == "\ufffd" for i in ids)  # the premise: byte tokens
    offsets = _serving(tok).text_offsets(ids, text, 10)
    assert offsets == sorted(offsets) and offsets[0] == 10 and offsets[-1] <= 10 + len(text)
    for token_id, offset in zip(ids, offsets):
        piece = tok.decode([token_id])
        if piece != "\ufffd":
            assert text[offset - 10 : offset - 10 + len(piece)] == piece, (piece, offset)
    assert offsets[ids.index(tok.encode("\U0001F642", add_special_tokens=False)[0])] == 10 + text.index("\U0001F642")
    # a special token the text leaves out (a BOS the tokenizer added; <|im_start|>, an added
    # token marked special that all_special_ids does not name) takes no room
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert im_start not in tok.all_special_ids and tok.decode([im_start], skip_special_tokens=True) == ""  # the premise
    with_specials = _serving(tok).text_offsets([0] + ids[:3] + [im_start] + ids[3:], text, 10)
    assert with_specials == [10] + offsets[:3] + [offsets[3]] + offsets[3:]
    # bytes that never complete a character are each a U+FFFD of the text: one character apiece
    lone = [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"][:2] + tok.encode("Gor", add_special_tokens=False)
    garbled = tok.decode(lone)
    assert garbled.startswith("\ufffd\ufffdG")
    assert _serving(tok).text_offsets(lone, garbled)[:3] == [0, 1, 2]


def test_text_offsets_of_an_answer_keep_its_leading_space_with_a_sentencepiece_tokenizer() -> None:
    """A Llama-2-style (SentencePiece, byte-fallback) decoder drops the leading space of a
    decode's first token; an answer's text begins with one (the detokenizer decoded it after the
    prompt). Decoded without left context the first token never matched, and every offset
    stayed at the first."""
    from minisgl.test_utils import train_byte_fallback_tokenizer

    tok = train_byte_fallback_tokenizer()
    prompt = "The function returns"
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    full = tok.encode(prompt + " the value of the object", add_special_tokens=False)
    assert full[: len(prompt_ids)] == prompt_ids  # the premise: the answer's tokens follow the prompt's
    answer_ids = full[len(prompt_ids) :]
    head = tok.decode(prompt_ids[-5:])
    text = tok.decode(prompt_ids[-5:] + answer_ids)[len(head) :]  # what the detokenizer sends
    assert text.startswith(" the")
    expected = [len(tok.decode(prompt_ids[-5:] + answer_ids[:k])) - len(head) for k in range(len(answer_ids))]
    assert _serving(tok).text_offsets(answer_ids, text, 0, continues=True) == expected
    assert _serving(tok).text_offsets(prompt_ids, prompt) == [len(tok.decode(prompt_ids[:k])) for k in range(len(prompt_ids))]


def test_completions_top_logprobs_keep_the_likelier_of_two_tokens_that_print_alike(tiny_model: str, tmp_path: Any) -> None:
    from minisgl.utils import get_tokenizer

    tok = get_tokenizer(tiny_model)
    a, b = [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"][:2]  # two byte tokens
    out = _out("r", "x", 1, LENGTH)
    out["meta_info"].update(output_token_logprobs=[(-0.5, a, None)], output_top_logprobs=[[(-0.5, a, None), (-2.0, b, None)]])
    client, _ = _scripted_client(tiny_model, tmp_path, [out])
    with client:
        lp = _post(client, "completions", logprobs=2).json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{"\ufffd": -0.5}]


def test_chat_logprobs_carry_the_top_alternatives_asked_for(tiny_model: str, tmp_path: Any) -> None:
    out = _out("r", "x", 1, LENGTH)
    out["meta_info"].update(output_token_logprobs=[(-0.5, 5, None)], output_top_logprobs=[[(-0.5, 5, None), (-1.5, 6, None)]])
    client, seen = _scripted_client(tiny_model, tmp_path, [out])
    with client:
        content = _post(client, "chat", logprobs=True, top_logprobs=2).json()["choices"][0]["logprobs"]["content"]
    assert seen[0].return_logprob is True and seen[0].top_logprobs_num == 2
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5, -1.5]


def test_chat_passes_the_trim_spacing_min_tokens_and_rid_fields_on(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("mine", "x", 1, LENGTH)])
    with client:
        r = _chat(client, no_stop_trim=True, spaces_between_special_tokens=False, min_tokens=2, rid="mine")
    assert r.status_code == 200, r.text
    params = seen[0].sampling_params
    assert (params["no_stop_trim"], params["spaces_between_special_tokens"], params["min_new_tokens"]) == (True, False, 2)
    assert seen[0].rid == "mine"


def test_continue_final_message_continues_the_assistants_text(tiny_model: str, tmp_path: Any) -> None:
    """No generation prompt after it; and a last message that is not the assistant's is a 400."""
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", "x", 1, LENGTH)])
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}]
    with client:
        r = _chat(client, messages=msgs, continue_final_message=True)
        assert r.status_code == 200, r.text
        bad = _chat(client, messages=msgs[:1], continue_final_message=True)
    assert seen[0].text.endswith("one, two,")
    assert bad.status_code == 400 and "continue_final_message" in bad.json()["error"]["message"]
    assert len(seen) == 1


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_choices_are_in_index_order_whichever_finishes_first(tiny_model: str, tmp_path: Any, route: str) -> None:
    outs = [_out("r-1", "second", 1, LENGTH, index=1), _out("r-0", "first", 1, LENGTH, index=0)]
    client, _ = _scripted_client(tiny_model, tmp_path, outs)
    with client:
        choices = _post(client, route, n=2).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["message"]["content"] if route == "chat" else c["text"] for c in choices] == ["first", "second"]


@pytest.mark.parametrize("incremental", [False, True])
def test_a_generate_stream_is_cumulative_unless_incremental_streaming_output(tiny_model: str, tmp_path: Any, incremental: bool) -> None:
    """SGLang's /generate streams everything so far; --incremental-streaming-output, what each chunk adds."""
    outs = [_out("r", "ab", 1), _out("r", "cd", 2, LENGTH)]
    outs[1]["output_ids"] = [6]  # the TokenizerManager's dicts are deltas
    args = resolve_server_args(ServerArgs(model_path=tiny_model, device="cpu", incremental_streaming_output=incremental))
    client, _ = _scripted_client(tiny_model, tmp_path, outs, server_args=args)
    with client:
        r = client.post("/generate", json={"text": "hi", "stream": True})
    chunks = [e for e in _events(r) if e != "[DONE]"]
    if incremental:
        assert [(c["text"], c["output_ids"]) for c in chunks] == [("ab", [5]), ("cd", [6])]
    else:
        assert [(c["text"], c["output_ids"]) for c in chunks] == [("ab", [5]), ("abcd", [5, 6])]


def test_chat_template_kwargs_reach_the_template_and_unused_ones_are_refused(tiny_model: str, tmp_path: Any) -> None:
    """SGLang's chat_template_kwargs (Qwen3's {"enable_thinking": false}) are template variables;
    one the template never reads would be dropped without a word, so it is a 400."""
    import copy

    from minisgl.utils import get_tokenizer

    tokenizer = copy.deepcopy(get_tokenizer(tiny_model))
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %} <no-think>{% endif %}{% endif %}"
    )
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", "ok", 1, LENGTH)], tokenizer=tokenizer)
    with client:
        assert _post(client, "chat", chat_template_kwargs={"enable_thinking": False}).status_code == 200
        assert _post(client, "chat").status_code == 200
        unused = _post(client, "chat", chat_template_kwargs={"reasoning": "high"})
        reserved = _post(client, "chat", chat_template_kwargs={"tokenize": True})
    assert seen[0].text.endswith("assistant: <no-think>") and seen[1].text.endswith("assistant:")
    assert unused.status_code == 400 and "['reasoning'] are not used by this model's chat template" in unused.text
    assert reserved.status_code == 400 and "arguments of apply_chat_template itself" in reserved.text


def test_a_chat_template_this_jinja_cannot_compile_is_a_400_and_generation_blocks_are_read(tiny_model: str, tmp_path: Any) -> None:
    """Looking for the template's variables compiled it outside the render's error handling: an
    unknown filter was a 500 on every chat request. transformers' {% generation %} block hid a
    template's variables, so every chat_template_kwargs key passed unchecked."""
    import copy

    from minisgl.chat_template import template_variables
    from minisgl.utils import get_tokenizer

    tokenizer = copy.deepcopy(get_tokenizer(tiny_model))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] | nosuchfilter }}{% endfor %}"
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "ok", 1, LENGTH)], tokenizer=tokenizer)
    with client:
        r = _post(client, "chat")
        assert r.status_code == 400 and "Cannot apply the chat template" in r.text
    marked = "{% for m in messages %}{% generation %}{{ m['content'] }}{{ eos }}{% endgeneration %}{% endfor %}"
    assert template_variables(marked) == {"messages", "eos"}


def test_sglangs_unbuilt_fields_on_the_openai_routes_are_null_or_refused_by_name(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "ok", 1, LENGTH)])
    with client:
        assert _post(client, "chat", regex=None, ebnf=None, json_schema=None, stop_regex=None).status_code == 200
        r = _post(client, "completions", bootstrap_room=1)
    assert r.status_code == 400 and "'bootstrap_room': it is not supported by minisgl" in r.text


def _lora_client(tiny_model: str, tmp_path: Any, **args: Any) -> Any:
    """A scripted app whose server has --lora-paths a=... b=... (directories only: the TokenizerManager
    checks names, the ModelRunner, not built here, would load them)."""
    paths = []
    for name in ("a", "b"):
        (tmp_path / f"adapter-{name}").mkdir()
        paths.append(f"{name}={tmp_path / f'adapter-{name}'}")
    return _scripted_client(tiny_model, tmp_path, [_out("r", "ok", 1, LENGTH)], args={"lora_paths": tuple(paths), **args})


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_the_adapter_comes_from_model_base_colon_name_or_the_lora_path_field(tiny_model: str, tmp_path: Any, route: str) -> None:
    """SGLang's LoRA syntax on the OpenAI routes: model "BASE:NAME" (it wins over lora_path), else the
    lora_path field; the answer names the model as the client sent it. (The TokenizerManager checks the name.)"""
    client, seen = _lora_client(tiny_model, tmp_path)
    with client:
        for model, lora_path, want in (
            (client.model, "x", "x"), (f"{client.model}:a", None, "a"), (f"{client.model}:a", "x", "a"),
            ("default:b", None, "b"), (client.model, None, None),
            (f"{client.model}: b ", None, "b"), (f"{client.model}:", "x", "x"),  # (stripped; empty: no adapter, as SGLang)
        ):
            r = _post(client, route, model=model, **({"lora_path": lora_path} if lora_path else {}))
            assert r.status_code == 200 and r.json()["model"] == model and seen[-1].lora_path == want, r.text
        assert _post(client, route, model="another:a").status_code == 404  # (the base must be this server's model)


def test_a_served_name_with_a_colon_still_reaches_adapters(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _lora_client(tiny_model, tmp_path, served_model_name="llama3:8b")
    with client:
        for model, want in (("llama3:8b", None), ("llama3:8b:a", "a"), ("default:b", "b"), ("llama3:8b:", None)):
            r = _post(client, "chat", model=model)
            assert r.status_code == 200 and seen[-1].lora_path == want, (model, r.text)
        assert _post(client, "chat", model="llama3:a").status_code == 404  # ("llama3" is not the served model)


def test_an_adapter_in_model_on_a_server_without_adapters_is_a_400_about_model(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", "ok", 1, LENGTH)])
    with client:
        r = _post(client, "chat", model=f"{client.model}:x")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "model" and not seen
    assert f"model '{client.model}:x' names LoRA adapter 'x'" in err["message"] and "serves no adapters" in err["message"]
    assert "lora_path" not in err["message"]


def test_models_lists_each_adapter_and_retrieves_it(tiny_model: str, tmp_path: Any) -> None:
    """SGLang's /v1/models: one card per adapter, id its name, root its directory, parent the served model."""
    client, _ = _lora_client(tiny_model, tmp_path)
    with client:
        data = client.get("/v1/models").json()["data"]
        assert [(m["id"], m["root"], m["parent"]) for m in data] == [
            (client.model, client.model, None),
            ("a", str(tmp_path / "adapter-a"), client.model),
            ("b", str(tmp_path / "adapter-b"), client.model),
        ]
        assert data[0]["max_model_len"] is not None and data[1]["max_model_len"] is None
        card = client.get("/v1/models/b").json()
        assert card["id"] == "b" and card["parent"] == client.model and card["root"] == str(tmp_path / "adapter-b")
        assert client.get("/v1/models/default").json()["id"] == client.model
        assert client.get("/v1/models/zzz").status_code == 404


def test_response_format_takes_sglangs_schema_without_its_wrapper(tiny_model: str, tmp_path: Any) -> None:
    """{"type": "json_schema", "schema": {...}}: SGLang names it after the schema's title and takes it."""
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", "{}", 1, LENGTH)])
    schema = {"title": "Pet", "type": "object"}
    with client:
        assert _post(client, "chat", response_format={"type": "json_schema", "schema": schema}).status_code == 200
        assert _post(client, "chat", response_format={"type": "json_schema", "schema": schema, "strict": True}).status_code == 200
        r = _post(client, "chat", response_format={"type": "json_schema", "schema": schema, "json_schema": {"name": "x", "schema": {}}})
    assert json.loads(seen[0].sampling_params["json_schema"]) == schema
    assert r.status_code == 400  # (both shapes at once: the wrapper's, and an unknown "schema" beside it)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_response_format_structural_tag_goes_down_as_sglangs_key_in_either_shape(tiny_model: str, tmp_path: Any, route: str) -> None:
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", "ok", 1, LENGTH)])
    structures = [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}]
    fmt = {"type": "triggered_tags", "triggers": ["<f"], "tags": [{"type": "tag", "begin": "<f>", "content": {"type": "any_text"}, "end": "</f>"}]}
    with client:
        assert _post(client, route, response_format={"type": "structural_tag", "structures": structures, "triggers": ["<f"]}).status_code == 200
        assert _post(client, route, response_format={"type": "structural_tag", "format": fmt}).status_code == 200
    assert json.loads(seen[0].sampling_params["structural_tag"]) == {"structures": structures, "triggers": ["<f"]}
    assert json.loads(seen[1].sampling_params["structural_tag"]) == {"type": "structural_tag", "format": fmt}


def test_a_stream_refused_by_the_scheduler_is_its_error_event_alone(tiny_model: str, tmp_path: Any) -> None:
    """A grammar that does not compile: the error event and [DONE], no role chunk before them (SGLang's order)."""
    refused = {"type": "abort", "message": "Invalid regex: Unclosed '['", "status_code": 400, "err_type": "BadRequestError"}
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "", 0, refused)])
    with client:
        events = _events(_post(client, "chat", stream=True, regex="["))
    assert events[0]["error"]["message"] == "Invalid regex: Unclosed '['" and events[1:] == ["[DONE]"]
