"""The Ollama API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version, /), without
model processes: the app in-process with a TokenizerManager that answers with scripted outputs
(test_openai_protocol's _scripted_client), the translation to a chat request on its own, and the
answers read by the `ollama` client's own types."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import pytest
from ollama import ChatResponse, GenerateResponse, ListResponse, ProcessResponse, ShowResponse

from test_anthropic import CALL, LENGTH, STOP, THOUGHT, TOOLS_TEMPLATE
from test_openai_protocol import _out, _scripted_client
from test_responses import TOOLS_TEMPLATE as EFFORT_TEMPLATE  # (it reads reasoning_effort)

from minisgl.entrypoints.ollama import model_info
from minisgl.entrypoints.ollama.convert import chat_messages, format_fields, keep_alive_seconds, options_fields, to_chat_request
from minisgl.entrypoints.ollama.protocol import BadOllamaRequest, OllamaChatRequest
from minisgl.entrypoints.ollama.serving import OLLAMA_API_VERSION
from minisgl.lora.lora_registry import LoRARegistry

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}  # fmt: skip
HI = [{"role": "user", "content": "hi"}]


def _client(tiny_model: str, tmp_path: Any, outs: List[Dict[str, Any]], template: Optional[str] = None, **args: Any) -> Tuple[Any, List[Any]]:
    return _scripted_client(tiny_model, tmp_path, outs, args=args, template=template)


def _chat(client: Any, **body: Any) -> Any:
    return client.post("/api/chat", json={"model": client.model, "messages": HI, **body})


def _lines(r: Any) -> List[Dict[str, Any]]:
    """A newline-delimited JSON stream's objects."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson"), r.text
    return [json.loads(line) for line in r.text.splitlines()]


def _assert_error(r: Any, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"] and needle in body["error"], body


# --------------------------------------------------------------------------- translation
def test_messages_tool_calls_and_tool_results_become_chat_messages() -> None:
    request = OllamaChatRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"role": "assistant", "content": "", "thinking": "Two calls.", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "12:00", "tool_name": "get_time"},  # (answered by name, out of order)
        {"role": "tool", "content": "sunny"},  # (the next unanswered call)
    ]})  # fmt: skip
    chat = chat_messages(request.messages or [])
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool", "tool"]
    calls = chat[2]["tool_calls"]
    assert chat[2]["reasoning_content"] == "Two calls." and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}, {}]
    assert (chat[3]["tool_call_id"], chat[3]["name"], chat[4]["tool_call_id"]) == (calls[1]["id"], "get_time", calls[0]["id"])
    with pytest.raises(BadOllamaRequest, match=r"messages\[1\]: this tool message \(tool_name 'nope'\) answers no"):
        chat_messages(OllamaChatRequest.model_validate({"model": "m", "messages": [HI[0], {"role": "tool", "content": "x", "tool_name": "nope"}]}).messages or [])


def test_options_map_to_sampling_fields() -> None:
    fields = options_fields({"temperature": 0, "top_p": 0.9, "top_k": 0, "min_p": 0.05, "seed": 7, "num_predict": -1, "stop": ["END"],
                             "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25, "num_ctx": 512, "num_keep": 4,
                             "typical_p": 1.0, "mirostat": 0, "mirostat_tau": 5.0, "top_logprobs_not": None}, context_len=2048)  # fmt: skip
    assert fields == {"temperature": 0.0, "top_p": 0.9, "top_k": -1, "min_p": 0.05, "seed": 7, "max_tokens": None, "stop": ["END"],
                      "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25}  # fmt: skip
    assert options_fields({"num_predict": 12, "top_k": 40}, 2048) == {"max_tokens": 12, "top_k": 40}
    chat = to_chat_request(OllamaChatRequest.model_validate({"model": "m", "messages": HI, "options": {"num_predict": 3, "repeat_penalty": 1.2}}),
                           HI, "r", 2048, {})  # fmt: skip
    params = chat.to_sampling_params()
    assert (params["max_new_tokens"], params["repetition_penalty"]) == (3, 1.2)


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"num_gpu": 1}, "option 'num_gpu' is a setting of Ollama's model runner"),
        ({"num_thread": 8}, "option 'num_thread' is a setting of Ollama's model runner"),
        ({"mirostat": 2}, "option 'mirostat' 2 cannot be honoured: mirostat sampling is not built"),
        ({"typical_p": 0.7}, "typical_p"),
        ({"repeat_last_n": 64}, "option 'repeat_last_n' 64 cannot be honoured"),
        ({"repeat_last_n": 0, "repeat_penalty": 1.2}, "option 'repeat_last_n' 0 switches the penalties off, but option 'repeat_penalty' is 1.2"),
        ({"num_ctx": 0}, "option 'num_ctx' must be a positive number of tokens"),
        ({"num_predict": -3}, "option 'num_predict' must be >= 0"),
        ({"seed": -2}, "option 'seed' must be >= 0, or -1 (a random seed)"),
        ({"wat": 1}, "option 'wat' is not an option minisgl knows"),
        ({"top_k": "many"}, "option 'top_k' must be of type integer"),
        ({"temperature": 5}, "option 'temperature': Input should be less than or equal to 2"),
    ],
)
def test_options_minisgl_cannot_honour_are_a_400_naming_them(tiny_model: str, tmp_path: Any, options: Dict[str, Any], needle: str) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)])
    with client:
        _assert_error(_chat(client, options=options, stream=False), 400, needle)
    assert seen == []  # (nothing reached the engine)


