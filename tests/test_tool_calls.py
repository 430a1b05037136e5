"""Forced tool calls: tool_choice "required" or a named function, through structured output.

Scripted outputs (no model) check the request checks, the schema sent down and the response
shapes; the Engine on the random tiny model checks that the schema really forces a call.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest

from test_openai_fields import _events
from test_openai_protocol import _out, _scripted_client
from test_tool_parsers import streamed_calls, tool_deltas

from minisgl.entrypoints.openai.protocol import ChatCompletionRequest
from minisgl.entrypoints.openai.tool_calls import parse_tool_calls, tool_call_constraint

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
STOP = {"type": "stop", "matched": 2}


def _chat(client: Any, **body: Any) -> Any:
    payload: Dict[str, Any] = {"model": client.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
    return client.post("/v1/chat/completions", json={**payload, **body})


def _request(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


# --------------------------------------------------------------------------- schema and parser
def test_the_constraint_is_sglangs_array_of_calls() -> None:
    required = json.loads(tool_call_constraint(_request(tools=[WEATHER, TIME], tool_choice="required")))
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    names = [option["properties"]["name"]["enum"] for option in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    named = json.loads(tool_call_constraint(_request(tools=[WEATHER, TIME], parallel_tool_calls=False,
                                                     tool_choice={"type": "function", "function": {"name": "get_time"}})))  # fmt: skip
    assert named["maxItems"] == 1 and named["items"]["properties"]["name"]["enum"] == ["get_time"]
    assert tool_call_constraint(_request(tools=[WEATHER], tool_choice="none")) is None


def test_parse_tool_calls_takes_only_a_whole_array_of_calls() -> None:
    calls = parse_tool_calls(CALL)
    assert calls is not None and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"} and calls[0].id.startswith("call_")
    for text in ('[{"name": "get_weather", "parameters": {"ci', "[]", '{"name": "x", "parameters": {}}', '[{"name": 3, "parameters": {}}]'):
        assert parse_tool_calls(text) is None, text


# --------------------------------------------------------------------------- the route, scripted
@pytest.mark.parametrize(
    "body, needle",
    [
        ({"tool_choice": "required"}, "Tools cannot be empty if tool choice is set to required."),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "Tools cannot be empty if tool choice is set to a specific tool."),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "Tool 'nope' not found in tools list."),
        ({"tools": [WEATHER]}, 'tool_choice "auto" (the default when tools are given) needs a parser'),
        ({"tools": [WEATHER], "tool_choice": "required", "regex": "a+"}, "constrains the output to a tool call; drop regex"),
        # (response_format becomes a json_schema inside: the message names what the user sent)
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool call; drop response_format"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"}, "name"),
        ({"messages": [{"role": "tool", "content": "18C"}]}, "tool_call_id"),
        ({"messages": [{"role": "user"}]}, "a user message needs content"),
    ],
)
def test_tool_requests_that_cannot_work_are_400s(tiny_model: str, tmp_path: Any, body: Dict[str, Any], needle: str) -> None:
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", CALL, 5, STOP)])
    with client:
        r = _chat(client, **body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert seen == []


def test_a_forced_call_comes_back_as_tool_calls(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", CALL, 9, STOP)])
    with client:
        r = _chat(client, tools=[WEATHER], tool_choice="required")
    schema = json.loads(seen[0].sampling_params["json_schema"])
    assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_a_call_cut_by_max_tokens_stays_content_with_finish_length(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", CALL[:20], 5, {"type": "length", "length": 5})])
    with client:
        choice = _chat(client, tools=[WEATHER], tool_choice="required").json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"] == {"role": "assistant", "content": CALL[:20], "reasoning_content": None, "tool_calls": None}


def test_a_streamed_forced_call_sends_its_name_then_its_arguments_as_they_come(tiny_model: str, tmp_path: Any) -> None:
    """OpenAI's stream of a call: its id and name (arguments "") once the name and the "parameters"
    key are read, then the arguments' pieces as their tokens arrive, adding up to the whole answer's."""
    pieces = ['[{"name": "get_wea', 'ther", "param', 'eters": {"city": "Os', 'lo"}}]']
    outs = [_out("r", p, 3 * (i + 1), STOP if i == 3 else None) for i, p in enumerate(pieces)]
    client, _ = _scripted_client(tiny_model, tmp_path, outs)
    with client:
        r = _chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "".join(pieces), 12, STOP)])
    with client:
        whole = _chat(client, tools=[WEATHER], tool_choice="required").json()["choices"][0]["message"]["tool_calls"]
    chunks = [e for e in _events(r) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d for d in deltas[1:] if "content" in d] == []  # the JSON text is never streamed as content
    (header,) = deltas[1]["tool_calls"]
    assert header == {"index": 0, "id": header["id"], "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert header["id"].startswith("call_")
    assert [d["tool_calls"] for d in deltas[2:-1]] == [[{"index": 0, "function": {"arguments": '{"city": "Os'}}],
                                                       [{"index": 0, "function": {"arguments": 'lo"}'}}]]  # fmt: skip
    assert whole[0]["function"]["arguments"] == '{"city": "Oslo"}' and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_results_go_back_to_the_template_with_the_calls_as_dicts(tiny_model: str, tmp_path: Any) -> None:
    """The second turn: the assistant's call and the tool's answer. A template that reads
    tool_calls gets the arguments as a dict (SGLang's); the tiny model's, which does not,
    refuses them rather than drop the call from the prompt."""
    turn = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                               "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    from transformers import AutoTokenizer

    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "Warm.", 2, STOP)])
    with client:
        r = _chat(client, messages=turn, tools=[WEATHER], tool_choice="none")
    assert r.status_code == 400 and "tool_calls is not used by this model's chat template" in r.text
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
        "[{{ c.function.name }}({{ c.function.arguments.city }})]{% endfor %};{% endfor %}"
    )
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", "Warm.", 2, STOP)], tokenizer=tokenizer)
    with client:
        r = _chat(client, messages=turn, tools=[WEATHER], tool_choice="none")
    assert r.status_code == 200, r.text
    assert seen[0].text == "user:Weather in Oslo?;assistant:[get_weather(Oslo)];tool:18C;"


# --------------------------------------------------------------------------- the engine: the schema forces a call
@pytest.mark.usefixtures("one_thread")
def test_the_constraint_makes_a_random_model_write_a_valid_call(tiny_model: str) -> None:
    pytest.importorskip("xgrammar")
    from minisgl import Engine

    schema = tool_call_constraint(_request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    with Engine(tiny_model, device="cpu", max_total_tokens=2048, constrained_json_disable_any_whitespace=True) as e:
        outs = e.generate(["Call something:"] * 4, {"json_schema": schema, "max_new_tokens": 128, "temperature": 1.0})
    calls: List[Any] = [parse_tool_calls(o["text"]) for o in outs]
    assert all(c is not None and len(c) == 1 for c in calls), [o["text"] for o in outs]
    for (call,) in calls:
        args = json.loads(call.function.arguments)
        assert (call.function.name, args) in (("get_time", {}), ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"}))


# --------------------------------------------------------------------------- what clients really send
def test_nested_models_defs_are_lifted_to_the_root_where_their_refs_resolve() -> None:
    """openai.pydantic_function_tool of a model with a nested model: "#/$defs/..." refs."""
    xgr = pytest.importorskip("xgrammar")
    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    nested = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"], "$defs": {"Place": place}}}}  # fmt: skip
    schema = json.loads(tool_call_constraint(_request(tools=[nested, TIME], tool_choice="required")))
    assert schema["$defs"] == {"Place": place}
    xgr.Grammar.from_json_schema(json.dumps(schema))  # (it raised "Cannot find field '$defs'" before)
    named = json.loads(tool_call_constraint(_request(tools=[nested], tool_choice={"type": "function", "function": {"name": "weather"}})))
    assert named["$defs"] == {"Place": place}
    other = json.loads(json.dumps(nested).replace('"weather"', '"other"').replace('"city"', '"zip"'))
    with pytest.raises(ValueError, match="Tool definition 'Place' has multiple schemas, which is not supported."):
        tool_call_constraint(_request(tools=[nested, other], tool_choice="required"))


def test_the_second_turn_takes_the_message_as_the_sdk_returns_it(tiny_model: str, tmp_path: Any) -> None:
    """`messages.append(resp.choices[0].message.model_dump())`: null refusal/audio/function_call/
    annotations, and calls with SGLang's index or the SDK's parsed_arguments; a tool message's
    name (OpenAI's cookbook sends it) is not the speaker name the template must show."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = (
        "{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}|{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }}]{% endfor %};{% endfor %}"
    )
    answer = {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None, "annotations": None,
              "tool_calls": [{"id": "call_1", "type": "function", "index": 0,
                              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}', "parsed_arguments": {"city": "Oslo"}}}]}  # fmt: skip
    turn = [{"role": "user", "content": "Weather?"}, answer, {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C"}]
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", CALL, 9, STOP)], tokenizer=tokenizer)
    with client:
        r = _chat(client, messages=turn, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.status_code == 200, r.text
    # only the named tool is shown (SGLang's), and the call went back into the prompt
    assert seen[0].text == "<get_weather>|user:Weather?;assistant:[get_weather];tool:18C;"


def test_call_arguments_keep_their_characters_and_only_a_stop_becomes_tool_calls(tiny_model: str, tmp_path: Any) -> None:
    (call,) = parse_tool_calls('[{"name": "get_weather", "parameters": {"city": "Zürich"}}]')
    assert call.function.arguments == '{"city": "Zürich"}'
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", CALL, 9, {"type": "length", "length": 9})])
    with client:
        choice = _chat(client, tools=[WEATHER], tool_choice="required").json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == CALL  # (complete, but cut: SGLang's rule)
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", CALL, 9, STOP)])
    with client:
        choice = _chat(client, tools=[WEATHER], tool_choice="required").json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None


def test_a_streamed_answer_cut_short_stays_content(tiny_model: str, tmp_path: Any) -> None:
    """Streamed too, only a stop becomes tool_calls: a whole array cut by max_tokens is content,
    sent at the end, finish "length". (The stream's limit, docs/server.md: the call's deltas went
    out as it came, before the cut said it was none: a client trusts them on "tool_calls" only.)"""
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", CALL[:10], 3), _out("r", CALL[10:], 9, {"type": "length", "length": 9})])
    with client:
        chunks = [c for c in _events(_chat(client, tools=[WEATHER], tool_choice="required", stream=True)) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert [d.get("content") for d in deltas[1:-1] if "content" in d] == [CALL]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert [(c["name"], c["arguments"]) for c in streamed_calls(tool_deltas(chunks))] == [("get_weather", '{"city": "Oslo"}')]


# --------------------------------------------------------------------------- tool_choice "auto", --tool-call-parser qwen25
QWEN_ANSWER = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'


def _qwen_client(tiny_model: str, tmp_path: Any, outs: List[Dict[str, Any]]) -> Any:
    from minisgl.server_args import ServerArgs, resolve_server_args

    args = resolve_server_args(ServerArgs(model_path=tiny_model, device="cpu", tool_call_parser="qwen25"))
    return _scripted_client(tiny_model, tmp_path, outs, server_args=args)


def test_the_qwen25_parser_splits_text_and_calls() -> None:
    from minisgl.entrypoints.openai.tool_calls import StreamedText, parse_qwen25

    names = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}  # (offered: schema by name)
    text, calls = parse_qwen25("\n" + QWEN_ANSWER, names)
    assert text == "\nLet me check." and [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Zürich"}')]
    for plain in ("No tools needed.", QWEN_ANSWER[:-5], QWEN_ANSWER + " and more", "<tool_call>\n{not json}\n</tool_call>"):
        assert parse_qwen25(plain, names) == (plain, None), plain
    # a function it was not offered is dropped (SGLang's rule), its markup too: with no call left,
    # the answer is the text before it
    rogue = QWEN_ANSWER.replace("get_weather", "delete_all_files")
    assert parse_qwen25(rogue, names) == ("Let me check.", None)
    splitter = StreamedText(names)
    assert splitter.feed(rogue) == "Let me check." and splitter.finish() == ("", None)
    _, calls = parse_qwen25(QWEN_ANSWER + "\n" + rogue[rogue.index("<tool_call>"):], names)
    assert [c.function.name for c in calls] == ["get_weather"]
    splitter, sent = StreamedText(names), ""
    for i in range(0, len(QWEN_ANSWER), 3):  # three characters at a time: "<tool_call>" arrives in pieces
        sent += splitter.feed(QWEN_ANSWER[i : i + 3])
    rest, calls = splitter.finish()
    assert sent == "Let me check." and rest == "" and calls[0].function.name == "get_weather"
    splitter = StreamedText(names)
    assert splitter.feed("a <tool") == "a" and splitter.feed("s> b") == " <tools> b" and splitter.finish() == ("", None)
    # arguments that are no object, of a function whose parameters are one (or unset): no call of it, dropped as a rogue one
    for arguments in ('"Zürich"', "[1]", "3"):
        bad = QWEN_ANSWER.replace('{"city": "Zürich"}', arguments)
        assert bad != QWEN_ANSWER and parse_qwen25(bad, names) == ("Let me check.", None), arguments
        assert parse_qwen25(bad, {"get_weather": {}}) == ("Let me check.", None), arguments


def test_a_streamed_auto_answer_sends_exactly_the_content_of_the_whole_one() -> None:
    """Blanks before a call: the whole answer's content drops them ("hello\n\n<tool_call>..." is
    "hello"), and a stream sent them as they came."""
    import random

    from minisgl.entrypoints.openai.tool_calls import StreamedText, parse_qwen25

    names, rng = {"get_weather": {}}, random.Random(0)
    call = QWEN_ANSWER[QWEN_ANSWER.index("<tool_call>") :]
    for answer in ["hello\n\n" + call, "\n" + call, " a \n " + call + "\n" + call, "hello\n\n<tool_call>\n{bad}\n</tool_call>",
                   "hi  " + call.replace("get_weather", "rm"), call + " and after", "text <tool", "plain \n"]:  # fmt: skip
        whole = parse_qwen25(answer, names)
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(answer)), k=min(5, len(answer) - 1)))
            splitter = StreamedText(names)
            sent = "".join(splitter.feed(answer[i:j]) for i, j in zip([0] + cuts, cuts + [len(answer)]))
            rest, calls = splitter.finish()
            assert (sent + rest, [c.function.name for c in calls or []]) == (whole[0], [c.function.name for c in whole[1] or []]), answer


def test_auto_needs_a_parser_and_with_one_returns_text_and_calls(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", QWEN_ANSWER, 20, STOP)])
    with client:
        r = _chat(client, tools=[WEATHER])
    assert r.status_code == 400 and "--tool-call-parser set to the model's format, one of: qwen25 (" in r.json()["error"]["message"]
    client, seen = _qwen_client(tiny_model, tmp_path, [_out("r", QWEN_ANSWER, 20, STOP)])
    with client:
        choice = _chat(client, tools=[WEATHER]).json()["choices"][0]
        plain = _chat(client, tools=[WEATHER], tool_choice="auto").json()["choices"][0]  # (same scripted answer)
    assert "json_schema" not in seen[0].sampling_params and seen[0].sampling_params["skip_special_tokens"] is False
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Zürich"}'} and plain["finish_reason"] == "tool_calls"
    client, _ = _qwen_client(tiny_model, tmp_path, [_out("r", "Just text.", 3, STOP)])
    with client:
        choice = _chat(client, tools=[WEATHER]).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "Just text." and choice["message"]["tool_calls"] is None


def test_a_strict_tool_under_auto_has_its_calls_constrained_by_a_structural_tag(tiny_model: str, tmp_path: Any) -> None:
    """SGLang's: free text, but from `<tool_call>` on, one of the tools' calls in Qwen's format, a
    strict tool's arguments matching its parameters (any JSON for one that is not strict)."""
    from transformers import AutoTokenizer

    from minisgl.constrained.xgrammar_backend import XGrammarGrammarBackend

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    client, seen = _qwen_client(tiny_model, tmp_path, [_out("r", QWEN_ANSWER.replace("Zürich", "Paris"), 20, STOP)])
    with client:
        choice = _chat(client, tools=[strict, TIME]).json()["choices"][0]
        plain = _chat(client, tools=[WEATHER, TIME])  # (no strict tool: nothing constrained)
    assert choice["finish_reason"] == "tool_calls" and plain.status_code == 200
    tag = json.loads(seen[0].sampling_params["structural_tag"])
    assert "structural_tag" not in seen[1].sampling_params
    assert tag["triggers"] == ["<tool_call>"] and [s["schema"] for s in tag["structures"]] == [WEATHER["function"]["parameters"], {"type": "object"}]
    backend = XGrammarGrammarBackend(AutoTokenizer.from_pretrained(tiny_model), 512, [0])
    try:
        future = backend.get_future(("structural_tag", seen[0].sampling_params["structural_tag"]))
        future.result(60)

        def accepts(text: str) -> bool:  # (a fresh matcher each time)
            return backend.get_grammar(future).matcher.accept_string(text)

        call = 'Sure. <tool_call>\n{"name":"get_weather", "arguments":{"city": "%s"}}\n</tool_call>'
        assert accepts(call % "Paris") and not accepts(call % "Rome")  # (its parameters: Paris or Oslo)
        assert accepts('<tool_call>\n{"name":"get_time", "arguments":{"any": [1, "JSON object"]}}\n</tool_call>')
        assert not accepts('<tool_call>\n{"name":"get_time", "arguments":[1]}\n</tool_call>')  # (arguments are an object)
        assert not accepts('<tool_call>\n{"name":"rm_rf", "arguments":{}}')  # only the tools offered
    finally:
        backend.shutdown()


def test_auto_streams_the_text_and_sends_the_calls_at_the_end(tiny_model: str, tmp_path: Any) -> None:
    pieces = [QWEN_ANSWER[:16], QWEN_ANSWER[16:40], QWEN_ANSWER[40:]]  # (the first ends inside "<tool_call>")
    outs = [_out("r", p, 5 * (i + 1), STOP if i == 2 else None) for i, p in enumerate(pieces)]
    client, _ = _qwen_client(tiny_model, tmp_path, outs)
    with client:
        chunks = [c for c in _events(_chat(client, tools=[WEATHER], stream=True)) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."  # (the non-streaming content)
    (call,) = next(d["tool_calls"] for d in deltas if "tool_calls" in d)
    assert call["function"]["name"] == "get_weather" and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any("<tool" in (d.get("content") or "") for d in deltas)