def test_format_keep_alive_and_fields_it_refuses() -> None:
    assert format_fields("json") == {"response_format": {"type": "json_object"}} and format_fields("") == {}
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}}
    assert format_fields(schema)["response_format"]["json_schema"]["schema"] == schema
    assert (keep_alive_seconds("5m"), keep_alive_seconds("1h30m"), keep_alive_seconds(-1), keep_alive_seconds("0s")) == (300, 5400, -1, 0)
    with pytest.raises(BadOllamaRequest, match="not a duration"):
        keep_alive_seconds("soon")


@pytest.mark.parametrize(
    "route, body, needle",
    [
        ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "messages[0].images: images are not supported"),
        ("/api/generate", {"prompt": "x", "images": ["aGk="]}, "images: images are not supported"),
        ("/api/generate", {"prompt": "def f(", "suffix": "return y"}, "suffix (fill-in-the-middle) is not supported"),
        ("/api/generate", {"prompt": "x", "template": "{{ .Prompt }}"}, "not Ollama's Go templates"),
        ("/api/generate", {"prompt": "x", "context": [1, 2]}, "context (deprecated by Ollama) is not supported"),
        ("/api/generate", {"prompt": "x", "raw": True, "system": "s"}, "raw: true skips"),
        ("/api/chat", {"keep_alive": 0}, "keep_alive 0 with no prompt is Ollama's call to unload the model"),
        ("/api/chat", {"messages": HI, "keep_alive": "0s"}, "keep_alive 0 asks to unload the model"),
        ("/api/chat", {"messages": HI, "truncate": True}, "truncate true cannot be honoured"),
        ("/api/chat", {"messages": HI, "format": "yaml"}, "format 'yaml' is not supported"),
        ("/api/chat", {"messages": HI, "think": True}, "does not support thinking"),
        ("/api/chat", {"messages": HI, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ("/api/chat", {"messages": HI, "tools": [WEATHER]}, "--tool-call-parser"),
        ("/api/chat", {"messages": HI, "frobnicate": 1}, "Unsupported parameter 'frobnicate'"),
    ],
)
def test_bad_input_is_ollamas_400(tiny_model: str, tmp_path: Any, route: str, body: Dict[str, Any], needle: str) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)])
    with client:
        _assert_error(client.post(route, json={"model": client.model, **body}), 400, needle)
    assert seen == []


def test_an_unknown_model_is_ollamas_404_and_name_latest_is_the_served_model(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "Hi!", 2, STOP)])
    with client:
        _assert_error(client.post("/api/chat", json={"model": "llama3.2", "messages": HI, "stream": False}), 404, "model 'llama3.2' not found")
        _assert_error(client.post("/api/show", json={"model": "llama3.2"}), 404, "model 'llama3.2' not found")
        answer = ChatResponse(**client.post("/api/chat", json={"model": client.model + ":latest", "messages": HI, "stream": False}).json())
    assert answer.message.content == "Hi!" and answer.model == client.model + ":latest" and len(seen) == 1


# --------------------------------------------------------------------------- answers
def test_a_stream_is_ndjson_chunks_then_a_final_one_with_counts_and_durations(tiny_model: str, tmp_path: Any) -> None:
    outs = [_out("r", "Hel", 1), _out("r", "lo", 2), _out("r", "!", 3, STOP)]
    client, seen = _client(tiny_model, tmp_path, outs)
    with client:
        lines = _lines(_chat(client))  # (no "stream": Ollama's default is true)
        generated = _lines(client.post("/api/generate", json={"model": client.model, "prompt": "hi"}))
    chunks = [ChatResponse(**line) for line in lines]
    assert [c.message.content for c in chunks] == ["Hel", "lo", "!", ""] and [c.done for c in chunks] == [False, False, False, True]
    final = chunks[-1]
    assert final.done_reason == "stop" and (final.prompt_eval_count, final.eval_count) == (3, 3) and final.load_duration == 0
    durations = (final.total_duration, final.prompt_eval_duration, final.eval_duration)
    assert all(isinstance(d, int) and d >= 0 for d in durations) and final.total_duration >= final.prompt_eval_duration + final.eval_duration
    assert "done_reason" not in lines[0] and "total_duration" not in lines[0]
    assert [GenerateResponse(**line).response for line in generated] == ["Hel", "lo", "!", ""] and generated[-1]["done_reason"] == "stop"
    assert all(obj.stream for obj in seen)  # (streamed inside: the first output dates the prompt's evaluation)


def test_a_whole_answer_and_done_reason_length(tiny_model: str, tmp_path: Any) -> None:
    outs = [_out("r", "Hel", 1), _out("r", "lo", 2, LENGTH)]
    client, seen = _client(tiny_model, tmp_path, outs)
    with client:
        chat = ChatResponse(**_chat(client, stream=False, options={"num_predict": 2, "temperature": 0}).json())
        gen = GenerateResponse(**client.post("/api/generate", json={"model": client.model, "prompt": "hi", "stream": False, "system": "Be brief."}).json())
    assert (chat.message.content, chat.done, chat.done_reason, chat.eval_count) == ("Hello", True, "length", 2)
    assert (gen.response, gen.done_reason) == ("Hello", "length")
    assert (seen[0].sampling_params["max_new_tokens"], seen[0].sampling_params["temperature"]) == (2, 0.0)
    assert "Be brief." in seen[1].text and seen[1].text.index("Be brief.") < seen[1].text.index("hi")  # (system, then the prompt, templated)


def test_a_body_sent_without_a_json_content_type_is_read_as_json(tiny_model: str, tmp_path: Any) -> None:
    """Ollama's documented `curl .../api/chat -d '{...}'` sends a form Content-Type; Ollama reads JSON anyway."""
    client, seen = _client(tiny_model, tmp_path, [_out("r", "Hi", 1, LENGTH)])
    body = json.dumps({"model": client.model, "messages": [{"role": "user", "content": "hi"}], "stream": False})
    with client:
        r = client.post("/api/chat", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text
    assert ChatResponse(**r.json()).message.content == "Hi" and len(seen) == 1


def test_raw_sends_the_prompt_as_it_is(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "<think>not split</think> ok", 2, STOP)], reasoning_parser="qwen3")
    with client:
        gen = client.post("/api/generate", json={"model": client.model, "prompt": "[INST] hi [/INST]", "raw": True, "stream": False}).json()
    assert seen[0].text == "[INST] hi [/INST]" and gen["response"] == "<think>not split</think> ok" and "thinking" not in gen


def test_thinking_comes_back_in_its_field(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [_out("r", THOUGHT, 3, STOP)], reasoning_parser="qwen3")
    with client:
        whole = ChatResponse(**_chat(client, stream=False, think=True).json())
        lines = _lines(_chat(client, think=True))
        gen = GenerateResponse(**client.post("/api/generate", json={"model": client.model, "prompt": "hi", "stream": False}).json())
    assert (whole.message.thinking, whole.message.content) == ("The user greets me.", "Hello there!")
    assert "".join(line["message"].get("thinking", "") for line in lines).strip() == "The user greets me."
    assert "".join(line["message"]["content"] for line in lines).strip() == "Hello there!"
    assert (gen.thinking, gen.response) == ("The user greets me.", "Hello there!")


def test_tool_calls_come_whole_with_object_arguments(tiny_model: str, tmp_path: Any) -> None:
    answer = "Sure.\n" + CALL
    pieces = [answer[k : k + 9] for k in range(0, len(answer), 9)]
    args = dict(template=TOOLS_TEMPLATE, tool_call_parser="qwen25")
    whole, _ = _client(tiny_model, tmp_path, [_out("r", answer, 9, STOP)], **args)
    streamed, _ = _client(tiny_model, tmp_path, [_out("r", p, i + 1, STOP if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)], **args)
    with whole:
        message = ChatResponse(**_chat(whole, stream=False, tools=[WEATHER]).json()).message
    with streamed:
        lines = _lines(_chat(streamed, tools=[WEATHER]))
    expected = [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}]
    assert message.content == "Sure." and [{"name": c.function.name, "arguments": dict(c.function.arguments)} for c in message.tool_calls or []] == expected
    with_calls = [line for line in lines if line["message"].get("tool_calls")]
    assert len(with_calls) == 1 and [{k: c["function"][k] for k in ("name", "arguments")} for c in with_calls[0]["message"]["tool_calls"]] == expected
    assert "".join(line["message"]["content"] for line in lines).strip() == "Sure." and lines[-1]["done_reason"] == "stop"
    # text after the call: the parse refuses it, so the answer is text, both ways (no call streams ahead of it)
    text = CALL + "\nDone."
    client, _ = _client(tiny_model, tmp_path, [_out("r", CALL, 5), _out("r", "\nDone.", 6, STOP)], **args)
    with client:
        lines = _lines(_chat(client, tools=[WEATHER]))
    assert not any(line["message"].get("tool_calls") for line in lines) and "".join(line["message"]["content"] for line in lines) == text


def test_format_goes_to_the_grammar_and_a_grammar_abort_is_a_400(tiny_model: str, tmp_path: Any) -> None:
    abort = {"type": "abort", "message": "json_schema needs xgrammar, which is not installed: pip install xgrammar", "status_code": 400}
    client, seen = _client(tiny_model, tmp_path, [_out("r", '{"age": 22}', 4, STOP)])
    refused, _ = _client(tiny_model, tmp_path, [_out("r", "", 0, abort)])
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    with client:
        assert _chat(client, stream=False, format=schema).json()["message"]["content"] == '{"age": 22}'
        assert _chat(client, stream=False, format="json").status_code == 200
    assert json.loads(seen[0].sampling_params["json_schema"]) == schema and json.loads(seen[1].sampling_params["json_schema"]) == {"type": "object"}
    with refused:
        _assert_error(_chat(refused, stream=False, format="json"), 400, "pip install xgrammar")
        _assert_error(_chat(refused, format="json"), 400, "pip install xgrammar")  # (streamed: refused before the first line)


def test_logprobs_come_per_token(tiny_model: str, tmp_path: Any) -> None:
    out = _out("r", "ab", 2, STOP)
    out["meta_info"]["output_token_logprobs"] = [(-0.5, 5, None), (-1.5, 6, None)]
    out["meta_info"]["output_top_logprobs"] = [[(-0.5, 5, None)], [(-1.5, 6, None)]]
    client, seen = _client(tiny_model, tmp_path, [out])
    with client:
        body = _chat(client, stream=False, logprobs=True, top_logprobs=1).json()
    assert [entry["logprob"] for entry in ChatResponse(**body).logprobs or []] == [-0.5, -1.5]
    assert len(body["logprobs"][0]["top_logprobs"]) == 1 and seen[0].return_logprob and seen[0].top_logprobs_num == 1


def test_the_load_call_answers_without_generating(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)])
    with client:
        loaded = client.post("/api/chat", json={"model": client.model, "messages": []}).json()
        generated = client.post("/api/generate", json={"model": client.model}).json()
    assert (loaded["done"], loaded["done_reason"], loaded["message"]["content"]) == (True, "load", "")
    assert (generated["done"], generated["done_reason"], generated["response"]) == (True, "load", "") and seen == []


# --------------------------------------------------------------------------- the model, the probe, the key
def test_tags_show_ps_version_and_the_probe(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [], reasoning_parser="qwen3")
    with client:
        assert client.get("/").text == "Ollama is running" and client.head("/").status_code == 200
        tags = ListResponse(**client.get("/api/tags").json())
        show = ShowResponse(**client.post("/api/show", json={"model": client.model}).json())
        ps = ProcessResponse(**client.get("/api/ps").json())
        version = client.get("/api/version").json()
        _assert_error(client.post("/api/show", json={"model": client.model, "verbose": True}), 400, "verbose")
        _assert_error(client.post("/api/pull", json={"model": "llama3.2"}), 404, "Not Found")  # (model management: not built)
    config = json.load(open(f"{tiny_model}/config.json"))
    (entry,) = tags.models
    assert entry.model == client.model and len(entry.digest or "") == 64 and (entry.size or 0) > 0
    assert entry.details.family == config["model_type"] and entry.details.parameter_size not in (None, "unknown")
    assert show.modelinfo[f"{config['model_type']}.block_count"] == config["num_hidden_layers"]
    assert show.capabilities == ["completion", "thinking"] and show.details == entry.details
    assert ps.models[0].size_vram == 0 and ps.models[0].context_length > 0  # (the CPU)
    assert isinstance(version["version"], str) and version["version"].count(".") == 2


def test_the_api_key_guards_the_api_but_not_the_probe(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)], api_key="sekret")
    with client:
        assert client.get("/").status_code == 200
        _assert_error(client.get("/api/tags"), 401, "unauthorized")
        assert client.get("/api/tags", headers={"authorization": "Bearer sekret"}).status_code == 200


# --------------------------------------------------------------------------- what Ollama's own clients send
def test_show_takes_the_go_clients_empty_fields_and_refuses_set_ones_by_name(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [])
    with client:
        # (the body `ollama show` / `ollama run` send: api.ShowRequest has no omitempty)
        go_body = {"model": client.model, "system": "", "template": "", "verbose": False, "options": None, "name": ""}
        r = client.post("/api/show", json=go_body)
        assert r.status_code == 200, r.text
        assert ShowResponse(**r.json()).capabilities == ["completion"]
        _assert_error(client.post("/api/show", json={"model": client.model, "system": "x"}), 400, "system cannot be honoured by /api/show")
        _assert_error(client.post("/api/show", json={"model": client.model, "options": {"temperature": 0}}), 400, "options cannot be honoured")
        _assert_error(client.post("/api/show", json={"model": "", "name": ""}), 400, "model is required")


def test_seed_minus_one_is_random_and_num_predict_zero_is_no_limit(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)])
    with client:
        for options in ({"seed": -1, "num_predict": 0}, {"seed": 7, "num_predict": -1}, {}):
            assert _chat(client, stream=False, options=options).status_code == 200
    random, seeded, default = (obj.sampling_params for obj in seen)
    assert random.get("seed") is None and seeded["seed"] == 7  # (-1: Ollama's default, a random seed)
    assert random["max_new_tokens"] == seeded["max_new_tokens"] == default["max_new_tokens"]  # (0 like -1: no limit)


def test_num_ctx_above_the_context_is_clamped_below_it_a_longer_prompt_is_refused(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "Hi", 1, STOP)])  # (the prompt: 3 tokens)
    with client:
        assert _chat(client, stream=False, options={"num_ctx": 1_000_000}).json()["message"]["content"] == "Hi"
        assert _chat(client, stream=False, options={"num_ctx": 3}).status_code == 200
        _assert_error(_chat(client, stream=False, options={"num_ctx": 2}), 400, "option 'num_ctx' 2 is shorter than the prompt (3 tokens)")
        _assert_error(_chat(client, options={"num_ctx": 2}), 400, "option 'num_ctx' 2")  # (streamed: before the first line)
        _assert_error(client.post("/api/generate", json={"model": client.model, "prompt": "hi", "options": {"num_ctx": 2}}), 400, "num_ctx")
    assert len(seen) == 5


def test_repeat_last_n_zero_switches_the_penalties_off(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)])
    with client:
        assert _chat(client, stream=False, options={"repeat_last_n": 0, "repeat_penalty": 1.0}).status_code == 200
    params = seen[0].sampling_params
    assert (params["repetition_penalty"], params["presence_penalty"], params["frequency_penalty"]) == (1.0, 0.0, 0.0)


def test_raw_generate_keeps_the_adapter_and_the_chat_fields(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)], lora_registry=LoRARegistry([("ad", str(tmp_path))]))
    with client:
        for raw in (True, False):
            body = {"model": f"{client.model}:ad", "prompt": "hi", "raw": raw, "stream": False, "logprobs": True, "options": {"seed": 3}}
            assert client.post("/api/generate", json=body).status_code == 200
    raw_obj, templated = seen
    assert raw_obj.text == "hi" and raw_obj.lora_path == templated.lora_path == "ad"
    for name in ("return_logprob", "priority", "custom_logit_processor", "extra_key", "rid"):
        assert (getattr(raw_obj, name) is None) == (getattr(templated, name) is None), name
    assert raw_obj.return_logprob and raw_obj.sampling_params["seed"] == templated.sampling_params["seed"] == 3


def test_think_max_is_the_highest_reasoning_effort(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", THOUGHT, 3, STOP)], template=EFFORT_TEMPLATE, reasoning_parser="qwen3")
    with client:
        assert ChatResponse(**_chat(client, stream=False, think="max").json()).message.thinking == "The user greets me."
    assert seen[0].text.startswith("effort=high\n")


def test_lowercase_roles_head_tags_version_and_an_empty_body(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)])
    with client:
        r = client.post("/api/chat", json={"model": client.model, "messages": [{"role": "User", "content": "hello"}], "stream": False})
        assert r.status_code == 200, r.text
        assert client.head("/api/tags").status_code == 200
        assert client.get("/api/version").json() == {"version": OLLAMA_API_VERSION}
        _assert_error(client.post("/api/chat"), 400, "missing request body")
        _assert_error(client.post("/api/chat", content=b"", headers={"content-type": "application/json"}), 400, "missing request body")
    assert "hello" in seen[0].text


def test_a_streamed_tool_answer_keeps_its_logprobs_and_thinking(tiny_model: str, tmp_path: Any) -> None:
    answer = "<think>\nLook it up.\n</think>\n\n" + CALL
    pieces = [answer[k : k + 9] for k in range(0, len(answer), 9)]
    outs = []
    for i, piece in enumerate(pieces):
        out = _out("r", piece, i + 1, STOP if i == len(pieces) - 1 else None)
        out["meta_info"]["output_token_logprobs"] = [(-0.1 * (i + 1), 5, None)]  # (one token per piece)
        outs.append(out)
    whole_out = _out("r", answer, len(pieces), STOP)
    whole_out["meta_info"]["output_token_logprobs"] = [(-0.1 * (i + 1), 5, None) for i in range(len(pieces))]
    args = dict(template=TOOLS_TEMPLATE, tool_call_parser="qwen25", reasoning_parser="qwen3")
    streamed, _ = _client(tiny_model, tmp_path, outs, **args)
    whole, _ = _client(tiny_model, tmp_path, [whole_out], **args)
    with streamed:
        lines = _lines(_chat(streamed, tools=[WEATHER], logprobs=True))
    with whole:
        body = _chat(whole, tools=[WEATHER], logprobs=True, stream=False).json()
    assert [e["logprob"] for line in lines for e in line.get("logprobs", [])] == [e["logprob"] for e in body["logprobs"]]
    assert len(body["logprobs"]) == len(pieces) and body["message"]["tool_calls"]
    assert "".join(line["message"].get("thinking", "") for line in lines).strip() == body["message"]["thinking"].strip() == "Look it up."


# --------------------------------------------------------------------------- the model's fields, read once
def test_the_model_fields_are_read_once_per_weight_version(tiny_model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: List[str] = []
    read = model_info.read_weights
    monkeypatch.setattr(model_info, "read_weights", lambda d: reads.append(d) or read(d))
    model_info.served_model.cache_clear()
    client, _ = _client(tiny_model, tmp_path, [])
    with client:
        first = client.get("/api/tags").json()
        assert client.get("/api/tags").json() == first and client.get("/api/ps").status_code == 200
        assert len(reads) == 1
        client.tm.weight_version = "v2"  # (a weight update: read again)
        assert client.get("/api/tags").json()["models"][0]["digest"] != first["models"][0]["digest"] and len(reads) == 2


def test_a_hub_id_is_read_from_its_snapshot_in_the_cache(tiny_model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from huggingface_hub import constants

    # the cache layout the loader's snapshot_download leaves: models--ORG--NAME/{refs/main, snapshots/<commit>/}
    repo = tmp_path / "hub" / "models--minisgl-test--tiny"
    commit = "0" * 40
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    served = model_info.ServedModel("tiny", "minisgl-test/tiny", "default", 2048)
    local = model_info.ServedModel("tiny", tiny_model, "default", 2048)
    assert served.model_dir == str(repo / "snapshots" / commit)
    assert served.weights == local.weights and served.weights.size > 0 and served.family == local.family != "unknown"
